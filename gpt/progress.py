"""What a training run shows and records: Log, one line and one metrics.jsonl record at each log and evaluation (on a
terminal under tqdm's bar, with its ETA); StepTimer, the clock behind the run's time and each log's ms/iter."""

import contextlib
import sys
import time

import torch

# how each figure of a record reads in its line (a figure not here, such as an lm-eval score: "name 0.1234")
FORMATS = dict(loss="loss {:.4f}", train_loss="train loss {:.4f}", val_loss="val loss {:.4f}", lr="lr {:.2e}",
               grad_norm="grad norm {:.3f}", first_step_s="first step {:.1f} s", ms_per_iter="{:.1f} ms/iter",
               tokens_per_sec="{:,.0f} tokens/s", mfu="MFU {:.1%}", peak_memory_gb="peak memory {:.1f} GB")


class Log:
    """What rank 0 prints and records; run_dir is None on the other ranks, which print and record nothing."""

    def __init__(self, run_dir, max_iters):
        self.run_dir, self.max_iters, self.bar = run_dir, max_iters, None

    def say(self, text):
        if self.bar:
            self.bar.write(text)  # above the bar
        elif self.run_dir:
            print(text, flush=True)  # so that a log file or pipe gets each line as it happens

    def record(self, record):
        """The record in metrics.jsonl (and wandb) and as one line; on a terminal the bar moves on to its iteration,
        from the first record on (so that its ETA counts what this run did)."""
        if not self.run_dir:
            return
        self.run_dir.log(record)
        figures = [FORMATS.get(key, key + " {:.4f}").format(value) for key, value in record.items()
                   if key not in ("iter", "time")]
        self.say(f"iter {record['iter']}: {', '.join(figures)}")
        if sys.stdout.isatty():
            if not self.bar:
                from tqdm import tqdm
                self.bar = tqdm(total=self.max_iters, initial=record["iter"], unit="it", dynamic_ncols=True)
            self.bar.update(record["iter"] - self.bar.n)

    def close(self):
        if self.bar:
            self.bar.close()


class StepTimer:
    """The run's wall-clock time (summed over resumes), and at each log the speed since the last one (MFU where
    peak_tokens_per_sec, the rate at the hardware's peak FLOP/s, is known), without evaluations and checkpoint writes
    (paused) or the first step: it compiles and warms up, so it is timed alone and logged once."""

    def __init__(self, device_type, tokens_per_iter, elapsed_before, peak_tokens_per_sec=None):
        self.device_type, self.tokens_per_iter, self.peak = device_type, tokens_per_iter, peak_tokens_per_sec
        self.elapsed_before, self.timed_steps, self.stepped_once, self.due = elapsed_before, 0, False, {}
        self.run_start = self.interval_start = time.perf_counter()

    def elapsed(self):
        return self.elapsed_before + time.perf_counter() - self.run_start

    @contextlib.contextmanager
    def paused(self):
        start = synced_time(self.device_type)
        yield
        self.interval_start += time.perf_counter() - start

    def stepped(self):
        """One more step; the first is timed alone (once the GPU has done it) and left out of ms/iter."""
        if self.stepped_once:
            self.timed_steps += 1
            return
        now = synced_time(self.device_type)
        self.due, self.interval_start, self.stepped_once = dict(first_step_s=now - self.interval_start), now, True

    def figures(self):
        """The speed figures since the last log (and the first step's, if it was in it); a new interval starts."""
        figures, self.due = self.due, {}
        if self.timed_steps:
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
    if device_type == "cuda":
        torch.cuda.synchronize()
    elif device_type == "mps":
        torch.mps.synchronize()
    return time.perf_counter()
