"""
Why attention divides the scores by sqrt(head_dim). If the entries of q and k are independent with mean 0 and
variance 1, the score q.k is a sum of head_dim such products, so its variance is head_dim: without the factor
the scores' spread grows like sqrt(head_dim), the softmax saturates (each row puts nearly all its weight on one
key, its entropy collapses toward 0) and its gradients vanish. Divided by sqrt(head_dim), the scores have std ~1
whatever the head width. This script measures both ways:

(a) random q and k with unit-variance entries, head_dim 16, 64, 256 and the trained model's own: the std of
    the scores and the mean entropy of the causal softmax rows (T keys; uniform rows give the maximum);
(b) the trained model's own q and k (after QK-norm and RoPE, exactly as it attends) on val text, per layer.

    python experiments/scaling.py                                    # out-small: a few seconds on 2 CPU cores
    python experiments/scaling.py --out_dir=out-shakespeare-bpe

The model is not changed: a forward pre-hook on each attention module recomputes its q and k from the module's
input with CausalSelfAttention.queries_and_keys, as attention.py does, and the scores are formed here. Scores
and entropies are over the causal part only (key position <= query position), what the model attends over;
out-small has QK-norm, so its q and k are RMS-normalized per head times a learned gain.
"""

import argparse
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: make the repo's modules importable
import torch

from experiments.position import model_and_val_batch  # the same input text, the same machine line
from gpt.cpuinfo import cpu_name
from model import CausalSelfAttention

HEAD_DIMS = [16, 64, 256]  # and the trained model's own


def random_queries_and_keys(n, T, head_dim, generator=None):
    """q, k (n, T, head_dim) with independent N(0, 1) entries: n score matrices of T queries and T keys."""
    return torch.randn(2, n, T, head_dim, generator=generator).unbind(0)


def scores(q, k, scaled):
    """q k^T (..., T, T), divided by sqrt(head_dim) if scaled; q (..., T, hd), k (..., T, hd)."""
    s = q.float() @ k.float().transpose(-2, -1)
    return s / math.sqrt(q.size(-1)) if scaled else s


def causal(T):  # (T, T): True where query t may see key s, s <= t
    return torch.ones(T, T, dtype=torch.bool).tril()


def causal_std(s):
    """The std of the scores s (..., T, T) a causal query sees: the visible entries only."""
    return s[..., causal(s.size(-1))].std().item()


def causal_entropy(s):
    """Mean entropy (nats) of the causal softmax rows of s (..., T, T): 0 is all weight on one key,
    uniform_entropy(T) is weight spread evenly over every visible key."""
    visible = causal(s.size(-1))
    log_p = s.masked_fill(~visible, float("-inf")).log_softmax(dim=-1)  # (..., T, T), -inf where masked
    p = log_p.exp()  # exactly 0 where masked
    return -(p * log_p.masked_fill(~visible, 0.0)).sum(-1).mean().item()  # 0 * -inf would be nan: zero it first


def uniform_entropy(T):  # the largest mean row entropy: row t spread evenly over its t + 1 keys
    return torch.log(torch.arange(1, T + 1, dtype=torch.float64)).mean().item()


def measure(q, k):
    """std of the scores and mean row entropy, without (raw) and with (scaled) the 1/sqrt(head_dim) factor."""
    raw, scaled = scores(q, k, scaled=False), scores(q, k, scaled=True)
    return dict(std_raw=causal_std(raw), std_scaled=causal_std(scaled),
                entropy_raw=causal_entropy(raw), entropy_scaled=causal_entropy(scaled))


@torch.no_grad()
def model_queries_and_keys(model, idx):
    """Each layer's q (B, nh, T, hd) and k (B, nh, T, hd) for idx (B, T), as the model attends with them (k
    repeated for the query heads that share it); caught by a hook on each attention module, as attention.py does."""
    captured, hooks = [], []

    def capture(module, args):
        x, positions = args[0], args[1]
        q, k = module.queries_and_keys(x, positions)  # (B, nh, T, hd), (B, n_kv, T, hd)
        k = k.repeat_interleave(module.n_head // module.n_kv_head, dim=1)  # query head h reads kv head h // group
        captured.append((q, k))

    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            hooks.append(module.register_forward_pre_hook(capture))
    try:
        model(idx)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


HEADER = f"{'std raw':>9} {'std scaled':>10} {'entropy raw':>11} {'entropy scaled':>14}"


def row(m):
    return f"{m['std_raw']:9.3f} {m['std_scaled']:10.3f} {m['entropy_raw']:11.3f} {m['entropy_scaled']:14.3f}"


def print_random_table(head_dims, model_head_dim, n, T, seed):
    print(f"(a) random q, k with N(0, 1) entries: {n} score matrices of {T} causal rows per head_dim; "
          f"raw = q.k, scaled = q.k / sqrt(head_dim); entropy in nats (uniform rows: {uniform_entropy(T):.3f})")
    print(f"{'head_dim':>13} {'sqrt(hd)':>8} {HEADER}")
    generator = torch.Generator().manual_seed(seed)
    for head_dim in sorted(set(head_dims) | {model_head_dim}):
        name = f"{head_dim} (model)" if head_dim == model_head_dim else str(head_dim)
        m = measure(*random_queries_and_keys(n, T, head_dim, generator))
        print(f"{name:>13} {math.sqrt(head_dim):8.2f} {row(m)}")


def print_model_table(model, idx, name):
    B, T = idx.shape
    print(f"(b) {name}'s own q and k (head_dim {model.config.head_dim}) on val text, idx ({B}, {T}), all heads "
          f"of a layer together; the model attends with the scaled scores (uniform rows: {uniform_entropy(T):.3f})")
    print(f"{'layer':>5} {HEADER}")
    for layer, (q, k) in enumerate(model_queries_and_keys(model, idx)):
        print(f"{layer:>5} {row(measure(q, k))}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default="out-small", help="the trained model's folder (holding ckpt.pt)")
    parser.add_argument("--text", default=os.path.join(ROOT, "data", "shakespeare", "input.txt"),
                        help="the text whose val part (last 10%%) is the input of (b)")
    parser.add_argument("--batch_size", type=int, default=4, help="val windows of block_size tokens for (b)")
    parser.add_argument("--n", type=int, default=64, help="random score matrices per head_dim for (a)")
    parser.add_argument("--T", type=int, default=128, help="queries and keys per random matrix for (a)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.batch_size, args.n, args.T) < 1:  # else a table of nan, or an empty batch's RuntimeError
        parser.error("--batch_size, --n and --T must be at least 1")

    model, idx = model_and_val_batch(args.out_dir, args.text, args.batch_size)

    print(f"cpu: {cpu_name()}, torch {torch.__version__}")
    print_random_table(HEAD_DIMS, model.config.head_dim, args.n, args.T, args.seed)
    print()
    print_model_table(model, idx, args.out_dir)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: no traceback, and the shell's status for it
        sys.exit(130)
