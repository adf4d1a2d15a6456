"""The GPU acceptance run: one command that runs every mode a GPU owner depends on, each as a row with PASS or FAIL
and its figures, and ends with a summary to paste into a bug report.

    python bench/gpu_check.py                  # on a GPU: the test suite, then every row at the 124M shape
    python bench/gpu_check.py --device=cuda:1  # one card of several
    python bench/gpu_check.py --tiny           # any machine, a tiny model: every row runs (CI runs this on the CPU)

Each row runs real commands in fresh processes, as a user would type them, with --device passed to every train.py
and sample.py; a row that fails records its error line and the last lines of its output, and the rows after it
still run (the decoding rows need train's checkpoint: without it they fail with "needs the train row").
The rows:
  tests        the test suite, with TEST_DEVICE=cuda on a GPU (tests/conftest.py); --no_tests skips it
  data         data/shakespeare_char/prepare.py (Tiny Shakespeare's characters; every run below trains on them)
  train_eager  train.py, one process, --compile=False: the speed torch.compile is measured against
  train        train.py, one process, --compile=True: ms/iter, tokens/s, MFU, the first step (compilation) and
               the graphs compiled, and its speed over train_eager's
  ddp          torchrun over every visible GPU (2 gloo processes on the CPU), --compile=True
  fsdp         the same with --fsdp=True --activation_checkpointing=True
  fp16         --dtype=float16, the gradient scaler's path: finite losses, and the optimizer steps it let through
  bf16         --dtype=bfloat16, where the card has it (compute capability 8.0 on; else skipped, not failed)
  memory       the peak memory of a few steps at each of --memory_batches sequences per micro-step, eager and
               compiled ("out of memory" where it does not fit: a figure, not a failure)
  int8         sample.py --quantize=int8 on train's checkpoint, eager and compiled (its fast path)
  graphs       sample.py eager and --compile=True (CUDA graphs on CUDA; "skipping cudagraphs" fails the row):
               tokens/s after the first 8 tokens (prefill, compilation and graph recording left out), and the ratio
The training rows share one global batch (--batch_size sequences per process and micro-step, on as many processes
as the ddp row runs), so one process, DDP and FSDP train the same model on the same data: on the CPU, in float32,
their losses agree. The model has GPT-2 small's shape (12 x 768, 4 kv heads, context 1024, vocab 50304) in the
precision train.py picks (bf16 from compute capability 8.0, fp16 before), or with --tiny a tiny one; the losses
mean little, the paths and the speed are the point.

Time on one H100, estimated (no GPU has run it yet): 6-9 minutes of rows, most of it torch.compile (train, ddp,
fsdp, the compiled memory runs at 32 and 64 and both compiled decodes each compile for ~30-60 s), plus the test
suite; --no_tests, or --memory_batches=16 (measured by the train rows already), make it shorter.

Everything goes to bench/gpu_check_<device>.json (after every row, so a run cut short keeps what it did) and every
command's output to a log file; on a CPU the output, the summary and the file say that these are not GPU figures.
The exit status is 1 if any row failed.
"""

import argparse
import contextlib
import glob
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
import time
import traceback
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: make the repo's modules importable
import torch

from files import atomic_open

TRAIN, SAMPLE = os.path.join(ROOT, "train.py"), os.path.join(ROOT, "sample.py")
GPT2_SHAPE = ["--n_layer=12", "--n_head=12", "--n_kv_head=4", "--n_embd=768", "--block_size=1024", "--vocab_size=50304",
              "--loss_chunk=8192"]  # as config/gpt2_124m.py
TINY_SHAPE = ["--n_layer=2", "--n_head=2", "--n_kv_head=1", "--n_embd=64", "--block_size=64", "--vocab_size=128"]
SPEED = re.compile(r"(\d+) tokens in [\d.]+ s \(([\d.]+) tokens/s; ([\d.]+) after the first \d+\)")  # sample.py's
PRECISION = re.compile(r"process\(es\) on \S+, torch\.(\w+)")  # train.py's first line names the dtype it picked
# torchrun's launcher, once a worker failed, prints its own traceback and a summary that name no cause: the cause is
# in the worker's output before this line
TORCHRUN_REPORT = re.compile(r"^E\d{4} .*torch/distributed/elastic/multiprocessing/api\.py:\d+\] failed", re.M)
RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failed|Interrupt|Exit)\b")  # a traceback's last line
TAIL_LINES = 40  # of a failed command's output, kept in the JSON and the log: the traceback a bug report needs


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


