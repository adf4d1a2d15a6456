"""Ops a decode step dispatches, and the quick start's decoding speed, for this checkout and others, side by side.

    python bench/bench_ops.py                                   # this checkout
    git worktree add /tmp/before <commit>
    python bench/bench_ops.py --repos=/tmp/before,. --rounds=3  # before and after, alternating, same machine

Ops are counted on the CPU with a TorchDispatchMode, per token as the difference of two run lengths (so prefill and
set-up cancel), views left out (they launch no work) but for `to` and `reshape`,
which copy where the dtype or the layout changes (the issue's count): through `model.generate` (the model's own loop: a growing
cache), and through the static-cache step `gpt.static_step.decode_step` that sample.py compiles or, on CUDA, captures as
a CUDA graph. Shapes: the quick start's (config/small.py, float32) and GPT-2 124M's (bfloat16, as sample.py runs it
on CUDA), random weights. Speed: `python sample.py --prompt "ROMEO:" --temperature=0` on a config/small.py model
trained for 30 iterations (data/shakespeare_char prepared), its "after the first 8" tokens/s, --rounds times alternating.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK_START = dict(n_layer=3, n_head=4, n_kv_head=4, n_embd=128, block_size=128, vocab_size=65, tie_embeddings=False)
GPT2_124M = dict(n_layer=12, n_head=12, n_kv_head=4, n_embd=768, block_size=1024, vocab_size=50304)
STEADY = re.compile(r"([\d.]+) after the first \d+\)")

COUNT = r"""
import sys, torch
from torch.utils._python_dispatch import TorchDispatchMode
from model import GPT, GPTConfig
from gpt import engine
try:
    from gpt import static_step
except ImportError:  # a checkout from before it (issue 60's e396e56): generate's count alone
    static_step = None

MAY_COPY = ("aten.to", "aten.reshape")  # views by their schema that copy where they must (a dtype, a layout)

class Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not func.is_view or str(func.overloadpacket) in MAY_COPY  # a view launches no work
        return func(*args, **(kwargs or {}))

def ops(run, n):
    with Counting() as counting:
        run(n)
    return counting.n

def per_token(run, short=4, long=12):
    return (ops(run, long) - ops(run, short)) / (long - short)

torch.manual_seed(0)
shape, dtype = eval(sys.argv[1]), getattr(torch, sys.argv[2])
model = GPT(GPTConfig(**shape)).to(dtype).eval()
prompt = torch.tensor([[1, 2, 3, 4]])

def generate(n):
    model.generate(prompt, n, temperature=0)

def static_steps(n):  # the loop of sample.py's static cache: one decode_step a token, inputs copied into place
    with torch.inference_mode():
        cache, tokens = engine.prefill(model, prompt, 32, static=True)
        step_tokens, input_pos = tokens.clone(), torch.tensor([cache.pos])
        for _ in range(n):
            logits = static_step.decode_step(model, step_tokens, cache, input_pos)
            step_tokens.copy_(logits[:, -1].argmax(-1, keepdim=True))
            input_pos.add_(1)

print(per_token(generate), per_token(static_steps) if static_step else float("nan"))
"""


def count_ops(repo, shape, dtype):
    """(ops a token through model.generate, through the static decode_step) in the checkout at repo."""
    result = subprocess.run([sys.executable, "-c", COUNT, repr(shape), dtype], cwd=repo, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": repo})
    if result.returncode:
        sys.exit(f"counting ops in {repo} failed: {result.stderr.strip()[-500:]}")
    return [float(x) for x in result.stdout.split()]


def train_quick_start(out_dir):
    """config/small.py's model, 30 iterations, trained here: enough to decode from (speed does not depend on the
    weights), read by every checkout's sample.py."""
    result = subprocess.run([sys.executable, "train.py", "config/small.py", f"--out_dir={out_dir}", "--max_iters=30",
                             "--eval_interval=30", "--eval_iters=1", "--overwrite=True"], cwd=ROOT, capture_output=True,
                            text=True)
    if result.returncode:
        sys.exit(f"training the quick start's model failed: {result.stderr.strip()[-300:]}")


def tokens_per_second(repo, out_dir):
    result = subprocess.run([sys.executable, "sample.py", f"--out_dir={out_dir}", "--prompt=ROMEO:", "--temperature=0",
                             "--device=cpu"], cwd=repo, capture_output=True, text=True)
    match = STEADY.search(result.stderr)
    if result.returncode or not match:
        sys.exit(f"sample.py in {repo} failed: {result.stderr.strip()[-300:]}")
    return float(match.group(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repos", default=ROOT, help="checkouts to compare, comma-separated (default: this one)")
    parser.add_argument("--rounds", type=int, default=2, help="sample.py runs per checkout, alternating")
    args = parser.parse_args()
    repos = [os.path.abspath(r) for r in args.repos.split(",")]
    from gpt.cpuinfo import cpu_name  # noqa: E402 (this checkout's; the machine is the same for all)
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores")
    print("| checkout | quick start fp32: generate | its static step | 124M bf16: generate | its static step |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for repo in repos:
        quick = count_ops(repo, QUICK_START, "float32")
        big = count_ops(repo, GPT2_124M, "bfloat16")
        print(f"| {repo} | {quick[0]:.0f} | {quick[1]:.0f} | {big[0]:.0f} | {big[1]:.0f} |")
    with tempfile.TemporaryDirectory() as work:
        out_dir = os.path.join(work, "out-small")
        train_quick_start(out_dir)
        speeds = {repo: [] for repo in repos}
        for _ in range(args.rounds):
            for repo in repos:
                speeds[repo].append(tokens_per_second(repo, out_dir))
    print('\n`python sample.py --prompt "ROMEO:" --temperature=0`, tokens/s after the first 8, rounds alternating:')
    for repo in repos:
        print(f"  {repo}: {', '.join(f'{s:.1f}' for s in speeds[repo])} (best {max(speeds[repo]):.1f}, "
              f"median {statistics.median(speeds[repo]):.1f})")
    if len(repos) == 2:  # the figure least moved by the machine's swings: each round's own ratio
        ratios = sorted(after / before for before, after in zip(*speeds.values()))
        print(f"  {repos[1]} over {repos[0]}, each round's ratio: {', '.join(f'{r:.2f}' for r in ratios)} (median "
              f"{statistics.median(ratios):.2f})")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
