"""bench/gpu_check.py: --tiny on the CPU runs every row a GPU owner's check runs, here with a tiny model, so that the
first GPU session finds a script that works (its figures there are the point; here they are not); and a row that
fails is reported with its error line and last output lines while the rows after it still run.

The check's own runs (Runs, below) start in the background with the first test that reads one, and the tests come in
the order their rows end: the paced runs' rows, the tests that run no check (the background run goes on meanwhile),
then the background run's rows and the tests of the whole check."""

import importlib.util
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import FAKE_CUDA_DIR, NO_FAKE_CUDA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.py")
ROWS = ["tests", "data", "train_eager", "train", "ddp", "fsdp", "resume", "resume_ddp", "resume_fsdp", "fp16", "bf16",
        "memory", "eval", "int8", "w8a8", "graphs", "lookup", "draft"]
TRAINING = ["train_eager", "train", "ddp", "fsdp", "fp16", "bf16"]
RESUMED = {"resume": "train", "resume_ddp": "ddp", "resume_fsdp": "fsdp"}  # and the row each resumes the run of
ITERS = 12  # --tiny's
# Rows the check on the CPU below leaves out (--skip): each runs what another row of it runs (resume's resume(),
# int8's quantized_decodes, the draft row's speculative decoding and its output's acceptance line) with other
# settings, 7 commands and ~75 s of the two cores. What those settings build is checked with the commands faked
# (test_the_left_out_rows_build_their_rows_commands); what the runs prove, where it lives: DDP's and FSDP's exact
# resumes in tests/test_parallel.py, w8a8 compiled decoding eager's text in tests/test_quantize.py, compiled prompt
# lookup eager's, and float32 compiled (its kernels measured compiled, as graphs' --compile=True runs on a CPU)
# decoding eager's, in tests/test_sample.py.
LEFT_OUT = ["resume_ddp", "resume_fsdp", "w8a8", "graphs", "lookup"]
# The check on the CPU (--device=cpu: every command is seen to carry it), in groups of rows, each group a run of its
# own (--skip leaves out the other groups' rows; each runs data, which the training rows need), so that no test waits
# for the whole check: in one run it took ~90 s of the two cores, its compiled decodes ~30 and ~23 s of one (inductor's
# cache is cold in a test session), and a test may take 15 s, its setup included. A row reads only rows of its own
# group (gpu_check's READS; train's run, which the decoding group runs again). Every row but tests and LEFT_OUT runs
# in a group
GROUPS = {
    "ddp": ["ddp"],
    "fsdp": ["fsdp"],
    "precision": ["fp16", "bf16", "memory"],
    "training": ["train_eager", "train"],  # train's speed over train_eager's
    # resume reads train's losses; eval and the decodes its checkpoint; the draft row decodes the plain greedy text
    # it is compared with
    "decoding": ["train", "resume", "eval", "int8", "draft"],
}
# The check with faked CUDA (tests/fake_cuda), with each --device spelling: (spelling, the card's compute capability)
FAKE = {"one_card": ("cuda:1", (7, 5)), "every_card": ("auto", (8, 0))}  # plain cuda: as auto
# Each row's commands once across the two spellings (a command's device plumbing is the same row function under
# either): the one-card T4 run keeps the rows whose settings follow the card (fsdp in float32, bf16 skipped) and torchrun
# shown one card; the two-card run the rows on every card (ddp over both, memory) and bf16 where the card has it
SKIPPED = {"cuda:1": ["train", "ddp", "memory"], "auto": ["train_eager", "fsdp", "fp16"]}
# The runs, in two lanes of one run after another (Runs). PACED: in the order the tests read them, rows ending a few
# seconds apart, each a test's wait; first the torchrun rows, alone (their two processes keep both cores busy: beside
# another run they took half as long again). BACKGROUND: the decoding group (train, and the rows that read its run),
# ~70 s of one core, beside the paced runs from BESIDE on: it has ended, or nearly, when its tests come, after the tests
# that run no check. It runs one row at a time (--jobs=1, as on a GPU), one core's worth, and leaves the other to the
# paced runs (nice would not make it give way: gpu_check runs each command in a session of its own, and where the
# kernel shares the CPU between sessions first, as Linux's autogroup does, nice counts within a session only)
PACED = ["ddp", "fsdp", "training", "precision", "one_card", "every_card"]
BACKGROUND, BESIDE = ["decoding"], "training"
# Rows side by side where none reads another's (--jobs), as CI may run the check: each row still runs all its
# commands, they only share the machine, and the figures' checks hold all the same. On faked CUDA three at a time; on
# the CPU, beside the background run, only where no row then outlasts a test's wait: fp16 and bf16, then memory. The
# other groups' rows read each other's runs (train_eager's, train's), but for resume and eval, which side by side took
# 15 s: one at a time
JOBS = "--jobs=3"
CPU_JOBS = {"precision": 2}  # --jobs=1 for the other groups
TIMEOUT = 600  # seconds a run may take
SCRIPTS = ("train.py", "sample.py", "eval.py")
LM_EVAL = importlib.util.find_spec("lm_eval") is not None  # the eval row runs lm-eval tasks only where it imports


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------------
# The check's runs, in the background


def run_command(name, out, environ):
    """The command and environment (from environ) of a run: a group of the check on the CPU, or the check on faked
    CUDA."""
    env = dict(environ, OMP_NUM_THREADS="1")
    if name in GROUPS:
        skip = [row for row in ROWS[1:] if row not in ["data", *GROUPS[name]]]  # LEFT_OUT among them
        return [sys.executable, SCRIPT, "--tiny", "--no_tests", "--device=cpu", f"--jobs={CPU_JOBS.get(name, 1)}",
                f"--out={out}", f"--skip={','.join(skip)}"], env
    spelling, capability = FAKE[name]
    # as the fake_cuda fixture (tests/conftest.py) shows it to a test's subprocesses: every command inherits it
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [FAKE_CUDA_DIR, environ.get("PYTHONPATH")])),
               FAKE_CUDA="{}.{}".format(*capability))
    return [sys.executable, SCRIPT, "--tiny", "--no_tests", f"--device={spelling}", JOBS, f"--out={out}",
            f"--skip={','.join(SKIPPED[spelling])}"], env


GPU_HERE = "this machine has CUDA: its commands would get past the first allocation"  # for the runs on faked CUDA


def why_not(name):
    """Why a run cannot show anything on this machine, or None."""
    if name in GROUPS:
        return "on a GPU, run bench/gpu_check.py itself" if torch.cuda.is_available() else None
    return GPU_HERE if torch.cuda.is_available() else NO_FAKE_CUDA  # faked CUDA needs a CPU-only torch