def run(ctx, command, env=None, cwd=None):
    """Run one command in a fresh process; its output (stdout and stderr interleaved) is appended to the log.
    (returncode, output); returncode None when it ran past --timeout. The command gets a process group of its own,
    so that a timeout, or Ctrl-C here, can end all of it (see stop)."""
    ctx.commands.append(shlex.join(command))
    with open(ctx.log, "a") as f:
        f.write(f"$ {shlex.join(command)}\n")
    proc = subprocess.Popen(command, cwd=cwd or ctx.work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=ctx.timeout)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        output, returncode = stop(proc) + f"\ngpu_check: stopped after --timeout={ctx.timeout} s\n", None
    except BaseException:  # Ctrl-C: end the command too (it is out of the terminal's reach), then stop here
        stop(proc)
        raise
    with open(ctx.log, "a") as f:
        f.write(output + "\n")
    return returncode, output


def stop(proc):
    """End a command and all it started; its output. SIGTERM first: torchrun passes it on to its workers, which run
    in sessions of their own that a signal to this group does not reach (and train.py saves and exits on it); what
    is left a minute later gets SIGKILL."""
    for sig, grace in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            return proc.communicate(timeout=grace)[0]
        except subprocess.TimeoutExpired:
            pass
    return "gpu_check: the command's output did not close after SIGKILL (a process of it still holds it)"


def must(ctx, command, env=None, cwd=None):
    """The output of a command that must succeed; else the row fails with the command's last error line."""
    returncode, output = run(ctx, command, env, cwd)
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
    after the first two timed ones (warm-up); the first step's seconds (train.py times it alone: compilation) and
    the graphs it compiled (compiled_graphs, where train.py logs it); the peak memory (CUDA); the final loss; the
    precision train.py picked. A loss that is not finite fails the row."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if "loss" in r]
    timed = [r for r in steps if "ms_per_iter" in r]
    timed = timed[2:] if len(timed) > 2 else timed
    figures = {key: statistics.median(r[key] for r in timed) for key in ("ms_per_iter", "tokens_per_sec", "mfu")
               if timed and key in timed[0]}
    first = next((r for r in records if "first_step_s" in r), {})
    figures.update(first_step_s=first.get("first_step_s"), compiled_graphs=first.get("compiled_graphs"),
                   peak_memory_gb=max((r["peak_memory_gb"] for r in records if "peak_memory_gb" in r), default=None),
                   final_loss=steps[-1]["loss"] if steps else None, iters=steps[-1]["iter"] if steps else 0)
    precision = PRECISION.search(output)
    figures["precision"] = precision.group(1) if precision else None
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
    return text + f", loss {figures['final_loss']:.4f}, {figures['precision']}"


def compile_note(ctx, figures, output):
    """What a --compile=True run says about compilation. On CUDA it must have compiled: train.py logs the graphs it
    compiled as compiled_graphs, and 0 or none fails the row. On the CPU train.py does not compile."""
    if not ctx.cuda:
        return "compile unused: train.py compiles on CUDA only"
    graphs = figures.get("compiled_graphs")
    if not graphs:
        raise RowFailed(f"--compile=True, but metrics.jsonl says compiled_graphs={graphs}: torch.compile compiled "
                        "no graph (or this train.py does not count them)", output, figures)
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
    """Run train.py for a row; its figures, and its output."""
    env = None
    if processes is not None:  # --device=cuda:N: torchrun sees that card alone (ctx.one_card)
        env = dict(os.environ, **ctx.one_card)
        if not ctx.cuda:
            env.setdefault("OMP_NUM_THREADS", "1")  # gloo processes sharing the cores: one thread each is far faster
    output = must(ctx, train_command(ctx, name, *settings, processes=processes), env)
    return training_figures(os.path.join(ctx.work, name), output), output


def drop_checkpoint(ctx, name):
    """ckpt.pt is 1.5 GB at the 124M shape (weights and AdamW state): only train's is read again (decoding)."""
    path = os.path.join(ctx.work, name, "ckpt.pt")
    if os.path.exists(path):
        os.remove(path)


def row_tests(ctx):
    if ctx.args.no_tests:
        raise RowSkipped("--no_tests")
    test_device = "cuda" if ctx.cuda else ctx.kind  # a cuda:N is the only card its CUDA_VISIBLE_DEVICES shows
    returncode, output = run(ctx, [ctx.python, "-m", "pytest", "-p", "no:cacheprovider"],
                             dict(os.environ, **ctx.one_card, TEST_DEVICE=test_device), cwd=ROOT)
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
    return f"{ctx.processes} process{'es' * (ctx.processes > 1)}" + (" (gloo)" if not ctx.cuda else "")


def row_ddp(ctx):
    figures, output = train_run(ctx, "ddp", "--compile=True", processes=ctx.processes)
    drop_checkpoint(ctx, "ddp")
    return figures, f"{processes(ctx)}: {speed(figures)}; {compile_note(ctx, figures, output)}"


