"""Training speed and loss over wall-clock time of a config on this machine: runs train.py, then reads its metrics.

    python bench/bench_train.py                      # config/small.py: ~150 s on a 2-core CPU
    python bench/bench_train.py config/small.py --out_dir=out-bench --max_iters=30 --eval_interval=10

Prints the machine, the median ms/iter and tokens/s, every evaluation (iteration, wall-clock seconds, train
and val loss) and when val loss first reached --target (1.70: the goal of config/small.py). Other --key=value
arguments go to train.py. The run trains from scratch in --out_dir (default out-bench rather than the config's
own, so no real run is overwritten), replacing what an earlier run left there (--overwrite).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: make train.py and `data` importable
import torch

from configurator import configure
from gpt import UserError
from gpt.cpuinfo import cpu_name
from gpt.shards import find_shards
from train import DEFAULTS

WARMUP_LOGS = 2  # the first logs carry one-time costs (allocator warm-up; torch.compile on CUDA)
TRAIN_LOG_LINE = re.compile(r"iter \d+: loss ")  # train.py's per-log line: the medians below replace them


def machine():
    cpu = cpu_name()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    load = f", load average {os.getloadavg()[0]:.2f} at start" if hasattr(os, "getloadavg") else ""
    return (f"machine: {cpu}, {os.cpu_count()} cores{load}\n"
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, CUDA device: {gpu}")


def run_train(argv):
    """Run train.py with argv, its output shown except the per-log training lines; returns wall-clock seconds."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # lines as they come, not in blocks
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "train.py", *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        for line in proc.stdout:
            if not TRAIN_LOG_LINE.match(line):
                print(line, end="", flush=True)
        returncode = proc.wait()
    except KeyboardInterrupt:  # Ctrl-C reaches train.py too: it saves a checkpoint and stops
        proc.wait()
        sys.exit("error: interrupted; no figures")
    if returncode:
        sys.exit(f"error: train.py exited with status {returncode} (its message is above)")
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="the config file (default: config/small.py)")
    parser.add_argument("--out_dir", default="out-bench", help="where the run goes (default: out-bench)")
    parser.add_argument("--target", type=float, default=1.70, help="val loss to reach (default: 1.70)")
    args, overrides = parser.parse_known_args()
    config = os.path.abspath(args.config) if args.config else os.path.join(ROOT, "config", "small.py")
    out_dir = os.path.abspath(args.out_dir)  # both absolute: train.py runs in the repo root
    train_argv = [config, *overrides, f"--out_dir={out_dir}", "--init_from=scratch", "--overwrite"]
    try:
        # bad overrides and missing data fail now, with train.py's one-line messages, not after its startup
        settings = configure(DEFAULTS, [args.config or config, *train_argv[1:]])
        for split in ("train", "val"):
            find_shards(os.path.join(ROOT, "data", settings["dataset"]), split)  # names the prepare command
    except UserError as e:
        sys.exit(f"error: {e}")

    print(machine())
    print(f"run: train.py {' '.join([os.path.relpath(config, ROOT), *overrides])} --out_dir={args.out_dir}", flush=True)
    process_seconds = run_train(train_argv)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    logs, evals = [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]
    if not logs or not evals:
        sys.exit("error: the run logged no training records or no evaluations; raise --max_iters")

    steady = logs[WARMUP_LOGS:] or logs
    tokens_per_iter = settings["batch_size"] * settings["block_size"] * settings["gradient_accumulation_steps"]
    print(f"\nspeed: {statistics.median(r['ms_per_iter'] for r in steady):.1f} ms/iter, "
          f"{statistics.median(r['tokens_per_sec'] for r in steady):,.0f} tokens/s ({tokens_per_iter:,} tokens per "
          f"iteration; median of {len(steady)} logs, the first {len(logs) - len(steady)} left out as warm-up)")
    print(f"\n{'iter':>6} {'seconds':>8} {'train loss':>11} {'val loss':>9}")
    for r in evals:
        print(f"{r['iter']:>6} {r['time']:>8.1f} {r['train_loss']:>11.4f} {r['val_loss']:>9.4f}")
    last, seconds = evals[-1], max(r["time"] for r in records)
    print(f"\nfinal val loss {last['val_loss']:.4f} at iter {last['iter']}; {seconds:.1f} s of training (evaluations "
          f"included), {process_seconds:.1f} s with startup")
    reached = next((r for r in evals if r["val_loss"] <= args.target), None)
    if reached:
        print(f"val loss <= {args.target:.2f} first at iter {reached['iter']}, {reached['time']:.1f} s")
    else:
        best = min(evals, key=lambda r: r["val_loss"])
        print(f"val loss never reached {args.target:.2f} (best {best['val_loss']:.4f} at iter {best['iter']})")


if __name__ == "__main__":
    main()