def interrupt(proc):
    """End a run as Ctrl-C would: gpu_check then ends its commands, which run in sessions of their own (out of a
    kill's reach); killed if it has not ended a minute later."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Runs:
    """Runs of bench/gpu_check.py in lanes [(after, [names])], each lane its runs one after another from when the run
    after has started (None: at once). A test waits for the rows it reads (row: gpu_check saves its JSON after every
    row) or for a run's end (result). A run gets the environment of the start, not one that a test running when it
    starts has changed (fake_cuda's); why_not is read at the start too, before a test fakes CUDA in this process."""

    def __init__(self, folder, lanes):
        self.folder, self.lock, self.stopping, self.procs = folder, threading.Lock(), False, {}
        self.environ, self.why_not = dict(os.environ), {name: why_not(name) for name in [*GROUPS, *FAKE]}
        self.started = {name: threading.Event() for _, names in lanes for name in names}
        self.ended = {name: threading.Event() for _, names in lanes for name in names}
        self.threads = [threading.Thread(target=self.lane, args=lane, daemon=True) for lane in lanes]
        for thread in self.threads:
            thread.start()

    def path(self, name, suffix):
        return self.folder / f"{name}.{suffix}"

    def lane(self, after, names):
        try:
            if after:
                self.started[after].wait()
            for name in names:
                command, env = run_command(name, self.path(name, "json"), self.environ)
                with self.lock:
                    if self.stopping:
                        return
                    with open(self.path(name, "stdout"), "w") as stdout, open(self.path(name, "stderr"), "w") as err:
                        proc = self.procs[name] = subprocess.Popen(command, stdout=stdout, stderr=err, text=True,
                                                                   env=env)
                self.started[name].set()
                try:
                    proc.wait(TIMEOUT)
                except subprocess.TimeoutExpired:
                    interrupt(proc)
                self.ended[name].set()
        finally:  # a run that never started has ended too: its tests fail rather than wait, and no lane waits for it
            for name in names:
                self.started[name].set()
                self.ended[name].set()

    def saved(self, name):
        """The run's JSON as saved last (whole: gpu_check writes it to a temp file and renames it), or None."""
        path = self.path(name, "json")
        return json.loads(path.read_text()) if path.exists() else None

    def output(self, name):
        return "".join(self.path(name, suffix).read_text() for suffix in ("stdout", "stderr")
                       if self.path(name, suffix).exists())

    def row(self, name, row):
        """A row's result, once the run has saved it."""
        if self.why_not[name]:
            pytest.skip(self.why_not[name])
        while True:
            ended = self.ended[name].is_set()  # before reading: a run that has ended saved its rows before
            rows = (self.saved(name) or {}).get("rows", {})
            if row in rows:
                return rows[row]
            if ended:
                pytest.fail(f"the {name} run ended without the {row} row\n{self.output(name)}")
            self.ended[name].wait(0.2)

    def result(self, name):
        """An ended run: its CompletedProcess (result), stdout and stderr together (output), and JSON (figures)."""
        if self.why_not[name]:
            pytest.skip(self.why_not[name])
        self.ended[name].wait()
        proc = self.procs.get(name)
        if proc is None:
            pytest.fail(f"the {name} run never started")
        stdout, stderr = (self.path(name, suffix).read_text() for suffix in ("stdout", "stderr"))
        return SimpleNamespace(result=subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr),
                               output=stdout + stderr, figures=self.saved(name))

    def stop(self):
        """No run starts any more, and those still running end (tests deselected, or one failed)."""
        with self.lock:
            self.stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                interrupt(proc)
        for thread in self.threads:
            thread.join()


def runs_read(item):
    """The runs a test reads: the one it is parametrized with (run), or every group of the check on the CPU."""
    if "runs" not in item.fixturenames:
        return set()
    run = item.callspec.params.get("run") if hasattr(item, "callspec") else None
    return {run} if run else set(GROUPS)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The runs this module's selected tests read, and only those, started now (the first test that reads one)."""
    read = set().union(*(runs_read(item) for item in request.session.items
                         if getattr(item, "module", None) is request.module))
    read = {name for name in read if not why_not(name)}
    runs = Runs(tmp_path_factory.mktemp("gpu_check"), [(None, [name for name in PACED if name in read]),
                                                        (BESIDE if BESIDE in read else None,
                                                         [name for name in BACKGROUND if name in read])])
    yield runs
    runs.stop()


@pytest.fixture(scope="module")
def checks(runs):
    """Every group's run of the check on the CPU, ended: {group: (result, output, figures)}."""
    return {group: runs.result(group) for group in GROUPS}


def ran_in(name):
    """The group a row's result is read from: the first that runs it (train runs in two); tests and LEFT_OUT run in
    none (the first group's skip)."""
    return next((group for group, names in GROUPS.items() if name in names), next(iter(GROUPS)))


def merged(checks):
    """The rows of the check on the CPU as one run's: each row's result from the group that ran it."""
    return {name: checks[ran_in(name)].figures["rows"][name] for name in ROWS}


def assert_row_passes(runs, run, row):
    result = runs.row(run, row)
    assert result["status"] == "PASS", (result, runs.output(run))
    assert "output_tail" not in result  # kept for failures only


# ----------------------------------------------------------------------------------------------------
# The paced runs' rows, in the order they end


@pytest.mark.parametrize("run, row", [(group, row) for group in PACED if group in GROUPS
                                      for row in ["data", *GROUPS[group]]])
def test_each_row_passes_in_its_groups_run_on_the_cpu(runs, run, row):
    """Each row of the paced groups, as it ends (test_every_row_runs_and_passes_on_the_cpu checks the whole runs)."""
    assert_row_passes(runs, run, row)


# Where a CPU-only torch stops a command on faked CUDA: the first call that needs the CUDA runtime (an allocation),
# or, for torchrun's processes, the NCCL process group (a CPU build has no NCCL): past the repo's own setup either way
NO_CUDA_RUNTIME = "AssertionError: libcudart functions unavailable"
NO_NCCL = "RuntimeError: Distributed package doesn't have NCCL built in"


def fake_skips(run):
    """The rows a run on faked CUDA skips: --no_tests, w8a8 (a CPU mode), SKIPPED, bf16 on a card without it."""
    spelling, capability = FAKE[run]
    return {"tests", "w8a8", *SKIPPED[spelling], *(["bf16"] if capability < (8, 0) else [])}


def fake_commands(run):
    """The rows that run a training command on faked CUDA: the one-process ones, then torchrun's (ending last)."""
    return [name for name in ["train_eager", "train", "fp16", "memory", "bf16", "ddp", "fsdp"]
            if name not in fake_skips(run)]


def fake_cuda_for(fake_cuda, run):
    """The test of a run on faked CUDA skipped where the run cannot show anything, as the fake_cuda fixture skips it
    on a torch built with CUDA (tests/test_cuda_build.py checks that each test that takes the fixture does); the
    run's commands get the fake through their environment (run_command), as the fixture gives it to a test's."""
    if torch.cuda.is_available():
        pytest.skip(GPU_HERE)
    fake_cuda(FAKE[run][1])


