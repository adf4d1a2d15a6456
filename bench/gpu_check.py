"""The GPU acceptance run: one command that proves the code paths only a GPU runs, and records their figures.

    python bench/gpu_check.py              # on a GPU: the test suite, then the 124M shape; under 10 minutes on one H100
    python bench/gpu_check.py --tiny       # any machine, a tiny model: checks that every step works (CI runs this)

Steps, each a real command in a fresh process, as a user would run them:
1. the test suite (`python -m pytest -q`; --no_tests skips it), with TEST_DEVICE=cuda on a GPU: the tests that take
   a device (tests/conftest.py) run there;
2. train.py on the GPT-2-small shape (12 x 768, 4 kv heads, context 1024, vocab 50304) for --iters iterations of
   --batch_size sequences, in the precision train.py picks (bf16 from compute capability 8.0, fp16 before; fp32 on
   CPU), without and with torch.compile: ms/iter, tokens/s, MFU, the first step's seconds (compilation included)
   and the peak memory;
3. the peak memory of a few steps at each of --memory_batches sequences per micro-step, without and with compile
   ("out of memory" where it does not fit);
4. the same through torchrun on one process, under DDP and under FSDP (fsdp=True);
5. sample.py on the trained checkpoint, eager and --compile=True (CUDA graphs on CUDA): tokens/s after the first
   8 tokens (prefill, compilation and graph recording left out) and their ratio.
The data is Tiny Shakespeare's characters (prepared here), with the vocabulary padded to GPT-2's size so the
model has the 124M shape; the losses mean little, the speed and the paths are the point. Every figure goes to
bench/gpu_check_<device>.json with the device's name; on a CPU the file and the output say that these are not
GPU figures.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: make the repo's modules importable
import torch

from files import atomic_open

GPT2_SHAPE = ["--n_layer=12", "--n_head=12", "--n_kv_head=4", "--n_embd=768", "--block_size=1024", "--vocab_size=50304",
              "--loss_chunk=8192"]  # as config/gpt2_124m.py
TINY_SHAPE = ["--n_layer=2", "--n_head=2", "--n_kv_head=1", "--n_embd=64", "--block_size=64", "--vocab_size=128"]
SPEED = re.compile(r"(\d+) tokens in [\d.]+ s \(([\d.]+) tokens/s; ([\d.]+) after the first \d+\)")
PRECISION = re.compile(r"process\(es\) on \S+, torch\.(\w+)")  # train.py's first line names the dtype it picked


def device_name():
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "CPU (no GPU: these are not GPU figures)"


def run(command, cwd, log, check=True, env=None):
    """Run command; its output goes to the log file. (seconds, output); a failure stops the check with the output,
    unless check=False (the test suite: its failures are recorded and the figures still measured)."""
    start = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    with open(log, "a") as f:
        f.write(f"$ {' '.join(command)}\n{result.stdout}{result.stderr}\n")
    if result.returncode and check:
        sys.exit(f"error: {' '.join(command[:4])} ... failed (exit {result.returncode}); see {log}:\n"
                 + (result.stdout + result.stderr)[-3000:])
    return seconds, result.stdout + result.stderr


def training_figures(out_dir):
    """Median ms/iter, tokens/s and MFU of the logged iterations after the first two timed ones (warm-up); the first
    step's seconds (train.py times it alone: compilation); the peak memory (CUDA); the final loss."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "loss" in r]
    timed = [r for r in records if "ms_per_iter" in r][2:]
    figures = {key: statistics.median(r[key] for r in timed) for key in ("ms_per_iter", "tokens_per_sec", "mfu")
               if timed and key in timed[0]}
    figures["first_step_s"] = next((r["first_step_s"] for r in records if "first_step_s" in r), None)
    figures["peak_memory_gb"] = max((r["peak_memory_gb"] for r in records if "peak_memory_gb" in r), default=None)
    figures["final_loss"] = records[-1]["loss"] if records else None
    return figures


