"""Tests for train.py: errors a user sees, checkpoints, exact resume, signals, divergence, DDP, wandb, the
learning-rate schedule and the optimizer groups.

Runs use a tiny model on character-level Tiny Shakespeare prepared into a temporary folder (train.py reads
data/<dataset> relative to its working directory), and run in-process through train.main() where a separate
process is not the point of the test, since every process start costs seconds of `import torch`.
"""

import collections
import contextlib
import glob
import io
import json
import math
import os
import re
import resource
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import model as model_module
import train
from conftest import DEVICE, finished
from data.shakespeare_char import prepare as prepare_char
from gpt import UserError, mfu, parallel, progress
from gpt.shards import ShardLoader
from model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
TINY = ["--dataset=shakespeare_char", "--n_layer=1", "--n_head=2", "--n_kv_head=1", "--n_embd=32", "--block_size=32",
        "--batch_size=4", "--eval_iters=2", "--log_interval=1", "--compile=False", f"--device={DEVICE}",
        "--dtype=float32",
        "--warmup_iters=2", "--learning_rate=3e-3", "--min_lr=3e-4"]
TWO_PROCESSES = ["--device=cpu"]  # torchrun --nproc_per_node=2 on CUDA needs 2 GPUs; gloo on the CPU runs anywhere
TIME_KEYS = {"time", "ms_per_iter", "tokens_per_sec", "mfu", "first_step_s"}  # wall-clock figures, not reproducible


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A working directory holding data/shakespeare_char (prepared from the text shipped with the repo)."""
    path = tmp_path_factory.mktemp("work")
    prepare_char.main(["--out_dir", str(path / "data" / "shakespeare_char")])
    return path


@contextlib.contextmanager
def in_dir(path):
    """Run train.main() (or a script) in path, the cwd restored after; train.main restores the signal handlers itself
    (test_train_main_gives_its_caller_back_the_signal_handlers_and_threads)."""
    cwd = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(cwd)


def train_main(workdir, out_dir, *args):
    with in_dir(workdir):
        return train.main(TINY + [f"--out_dir={out_dir}", *args])


def records(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def without_times(recs):
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in recs]


def load_ckpt(out_dir):
    return torch.load(os.path.join(out_dir, "ckpt.pt"), map_location="cpu", weights_only=True)


def run_script(script, args, cwd, timeout=120):
    """What `python script args` in cwd gives, run in this process instead (a process costs seconds of `import
    torch`): a CompletedProcess of its exit status, stdout and stderr as the interpreter would make them. The script
    runs as __main__ (runpy); a message it exits with (sys.exit("error: ...")) goes to stderr with status 1, and so
    does an uncaught exception's traceback. For what a command prints and exits with, not what its process does.
    Past timeout seconds it is stopped (SIGALRM) with subprocess.TimeoutExpired, as subprocess.run(timeout=) does:
    a command that should have refused to start, started, ends the test instead of running on."""
    def expire(signum, frame):
        raise subprocess.TimeoutExpired([script, *args], timeout)

    stdout, stderr, argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv, returncode = [script, *args], 0
    alarm = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        with in_dir(cwd), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    returncode = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
                    returncode = 1
            except subprocess.TimeoutExpired:
                raise
            except Exception:
                traceback.print_exc()
                returncode = 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, alarm)
        sys.argv = argv
    return subprocess.CompletedProcess([script, *args], returncode, stdout.getvalue(), stderr.getvalue())


def assert_one_line_error(result, *needles):
    assert result.returncode == 1, (result.returncode, result.stderr)  # sys.exit("error: ...")
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def trained(workdir, tmp_path_factory):
    """A finished 30-iteration run (evaluated every 10): its out_dir, with ckpt.pt and metrics.jsonl."""
    out_dir = str(tmp_path_factory.mktemp("trained"))
    train_main(workdir, out_dir, "--max_iters=30", "--eval_interval=10", "--learning_rate=1e-2", "--min_lr=1e-3")
    return out_dir


# ----------------------------------------------------------------------------------------------------
# Errors a user sees: one line, what to do, no traceback


ERROR_RUNS = {"misspelled": ["--learnin_rate=1"], "no_data": TINY + ["--dataset=nope"]}
BAD_VALUES = {"batch_size": "0", "eval_interval": "0", "log_interval": "0", "learning_rate": "-1", "max_iters": "0"}
ERROR_RUNS.update({f"bad_{key}": TINY + [f"--{key}={value}"] for key, value in BAD_VALUES.items()})


@pytest.fixture(scope="module")
def error_runs(workdir, tmp_path_factory):
    """Exit status and stderr of `python train.py` for each of ERROR_RUNS (run_script: in this process)."""
    out_dir = str(tmp_path_factory.mktemp("errors"))
    return {name: run_script(TRAIN, [*args, f"--out_dir={out_dir}/{name}"], workdir)
            for name, args in ERROR_RUNS.items()}


def test_misspelled_setting_is_a_one_line_error_suggesting_the_right_one(error_runs):
    assert_one_line_error(error_runs["misspelled"], "learning_rate")


@pytest.mark.parametrize("key", BAD_VALUES)
def test_a_value_that_cannot_run_is_a_one_line_error_naming_the_setting_and_nothing_is_written(error_runs, key):
    """Before, numpy's or torch's traceback, a ZeroDivisionError, or (max_iters=0) a run that did nothing, exit 0."""
    expected = "must be positive" if key == "learning_rate" else "must be at least 1"
    assert_one_line_error(error_runs[f"bad_{key}"], f"{key} {expected}, got {BAD_VALUES[key]}")
    assert not os.path.exists(error_runs[f"bad_{key}"].args[-1].split("=", 1)[1])  # no out_dir holding only a lock


def test_a_resume_with_nothing_left_to_train_says_so_and_leaves_the_run_as_it_was(workdir, trained, tmp_path):
    out_dir = str(tmp_path / "run")
    shutil.copytree(trained, out_dir)
    before = file_bytes(os.path.join(out_dir, "ckpt.pt"))
    with pytest.raises(UserError, match=r"ckpt.pt is at iteration 30 already, so max_iters=20 leaves nothing to "
                                        r"train; pass a larger --max_iters to continue it"):
        train_main(workdir, out_dir, "--init_from=resume", "--max_iters=20")
    assert file_bytes(os.path.join(out_dir, "ckpt.pt")) == before


def test_a_finished_run_says_last_where_its_checkpoint_is(workdir, tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    train_main(workdir, out_dir, "--max_iters=2", "--eval_interval=2")
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (f"done at iter 2; checkpoint in {os.path.join(out_dir, 'ckpt.pt')}, sample from it with: "
                    f"python sample.py --out_dir={out_dir}")


def test_a_run_that_fails_before_writing_anything_leaves_no_out_dir(error_runs):
    failed = error_runs["no_data"]
    assert failed.returncode == 1 and not os.path.exists(failed.args[-1].split("=", 1)[1])


def test_missing_dataset_lists_the_datasets_and_commands_that_work(error_runs, workdir, tmp_path):
    """--dataset=nope in workdir, which has data/shakespeare_char prepared: the message lists the repository's datasets
    (data/<name>/prepare.py), names one prepared here to pass, and the prepare command of another, which works."""
    line = assert_one_line_error(error_runs["no_data"], "dataset folder data/nope not found")
    names = re.search(r"the datasets are ([\w, ]+) \(data/<name>/prepare.py\)", line).group(1).split(", ")
    assert names == sorted(n for n in os.listdir(os.path.join(ROOT, "data"))
                           if os.path.isfile(os.path.join(ROOT, "data", n, "prepare.py"))), line
    assert "nope" not in names and "shakespeare_char" in names
    passed = re.findall(r"pass --dataset=(\w+)", line)
    assert passed[0] == "shakespeare_char" and glob.glob(os.path.join(workdir, "data", passed[0], "*_train_*.bin"))
    command = shlex.split(re.search(r"prepare one, e\.g\. `([^`]+)`", line).group(1))
    assert command[0] == "python" and os.path.isfile(command[1]) and passed[1] in names
    prepared = run_script(command[1], command[2:], tmp_path)  # in this process: what it writes is the point
    assert prepared.returncode == 0, prepared.stderr
    with in_dir(tmp_path):  # what it wrote is the dataset --dataset=<name> reads, from where train.py was run
        ShardLoader(os.path.join("data", passed[1]), "train", batch_size=2, block_size=8)


def test_resume_without_a_checkpoint_says_to_train_first(workdir, tmp_path):
    with pytest.raises(UserError) as e:
        train_main(workdir, str(tmp_path), "--init_from=resume", "--max_iters=2")
    message = str(e.value)
    assert "\n" not in message and os.path.join(str(tmp_path), "ckpt.pt") in message
    assert "--init_from=scratch" in message and "train" in message


@pytest.mark.parametrize("keep", [0.5, 0.0], ids=["half", "empty"])
def test_truncated_checkpoint_is_a_one_line_error_naming_the_file(workdir, trained, tmp_path, keep):
    path = os.path.join(str(tmp_path), "ckpt.pt")
    with open(os.path.join(trained, "ckpt.pt"), "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:int(len(data) * keep)])
    with pytest.raises(UserError) as e:
        train_main(workdir, str(tmp_path), "--init_from=resume", "--max_iters=40")
    message = str(e.value)
    assert "\n" not in message and path in message and "truncated or corrupt" in message


# ----------------------------------------------------------------------------------------------------
# Checkpoints and a short run


def test_checkpoint_holds_everything_a_resume_needs(workdir, trained):
    ckpt = load_ckpt(trained)
    assert set(ckpt) >= {"model", "optimizers", "model_config", "settings", "meta", "iter_num", "best_val_loss", "loader"}
    assert ckpt["iter_num"] == 30
    config = GPTConfig(**ckpt["model_config"])
    assert (config.vocab_size, config.n_layer, config.n_head, config.n_kv_head, config.n_embd) == (128, 1, 2, 1, 32)
    GPT(config).load_state_dict(ckpt["model"])  # strict: every weight is there, with the right shape
    assert len(ckpt["optimizers"]) == 1 and ckpt["optimizers"][0]["state"]  # AdamW, with its moments
    assert ckpt["settings"]["max_iters"] == 30 and ckpt["settings"]["out_dir"] == trained
    with open(os.path.join(workdir, "data", "shakespeare_char", "meta.json")) as f:
        assert ckpt["meta"] == json.load(f)
    val_losses = [r["val_loss"] for r in records(trained) if "val_loss" in r]
    assert ckpt["best_val_loss"] == min(val_losses)
    assert set(ckpt["loader"]) == {"epoch", "shard", "window", "world_size"}
    assert ckpt["loader"]["window"] == 30 * 4  # 30 iterations of batch_size 4 windows, one shard


class ValuesReadByTheRepo(TorchDispatchMode):
    """Where the repo's own code reads a tensor's value (.item(), float(), bool(): a wait for the GPU there), as
    file:line; torch's own reads (AdamW's step count, a CPU tensor) are not the loop's."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in VALUE_READS:
            frame = sys._getframe(1)
            while frame.f_code.co_filename.endswith(DISPATCHING):  # torch's frames between a call and its mode
                frame = frame.f_back
            caller = frame.f_code.co_filename  # the Python line that asked for the value
            if caller.startswith(ROOT) and ".venv" not in caller:
                self.reads.append(f"{os.path.relpath(caller, ROOT)}:{frame.f_lineno}")
        return func(*args, **(kwargs or {}))


