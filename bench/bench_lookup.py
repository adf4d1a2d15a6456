"""When does prompt lookup (sample.py --draft=lookup) pay? Its acceptance on a trained model, its step costs on a model
whose step is bound by reading its weights, and the speed the two give, beside plain decoding in each mode.

    python bench/bench_lookup.py --model=out-small --target=/tmp/llamacpp-anchor/gpt2shape.pt

A lookup step feeds the last token alone (nothing proposed) or with draft_k proposed tokens, and keeps 1 to
draft_k + 1 tokens. How many it keeps is a property of the model and the text: --model is a trained checkpoint,
decoded greedily and sampled (temperature 0.8) after a plain prompt, and greedily after a prompt that quotes a
passage and starts it again (text that repeats what it has read: a quote, code being edited). What a step costs is
a property of the weights' size and the machine: --target's compiled one-token and (draft_k + 1)-token steps are
timed in each mode (best of 5 x 10 after a first call), at --target's shape, no trained weights needed. The speed
of lookup on a trained model of --target's size is then tokens / (one-token steps x their cost + checks x theirs),
as ms per token; "vs fastest" divides plain decoding's fastest mode (one-token step) by it.
"""

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: make the repo's modules importable
from gpt import engine, kernels, speculative, static_step
from gpt.checkpoint import load_model
from gpt.cpuinfo import cpu_name
from gpt.quantize import quantize
from gpt.tokenizer import Tokenizer

MODES = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None), "int8": (torch.float32, "int8"),
         "int8 bf16": (torch.bfloat16, "int8"), "w8a8": (torch.float32, "w8a8")}
PASSAGE = ("But, soft! what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n")


def lookup_counts(model, tokenizer, prompt, temperature, k, new_tokens):
    """(tokens made, one-token steps, (k + 1)-token steps, accepted, proposed) of decode_lookup after prompt."""
    steps = []
    settings = dict(num_samples=1, max_new_tokens=new_tokens, temperature=temperature, top_k=None, top_p=None,
                    no_kv_cache=False, compile=False, draft_k=k)
    decode_step = speculative.decode_step

    def counted(model, tokens, cache, input_pos):
        steps.append(tokens.size(1))
        return decode_step(model, tokens, cache, input_pos)

    speculative.decode_step = counted
    try:
        samples = engine.Samples(1, tokenizer, [], stream=False)
        accepted, proposed = speculative.decode_lookup(model, tokenizer.encode(prompt), settings, samples,
                                                       torch.Generator().manual_seed(0))
    finally:
        speculative.decode_step = decode_step
    return samples.n_tokens, steps.count(1), len(steps) - steps.count(1), accepted, proposed


def step_costs(target, mode, k):
    """Seconds of --target's compiled one-token step and (k + 1)-token step in mode, on a static cache."""
    dtype, scheme = MODES[mode]
    model = quantize(load_model(target, dtype=dtype)[0], scheme)
    costs = []
    with torch.inference_mode(), kernels.decode_linears(model, (k + 1, 1), compiled=True):  # as decode_lookup
        step = static_step.compile_decode_step(torch.device("cpu"))
        cache, _ = engine.prefill(model, torch.randint(0, 1000, (1, 64)), 256, static=True)
        for n in (1, k + 1):
            tokens, input_pos = torch.randint(0, 1000, (1, n)), torch.arange(cache.pos, cache.pos + n)
            step(model, tokens, cache, input_pos)
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(10):
                    step(model, tokens, cache, input_pos)
                best = min(best, (time.perf_counter() - start) / 10)
            costs.append(best)
    return costs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="out-small", help="a trained checkpoint: what lookup keeps on it")
    parser.add_argument("--target", required=True, help="a checkpoint of the size to time (its weights unused)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)}")
    parser.add_argument("--draft_k", type=int, default=4)
    parser.add_argument("--new_tokens", type=int, default=300)
    args = parser.parse_args()
    cpu = cpu_name()
    print(f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}; draft_k {args.draft_k}")

    model, meta, _ = load_model(args.model)
    tokenizer, k = Tokenizer(meta), args.draft_k
    texts = {"free, greedy": ("ROMEO:", 0.0), "free, t=0.8": ("ROMEO:", 0.8),  # a plain prompt, and a quote begun again
             "quote, greedy": (PASSAGE + "\n" + PASSAGE[:20], 0.0)}
    counts = {}
    for name, (prompt, temperature) in texts.items():
        counts[name] = made, ones, checks, accepted, proposed = lookup_counts(model, tokenizer, prompt, temperature,
                                                                             k, args.new_tokens)
        print(f"  {args.model}, {name}: {made} tokens in {ones} one-token steps and {checks} checks of {k}, "
              f"{accepted}/{proposed} proposed tokens kept, {made / (ones + checks):.2f} tokens a step")

    costs = {mode: step_costs(args.target, mode, k) for mode in args.modes.split(",")}
    fastest = min(one for one, _ in costs.values())
    print(f"  {args.target}: ms of a one-token step / a {k + 1}-token check, and ms per token with lookup "
          f"(vs the fastest plain mode's {fastest * 1e3:.2f} ms a token)")
    for mode, (one, check) in costs.items():
        line = f"    {mode:9s} {one * 1e3:5.2f} / {check * 1e3:5.2f} ms;"
        for name, (made, ones, checks, _, _) in counts.items():
            per_token = (ones * one + checks * check) / made
            line += f"  {name}: {per_token * 1e3:.2f} ({fastest / per_token:.2f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