def memory_figures(command, out_dir, work, log):
    """The peak memory of a short train.py run, or "out of memory" where it does not fit."""
    _, output = run([*command, f"--out_dir={out_dir}"], work, log, check=False)
    if "out of memory" in output.lower():
        return "out of memory"
    if not os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
        sys.exit(f"error: {' '.join(command[:4])} ... failed; see {log}:\n{output[-3000:]}")
    return training_figures(out_dir)["peak_memory_gb"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model instead of the 124M shape (any machine)")
    parser.add_argument("--no_tests", action="store_true", help="skip the test suite")
    parser.add_argument("--iters", type=int, default=0, help="training iterations per run (default 50, tiny 12)")
    parser.add_argument("--batch_size", type=int, default=0, help="sequences per iteration (default 16, tiny 4)")
    parser.add_argument("--memory_batches", default="", help="micro-batches whose peak memory is measured, comma-"
                        "separated (default 16,32,64, tiny 8)")
    parser.add_argument("--out", default="", help="the JSON file (default bench/gpu_check_<device>.json)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    iters, batch = args.iters or (12 if args.tiny else 50), args.batch_size or (4 if args.tiny else 16)
    name = device_name()
    out = args.out or os.path.join(ROOT, "bench", "gpu_check_" + re.sub(r"\W+", "_", name.split(" (")[0]).strip("_").lower() + ".json")
    results = dict(device=name, gpu=cuda, torch=torch.__version__, tiny=args.tiny, iters=iters, batch_size=batch)
    print(f"device: {name}; torch {torch.__version__}")
    work = tempfile.mkdtemp(prefix="gpu_check_")
    log = os.path.join(work, "log.txt")
    python, train = sys.executable, os.path.join(ROOT, "train.py")
    env_note = "" if cuda else " (on CPU: not GPU figures)"

    if not args.no_tests:
        seconds, output = run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider"], ROOT, log, check=False,
                              env=dict(os.environ, TEST_DEVICE="cuda" if cuda else "cpu"))
        results["tests"] = dict(seconds=round(seconds, 1), summary=output.strip().splitlines()[-1])
        print(f"tests: {results['tests']['summary']}")

    run([python, os.path.join(ROOT, "data", "shakespeare_char", "prepare.py"), "--out_dir",
         os.path.join(work, "data", "shakespeare_char")], work, log)
    common = [train, "--dataset=shakespeare_char", *(TINY_SHAPE if args.tiny else GPT2_SHAPE), f"--batch_size={batch}",
              f"--max_iters={iters}", f"--eval_interval={iters}", "--eval_iters=2", "--log_interval=1",
              "--warmup_iters=5", "--dropout=0.0", "--overwrite=True"]
    for compile in (False, True):
        out_dir = os.path.join(work, f"train_compile_{compile}")
        seconds, output = run([python, *common, f"--out_dir={out_dir}", f"--compile={compile}"], work, log)
        results["precision"] = PRECISION.search(output).group(1)
        results[f"train_compile_{compile}"] = dict(training_figures(out_dir), seconds=round(seconds, 1))
        print(f"train.py, compile={compile}, {results['precision']}{env_note}: {results[f'train_compile_{compile}']}")
    memory_batches = [int(b) for b in (args.memory_batches or ("8" if args.tiny else "16,32,64")).split(",")]
    results["peak_memory_gb"] = {}
    for compile in (False, True):
        for batch_size in memory_batches:
            key = f"batch {batch_size}, compile={compile}"
            if batch_size == batch:  # the run above measured it (one compilation fewer: the check stays in 10 minutes)
                results["peak_memory_gb"][key] = results[f"train_compile_{compile}"]["peak_memory_gb"]
            else:
                command = [python, *common, f"--batch_size={batch_size}", "--max_iters=3", "--eval_interval=100",
                           f"--compile={compile}"]
                out_dir = os.path.join(work, f"memory_{batch_size}_compile_{compile}")
                results["peak_memory_gb"][key] = memory_figures(command, out_dir, work, log)
            peak = results["peak_memory_gb"][key]
            print(f"peak memory, {key}: " + (f"{peak:.2f} GB" if isinstance(peak, float) else peak or "CUDA only"))
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    for mode in ("ddp", "fsdp"):
        out_dir = os.path.join(work, f"torchrun_{mode}")
        seconds, _ = run([*torchrun, *common, f"--out_dir={out_dir}", f"--fsdp={mode == 'fsdp'}", "--compile=False"],
                         work, log)
        results[f"torchrun_{mode}"] = dict(training_figures(out_dir), seconds=round(seconds, 1))
        print(f"torchrun 1 process, {mode}{env_note}: {results[f'torchrun_{mode}']}")
    ckpt = os.path.join(work, "train_compile_True")
    for compile in (False, True):
        n_new = 64 if args.tiny else 256
        # TORCH_LOGS=cudagraphs shows CUDA-graph trees' "skipping cudagraphs due to ..." (e.g. an input mutated in
        # place that is not a static address), which would leave the compiled step launch-bound
        seconds, output = run([python, os.path.join(ROOT, "sample.py"), f"--out_dir={ckpt}", "--prompt=ROMEO:",
                               "--temperature=0", f"--max_new_tokens={n_new}", f"--compile={compile}"], work, log,
                              env=dict(os.environ, TORCH_LOGS="cudagraphs"))
        if "skipping cudagraphs" in output:
            sys.exit(f"error: sample.py --compile=True skipped CUDA graphs: {output.split('skipping cudagraphs')[1][:300]}")
        tokens, tokens_per_s, steady = SPEED.search(output).groups()
        # sample.py's own figures: its whole decode (compilation included), and after the first 8 tokens
        results[f"sample_compile_{compile}"] = dict(tokens=int(tokens), tokens_per_sec=float(tokens_per_s),
                                                    tokens_per_sec_after_8=float(steady), seconds=round(seconds, 1))
        print(f"sample.py, compile={compile}{env_note}: {steady} tokens/s after the first 8 ({tokens_per_s} overall)")
    results["sample_compiled_over_eager"] = round(results["sample_compile_True"]["tokens_per_sec_after_8"] /
                                                  results["sample_compile_False"]["tokens_per_sec_after_8"], 2)
    print(f"sample.py compiled (CUDA graphs on CUDA) / eager: {results['sample_compiled_over_eager']}x{env_note}")
    results["log"] = log
    with atomic_open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"figures written to {out}; every command's output in {log}")


if __name__ == "__main__":
    main()
