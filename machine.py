"""
How many CPU threads a run should use on a machine shared with other work.

torch starts one thread per core, and OpenMP's waiting threads spin: two such processes on the same cores keep
every core's threads spinning against each other, and config/small.py took 753 s instead of 108 s beside one
other busy process. A run that takes only the cores other processes leave free runs at the speed of that share
(bench/bench_busy.py measures it; bench/RESULTS.md has the table). So, before it starts, a run looks at how busy
the machine is and, when other processes keep cores busy, uses fewer threads and says so in one line.

    threads, note = choose_threads(requested=0)   # 0: decide from the cores actually free
"""

import os
import time

LOOK_SECONDS = 0.25  # how long the machine is watched at start (the CPU counters tick 100 times a second)
BUSY_CORES = 0.5  # other processes' use, in cores, from which a run takes fewer threads


def busy_cores(seconds=LOOK_SECONDS):
    """How many cores other processes keep busy, from the kernel's CPU counters (/proc/stat) over `seconds` in which
    this process sleeps; None where there are no such counters (macOS, Windows)."""
    def counters():  # (all time, idle time) summed over the cores, in clock ticks
        with open("/proc/stat") as f:
            ticks = [int(field) for field in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        return sum(ticks), ticks[3] + ticks[4]

    try:
        total_before, idle_before = counters()
        time.sleep(seconds)
        total_after, idle_after = counters()
    except (OSError, ValueError, IndexError):
        return None
    total = total_after - total_before
    return 0.0 if total <= 0 else (total - (idle_after - idle_before)) / total * os.cpu_count()


def choose_threads(requested, current, look=busy_cores, cores=None):
    """(threads, note): requested > 0 as given; 0 (auto): the current count (torch's: one per core, or
    OMP_NUM_THREADS) less the cores other processes keep busy, at least 1, never more than current. note: the one
    line to print when the machine is busy, else None. look: how busy it is (busy_cores); cores: the machine's."""
    if requested > 0:
        return requested, None
    if current <= 1 or "OMP_NUM_THREADS" in os.environ:  # nothing to take away, or the user chose
        return current, None
    busy = look()
    if busy is None or busy < BUSY_CORES:
        return current, None
    cores = cores or os.cpu_count()
    threads = max(1, min(current, round(cores - busy)))
    slower = "busier than its cores" if busy > cores - 1 else "busy"
    return threads, (f"this machine is {slower}: other processes keep {busy:.1f} of its {cores} cores busy, so this "
                     f"run takes {threads} thread{'s' * (threads > 1)} (not {current}) and is slower than on a quiet "
                     f"machine; stop them for full speed, or pass --threads=N to choose")
