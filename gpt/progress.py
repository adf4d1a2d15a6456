"""What a training run prints and records: Log, its lines and metrics.jsonl records; StepTimer, its clock and speed."""

import contextlib
import sys
import time

import torch


class Log:
    """What rank 0 prints and logs: evaluations, and every log_interval steps loss, lr and speed (a bar on a tty)."""

    def __init__(self, max_iters, master, iter_num, mfu):
        self.master, self.mfu, self.logged_iter, self.bar = master, mfu, iter_num, None
        if master and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=max_iters, initial=iter_num, unit="it", dynamic_ncols=True)

    def say(self, text):
        if self.master and self.bar:
            self.bar.write(text)
        elif self.master:
            print(text, flush=True)  # so that a log file or pipe gets each line as it happens

    def steps_since_log(self, iter_num):
        return iter_num - self.logged_iter

    def evaluation(self, run_dir, iter_num, elapsed, losses, scores):
        self.say(f"iter {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}" +
                 "".join(f", {name} {value:.4f}" for name, value in scores.items()))
        if self.master:
            run_dir.log(dict(iter=iter_num, time=elapsed, train_loss=losses["train"], val_loss=losses["val"], **scores))

    def progress(self, run_dir, record, busy_note):
        self.logged_iter = record["iter"]
        if self.mfu and "tokens_per_sec" in record:
            record["mfu"] = self.mfu(record["tokens_per_sec"])
        if not self.master:
            return
        if busy_note:
            self.say(busy_note)
        run_dir.log(record)
        line = f"loss {record['loss']:.4f}, lr {record['lr']:.2e}, grad norm {record['grad_norm']:.3f}"
        if "first_step_s" in record:
            line += f", first step {record['first_step_s']:.1f} s"
        if "ms_per_iter" in record:
            line += f", {record['ms_per_iter']:.1f} ms/iter, {record['tokens_per_sec']:,.0f} tokens/s"
        if "mfu" in record:
            line += f", MFU {100 * record['mfu']:.1f}%"
        if "peak_memory_gb" in record:
            line += f", peak memory {record['peak_memory_gb']:.1f} GB"
        if self.bar:
            self.bar.set_postfix_str(line)
        else:
            self.say(f"iter {record['iter']}: {line}")

    def stepped(self):
        if self.bar:
            self.bar.update(1)

    def close(self):
        if self.bar:
            self.bar.close()


class StepTimer:
    """The run's wall-clock time (summed over resumes) and each log's ms/iter, without evaluation, checkpoint writes or
    the first step (it compiles and warms up): that is timed alone and logged once, with the graphs it compiled."""

    def __init__(self, device_type, compiled, tokens_per_iter, elapsed_before):
        self.device_type, self.compiled, self.tokens_per_iter = device_type, compiled, tokens_per_iter
        self.run_start, self.elapsed_before = time.perf_counter(), elapsed_before
        self.first_step_s, self.graphs, self.first_in_interval = None, None, False
        self.timed_steps, self.interval_start = 0, time.perf_counter()

    def elapsed(self):
        return self.elapsed_before + time.perf_counter() - self.run_start

    @contextlib.contextmanager
    def paused(self):
        start = synced_time(self.device_type)
        yield
        self.interval_start += time.perf_counter() - start

    @contextlib.contextmanager
    def step(self, log):
        first = self.first_step_s is None
        graphs_before = compiled_graphs() if first else 0
        yield
        if not first:
            self.timed_steps += 1
            return
        self.first_step_s = synced_time(self.device_type) - self.interval_start
        self.interval_start += self.first_step_s
        self.first_in_interval = True
        if self.compiled:
            self.graphs = compiled_graphs() - graphs_before
            took = f"first step: {self.first_step_s:.1f} s"
            log.say(f"{took}, torch.compile included ({self.graphs} graphs); ms/iter leaves it out" if self.graphs else
                    f"{took}; torch.compile was on but compiled no graph for the training step: it runs eagerly")

    def figures(self):
        """Speed figures since the last log (and the first step's, if it was among them); a new interval starts."""
        figures = {}
        if self.first_in_interval:
            figures["first_step_s"] = self.first_step_s
            if self.compiled:
                figures["compiled_graphs"] = self.graphs
        if self.timed_steps:
            ms_per_iter = 1000 * (time.perf_counter() - self.interval_start) / self.timed_steps
            figures.update(ms_per_iter=ms_per_iter, tokens_per_sec=self.tokens_per_iter * 1000 / ms_per_iter)
        if self.device_type == "cuda":
            figures["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9  # since the run started
        self.timed_steps, self.first_in_interval, self.interval_start = 0, False, time.perf_counter()
        return figures


def synced_time(device_type):
    """time.perf_counter() once the GPU has done the work queued so far (the CPU runs ahead of it)."""
    if device_type == "cuda":
        torch.cuda.synchronize()
    elif device_type == "mps":
        torch.mps.synchronize()
    return time.perf_counter()


def compiled_graphs():
    """The graphs torch.compile has compiled in this process so far (Dynamo's own count)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]
