"""machine.py: a run on a machine busy with other work takes only the cores left free and says so once, in one
line; on a quiet machine it keeps torch's threads and says nothing. So does every command that computes on the CPU
(sample.py, eval.py, attention.py), its look at the machine overlapping its model's load. The load is set by the
tests: counters they fake, or, in the two tests that say so, processes spinning on every core for at most 20 s."""

import contextlib
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict

import pytest
import torch

import attention
import eval as evaluate
import sample
from gpt import machine
from gpt.machine import SharedCpu
from model import GPT, GPTConfig
from test_train import train_main, workdir  # noqa: F401 (workdir is a fixture)

# bounded, whatever happens; it says when it spins
SPIN = "import time\nprint(flush=True)\nend = time.time() + 20\nwhile time.time() < end:\n    pass\n"


@contextlib.contextmanager
def every_core_busy():
    """A process spinning on each core, every one of them spinning already."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE) for _ in range(os.cpu_count())]
    try:
        for proc in procs:
            proc.stdout.readline()
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


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


def machine_of(monkeypatch, cores, readings):
    """This process on a machine of `cores` cores whose counters read `readings`, (all, idle, own) in turn."""
    monkeypatch.setattr(machine, "cpu_counters", counters_from(readings))
    monkeypatch.setattr(machine.os, "cpu_count", lambda: cores)


@pytest.mark.parametrize("busy, expected", [(0.0, 8), (0.3, 8), (1.0, 7), (3.4, 5), (7.9, 1), (8.0, 1)])
def test_a_run_takes_the_cores_other_processes_leave_free(two_threads, monkeypatch, busy, expected):
    """8 cores over a 1 s look, `busy` of them kept busy by others: the threads left free, never more than torch's
    own count."""
    for most in (8, 4):
        torch.set_num_threads(most)
        machine_of(monkeypatch, 8, [(0.0, 0.0, 0.0), (8.0, 8.0 - busy, 0.0)])
        note = SharedCpu().check()
        assert torch.get_num_threads() == min(expected, most) and (note is None) == (min(expected, most) == most)


def test_the_counters_leave_this_process_out(two_threads, monkeypatch):
    """(all, idle, own) seconds: 2 cores for 10 s, 8 s idle, 5 s of them this process's: others kept 0.7 busy."""
    machine_of(monkeypatch, 2, [(100.0, 50.0, 1.0), (120.0, 58.0, 6.0)])
    assert "other processes keep 0.7 of its 2 cores busy" in SharedCpu().check()


def test_without_counters_a_run_keeps_its_threads_and_says_nothing(two_threads, monkeypatch):
    """macOS and Windows have no /proc/stat: nothing to read, nothing taken away."""
    monkeypatch.setattr(machine, "cpu_counters", lambda: None)
    assert SharedCpu().check() is None and torch.get_num_threads() == 2


def test_the_run_follows_the_load_and_says_so_once(two_threads, monkeypatch):
    # 2 cores: quiet at start; a span too short to read (a few ticks, all busy: logs milliseconds apart); then
    # another process takes a whole core, a second one joins, then both stop
    machine_of(monkeypatch, 2, [(0, 0, 0), (2, 2, 0), (2.04, 2, 0), (4, 3, 0), (6, 3, 0), (8, 5, 0), (10, 7, 0)])
    cpu = SharedCpu()
    assert cpu.check() is None and torch.get_num_threads() == 2  # quiet
    assert cpu.check() is None and torch.get_num_threads() == 2  # 0.02 s: not read
    note = cpu.check()  # others: 1 of the 2 seconds of CPU
    assert torch.get_num_threads() == 1 and "keep 1.0 of its 2 cores busy" in note and "takes 1 thread" in note
    assert cpu.check() is None and torch.get_num_threads() == 1  # busier still: said already
    assert cpu.check() is None and torch.get_num_threads() == 2  # quiet again: all the threads back
    assert cpu.check() is None and torch.get_num_threads() == 2


def test_the_first_look_overlaps_what_the_process_does_meanwhile(two_threads, monkeypatch):
    """The look at the machine starts with SharedCpu and the first check() ends it, waiting only for what is left
    of it: a command that loads its model meanwhile (here: sleeps as long as the look) starts no later for it."""
    monkeypatch.setattr(machine, "LOOK_SECONDS", 0.2)
    quiet = [(0, 0, 0), (2, 2, 0)]
    machine_of(monkeypatch, 2, quiet)
    cpu = SharedCpu()
    time.sleep(0.2)  # the model loading
    start = time.monotonic()
    assert cpu.check() is None and time.monotonic() - start < 0.05
    machine_of(monkeypatch, 2, quiet)
    cpu = SharedCpu()
    start = time.monotonic()
    assert cpu.check() is None and time.monotonic() - start > 0.15  # nothing ran meanwhile: the look takes its time