@pytest.mark.parametrize("run, row", [(run, row) for run in FAKE for row in ["data", *fake_commands(run)]])
def test_on_a_gpu_every_command_gets_the_device_and_stops_where_a_cpu_torch_must(fake_cuda, runs, run, row):
    """The check with each --device spelling on faked CUDA (inherited by every command through PYTHONPATH), each
    training row run under one of the two (SKIPPED): each training command gets that device (torchrun's, for one named
    card, plain cuda: it is shown that card alone), gets through its setup and stops where a CPU-only torch must (its
    first CUDA allocation; NCCL under torchrun), the row failing with the command's own error line and keeping its last
    lines. A compute capability 7.5 card (a T4) runs FSDP in float32. The data row, which needs no GPU, passes."""
    fake_cuda_for(fake_cuda, run)
    result, (spelling, capability) = runs.row(run, row), FAKE[run]
    if row == "data":  # the run's first row to end: a wait of its own
        assert result["status"] == "PASS", (result, runs.output(run))
        return
    one_process = "torch.distributed.run" not in result["commands"][0]
    # the command's own error line: its last line, or under torchrun a worker's, above torchrun's report
    assert result["status"] == "FAIL", result
    assert result["error"].endswith(" (exit 1)") and result["error"][:-9] in [line.strip()
                                                                            for line in result["output_tail"]]
    assert not one_process or result["error"] == result["output_tail"][-1].strip() + " (exit 1)", result
    assert result["error"].startswith(NO_CUDA_RUNTIME if one_process else NO_NCCL), result["error"]
    torchrun_device = "cuda" if spelling == "cuda:1" else spelling
    device = f"--device={spelling if one_process else torchrun_device}"
    assert device in result["commands"][0].split(), result["commands"]  # whole: --device=cuda:1 starts as cuda's
    if not one_process:
        processes = 1 if spelling == "cuda:1" else 2
        assert f"--nproc_per_node={processes}" in result["commands"][0]
    if row == "fsdp" and capability < (8, 0):
        assert result["commands"][0].endswith("--dtype=float32")  # FSDP takes no float16; a T4 has no bfloat16


@pytest.mark.parametrize("run", FAKE)
def test_on_a_gpu_failing_rows_stop_none(fake_cuda, runs, run):
    """The rest of the check on faked CUDA: every row still runs, the resume rows fail for want of the runs they resume
    (running nothing), the eval and decoding rows for want of train's checkpoint, w8a8 is skipped (a CPU mode), a T4
    skips bf16, and the check exits 1 after its summary. The rows run side by side (JOBS), as CI may run them."""
    fake_cuda_for(fake_cuda, run)
    check, (spelling, capability) = runs.result(run), FAKE[run]
    assert check.result.returncode == 1, check.output
    figures = check.figures
    rows, skips = figures["rows"], fake_skips(run)
    index = 1 if spelling == "cuda:1" else 0
    assert list(rows) == ROWS and figures["summary"][0] == f"gpu_check on Fake GPU (cuda:{index} of 2 visible), " \
                                                          f"compute capability {capability[0]}.{capability[1]}"
    assert [rows[name]["status"] for name in ROWS] == \
        ["SKIP" if name in skips else "PASS" if name == "data" else "FAIL" for name in ROWS]
    assert all(rows[name]["key"] == "skipped: --skip" and rows[name]["commands"] == [] for name in SKIPPED[spelling])
    for name, unbroken in RESUMED.items():
        assert rows[name]["error"] == f"needs the {unbroken} row's losses to compare with, and it logged none"
        assert rows[name]["commands"] == []
    for name in ("eval", "int8", "graphs", "lookup", "draft"):
        assert rows[name]["error"] == "needs the train row, which failed before writing its checkpoint", name
    assert rows["w8a8"]["key"] == "skipped: w8a8 is a CPU mode; on a GPU use --quantize=int8"
    assert "\n".join(figures["summary"]) in check.result.stdout
    failed = len(ROWS) - len(skips) - 1
    assert figures["summary"][-1] == f"rows: 1 PASS, {failed} FAIL, {len(skips)} SKIP"


# ----------------------------------------------------------------------------------------------------
# Tests that run no check: meanwhile the decoding group goes on


def test_the_left_out_rows_build_their_rows_commands(monkeypatch, tmp_path):
    """The LEFT_OUT rows with every command faked (`must`: a train.py run logs UNBROKEN's losses up to its
    --max_iters, a sample.py run prints a speed line, and with --draft an acceptance line): resume_ddp and resume_fsdp
    each train the ddp and fsdp rows' command in two, w8a8's commands are int8's with the other mode, graphs' are
    int8's without it, and lookup decodes the graphs row's compiled command with --draft=lookup."""
    gpu_check = load_script()

    def must(ctx, command, env=None, cwd=None, text_path=None):
        ctx.commands.append(shlex.join(command))
        options = dict(arg[2:].split("=", 1) for arg in command if arg.startswith("--") and "=" in arg)
        if text_path:  # sample.py
            with open(text_path, "w") as f:
                f.write("ROMEO: the king")
            return "64 tokens in 1.00 s (64.0 tokens/s; 70.0 after the first 8)" + (
                ", draft acceptance rate 50.0% (20/40)" if any(arg.startswith("--draft=") for arg in command) else "")
        os.makedirs(options["out_dir"], exist_ok=True)
        with open(os.path.join(options["out_dir"], "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(dict(iter=i, loss=loss, ms_per_iter=10.0, tokens_per_sec=1e4)) + "\n"
                         for i, loss in UNBROKEN.items() if i <= int(options["max_iters"]))
        return "0.10M parameters, 512 tokens per iteration, 2 process(es) on cpu, torch.float32"

    monkeypatch.setattr(gpu_check, "must", must)
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "ckpt.pt").write_bytes(b"")  # train's checkpoint, which the decoding rows need
    ctx = SimpleNamespace(python=sys.executable, common=["--dataset=shakespeare_char", f"--max_iters={ITERS}"],
                          device="cpu", torchrun_device="cpu", work=str(tmp_path), global_tokens=512, processes=2,
                          cuda=False, kind="cpu", one_card={}, iters=ITERS, results={}, commands=[], texts={},
                          args=SimpleNamespace(tiny=True), log=str(tmp_path / "log.txt"))
    rows, row_function = {}, {name: function for name, _, function in gpu_check.ROWS}
    for name in ["ddp", "fsdp", "resume_ddp", "resume_fsdp", "int8", "w8a8", "graphs", "lookup"]:
        ctx.commands = []
        figures, _ = row_function[name](ctx)
        ctx.results[name] = dict(status="PASS", figures=figures)
        rows[name] = dict(commands=ctx.commands, figures=figures)
    for name in ("resume_ddp", "resume_fsdp"):
        assert_resumes_the_same_command(rows, name)
        assert rows[name]["figures"]["largest_difference"] == 0
    assert [c.replace("--quantize=int8", "--quantize=w8a8") for c in rows["int8"]["commands"]] == rows["w8a8"]["commands"]
    assert rows["w8a8"]["commands"][1].endswith("--quantize=w8a8 --compile=True")
    assert [c.replace(" --quantize=int8", "") for c in rows["int8"]["commands"]] == rows["graphs"]["commands"]
    assert "--compile=False" in rows["graphs"]["commands"][0] and "--compile=True" in rows["graphs"]["commands"][1]
    assert rows["graphs"]["figures"]["compiled_over_eager"] == 1.0  # the faked speed lines' 70.0 / 70.0
    assert rows["lookup"]["commands"] == [rows["graphs"]["commands"][1].replace("--compile=True",
                                                                              "--draft=lookup --compile=True")]
    assert (rows["lookup"]["figures"]["accepted"], rows["lookup"]["figures"]["proposed"]) == (20, 40)