def row_fsdp(ctx):
    settings = ["--compile=True", "--fsdp=True", "--activation_checkpointing=True"]
    note = ""
    if ctx.cuda and not ctx.has_bf16:  # FSDP refuses float16 (train.check_fsdp), which auto picks on this card
        settings.append("--dtype=float32")
        note = " (float32: fsdp takes no float16, and this card has no bfloat16)"
    figures, output = train_run(ctx, "fsdp", *settings, processes=ctx.processes)
    drop_checkpoint(ctx, "fsdp")
    return figures, (f"{processes(ctx)}, activation checkpointing: {speed(figures)}{note}; "
                     f"{compile_note(ctx, figures, output)}")


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


def decode(ctx, *settings):
    """sample.py on train's checkpoint, greedy: its tokens/s overall and after the first 8 tokens."""
    new_tokens = 64 if ctx.args.tiny else 256
    checkpoint = os.path.join(ctx.work, "train")
    # needs train's checkpoint, not its PASS: a train row that failed on a figure alone (compiled_graphs) wrote one
    if not os.path.exists(os.path.join(checkpoint, "ckpt.pt")):
        raise RowFailed("needs the train row, which failed before writing its checkpoint")
    # TORCH_LOGS=cudagraphs shows CUDA-graph trees' "skipping cudagraphs due to ..." (e.g. an input mutated in place
    # that is not a static address), which would leave the compiled step launch-bound
    output = must(ctx, [ctx.python, SAMPLE, f"--out_dir={checkpoint}", "--prompt=ROMEO:",
                        "--temperature=0", f"--max_new_tokens={new_tokens}", f"--device={ctx.device}", *settings],
                  dict(os.environ, TORCH_LOGS="cudagraphs"))
    if "skipping cudagraphs" in output:
        reason = output.split("skipping cudagraphs")[1].splitlines()[0]
        raise RowFailed(f"sample.py {' '.join(settings)} skipped CUDA graphs{reason[:300]}", output)
    match = SPEED.search(output)
    if not match:
        raise RowFailed("sample.py printed no speed line", output)
    tokens, overall, steady = match.groups()
    return dict(tokens=int(tokens), tokens_per_sec=float(overall), tokens_per_sec_after_8=float(steady))


def row_int8(ctx):
    # weight-only int8 (quantize.py): compiled, the int8 weights' cast fuses into the product (on a GPU at batch 1);
    # eager, every step makes a float copy of each weight
    figures = dict(eager=decode(ctx, "--quantize=int8", "--compile=False"),
                   compiled=decode(ctx, "--quantize=int8", "--compile=True"))
    figures["compiled_over_eager"] = round(figures["compiled"]["tokens_per_sec_after_8"] /
                                           figures["eager"]["tokens_per_sec_after_8"], 2)
    key = (f"{figures['eager']['tokens_per_sec_after_8']:,.1f} tokens/s eager, "
           f"{figures['compiled']['tokens_per_sec_after_8']:,.1f} compiled: {figures['compiled_over_eager']}x"
           " (after the first 8 tokens)")
    return figures, key


def row_graphs(ctx):
    figures = dict(eager=decode(ctx), compiled=decode(ctx, "--compile=True"))
    figures["compiled_over_eager"] = round(figures["compiled"]["tokens_per_sec_after_8"] /
                                           figures["eager"]["tokens_per_sec_after_8"], 2)
    key = (f"{figures['eager']['tokens_per_sec_after_8']:,.1f} tokens/s eager, "
           f"{figures['compiled']['tokens_per_sec_after_8']:,.1f} compiled: {figures['compiled_over_eager']}x "
           "(after the first 8 tokens)")
    return figures, key + ("" if ctx.cuda else "; no CUDA graphs on the CPU: compiled without them")


# (name, the rows it needs to have passed, the row)
ROWS = [
    ("tests", [], row_tests),
    ("data", [], row_data),
    ("train_eager", ["data"], row_train_eager),
    ("train", ["data"], row_train),
    ("ddp", ["data"], row_ddp),
    ("fsdp", ["data"], row_fsdp),
    ("fp16", ["data"], row_fp16),
    ("bf16", ["data"], row_bf16),
    ("memory", ["data"], row_memory),
    ("int8", [], row_int8),  # these two decode train's checkpoint: see decode
    ("graphs", [], row_graphs),
]


# ----------------------------------------------------------------------------------------------------
# Running the rows, the summary


