"""The GPU acceptance run: one command that runs every mode a GPU owner depends on, each as a row with PASS or FAIL
and its figures, and ends with a summary to paste into a bug report.

    python bench/gpu_check.py                  # on a GPU: the device's tests, then every row at the 124M shape
    python bench/gpu_check.py --device=cuda:1  # one card of several
    python bench/gpu_check.py --tiny           # any machine, a tiny model: every row runs (CI runs this on the CPU)
    python bench/gpu_check.py --tiny --jobs=2  # two rows at once where neither reads the other's: sooner, figures
                                               # meaningless (they share the machine)

Each row runs real commands in fresh processes, as a user would type them, with --device passed to every train.py,
sample.py and eval.py; a row that fails records its error line and the last lines of its output, and the rows after
it still run (the eval and decoding rows need train's checkpoint: without it they fail with "needs the train row").
The rows:
  tests        the tests that take the device (pytest -m device, ~260: tests/conftest.py), with TEST_DEVICE=cuda
               on a GPU (under 2 minutes on an H200); the others run as on any CPU; --no_tests skips it
  data         data/shakespeare_char/prepare.py (Tiny Shakespeare's characters; every run below trains on them)
  train_eager  train.py, one process, --compile=False: the speed torch.compile is measured against
  train        train.py, one process, --compile=True: ms/iter, tokens/s, MFU, the first step (compilation) and
               the graphs compiled, and its speed over train_eager's
  ddp          torchrun over every visible GPU (2 gloo processes on the CPU), --compile=True
  fsdp         the same with --fsdp=True --activation_checkpointing=True
  resume       train's run again in two: half the iterations, then --init_from=resume to the end; every loss
               after the resume must be train's (on the CPU to 1e-5: they are equal; on a GPU to 0.01)
  resume_ddp   the same for ddp's run, under torchrun
  resume_fsdp  the same for fsdp's run
               (ddp, fsdp and their resumes are skipped on Apple MPS: torchrun there needs gloo, which carries no
               MPS tensors)
  fp16         --dtype=float16, the gradient scaler's path: finite losses, and the optimizer steps it let through
  bf16         --dtype=bfloat16, where the card has it (compute capability 8.0 on; else skipped, not failed)
  memory       the peak memory of a few steps at each of --memory_batches sequences per micro-step, eager and
               compiled ("out of memory" where it does not fit: a figure, not a failure)
  eval         eval.py on train's checkpoint: bits per byte of the val split (finite), and where lm-eval imports,
               two local lm-eval tasks it writes itself (multiple choice, rolling log-likelihood) through --tasks
               and --include_path; without lm-eval that part is skipped, saying why, and the row still passes
  int8         sample.py --quantize=int8 on train's checkpoint, eager and compiled (its fast path)
  w8a8         sample.py --quantize=w8a8, eager and compiled: a CPU mode, skipped on a GPU (use int8 there)
  graphs       sample.py eager and --compile=True (CUDA graphs on CUDA; "skipping cudagraphs" fails the row):
               tokens/s after the first 8 tokens (prefill, compilation and graph recording left out), and the ratio
  lookup       sample.py --draft=lookup --compile=True: its text must be plain greedy decoding's (graphs' compiled)
  draft        a 1-layer draft model trained as config/small_draft.py makes one (same data, tokenizer, width),
               then sample.py --draft=<it>: its text must be plain greedy decoding's (graphs' eager)
All decoding is greedy (--temperature=0) from the same prompt.
The training rows share one global batch (--batch_size sequences per process and micro-step, on as many processes
as the ddp row runs), so one process, DDP and FSDP train the same model on the same data: on the CPU, in float32,
their losses agree. The model has GPT-2 small's shape (12 x 768, 4 kv heads, context 1024, vocab 50304) in the
precision train.py picks (bf16 from compute capability 8.0, fp16 before), or with --tiny a tiny one; the losses
mean little, the paths and the speed are the point.

Time on one H100 (2026-11-26, torch 2.11, a cold inductor cache; bench/RESULTS.md): with --no_tests --iters=20
--memory_batches=16, 545 s reached only the eval row: train 66 s, ddp 102 s, fsdp 42 s, the resume rows 57, 100 and
70 s, most of it torch.compile (32-45 s a first step); the decoding rows compile again (~70-100 s each compiled decode;
the tenth session's run of the decoding rows alone: int8 133 s, graphs 133 s, lookup 154 s).
A lease of 15 minutes holds the training rows or the decoding rows, not both: --skip leaves rows out, e.g.
    python bench/gpu_check.py --no_tests --skip=ddp,fsdp,resume,resume_ddp,resume_fsdp,fp16,bf16,memory
(with --iters=20 it reached every row but draft in 540 s; add lookup to the list to reach draft).

Everything goes to out-gpu-check/gpu_check_<device>.json (after every row, so a run cut short keeps what it did) and
every command's output to log.txt in a folder beside it (gpu_check_<random>/, the run's work); on a CPU the output,
the summary and the file say that these are not GPU figures.
The exit status is 1 if any row failed.
"""

import argparse
import concurrent.futures
import contextlib
import glob
import importlib.util
import itertools
import json
import math
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: make the repo's modules importable
import torch

from gpt.files import atomic_open

TRAIN, SAMPLE, EVAL = (os.path.join(ROOT, name) for name in ("train.py", "sample.py", "eval.py"))
GPT2_SHAPE = ["--n_layer=12", "--n_head=12", "--n_kv_head=4", "--n_embd=768", "--block_size=1024", "--vocab_size=50304",
              "--loss_chunk=8192"]  # chunked, so the eager rows fit a 16 GB card (config/gpt2_124m.py: whole logits)
TINY_SHAPE = ["--n_layer=2", "--n_head=2", "--n_kv_head=1", "--n_embd=64", "--block_size=64", "--vocab_size=128"]
SPEED = re.compile(r"(\d+) tokens in [\d.]+ s \(([\d.]+) tokens/s; ([\d.]+) after the first \d+\)")  # sample.py's
ACCEPTED = re.compile(r"draft acceptance rate [\d.]+% \((\d+)/(\d+)\)")  # sample.py's, with --draft
PRECISION = re.compile(r"process\(es\) on \S+, torch\.(\w+)")  # train.py's first line names the dtype it picked
WARNING = re.compile(r"\b\w*Warning: .*")  # Python's warnings, torch's C++ ones included (the H100's first run had one)
# torchrun's launcher, once a worker failed, prints its own traceback and a summary that name no cause: the cause is
# in the worker's output before this line
TORCHRUN_REPORT = re.compile(r"^E\d{4} .*torch/distributed/elastic/multiprocessing/api\.py:\d+\] failed", re.M)
RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failed|Interrupt|Exit)\b")  # a traceback's last line
# The eval row's lm-eval tasks, local files (write_local_tasks) as tests/test_eval.py builds its own: multiple choice
# (loglikelihood requests, as hellaswag's) and rolling log-likelihood (as wikitext's)
CHOICE_TASK = """task: gpu_check_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: label
doc_to_choice: choices
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
TEXT_TASK = """task: gpu_check_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""
TAIL_LINES = 40  # of a failed command's output, kept in the JSON and the log: the traceback a bug report needs
RUNNING = set()  # the commands running now (subprocess.Popen), for stop_all
STOPPING = threading.Event()  # set by stop_all: no command starts after it
SAMPLE_FILES = itertools.count()  # numbers sample.py's text files, each its own where rows run side by side


