"""What choosing the next token costs a decode step, by setting, at GPT-2's vocabulary (50,304 tokens) on this machine:
gpt/sampling.py's sample_next_token beside the forms it replaced (torch.multinomial for the draw, a sort of the whole
vocabulary for top_p), on logits of three shapes: peaked, medium and near-flat (an untrained model's), whose top_p=0.9
nucleus holds tens, hundreds and tens of thousands of tokens.

    python bench/bench_sampling.py            # µs a call, best of 5 interleaved rounds, at 1 and 4 rows
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpt.cpuinfo import cpu_name  # noqa: E402
from gpt.sampling import sample_next_token, sampling_probs  # noqa: E402

VOCAB, ROUNDS, CALLS = 50304, 5, 20


def replaced(logits, temperature, top_k, top_p, generator):
    """The token as sampling.py chose it before: the whole vocabulary sorted for top_p, torch.multinomial's draw."""
    probs = sampling_probs(logits, temperature, top_k)
    if top_p is not None:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
    return torch.multinomial(probs, 1, generator=generator)


def microseconds(choose, logits, settings, generator):
    choose(logits, *settings, generator)  # warm-up
    start = time.perf_counter()
    for _ in range(CALLS):
        choose(logits, *settings, generator)
    return 1e6 * (time.perf_counter() - start) / CALLS


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; µs a call, best of {ROUNDS}")
    print("| logits | rows | setting | nucleus (top_p) | before | now |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    generator = torch.Generator().manual_seed(0)
    settings = {"temperature 0.8": (0.8, None, None), "top_k=50": (0.8, 50, None), "top_p=0.9": (0.8, None, 0.9),
                "top_k=50, top_p=0.95": (0.8, 50, 0.95)}
    with torch.inference_mode():
        for shape, scale in (("peaked", 6.0), ("medium", 3.0), ("near-flat", 1.0)):
            for rows in (1, 4):
                logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(1)) * scale
                for name, setting in settings.items():
                    best = {"before": float("inf"), "now": float("inf")}
                    for _ in range(ROUNDS):
                        for label, choose in (("before", replaced), ("now", sample_next_token)):
                            best[label] = min(best[label], microseconds(choose, logits, setting, generator))
                    nucleus = (sampling_probs(logits, *setting) > 0).sum(-1).max() if setting[2] else "-"
                    print(f"| {shape} | {rows} | {name} | {nucleus} | {best['before']:,.0f} | {best['now']:,.0f} |")


if __name__ == "__main__":
    main()