def test_a_failing_row_is_reported_with_its_error_and_the_rest_still_run(tmp_path):
    """The runner main() uses, with rows of our own: a torchrun command whose rank 1 raises (its cause must be found
    above torchrun's own report), a row that needs it, a row with a bug of the script's own, and one that passes."""
    gpu_check = load_script()
    script = tmp_path / "fails.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    print('working', flush=True)\n"
                      "    raise RuntimeError('broken on purpose')\n")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    rows = [("broken", [], lambda ctx: gpu_check.must(ctx, torchrun, dict(os.environ, OMP_NUM_THREADS="1"))),
            ("needs_it", ["broken"], lambda ctx: ({}, "never runs")),
            ("bug", [], lambda ctx: {}["missing"]),
            ("fine", [], lambda ctx: ({"figure": 1}, "1 figure"))]
    ctx = SimpleNamespace(log=str(tmp_path / "log.txt"), work=str(tmp_path), timeout=120, results={}, commands=[],
                          name="CPU (test)", capability=None)
    gpu_check.run_rows(ctx, rows)
    broken, needs_it, bug, fine = (ctx.results[name] for name, _, _ in rows)
    assert broken["status"] == "FAIL" and broken["error"] == "RuntimeError: broken on purpose (exit 1)", broken
    assert "working" in broken["output_tail"] and "    raise RuntimeError('broken on purpose')" in broken["output_tail"]
    assert not any("ChildFailedError" in line for line in broken["output_tail"])  # torchrun's report left out
    assert needs_it == dict(status="FAIL", error="needs the broken row, which did not pass", output_tail=[],
                            figures={}, seconds=needs_it["seconds"], commands=[])
    assert bug["status"] == "FAIL" and bug["error"] == "gpu_check: KeyError: 'missing'"
    assert fine["status"] == "PASS" and fine["figures"] == {"figure": 1}
    summary = gpu_check.summary(ctx)
    assert summary[3:] == ["broken    FAIL  RuntimeError: broken on purpose (exit 1)",
                           "needs_it  FAIL  needs the broken row, which did not pass",
                           "bug       FAIL  gpu_check: KeyError: 'missing'",
                           "fine      PASS  1 figure",
                           "rows: 1 PASS, 3 FAIL, 0 SKIP"]
    log = (tmp_path / "log.txt").read_text()
    assert "FAIL broken: RuntimeError: broken on purpose (exit 1)\n  last lines:\n" in log
    assert "raise RuntimeError('broken on purpose')" in log.split("FAIL broken")[1]


def test_skipped_rows_run_nothing_and_a_row_that_needs_one_fails_saying_so(tmp_path):
    """--skip, for a lease too short for every row (bench/RESULTS.md: an H100's 15 minutes held the training rows)."""
    gpu_check = load_script()
    ran = []
    rows = [("first", [], lambda ctx: ran.append("first") or ({}, "ran")),
            ("left_out", [], lambda ctx: ran.append("left_out") or ({}, "ran")),
            ("needs_it", ["left_out"], lambda ctx: ran.append("needs_it") or ({}, "ran")),
            ("last", [], lambda ctx: ran.append("last") or ({}, "ran"))]
    ctx = SimpleNamespace(log=str(tmp_path / "log.txt"), results={}, commands=[], name="CPU (test)", capability=None)
    gpu_check.run_rows(ctx, rows, skip=gpu_check.row_names(""))
    assert ran == ["first", "left_out", "needs_it", "last"]  # nothing named: every row runs
    ran.clear()
    gpu_check.run_rows(ctx, rows, skip=["left_out"])
    assert ran == ["first", "last"]
    assert [(r["status"], r.get("key") or r["error"]) for r in ctx.results.values()] == [
        ("PASS", "ran"), ("SKIP", "skipped: --skip"), ("FAIL", "needs the left_out row, which did not pass"),
        ("PASS", "ran")]


def test_rows_side_by_side_wait_for_the_rows_they_read_and_keep_their_order(monkeypatch, tmp_path):
    """--jobs: rows run at once (here two that each go on only once the other has started), a row starts after the
    rows it reads (READS) have ended, each row keeps its own commands and its lines together in the log, and the
    results end in the rows' order whichever row ended first."""
    gpu_check = load_script()
    started, events = {"first": threading.Event(), "second": threading.Event()}, []

    def row(name, other=None):
        def run(ctx):
            events.append(f"start {name}")
            if other:
                started[name].set()
                assert started[other].wait(30), f"{other} did not start while {name} ran"
            gpu_check.must(ctx, [sys.executable, "-c", f"print('{name} printed this')"])
            events.append(f"end {name}")
            return {}, name
        return run

    monkeypatch.setattr(gpu_check, "READS", {"reader": ["second"]})
    rows = [("first", [], row("first", "second")), ("second", [], row("second", "first")),
            ("reader", [], row("reader")), ("bug", [], lambda ctx: {}["missing"])]
    ctx = SimpleNamespace(log=str(tmp_path / "log.txt"), work=str(tmp_path), timeout=60, results={}, commands=[])
    gpu_check.run_rows(ctx, rows, jobs=2)
    assert list(ctx.results) == ["first", "second", "reader", "bug"]
    assert [ctx.results[name]["status"] for name in ctx.results] == ["PASS"] * 3 + ["FAIL"]
    assert events.index("start reader") > events.index("end second")
    log = (tmp_path / "log.txt").read_text()
    for name in ("first", "second", "reader"):
        command = shlex.join([sys.executable, "-c", f"print('{name} printed this')"])
        assert ctx.results[name]["commands"] == [command]
        assert f"===== row {name} =====\n$ {command}\n{name} printed this\n" in log
    assert "===== row bug =====\nFAIL bug: gpu_check: KeyError: 'missing'\n" in log
    assert not list(tmp_path.glob("log_*"))  # the rows' own logs, joined into the log