VALUE_READS = (torch.ops.aten._local_scalar_dense, torch.ops.aten.item, torch.ops.aten.is_nonzero)
DISPATCHING = ("torch/_dynamo/eval_frame.py", "torch/_compile.py", "torch/_ops.py", "torch/utils/_python_dispatch.py")


def test_the_loop_reads_values_from_the_device_only_to_log_them(workdir, tmp_path):
    """Issue 61: no wait for the GPU per iteration beyond what is logged. 16 iterations logged every 8 read what 8 do
    and one log more (its loss and gradient norm), not one value an iteration more."""
    reads = {}
    for iters in (8, 16):
        with ValuesReadByTheRepo() as seen:
            train_main(workdir, tmp_path / str(iters), f"--max_iters={iters}", "--log_interval=8", "--eval_interval=100")
        reads[iters] = seen.reads
    extra = list((collections.Counter(reads[16]) - collections.Counter(reads[8])).elements())
    assert 1 <= len(extra) <= 2, extra  # one log's: its loss and gradient norm


def test_val_loss_goes_down(trained):
    val = [(r["iter"], r["val_loss"]) for r in records(trained) if "val_loss" in r]
    assert [it for it, _ in val] == [0, 10, 20, 30]
    assert val[0][1] > math.log(65)  # an untrained model: about ln(128) on the padded vocabulary
    assert val[-1][1] < val[0][1] - 0.8, val
    train_losses = [r["loss"] for r in records(trained) if "loss" in r]
    assert len(train_losses) == 30 and all(math.isfinite(x) for x in train_losses)


# ----------------------------------------------------------------------------------------------------
# Exact resume, signals, divergence


