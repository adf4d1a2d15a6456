"""Muon for the matrices inside the blocks: torch.optim.Muon's step, with its Newton-Schulz orthogonalization in
float32 where this machine computes torch's bfloat16 much slower: a CPU without bfloat16 instructions (no AVX512-BF16
or AMX), where oneDNN emulates them, ran config/small.py 6x slower for it (bench/RESULTS.md). Chosen by timing both
once a run on the model's own shapes."""

import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.optim._muon import _adjust_lr  # the learning rate per matrix shape, as torch's Muon scales it

# float32 only where bfloat16 is clearly slower: near a tie, timing noise would pick either, and two runs of one
# command would differ in their last digits
SLOWER = 1.5


def orthogonalize(update, coefficients, steps, eps, dtype):
    """torch.optim.Muon's quintic Newton-Schulz iteration (torch/optim/_muon.py, which fixes it to bfloat16) in dtype:
    about the nearest semi-orthogonal matrix to update (its singular values brought near 1). (out, in) -> (out, in)."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T  # (short, long): the Gram matrix below is the smaller one
    x = x / x.norm().clamp(min=eps)  # the Frobenius norm bounds the spectral norm: singular values now at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b G + c G^2) x
    return x.T if tall else x


def seconds_per_step(shapes, dtype, group, device, clock):
    """How long one step's orthogonalization of matrices of these shapes takes in dtype: each distinct shape timed
    once and counted as often as it occurs, the fastest of 3 tries after one that warms the library's kernels up."""
    counts = Counter(shapes)
    matrices = {shape: torch.randn(shape, device=device) for shape in counts}
    tries = []
    for _ in range(4):
        total = 0.0
        for shape, count in counts.items():
            start = clock()
            result = orthogonalize(matrices[shape], group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
            result.sum().item()  # waits for an accelerator to finish
            total += count * (clock() - start)
        tries.append(total)
    return min(tries[1:])


def choose_dtype(group, clock=time.perf_counter):
    """"bfloat16", or "float32" where bfloat16 takes SLOWER times as long on this group's matrices (timed on one
    thread). Under torchrun, rank 0 times them alone (the others would share its cores meanwhile) and every process
    takes its choice, so that their copies of the model step alike."""
    choice = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        shapes = [tuple(param.shape) for param in group["params"]]  # whole matrices, also where FSDP shards them
        device, threads = group["params"][0].device, torch.get_num_threads()
        torch.set_num_threads(1)  # beside another process, spinning threads timed bfloat16 at 31 ms to 3.9 s a step:
        try:                      # one thread is slowed alike in both dtypes, so load does not flip the choice
            bf16, fp32 = (seconds_per_step(shapes, dtype, group, device, clock)
                          for dtype in (torch.bfloat16, torch.float32))
        finally:
            torch.set_num_threads(threads)
        choice = ["float32" if bf16 > SLOWER * fp32 else "bfloat16"]
        if choice == ["float32"]:
            print(f"muon: orthogonalizing in float32, which took {fp32 * 1e3:.0f} ms a step on one thread here "
                  f"against bfloat16's {bf16 * 1e3:.0f} ms")
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


class Muon(torch.optim.Muon):
    """torch.optim.Muon, orthogonalizing in the dtype choose_dtype picks. The choice is each param group's "ns_dtype"
    and is saved with the optimizer's state: a resumed run steps as the run it continues, and a checkpoint from before
    the choice existed resumes in torch's bfloat16."""

    def __init__(self, params, **settings):
        super().__init__(params, **settings)
        for group in self.param_groups:
            group["ns_dtype"] = choose_dtype(group)

    @torch.no_grad()
    def step(self, closure=None):
        """torch.optim.Muon's step (its _single_tensor_muon), with each update orthogonalized by self.orthogonalized."""
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)  # Muon's own: state["momentum_buffer"] as it keeps it
            for i, (param, grad, buffer) in enumerate(zip(params, grads, buffers)):
                buffer.lerp_(grad, 1 - group["momentum"])
                update = grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer
                update = self.orthogonalized(update, group, i)
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(update, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], param.shape))

    def orthogonalized(self, update, group, i):
        """The i-th matrix's update orthogonalized (gpt.parallel.ShardedMuon shares the work out instead)."""
        dtype = getattr(torch, group.get("ns_dtype", "bfloat16"))
        return orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
