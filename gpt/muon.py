"""Muon for the matrices inside the blocks: torch.optim.Muon's step, with its Newton-Schulz orthogonalization in
float32 on a CPU (torch's fixed bfloat16 ran up to 18x slower without AVX512-BF16: bench/RESULTS.md), else bfloat16."""

import torch
from torch.optim._muon import _adjust_lr  # the learning rate per matrix shape, as torch's Muon scales it


def orthogonalize(update, coefficients, steps, eps, dtype):
    """torch.optim.Muon's quintic Newton-Schulz iteration (torch/optim/_muon.py, which fixes it to bfloat16) in dtype:
    about the nearest semi-orthogonal matrix to update (its singular values brought near 1). (out, in) -> (out, in),
    or a stack of matrices of one shape, each on its own: (n, out, in) -> (n, out, in)."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT  # (short, long): the Gram matrix below is the smaller one
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # Frobenius bounds spectral: singular values <= 1
    addmm = torch.addmm if x.dim() == 2 else torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        x = addmm(x, addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b G + c G^2) x
    return x.mT if tall else x


def orthogonalize_dtype(device):
    """The dtype Muon orthogonalizes in on this device: "float32" on a CPU, torch's "bfloat16" elsewhere."""
    return "float32" if torch.device(device).type == "cpu" else "bfloat16"


class Muon(torch.optim.Muon):
    """torch.optim.Muon, orthogonalizing in each param group's "ns_dtype", saved with the optimizer's state: a resumed
    run steps as the run it continues, and a checkpoint from before the choice existed in torch's bfloat16."""

    def __init__(self, params, **settings):
        super().__init__(params, **settings)
        for group in self.param_groups:
            group["ns_dtype"] = orthogonalize_dtype(group["params"][0].device)

    @torch.no_grad()
    def step(self, closure=None):
        """torch.optim.Muon's step (its _single_tensor_muon), each update orthogonalized by self.orthogonalized."""
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)  # Muon's own: state["momentum_buffer"] as it keeps it
            updates = (momentum_update(grad, buffer, group) for grad, buffer in zip(grads, buffers))  # made lazily
            for param, update in zip(params, self.orthogonalized(updates, group)):
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(update, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], param.shape))

    def orthogonalized(self, updates, group):
        """The group's updates orthogonalized: on CUDA batched by shape (7.6x faster on an H200: bench/bench_muon.py),
        on a CPU one at a time in memory (no faster batched). gpt.parallel.ShardedMuon shares the work out instead."""
        if group["params"][0].device.type == "cuda":
            return orthogonalized_by_shape(list(updates), group)
        return (orthogonalize_in_group(update, group) for update in updates)


def momentum_update(grad, buffer, group):
    """torch.optim.Muon's momentum: the buffer moved toward grad, and the update to orthogonalize (Nesterov's, or the
    buffer itself)."""
    buffer.lerp_(grad, 1 - group["momentum"])
    return grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer


def orthogonalize_in_group(update, group):  # orthogonalize with a Muon param group's settings
    dtype = getattr(torch, group.get("ns_dtype", "bfloat16"))
    return orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)


def orthogonalized_by_shape(updates, group):
    """Each update orthogonalized, in their order, those of one shape as one stack (n, out, in): a few launches a shape,
    not a few a matrix."""
    results = [None] * len(updates)
    for shape in {update.shape for update in updates}:
        indices = [i for i, update in enumerate(updates) if update.shape == shape]
        for i, result in zip(indices, orthogonalize_in_group(torch.stack([updates[i] for i in indices]), group)):
            results[i] = result
    return results