@pytest.mark.parametrize("optimizer, dtype", [("adamw", "float32"), ("muon", "float32"), ("adamw", "float16")])
def test_resumed_run_equals_uninterrupted_run(workdir, tmp_path, optimizer, dtype, monkeypatch):
    """float16: the gradient scaler's state resumes too. Started at 2**20 (not 2**16), its first steps overflow here
    and are skipped, halving the scale (2**18 by iteration 4, as measured), as on a real fp16 GPU run; a fresh
    scaler after the resume would skip iteration 5 again."""
    scaler = torch.amp.GradScaler
    monkeypatch.setattr(torch.amp, "GradScaler", lambda *a, **k: scaler(*a, init_scale=2.0 ** 20, **k))
    args = ["--dropout=0.2", "--eval_interval=2", "--lr_decay_iters=8", f"--optimizer={optimizer}", f"--dtype={dtype}"]
    whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
    train_main(workdir, whole, *args, "--max_iters=8")
    train_main(workdir, split, *args, "--max_iters=4")
    assert load_ckpt(split)["iter_num"] == 4
    train_main(workdir, split, *args, "--max_iters=8", "--init_from=resume")
    expected, got = without_times(records(whole)), without_times(records(split))
    assert [r["iter"] for r in expected if "loss" in r] == list(range(1, 9))
    assert [r["iter"] for r in expected if "val_loss" in r] == [0, 2, 4, 6, 8]
    assert got == expected  # exact: loss, lr, grad_norm, train_loss and val_loss of every record
    a, b = load_ckpt(whole), load_ckpt(split)
    assert a["loader"] == b["loader"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


RESUMED = re.compile(r"^resumed from iteration (\d+) of (\d+) \(best val loss ([\d.]+)(?:, saved at (.+))?\)$", re.M)
CHANGED = re.compile(r"^settings changed since the checkpoint: (.*)$", re.M)
OLD_CKPT = os.path.join(ROOT, "tests", "data", "ckpt_before_restructure")  # see test_checkpoint.py


def changes(line):
    """{setting: (before, now, used)} from the changed-settings line (used: False for the model's settings, which the
    checkpoint's model config overrides), and the learning rate's jump (or None)."""
    listed, _, jump = line.partition("; the learning rate at iteration ")
    used, unused = re.fullmatch(r"(.*?)(?:(?:^|; )with no effect \(the model is the checkpoint's\): (.*))?",
                                listed).groups()
    unused = unused or ""
    found = {}
    for part, effect in ((used, True), (unused, False)):
        for item in part.split(", ") if part else []:
            key, was, now = re.fullmatch(r"(\w+) (\S+) -> (\S+)", item).groups()  # nothing else in the line
            found[key] = (was, now, effect)
    return found, jump or None


@pytest.fixture(scope="module")
def interrupted(workdir, tmp_path_factory):
    """A run of 6 iterations (evaluated every 2) stopped at iteration 3 as a signal stops it: its out_dir, holding the
    checkpoint of iteration 3, and the time before it started."""
    out_dir, started = str(tmp_path_factory.mktemp("interrupted")), time.time()
    steps, optimizer_step = [], train.optimizer_step

    def signal_in_step_3(*args):  # a SIGTERM to this process while it takes its third step (to iteration 3)
        steps.append(len(steps) + 1)
        if steps[-1] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return optimizer_step(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train, "optimizer_step", signal_in_step_3)
        assert train_main(workdir, out_dir, "--max_iters=6", "--eval_interval=2") == signal.SIGTERM
    assert load_ckpt(out_dir)["iter_num"] == 3
    return out_dir, started


def resume_copy(workdir, interrupted, tmp_path, capsys, *args):
    """Resume a copy of the interrupted run (in another out_dir, which is no change) with args; what it printed."""
    out_dir = str(tmp_path / "resumed")
    shutil.copytree(interrupted[0], out_dir)
    capsys.readouterr()
    train_main(workdir, out_dir, "--max_iters=6", "--eval_interval=2", *args, "--init_from=resume")
    return out_dir, capsys.readouterr().out


def test_a_plain_resume_says_where_it_resumed_and_lists_no_change(workdir, interrupted, tmp_path, capsys):
    out_dir, output = resume_copy(workdir, interrupted, tmp_path, capsys)
    assert len(RESUMED.findall(output)) == 1, output
    it, max_iters, best, saved_at = RESUMED.search(output).groups()
    ckpt = torch.load(os.path.join(interrupted[0], "ckpt.pt"), map_location="cpu", weights_only=True)
    assert (int(it), int(max_iters), best) == (3, 6, f"{ckpt['best_val_loss']:.4f}")
    saved = time.mktime(time.strptime(saved_at.rsplit(" ", 1)[0], "%Y-%m-%d %H:%M:%S"))
    assert interrupted[1] - 1 <= saved <= time.time(), saved_at  # when the interrupted run saved it, local time
    assert "settings changed" not in output, output  # init_from, out_dir differ: noise
    assert load_ckpt(out_dir)["iter_num"] == 6  # and it went on to max_iters


def test_a_resume_with_other_settings_lists_each_and_the_learning_rate_jump(workdir, interrupted, tmp_path, capsys):
    out_dir, output = resume_copy(workdir, interrupted, tmp_path, capsys, "--learning_rate=1e-3", "--max_iters=8",
                                  "--n_layer=2")
    assert RESUMED.search(output).group(1, 2) == ("3", "8"), output
    lines = CHANGED.findall(output)
    assert len(lines) == 1, output
    listed, jump = changes(lines[0])
    assert listed == {"learning_rate": ("0.003", "0.001", True), "max_iters": ("6", "8", True),
                      "n_layer": ("1", "2", False)}, lines[0]  # the model stays the checkpoint's: said so
    lr_from, lr_to = re.fullmatch(r"3 goes from (\S+) to (\S+)", jump).groups()
    before = dict(train.DEFAULTS, **load_ckpt(interrupted[0])["settings"])
    assert float(lr_from) == pytest.approx(3e-3 * train.lr_multiplier(3, before), rel=1e-2)
    first_step = next(r for r in records(out_dir) if r["iter"] == 4 and "lr" in r)  # the step from iteration 3
    assert float(lr_to) == pytest.approx(first_step["lr"], rel=1e-2) and float(lr_from) != float(lr_to)
    assert load_ckpt(out_dir)["model_config"]["n_layer"] == 1


def test_the_same_global_batch_on_another_process_count_is_no_change():
    """A 2-process run saves its settings as split (8 sequences a step: batch_size 4, total_batch_size 8 x 32 on
    each); the same command resumed on one process (batch_size 8, accumulation 1) was listed as changing both."""
    from gpt.resume import resume_report

    ran = dict(train.DEFAULTS, block_size=32, batch_size=8, gradient_accumulation_steps=1)
    checkpoint = dict(iter_num=3, best_val_loss=2.0, settings=dict(ran, batch_size=4, total_batch_size=8 * 32))
    assert not any("settings changed" in line for line in resume_report(checkpoint, ran, train.DEFAULTS,
                                                                           train.lr_multiplier))
    other = dict(ran, batch_size=16)  # another global batch: said
    (line,) = [line for line in resume_report(checkpoint, other, train.DEFAULTS, train.lr_multiplier)
               if line.startswith("settings changed")]
    assert changes(CHANGED.search(line).group(1))[0] == {"batch_size": ("4", "16", True),
                                                        "total_batch_size": ("256", "0", True)}


def test_a_checkpoint_from_before_the_restructure_resumes_with_the_line_without_a_time(workdir, tmp_path, capsys):
    with open(os.path.join(OLD_CKPT, "expected.json")) as f:
        old_settings = json.load(f)["settings"].split()
    old = torch.load(os.path.join(OLD_CKPT, "ckpt.pt"), map_location="cpu", weights_only=True)
    assert "saved_at" not in old and "loss_chunk" not in old["settings"]  # it predates both
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    shutil.copy(os.path.join(OLD_CKPT, "ckpt.pt"), out_dir / "ckpt.pt")
    capsys.readouterr()
    with in_dir(workdir):
        train.main(old_settings + [f"--out_dir={out_dir}", "--init_from=resume", "--max_iters=6", "--eval_interval=4"])
    output = capsys.readouterr().out
    assert RESUMED.findall(output) == [("4", "6", f"{old['best_val_loss']:.4f}", "")], output
    listed, jump = changes(CHANGED.search(output).group(1))
    assert listed == {"max_iters": ("4", "6", True)} and jump  # settings it predates are their defaults: no change
    assert load_ckpt(str(out_dir))["iter_num"] == 6 and "saved_at" in load_ckpt(str(out_dir))


def logged_iterations(metrics):
    """Iterations of the complete training records in metrics.jsonl so far (a line may be half-written)."""
    if not os.path.exists(metrics):
        return []
    with open(metrics) as f:
        return [json.loads(line)["iter"] for line in f if line.endswith("\n") and '"loss"' in line]


@contextlib.contextmanager
def in_background(command, cwd, log_path):
    """Start command with its output going to log_path (a file, not a pipe nobody reads while it runs);
    kill it on the way out if it is still running, so a failed assertion leaves no process behind."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def endless_runs(workdir, root, names):
    """train.py processes in the background, one per name (out_dir root/name/out), running until stopped, started
    side by side (each start costs seconds of `import torch`); yielded once each has logged 3 training records: it
    has installed its signal handlers and holds its out_dir's lock. Yields {name: (process, command, out_dir,
    log_path)}."""
    runs = {}
    with contextlib.ExitStack() as stack:
        for name in names:
            out_dir, log_path = str(root / name / "out"), str(root / name / "output.txt")
            os.makedirs(root / name, exist_ok=True)
            command = [sys.executable, TRAIN, *TINY, f"--out_dir={out_dir}", "--max_iters=1000000",
                       "--eval_interval=1000000"]
            runs[name] = (stack.enter_context(in_background(command, workdir, log_path)), command, out_dir, log_path)
        deadline = time.monotonic() + 120
        for proc, _, out_dir, log_path in runs.values():
            while len(logged_iterations(os.path.join(out_dir, "metrics.jsonl"))) < 3:
                assert proc.poll() is None, open(log_path).read()
                assert time.monotonic() < deadline, "no training iterations logged"
                time.sleep(0.05)
        yield runs


@pytest.fixture(scope="module")
def stopped_runs(workdir, tmp_path_factory):
    """Two endless runs, stopped as a user stops one: "sigterm" by SIGTERM, once a second run of the same command
    (in this process: run_script) was refused, and "killed" by SIGKILL. {name: (process, out_dir, its output)} and
    "second": (the second run's result, its seconds, whether the first still ran after it). The killed run is
    test_a_lock_left_by_a_killed_run_does_not_block_the_next's alone: it trains in that out_dir."""
    with endless_runs(workdir, tmp_path_factory.mktemp("stopped"), ("sigterm", "killed")) as runs:
        first, command, out_dir, _ = runs["sigterm"]
        start = time.monotonic()
        second = run_script(command[1], command[2:], workdir)
        stopped = {"second": (second, time.monotonic() - start, first.poll() is None)}
        first.send_signal(signal.SIGTERM)
        runs["killed"][0].kill()  # SIGKILL: no handler runs, the lock file stays behind
        for name, (proc, _, out_dir, log_path) in runs.items():
            proc.wait(timeout=60)
            with open(log_path) as f:
                stopped[name] = (proc, out_dir, f.read())
    return stopped


def test_sigterm_saves_a_loadable_checkpoint_and_resume_continues(stopped_runs, workdir, tmp_path):
    proc, out_dir, output = stopped_runs["sigterm"]
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in output, output  # a stop, not an end
    assert "stopping: a checkpoint is saved once the current step or evaluation ends" in output  # heard at once
    match = re.search(r"stopped by signal at iter (\d+); checkpoint saved to (\S+),", output)
    assert match, output
    stopped_at = int(match.group(1))
    assert match.group(2) == os.path.join(out_dir, "ckpt.pt") and "--init_from=resume" in output
    ckpt = load_ckpt(out_dir)  # weights_only=True
    assert ckpt["iter_num"] == stopped_at >= 3
    assert logged_iterations(os.path.join(out_dir, "metrics.jsonl")) == list(range(1, stopped_at + 1))  # each one

    resumed = str(tmp_path / "resumed")  # a copy: the run is the next test's too (a moved run resumes the same)
    shutil.copytree(out_dir, resumed)
    train_main(workdir, resumed, "--init_from=resume", f"--max_iters={stopped_at + 2}", "--eval_interval=1000000")
    assert logged_iterations(os.path.join(resumed, "metrics.jsonl")) == list(range(1, stopped_at + 3))
    assert load_ckpt(resumed)["iter_num"] == stopped_at + 2


def test_train_main_gives_its_caller_back_the_signal_handlers_and_threads(workdir, tmp_path, monkeypatch):
    """train.main in a caller's process (experiments/kv_heads.py runs several): the SIGINT and SIGTERM handlers and
    the thread count it found are the caller's again once it returns, so a Ctrl-C between runs is not a finished
    run's to swallow."""
    def callers_handler(signum, frame):
        pass
    handlers = {s: signal.signal(s, callers_handler) for s in (signal.SIGINT, signal.SIGTERM)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.chdir(workdir)
    try:
        train.main(TINY + [f"--out_dir={tmp_path / 'out'}", "--max_iters=2", "--threads=2"])
        assert [signal.getsignal(s) for s in handlers] == [callers_handler] * 2
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
        for s, handler in handlers.items():
            signal.signal(s, handler)


def poison_loss_after(monkeypatch, n_good, ckpt_path):
    """From training forward call n_good + 1 on, the loss is NaN; the checkpoint file's bytes (or None) at
    the first NaN are recorded in the returned dict."""
    forward, state = model_module.GPT.forward, {"calls": 0, "ckpt_at_nan": "not reached"}

    def nan_forward(self, idx, targets=None, kv_cache=None, **kwargs):
        logits, loss = forward(self, idx, targets, kv_cache, **kwargs)
        if self.training and targets is not None:
            state["calls"] += 1
            if state["calls"] > n_good:
                if state["ckpt_at_nan"] == "not reached":
                    state["ckpt_at_nan"] = open(ckpt_path, "rb").read() if os.path.exists(ckpt_path) else None
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(model_module.GPT, "forward", nan_forward)
    return state


@pytest.mark.parametrize("log_interval", [1, 100], ids=["caught-in-train-log", "caught-in-eval"])
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(workdir, tmp_path, monkeypatch, log_interval):
    out_dir = str(tmp_path)
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    # checkpoints at the evaluations of iterations 2 and 4; the step of iteration 5 makes the loss NaN, which the
    # log at iteration 6 (log_interval 1) or the evaluation at iteration 6 (log_interval 100) finds
    state = poison_loss_after(monkeypatch, 5, ckpt_path)
    with pytest.raises(UserError) as e:
        train_main(workdir, out_dir, "--max_iters=20", "--eval_interval=2", f"--log_interval={log_interval}")
    message = str(e.value)
    assert "\n" not in message
    assert "loss is nan at iter 6" in message and ckpt_path in message and "is kept" in message, message
    assert state["ckpt_at_nan"] not in (None, "not reached")
    with open(ckpt_path, "rb") as f:
        assert f.read() == state["ckpt_at_nan"]
    assert load_ckpt(out_dir)["iter_num"] == 4
    assert all(math.isfinite(r.get("loss", 0)) and math.isfinite(r.get("val_loss", 0)) for r in records(out_dir))


def test_nan_loss_before_any_checkpoint_says_none_was_saved(workdir, tmp_path, monkeypatch):
    out_dir = str(tmp_path)
    poison_loss_after(monkeypatch, 0, os.path.join(out_dir, "ckpt.pt"))
    with pytest.raises(UserError) as e:
        train_main(workdir, out_dir, "--max_iters=20", "--eval_interval=1000")
    message = str(e.value)
    assert "loss is nan at iter 1" in message and "no checkpoint was saved" in message, message
    assert not os.path.exists(os.path.join(out_dir, "ckpt.pt"))


# ----------------------------------------------------------------------------------------------------
# No run lost: a full disk, a second run, a run from scratch over a finished one, a torn log line, a stop
# during a checkpoint write. Each fault is really injected: a file size limit (RLIMIT_FSIZE) makes the
# kernel refuse the write, processes really run side by side and really get signals.


def file_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def test_a_run_from_scratch_over_a_run_is_refused_and_overwrite_replaces_it(workdir, tmp_path):
    out_dir = str(tmp_path)
    train_main(workdir, out_dir, "--max_iters=3", "--eval_interval=2")
    ckpt, log = file_bytes(os.path.join(out_dir, "ckpt.pt")), file_bytes(os.path.join(out_dir, "metrics.jsonl"))
    for init_from in ("scratch", "hf:folder"):  # hf: is checked before the folder is read: nothing is loaded
        with pytest.raises(UserError) as e:
            train_main(workdir, out_dir, "--max_iters=2", "--eval_interval=2", f"--init_from={init_from}")
        message = str(e.value)
        assert "\n" not in message and os.path.join(out_dir, "ckpt.pt") in message, message
        assert all(way in message for way in ("--init_from=resume", "another --out_dir", "--overwrite")), message
    assert file_bytes(os.path.join(out_dir, "ckpt.pt")) == ckpt  # untouched: still loads, still iteration 3
    assert file_bytes(os.path.join(out_dir, "metrics.jsonl")) == log and load_ckpt(out_dir)["iter_num"] == 3
    # a run that will fail (a val split shorter than one window; the train split has a few) fails before it replaces:
    # its evaluation's loader was once made at the first evaluation, after the earlier run's files were removed
    with pytest.raises(UserError, match="the val split .* is shorter than one window of block_size"):
        train_main(workdir, out_dir, "--max_iters=2", "--overwrite", "--block_size=200000")
    assert file_bytes(os.path.join(out_dir, "ckpt.pt")) == ckpt
    assert file_bytes(os.path.join(out_dir, "metrics.jsonl")) == log

    train_main(workdir, out_dir, "--max_iters=2", "--eval_interval=2", "--overwrite")
    assert [r["iter"] for r in records(out_dir)] == [0, 1, 2, 2]  # a fresh log
    assert load_ckpt(out_dir)["iter_num"] == 2


def start_limited(command, cwd, max_file_bytes):
    """Start command with files it writes limited to max_file_bytes: past that, the kernel refuses the write
    (EFBIG, "File too large"), what a full disk or a quota does (ENOSPC, EDQUOT)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    return subprocess.Popen(command, cwd=cwd, preexec_fn=limit, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


FULL_DISK = ["--eval_interval=2", "--dropout=0.1", "--lr_decay_iters=8"]


@pytest.fixture(scope="module")
def full_disk_runs(workdir, tmp_path_factory):
    """For each file whose write fails: a run of 4 iterations, resumed to 8 in a process whose writes past a size
    the kernel refuses; the two resumes side by side. {file: (out_dir, ckpt.pt's bytes before the resume, the
    resume's result)}; each out_dir is that file's test's alone, which continues the run in it."""
    started = {}
    for failing in ("ckpt.pt", "metrics.jsonl"):
        out_dir = str(tmp_path_factory.mktemp("full_disk"))
        train_main(workdir, out_dir, *FULL_DISK, "--max_iters=4")
        saved = file_bytes(os.path.join(out_dir, "ckpt.pt"))
        # The resumed run writes its log records of iterations 5, 6 and its checkpoint at 6: with room for the
        # log only, the checkpoint write fails; with room for less than one more record, a log append fails.
        log_size = os.path.getsize(os.path.join(out_dir, "metrics.jsonl"))
        room = len(saved) // 2 if failing == "ckpt.pt" else log_size + 40
        command = [sys.executable, TRAIN, *TINY, f"--out_dir={out_dir}", *FULL_DISK, "--max_iters=8",
                   "--init_from=resume"]
        started[failing] = (out_dir, saved, start_limited(command, workdir, room))
    runs = {}
    for failing, (out_dir, saved, proc) in started.items():
        runs[failing] = (out_dir, saved, finished(proc, timeout=300))
    return runs


@pytest.mark.parametrize("failing", ["ckpt.pt", "metrics.jsonl"])
def test_a_full_disk_stops_the_run_and_keeps_the_last_checkpoint(full_disk_runs, workdir, tmp_path, failing, capsys):
    out_dir, saved, result = full_disk_runs[failing]
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    line = assert_one_line_error(result, "could not write", f"{os.path.join(out_dir, failing)} (File too large)",
                                 "continue from it with --init_from=resume")
    assert not glob.glob(os.path.join(out_dir, "*.tmp")), line
    assert file_bytes(ckpt_path) == saved and load_ckpt(out_dir)["iter_num"] == 4

    # once there is room again, the resume the message names works and gives the uninterrupted run's log
    capsys.readouterr()
    train_main(workdir, out_dir, *FULL_DISK, "--max_iters=8", "--init_from=resume")
    dropped = "dropped its torn last line" in capsys.readouterr().out
    assert dropped == (failing == "metrics.jsonl")  # the append that failed left part of a line
    train_main(workdir, str(tmp_path / "whole"), *FULL_DISK, "--max_iters=8")
    assert without_times(records(out_dir)) == without_times(records(str(tmp_path / "whole")))


def test_a_torn_last_log_line_is_dropped_on_resume_and_a_torn_middle_line_is_an_error(workdir, tmp_path, capsys):
    out_dir = str(tmp_path)
    log_path = os.path.join(out_dir, "metrics.jsonl")
    train_main(workdir, out_dir, "--max_iters=4", "--eval_interval=2")
    lines = open(log_path).readlines()
    with open(log_path, "a") as f:
        f.write('{"iter": 5, "time": 0.1, "lo')  # what a power cut leaves: part of a line, no newline
    capsys.readouterr()
    train_main(workdir, out_dir, "--max_iters=6", "--eval_interval=2", "--init_from=resume")
    output = capsys.readouterr().out
    assert f"{log_path}: dropped its torn last line" in output and output.count("dropped") == 1, output
    assert [r["iter"] for r in records(out_dir)] == [0, 1, 2, 2, 3, 4, 4, 5, 6, 6]  # continued, each once
    assert open(log_path).readlines()[:len(lines)] == lines

    torn = open(log_path).readlines()
    torn[3] = torn[3][:20] + "\n"  # a torn line with complete lines after it: not a crash's trace
    with open(log_path, "w") as f:
        f.writelines(torn)
    with pytest.raises(UserError) as e:
        train_main(workdir, out_dir, "--max_iters=8", "--eval_interval=2", "--init_from=resume")
    message = str(e.value)
    assert "\n" not in message and f"{log_path}, line 4: not valid JSON" in message, message
    assert open(log_path).readlines() == torn and load_ckpt(out_dir)["iter_num"] == 6


def test_a_second_run_on_the_same_out_dir_exits_at_once_and_the_first_is_untouched(stopped_runs):
    first, out_dir, output = stopped_runs["sigterm"]
    second, seconds, first_ran_on = stopped_runs["second"]
    assert_one_line_error(second, f"{out_dir} is in use by another training run (process {first.pid})")
    assert seconds < 30 and first_ran_on  # it did not wait for the first; the first runs on
    assert first.returncode == 128 + signal.SIGTERM, output  # stopped, with a checkpoint
    stopped_at = load_ckpt(out_dir)["iter_num"]
    metrics = os.path.join(out_dir, "metrics.jsonl")
    assert logged_iterations(metrics) == list(range(1, stopped_at + 1))  # one run's records, each once


def test_a_lock_left_by_a_killed_run_does_not_block_the_next(stopped_runs, workdir):
    proc, out_dir, _ = stopped_runs["killed"]
    assert open(os.path.join(out_dir, "lock")).read() == str(proc.pid)
    train_main(workdir, out_dir, "--max_iters=2", "--eval_interval=2")  # no checkpoint was saved: a fresh run
    assert [r["iter"] for r in records(out_dir)] == [0, 1, 2, 2]


SLOW_SAVE = """
import os, runpy, sys, time, torch
real_save, marker = torch.save, sys.argv[1]

def slow_save(obj, f):  # a checkpoint write that takes 1 s after its data is written, before the rename: the test
    real_save(obj, f)  # sees the marker within its 0.02 s polls and signals well inside that second
    open(marker, "w").close()
    time.sleep(1)

torch.save = slow_save
train_py, sys.argv = sys.argv[2], sys.argv[2:]
sys.path.insert(0, os.path.dirname(train_py))
runpy.run_path(train_py, run_name="__main__")
"""


def test_a_second_signal_during_a_checkpoint_write_ends_the_run_and_the_last_checkpoint_stays_whole(workdir, tmp_path):
    """A first signal during a write lets it finish, then the run saves and stops; a second ends the process at once,
    mid-write (the documented behaviour): ckpt.pt is still the last one written whole, since a write goes to a temp
    file that only a finished write renames."""
    out_dir, log_path, marker = str(tmp_path / "out"), str(tmp_path / "output.txt"), str(tmp_path / "writing")
    (tmp_path / "slow_save.py").write_text(SLOW_SAVE)
    command = [sys.executable, str(tmp_path / "slow_save.py"), marker, TRAIN, *TINY, f"--out_dir={out_dir}",
               "--max_iters=1000000", "--eval_interval=3"]

    def wait_for_write():
        deadline = time.monotonic() + 120
        while not os.path.exists(marker):
            assert proc.poll() is None and time.monotonic() < deadline, open(log_path).read()
            time.sleep(0.02)
        os.remove(marker)

    with in_background(command, workdir, log_path) as proc:
        wait_for_write()  # the checkpoint of iteration 3 is being written
        proc.send_signal(signal.SIGTERM)  # asks the run to stop: it finishes this write, saves iteration 4, stops
        wait_for_write()  # the checkpoint of iteration 4 is being written: its data is in the temp file
        proc.send_signal(signal.SIGTERM)  # a second signal ends the process before the rename
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGTERM, open(log_path).read()
    assert load_ckpt(out_dir)["iter_num"] == 3  # whole: the write of iteration 4 never replaced it


# ----------------------------------------------------------------------------------------------------
# wandb (runs on several processes: tests/test_parallel.py)


def test_offline_wandb_run_writes_its_files(workdir, tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # a requirement, absent from the GPU machine
    for key, value in dict(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONSOLE="off").items():
        monkeypatch.setenv(key, value)
    out_dir = str(tmp_path)
    train_main(workdir, out_dir, "--max_iters=2", "--eval_interval=2", "--wandb_log=True")
    run_dirs = glob.glob(os.path.join(out_dir, "wandb", "offline-run-*"))
    assert len(run_dirs) == 1, os.listdir(out_dir)
    assert glob.glob(os.path.join(run_dirs[0], "*.wandb"))


def test_wandb_log_without_wandb_installed_is_a_one_line_error(workdir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(UserError, match="pip install wandb"):
        train_main(workdir, str(tmp_path), "--max_iters=2", "--wandb_log=True")
    assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))


# ----------------------------------------------------------------------------------------------------
# Learning-rate schedule and optimizer groups


def schedule(**overrides):
    return dict(dict(learning_rate=1e-3, min_lr=1e-4, warmup_iters=10, max_iters=100, lr_decay_iters=0,
                     lr_schedule="cosine", cooldown_frac=0.2), **overrides)


def lr_at(it, settings):
    return settings["learning_rate"] * train.lr_multiplier(it, settings)


def test_lr_warmup_is_linear_from_lr_over_warmup_iters():
    s = schedule()
    for it in range(10):
        assert lr_at(it, s) == pytest.approx(1e-3 * (it + 1) / 10)
    assert lr_at(9, schedule(lr_schedule="wsd")) == pytest.approx(1e-3)
    assert lr_at(0, schedule(lr_schedule="wsd")) == pytest.approx(1e-4)


def test_lr_cosine_decays_to_min_lr_at_lr_decay_iters():
    s = schedule()  # lr_decay_iters=0: decay over max_iters=100, after 10 warmup iterations
    assert lr_at(10, s) == pytest.approx(1e-3)
    assert lr_at(55, s) == pytest.approx((1e-3 + 1e-4) / 2)  # half way through the cosine: the mean
    assert lr_at(32.5, s) == pytest.approx(1e-4 + 0.9e-3 * (1 + math.cos(math.pi / 4)) / 2)
    assert lr_at(100, s) == pytest.approx(1e-4) and lr_at(250, s) == pytest.approx(1e-4)
    lrs = [lr_at(it, s) for it in range(10, 101)]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))
    s = schedule(lr_decay_iters=50, max_iters=200)  # lr_decay_iters, when set, wins over max_iters
    assert lr_at(30, s) == pytest.approx((1e-3 + 1e-4) / 2) and lr_at(50, s) == pytest.approx(1e-4)


def test_lr_wsd_holds_then_cools_down_linearly_to_min_lr():
    s = schedule(lr_schedule="wsd", lr_decay_iters=100, max_iters=200)  # cooldown: the last 20 of 100
    for it in (10, 40, 79, 80):
        assert lr_at(it, s) == pytest.approx(1e-3)
    assert lr_at(90, s) == pytest.approx((1e-3 + 1e-4) / 2)
    assert lr_at(95, s) == pytest.approx(1e-4 + 0.9e-3 / 4)
    assert lr_at(100, s) == pytest.approx(1e-4) and lr_at(150, s) == pytest.approx(1e-4)


def optimizer_setup(optimizer):
    model = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, bias=True,
                          tie_embeddings=False))
    settings = dict(train.DEFAULTS, optimizer=optimizer, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {n for n in names.values() if n.endswith(".bias") or "norm" in n}
    return model, settings, names, no_decay


def group_names(group, names):
    return {names[id(p)] for p in group["params"]}


def test_make_optimizers_adamw_decays_matrices_only():
    model, settings, names, no_decay = optimizer_setup("adamw")
    (adamw,) = train.make_optimizers(model, settings, "cpu")
    assert isinstance(adamw, torch.optim.AdamW)
    decay = [g for g in adamw.param_groups if g["weight_decay"] == 0.1]
    zero = [g for g in adamw.param_groups if g["weight_decay"] == 0.0]
    assert len(decay) == len(zero) == 1 and len(adamw.param_groups) == 2
    assert group_names(zero[0], names) == no_decay
    assert group_names(decay[0], names) == set(names.values()) - no_decay
    assert {"embed_tokens.weight", "lm_head.weight", "layers.0.mlp.up_proj.weight"} <= group_names(decay[0], names)
    assert {"norm.weight", "layers.1.self_attn.q_norm.weight", "layers.0.mlp.down_proj.bias"} <= no_decay


def test_make_optimizers_muon_takes_the_block_matrices_and_adamw_the_rest():
    """The rule, on whatever parameters model.py has (an edit adding one, like learned positions, still passes):
    each parameter in exactly one group; Muon the matrices inside the blocks, AdamW the other matrices with decay
    and the norms and biases without."""
    model, settings, names, no_decay = optimizer_setup("muon")
    adamw, muon = train.make_optimizers(model, settings, "cpu")
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(muon, torch.optim.Muon)
    groups = [*adamw.param_groups, *muon.param_groups]
    assert sorted(names[id(p)] for g in groups for p in g["params"]) == sorted(names.values())  # each exactly once
    in_blocks = {names[id(p)] for p in model.layers.parameters()}
    matrices = set(names.values()) - no_decay
    assert set().union(*(group_names(g, names) for g in muon.param_groups)) == matrices & in_blocks
    adamw_groups = {g["weight_decay"]: group_names(g, names) for g in adamw.param_groups}
    assert adamw_groups == {0.1: matrices - in_blocks, 0.0: no_decay}
    assert {"layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight"} <= matrices & in_blocks
    assert {"embed_tokens.weight", "lm_head.weight"} <= adamw_groups[0.1]
    with pytest.raises(UserError, match="optimizer"):
        train.make_optimizers(model, dict(settings, optimizer="sgd"), "cpu")
    assert [g["momentum"] for g in muon.param_groups] == [0.95]  # torch's default, unless muon_momentum says
    _, muon = train.make_optimizers(model, dict(settings, muon_momentum=0.9), "cpu")
    assert [g["momentum"] for g in muon.param_groups] == [0.9]


def test_the_muon_momentum_setting_reaches_the_run_and_its_checkpoint(workdir, tmp_path):
    out_dir = str(tmp_path / "run")
    train_main(workdir, out_dir, "--optimizer=muon", "--muon_momentum=0.9", "--max_iters=2", "--eval_interval=2")
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)
    muon_groups = checkpoint["optimizers"][1]["param_groups"]
    assert [g["momentum"] for g in muon_groups] == [0.9] and checkpoint["settings"]["muon_momentum"] == 0.9


