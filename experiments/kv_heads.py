"""
Multi-head, grouped-query and multi-query attention side by side: config/small.py trained with n_kv_head 4
(MHA: every query head has its own keys and values), 2 (GQA) and 1 (MQA), each for the same number of
training tokens, then compared on parameters, KV-cache bytes per token, decode ms per token and val loss.
One more run of n_kv_head 4 with another seed shows how much of a val-loss difference is noise.

    python experiments/kv_heads.py                    # four runs of config/small.py: ~10 min on 2 CPU cores
    python experiments/kv_heads.py --max_iters=300    # shorter runs; other --key=value go to train.py too

The runs go to --out_dir/kv4, kv2, kv1 and kv4-seed2 (default out-kv-heads), replacing earlier ones there.
"""

import argparse
import contextlib
import io
import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script
import torch

import train
from gpt import UserError
from gpt.checkpoint import load_model
from gpt.engine import Samples, decode_batch
from gpt.tokenizer import Tokenizer

RUNS = [("kv4", 4, 1337), ("kv2", 2, 1337), ("kv1", 1, 1337), ("kv4-seed2", 4, 1338)]  # name, n_kv_head, seed


def train_run(config, out_dir, n_kv_head, seed, overrides):
    """Train config with n_kv_head and seed into out_dir (its printout kept out of the table); wall seconds. A signal
    that stopped the run (train.py saved and returned) ends the script, with the shell's status for it, as compare.py
    does: the runs after it would not hear it."""
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        stopped_by = train.main([config, f"--out_dir={out_dir}", f"--n_kv_head={n_kv_head}", f"--seed={seed}",
                                 "--overwrite", *overrides])
    if stopped_by:
        print(f"stopped by {signal.Signals(stopped_by).name} during {os.path.basename(out_dir)}; its checkpoint is in "
              f"{out_dir}", file=sys.stderr)
        sys.exit(128 + stopped_by)
    return time.perf_counter() - start


def final_val_loss(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["val_loss"] for line in f if '"val_loss"' in line][-1]


@torch.inference_mode()
def decode_ms_per_token(model, tokenizer, new_tokens=100, repeats=3):
    """Greedy batch-1 decoding, ms per token of the decode phase: a run of new_tokens minus a run of 1,
    so prefill and setup cancel; best of repeats."""
    settings = dict(num_samples=1, temperature=0.0, top_k=None, top_p=None, no_kv_cache=False, compile=False)
    prompt = tokenizer.encode("ROMEO:")

    def run(n):
        samples = Samples(1, tokenizer, [], stream=False)
        start = time.perf_counter()
        decode_batch(model, prompt, dict(settings, max_new_tokens=n), samples, None)
        return time.perf_counter() - start

    best = min(run(new_tokens) - run(1) for _ in range(repeats))
    return 1000 * best / (new_tokens - 1)


def kv_bytes_per_token(config, bytes_per_value=4):
    """A token's keys and values in every layer: 2 x n_layer x n_kv_head x head_dim values (fp32: 4 bytes)."""
    return 2 * config.n_layer * config.n_kv_head * config.head_dim * bytes_per_value


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(ROOT, "config", "small.py"), help="the config to train")
    parser.add_argument("--out_dir", default="out-kv-heads", help="where the runs go (default: out-kv-heads)")
    args, overrides = parser.parse_known_args()
    args.config, args.out_dir = os.path.abspath(args.config), os.path.abspath(args.out_dir)
    os.chdir(ROOT)  # train.py reads data/<dataset> from the working directory
    from bench.bench_train import machine  # the machine line every figure in this repo carries

    print(machine())
    rows = []
    for name, n_kv_head, seed in RUNS:
        out_dir = os.path.join(args.out_dir, name)
        seconds = train_run(args.config, out_dir, n_kv_head, seed, overrides)
        model, meta, _ = load_model(out_dir)
        rows.append((name, n_kv_head, seed, model.num_params(), kv_bytes_per_token(model.config),
                     decode_ms_per_token(model, Tokenizer(meta)), final_val_loss(out_dir), seconds))
        print(f"trained {name} in {seconds:.0f} s", flush=True)
    print(f"\n{' '.join([os.path.relpath(args.config), *overrides])}: the same training tokens for each run")
    print(f"{'run':>10} {'n_kv_head':>9} {'seed':>5} {'parameters':>10} {'KV bytes/token':>14} {'decode ms/token':>15} "
          f"{'val loss':>8} {'train s':>7}")
    for name, n_kv_head, seed, params, kv, ms, loss, seconds in rows:
        print(f"{name:>10} {n_kv_head:>9} {seed:>5} {params:>10,} {kv:>14,} {ms:>15.2f} {loss:>8.4f} {seconds:>7.0f}")
    noise = abs(rows[0][6] - rows[3][6])
    print(f"noise: the two seeds of n_kv_head 4 differ by {noise:.4f} in val loss")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # Ctrl-C while it measures (while it trains, train.main returns the stop instead)
        sys.exit(130)
