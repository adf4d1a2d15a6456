"""
Scoring: the log-probabilities a model gives to given tokens, for eval.py and harness.py.

- token_predictions / token_logprobs: every token of a long text, in sliding windows of block_size.
- continuation_logprobs: several continuations of one context, the context run once into a KV cache.
- sequence_logprobs: (context, continuation) pairs of different contexts, as one padded batch.
"""

import torch
import torch.nn.functional as F

from gpt.engine import device_of, prefill, select_rows


def target_logprobs(model, hidden, targets):
    """log p(target) (N,) float32 for hidden states (N, C) and their next tokens targets (N,), and the most likely
    next tokens (N,): the output head runs on these positions only, where most of a long window's memory would go."""
    logits = model.logits(hidden).float()
    return -F.cross_entropy(logits, targets, reduction="none"), logits.argmax(-1)


def token_logprobs(model, tokens, stride=None, batch_size=8):
    """log p(tokens[i] | the tokens before it) for i = 1 .. N-1, as (N-1,) float32: see token_predictions."""
    return token_predictions(model, tokens, stride, batch_size)[0]


@torch.inference_mode()
def token_predictions(model, tokens, stride=None, batch_size=8):
    """log p(tokens[i] | the tokens before it) for i = 1 .. N-1, as (N-1,) float32, and the model's most likely
    token there (N-1,), with a sliding window: windows of block_size + 1 tokens start every `stride` tokens
    (default block_size // 2), and each scores only the tokens earlier windows did not, so every token past the
    first block is predicted from at least block_size - stride tokens of context. batch_size windows at a time."""
    block_size, device = model.config.block_size, device_of(model)
    stride = stride or max(1, block_size // 2)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    n_targets = len(tokens) - 1
    # window w: inputs tokens[start : start + block_size], scoring the targets from index `first` on
    starts = list(range(0, max(1, n_targets - block_size + stride), stride))
    starts[-1] = max(0, n_targets - block_size)  # the last window ends at the last token, with a full context
    windows, scored_until = [], 0
    for start in starts:
        end = min(start + block_size, n_targets)
        windows.append((start, end, scored_until))  # scores targets scored_until .. end - 1
        scored_until = end
    logprobs, top1 = [], []
    for i in range(0, len(windows), batch_size):
        batch = windows[i:i + batch_size]
        inputs = torch.stack([tokens[start:end] for start, end, _ in batch]).to(device)  # (B, T): equal lengths
        hidden = model.hidden_states(inputs)  # (B, T, C)
        keep = torch.cat([hidden[b, first - start:] for b, (start, _, first) in enumerate(batch)])  # (kept, C)
        targets = torch.cat([tokens[first + 1:end + 1] for start, end, first in batch]).to(device)
        window_logprobs, window_top1 = target_logprobs(model, keep, targets)
        logprobs.append(window_logprobs)
        top1.append(window_top1)
    if not logprobs:
        return torch.zeros(0), torch.zeros(0, dtype=torch.long)
    return torch.cat(logprobs).cpu(), torch.cat(top1).cpu()


@torch.inference_mode()
def continuation_logprobs(model, context, continuations):
    """(log p(continuation | context), whether each of its tokens was the most likely one) for each of the
    continuations (token lists) of one context (a token list): the context runs once into a KV cache, then
    the continuations together as a chunk after that cached prefix. len(context) + the longest continuation
    must be at most block_size + 1 (the last token is scored, never fed)."""
    device, n, longest = device_of(model), len(continuations), max(map(len, continuations))
    cache, last = prefill(model, torch.tensor([context], device=device), len(context) - 1 + longest)
    select_rows(cache, [0] * n)
    inputs = torch.zeros(n, longest, dtype=torch.long, device=device)  # each row: the context's last token,
    targets = torch.full((n, longest), -1, dtype=torch.long, device=device)  # then the continuation, padded
    for row, continuation in enumerate(continuations):
        inputs[row, 0], inputs[row, 1:len(continuation)] = last[0, 0], torch.tensor(continuation[:-1])
        targets[row, :len(continuation)] = torch.tensor(continuation)
    return scores(model, model.hidden_states(inputs, cache), targets)  # hidden states (n, longest, C)


@torch.inference_mode()
def sequence_logprobs(model, pairs):
    """continuation_logprobs for (context, continuation) pairs of different contexts, each as one sequence of
    a padded batch; a sequence longer than block_size + 1 loses its first tokens."""
    device, block_size = device_of(model), model.config.block_size
    sequences = [(context + continuation)[-(block_size + 1):] for context, continuation in pairs]
    longest = max(map(len, sequences)) - 1
    inputs = torch.zeros(len(pairs), longest, dtype=torch.long, device=device)
    targets = torch.full((len(pairs), longest), -1, dtype=torch.long, device=device)
    for row, (sequence, (_, continuation)) in enumerate(zip(sequences, pairs)):
        inputs[row, :len(sequence) - 1] = torch.tensor(sequence[:-1])
        start = len(sequence) - 1 - len(continuation)  # the targets of the continuation's tokens
        targets[row, start:len(sequence) - 1] = torch.tensor(continuation)
    return scores(model, model.hidden_states(inputs), targets)  # hidden states (B, T, C)


def scores(model, hidden, targets):
    """(sum of log p(target), all targets the argmax) per row of hidden states (B, T, C) and targets (B, T; -1:
    none). The output head runs on the positions with a target only: most of a padded batch's are not."""
    mask = targets >= 0
    logits = model.logits(hidden[mask]).float()  # (K, V): the K positions with a target
    logprobs, greedy = torch.zeros(targets.shape, device=hidden.device), torch.ones_like(mask)
    logprobs[mask] = -F.cross_entropy(logits, targets[mask], reduction="none")
    greedy[mask] = logits.argmax(-1) == targets[mask]
    return list(zip(logprobs.sum(1).tolist(), greedy.all(1).tolist()))