def test_a_command_shares_the_cpu_only_where_it_computes_on_it(two_threads):
    assert SharedCpu("cuda:0").last is None and SharedCpu("mps").last is None  # no look: check() says nothing
    assert SharedCpu("cpu").last is not None
    assert SharedCpu("cpu").remedy == "stop them or set OMP_NUM_THREADS=N"  # a command without --threads
    assert SharedCpu("cpu", threads=0).remedy == "stop them or pass --threads=N"
    assert SharedCpu("cuda", threads=2).last is None and torch.get_num_threads() == 2  # the threads it asks for


def test_what_the_user_chose_is_kept(two_threads, monkeypatch):
    machine_of(monkeypatch, 2, [(0, 0, 0), (2, 0, 0), (4, 0, 0)])  # every core busy
    cpu = SharedCpu(threads=1)  # --threads=1
    assert cpu.check() is None and torch.get_num_threads() == 1
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    cpu = SharedCpu()
    assert cpu.check() is None and torch.get_num_threads() == 2


# ----------------------------------------------------------------------------------------------------
# Every command that computes on the CPU shares it: in this process, the machine's counters faked


TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A folder with a tiny random character model's ckpt.pt (what train.py writes, in the fields the commands read)
    and a text to score."""
    root = tmp_path_factory.mktemp("tiny_run")
    chars = sorted(set(TEXT))
    meta = {"tokenizer": "char", "vocab_size": len(chars), "eot_token": None, "chars": chars}
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=16))
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config), "meta": meta}, root / "ckpt.pt")
    (root / "text.txt").write_text(TEXT)
    return root


COMMANDS = {  # each command's main(), on the CPU, with the least work that still loads the model and runs it
    "sample.py": lambda run: sample.main([f"--out_dir={run}", "--prompt=ROMEO:", "--max_new_tokens=4",
                                          "--device=cpu", "--dtype=float32", "--compile=False"]),
    "eval.py": lambda run: evaluate.main([f"--out_dir={run}", f"--text={run / 'text.txt'}", "--device=cpu",
                                          "--dtype=float32"]),
    "attention.py": lambda run: attention.main([f"--out_dir={run}", "--prompt=ROMEO:", "--device=cpu",
                                                f"--out={run / 'attention.png'}"]),
}


def machine_is(monkeypatch, busy):
    """The counters a command reads (its look's start and end): over 1 s other processes kept every core busy, or
    none; the command's own time is taken out by SharedCpu.check, so only others' shows."""
    cores = os.cpu_count()
    monkeypatch.setattr(machine, "cpu_counters", counters_from([(0.0, 0.0, 0.0), (cores, 0.0 if busy else cores, 0.0)]))


@pytest.mark.parametrize("command", COMMANDS)
def test_a_command_takes_the_cores_left_free_and_says_so(two_threads, monkeypatch, capsys, tiny_run, command):
    machine_is(monkeypatch, busy=True)
    COMMANDS[command](tiny_run)
    out, err = capsys.readouterr()
    notes = [line for line in err.splitlines() if line.startswith("this machine is")]
    assert torch.get_num_threads() == 1
    assert len(notes) == 1 and "takes 1 thread (not 2)" in notes[0] and "set OMP_NUM_THREADS=N" in notes[0], err
    assert "this machine" not in out  # stdout keeps the command's output (sample.py's: the text alone)


@pytest.mark.parametrize("command", COMMANDS)
def test_on_a_quiet_machine_a_command_keeps_its_threads_and_says_nothing(two_threads, monkeypatch, capsys, tiny_run,
                                                                        command):
    machine_is(monkeypatch, busy=False)
    COMMANDS[command](tiny_run)
    out, err = capsys.readouterr()
    assert torch.get_num_threads() == 2 and "this machine" not in out + err


# The two tests below create load and assert only what that load makes true, whatever else the machine runs (a
# test suite beside them, a build): that a quiet machine reads as quiet and says nothing is shown with counters the
# tests set (test_the_run_follows_the_load_and_says_so_once), since no test can make a machine quiet.


def test_the_counters_see_a_real_load(two_threads):
    with every_core_busy():
        cpu = SharedCpu()
        subprocess.run(["sleep", "0.5"])
        note = cpu.check()
    assert note and "busier than its cores" in note, note


def test_train_says_once_that_the_machine_is_busy(workdir, tmp_path, monkeypatch, capsys):  # noqa: F811
    """train.py's run, in this process (a process of its own would spend seconds importing torch on the busy cores),
    with torch's own thread count: one per core, no OMP_NUM_THREADS."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count())
    try:
        with every_core_busy():
            stopped_by = train_main(workdir, tmp_path / "busy", "--max_iters=4", "--eval_interval=4",
                                    "--overwrite=True")
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert stopped_by is None, out  # it ran to the end: the command's exit status 0
    lines = [line for line in out.splitlines() if line.startswith("this machine is")]
    if os.cpu_count() > 1:
        # the spinners and this run share the cores: others' share measures 1.3-1.9 of 2 (busy, or busier than its
        # cores, from 1.5), and either way the run takes 1 thread
        assert len(lines) == 1 and re.match(r"this machine is (busy|busier than its cores): ", lines[0]), out
        assert "takes 1 thread" in lines[0], out