def test_ctrl_c_with_rows_side_by_side_ends_the_commands_running(tmp_path):
    """Ctrl-C reaches this script's main thread only, and the commands run in sessions of their own: stop_all must
    end those the rows' threads are running, and no row goes on to another command."""
    gpu_check = load_script()
    pid_file, woke = tmp_path / "pids", tmp_path / "woke"  # a line for each sleeper started; one that slept it out
    sleeper = [sys.executable, "-c", f"import os, time\nopen({str(pid_file)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
               f"time.sleep(60)\nopen({str(woke)!r}, 'w')"]

    def sleeps(ctx):
        gpu_check.must(ctx, sleeper)
        gpu_check.must(ctx, sleeper)  # must never start

    def quick(ctx):
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text().endswith("\n")) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {}, "ended while sleeps ran"

    def interrupt():  # save(), after quick has ended: Ctrl-C as the main thread gets it
        raise KeyboardInterrupt

    ctx = SimpleNamespace(log=str(tmp_path / "log.txt"), work=str(tmp_path), timeout=120, results={}, commands=[])
    with pytest.raises(KeyboardInterrupt):
        gpu_check.run_rows(ctx, [("sleeps", [], sleeps), ("quick", [], quick)], save=interrupt, jobs=2)
    pids = pid_file.read_text().split()
    assert len(pids) == 1 and not woke.exists()  # ended asleep, and the row's second command never started
    with pytest.raises(ProcessLookupError):
        os.kill(int(pids[0]), 0)


def test_a_training_run_that_warns_says_so_in_its_row(tmp_path):
    """A warning printed by train.py reaches the row's figures and its summary line, once however many ranks print
    it: the H100's first run printed torch's fused-rms_norm warning on every training row, and only its log said so."""
    gpu_check = load_script()
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps(dict(iter=i, loss=3.0, ms_per_iter=40.0, tokens_per_sec=4e5)) + "\n" for i in range(1, 6)))
    first_line = "114.15M parameters, 16,384 tokens per iteration, 1 process(es) on cuda:0, torch.bfloat16\n"
    warning = ("UserWarning: Mismatch dtype between input and weight: input dtype = c10::BFloat16, weight dtype = "
               "float, Cannot dispatch to fused implementation.")
    printed = f"/torch/nn/functional.py:2954: {warning}\n  return torch.rms_norm(input)\n"
    quiet = gpu_check.training_figures(str(tmp_path), first_line)
    warned = gpu_check.training_figures(str(tmp_path), first_line + printed + "iter 1: loss 3.0\n" + printed)
    assert quiet["warnings"] == [] and "warning" not in gpu_check.speed(quiet)
    assert warned["warnings"] == [warning]
    assert gpu_check.speed(warned) == gpu_check.speed(quiet) + f"; 1 warning(s), first: {warning[:120]}"


def test_bad_input_is_one_line(monkeypatch, tmp_path):
    result = subprocess.run([sys.executable, SCRIPT, "--tiny", "--device=gpu"], capture_output=True, text=True)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == "error: --device must be auto, cpu, cuda or cuda:N, got 'gpu'\n"
    gpu_check = load_script()  # the other checks, in this process (each run of the script costs an import torch)
    checks = [(lambda: gpu_check.positive_ints("8,x", "--memory_batches", many=True),
               "error: --memory_batches must be positive integers, comma-separated, got '8,x'"),
              (lambda: gpu_check.positive_ints("12,4", "--iters"),
               "error: --iters must be a positive integer, got '12,4'"),
              (lambda: gpu_check.row_names("train,trian"), "error: --skip: no row 'trian'; the rows are tests, data, "),
              (lambda: gpu_check.jobs_option("2", tiny=False), "error: --jobs runs rows side by side, which spoils "),
              (lambda: gpu_check.jobs_option("0", tiny=True), "error: --jobs must be a positive integer, got '0'")]
    if torch.cuda.device_count() <= 7:
        checks.append((lambda: gpu_check.device_setup("cuda:7"), "error: --device=cuda:7, but this "))
    for call, message in checks:
        with pytest.raises(SystemExit) as exit:
            call()
        assert str(exit.value.code).startswith(message) and "\n" not in str(exit.value.code)
    # the last setting read is refused before the run makes its folders: nothing written
    out = tmp_path / "out" / "check.json"
    monkeypatch.setattr(sys, "argv", [SCRIPT, "--tiny", "--device=cpu", "--timeout=0", f"--out={out}"])
    with pytest.raises(SystemExit) as exit:
        gpu_check.main()
    assert exit.value.code == "error: --timeout must be a positive integer, got '0'"
    assert not out.parent.exists()


@pytest.mark.parametrize("has_xdist", [True, False])
def test_the_tests_row_runs_the_suite_on_its_device_with_or_without_xdist(monkeypatch, has_xdist):
    """The tests row runs README's command with TEST_DEVICE and -m device (the tests that take it); where pytest-xdist
    is missing (a GPU machine may have pytest alone), without pytest.ini's -n, which pytest would refuse as unknown."""
    gpu_check, calls = load_script(), []
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: find_spec(name) if has_xdist or name != "xdist"
                        else None)
    monkeypatch.setattr(gpu_check, "run", lambda ctx, command, env, cwd: calls.append((command, env)) or (
        0, "==== 5 passed in 1.00s ===="))
    ctx = SimpleNamespace(args=SimpleNamespace(no_tests=False), cuda=True, kind="cuda", python=sys.executable,
                          one_card={"CUDA_VISIBLE_DEVICES": "1"})
    figures, line = gpu_check.row_tests(ctx)
    [(command, env)] = calls
    assert command[:5] == [sys.executable, "-m", "pytest", "-m", "device"] and env["TEST_DEVICE"] == "cuda"
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and line == "5 passed in 1.00s (TEST_DEVICE=cuda)"
    assert ("-o" in command) == (not has_xdist)
    if not has_xdist:
        assert "-n" not in command[command.index("-o") + 1]  # pytest.ini's addopts replaced, its -n with them


def test_dash_m_device_selects_the_tests_that_take_the_device_fixture():
    """conftest.py marks them; test_muon.py has one, and one whose own parameter is named device (not the fixture)."""
    listed = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-m", "device", "-p", "no:cacheprovider",
                             "tests/test_muon.py"], capture_output=True, text=True, cwd=ROOT)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    chosen = [line for line in listed.stdout.splitlines() if "::" in line]
    assert chosen == ["tests/test_muon.py::test_cuda_batches_the_matrices_of_a_shape_and_a_cpu_takes_them_in_turn"]