def test_muon_momentum_outside_zero_to_one_is_a_one_line_error():
    for bad in (1.0, -0.1):
        with pytest.raises(UserError, match=rf"^muon_momentum must be at least 0 and below 1, got {bad}$"):
            train.check_settings(dict(train.DEFAULTS, muon_momentum=bad))
    assert train.check_settings(dict(train.DEFAULTS, muon_momentum=0.9))["muon_momentum"] == 0.9


@pytest.mark.parametrize("key, bad, message", [
    # a negative chunk summed no loss (0.0, "improved") and saved NaN weights over a good checkpoint
    ("loss_chunk", -1, "loss_chunk must be at least 0, got -1"),
    ("threads", -1, "threads must be at least 0, got -1"),  # torch.set_num_threads' RuntimeError
    ("beta1", 1.0, "beta1 must be at least 0 and below 1, got 1.0"),  # AdamW's ValueError, once the model was built
    ("beta2", -0.5, "beta2 must be at least 0 and below 1, got -0.5"),
    ("cooldown_frac", 1.5, r"cooldown_frac must be in \[0, 1\] \(wsd's share of the decay\), got 1.5"),
    ("lr_schedule", "linear", "lr_schedule must be cosine or wsd, got 'linear'"),  # ran as cosine
])
def test_a_setting_that_would_fail_or_mislead_the_run_is_refused_before_it_starts(key, bad, message):
    with pytest.raises(UserError, match=f"^{message}$"):
        train.check_settings(dict(train.DEFAULTS, **{key: bad}))
    edge = dict(loss_chunk=0, threads=0, beta1=0.0, beta2=0.999, cooldown_frac=1.0, lr_schedule="wsd")[key]
    assert train.check_settings(dict(train.DEFAULTS, **{key: edge}))[key] == edge


