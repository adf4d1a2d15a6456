"""Speed of lm-eval tasks through harness.GPTLM (what eval.py --tasks runs) against lm-eval's own Hugging Face
backend (HFLM) on the same model, exported with export.py, side by side in one run:

    python bench/bench_eval.py                               # config/shakespeare_bpe.py's shape, ~1 min
    python bench/bench_eval.py --shape gpt2                  # GPT-2-small's shape (124M parameters)
    python bench/bench_eval.py --out_dir out-shakespeare-bpe # a trained model: the accuracies mean something

Two local tasks are written to a temp folder from Tiny Shakespeare (GPT-2 BPE): "shared" is HellaSwag-shaped,
--questions questions of 4 endings (~20 tokens) after one ~100-token context; "distinct" has as many
(context, continuation) requests, each with a context of its own. Only the backends' loglikelihood calls are
timed (lm-eval's own work around them is the same for both). Each backend runs each task --repeats times,
interleaved, the best kept, because this VM's speed drifts over minutes: compare the ratios, not figures across
runs. The per-request scores of the two backends are compared too, so a fast wrong answer shows. A third
column, harness.GPTLM with context sharing off (every request a whole sequence), shows what sharing is worth.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: make the repo's modules importable
import numpy as np
import torch

from bench.bench_train import machine
from gpt.checkpoint import load_model
from gpt.hf import export_hf
from gpt.bpe import GPT2_META
from gpt.tokenizer import Tokenizer
from model import GPT, GPTConfig

SHAPES = {  # config/shakespeare_bpe.py's model, and GPT-2 small's
    "small": dict(block_size=128, n_layer=4, n_head=4, n_kv_head=2, n_embd=128),
    "gpt2": dict(block_size=1024, n_layer=12, n_head=12, n_kv_head=4, n_embd=768),
}
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "{{{{context}}}}"
doc_to_target: {target}
{choices}metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(folder, tokenizer, n_questions, seed=0):
    """shared.yaml (4 endings after each context) and distinct.yaml (one continuation per context), with data."""
    with open(os.path.join(ROOT, "data", "shakespeare", "input.txt"), encoding="utf-8") as f:
        tokens = tokenizer.encode(f.read())
    rng = np.random.default_rng(seed)

    def passage(n):
        start = int(rng.integers(0, len(tokens) - n))
        return tokenizer.decode(tokens[start:start + n])

    shared = [dict(context=passage(100), endings=[passage(20) for _ in range(4)], label=0) for _ in range(n_questions)]
    distinct = [dict(context=passage(100), continuation=passage(20)) for _ in range(4 * n_questions)]
    for name, docs, output_type, target, choices in [
            ("shared", shared, "multiple_choice", "label", "doc_to_choice: endings\n"),
            ("distinct", distinct, "loglikelihood", '"{{continuation}}"', "")]:
        data = os.path.join(folder, f"{name}.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps(doc) + "\n" for doc in docs)
        with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
            f.write(TASK.format(name=name, data=data, output_type=output_type, target=target, choices=choices))


def timed(lm):
    """lm, with the seconds and requests of its loglikelihood calls counted in lm.seconds and lm.requests."""
    method = lm.loglikelihood
    lm.seconds, lm.requests = 0.0, 0

    def loglikelihood(requests, *args, **kwargs):
        start = time.perf_counter()
        results = method(requests, *args, **kwargs)
        lm.seconds += time.perf_counter() - start
        lm.requests += len(requests)
        return results

    lm.loglikelihood = loglikelihood
    return lm


def run(lm, task, manager):
    """(requests per second of lm's loglikelihood calls, each request's log-likelihood in order)."""
    import lm_eval

    lm.seconds, lm.requests = 0.0, 0
    results = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, log_samples=True,
                                      verbosity="ERROR")
    scores = [resp[0][0] for sample in results["samples"][task] for resp in sample["resps"]]
    return lm.requests / lm.seconds, scores


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="small", help="random model of this shape (default: small)")
    parser.add_argument("--out_dir", help="a trained GPT-2-BPE checkpoint to use instead of a random model")
    parser.add_argument("--questions", type=int, default=50, help="questions per task (default: 50)")
    parser.add_argument("--batch_size", type=int, default=8, help="both backends' batch size (default: 8)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each backend on each task (default: 2)")
    args = parser.parse_args()
    import lm_eval.tasks
    from lm_eval.models.huggingface import HFLM

    from gpt import harness

    if args.out_dir:
        model, meta, _ = load_model(args.out_dir)
        what = f"the model in {args.out_dir}"
    else:
        torch.manual_seed(0)
        model, meta = GPT(GPTConfig(vocab_size=50304, **SHAPES[args.shape])).eval(), GPT2_META
        what = f"a random model of the {args.shape!r} shape"
    if meta.get("tokenizer") != "gpt2":
        sys.exit("error: the benchmark's tasks are GPT-2 BPE text; use a model trained on data/shakespeare or fineweb")
    print(machine())
    print(f"{what}: {model.num_params() / 1e6:.1f}M parameters, block_size {model.config.block_size}; "
          f"batch size {args.batch_size}, best of {args.repeats}")
    folder = tempfile.mkdtemp(prefix="bench-eval-")
    try:
        write_tasks(folder, Tokenizer(meta), args.questions)
        export_hf(model, meta, os.path.join(folder, "hf"))
        manager = lm_eval.tasks.TaskManager(include_path=folder, include_defaults=False)
        backends = {"harness.GPTLM": timed(harness.GPTLM(model, Tokenizer(meta), batch_size=args.batch_size)),
                    "no sharing": timed(harness.GPTLM(model, Tokenizer(meta), batch_size=args.batch_size,
                                                      share_contexts=False)),
                    "lm-eval HFLM": timed(HFLM(pretrained=os.path.join(folder, "hf"), device="cpu",
                                               batch_size=args.batch_size, dtype="float32"))}
        for task in ("shared", "distinct"):
            best, scores = {}, {}
            for _ in range(args.repeats):
                for name, lm in backends.items():
                    speed, scores[name] = run(lm, task, manager)
                    best[name] = max(best.get(name, 0.0), speed)
            ours, unshared, theirs = best["harness.GPTLM"], best["no sharing"], best["lm-eval HFLM"]
            diff = max(abs(a - b) for a, b in zip(scores["harness.GPTLM"], scores["lm-eval HFLM"]))
            print(f"{task:>8}: {len(scores['harness.GPTLM'])} requests; harness.GPTLM {ours:6.1f} requests/s "
                  f"(without context sharing {unshared:6.1f}), HFLM {theirs:6.1f}: {ours / theirs:.2f}x HFLM; "
                  f"largest score difference from HFLM {diff:.1e}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
