"""Throughput of the web-scale prepare pipeline (data/fineweb/prepare.py) on local files: one process vs all cores.

    python bench/bench_prepare.py [--repeats 10]

The corpus is Tiny Shakespeare cut into documents of 16 paragraphs, repeated, written as a jsonl file in a
temp folder. The time covers the whole pipeline: reading with `datasets`, tokenizing, writing shards.
"""

import argparse
import json
import os
import resource
import sys
import tempfile
import time

os.environ.setdefault("TQDM_DISABLE", "1")  # the figures below are the output; no progress bars between them
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run as a script: make `data` importable
from data.fineweb import prepare
from gpt.shards import read_shard

TEXT = os.path.join(os.path.dirname(__file__), "..", "data", "shakespeare", "input.txt")


def write_corpus(path, repeats):
    paragraphs = open(TEXT, encoding="utf-8").read().split("\n\n")
    # documents of 16 paragraphs, ~750 tokens: the order of a typical web page, so per-document costs weigh as in FineWeb
    docs = ["\n\n".join(paragraphs[i:i + 16]) for i in range(0, len(paragraphs), 16)]
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(repeats):
            f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)
    return len(docs) * repeats


def cpu_seconds():
    """CPU time of this process and its finished children: well below cores x wall time means busy cores."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run(corpus, out_dir, num_workers):
    """Tokens per second of one prepare run, and its wall and CPU seconds."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    prepare.main(["--data_files", corpus, "--out_dir", out_dir, "--num_workers", str(num_workers), "--shard_size", "1000000"])
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    n_tokens = sum(len(read_shard(os.path.join(out_dir, f))) for f in os.listdir(out_dir) if f.endswith(".bin"))
    return n_tokens, n_tokens / wall, wall, cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="copies of Tiny Shakespeare in the corpus")
    args = parser.parse_args()
    cores = os.cpu_count()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        n_docs = write_corpus(corpus, args.repeats)
        # each timed twice, the faster kept: a process's first run pays a one-time start (~1.7 s on a 2-core VM),
        # which timed once fell on the 1-process figure alone and inflated the speedup (8.8x at --repeats 1)
        results = [max((run(corpus, os.path.join(tmp, f"{workers}-{i}"), workers) for i in range(2)),
                       key=lambda result: result[1]) for workers in (1, cores)]
    print(f"corpus: {n_docs:,} documents, {results[0][0]:,} tokens ({args.repeats} x Tiny Shakespeare), {cores} cores")
    for workers, (_, speed, wall, cpu) in zip((1, cores), results):
        print(f"{workers:2d} process(es): {speed / 1e6:5.2f}M tokens/s   wall {wall:5.2f} s   CPU {cpu:5.2f} s")
    print(f"speedup: {results[1][1] / results[0][1]:.2f}x")


if __name__ == "__main__":
    main()
