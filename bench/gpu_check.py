"""The GPU acceptance run: one command that proves the code paths only a GPU runs, and records their figures.

    python bench/gpu_check.py              # on a GPU: the test suite, then the 124M shape; under 10 minutes on one H100
    python bench/gpu_check.py --tiny       # any machine, a tiny model: checks that every step works (CI runs this)

Steps, each a real command in a fresh process, as a user would run them:
1. the test suite (`python -m pytest -q`; --no_tests skips it);
2. train.py on the GPT-2-small shape (12 x 768, 4 kv heads, context 1024, vocab 50304) for --iters iterations of
   --batch_size sequences, bf16 on CUDA (fp32 elsewhere), without and with torch.compile: ms/iter, tokens/s, MFU;
3. the same through torchrun on one process, under DDP and under FSDP (fsdp=True);
4. sample.py on the trained checkpoint, eager and --compile=True (CUDA graphs on CUDA): tokens/s.
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
SPEED = re.compile(r"(\d+) tokens in [\d.]+ s \(([\d.]+) tokens/s\)")


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
    """Median ms/iter, tokens/s and MFU of the logged iterations after the first two (compile, warm-up)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        logs = [r for r in map(json.loads, f) if "ms_per_iter" in r][2:]
    figures = {key: statistics.median(r[key] for r in logs) for key in ("ms_per_iter", "tokens_per_sec", "mfu")
               if logs and key in logs[0]}
    figures["final_loss"] = logs[-1]["loss"] if logs else None
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model instead of the 124M shape (any machine)")
    parser.add_argument("--no_tests", action="store_true", help="skip the test suite")
    parser.add_argument("--iters", type=int, default=0, help="training iterations per run (default 50, tiny 12)")
    parser.add_argument("--batch_size", type=int, default=0, help="sequences per iteration (default 16, tiny 4)")
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
        seconds, output = run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider"], ROOT, log, check=False)
        results["tests"] = dict(seconds=round(seconds, 1), summary=output.strip().splitlines()[-1])
        print(f"tests: {results['tests']['summary']}")

    run([python, os.path.join(ROOT, "data", "shakespeare_char", "prepare.py"), "--out_dir",
         os.path.join(work, "data", "shakespeare_char")], work, log)
    common = [train, "--dataset=shakespeare_char", *(TINY_SHAPE if args.tiny else GPT2_SHAPE), f"--batch_size={batch}",
              f"--max_iters={iters}", f"--eval_interval={iters}", "--eval_iters=2", "--log_interval=1",
              "--warmup_iters=5", "--dropout=0.0", "--overwrite=True"]
    for compile in (False, True):
        out_dir = os.path.join(work, f"train_compile_{compile}")
        seconds, _ = run([python, *common, f"--out_dir={out_dir}", f"--compile={compile}"], work, log)
        results[f"train_compile_{compile}"] = dict(training_figures(out_dir), seconds=round(seconds, 1))
        print(f"train.py, compile={compile}{env_note}: {results[f'train_compile_{compile}']}")
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
        tokens, tokens_per_s = SPEED.search(output).groups()
        # sample.py's own figure: its whole decode, the first compile included (compile=True: CUDA graphs on CUDA)
        results[f"sample_compile_{compile}"] = dict(tokens=int(tokens), tokens_per_sec=float(tokens_per_s),
                                                    seconds=round(seconds, 1))
        print(f"sample.py, compile={compile}{env_note}: {tokens_per_s} tokens/s (compile time included)")
    results["log"] = log
    with atomic_open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"figures written to {out}; every command's output in {log}")


if __name__ == "__main__":
    main()
