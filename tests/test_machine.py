"""machine.py: a run on a machine busy with other work takes only the cores left free and says so in one line;
on a quiet machine it keeps torch's threads and says nothing. The load here is real: processes spinning on every
core for at most 20 s."""

import contextlib
import os
import subprocess
import sys

import pytest

from machine import busy_cores, choose_threads
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


@pytest.mark.parametrize("busy, expected", [(0.0, 8), (0.3, 8), (1.0, 7), (3.4, 5), (7.9, 1), (8.0, 1)])
def test_a_run_takes_the_cores_other_processes_leave_free(monkeypatch, busy, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads, note = choose_threads(0, 8, look=lambda: busy, cores=8)
    assert threads == expected
    assert (note is None) == (busy < 0.5)  # a core or more in other hands is worth a line, a fraction is not
    if note:
        assert f"keep {busy:.1f} of its 8 cores busy" in note and f"takes {expected} thread" in note


def test_what_the_user_chose_is_kept(monkeypatch):
    assert choose_threads(3, 8, look=lambda: 8.0, cores=8) == (3, None)  # --threads=3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_threads(0, 2, look=lambda: 8.0, cores=8) == (2, None)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert choose_threads(0, 1, look=lambda: 8.0, cores=8) == (1, None)  # one thread: nothing to take away


def test_busy_cores_sees_a_real_load():
    quiet = busy_cores(0.5)
    with every_core_busy():
        busy = busy_cores(0.5)
    assert quiet < 0.5 and busy > os.cpu_count() - 0.5, (quiet, busy)


def test_train_says_once_that_the_machine_is_busy_and_only_then(workdir, tmp_path):  # noqa: F811
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torch's own thread count
    command = [sys.executable, TRAIN, *TINY, "--max_iters=2", "--eval_interval=2", "--overwrite=True"]
    quiet = subprocess.run([*command, f"--out_dir={tmp_path / 'quiet'}"], cwd=workdir, env=env, capture_output=True,
                           text=True, timeout=120)
    with every_core_busy():
        busy = subprocess.run([*command, f"--out_dir={tmp_path / 'busy'}"], cwd=workdir, env=env,
                              capture_output=True, text=True, timeout=120)
    assert quiet.returncode == busy.returncode == 0, quiet.stderr + busy.stderr
    assert "this machine is" not in quiet.stdout
    lines = [line for line in busy.stdout.splitlines() if line.startswith("this machine is")]
    if os.cpu_count() > 1:
        assert len(lines) == 1 and "busier than its cores" in lines[0] and "takes 1 thread" in lines[0], busy.stdout