def test_what_the_rows_decide_on_a_gpu(fake_cuda, monkeypatch, tmp_path):
    """The choices only a GPU meets, on CUDA faked at torch's C boundary (conftest.py): two cards of compute
    capability 7.5 (a T4's: no bfloat16)."""
    fake_cuda((7, 5))
    gpu_check = load_script()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    every = gpu_check.device_setup("auto")
    assert (every["processes"], every["torchrun_device"], every["one_card"]) == (2, "auto", {})
    assert every["name"] == "Fake GPU (cuda:0 of 2 visible)" and every["has_bf16"] is False
    assert gpu_check.device_setup("cuda") == every | {"torchrun_device": "cuda"}  # plain cuda: every card, as auto
    # one card: torchrun and the tests are shown it alone (train.py under torchrun takes cuda:LOCAL_RANK)
    one = gpu_check.device_setup("cuda:1")
    assert (one["processes"], one["torchrun_device"], one["one_card"]) == (1, "cuda", {"CUDA_VISIBLE_DEVICES": "5"})
    # a compile row on CUDA fails unless torch.compile compiled graphs (compiled_graphs, counted from torch's trace)
    ctx = SimpleNamespace(cuda=True, has_bf16=False, capability="7.5", log=str(tmp_path / "log.txt"), results={},
                          name=one["name"])
    for figures in ({"compiled_graphs": None}, {"compiled_graphs": 0}):
        with pytest.raises(gpu_check.RowFailed, match="compiled_graphs="):
            gpu_check.compile_note(ctx, figures, "output")
    assert gpu_check.compile_note(ctx, {"compiled_graphs": 3, "first_step_s": 41.0}, "") == \
        "first step 41.0 s (3 graphs compiled)"
    gpu_check.run_rows(ctx, [("bf16", [], gpu_check.row_bf16)])  # a card without bfloat16: skipped, not failed
    assert ctx.results["bf16"]["status"] == "SKIP"
    assert ctx.results["bf16"]["key"] == "skipped: no bfloat16 (compute capability 7.5; 8.0 on has it)"


def test_on_apple_mps_the_torchrun_rows_and_w8a8_are_skipped(tmp_path):
    """torchrun needs gloo off CUDA, and gloo carries only cpu and cuda tensors: on MPS the ddp and fsdp rows and
    their resumes are skipped, saying why, before any command runs; w8a8 is a CPU mode."""
    gpu_check = load_script()
    ctx = SimpleNamespace(kind="mps", cuda=False, log=str(tmp_path / "log.txt"), results={"data": dict(status="PASS")},
                          commands=[], name="Apple MPS (test)", capability=None)
    names = ["ddp", "fsdp", "resume_ddp", "resume_fsdp", "w8a8"]
    gpu_check.run_rows(ctx, [row for row in gpu_check.ROWS if row[0] in names])
    assert list(ctx.results) == ["data"] + names
    gloo = "skipped: torchrun needs gloo here, and gloo carries only cpu and cuda tensors: not Apple MPS's"
    assert [ctx.results[name].get("key") or ctx.results[name]["error"] for name in names] == [gloo] * 4 + [
        "skipped: w8a8 is a CPU mode; on a GPU use --quantize=int8"]
    assert all(ctx.results[name]["status"] == "SKIP" and ctx.results[name]["commands"] == [] for name in names)


UNBROKEN = {i: 4.8 - 0.05 * i for i in range(1, ITERS + 1)}  # a run's losses by iteration, falling


