"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus), and drawing it. For model.py's
generate, gpt/engine.py and gpt/speculative.py; apart from the model: it is about the logits, not how they are made."""

import torch
import torch.nn.functional as F


def check_sampling(temperature, top_k, top_p):
    """ValueError naming the setting unless temperature >= 0, top_k >= 1 (an integer) and 0 < top_p <= 1."""
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def greedy(logits):  # temperature 0: the most likely token of each row of logits (B, V), as (B, 1)
    best, ids = logits.max(dim=-1, keepdim=True)  # best: NaN where the row holds one (argmax would pick its token)
    return ids.masked_fill(~best.isfinite(), logits.size(-1))  # V for a row of NaN or inf: no token, as from draw


def sampling_probs(logits, temperature=1.0, top_k=None, top_p=None):
    """Next-token probabilities (B, V) from logits (B, V) / temperature (0: all on the greedy token), restricted to the
    top_k most likely tokens and to the smallest set reaching top_p (settings checked: sample_next_token, sample.py)."""
    if temperature == 0:  # greedy's V (a row of NaN or inf) goes past the end: a row of zeros, from which draw gives V
        one_hot = logits.new_zeros(logits.size(0), logits.size(-1) + 1, dtype=torch.float32)
        return one_hot.scatter_(-1, greedy(logits), 1.0)[:, :-1]
    logits = logits.float() / temperature
    if top_k is not None:
        kth_largest = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        # The most likely tokens, sorted, until they reach top_p: on a CPU the top 256 first, then 16x more while short
        # (sorting GPT-2's 50k takes ~5 ms there, the top 256 ~0.3); the check would sync a GPU, which sorts all at once
        k = min(256, probs.size(-1)) if probs.device.type == "cpu" else probs.size(-1)
        sorted_probs, order = probs.topk(k, dim=-1)  # (B, k), descending
        while k < probs.size(-1) and (sorted_probs.cumsum(dim=-1)[:, -1] < top_p).any():
            k = min(16 * k, probs.size(-1))
            sorted_probs, order = probs.topk(k, dim=-1)
        # Drop a token when the tokens more likely than it already reach top_p (the first always stays; past k, all go).
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        drop = torch.ones_like(probs, dtype=torch.bool).scatter_(-1, order, drop_sorted)  # back to vocabulary order
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_next_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token id per row of logits (B, V), as (B, 1), drawn from sampling_probs (or greedy)."""
    check_sampling(temperature, top_k, top_p)
    return greedy(logits) if temperature == 0 else draw(sampling_probs(logits, temperature, top_k, top_p), generator)


def draw(probs, generator=None):
    """One token id per row of probs (..., V), as (..., 1): where a uniform draw falls in the row's cumulative sum (V
    for a row of NaN or inf). torch.multinomial draws a number per token (~1.4 ms a GPT-2 row on a CPU) and on CUDA
    waits to check its input (pytorch#108968). In float64 a rare token keeps its share of 50k (MPS has no float64)."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float32 if probs.device.type == "mps" else torch.float64)  # (..., V)
    cdf = cdf / cdf[..., -1:]  # ends at exactly 1.0, above every draw from [0, 1)
    u = torch.rand(*probs.shape[:-1], 1, dtype=cdf.dtype, device=probs.device, generator=generator)
    return torch.searchsorted(cdf, u, right=True)  # never a token of probability 0; V: no token (engine.Samples stops)
