"""
What the KV cache buys: the work and the time of one generated token as the context grows, with the cache
(the new token attends to cached keys and values: constant matmul work, attention work linear in the
context) and without it (the whole context runs again: work linear in the context, attention quadratic).

    python experiments/kv_cache.py                  # GPT-2-small's shape (random weights), contexts 64 .. 1024
    python experiments/kv_cache.py --shape small    # config/small.py's shape, contexts 64 .. 128

FLOPs are counted like train.flops_per_token, for inference: 2 per weight of every matmul per token run,
plus 4 * head_dim per (query, key) pair and head for q.k and the weighted sum of v (causal: a query at
position p reads p + 1 keys). Times are one step's best of --repeats, both ways measured side by side.
Random weights run as fast as trained ones; the logits of both ways are checked to agree.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script
import torch
import torch.nn as nn

from gpt.engine import last_logits, prefill
from model import GPT, GPTConfig

SHAPES = {  # GPT-2 small's (the size where the time shows), and config/small.py's
    "gpt2": dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_kv_head=4, n_embd=768),
    "small": dict(vocab_size=128, block_size=128, n_layer=4, n_head=4, n_kv_head=4, n_embd=128),
}


def step_flops(model, context, cached):
    """FLOPs of the forward work that yields the next token after `context` tokens: with the cache, the last
    token alone against context cached keys; without, all context tokens (the output head at the last only)."""
    cfg = model.config
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head)
    attention_per_pair = 4 * cfg.n_layer * cfg.n_head * cfg.head_dim  # q.k and the v sum, every layer and head
    head = 2 * model.lm_head.weight.numel()
    if cached:
        return 2 * body + attention_per_pair * context + head
    pairs = context * (context + 1) // 2  # causal: position p reads p + 1 keys
    return 2 * body * context + attention_per_pair * pairs + head


def best_ms(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1000 * best


@torch.inference_mode()
def measure(model, context, repeats=3):
    """(ms with the cache, ms without, largest logit difference) of the step after `context` tokens."""
    tokens = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    cache, last = prefill(model, tokens, context)  # context - 1 tokens cached, the last one to feed

    def cached_step():
        cache.truncate(context - 1)  # the same step each time: forget the token the last run fed
        return last_logits(model, last, cache)

    with_cache = cached_step()
    without_cache = last_logits(model, tokens, None)
    difference = (with_cache - without_cache).abs().max().item()
    return best_ms(cached_step, repeats), best_ms(lambda: last_logits(model, tokens, None), repeats), difference


def contexts(block_size):
    """64, 128, ... up to block_size."""
    sizes, size = [], 64
    while size <= block_size:
        sizes.append(size)
        size *= 2
    return sizes or [block_size]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="gpt2", help="model shape (default: gpt2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each step, best kept (default: 3)")
    args = parser.parse_args()
    if args.repeats < 1:  # else no run is timed: inf ms and a ratio of nan
        parser.error("--repeats must be at least 1")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPES[args.shape])).eval()
    from bench.bench_train import machine  # the machine line every figure in this repo carries

    print(machine())
    print(f"{args.shape} shape, {model.num_params() / 1e6:.1f}M parameters, fp32, random weights; one generated token")
    print(f"{'context':>8} {'GFLOPs cached':>14} {'uncached':>9} {'ratio':>6} {'ms cached':>10} {'uncached':>9} "
          f"{'ratio':>6} {'max |logit diff|':>17}")
    for context in contexts(model.config.block_size):
        flops = [step_flops(model, context, cached) / 1e9 for cached in (True, False)]
        ms_cached, ms_uncached, difference = measure(model, context, args.repeats)
        print(f"{context:>8} {flops[0]:>14.3f} {flops[1]:>9.2f} {flops[1] / flops[0]:>5.0f}x {ms_cached:>10.2f} "
              f"{ms_uncached:>9.2f} {ms_uncached / ms_cached:>5.1f}x {difference:>17.1e}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: no traceback, and the shell's status for it
        sys.exit(130)