def resume_row(gpu_check, monkeypatch, tmp_path, kind, losses_after_resume):
    """row_resume's result where train.py is faked: the train row's run logged UNBROKEN, and the resumed run logs
    UNBROKEN's losses up to its resume, then losses_after_resume (iteration: loss)."""
    def write_losses(name, losses):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(dict(iter=i, loss=loss)) + "\n"
                                                               for i, loss in losses.items()))

    def train_run(ctx, name, *settings, processes=None):
        if "--init_from=resume" in settings:
            write_losses(name, {i: loss for i, loss in UNBROKEN.items() if i <= ITERS // 2} | losses_after_resume)
        return dict(final_loss=max(losses_after_resume.items())[1], precision="float32"), "output"

    write_losses("train", UNBROKEN)
    monkeypatch.setattr(gpu_check, "train_run", train_run)
    ctx = SimpleNamespace(kind=kind, cuda=kind == "cuda", iters=ITERS, work=str(tmp_path), processes=1,
                          results={"train": dict(status="PASS", figures=dict(final_loss=UNBROKEN[ITERS]))})
    return gpu_check.row_resume(ctx)


def test_a_resumed_run_whose_losses_are_not_the_unbroken_runs_fails(monkeypatch, tmp_path):
    """What real breaks would do to the losses after the resume, in resume_row's faked runs: each fails the row; the
    same losses pass, and so does a GPU's small drift between identical runs."""
    gpu_check = load_script()
    after = {i: loss for i, loss in UNBROKEN.items() if i > ITERS // 2}
    figures, key = resume_row(gpu_check, monkeypatch, tmp_path, "cpu", after)
    assert figures["largest_difference"] == 0 and figures["resumed_at"] == ITERS // 2
    assert key == ("1 process: resumed at iter 6 of 12, losses 7-12 differ from the train row's by at most 0 "
                   f"(tolerance 1e-05); loss {UNBROKEN[ITERS]:.4f}, float32")
    breaks = {
        # the schedule restarted: other learning rates after the resume, the last loss back where it was
        "restarted schedule": after | {7: after[7] + 0.05, 8: after[8] + 0.07, 9: after[9] + 0.05},
        "lost optimizer state": {i: loss - 0.004 * (i - 6) for i, loss in after.items()},
        "a GPU's drift, on the CPU": {i: loss + 1e-3 for i, loss in after.items()},
        "a missing iteration": {i: loss for i, loss in after.items() if i != 10},
    }
    for name, losses in breaks.items():
        with pytest.raises(gpu_check.RowFailed) as failed:
            resume_row(gpu_check, monkeypatch, tmp_path, "cpu", losses)
        expected = "no loss logged at iter 10" if name == "a missing iteration" else "resumed at iter 6: loss "
        assert str(failed.value).startswith(expected), (name, str(failed.value))
    with pytest.raises(gpu_check.RowFailed) as failed:
        resume_row(gpu_check, monkeypatch, tmp_path, "cpu", breaks["restarted schedule"])
    assert str(failed.value) == ("resumed at iter 6: loss 4.470000 at iter 8, the train row's unbroken run 4.400000 "
                                 "(0.07 apart, tolerance 1e-05)")
    with pytest.raises(gpu_check.RowFailed, match=r"at iter 8, the train row's unbroken run 4.400000 \(0.07 apart"):
        resume_row(gpu_check, monkeypatch, tmp_path, "cuda", breaks["restarted schedule"])
    figures, _ = resume_row(gpu_check, monkeypatch, tmp_path, "cuda", breaks["a GPU's drift, on the CPU"])
    assert figures["largest_difference"] == pytest.approx(1e-3) and figures["tolerance"] == 1e-2


def speculative_row(gpu_check, monkeypatch, tmp_path, row, text):
    """A decoding row's result where sample.py is faked: plain greedy decoding writes "ROMEO: the king", a
    speculative run (--draft=...) writes text."""
    def sample(ctx, *settings):
        speculative = any(setting.startswith("--draft=") for setting in settings)
        ctx.texts[settings] = text if speculative else "ROMEO: the king"
        return ctx.texts[settings], ("64 tokens in 1.00 s (64.0 tokens/s; 70.0 after the first 8), "
                                     "draft acceptance rate 50.0% (20/40)")

    monkeypatch.setattr(gpu_check, "sample", sample)
    monkeypatch.setattr(gpu_check, "train_run", lambda ctx, name, *settings: (dict(final_loss=4.2), ""))
    (tmp_path / "train").mkdir(exist_ok=True)
    (tmp_path / "train" / "ckpt.pt").write_bytes(b"")  # train's checkpoint, which the rows need
    return row(SimpleNamespace(work=str(tmp_path), texts={}))


@pytest.mark.parametrize("row", ["row_lookup", "row_draft"])
def test_speculative_text_that_is_not_plain_greedy_decodings_fails(monkeypatch, tmp_path, row):
    gpu_check = load_script()
    figures, key = speculative_row(gpu_check, monkeypatch, tmp_path, getattr(gpu_check, row), "ROMEO: the king")
    assert (figures["accepted"], figures["proposed"]) == (20, 40) and "text as plain greedy decoding's" in key
    what = "--draft=lookup" if row == "row_lookup" else "--draft"
    with pytest.raises(gpu_check.RowFailed) as failed:
        speculative_row(gpu_check, monkeypatch, tmp_path, getattr(gpu_check, row), "ROMEO: the kinsman")
    assert str(failed.value) == (f"{what}: its text parts from plain greedy decoding's at character 14: 'sman' "
                                 "instead of 'g'")


def test_the_eval_row_without_lm_eval_passes_on_bits_per_byte_and_says_why(monkeypatch, tmp_path):
    """lm_eval_missing imports lm-eval as eval.py would (here made to fail by a module of that name on PYTHONPATH);
    the row then reports the tasks skipped with that error, and passes on a finite bits per byte alone."""
    gpu_check = load_script()
    (tmp_path / "no_lm_eval").mkdir()
    (tmp_path / "no_lm_eval" / "lm_eval.py").write_text("raise ImportError('no lm-eval on this machine')\n")
    ctx = SimpleNamespace(python=sys.executable, work=str(tmp_path), log=str(tmp_path / "log.txt"), timeout=60,
                          commands=[])
    if LM_EVAL:
        assert gpu_check.lm_eval_missing(ctx) is None
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "no_lm_eval"))
    assert gpu_check.lm_eval_missing(ctx) == "ImportError: no lm-eval on this machine"
    val = dict(bits_per_byte=6.05, loss=4.19)
    monkeypatch.setattr(gpu_check, "eval_figures", lambda ctx, name, *settings: {"text": dict(val)})
    assert gpu_check.row_eval(ctx) == (val, "6.0500 bits per byte on the val split; lm-eval tasks skipped: "
                                            "ImportError: no lm-eval on this machine")
    val["bits_per_byte"] = math.nan
    with pytest.raises(gpu_check.RowFailed, match="eval.py: nan bits per byte on the val split"):
        gpu_check.row_eval(ctx)


# ----------------------------------------------------------------------------------------------------
# The decoding group's rows, then the whole check on the CPU


@pytest.mark.parametrize("run, row", [(group, row) for group in BACKGROUND for row in ["data", *GROUPS[group]]])
def test_each_row_reading_trains_run_passes_on_the_cpu(runs, run, row):
    """The background group's rows, as test_each_row_passes_in_its_groups_run_on_the_cpu the paced groups'."""
    assert_row_passes(runs, run, row)


def test_every_row_runs_and_passes_on_the_cpu(checks):
    for group, check in checks.items():
        assert check.result.returncode == 0, check.output
        rows = check.figures["rows"]
        assert list(rows) == ROWS, group  # every row in each run's JSON, in order
        assert rows["tests"]["status"] == "SKIP" and rows["tests"]["key"] == "skipped: --no_tests"
        ran = ["data", *GROUPS[group]]
        # LEFT_OUT, and the rows the other groups run
        assert all(rows[name]["status"] == "SKIP" and rows[name]["key"] == "skipped: --skip"
                   for name in ROWS[1:] if name not in ran), group
        assert all(rows[name]["status"] == "PASS" for name in ran), check.output
        assert not any("output_tail" in row for row in rows.values())  # kept for failures only
    rows = merged(checks)  # each row as the group that ran it saw it: every row but LEFT_OUT ran, and passed
    assert all(rows[name]["status"] == "SKIP" and rows[name]["key"] == "skipped: --skip" for name in LEFT_OUT)
    assert all(rows[name]["status"] == "PASS" for name in ROWS[1:] if name not in LEFT_OUT)


def test_the_figures_are_sane(checks):
    rows = {name: row.get("figures") for name, row in merged(checks).items()}
    for name in TRAINING:
        figures = rows[name]
        assert figures["ms_per_iter"] > 0 and figures["tokens_per_sec"] > 0 and figures["first_step_s"] > 0, name
        assert math.isfinite(figures["final_loss"]) and figures["iters"] == ITERS, name
        assert figures["peak_memory_gb"] is None and figures["compiled_graphs"] is None, name  # CUDA only
    assert [rows[name]["precision"] for name in TRAINING] == ["float32"] * 4 + ["float16", "bfloat16"]
    # one global batch: one process (2 micro-steps), DDP and FSDP x2 (1 each; FSDP with activation checkpointing,
    # which recomputes the same thing) train the same model on the same data, in float32 (measured: equal)
    losses = [rows[name]["final_loss"] for name in ("train_eager", "train", "ddp", "fsdp")]
    assert max(losses) - min(losses) < 1e-5, losses
    # the same run in float16 and bfloat16 autocast ends near it (measured: 1.3e-5 and 7e-6 away)
    assert all(abs(rows[name]["final_loss"] - losses[0]) < 1e-3 for name in ("fp16", "bf16"))
    assert ITERS // 2 < rows["fp16"]["optimizer_steps"] <= ITERS and rows["fp16"]["scaler_scale"] > 0
    assert rows["train"]["speedup_over_eager"] > 0
    assert rows["memory"] == {"batch 8, compile=False": None, "batch 8, compile=True": None}  # measured on CUDA only
    for decode in (rows["int8"]["eager"], rows["int8"]["compiled"]):
        assert decode["tokens"] == 64 and decode["tokens_per_sec"] > 0 and decode["tokens_per_sec_after_8"] > 0
    assert rows["int8"]["compiled_over_eager"] > 0
    # resumed halfway, each run's losses after it are the unbroken run's (read from that row's run: the train row of
    # the resume row's own group), on the CPU to the last bit (measured: equal)
    for name, unbroken in RESUMED.items():
        if name in LEFT_OUT:
            continue
        figures, unbroken_loss = rows[name], checks[ran_in(name)].figures["rows"][unbroken]["figures"]["final_loss"]
        assert figures["resumed_at"] == ITERS // 2 and figures["iters"] == ITERS and figures["tolerance"] == 1e-5
        assert figures["unbroken_final_loss"] == unbroken_loss, name
        assert figures["largest_difference"] <= 1e-5
        assert abs(figures["final_loss"] - unbroken_loss) <= 1e-5, name
    # bits per byte of the val split: characters are bytes, so it is the loss in bits; below a uniform guess's
    assert rows["eval"]["tokens"] == rows["eval"]["bytes"] > 100_000
    assert rows["eval"]["bits_per_byte"] == pytest.approx(rows["eval"]["loss"] / math.log(2), rel=1e-9)
    assert 0 < rows["eval"]["bits_per_byte"] < math.log2(128)
    if LM_EVAL:
        assert 0 <= rows["eval"]["choice_acc"] <= 1 and 0 < rows["eval"]["text_bits_per_byte"] < math.inf
    # the draft proposed tokens and some were kept: the text was not all the model's
    assert rows["draft"]["tokens"] == 64 and 0 < rows["draft"]["accepted"] <= rows["draft"]["proposed"]
    assert math.isfinite(rows["draft"]["draft_final_loss"])


def test_each_row_ran_the_command_a_user_would(runs, checks):
    rows = merged(checks)
    commands = [c for row in rows.values() for c in row["commands"] if any(script in c for script in SCRIPTS)]
    # training 6, resume 2 (LEFT_OUT: not its ddp and fsdp runs), memory 2, eval 1 (+ 1 with lm-eval), int8 2 (not
    # w8a8's 2, nor graphs' 2), draft 3 (training it, decoding, and plain greedy's text; not lookup's 1)
    assert len(commands) == 6 + 2 + 2 + 1 + LM_EVAL + 2 + 3, commands
    every = [c for check in checks.values() for row in check.figures["rows"].values() for c in row["commands"]
             if any(script in c for script in SCRIPTS)]  # train's too where another group runs it again
    assert all("--device=cpu" in c for c in every), every
    assert "--nproc_per_node=2" in rows["ddp"]["commands"][0] and "--compile=True" in rows["ddp"]["commands"][0]
    assert "--fsdp=True --activation_checkpointing=True" in rows["fsdp"]["commands"][0]
    assert_resumes_the_same_command(checks[ran_in("resume")].figures["rows"], "resume")  # its group's train run
    assert "--dtype=float16" in rows["fp16"]["commands"][0] and "--dtype=bfloat16" in rows["bf16"]["commands"][0]
    assert "eval.py --out_dir=" in rows["eval"]["commands"][0]
    assert rows["eval"]["commands"][1].endswith("-c 'import lm_eval'")  # whether lm-eval imports here
    if LM_EVAL:
        assert "--tasks=gpu_check_choice,gpu_check_text --include_path=" in rows["eval"]["commands"][2]
    assert "--quantize=int8 --compile=False" in rows["int8"]["commands"][0]
    assert "--quantize=int8 --compile=True" in rows["int8"]["commands"][1]
    assert "train.py" in rows["draft"]["commands"][0]
    assert rows["draft"]["commands"][0].endswith("--n_layer=1 --compile=False")
    assert "--draft=" in rows["draft"]["commands"][1] and rows["draft"]["commands"][1].endswith("--compile=False")
    assert "--draft=" not in rows["draft"]["commands"][2] and rows["draft"]["commands"][2].endswith("--compile=False")
    # side by side, each row's commands are in each run's log together, under its own header
    for group, check in checks.items():
        # the run's work folder, its log in it, lies beside its JSON (--out), here a test's folder: not /tmp
        assert os.path.dirname(os.path.dirname(check.figures["log"])) == str(runs.path(group, "json").parent)
        with open(check.figures["log"]) as f:
            blocks = dict(re.findall(r"===== row (\w+) =====\n(.*?)(?=\n===== row |\Z)", f.read(), re.S))
        assert sorted(blocks) == sorted(ROWS), group
        for name, row in check.figures["rows"].items():
            assert [line[2:] for line in blocks[name].splitlines() if line.startswith("$ ")] == row["commands"], name


def assert_resumes_the_same_command(rows, name):
    """A resume row trains its unbroken row's run (the same command, but for its out_dir) in two, on one schedule."""
    unbroken = RESUMED[name]
    half, resumed = (re.sub(r" --out_dir=\S+", "", c) for c in rows[name]["commands"])
    unbroken_command = re.sub(r" --out_dir=\S+", "", rows[unbroken]["commands"][0])
    assert half == unbroken_command + f" --max_iters={ITERS // 2} --lr_decay_iters={ITERS}", (half, unbroken)
    assert resumed == unbroken_command + f" --init_from=resume --max_iters={ITERS} --lr_decay_iters={ITERS}"


def test_the_summary_is_printed_saved_and_says_these_are_not_gpu_figures(checks):
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"  # a CUDA build without a GPU says so
    for group, check in checks.items():
        summary = check.figures["summary"]
        assert "\n".join(summary) in check.result.stdout
        assert summary[0] == "gpu_check on CPU (no GPU: these are not GPU figures)"
        assert summary[1].startswith(f"torch {torch.__version__}, {build}")
        assert summary[2].startswith("command: python bench/gpu_check.py --tiny")
        for name, line in zip(ROWS, summary[3:]):
            assert line.split()[:2] == [name, check.figures["rows"][name]["status"]]
        ran = 1 + len(GROUPS[group])  # data and the group's rows; the rest skipped
        assert summary[-1] == f"rows: {ran} PASS, 0 FAIL, {len(ROWS) - ran} SKIP", group
        assert "not GPU figures" in check.figures["device"] and check.figures["gpu"] is False
    summary = checks[ran_in("ddp")].figures["summary"]
    assert "compile unused: train.py compiles on CUDA only" in summary[ROWS.index("ddp") + 3]


# ----------------------------------------------------------------------------------------------------
# Last, once the check's runs have ended: this test waits out a timeout within which torchrun must have started its
# workers, which two cores busy with the runs could make it miss


def test_a_command_past_the_timeout_is_stopped_with_its_torchrun_workers(tmp_path):
    """torchrun's workers run in sessions of their own: stopping the command must end them too (on a GPU, a hung
    worker would hold the card), and the row fails saying so."""
    gpu_check = load_script()
    script = tmp_path / "hangs.py"
    script.write_text(f"import os, time\nopen(os.path.join({str(tmp_path)!r}, 'pid' + os.environ['RANK']), 'w')"
                      ".write(str(os.getpid()))\nprint('started', flush=True)\ntime.sleep(300)\n")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    # 8 s, which this test waits out: torchrun has its workers started in 2-3 s (importing torch), and 5 s was seen
    # too short once, on 2 cores busy with other work
    ctx = SimpleNamespace(log=str(tmp_path / "log.txt"), work=str(tmp_path), timeout=8, results={}, commands=[])
    start = time.perf_counter()
    gpu_check.run_rows(ctx, [("hangs", [], lambda ctx: gpu_check.must(ctx, torchrun))])
    assert time.perf_counter() - start < 60
    result = ctx.results["hangs"]
    assert result["status"] == "FAIL" and result["error"].startswith("timed out after 8 s (--timeout)"), result
    for rank in (0, 1):
        assert (tmp_path / f"pid{rank}").exists(), "torchrun's workers had not started within the timeout"
        pid = int((tmp_path / f"pid{rank}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
