"""
Evaluate a trained model: its loss and bits per byte on the val split or any text, and standard benchmarks
through EleutherAI's lm-evaluation-harness:

    python eval.py --out_dir=out-small                       # the val split it was trained on
    python eval.py --out_dir=out-small --text=FILE           # any UTF-8 text file
    python eval.py --init_from=hf:hf-folder --text=FILE      # a Hugging Face Llama/Qwen3 folder (export.py)
    python eval.py --out_dir=out-gpt2-124m --tasks=hellaswag,arc_easy --limit=500   # needs lm-eval
    python eval.py --out_dir=... --tasks=my_task --include_path=tasks/   # task YAML files of your own
    python eval.py --out_dir=out-small --quantize=int8       # what int8 weights (or --dtype=bfloat16) cost

Bits per byte is the total loss in bits over the UTF-8 bytes of the text the predicted tokens stand for
(end-of-text: 0 bytes): unlike the loss per token, it compares a character model with a BPE model, and
with published models. Texts longer than block_size are scored with a sliding window (stride tokens a
step, default block_size // 2), so every token is predicted with at least block_size - stride tokens of
context. --out_json=FILE writes the figures (or lm-eval's full results) as JSON.
"""

import math
import os
import sys

import numpy as np
import torch

from configurator import configure
from gpt import UserError
from gpt.checkpoint import load_model
from gpt.device import resolve_device, resolve_dtype
from gpt.files import write_json
from gpt.scoring import token_logprobs
from gpt.shards import find_shards, load_meta, read_shard
from gpt.tokenizer import Tokenizer

DEFAULTS = dict(
    out_dir="out-small",  # the folder holding ckpt.pt (or a path to a .pt file)
    init_from="resume",  # "resume": the checkpoint in out_dir; "hf:path": a Llama/Qwen3 folder (see export.py)
    dataset="",  # whose val split to score (data/<dataset>); "": the one the checkpoint was trained on
    text="",  # a UTF-8 text file to score instead of the val split
    max_tokens=1_000_000,  # score at most this many tokens of the val split (its first ones)
    stride=0,  # the sliding window's step in tokens; 0: block_size // 2
    batch_size=8,  # windows (bits per byte) or requests (tasks) per forward pass
    tasks="",  # comma-separated lm-eval tasks, e.g. "hellaswag,arc_easy,lambada_openai,piqa"
    limit=None,  # at most this many examples per task (None: all)
    num_fewshot=None,  # examples shown before each question (None: the task's default)
    include_path="",  # a folder of lm-eval task YAML files (local tasks, or offline copies)
    out_json="",  # also write the results to this JSON file
    device="auto",  # "auto" (cuda, then mps, then cpu), or e.g. "cpu", "cuda:1"
    dtype="auto",  # the matrix products' precision under autocast, weights staying float32 as in training's val loss:
                   # "auto" (bfloat16 on CUDA, float16 on cards before compute capability 8.0, else float32), or one
    quantize=None,  # "int8" or "w8a8": score the model as sample.py --quantize=... decodes (gpt/quantize.py)
)


def load(settings, device, dtype):
    """(model, tokenizer meta, the dataset it was trained on: a checkpoint's, None for a Hugging Face folder)."""
    return load_model(settings["out_dir"], device, dtype, settings["init_from"])


# ----------------------------------------------------------------------------------------------------
# Loss and bits per byte


def bits_per_byte(model, tokens, byte_lengths, stride=0, batch_size=8):
    """Loss (nats per token) and bits per byte of tokens[1:], each predicted from the tokens before it."""
    logprobs = token_logprobs(model, tokens, stride or None, batch_size)  # (N - 1,)
    nats = -logprobs.double().sum().item()
    n_bytes = int(np.asarray(byte_lengths)[np.asarray(tokens[1:], dtype=np.int64)].sum())
    return dict(tokens=len(logprobs), bytes=n_bytes, loss=nats / max(1, len(logprobs)),
                bits_per_byte=nats / math.log(2) / max(1, n_bytes))


