"""Where a CUDA-graph decode step's GPU time goes, at the GPT-2 124M shape in bf16 on one GPU (random weights).

    python bench/gpu_decode_kernels.py [--cache=320,1024] [--steps=200]

For each static cache length: the eager static step's ms, the same step replayed as a CUDA graph (sample.py's default
on CUDA) as SDPA chooses, with each of its kernels forced, and with q, k, v and gate, up each one product (a
bench-only patch: what fusing them would save), and torch.profiler's kernel table of one eager step (kernels a step,
the costliest). bench/RESULTS.md has its runs.
"""

import argparse
import contextlib
import copy
import os
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpt import engine, static_step  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

GPT2_124M = dict(n_layer=12, n_head=12, n_kv_head=4, n_embd=768, block_size=1024, vocab_size=50304)


def ms_per_step(run, steps):  # after 5 warm-up calls, synchronized
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        run()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t) / steps


class FusedProduct(torch.nn.Module):
    """Stands in for the first of several linear layers that read the same input (q_proj of q, k and v; gate_proj of
    gate and up): one product with their weights stacked, its other outputs kept for the next calls, in order (the
    order model.py calls them in). Bench-only: what fusing the products would save, measured before model.py
    changes its modules (issue 60)."""

    def __init__(self, layers):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.cat([layer.weight for layer in layers]), requires_grad=False)
        self.widths, self.kept = [layer.weight.size(0) for layer in layers], []

    def forward(self, x):
        first, *self.kept = torch.nn.functional.linear(x, self.weight).split(self.widths, dim=-1)
        return first


class KeptOutput(torch.nn.Module):  # a later layer of a FusedProduct: its output, already computed
    def __init__(self, fused, index):
        super().__init__()
        self.fused, self.index = [fused], index  # a list: not a submodule

    def forward(self, x):
        return self.fused[0].kept[self.index]


def fuse_products(model):
    """model with each layer's q, k and v products made one, and gate and up one (no biases); the same logits."""
    for block in model.layers:
        for owner, names in ((block.self_attn, ("q_proj", "k_proj", "v_proj")), (block.mlp, ("gate_proj", "up_proj"))):
            fused = FusedProduct([getattr(owner, name) for name in names])
            setattr(owner, names[0], fused)
            for index, name in enumerate(names[1:]):
                setattr(owner, name, KeptOutput(fused, index))
    return model


def graphed(model, cache_len, variant, steps):
    """(eager ms a step or None, graphed ms a step) of the static decode step at cache_len, SDPA's kernel as variant
    says (its last word), captured as sample.py's default captures it."""
    prompt = torch.randint(0, 50304, (1, 8), device="cuda")
    cache, tokens = engine.prefill(model, prompt, cache_len, static=True)
    step_tokens, input_pos = tokens.clone(), torch.tensor([cache.pos], device="cuda")
    run = lambda: static_step.decode_step(model, step_tokens, cache, input_pos)  # noqa: E731
    context = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "math": SDPBackend.MATH}.get(variant.split()[-1])
    with sdpa_kernel(context) if context else contextlib.nullcontext():
        with torch.inference_mode():
            eager = ms_per_step(run, 20) if variant in ("as-is", "products fused") else None
            graph, _ = static_step.capture(run)
    return eager, ms_per_step(graph.replay, steps)


def kernel_table(model, cache_len):
    """The eager static step's GPU kernels per step and GPU time, and the costliest, from torch.profiler."""
    prompt = torch.randint(0, 50304, (1, 8), device="cuda")
    with torch.inference_mode():
        cache, tokens = engine.prefill(model, prompt, cache_len, static=True)
        input_pos = torch.tensor([cache.pos], device="cuda")
        for _ in range(3):
            static_step.decode_step(model, tokens, cache, input_pos)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                static_step.decode_step(model, tokens, cache, input_pos)
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = sum(e.count for e in events) / 10
    total = sum(e.device_time_total for e in events) / 10
    print(f"  eager step, cache {cache_len}: {kernels:.0f} GPU kernels/copies a step, {total:.0f} us of GPU time")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:18]:
        print(f"    {e.device_time_total / 10:8.1f} us  {e.count / 10:5.1f}x  {e.key[:110]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", default="320,1024")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_decode_kernels.py: no CUDA GPU here; it times CUDA graphs of the decode step, run it on one")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT2_124M)).to("cuda", torch.bfloat16).eval()
    fused = fuse_products(copy.deepcopy(model))
    with torch.inference_mode():  # the same logits, fused or not
        idx = torch.randint(0, 50304, (1, 16), device="cuda")
        print(f"products fused: logits differ by {(fused(idx)[0] - model(idx)[0]).abs().max().item():.2e} at most")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for cache_len in map(int, args.cache.split(",")):
        for variant in ("as-is", "SDPA's efficient", "SDPA's cudnn", "SDPA's math", "products fused"):
            try:
                eager, graph = graphed(fused if variant == "products fused" else model, cache_len, variant, args.steps)
                print(f"cache {cache_len}, {variant}: graph {graph:.3f} ms/step ({1000 / graph:.0f} tokens/s)"
                      + (f", eager {eager:.3f} ms/step" if eager else ""), flush=True)
            except Exception as e:  # noqa: BLE001 (a variant a card cannot run: say so, go on)
                print(f"cache {cache_len}, {variant}: failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
        kernel_table(model, cache_len)


if __name__ == "__main__":
    main()
