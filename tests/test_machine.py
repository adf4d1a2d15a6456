"""machine.py: a run on a machine busy with other work takes only the cores left free and says so once, in one
line; on a quiet machine it keeps torch's threads and says nothing. The load here is real: processes spinning on
every core for at most 20 s."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from gpt.machine import SharedCpu, busy_cores, cpu_counters, threads_for
from test_train import TINY, TRAIN, workdir  # noqa: F401 (workdir is a fixture)

SPIN = "import time\nend = time.time() + 20\nwhile time.time() < end:\n    pass\n"  # bounded, whatever happens


@contextlib.contextmanager
def every_core_busy():
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(os.cpu_count())]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("busy, expected", [(None, 8), (0.0, 8), (0.3, 8), (1.0, 7), (3.4, 5), (7.9, 1), (8.0, 1)])
def test_a_run_takes_the_cores_other_processes_leave_free(busy, expected):
    assert threads_for(busy, 8, 8) == expected
    assert threads_for(busy, 4, 8) == min(expected, 4)  # never more than torch's own count


def test_the_counters_leave_this_process_out():
    """(all, idle, own) seconds: 2 cores for 10 s, 12 s idle, 5 s of them this process's: others kept 0.6 busy."""
    assert busy_cores((100.0, 50.0, 1.0), (120.0, 62.0, 6.0), cores=2) == pytest.approx(0.3)
    assert busy_cores(None, (1.0, 1.0, 1.0), cores=2) is None


@pytest.fixture
def two_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def counters_from(readings):
    """A counters function giving these (all, idle, own) readings in turn: a machine whose load the test sets."""
    readings = iter(readings)
    return lambda: next(readings)


def test_the_run_follows_the_load_and_says_so_once(two_threads):
    # 2 cores: quiet at start; a span too short to read (a few ticks, all busy: logs milliseconds apart); then
    # another process takes a whole core, a second one joins, then both stop
    cpu = SharedCpu(cores=2, counters=counters_from([(0, 0, 0), (2, 2, 0), (2.04, 2, 0), (4, 3, 0), (6, 3, 0),
                                                     (8, 5, 0), (10, 7, 0)]))
    assert cpu.check() is None and torch.get_num_threads() == 2  # quiet
    assert cpu.check() is None and torch.get_num_threads() == 2  # 0.02 s: not read
    note = cpu.check()  # others: 1 of the 2 seconds of CPU
    assert torch.get_num_threads() == 1 and "keep 1.0 of its 2 cores busy" in note and "takes 1 thread" in note
    assert cpu.check() is None and torch.get_num_threads() == 1  # busier still: said already
    assert cpu.check() is None and torch.get_num_threads() == 2  # quiet again: all the threads back
    assert cpu.check() is None and torch.get_num_threads() == 2


def test_what_the_user_chose_is_kept(two_threads, monkeypatch):
    busy = counters_from([(0, 0, 0), (2, 0, 0), (4, 0, 0)])
    cpu = SharedCpu(requested=1, cores=2, counters=busy)  # --threads=1
    assert cpu.check() is None and torch.get_num_threads() == 1
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    cpu = SharedCpu(cores=2, counters=busy)
    assert cpu.check() is None and torch.get_num_threads() == 2


# The two tests below create load and assert only what that load makes true, whatever else the machine runs (a
# test suite beside them, a build): that a quiet machine reads as quiet and says nothing is shown with counters the
# tests set (test_the_run_follows_the_load_and_says_so_once), since no test can make a machine quiet.


def test_the_counters_see_a_real_load():
    before = cpu_counters()
    with every_core_busy():
        subprocess.run(["sleep", "0.5"])
        busy = busy_cores(before, cpu_counters(), os.cpu_count())
    assert busy > os.cpu_count() - 0.5, busy


def test_train_says_once_that_the_machine_is_busy(workdir, tmp_path):  # noqa: F811
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torch's own thread count
    command = [sys.executable, TRAIN, *TINY, "--max_iters=4", "--eval_interval=4", "--overwrite=True"]
    with every_core_busy():
        busy = subprocess.run([*command, f"--out_dir={tmp_path / 'busy'}"], cwd=workdir, env=env,
                              capture_output=True, text=True, timeout=120)
    assert busy.returncode == 0, busy.stderr
    lines = [line for line in busy.stdout.splitlines() if line.startswith("this machine is")]
    if os.cpu_count() > 1:
        assert len(lines) == 1 and "busier than its cores" in lines[0] and "takes 1 thread" in lines[0], busy.stdout
