"""
Where does a transformer learn word order? Not from attention itself: without position information and
without the causal mask, self-attention is permutation-equivariant. Shuffle the input tokens and every layer
(attention, MLP, norms) computes the same vectors, shuffled the same way, so model(idx[perm]) == model(idx)[perm].
RoPE breaks this (q and k are turned by their position, so scores depend on where tokens are), and so does the
causal mask (which keys a query may see depends on where it is). This script measures it on a trained model
and on a random-init model of the same shape, for all four settings:

    max |model(idx[:, perm]) - model(idx)[:, perm]|   for {RoPE on, off} x {causal mask on, off}

Only "RoPE off, mask off" is ~0 (float rounding, 1e-6 to 1e-5); the other three are as large as the outputs.

    python experiments/position.py                                   # out-small: a few seconds on 2 CPU cores
    python experiments/position.py --out_dir=out-shakespeare-bpe --batch_size=2

How the model is changed: model.py is not edited. While a setting is measured, `positions_and_mask` patches
model.py's module-level functions with unittest.mock.patch, which restores them on exit; CausalSelfAttention
looks both up at call time:
- RoPE off: model.rope becomes the identity, so q and k carry no position;
- mask off: model.attention becomes softmax(q k^T / sqrt(hd)) v over every key (SDPA with no mask).
The input is val text (the last 10% of Tiny Shakespeare, the part the model did not train on) in the model's
own tokenizer.
"""

import argparse
import contextlib
import inspect
import os
import sys
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: make the repo's modules importable
import torch
import torch.nn.functional as F

from data.shakespeare.prepare import split_text
from gpt import UserError
from gpt.checkpoint import load_model
from gpt.cpuinfo import cpu_name
from gpt.tokenizer import Tokenizer
import model as model_py
from model import GPT

SETTINGS = [(True, True), (True, False), (False, True), (False, False)]  # (RoPE, causal mask)
ATTENTION_SIGNATURE = inspect.signature(model_py.attention)  # read before any patch stands in for it


def no_rope(x, positions):  # stands in for model.rope: q and k (B, T, h, hd) unchanged, whatever their position
    return x


def unmasked_attention(*args, **kwargs):
    """Stands in for model.attention: every query reads every key (no causal mask, no window); q (B, nh, T, hd),
    k and v (B, n_kv, T, hd) -> (B, nh, T, hd). It takes whatever model.attention takes (its arguments found by
    name in its own signature), so an edit of that signature in model.py needs no edit here."""
    given = ATTENTION_SIGNATURE.bind(*args, **kwargs).arguments
    q, k, v = given["q"], given["k"], given["v"]
    return F.scaled_dot_product_attention(q, k, v, dropout_p=given.get("dropout_p", 0.0),
                                          enable_gqa=q.size(1) != k.size(1))


@contextlib.contextmanager
def positions_and_mask(rope=True, mask=True):
    """Run the model with RoPE and the causal mask each on (the model as it is) or off (patched out)."""
    with contextlib.ExitStack() as stack:
        if not rope:
            stack.enter_context(mock.patch("model.rope", no_rope))
        if not mask:
            stack.enter_context(mock.patch("model.attention", unmasked_attention))
        yield


@torch.no_grad()
def equivariance_error(model, idx, perm, rope=True, mask=True):
    """max |model(idx[:, perm]) - model(idx)[:, perm]| over the logits (B, T, V) and over the final hidden
    states (B, T, C): 0 up to rounding exactly when the model is permutation-equivariant."""
    with positions_and_mask(rope, mask):
        hidden, hidden_of_permuted = model.hidden_states(idx), model.hidden_states(idx[:, perm])  # (B, T, C)
    logits, logits_of_permuted = model.logits(hidden), model.logits(hidden_of_permuted)  # (B, T, V)
    return dict(hidden=(hidden_of_permuted - hidden[:, perm]).abs().max().item(),
                logits=(logits_of_permuted - logits[:, perm]).abs().max().item())


def val_batch(tokenizer, text_path, batch_size, block_size):
    """idx (batch_size, block_size): consecutive windows of the val part of the text, in the model's tokens."""
    with open(text_path, encoding="utf-8") as f:
        val = split_text(f.read())[1]
    tokens = torch.tensor(tokenizer.encode(val))
    if len(tokens) < batch_size * block_size:
        sys.exit(f"error: {text_path}'s val part is {len(tokens)} tokens, fewer than batch_size x T = "
                 f"{batch_size * block_size}; give a longer --text or a smaller --batch_size")
    return tokens[:batch_size * block_size].view(batch_size, block_size)


def model_and_val_batch(out_dir, text, batch_size):
    """(the trained model of out_dir, idx: val_batch of text in its tokens); a bad folder or text ends the run
    with a one-line error."""
    try:
        model, meta, _ = load_model(out_dir)
    except UserError as e:
        sys.exit(f"error: {e}")
    if not os.path.isfile(text):
        sys.exit(f"error: --text {text}: no such file")
    try:
        return model, val_batch(Tokenizer(meta), text, batch_size, model.config.block_size)
    except UserError as e:
        sys.exit(f"error: --text {text} does not suit {out_dir}'s tokenizer: {e}")


def print_table(models, idx, perm):
    print(f"max |model(idx[:, perm]) - model(idx)[:, perm]|, idx {tuple(idx.shape)} of val text, one random perm")
    print(f"{'model':<12} {'RoPE':>4} {'causal mask':>11} {'hidden states':>13} {'logits':>10} {'max |logit|':>11}")
    for name, model in models.items():
        with torch.no_grad():
            scale = model(idx)[0].abs().max().item()  # what a difference of "as large as the output" means
        for rope, mask in SETTINGS:
            error = equivariance_error(model, idx, perm, rope, mask)
            print(f"{name:<12} {'on' if rope else 'off':>4} {'on' if mask else 'off':>11} {error['hidden']:13.2e} "
                  f"{error['logits']:10.2e} {scale:11.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default="out-small", help="the trained model's folder (holding ckpt.pt)")
    parser.add_argument("--text", default=os.path.join(ROOT, "data", "shakespeare", "input.txt"),
                        help="the text whose val part (last 10%%) is the input")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.batch_size < 1:  # else a RuntimeError of an empty batch
        parser.error("--batch_size must be at least 1")

    trained, idx = model_and_val_batch(args.out_dir, args.text, args.batch_size)
    torch.manual_seed(args.seed)
    random_init = GPT(trained.config).eval()  # same shape, GPT-2 init: equivariance is architecture, not training
    perm = torch.randperm(idx.size(1))  # one shuffle of the T positions, the same for every row

    print(f"cpu: {cpu_name()}, torch {torch.__version__}")
    print(f"{args.out_dir}: {trained.config}")
    print_table({"trained": trained, "random init": random_init}, idx, perm)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: no traceback, and the shell's status for it
        sys.exit(130)
