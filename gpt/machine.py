"""The CPU threads a command takes on a machine shared with other work: the cores others leave free (2.5x-39x faster
than torch's thread per core spinning against them), first looked at as the model loads, then followed; said once."""

import contextlib
import os
import time

import torch

LOOK_SECONDS, CHECK_SECONDS = 0.1, 1.0  # the shortest spans read: the first look, then later ones (100 ticks a second)
BUSY_CORES = 0.5  # other processes' use, in cores, from which a run takes fewer threads


def cpu_counters():
    """(all, idle) CPU seconds of the machine (/proc/stat's first 8 fields) and this process's; None without it."""
    with contextlib.suppress(OSError, ValueError), open("/proc/stat") as f:
        ticks = [int(field) / os.sysconf("SC_CLK_TCK") for field in f.readline().split()[1:9]]
        return sum(ticks), ticks[3] + ticks[4], sum(os.times()[:2])


class SharedCpu:
    def __init__(self, device="cpu", threads=None):  # threads: --threads (0: the cores left free; None: none)
        torch.set_num_threads(threads or torch.get_num_threads())  # the user's count, kept (else a no-op)
        self.most, self.cores, self.said = torch.get_num_threads(), os.cpu_count(), False
        self.remedy = "stop them or " + ("set OMP_NUM_THREADS=N" if threads is None else "pass --threads=N")
        fixed = threads or "OMP_NUM_THREADS" in os.environ or self.most <= 1 or torch.device(device).type != "cpu"
        self.last, self.span, self.look_ends = None if fixed else cpu_counters(), LOOK_SECONDS, time.monotonic()

    def check(self):
        """Threads set to the cores other processes leave free; a line the first time that is fewer, else None."""
        if self.last is None:
            return None
        time.sleep(max(0.0, self.look_ends + LOOK_SECONDS - time.monotonic()))  # the first look's end, once
        now = cpu_counters() or self.last
        total, idle, own = (b - a for a, b in zip(self.last, now))
        if total / self.cores < 0.9 * self.span:  # a span too short to read (or no counters now): wait
            return None
        busy = max(0.0, total - idle - own) / total * self.cores  # the cores other processes kept busy
        self.last, self.span, self.look_ends = now, CHECK_SECONDS, float("-inf")
        threads = self.most if busy < BUSY_CORES else max(1, min(self.most, round(self.cores - busy)))
        torch.set_num_threads(threads)  # a no-op where the count is unchanged
        if threads < self.most and not self.said:
            self.said, crowded = True, "busier than its cores" if busy > self.cores - BUSY_CORES else "busy"
            return (f"this machine is {crowded}: other processes keep {busy:.1f} of its {self.cores} cores busy, so "
                    f"this run takes {threads} thread{'s' * (threads > 1)} (not {self.most}); {self.remedy}")