class RowFailed(Exception):
    """A row's failure: its one line for the summary, the output of the command that failed (its last lines go to
    the JSON and the log), and the figures measured before the check that failed."""

    def __init__(self, line, output="", figures=None):
        super().__init__(line)
        self.output, self.figures = output, figures or {}


class RowSkipped(Exception):
    """A row that does not apply here (bf16 on a card without it, the tests under --no_tests): not a failure."""


# ----------------------------------------------------------------------------------------------------
# Running commands


def run(ctx, command, env=None, cwd=None, text_path=None):
    """Run one command in a fresh process; its output (stdout and stderr interleaved) is appended to the log.
    (returncode, output); returncode None when it ran past --timeout. The command gets a process group of its own,
    so that a timeout, or Ctrl-C here, can end all of it (see stop). With text_path, its stdout goes to that file
    alone (sample.py's text, kept apart from what it and torch print on stderr) and output is its stderr."""
    ctx.commands.append(shlex.join(command))
    with open(ctx.log, "a") as f:
        f.write(f"$ {shlex.join(command)}\n")
    with open(text_path, "w") if text_path else contextlib.nullcontext() as text_file:
        proc = subprocess.Popen(command, cwd=cwd or ctx.work, env=env, stdout=text_file or subprocess.PIPE,
                                stderr=subprocess.PIPE if text_file else subprocess.STDOUT, text=True,
                                start_new_session=True)
        RUNNING.add(proc)
        try:
            if STOPPING.is_set():  # rows side by side (--jobs), Ctrl-C'd: stop_all may have missed this one
                raise KeyboardInterrupt
            output = "".join(filter(None, proc.communicate(timeout=ctx.timeout)))
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            output, returncode = stop(proc) + f"\ngpu_check: stopped after --timeout={ctx.timeout} s\n", None
        except BaseException:  # Ctrl-C: end the command too (it is out of the terminal's reach), then stop here
            stop(proc)
            raise
        finally:
            RUNNING.discard(proc)
        if STOPPING.is_set():  # ended by stop_all: the row goes no further
            raise KeyboardInterrupt
    with open(ctx.log, "a") as f:
        if text_path:  # the text, then what the command printed on stderr
            with open(text_path) as text_file:
                f.write(text_file.read() + "\n")
        f.write(output + "\n")
    return returncode, output


GRACE = ((signal.SIGTERM, 60), (signal.SIGKILL, 30))  # how a command is ended: see stop


def stop(proc):
    """End a command and all it started; its output. SIGTERM first: torchrun passes it on to its workers, which run
    in sessions of their own that a signal to this group does not reach (and train.py saves and exits on it); what
    is left a minute later gets SIGKILL."""
    for sig, grace in GRACE:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            return "".join(filter(None, proc.communicate(timeout=grace)))
        except subprocess.TimeoutExpired:
            pass
    return "gpu_check: the command's output did not close after SIGKILL (a process of it still holds it)"


def must(ctx, command, env=None, cwd=None, text_path=None):
    """The output of a command that must succeed; else the row fails with the command's last error line."""
    returncode, output = run(ctx, command, env, cwd, text_path)
    if returncode != 0:
        raise failure(ctx, command, returncode, output)
    return output


def failure(ctx, command, returncode, output):
    """The RowFailed of a command that failed or timed out."""
    if returncode is None:
        return RowFailed(f"timed out after {ctx.timeout} s (--timeout): {shlex.join(command[:4])} ...", output)
    return RowFailed(error_line(output) + f" (exit {returncode})", output)


def worker_output(output):
    """The output up to torchrun's own report of a failed worker (all of it when there is none)."""
    report = TORCHRUN_REPORT.search(output)
    return output[:report.start()] if report else output


def error_line(output):
    """The line that says what went wrong: the last "error: ..." line (this repo's one-line errors), else the last
    line a traceback ends with, else the last line."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in worker_output(output).splitlines()]
    lines = [line for line in lines if line]
    ours = [line for line in lines if line.startswith("error: ")]
    raised = [line for line in lines if RAISED.match(line)]
    return ((ours or raised or lines or ["(no output)"])[-1])[:500]


def tail(output):
    return worker_output(output).rstrip().splitlines()[-TAIL_LINES:]


# ----------------------------------------------------------------------------------------------------
# Figures


def training_figures(out_dir, output):
    """A train.py run's figures from its metrics.jsonl: median ms/iter, tokens/s and MFU of the logged iterations
    after the first two timed ones (warm-up); the first step's seconds (train.py times it alone: compilation); the
    peak memory (CUDA); the final loss; the precision train.py picked; the warnings it printed. A loss that is not
    finite fails the row."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if "loss" in r]
    timed = [r for r in steps if "ms_per_iter" in r]
    timed = timed[2:] if len(timed) > 2 else timed
    figures = {key: statistics.median(r[key] for r in timed) for key in ("ms_per_iter", "tokens_per_sec", "mfu")
               if timed and key in timed[0]}
    first = next((r for r in records if "first_step_s" in r), {})
    figures.update(first_step_s=first.get("first_step_s"),
                   peak_memory_gb=max((r["peak_memory_gb"] for r in records if "peak_memory_gb" in r), default=None),
                   final_loss=steps[-1]["loss"] if steps else None, iters=steps[-1]["iter"] if steps else 0)
    precision = PRECISION.search(output)
    figures["precision"] = precision.group(1) if precision else None
    figures["warnings"] = sorted({line[:300] for line in WARNING.findall(output)})  # each once, whichever rank said it
    losses = [r[key] for r in records for key in ("loss", "train_loss", "val_loss") if key in r]
    if not steps or not all(math.isfinite(loss) for loss in losses):
        raise RowFailed(f"losses not finite: {losses[-5:]}", output, figures)
    if not figures.get("ms_per_iter", 0) > 0:
        raise RowFailed("no ms/iter logged (too few --iters?)", output, figures)
    return figures


