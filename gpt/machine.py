"""
How many CPU threads a run should use on a machine shared with other work.

torch starts one thread per core, and OpenMP's waiting threads spin: two such processes on the same cores keep
every core's threads spinning against each other (config/small.py beside a second copy of itself: 4.3x slower
per iteration with torch's defaults, 1.7x with one thread each; bench/bench_busy.py, bench/RESULTS.md). A run that
takes only the cores other processes leave free runs at the speed of that share. So a training run looks at how
busy the machine is before it starts and again at every log, takes the cores left free, and says once, in one
line, that the machine is busy and what to do.

    cpu = SharedCpu(requested=0)   # 0: decide from the cores actually free; N: exactly N threads
    note = cpu.check()             # at every log: the line to print the first time the machine is busy
"""

import os
import time

import torch

LOOK_SECONDS = 0.25  # how long the machine is watched before a run starts (the counters tick 100 times a second)
CHECK_SECONDS = 1.0  # the shortest span a later check reads: over a few ticks, the counters say little
BUSY_CORES = 0.5  # other processes' use, in cores, from which a run takes fewer threads


def cpu_counters():
    """(all CPU time, idle CPU time) of the machine summed over its cores, from the kernel's counters (/proc/stat),
    and this process's own CPU time, all in seconds; None where there are no such counters (macOS, Windows)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(field) for field in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    per_second = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return sum(ticks) / per_second, (ticks[3] + ticks[4]) / per_second, own.user + own.system


def busy_cores(before, after, cores):
    """How many cores other processes kept busy between two cpu_counters() readings (this process's own time
    taken out); None without counters."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    busy = (after[0] - before[0]) - (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, busy / (after[0] - before[0]) * cores)


def threads_for(busy, most, cores):
    """The threads a run takes when other processes keep `busy` cores busy: the cores they leave free, at least 1,
    at most `most` (torch's own count: one per core, or OMP_NUM_THREADS)."""
    if busy is None or busy < BUSY_CORES:
        return most
    return max(1, min(most, round(cores - busy)))


class SharedCpu:
    """The run's CPU threads (torch.set_num_threads), chosen before it starts and again at each check() from how
    busy other processes keep the machine. requested > 0, or OMP_NUM_THREADS set: that many, never changed."""

    def __init__(self, requested=0, cores=None, counters=cpu_counters):
        self.cores, self.counters, self.said = cores or os.cpu_count(), counters, False
        self.fixed = requested > 0 or "OMP_NUM_THREADS" in os.environ
        if requested > 0:
            torch.set_num_threads(requested)
        self.most = torch.get_num_threads()
        self.last = None if self.fixed or self.most <= 1 else self.counters()  # one thread: nothing to take away
        self.span = LOOK_SECONDS
        if self.last is not None:
            time.sleep(LOOK_SECONDS)  # while this process sleeps, what the counters see is other processes' work

    def check(self):
        """Take the cores left free since the last check; the one line to print the first time the machine is busy
        (what is happening and what the user can do), else None."""
        if self.last is None:
            return None
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
                "machine; stop them for full speed, or pass --threads=N to choose")
