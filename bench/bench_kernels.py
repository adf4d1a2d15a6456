"""Every decode kernel candidate of kernels.py on the linear layers of a GPT-2-small step, eager and compiled.

    python bench/bench_kernels.py                       # float32, 1 and 8 rows
    python bench/bench_kernels.py --dtype int8 int8/bfloat16 bfloat16   # weights/rows: int8 weights, bf16 rows
    python bench/bench_kernels.py --dtype int8/int8 --rows 1 5 8        # int8 rows: --quantize=w8a8's products

A GPT-2-small-shaped step (12 x 768, 4 kv heads, SwiGLU, vocab 50304) multiplies 85 weights by one row per sample:
each candidate runs all of them once (each weight its own tensor, so they are read from memory as a step reads
them), best of 5 after a first call; ms for the 85 products. int8 weights are multiplied by float32 rows unless
another dtype is named after a slash (quantize.py's weight-only layers compute in the model's dtype; int8 rows are
w8a8's, quantized before the product). What kernels.py measures on a model, here for the record (bench/RESULTS.md).
"""

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: make the repo's modules importable
from gpt import kernels
from gpt.cpuinfo import cpu_name

# (out, in) of one block's products: q, k, v, o, gate, up, down; then the output head
BLOCK = [(768, 768), (256, 768), (256, 768), (768, 768), (2048, 768), (2048, 768), (768, 2048)]
SHAPES = BLOCK * 12 + [(50304, 768)]


def products(kernel, weights, inputs):
    """Every weight times its input rows; returned, or compiled there would be nothing to compute."""
    return [kernel(x, weight, None) for weight, x in zip(weights, inputs)]


def best_ms(run, repeats=5):
    run()  # compiles, or builds the library's plan for these shapes
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["float32"], help="float32, bfloat16, float16, int8[/rows' dtype]")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    args = parser.parse_args()
    cpu = cpu_name()
    print(f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}; ms for the 85 products of a step")
    torch.manual_seed(0)
    for name in args.dtype:
        dtype, _, rows_dtype = name.partition("/")
        dtype = getattr(torch, dtype)
        weights = [(torch.randn(o, i) * (40 if dtype == torch.int8 else 1)).to(dtype) for o, i in SHAPES]
        activation = getattr(torch, rows_dtype) if rows_dtype else torch.float32 if dtype == torch.int8 else dtype
        for rows in args.rows:
            inputs = [torch.randint(-127, 128, (rows, w.size(1)), dtype=torch.int8) if activation == torch.int8
                      else torch.randn(rows, w.size(1), dtype=activation) for w in weights]
            figures = []
            for kernel_name, kernel in kernels.KERNELS.items():
                for compiled in (False, True):
                    if kernel_name in kernels.COMPILED_ONLY and not compiled:
                        continue
                    run_all = torch.compile(products, dynamic=False, isolate_recompiles=True) if compiled else products
                    try:
                        with torch.inference_mode():
                            ms = best_ms(lambda: run_all(kernel, weights, inputs))
                    except RuntimeError as e:  # a kernel this build or CPU lacks for this dtype
                        figures.append(f"{kernel_name}{' compiled' if compiled else ''} n/a ({str(e)[:40]})")
                        continue
                    figures.append(f"{kernel_name}{' compiled' if compiled else ''} {ms:.1f}")
            kernels.packed_weights.clear()
            print(f"  {name:8s} {rows} row{'s' if rows > 1 else ' '}: " + ", ".join(figures), flush=True)


if __name__ == "__main__":
    main()