def speed(figures):
    """The key figures of a training run, as the summary shows them."""
    text = f"{figures['ms_per_iter']:.1f} ms/iter, {figures['tokens_per_sec']:,.0f} tokens/s"
    if figures.get("mfu"):
        text += f", MFU {100 * figures['mfu']:.1f}%"
    if figures.get("peak_memory_gb"):
        text += f", peak {figures['peak_memory_gb']:.1f} GB"
    text += f", loss {figures['final_loss']:.4f}, {figures['precision']}"
    warnings = figures.get("warnings")
    return text + (f"; {len(warnings)} warning(s), first: {warnings[0][:120]}" if warnings else "")


def compile_note(ctx, figures, output):
    """What a --compile=True run says about compilation. On CUDA it must have compiled: train_run counts the graphs
    as compiled_graphs, and 0 or none fails the row. On the CPU train.py does not compile."""
    if not ctx.cuda:
        return "compile unused: train.py compiles on CUDA only"
    graphs = figures.get("compiled_graphs")
    if not graphs:
        raise RowFailed(f"--compile=True, but torch's trace shows compiled_graphs={graphs}: torch.compile compiled "
                        "no graph", output, figures)
    return f"first step {figures['first_step_s']:.1f} s ({graphs} graphs compiled)"


# ----------------------------------------------------------------------------------------------------
# The rows: each returns (figures, the key figure for the summary), or raises RowFailed or RowSkipped


