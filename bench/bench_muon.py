"""Muon's Newton-Schulz for one optimizer step at the GPT-2 124M shape: matrix by matrix (gpt/muon.py's way on a CPU),
against batched over the matrices of one shape (its way on CUDA), on this machine's accelerator or its CPU. A step of
the 124M shape orthogonalizes 84 matrices of 4 shapes.

    python bench/bench_muon.py [--device=cuda] [--rounds=5]

Prints ms a step each way (best of --rounds, alternating) and the largest difference between their results.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpt.muon import orthogonalize, orthogonalize_dtype  # noqa: E402

COEFFICIENTS, STEPS, EPS = (3.4445, -4.7750, 2.0315), 5, 1e-7  # torch.optim.Muon's defaults
# the 124M shape's block matrices, (out, in) x how many: q and o, k and v (4 kv heads), gate and up, down
SHAPES_124M = {(768, 768): 24, (256, 768): 24, (2048, 768): 24, (768, 2048): 12}


def timed(run, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start), out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, orthogonalize_dtype(device))
    torch.manual_seed(0)
    updates = {shape: torch.randn(n, *shape, device=device) for shape, n in SHAPES_124M.items()}
    one_by_one = lambda: {s: torch.stack([orthogonalize(m, COEFFICIENTS, STEPS, EPS, dtype) for m in u])  # noqa: E731
                          for s, u in updates.items()}
    batched = lambda: {s: orthogonalize(u, COEFFICIENTS, STEPS, EPS, dtype) for s, u in updates.items()}  # noqa: E731
    times, results = {"matrix by matrix": [], "batched by shape": []}, {}
    for _ in range(args.rounds + 1):  # the first round warms up
        for name, run in zip(times, (one_by_one, batched)):
            ms, results[name] = timed(run, device)
            times[name].append(ms)
    difference = max((results["matrix by matrix"][s].float() - results["batched by shape"][s].float()).abs().max()
                     .item() for s in SHAPES_124M)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, {dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads: one Muon step's "
          f"Newton-Schulz at the 124M shape ({sum(SHAPES_124M.values())} matrices)")
    for label, ms in times.items():
        print(f"  {label}: {min(ms[1:]):.1f} ms (best of {args.rounds}; all: {', '.join(f'{t:.1f}' for t in ms[1:])})")
    print(f"  largest difference between the two: {difference:.2e}")


if __name__ == "__main__":
    main()