def test_muon_leaves_an_embedding_inside_a_block_to_adamw():
    """An edit that puts an embedding in a block (value embeddings) keeps it out of Muon's orthogonalization."""
    model, settings, names, _ = optimizer_setup("muon")
    model.layers[0].value_embed = torch.nn.Embedding(128, 32)
    adamw, muon = train.make_optimizers(model, settings, "cpu")
    assert any(p is model.layers[0].value_embed.weight for g in adamw.param_groups for p in g["params"])
    assert all(p is not model.layers[0].value_embed.weight for g in muon.param_groups for p in g["params"])


# ----------------------------------------------------------------------------------------------------
# MFU's peak


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12),  # SXM
    ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),  # not the SXM's figure, though the name holds "H100"
    ("NVIDIA H100 NVL", torch.bfloat16, 835e12),
    ("NVIDIA A100-SXM4-40GB", torch.bfloat16, 312e12),
    ("NVIDIA A10", torch.float16, 125e12),
    ("NVIDIA L40S", torch.bfloat16, 362e12),
    ("NVIDIA GeForce RTX 3090", torch.bfloat16, 71e12),
    ("Tesla T4", torch.float16, 65e12),
    ("Tesla T4", torch.bfloat16, None),  # no bfloat16 tensor cores: no honest peak
    ("Tesla V100-SXM2-32GB", torch.float16, 125e12),
    ("NVIDIA H100 80GB HBM3", torch.float32, None),
    ("NVIDIA B200", torch.bfloat16, None),  # not in the table: no MFU, and train.py says to pass --peak_flops
])
def test_each_gpu_name_gets_its_own_peak(name, dtype, peak):
    assert mfu.peak_flops(name, dtype) == peak