def text_tokens(path, tokenizer):
    """The tokens of a text file, after the end-of-text token when the tokenizer has one (so that every
    token of the text is predicted; a character model predicts all but the first)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise UserError(f"cannot read --text {path}: {reason}") from None
    try:
        tokens = tokenizer.encode(text)
    except UserError as e:
        raise UserError(f"--text {path} has {e}") from None
    tokens = ([tokenizer.eot] if tokenizer.eot is not None else []) + tokens
    if len(tokens) < 2:
        raise UserError(f"--text {path} is empty or too short: it needs at least two tokens to predict one")
    return tokens


def val_tokens(dataset, max_tokens, meta):
    """The first max_tokens + 1 tokens of data/<dataset>'s val shards, whose tokenizer must be the model's (meta)."""
    data_meta = load_meta(os.path.join("data", dataset))
    if data_meta != meta:  # another vocabulary's ids, scored as the model's: a figure of nothing, or an IndexError
        raise UserError(f"data/{dataset} has another tokenizer ({data_meta['tokenizer']}, {data_meta['vocab_size']} "
                        f"tokens) than the model ({meta['tokenizer']}, {meta['vocab_size']} tokens); pass the "
                        "--dataset it was trained on, or --text=FILE")
    tokens, needed = [], max_tokens + 1
    for path in find_shards(os.path.join("data", dataset), "val"):
        tokens.append(np.asarray(read_shard(path)[:needed - sum(map(len, tokens))], dtype=np.int64))
        if sum(map(len, tokens)) >= needed:
            break
    return np.concatenate(tokens).tolist()


def score_text(settings, model, tokenizer, dataset):
    """The figures for --text, or else the val split."""
    if settings["text"]:
        tokens, source = text_tokens(settings["text"], tokenizer), settings["text"]
    else:
        dataset = settings["dataset"] or dataset
        if not dataset:
            raise UserError("which text? pass --text=FILE, or --dataset=NAME for data/NAME's val split "
                            "(a Hugging Face folder has no dataset of its own)")
        tokens, source = val_tokens(dataset, settings["max_tokens"], tokenizer.meta), f"data/{dataset} val split"
    if settings["stride"] > model.config.block_size:  # windows with gaps between them, and a traceback
        raise UserError(f"stride must be at most the model's block_size ({model.config.block_size}), got "
                        f"{settings['stride']}")
    figures = bits_per_byte(model, tokens, tokenizer.byte_lengths(), settings["stride"], settings["batch_size"])
    return dict(source=source, **figures, block_size=model.config.block_size,
                stride=settings["stride"] or max(1, model.config.block_size // 2))


# ----------------------------------------------------------------------------------------------------
# Benchmarks through lm-evaluation-harness


def run_tasks(settings, model, tokenizer):
    """lm-eval's results for --tasks, after its table is printed."""
    from lm_eval.utils import make_table  # main imported gpt/harness.py, which says where lm-eval is missing

    from gpt import harness
    results = harness.run_tasks(model, tokenizer, harness.task_names(settings["tasks"]), limit=settings["limit"], num_fewshot=settings["num_fewshot"],
                                batch_size=settings["batch_size"], include_path=settings["include_path"] or None)
    print(make_table(results))
    return results


def check_settings(settings):
    folder = os.path.dirname(os.path.abspath(settings["out_json"]))
    if settings["out_json"] and not os.path.isdir(folder):  # else found once the work is done
        raise UserError(f"--out_json {settings['out_json']}: there is no folder {folder} to write it in")
    for key in ("max_tokens", "batch_size"):
        if not isinstance(settings[key], int) or settings[key] < 1:
            raise UserError(f"{key} must be a positive integer, got {settings[key]!r}")
    if settings["stride"] < 0:
        raise UserError(f"stride must be at least 1 (or 0 for block_size // 2), got {settings['stride']}")
    if settings["limit"] is not None and (not isinstance(settings["limit"], (int, float)) or settings["limit"] <= 0):
        raise UserError(f"limit must be a positive number of examples, got {settings['limit']!r}")
    if settings["num_fewshot"] is not None and (not isinstance(settings["num_fewshot"], int) or settings["num_fewshot"] < 0):
        raise UserError(f"num_fewshot must be 0 or more, got {settings['num_fewshot']!r}")


def main(argv):
    settings = configure(DEFAULTS, argv)
    check_settings(settings)
    if settings["tasks"]:
        from gpt import harness  # noqa: F401  # lm-eval is optional: one missing is said before a long model load
    device = resolve_device(settings["device"])
    from gpt.machine import SharedCpu
    cpu = SharedCpu(device)  # on a CPU: the look at how busy the machine is runs while the model loads
    dtype = resolve_dtype(settings["dtype"], device)
    if settings["quantize"]:
        from gpt.quantize import check_quantize, quantize
        check_quantize(settings["quantize"], device)
    # Scored as training scores its val loss: float32 weights and residual stream, the matrix products in dtype
    # under autocast. A model cast to bfloat16 whole gave a figure comparable with neither that nor float32's.
    model, meta, dataset = load(settings, device, torch.float32)
    if settings["quantize"]:
        quantize(model, settings["quantize"])
    tokenizer = Tokenizer(meta)
    busy_note = cpu.check()  # torch's threads: the cores other processes leave free
    if busy_note:
        print(busy_note, file=sys.stderr)
    results = {}
    with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32):
        if settings["text"] or not settings["tasks"]:
            results["text"] = figures = score_text(settings, model, tokenizer, dataset)
            print(f"{figures['source']}: {figures['tokens']:,} tokens predicted, {figures['bytes']:,} bytes; "
                  f"loss {figures['loss']:.4f} nats/token, {figures['bits_per_byte']:.4f} bits per byte")
        if settings["tasks"]:
            results["tasks"] = run_tasks(settings, model, tokenizer)
    if settings["out_json"]:
        write_json(settings["out_json"], results, indent=1, default=str)  # lm-eval's results hold a few non-JSON values


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # Ctrl-C: no traceback, and the shell's status for it
        sys.exit(130)
