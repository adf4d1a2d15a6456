"""
How long export takes at GPT-2-124M's shape (12 layers, 768 wide, 50,304 ids, 1,024 positions; swiglu, untied: a
Llama), on this machine: export_hf on a model of random weights, whole (proof, files, transformers' outputs compared),
best of --repeats. Run it in two checkouts side by side to compare them.

    python bench/bench_export.py
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpt.cpuinfo import cpu_name  # noqa: E402
from gpt.hf import export_hf  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPTConfig(n_layer=12, n_head=12, n_kv_head=12, n_embd=768, vocab_size=50304, block_size=1024,
                       mlp="swiglu", bias=False, tie_embeddings=False)
    model = GPT(config).eval()
    print(f"{model.num_params() / 1e6:.1f}M parameters; {cpu_name()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    best = float("inf")
    for _ in range(args.repeats):
        folder = tempfile.mkdtemp(prefix="bench_export_")
        start = time.perf_counter()
        _, checked = export_hf(model, None, os.path.join(folder, "hf"))
        best = min(best, time.perf_counter() - start)
        shutil.rmtree(folder)
    print(f"export_hf: {best:.1f} s ({'outputs compared in transformers' if checked else 'transformers missing'})")


if __name__ == "__main__":
    main()
