"""What a training run shows: a line per log and evaluation (on a terminal above tqdm's bar and its ETA), and the
clock behind each log's ms/iter, which leaves out evaluations, checkpoint writes and the first step."""

import contextlib
import sys
import time

import torch

# how each figure of a record reads in its line (a figure not here, such as an lm-eval score: "name 0.1234")
FORMATS = dict(loss="loss {:.4f}", train_loss="train loss {:.4f}", val_loss="val loss {:.4f}", lr="lr {:.2e}",
               grad_norm="grad norm {:.3f}", first_step_s="first step {:.1f} s", ms_per_iter="{:.1f} ms/iter",
               tokens_per_sec="{:,.0f} tokens/s", mfu="MFU {:.1%}", peak_memory_gb="peak memory {:.1f} GB")


class Log:
    def __init__(self, run_dir, max_iters):  # run_dir: None on ranks other than 0, which print and record nothing
        self.run_dir, self.max_iters, self.bar = run_dir, max_iters, None

    def say(self, text):
        if self.bar:
            self.bar.write(text)  # above the bar
        elif self.run_dir:
            print(text, flush=True)  # so that a log file or pipe gets each line as it happens

    def record(self, record):
        if not self.run_dir:
            return
        self.run_dir.log(record)
        figures = [FORMATS.get(key, key + " {:.4f}").format(value) for key, value in record.items()
                   if key not in ("iter", "time")]
        self.say(f"iter {record['iter']}: {', '.join(figures)}")
        if sys.stdout.isatty():
            if not self.bar:  # started at the first record, so that its ETA counts only this run's steps
                from tqdm import tqdm
                self.bar = tqdm(total=self.max_iters, initial=record["iter"], unit="it", dynamic_ncols=True)
            self.bar.update(record["iter"] - self.bar.n)

    def close(self):
        if self.bar:
            self.bar.close()


class StepTimer:
    """The run's wall-clock time (summed over resumes), and each log's speed (MFU where the tokens/s at the hardware's
    peak FLOP/s is known). The first step compiles and warms up: it is timed alone and logged once."""

    def __init__(self, device_type, tokens_per_iter, elapsed_before, peak_tokens_per_sec=None):
        self.device_type, self.tokens_per_iter, self.peak = device_type, tokens_per_iter, peak_tokens_per_sec
        self.elapsed_before, self.timed_steps, self.due = elapsed_before, -1, {}  # -1: the first step is to come
        self.run_start = self.interval_start = time.perf_counter()

    def elapsed(self):
        return self.elapsed_before + time.perf_counter() - self.run_start

    @contextlib.contextmanager
    def paused(self):
        start = synced_time(self.device_type)
        yield
        self.interval_start += time.perf_counter() - start

    def stepped(self):
        self.timed_steps += 1
        if self.timed_steps == 0:  # the first step, once the GPU has done it
            now = synced_time(self.device_type)
            self.due, self.interval_start = dict(first_step_s=now - self.interval_start), now

    def figures(self):
        """The figures since the last log (and the first step's, if it was in it); a new interval starts."""
        figures, self.due = self.due, {}
        if self.timed_steps > 0:
            ms_per_iter = 1000 * (time.perf_counter() - self.interval_start) / self.timed_steps
            figures.update(ms_per_iter=ms_per_iter, tokens_per_sec=self.tokens_per_iter * 1000 / ms_per_iter)
            if self.peak:
                figures["mfu"] = figures["tokens_per_sec"] / self.peak
        if self.device_type == "cuda":
            figures["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9  # since the run started
        self.timed_steps, self.interval_start = 0, time.perf_counter()
        return figures


def synced_time(device_type):
    """time.perf_counter() once the GPU has done the work queued so far (the CPU runs ahead of it)."""
    if device_type in ("cuda", "mps"):
        getattr(torch, device_type).synchronize()
    return time.perf_counter()
