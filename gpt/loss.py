"""The chunked loss (train.py's loss_chunk, model.GPT.chunked_loss): the mean cross-entropy of a model's logits without
its B x T x vocab logits, the step's largest tensors (13 GB in fp32 at GPT-2's vocabulary and 64 x 1024 tokens), ever
existing at once: chunk x vocab at a time."""

import torch
import torch.nn.functional as F


def chunked_cross_entropy(logits, hidden, targets, chunk, params):
    """The mean cross-entropy of logits(hidden) (N, C) -> (N, V) against targets (N,; -1 ignored), chunk rows at a
    time. Training (params: those logits reads, among them), each chunk's gradients are taken as it is computed
    (ChunkedLoss): the head runs once, as without chunks."""
    if chunk < 1:  # range() would take no chunk: a loss of 0, and gradients never written
        raise ValueError(f"loss_chunk must be at least 1 (0: no chunks), got {chunk}")
    if not (torch.is_grad_enabled() and hidden.requires_grad):  # evaluation: the losses alone
        return sum(F.cross_entropy(logits(hidden[i:i + chunk]).float(), targets[i:i + chunk], ignore_index=-1,
                                   reduction="sum") for i in range(0, len(targets), chunk)) / (targets != -1).sum()
    return ChunkedLoss.apply(hidden, targets, chunk, logits, *params)


class ChunkedLoss(torch.autograd.Function):
    """Each chunk's loss differentiated at once (through logits, whatever it computes) with respect to its hidden rows
    and to every parameter it reads; the backward only scales those gradients. So the head runs once per chunk, where
    recomputing it in the backward (checkpointing each chunk) would run it twice; what waits for the backward is the
    hidden states' gradient (N, C) and the parameters' (the head's V x C)."""

    @staticmethod
    def forward(ctx, hidden, targets, chunk, logits, *params):
        grad_hidden, grads, total = torch.empty_like(hidden), [None] * len(params), 0.0
        with torch.enable_grad():
            for i in range(0, len(targets), chunk):
                rows = hidden[i:i + chunk].detach().requires_grad_()
                loss_sum = F.cross_entropy(logits(rows).float(), targets[i:i + chunk], ignore_index=-1, reduction="sum")
                grad_rows, *chunk_grads = torch.autograd.grad(loss_sum, [rows, *params], allow_unused=True)
                grad_hidden[i:i + chunk] = grad_rows
                grads = [summed if g is None else g if summed is None else summed + g  # None: not read (yet)
                         for summed, g in zip(grads, chunk_grads)]
                total = total + loss_sum.detach()
        n = (targets != -1).sum()
        ctx.grads, ctx.n = [grad_hidden, *grads], n  # made here, not inputs: kept as attributes
        return total / n

    @staticmethod
    def backward(ctx, grad_loss):
        scale = grad_loss / ctx.n  # d(total / n) = d(total) / n
        grad_hidden, *grads = [None if g is None else g * scale.to(g.dtype) for g in ctx.grads]
        return grad_hidden, None, None, None, *grads