def run_rows(ctx, rows, save=lambda: None):
    """Run each row, recording into ctx.results whatever happens to it, and go on to the next; save() after each."""
    for number, (name, needs, row) in enumerate(rows, 1):
        print(f"[{number}/{len(rows)}] {name} ...", flush=True)
        with open(ctx.log, "a") as f:
            f.write(f"\n===== row {name} =====\n")
        ctx.commands, start = [], time.perf_counter()
        missing = [need for need in needs if ctx.results.get(need, {}).get("status") != "PASS"]
        try:
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
        ctx.results[name] = result
        print(f"    {result['status']} ({result['seconds']} s): {result.get('key') or result['error']}", flush=True)
        if result["status"] == "FAIL":
            last_lines = "\n".join("      " + line for line in result["output_tail"])
            print(last_lines, flush=True)
            with open(ctx.log, "a") as f:
                f.write(f"FAIL {name}: {result['error']}\n  last lines:\n{last_lines}\n")
        save()


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
    if device == "auto":  # as train.py and sample.py resolve it (checkpoint.resolve_device)
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
                 has_bf16=capability >= (8, 0))  # what checkpoint.resolve_dtype requires of bfloat16
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda or cuda:N; "
                        "passed to every train.py and sample.py")
    parser.add_argument("--tiny", action="store_true", help="a tiny model instead of the 124M shape (any machine)")
    parser.add_argument("--no_tests", action="store_true", help="skip the test suite")
    parser.add_argument("--iters", default="", help="training iterations per row (default 50, tiny 12)")
    parser.add_argument("--batch_size", default="", help="sequences per process and micro-step (default 16, tiny 4)")
    parser.add_argument("--memory_batches", default="", help="micro-batches whose peak memory is measured, comma-"
                        "separated (default 16,32,64, tiny 8)")
    parser.add_argument("--timeout", default="1800", help="seconds one command may run before its row fails "
                        "(default 1800; a hung NCCL collective would otherwise never end)")
    parser.add_argument("--out", default="", help="the JSON file (default bench/gpu_check_<device>.json)")
    args = parser.parse_args()
    setup = device_setup(args.device)
    iters = positive_ints(args.iters or ("12" if args.tiny else "50"), "--iters")
    batch = positive_ints(args.batch_size or ("4" if args.tiny else "16"), "--batch_size")
    block_size = 64 if args.tiny else 1024
    work = tempfile.mkdtemp(prefix="gpu_check_")
    ctx = SimpleNamespace(
        args=args, device=args.device, cuda=setup["kind"] == "cuda", **setup, batch=batch,
        memory_batches=positive_ints(args.memory_batches or ("8" if args.tiny else "16,32,64"), "--memory_batches",
                                     many=True),
        # one global batch for every training row: the ddp row's processes x batch_size sequences, so that one
        # process (with as many micro-steps) trains on the same data
        global_tokens=setup["processes"] * batch * block_size, micro_steps=setup["processes"],
        common=["--dataset=shakespeare_char", *(TINY_SHAPE if args.tiny else GPT2_SHAPE), f"--batch_size={batch}",
                f"--max_iters={iters}", f"--eval_interval={iters}", "--eval_iters=2", "--log_interval=1",
                "--warmup_iters=5", "--dropout=0.0", "--overwrite=True"],
        python=sys.executable, work=work, log=os.path.join(work, "log.txt"),
        timeout=positive_ints(args.timeout, "--timeout"), results={},
        commands=[])
    card = re.sub(r"\W+", "_", ctx.name.split(" (")[0]).strip("_").lower()
    out = args.out or os.path.join(ROOT, "bench", f"gpu_check_{card}.json")
    report = dict(device=ctx.name, capability=ctx.capability, gpu=ctx.cuda, torch=torch.__version__,
                  cuda=torch.version.cuda, python=platform.python_version(), tiny=args.tiny, iters=iters,
                  batch_size=batch, processes=ctx.processes, rows=ctx.results, log=ctx.log)

    def save():
        report["summary"] = summary(ctx)
        with atomic_open(out, "w") as f:
            json.dump(report, f, indent=1)

    print(f"device: {ctx.name}; torch {torch.__version__}; every command's output goes to {ctx.log}", flush=True)
    start = time.perf_counter()
    run_rows(ctx, ROWS, save)
    for path in glob.glob(os.path.join(ctx.work, "*", "ckpt.pt")):  # train's, and any a failed row left
        os.remove(path)
    report["seconds"] = round(time.perf_counter() - start, 1)
    save()
    print("\n" + "\n".join(report["summary"]))
    print(f"\nfigures written to {out}; every command's output in {ctx.log}")
    sys.exit(1 if any(r["status"] == "FAIL" for r in ctx.results.values()) else 0)


if __name__ == "__main__":
    main()