def train_command(ctx, name, *settings, processes=None):
    """A train.py command writing to work/name: one process, or torchrun over that many."""
    launcher = [ctx.python] if processes is None else [
        ctx.python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    device = ctx.device if processes is None else ctx.torchrun_device
    return [*launcher, TRAIN, *ctx.common, f"--device={device}", f"--out_dir={os.path.join(ctx.work, name)}",
            f"--total_batch_size={ctx.global_tokens}", *settings]


def train_run(ctx, name, *settings, processes=None):
    """Run train.py for a row; its figures, and its output. A compiled run on CUDA runs under torch's structured
    trace (TORCH_TRACE), from which compiled_graphs counts the graphs Dynamo compiled (None where none was traced)."""
    env = None
    if processes is not None:  # --device=cuda:N: torchrun sees that card alone (ctx.one_card)
        env = dict(os.environ, **ctx.one_card)
        if not ctx.cuda:
            env.setdefault("OMP_NUM_THREADS", "1")  # gloo processes sharing the cores: one thread each is far faster
    trace = None
    if ctx.cuda and "--compile=True" in settings:
        trace = tempfile.mkdtemp(prefix=f"trace_{name}_", dir=ctx.work)
        env = dict(env or os.environ, TORCH_TRACE=trace)
    output = must(ctx, train_command(ctx, name, *settings, processes=processes), env)
    figures = training_figures(os.path.join(ctx.work, name), output)
    figures["compiled_graphs"] = trace and compiled_graphs(trace)
    return figures, output


def compiled_graphs(trace):
    """The graphs Dynamo compiled in the one process, or rank 0 of torchrun's: one "dynamo_output_graph" entry each
    in its TORCH_TRACE log (the count torch._dynamo keeps as unique_graphs, in the same function)."""
    count = 0
    for path in glob.glob(os.path.join(trace, "*.log")):
        if "_rank_" not in os.path.basename(path) or "_rank_0_" in os.path.basename(path):
            with open(path) as f:
                count += f.read().count('"dynamo_output_graph"')
    return count


def drop_checkpoint(ctx, name):
    """ckpt.pt is 1.5 GB at the 124M shape (weights and AdamW state): only train's is read again (decoding)."""
    path = os.path.join(ctx.work, name, "ckpt.pt")
    if os.path.exists(path):
        os.remove(path)


def row_tests(ctx):
    if ctx.args.no_tests:
        raise RowSkipped("--no_tests")
    test_device = "cuda" if ctx.cuda else ctx.kind  # a cuda:N is the only card its CUDA_VISIBLE_DEVICES shows
    # pytest.ini's -n spreads the files over the cores (pytest-xdist); a GPU machine may have pytest alone: one process
    in_one_process = [] if importlib.util.find_spec("xdist") else ["-o", "addopts=-rfE"]
    command = [ctx.python, "-m", "pytest", "-m", "device", "-p", "no:cacheprovider", *in_one_process]
    returncode, output = run(ctx, command, dict(os.environ, **ctx.one_card, TEST_DEVICE=test_device), cwd=ROOT)
    lines = output.strip().splitlines()
    figures = dict(summary=lines[-1] if lines else "(no output)", test_device=test_device,
                   failed=[line for line in lines if line.startswith(("FAILED ", "ERROR "))])
    if returncode != 0:
        first = f"; first: {figures['failed'][0][:300]}" if figures["failed"] else ""
        raise RowFailed(figures["summary"].strip("= ") + first, output, figures)
    return figures, f"{figures['summary'].strip('= ')} (TEST_DEVICE={test_device})"


def row_data(ctx):
    output = must(ctx, [ctx.python, os.path.join(ROOT, "data", "shakespeare_char", "prepare.py"), "--out_dir",
                        os.path.join(ctx.work, "data", "shakespeare_char")])
    return {}, "; ".join(output.strip().splitlines())


def row_train_eager(ctx):
    figures, _ = train_run(ctx, "train_eager", "--compile=False")
    drop_checkpoint(ctx, "train_eager")
    return figures, speed(figures)


def row_train(ctx):
    figures, output = train_run(ctx, "train", "--compile=True")
    key = f"{speed(figures)}; {compile_note(ctx, figures, output)}"
    eager = ctx.results["train_eager"]
    if eager["status"] == "PASS":
        figures["speedup_over_eager"] = round(eager["figures"]["ms_per_iter"] / figures["ms_per_iter"], 2)
        key += f"; {figures['speedup_over_eager']}x train_eager's speed"
    return figures, key


def processes(ctx):
    return processes_of(ctx, ctx.processes)


def processes_of(ctx, count):
    """How a run of count processes under torchrun (None: one process, no torchrun) runs, for a row's key."""
    if count is None:
        return "1 process"
    return f"{count} process{'es' * (count > 1)}" + (" (gloo)" if not ctx.cuda else "")


def skip_torchrun_on_mps(ctx):
    if ctx.kind == "mps":
        raise RowSkipped("torchrun needs gloo here, and gloo carries only cpu and cuda tensors: not Apple MPS's")


def row_ddp(ctx):
    skip_torchrun_on_mps(ctx)
    figures, output = train_run(ctx, "ddp", "--compile=True", processes=ctx.processes)
    drop_checkpoint(ctx, "ddp")
    return figures, f"{processes(ctx)}: {speed(figures)}; {compile_note(ctx, figures, output)}"


def fsdp_settings(ctx):
    """The fsdp row's settings (the resume_fsdp row's too), and a note on them for its key."""
    settings = ["--compile=True", "--fsdp=True", "--activation_checkpointing=True"]
    if ctx.cuda and not ctx.has_bf16:  # FSDP refuses float16 (train.check_fsdp), which auto picks on this card
        return settings + ["--dtype=float32"], " (float32: fsdp takes no float16, and this card has no bfloat16)"
    return settings, ""


def row_fsdp(ctx):
    skip_torchrun_on_mps(ctx)
    settings, note = fsdp_settings(ctx)
    figures, output = train_run(ctx, "fsdp", *settings, processes=ctx.processes)
    drop_checkpoint(ctx, "fsdp")
    return figures, (f"{processes(ctx)}, activation checkpointing: {speed(figures)}{note}; "
                     f"{compile_note(ctx, figures, output)}")


def step_losses(out_dir):
    """{iteration: the loss logged there} from a run's metrics.jsonl (a resumed run's holds both halves)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["iter"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def largest_difference(resumed, unbroken, iterations):
    """The largest difference between two runs' losses ({iteration: loss}) over these iterations, and where it is;
    an iteration that either run did not log counts as an infinite difference."""
    differences = {i: abs(resumed[i] - unbroken[i]) if i in resumed and i in unbroken else math.inf
                   for i in iterations}
    where = max(differences, key=differences.get)
    return differences[where], where


def resume_tolerance(ctx):
    """How far a resumed run's losses may be from the unbroken run's. On the CPU both runs compute the same thing in
    the same order: their losses were measured equal to the last bit (one process, DDP and FSDP), and the margin is
    a few float32 steps of a loss, not enough for any real break. On a GPU, kernels that add in the order their
    threads finish (atomic adds in backward passes) let two identical runs drift apart a little; a real break moves
    the losses after the resume by percents: a schedule that restarts (warmup again, then a decay from the top)
    trains those iterations at other learning rates, lost AdamW state makes its next steps move every weight by the
    whole learning rate, a lost data position trains on other batches (and a loss is one batch's), and weights not
    restored are nats away. Between the two, a hundredth of a nat."""
    return 1e-5 if ctx.kind == "cpu" else 1e-2


def resume(ctx, unbroken, settings, processes=None):
    """The row unbroken's run (its settings and --iters; it trained them in one go) trained in two runs: half the
    iterations, then on to --iters with --init_from=resume. Each loss the resumed run logged must be the unbroken
    run's: a loss depends on the weights, the optimizer state, the learning rate and the batch, all of which a
    resume must restore. Each, not the final one alone: a schedule that restarted moves the losses right after the
    resume most, and may have come back near the unbroken run's by the end."""
    if (ctx.results.get(unbroken, {}).get("figures") or {}).get("final_loss") is None:
        raise RowFailed(f"needs the {unbroken} row's losses to compare with, and it logged none")
    name, half = f"resume_{unbroken}", ctx.iters // 2
    # lr_decay_iters=0 would mean each run's own max_iters: the first would decay by half-time. Both get the
    # unbroken run's (its 0 meant --iters). A run evaluates and saves where it stops: the first leaves its checkpoint.
    schedule = f"--lr_decay_iters={ctx.iters}"
    train_run(ctx, name, *settings, f"--max_iters={half}", schedule, processes=processes)
    figures, output = train_run(ctx, name, *settings, "--init_from=resume", f"--max_iters={ctx.iters}", schedule,
                                processes=processes)
    drop_checkpoint(ctx, name)
    resumed, before = step_losses(os.path.join(ctx.work, name)), step_losses(os.path.join(ctx.work, unbroken))
    difference, where = largest_difference(resumed, before, range(half + 1, ctx.iters + 1))
    figures.update(resumed_at=half, unbroken_final_loss=before.get(ctx.iters), largest_difference=difference,
                   tolerance=resume_tolerance(ctx))
    if difference == math.inf:
        raise RowFailed(f"no loss logged at iter {where} by the resumed run or the {unbroken} row", output, figures)
    if difference > figures["tolerance"]:
        raise RowFailed(f"resumed at iter {half}: loss {resumed[where]:.6f} at iter {where}, the {unbroken} row's "
                        f"unbroken run {before[where]:.6f} ({difference:.2g} apart, tolerance "
                        f"{figures['tolerance']:g})", output, figures)
    return figures, (f"{processes_of(ctx, processes)}: resumed at iter {half} of {ctx.iters}, losses {half + 1}-"
                     f"{ctx.iters} differ from the {unbroken} row's by at most {difference:.2g} (tolerance "
                     f"{figures['tolerance']:g}); loss {figures['final_loss']:.4f}, {figures['precision']}")


def row_resume(ctx):
    return resume(ctx, "train", ["--compile=True"])


def row_resume_ddp(ctx):
    skip_torchrun_on_mps(ctx)
    return resume(ctx, "ddp", ["--compile=True"], processes=ctx.processes)


def row_resume_fsdp(ctx):
    skip_torchrun_on_mps(ctx)
    return resume(ctx, "fsdp", fsdp_settings(ctx)[0], processes=ctx.processes)


def row_fp16(ctx):
    # eager: the precision is the point here; on a card without bfloat16 the train and ddp rows already run
    # float16 with compile (dtype=auto picks it there)
    figures, output = train_run(ctx, "fp16", "--dtype=float16", "--compile=False")
    if figures["precision"] != "float16":
        raise RowFailed(f"--dtype=float16 ran in {figures['precision']}", output, figures)
    # AdamW counts the steps it took; the gradient scaler skips a step whose gradients overflowed
    checkpoint = torch.load(os.path.join(ctx.work, "fp16", "ckpt.pt"), map_location="cpu", weights_only=True)
    drop_checkpoint(ctx, "fp16")
    state = checkpoint["optimizers"][0]["state"].values()
    figures["optimizer_steps"] = int(max((float(s["step"]) for s in state), default=0))
    figures["scaler_scale"] = (checkpoint.get("scaler") or {}).get("scale")
    if figures["scaler_scale"] is None:
        raise RowFailed("ckpt.pt holds no gradient scaler state: float16 ran without loss scaling", output, figures)
    steps, iters = figures["optimizer_steps"], figures["iters"]
    key = f"{speed(figures)}; the gradient scaler took {steps} of {iters} steps (scale {figures['scaler_scale']:g})"
    if steps <= iters // 2:  # a few skipped at the start, while the scale finds its level, are normal
        raise RowFailed(f"the gradient scaler skipped {iters - steps} of {iters} steps: float16 gradients overflow",
                        output, figures)
    return figures, key


def row_bf16(ctx):
    if ctx.cuda and not ctx.has_bf16:
        raise RowSkipped(f"no bfloat16 (compute capability {ctx.capability}; 8.0 on has it)")
    figures, output = train_run(ctx, "bf16", "--dtype=bfloat16", "--compile=False")  # eager: see row_fp16
    drop_checkpoint(ctx, "bf16")
    if figures["precision"] != "bfloat16":
        raise RowFailed(f"--dtype=bfloat16 ran in {figures['precision']}", output, figures)
    return figures, speed(figures)


def row_memory(ctx):
    figures, parts = {}, []
    for batch in ctx.memory_batches:
        peaks = []
        for compiled, reuse in ((False, "train_eager"), (True, "train")):
            name = f"memory_{batch}_{'compiled' if compiled else 'eager'}"
            if batch == ctx.batch and ctx.micro_steps == 1 and ctx.results[reuse]["status"] == "PASS":
                peak = ctx.results[reuse]["figures"]["peak_memory_gb"]  # measured there: one compilation fewer
            else:
                # one micro-step of this many sequences, a few steps
                command = [*train_command(ctx, name, f"--compile={compiled}"), f"--batch_size={batch}",
                           "--total_batch_size=0", "--max_iters=3", "--eval_interval=100"]
                returncode, output = run(ctx, command)
                if returncode != 0 and "out of memory" in output.lower():
                    peak = "out of memory"
                elif returncode != 0:
                    raise failure(ctx, command, returncode, output)
                else:
                    peak = training_figures(os.path.join(ctx.work, name), output)["peak_memory_gb"]
                drop_checkpoint(ctx, name)
            figures[f"batch {batch}, compile={compiled}"] = peak
            peaks.append(f"{peak:.2f} GB" if isinstance(peak, float) else peak)
        if ctx.cuda:
            parts.append(f"batch {batch}: {peaks[0]} eager, {peaks[1]} compiled")
    if not ctx.cuda:
        return figures, (f"ran batch {', '.join(map(str, ctx.memory_batches))} eager and with --compile=True; "
                         "peak memory is measured on CUDA only")
    return figures, "; ".join(parts)


def train_checkpoint(ctx):
    """train's out_dir, which the decoding and eval rows read: they need its checkpoint, not its PASS (a train row
    that failed on a figure alone, compiled_graphs, wrote one)."""
    checkpoint = os.path.join(ctx.work, "train")
    if not os.path.exists(os.path.join(checkpoint, "ckpt.pt")):
        raise RowFailed("needs the train row, which failed before writing its checkpoint")
    return checkpoint


def sample(ctx, *settings):
    """sample.py on train's checkpoint, greedy: its text (kept in ctx.texts under its settings: see greedy_text) and
    its output on stderr."""
    checkpoint = train_checkpoint(ctx)
    new_tokens = 64 if ctx.args.tiny else 256
    text_path = os.path.join(ctx.work, f"sample_{next(SAMPLE_FILES)}.txt")
    # TORCH_LOGS=cudagraphs shows CUDA-graph trees' "skipping cudagraphs due to ..." (e.g. an input mutated in place
    # that is not a static address), which would leave the compiled step launch-bound
    output = must(ctx, [ctx.python, SAMPLE, f"--out_dir={checkpoint}", "--prompt=ROMEO:",
                        "--temperature=0", f"--max_new_tokens={new_tokens}", f"--device={ctx.device}", *settings],
                  dict(os.environ, TORCH_LOGS="cudagraphs"), text_path=text_path)
    with open(text_path) as f:
        ctx.texts[settings] = f.read()
    return ctx.texts[settings], output


def greedy_text(ctx, *settings):
    """Plain greedy decoding's text with these settings: from a row that ran exactly them (graphs), else run here."""
    if settings not in ctx.texts:
        sample(ctx, *settings)
    return ctx.texts[settings]


def decode(ctx, *settings):
    """sample.py on train's checkpoint, greedy: its tokens/s overall and after the first 8 tokens."""
    _, output = sample(ctx, *settings)
    if "skipping cudagraphs" in output:
        reason = output.split("skipping cudagraphs")[1].splitlines()[0]
        raise RowFailed(f"sample.py {' '.join(settings)} skipped CUDA graphs{reason[:300]}", output)
    match = SPEED.search(output)
    if not match:
        raise RowFailed("sample.py printed no speed line", output)
    tokens, overall, steady = match.groups()
    figures = dict(tokens=int(tokens), tokens_per_sec=float(overall), tokens_per_sec_after_8=float(steady))
    if any(setting.startswith("--draft=") for setting in settings):
        accepted = ACCEPTED.search(output)
        if not accepted:
            raise RowFailed("sample.py --draft printed no acceptance rate", output)
        figures.update(accepted=int(accepted.group(1)), proposed=int(accepted.group(2)))
    return figures


def check_same_text(text, plain, what):
    """Speculative decoding at temperature 0 must write plain greedy decoding's text: the model decides every token,
    the draft only proposes. Where they part, the row fails, showing both from there."""
    if text != plain:
        at = next((i for i, (a, b) in enumerate(zip(text, plain)) if a != b), min(len(text), len(plain)))
        raise RowFailed(f"{what}: its text parts from plain greedy decoding's at character {at}: "
                        f"{text[at:at + 30]!r} instead of {plain[at:at + 30]!r}")


def quantized_decodes(ctx, mode):
    """sample.py --quantize=mode eager and compiled: their figures and the key."""
    figures = dict(eager=decode(ctx, f"--quantize={mode}", "--compile=False"),
                   compiled=decode(ctx, f"--quantize={mode}", "--compile=True"))
    figures["compiled_over_eager"] = round(figures["compiled"]["tokens_per_sec_after_8"] /
                                           figures["eager"]["tokens_per_sec_after_8"], 2)
    key = (f"{figures['eager']['tokens_per_sec_after_8']:,.1f} tokens/s eager, "
           f"{figures['compiled']['tokens_per_sec_after_8']:,.1f} compiled: {figures['compiled_over_eager']}x"
           " (after the first 8 tokens)")
    return figures, key


def eval_figures(ctx, name, *settings):
    """eval.py on train's checkpoint: the figures it writes to --out_json. --dtype is left at eval.py's default
    (auto), as a user runs it: the figures are in the precision eval.py picks for this device."""
    out_json = os.path.join(ctx.work, f"eval_{name}.json")
    must(ctx, [ctx.python, EVAL, f"--out_dir={train_checkpoint(ctx)}", f"--device={ctx.device}",
               f"--out_json={out_json}", *settings])
    with open(out_json) as f:
        return json.load(f)


def lm_eval_missing(ctx):
    """Why lm-eval cannot run here (the error of importing it), or None: it is optional, and not on every machine."""
    returncode, output = run(ctx, [ctx.python, "-c", "import lm_eval"])
    return error_line(output) if returncode != 0 else None


def write_local_tasks(folder):
    """The tasks gpu_check_choice and gpu_check_text in folder: YAML files over JSON lines files, in plain ASCII
    (which shakespeare_char's vocabulary holds), so that nothing is downloaded."""
    os.makedirs(folder, exist_ok=True)
    choices = [("First Citizen:\nBefore we proceed any further, hear me", [" speak.", " sing.", " sleep."], 0),
               ("ROMEO:\nBut soft, what light through yonder window", [" breaks?", " bends?", " burns?"], 0)]
    texts = ["Now is the winter of our discontent\nMade glorious summer by this sun of York;"]
    for name, task, lines in (("choice", CHOICE_TASK, [dict(question=q, choices=c, label=a) for q, c, a in choices]),
                              ("text", TEXT_TASK, [dict(text=t) for t in texts])):
        data = os.path.join(folder, f"{name}.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
        with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
            f.write(task.format(data=data))


def row_eval(ctx):
    figures = eval_figures(ctx, "val")["text"]
    if not math.isfinite(figures["bits_per_byte"]):
        raise RowFailed(f"eval.py: {figures['bits_per_byte']} bits per byte on the val split", figures=figures)
    key = f"{figures['bits_per_byte']:.4f} bits per byte on the val split"
    missing = lm_eval_missing(ctx)
    if missing:
        return figures, key + f"; lm-eval tasks skipped: {missing}"
    folder = os.path.join(ctx.work, "lm_eval_tasks")
    write_local_tasks(folder)
    results = eval_figures(ctx, "tasks", "--tasks=gpu_check_choice,gpu_check_text",
                           f"--include_path={folder}")["tasks"]["results"]
    figures.update(choice_acc=results["gpu_check_choice"]["acc,none"],
                   text_bits_per_byte=results["gpu_check_text"]["bits_per_byte,none"])
    if not math.isfinite(figures["text_bits_per_byte"]):
        raise RowFailed(f"lm-eval: {figures['text_bits_per_byte']} bits per byte on gpu_check_text", figures=figures)
    return figures, key + (f"; lm-eval tasks: gpu_check_choice acc {figures['choice_acc']:.2f}, gpu_check_text "
                           f"{figures['text_bits_per_byte']:.4f} bits per byte")


def row_int8(ctx):
    # weight-only int8 (quantize.py): compiled, the int8 weights' cast fuses into the product (on a GPU at batch 1);
    # eager, every step makes a float copy of each weight
    return quantized_decodes(ctx, "int8")


def row_w8a8(ctx):
    # int8 weights and int8 rows, int8 x int8 products with integer sums: the CPU's int8 dot products. On a GPU its
    # layers would run their own float32 product, and sample.py refuses it on CUDA
    if ctx.kind != "cpu":
        raise RowSkipped("w8a8 is a CPU mode; on a GPU use --quantize=int8")
    return quantized_decodes(ctx, "w8a8")


def row_graphs(ctx):
    # eager said explicitly: sample.py compiles a model over 64 MB by default (engine.compiles_by_default)
    figures = dict(eager=decode(ctx, "--compile=False"), compiled=decode(ctx, "--compile=True"))
    figures["compiled_over_eager"] = round(figures["compiled"]["tokens_per_sec_after_8"] /
                                           figures["eager"]["tokens_per_sec_after_8"], 2)
    key = (f"{figures['eager']['tokens_per_sec_after_8']:,.1f} tokens/s eager, "
           f"{figures['compiled']['tokens_per_sec_after_8']:,.1f} compiled: {figures['compiled_over_eager']}x "
           "(after the first 8 tokens)")
    return figures, key + ("" if ctx.cuda else "; no CUDA graphs on the CPU: compiled without them")


def speculative_key(figures):
    return (f"text as plain greedy decoding's; {figures['accepted']} of {figures['proposed']} drafted tokens kept, "
            f"{figures['tokens_per_sec_after_8']:,.1f} tokens/s after the first 8")


def row_lookup(ctx):
    # prompt lookup: the context is the draft; compiled, it checks its proposals with a second compiled step shape
    settings = ("--draft=lookup", "--compile=True")
    figures = decode(ctx, *settings)
    check_same_text(ctx.texts[settings], greedy_text(ctx, "--compile=True"), "--draft=lookup")
    return figures, speculative_key(figures)


def row_draft(ctx):
    train_checkpoint(ctx)  # a draft is no use without the model it drafts for
    # a draft as config/small_draft.py makes one: one block, the same data and tokenizer; eager, as its training
    # speed is not the point here
    draft_figures, _ = train_run(ctx, "draft", "--n_layer=1", "--compile=False")
    # speculative decoding with a draft model runs eager (sample.py compiles none): the plain text to match is eager's
    settings = (f"--draft={os.path.join(ctx.work, 'draft')}", "--compile=False")
    figures = decode(ctx, *settings)
    drop_checkpoint(ctx, "draft")
    figures["draft_final_loss"] = draft_figures["final_loss"]
    check_same_text(ctx.texts[settings], greedy_text(ctx, "--compile=False"), "--draft")
    return figures, f"a 1-layer draft: {speculative_key(figures)}"


# (name, the rows it needs to have passed, the row)
ROWS = [
    ("tests", [], row_tests),
    ("data", [], row_data),
    ("train_eager", ["data"], row_train_eager),
    ("train", ["data"], row_train),
    ("ddp", ["data"], row_ddp),
    ("fsdp", ["data"], row_fsdp),
    ("resume", ["data"], row_resume),  # these three compare with the train, ddp and fsdp rows' runs
    ("resume_ddp", ["data"], row_resume_ddp),
    ("resume_fsdp", ["data"], row_resume_fsdp),
    ("fp16", ["data"], row_fp16),
    ("bf16", ["data"], row_bf16),
    ("memory", ["data"], row_memory),
    ("eval", [], row_eval),  # these read train's checkpoint: see train_checkpoint
    ("int8", [], row_int8),
    ("w8a8", [], row_w8a8),
    ("graphs", [], row_graphs),
    ("lookup", [], row_lookup),  # these two after graphs, whose plain greedy texts they are compared with
    ("draft", ["data"], row_draft),
]


# ----------------------------------------------------------------------------------------------------
# Running the rows, the summary


# The rows whose results or files a row reads, beyond those it needs to have passed: run one after another, ROWS'
# order ends them first; run side by side (--jobs), a row starts only once these have ended
READS = {
    "train": ["train_eager"],  # its speed over train_eager's
    "resume": ["train"], "resume_ddp": ["ddp"], "resume_fsdp": ["fsdp"],  # the losses they compare with
    "memory": ["train_eager", "train"],  # the peaks it takes from them where it can
    **{name: ["train"] for name in ("eval", "int8", "w8a8", "graphs")},  # train's checkpoint
    "lookup": ["train", "graphs"], "draft": ["train", "graphs"],  # and the plain greedy texts graphs decoded
}


def run_rows(ctx, rows, save=lambda: None, skip=(), jobs=1):
    """Run each row but those named in skip, recording into ctx.results whatever happens to it, and go on to the
    next; save() after each. With jobs > 1, that many rows at once: see side_by_side."""
    if jobs > 1:
        return side_by_side(ctx, rows, save, skip, jobs)
    for number, (name, needs, row) in enumerate(rows, 1):
        print(f"[{number}/{len(rows)}] {name} ...", flush=True)
        ctx.results[name] = run_row(ctx, name, needs, row, skip)
        print_result(ctx.results[name])
        save()


def run_row(ctx, name, needs, row, skip):
    """One row, whatever happens to it: its result (a failure's error and last lines go to the log too)."""
    with open(ctx.log, "a") as f:
        f.write(f"\n===== row {name} =====\n")
    ctx.commands, start = [], time.perf_counter()
    missing = [need for need in needs if ctx.results.get(need, {}).get("status") != "PASS"]
    try:
        if name in skip:
            raise RowSkipped("--skip")
        if missing:
            raise RowFailed(f"needs the {missing[0]} row, which did not pass")
        figures, key = row(ctx)
        result = dict(status="PASS", key=key, figures=figures)
    except RowSkipped as e:
        result = dict(status="SKIP", key=f"skipped: {e}")
    except RowFailed as e:
        result = dict(status="FAIL", error=str(e), output_tail=tail(e.output), figures=e.figures)
    except Exception as e:  # output this script did not expect, or a bug in it: this row fails, the rest run
        result = dict(status="FAIL", error=f"gpu_check: {type(e).__name__}: {e}",
                      output_tail=traceback.format_exc().splitlines()[-TAIL_LINES:])
    result.update(seconds=round(time.perf_counter() - start, 1), commands=ctx.commands)
    if result["status"] == "FAIL":
        with open(ctx.log, "a") as f:
            f.write(f"FAIL {name}: {result['error']}\n  last lines:\n{last_lines(result)}\n")
    return result


def last_lines(result):
    return "\n".join("      " + line for line in result["output_tail"])


def print_result(result, name=None):
    """A row's result as it ends: its status and key line (after its name, where rows run side by side), and a
    failure's last lines."""
    print(f"    {name + ': ' if name else ''}{result['status']} ({result['seconds']} s): "
          f"{result.get('key') or result['error']}", flush=True)
    if result["status"] == "FAIL":
        print(last_lines(result), flush=True)


def side_by_side(ctx, rows, save, skip, jobs):
    """run_rows with up to jobs rows running at once (--jobs), in threads: a row starts once the earlier rows it needs
    or reads (READS) have ended. It gets a ctx of its own: its commands, and a log of its own that joins ctx.log when
    the row ends (each row's lines together). ctx.results ends in the rows' order."""
    names = [name for name, _, _ in rows]
    waits = {name: set(needs + READS.get(name, [])) & set(names[:number]) for number, (name, needs, _) in
             enumerate(rows)}
    # the rows others wait for first (train, graphs): a chain of rows started late would end the run one at a time
    waiting = sorted(rows, key=lambda entry: -sum(entry[0] in wait for wait in waits.values()))
    running, ended = {}, set()
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        try:
            while waiting or running:
                for entry in [entry for entry in waiting if waits[entry[0]] <= ended][:jobs - len(running)]:
                    waiting.remove(entry)
                    name = entry[0]
                    print(f"[{names.index(name) + 1}/{len(rows)}] {name} ...", flush=True)
                    own = SimpleNamespace(**{**vars(ctx), "log": os.path.join(ctx.work, f"log_{name}.txt")})
                    running[pool.submit(run_row, own, *entry, skip)] = name, own.log
                for future in concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED).done:
                    name, log = running.pop(future)
                    ctx.results[name] = future.result()
                    ended.add(name)
                    with open(log) as f, open(ctx.log, "a") as main_log:
                        main_log.write(f.read())
                    os.remove(log)
                    print_result(ctx.results[name], name)
                    save()
        except BaseException:  # Ctrl-C: end the commands running (out of the terminal's reach), then stop here
            stop_all(running)
            raise
    ordered = {name: result for name, result in ctx.results.items() if name not in names}  # from before: first
    ordered.update((name, ctx.results[name]) for name in names)
    ctx.results.clear()  # the same dict, in order: main's report holds it
    ctx.results.update(ordered)


def stop_all(futures):
    """Rows side by side, Ctrl-C'd: no command starts any more (run), and those running end as stop ends one, SIGTERM
    then SIGKILL; the rows' threads (futures) then end."""
    STOPPING.set()
    for sig, grace in GRACE:
        for proc in list(RUNNING):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        if not concurrent.futures.wait(futures, timeout=grace).not_done:
            return


def summary(ctx):
    """The lines to paste into a bug report: the machine, the command, and each row's result in one line."""
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU build of torch)"
    capability = f", compute capability {ctx.capability}" if ctx.capability else ""
    lines = [f"gpu_check on {ctx.name}{capability}",
             f"torch {torch.__version__}, {cuda}, Python {platform.python_version()}, {platform.system()}",
             "command: " + shlex.join(["python", "bench/gpu_check.py", *sys.argv[1:]])]
    width = max(map(len, ctx.results))
    for name, result in ctx.results.items():
        lines.append(f"{name:<{width}}  {result['status']}  {result.get('key') or result['error']}")
    counts = [sum(r["status"] == status for r in ctx.results.values()) for status in ("PASS", "FAIL", "SKIP")]
    lines.append("rows: {} PASS, {} FAIL, {} SKIP".format(*counts))
    return lines


# ----------------------------------------------------------------------------------------------------
# Setup


def device_setup(device):
    """What --device means for the rows, checked without touching the GPU (a CUDA context here would hold memory on
    the card while the rows measure it); a bad --device is one line. one_card: the variables that show torchrun and
    the tests that card alone when one was named; torchrun_device: the --device torchrun's processes get; processes:
    how many the ddp and fsdp rows run."""
    kind = device
    if device == "auto":  # as train.py and sample.py resolve it (gpt/device.py's resolve_device)
        kind = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    try:
        parsed = torch.device(kind)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "mps", "cuda"):
        sys.exit(f"error: --device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if parsed.type != "cuda":  # DDP and FSDP as 2 gloo processes
        name = "CPU (no GPU" if parsed.type == "cpu" else "Apple MPS (no CUDA GPU"
        return dict(kind=parsed.type, name=f"{name}: these are not GPU figures)", one_card={}, torchrun_device=device,
                    processes=2, capability=None, has_bf16=True)
    if not torch.cuda.is_available():
        sys.exit(f"error: --device={device}, but this torch ({torch.__version__}) sees no CUDA GPU; "
                 "use --device=cpu (or auto)")
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        sys.exit(f"error: --device={device}, but this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    index = parsed.index or 0  # plain cuda: the current device, cuda:0 in a fresh process
    capability = torch.cuda.get_device_capability(index)
    setup = dict(kind="cuda", name=f"{torch.cuda.get_device_name(index)} (cuda:{index} of {count} visible)",
                 one_card={}, torchrun_device=device, processes=count, capability="{}.{}".format(*capability),
                 has_bf16=capability >= (8, 0))  # what gpt/device.py's resolve_dtype requires of bfloat16
    if parsed.index is not None:
        # One card: train.py under torchrun takes cuda:LOCAL_RANK, so torchrun (and the tests) see only this card
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        setup.update(one_card={"CUDA_VISIBLE_DEVICES": visible.split(",")[index] if visible else str(index)},
                     torchrun_device="cuda", processes=1)
    return setup


def positive_ints(text, what, many=False):
    """The positive integer (or with many, comma-separated integers) of an option; anything else is one line."""
    values = text.split(",")
    if not all(v.strip().isdigit() and int(v) > 0 for v in values) or len(values) > 1 and not many:
        sys.exit(f"error: {what} must be {'positive integers, comma-separated' if many else 'a positive integer'}, "
                 f"got {text!r}")
    return [int(v) for v in values] if many else int(values[0])


def jobs_option(text, tiny):
    """--jobs: how many rows run at once. Side by side they share the machine, so it takes --tiny, whose figures are
    not the point; a bad value is one line."""
    jobs = positive_ints(text, "--jobs")
    if jobs > 1 and not tiny:
        sys.exit("error: --jobs runs rows side by side, which spoils every figure they measure: with --tiny only")
    return jobs


def row_names(text):
    """The rows --skip names; a name that is no row is one line that lists them."""
    names, rows = [name for name in text.split(",") if name], [row[0] for row in ROWS]
    unknown = [name for name in names if name not in rows]
    if unknown:
        sys.exit(f"error: --skip: no row {unknown[0]!r}; the rows are {', '.join(rows)}")
    return names


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda or cuda:N; "
                        "passed to every train.py and sample.py")
    parser.add_argument("--tiny", action="store_true", help="a tiny model instead of the 124M shape (any machine)")
    parser.add_argument("--no_tests", action="store_true", help="skip the tests that take the device")
    parser.add_argument("--skip", default="", help="rows to leave out, comma-separated (a row that needs one fails "
                        "saying so)")
    parser.add_argument("--iters", default="", help="training iterations per row (default 50, tiny 12)")
    parser.add_argument("--batch_size", default="", help="sequences per process and micro-step (default 16, tiny 4)")
    parser.add_argument("--memory_batches", default="", help="micro-batches whose peak memory is measured, comma-"
                        "separated (default 16,32,64, tiny 8)")
    parser.add_argument("--timeout", default="1800", help="seconds one command may run before its row fails "
                        "(default 1800; a hung NCCL collective would otherwise never end)")
    parser.add_argument("--jobs", default="1", help="rows run at once, with --tiny only (default 1): rows side by "
                        "side share the machine, and their figures mean nothing (a quick check of the paths, as CI's)")
    parser.add_argument("--out", default="", help="the JSON file (default out-gpu-check/gpu_check_<device>.json); the "
                        "commands' output goes to a folder beside it")
    args = parser.parse_args()
    skip = row_names(args.skip)
    jobs = jobs_option(args.jobs, args.tiny)
    setup = device_setup(args.device)
    iters = positive_ints(args.iters or ("12" if args.tiny else "50"), "--iters")
    batch = positive_ints(args.batch_size or ("4" if args.tiny else "16"), "--batch_size")
    memory_batches = positive_ints(args.memory_batches or ("8" if args.tiny else "16,32,64"), "--memory_batches",
                                   many=True)
    timeout = positive_ints(args.timeout, "--timeout")
    block_size = 64 if args.tiny else 1024
    card = re.sub(r"\W+", "_", setup["name"].split(" (")[0]).strip("_").lower()
    out = args.out or os.path.join(ROOT, "out-gpu-check", f"gpu_check_{card}.json")  # not into the repo's bench/
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu_check_", dir=folder)  # the commands' log and runs: beside the figures
    ctx = SimpleNamespace(
        args=args, device=args.device, cuda=setup["kind"] == "cuda", **setup, batch=batch,
        memory_batches=memory_batches,
        # one global batch for every training row: the ddp row's processes x batch_size sequences, so that one
        # process (with as many micro-steps) trains on the same data
        global_tokens=setup["processes"] * batch * block_size, micro_steps=setup["processes"],
        common=["--dataset=shakespeare_char", *(TINY_SHAPE if args.tiny else GPT2_SHAPE), f"--batch_size={batch}",
                f"--max_iters={iters}", f"--eval_interval={iters}", "--eval_iters=2", "--log_interval=1",
                "--warmup_iters=5", "--dropout=0.0", "--overwrite=True"],
        iters=iters, python=sys.executable, work=work, log=os.path.join(work, "log.txt"),
        timeout=timeout, results={}, commands=[],
        texts={})  # sample.py's texts by their settings: see greedy_text
    report = dict(device=ctx.name, capability=ctx.capability, gpu=ctx.cuda, torch=torch.__version__,
                  cuda=torch.version.cuda, python=platform.python_version(), tiny=args.tiny, iters=iters,
                  batch_size=batch, processes=ctx.processes, jobs=jobs, rows=ctx.results, log=ctx.log)

    def save():
        report["summary"] = summary(ctx)
        with atomic_open(out, "w") as f:
            json.dump(report, f, indent=1)

    print(f"device: {ctx.name}; torch {torch.__version__}; every command's output goes to {ctx.log}", flush=True)
    start = time.perf_counter()
    run_rows(ctx, ROWS, save, skip, jobs)
    for path in glob.glob(os.path.join(ctx.work, "*", "ckpt.pt")):  # train's, and any a failed row left
        os.remove(path)
    report["seconds"] = round(time.perf_counter() - start, 1)
    save()
    print("\n" + "\n".join(report["summary"]))
    print(f"\nfigures written to {out}; every command's output in {ctx.log}")
    sys.exit(1 if any(r["status"] == "FAIL" for r in ctx.results.values()) else 0)


if __name__ == "__main__":
    main()
