"""What each decoding mode costs in quality, on trained models: bits per byte of the val split, and greedy agreement.

    python bench/bench_quality.py                                   # out-small and out-shakespeare-bpe
    python bench/bench_quality.py --out_dirs=out-gpt2-124m --max_tokens=100000

Modes: float32 (the reference), bfloat16, float16 (sample.py --dtype=...), int8 and w8a8 (--quantize=...).
- bits per byte: eval.py's figure (sliding window) on the first --max_tokens tokens of the val split.
- greedy agreement: float32 decodes --new_tokens tokens greedily from the start of the val text (engine.decode_batch,
  as sample.py --temperature=0 does); then each mode reads that text teacher-forced and at each position predicts
  its most likely next token: the share equal to float32's prediction at the same position. (Two free-running
  greedy texts would be compared instead only until their first difference, after which they diverge for good.)
"""

import argparse
import os
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: make the repo's modules importable
import torch

from bench_sample import MODES, in_mode, machine, settings_for
from eval import bits_per_byte, val_tokens
from gpt.checkpoint import load_model
from gpt.engine import decode_batch
from gpt.cpuinfo import cpu_name
from gpt.scoring import token_predictions
from gpt.tokenizer import Tokenizer

PROMPT_TOKENS = 32


class TokenRecorder:
    """What decode_batch needs of engine.Samples, keeping the tokens: it never ends a sample."""

    def __init__(self, vocab_size):
        self.tokenizer, self.tokens = SimpleNamespace(vocab_size=vocab_size), []

    def add(self, sample, token):
        self.tokens.append(token)
        return False


def greedy_continuation(model, prompt, n_new, vocab_size):
    """prompt + n_new tokens of float32 greedy decoding, through the engine (the window slides past block_size)."""
    recorder = TokenRecorder(vocab_size)
    settings = settings_for(1, n_new)  # greedy, as sample.py --temperature=0
    decode_batch(model, prompt, settings, recorder, torch.Generator().manual_seed(0))
    return prompt + recorder.tokens


def bench_checkpoint(out_dir, args):
    model, meta, dataset = load_model(out_dir)
    tokenizer = Tokenizer(meta)
    tokens = val_tokens(dataset, args.max_tokens)
    text = greedy_continuation(model, tokens[:PROMPT_TOKENS], args.new_tokens, tokenizer.vocab_size)
    print(f"\n== {out_dir} on {cpu_name()}: {model.num_params() / 1e6:.2f}M parameters, {meta['tokenizer']} tokenizer, "
          f"data/{dataset} val split, {len(tokens):,} tokens")
    print(f"{'mode':<9} {'loss':>8} {'bits/byte':>10} {'vs float32':>11} {'greedy agreement':>17} {'seconds':>8}")
    reference = None
    for mode in args.modes:
        start = time.perf_counter()
        mode_model = in_mode(model, mode)
        figures = bits_per_byte(mode_model, tokens, tokenizer.byte_lengths(), batch_size=args.batch_size)
        top1 = token_predictions(mode_model, text)[1][PROMPT_TOKENS - 1:]  # predictions of the continuation
        if reference is None:
            reference = dict(figures, top1=top1)
            if mode != "float32":
                print(f"(the reference is {mode}: put float32 first)")
        change = figures["bits_per_byte"] / reference["bits_per_byte"] - 1
        agreement = (top1 == reference["top1"]).float().mean().item()
        print(f"{mode:<9} {figures['loss']:>8.4f} {figures['bits_per_byte']:>10.4f} {change:>+10.2%} "
              f"{agreement:>16.1%} {time.perf_counter() - start:>8.1f}")
    # float32's own predictions along its greedy text: where the scoring windows give it the context it decoded
    # with, it predicts its own tokens; the rest differ only by the window's place
    own = (reference["top1"] == torch.tensor(text[PROMPT_TOKENS:])).float().mean().item()
    print(f"(float32 teacher-forced predicts {own:.1%} of its own {args.new_tokens} greedy tokens)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dirs", default="out-small,out-shakespeare-bpe", help="comma-separated run folders")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, float32 first: {', '.join(MODES)}")
    parser.add_argument("--max_tokens", type=int, default=1_000_000, help="val tokens scored for bits per byte")
    parser.add_argument("--new_tokens", type=int, default=500, help="greedy tokens for the agreement")
    parser.add_argument("--batch_size", type=int, default=8)
    args = parser.parse_args()
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - set(MODES):
        sys.exit(f"error: --modes takes {', '.join(MODES)}, got {','.join(args.modes)!r}")
    print(machine())
    for out_dir in [d.strip() for d in args.out_dirs.split(",") if d.strip()]:
        if not os.path.exists(os.path.join(out_dir, "ckpt.pt")):
            print(f"\n== {out_dir}: no ckpt.pt, skipped (train it: python train.py config/small.py, or "
                  "config/shakespeare_bpe.py)")
            continue
        bench_checkpoint(out_dir, args)


if __name__ == "__main__":
    main()
