"""How many CPU threads a command should use on a machine shared with other work.

torch starts one thread per core, and OpenMP's waiting threads spin: two such processes on the same cores spin against
each other, far slower than each taking only the cores the other leaves free (bench/RESULTS.md). So every command that
computes on the CPU (train.py, sample.py, eval.py, attention.py) takes the cores left free, says so once, and
(train.py) looks again at every log:

    cpu = shared_cpu(device, threads)   # before loading the model, which overlaps the look at the machine
    note = cpu and cpu.check()          # after: torch's threads set; the line to print, or None
"""

import os
import time

import torch

LOOK_SECONDS = 0.1  # the shortest first look (the counters tick 100 times a second); as good as 0.25 s (bench_busy.py)
CHECK_SECONDS = 1.0  # the shortest span a later check reads: over a few ticks, the counters say little
BUSY_CORES = 0.5  # other processes' use, in cores, from which a run takes fewer threads


def cpu_counters():
    """(all, idle) CPU seconds of the machine, summed over its cores (/proc/stat), and this process's own CPU seconds;
    None where there are no such counters (macOS, Windows)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(field) for field in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    per_second = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return sum(ticks) / per_second, (ticks[3] + ticks[4]) / per_second, own.user + own.system


def busy_cores(before, after, cores):
    """Cores other processes kept busy between two cpu_counters() readings (this process's taken out), or None."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    busy = (after[0] - before[0]) - (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, busy / (after[0] - before[0]) * cores)


def threads_for(busy, most, cores):
    """The threads to take while others keep `busy` cores busy: those left free, at least 1, at most `most`."""
    return most if busy is None or busy < BUSY_CORES else max(1, min(most, round(cores - busy)))


class SharedCpu:
    """The run's CPU threads, chosen at each check(); requested > 0, or OMP_NUM_THREADS set: that many, never changed.
    The first look runs from here to the first check(), so work done meanwhile (loading the model) overlaps it."""

    def __init__(self, requested=0, cores=None, counters=None, choose="pass --threads=N", look=LOOK_SECONDS):
        self.cores, self.counters, self.said = cores or os.cpu_count(), counters or cpu_counters, False
        self.choose = choose  # how the note says to pick a count
        self.fixed = requested > 0 or "OMP_NUM_THREADS" in os.environ
        if requested > 0:
            torch.set_num_threads(requested)
        self.most = torch.get_num_threads()
        self.last = None if self.fixed or self.most <= 1 else self.counters()  # one thread: nothing to take away
        self.span, self.look_ends = look, time.monotonic() + look  # the first check reads no sooner

    def check(self):
        """Take the cores left free; the line to print the first time the machine is busy, else None."""
        if self.last is None:
            return None
        if self.look_ends is not None:  # the first look: `look` seconds at least, whatever ran meanwhile
            time.sleep(max(0.0, self.look_ends - time.monotonic()))
            self.look_ends = None
        now = self.counters()
        if now is None or (now[0] - self.last[0]) / self.cores < 0.9 * self.span:
            return None  # too short a span to read (logs a few ms apart): wait for a longer one
        busy, self.last, self.span = busy_cores(self.last, now, self.cores), now, CHECK_SECONDS
        threads = threads_for(busy, self.most, self.cores)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        if threads == self.most or self.said:
            return None
        self.said = True
        crowded = "busier than its cores" if busy > self.cores - BUSY_CORES else "busy"
        return (f"this machine is {crowded}: other processes keep {busy:.1f} of its {self.cores} cores busy, so this "
                f"run takes {threads} thread{'s' * (threads > 1)} (not {self.most}) and is slower than on a quiet "
                f"machine; stop them for full speed, or {self.choose} to choose")


def shared_cpu(device, threads=None):
    """A command's SharedCpu where it computes on the CPU or threads asks for a count, else None. threads: its
    --threads (0: the cores left free), or None where it has none (the note then says OMP_NUM_THREADS chooses)."""
    if torch.device(device).type != "cpu" and not threads:
        return None
    return SharedCpu(threads or 0, choose="set OMP_NUM_THREADS=N" if threads is None else "pass --threads=N")