@pytest.mark.parametrize("n_kv_head", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_flops_per_token_matches_counted_flops(n_kv_head):
    """PaLM's 6N + 12 L H hd T against the matmul FLOPs PyTorch counts in one training step."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = GPT(GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=64))
    idx = torch.randint(0, 97, (3, 32))
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):  # the math kernel's matmuls are visible to the counter
        _, loss = model(idx, idx)
        loss.backward()
    assert mfu.flops_per_token(model, 32) * idx.numel() == counter.get_total_flops()
    assert mfu.mfu(model, 1000.0, mfu.flops_per_token(model, 32) * 4000.0, 32) == pytest.approx(0.25)


def test_a_run_with_a_chunked_loss_trains_as_the_plain_one(workdir, tmp_path):
    """train.py's loss_chunk changes memory, not the run: the same logged losses (model.chunked_loss)."""
    for name, chunk in (("plain", 0), ("chunked", 37)):
        train_main(workdir, str(tmp_path / name), "--max_iters=4", "--eval_interval=2", f"--loss_chunk={chunk}")
    plain, chunked = records(str(tmp_path / "plain")), records(str(tmp_path / "chunked"))
    assert [r["iter"] for r in chunked] == [r["iter"] for r in plain]
    for p, c in zip(plain, chunked):
        for key in ("loss", "train_loss", "val_loss", "grad_norm"):
            if key in p:
                assert abs(p[key] - c[key]) < 1e-5, (key, p, c)


# ----------------------------------------------------------------------------------------------------
# The global batch and the timing of steps


def gpt2_124m_settings(**overrides):
    from configurator import configure

    with in_dir(ROOT):
        return configure(train.DEFAULTS, ["config/gpt2_124m.py", *(f"--{k}={v}" for k, v in overrides.items())])


def global_batch(settings, world_size):
    """Tokens per optimizer step that world_size processes train with these settings."""
    micro_steps = parallel.micro_steps_per_process(settings, world_size)
    return micro_steps * world_size * settings["batch_size"] * settings["block_size"]


def test_the_124m_global_batch_holds_on_every_process_count_that_divides_it():
    settings = gpt2_124m_settings()
    assert {n: parallel.micro_steps_per_process(settings, n) for n in (1, 2, 4, 8)} == {1: 8, 2: 4, 4: 2, 8: 1}
    assert all(global_batch(settings, n) == 524288 for n in (1, 2, 4, 8))
    assert global_batch(gpt2_124m_settings(batch_size=16), 8) == 524288  # a smaller micro-batch: more micro-steps


@pytest.mark.parametrize("world_size, overrides", [(3, {}), (6, {}), (7, {}), (2, dict(batch_size=48)),
                                                   (1, dict(total_batch_size=1000)), (3, dict(batch_size=24))])
def test_a_global_batch_that_does_not_split_names_what_to_pass_and_that_works(world_size, overrides):
    settings = gpt2_124m_settings(**overrides)
    with pytest.raises(UserError) as e:
        parallel.micro_steps_per_process(settings, world_size)
    message = str(e.value)
    assert "\n" not in message
    key, value = re.search(r"pass --(\w+)=(\d+)", message).groups()
    fixed = dict(settings, **{key: int(value)})
    assert global_batch(fixed, world_size) == fixed["total_batch_size"]  # what it says to pass runs
    if "run on" in message:  # and the process counts it names do too
        counts = [int(n) for n in re.search(r"run on ([\d, ]+) process", message).group(1).split(", ")]
        assert counts and all(global_batch(settings, n) == settings["total_batch_size"] for n in counts)


def small_settings():
    from configurator import configure

    with in_dir(ROOT):
        return configure(train.DEFAULTS, ["config/small.py"])


def test_config_small_runs_as_it_is_on_every_process_count_that_divides_its_batch():
    """config/small.py (10 sequences a step, one micro-step) under torchrun: each of 1, 2, 5 or 10 processes takes its
    share of the 10 in one micro-step, the global batch the same; 3 and 4 processes are refused, naming what works."""
    settings = small_settings()
    for world_size, share in ((1, 10), (2, 5), (5, 2), (10, 1)):
        split, note = parallel.split_over_processes(settings, world_size)
        assert split["batch_size"] == share and (note is None) == (world_size == 1)
        assert parallel.micro_steps_per_process(split, world_size) == 1
        assert global_batch(split, world_size) == 10 * 128
    for world_size in (3, 4):
        split, note = parallel.split_over_processes(settings, world_size)
        assert split == settings and note is None
        with pytest.raises(UserError, match=rf"pass --gradient_accumulation_steps={world_size}"):
            parallel.micro_steps_per_process(split, world_size)


def test_total_batch_size_and_accumulation_steps_together_are_refused():
    with pytest.raises(UserError, match="pass one of them"):
        parallel.micro_steps_per_process(gpt2_124m_settings(gradient_accumulation_steps=2), 1)


def test_the_first_step_is_timed_alone_and_left_out_of_ms_per_iter(workdir, tmp_path, monkeypatch):
    """The first step compiles (CUDA) and warms up: a slow first step (here a 1 s sleep in its forward pass, far
    above a step's own milliseconds) is logged once as first_step_s and not in the throughput of its log interval."""
    forward, calls = model_module.GPT.forward, []

    def slow_first_forward(self, *args, **kwargs):
        if self.training:
            calls.append(1)
            if len(calls) == 1:
                time.sleep(1.0)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(model_module.GPT, "forward", slow_first_forward)
    for log_interval in (2, 1):
        out_dir = str(tmp_path / f"log_{log_interval}")
        calls.clear()
        train_main(workdir, out_dir, "--max_iters=6", "--eval_interval=100", f"--log_interval={log_interval}")
        logs = [r for r in records(out_dir) if "loss" in r]
        assert [r["iter"] for r in logs] == list(range(log_interval, 7, log_interval))
        assert logs[0]["first_step_s"] >= 1.0 and all("first_step_s" not in r for r in logs[1:])
        timed = logs[1:] if log_interval == 1 else logs  # an interval of the first step alone has no throughput
        assert all(r["ms_per_iter"] < 250 for r in timed), timed  # with the first step: >= 500
        assert log_interval > 1 or "ms_per_iter" not in logs[0]


def test_ms_per_iter_counts_every_step_of_its_interval_and_no_evaluation(workdir, tmp_path, monkeypatch):
    """Steps of 0.1 s (a sleep in each training forward, far above a step's own milliseconds) and evaluations of
    0.5 s, at iterations that are not log iterations (eval_interval 3, log_interval 2): every logged ms/iter is a
    step's 0.1 s, not diluted by steps whose time was dropped at an evaluation (one step's time over 2: 50 ms) nor
    raised by the evaluation itself (2 steps and an evaluation over 2: 350 ms)."""
    forward, estimate_loss = model_module.GPT.forward, train.estimate_loss

    def slow_forward(self, *args, **kwargs):
        if self.training:
            time.sleep(0.1)
        return forward(self, *args, **kwargs)

    def slow_estimate_loss(*args, **kwargs):
        time.sleep(0.5)
        return estimate_loss(*args, **kwargs)

    monkeypatch.setattr(model_module.GPT, "forward", slow_forward)
    monkeypatch.setattr(train, "estimate_loss", slow_estimate_loss)
    train_main(workdir, str(tmp_path / "out"), "--max_iters=8", "--eval_interval=3", "--log_interval=2")
    timed = [r["ms_per_iter"] for r in records(str(tmp_path / "out")) if "ms_per_iter" in r]
    assert len(timed) == 4 and all(100 <= ms < 300 for ms in timed), timed


def test_each_record_is_one_line_showing_every_figure_but_the_time(capsys):
    """Log.record writes the record (to metrics.jsonl, here a list) and prints it as one line in its order, as README
    shows it: an evaluation's (an lm-eval score as name and value) and a log's, with MFU and peak memory."""
    written = []
    log = progress.Log(types.SimpleNamespace(log=written.append), max_iters=950)
    evaluation = dict(iter=0, time=3.8, train_loss=4.88032, val_loss=4.87943, **{"hellaswag/acc": 0.25})
    step = dict(iter=10, time=5.6, loss=4.66547, lr=8e-4, grad_norm=3.94787, first_step_s=0.194, ms_per_iter=111.43,
                tokens_per_sec=11495.2, mfu=0.4531, peak_memory_gb=1.23)
    log.record(evaluation)
    log.record(step)
    assert written == [evaluation, step]
    assert capsys.readouterr().out.splitlines() == [
        "iter 0: train loss 4.8803, val loss 4.8794, hellaswag/acc 0.2500",
        "iter 10: loss 4.6655, lr 8.00e-04, grad norm 3.948, first step 0.2 s, 111.4 ms/iter, 11,495 tokens/s, "
        "MFU 45.3%, peak memory 1.2 GB"]
    progress.Log(None, max_iters=950).record(step)  # another rank's: nothing written or printed
    assert written == [evaluation, step] and capsys.readouterr().out == ""


def test_mfu_is_the_training_flops_over_the_peak(workdir, tmp_path):
    """With --peak_flops (a GPU's peak is looked up instead) every timed log has MFU: the model's training FLOPs per
    token (gpt/mfu.py) times its tokens/s, over the peak of all processes."""
    train_main(workdir, tmp_path, "--max_iters=4", "--eval_interval=100", "--peak_flops=1e12")
    timed = [r for r in records(tmp_path) if "ms_per_iter" in r]
    model = GPT(GPTConfig(**load_ckpt(tmp_path)["model_config"]))
    assert len(timed) == 3 and all(r["mfu"] == pytest.approx(mfu.flops_per_token(model, 32) * r["tokens_per_sec"] / 1e12)
                                   for r in timed)


def test_timings_wait_for_the_gpu_on_a_mac_too(monkeypatch):
    """The first step's time and each evaluation's are taken once the GPU has finished (the CPU runs ahead of it):
    on MPS as on CUDA. torch.mps.synchronize's C function is faked here, counting its calls."""
    calls = []
    monkeypatch.setattr(torch._C, "_mps_deviceSynchronize", lambda: calls.append("mps"), raising=False)
    progress.synced_time("mps")
    assert calls == ["mps"]
    progress.synced_time("cpu")
    assert calls == ["mps"]


def test_a_resumed_run_keeps_none_of_the_checkpoints_tensors(workdir, trained, tmp_path, monkeypatch):
    """Once the weights and optimizer state are in place, the loaded checkpoint's tensors are let go: held for the
    whole run they were a second copy of the model and its optimizer state in every process. Checked at the first
    log line, with weak references to the tensors of the checkpoint that load_checkpoint returned."""
    import gc
    import weakref
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    loaded, alive_at_first_log = [], []

    def load_checkpoint(*args, **kwargs):
        checkpoint = load_checkpoint_before(*args, **kwargs)
        loaded.extend(weakref.ref(t) for t in checkpoint["model"].values())
        return checkpoint

    def log(self, record):
        if not alive_at_first_log:
            gc.collect()
            alive_at_first_log.append(sum(ref() is not None for ref in loaded))
        log_before(self, record)

    import gpt.resume
    load_checkpoint_before, log_before = gpt.resume.load_checkpoint, train.RunDir.log
    monkeypatch.setattr(gpt.resume, "load_checkpoint", load_checkpoint)
    monkeypatch.setattr(train.RunDir, "log", log)
    train_main(workdir, str(tmp_path), "--init_from=resume", "--max_iters=32", "--eval_interval=10")
    assert len(loaded) > 5 and alive_at_first_log == [0]
