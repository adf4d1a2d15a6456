"""Decode speed of the engine (what sample.py runs) on this machine: tokens/s with the KV cache, without it, and speculative, against
transformers' LlamaForCausalLM.generate and against the memory-bandwidth floor.

    python bench/bench_sample.py                         # both models, all columns: a few minutes on 2 CPU cores
    python bench/bench_sample.py --models gpt2 --quick   # one model, fewer repeats and no-cache steps
    python bench/bench_sample.py --models small --threads 1
    python bench/bench_sample.py --models gpt2 --compile # and a row for sample.py --compile=True
    python bench/bench_sample.py --models gpt2 --modes float32,int8   # the decoding modes compared (default: all)

Models: "small" is config/small.py's shape (4 layers, 128 wide, context 128), loaded from out-small/ckpt.pt when
it exists (so speculative acceptance means something), else random; "gpt2" is the GPT-2-small size (12 layers,
768 wide, 12 heads, 4 kv heads, context 1024, vocab 50304; no qk_norm, so exactly a Llama) with random weights,
which decode as fast as trained ones. Each runs a short prompt (16 tokens) and a long one (block_size minus the
new tokens minus 32, so decoding ends near block_size), at batch 1 and 8, greedy.

Modes: float32 is the "cached" row; bfloat16 and float16 are sample.py --dtype=..., int8 and w8a8 --quantize=.... Every
/floor ratio is to the float32 floor (a mode that reads half the bytes can reach 0.5x).

Every figure is the decode phase alone: a run of N new tokens minus a run of 1, over N - 1 steps, so prefill
and setup cancel. Runs of the methods being compared are interleaved and each keeps its best, because the VM's
speed drifts over minutes: compare the ratios printed together, not figures across runs.
"""

import argparse
import copy
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: make the repo's modules importable
import torch
import torch.nn as nn

from gpt.checkpoint import load_model
from gpt.engine import Samples, decode_batch
from gpt.cpuinfo import cpu_name
from gpt.quantize import quantize
from gpt.speculative import decode_speculative
from gpt.tokenizer import Tokenizer
from model import GPT, GPTConfig

SHORT_PROMPT = 16
SPEC_K = 4  # draft tokens per speculative step, sample.py's default
CACHED, COMPILED = "cached (decode_batch)", "cached, compiled (--compile=True)"
FLOOR = "floor: sum() of a buffer of weights + KV cache size"
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME", "KMP_AFFINITY",
              "OMP_PROC_BIND", "OMP_PLACES", "GOMP_SPINCOUNT", "LD_PRELOAD")
# qk_norm off: exactly the architecture of the LlamaForCausalLM it is compared with (qk_norm=True, the default,
# is a Qwen3 and adds two small norms per layer to every step)
GPT2_CONFIG = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_kv_head=4, n_embd=768, qk_norm=False)
MODES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": "int8", "w8a8": "w8a8"}
SMALL_CONFIG = dict(vocab_size=128, block_size=128, n_layer=4, n_head=4, n_kv_head=4, n_embd=128)


def machine():
    cpu = cpu_name()
    load = f", load average {os.getloadavg()[0]:.2f} at start" if hasattr(os, "getloadavg") else ""
    # the thread count and OMP_WAIT_POLICY change the decode speed (bench/RESULTS.md): show what is set
    env = ", ".join(f"{name}={os.environ[name]}" for name in THREAD_ENV if name in os.environ) or "none set"
    return (f"machine: {cpu}, {os.cpu_count()} cores{load}\n"
            f"torch {torch.__version__}, torch.get_num_threads()={torch.get_num_threads()}, "
            f"interop threads {torch.get_num_interop_threads()}; thread env vars: {env}")


def read_bandwidth(gib=1.0, repeats=5):
    """Bytes per second of one full read of a large fp32 buffer (best of repeats)."""
    buffer = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32)
    buffer.fill_(1.0)  # untouched pages all map the zero page: reading them would give absurd bandwidths
    buffer.sum()  # warm-up: thread pool, page tables
    best = min(timed(buffer.sum) for _ in range(repeats))
    return buffer.numel() * 4 / best


def memory_read(n_bytes):
    """A function of n_new that reads an fp32 buffer of n_bytes n_new times: the floor, timed like the methods
    (interleaved with them), since the VM's bandwidth drifts as much as its decode speed."""
    buffer = torch.empty(n_bytes // 4, dtype=torch.float32)
    buffer.fill_(1.0)

    def run(n_new):
        for _ in range(n_new):
            buffer.sum()
    return run


def in_mode(model, mode):
    """A copy of the float32 model in a decoding mode (MODES): sample.py's --dtype or --quantize."""
    if isinstance(MODES[mode], str):  # a quantize.py scheme
        return quantize(copy.deepcopy(model), MODES[mode])
    return copy.deepcopy(model).to(MODES[mode])


def mode_label(mode):
    option = "quantize" if isinstance(MODES[mode], str) else "dtype"
    return CACHED if mode == "float32" else f"cached, {mode} (--{option}={mode})"


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class NullTokenizer:
    """What Samples needs from a tokenizer, for models without one: no end-of-text, no text."""

    def __init__(self, vocab_size):
        self.vocab_size, self.eot = vocab_size, None

    def decoder(self):
        return lambda token: ""


def build_models(name, seed):
    """(model, tokenizer, description) for 'small' or 'gpt2', fp32, eval mode."""
    torch.manual_seed(seed)
    ckpt_path = os.path.join(ROOT, "out-small", "ckpt.pt")
    if name == "small" and os.path.exists(ckpt_path):
        model, meta, _ = load_model(ckpt_path)
        return model, Tokenizer(meta), "config/small.py shape, trained (out-small/ckpt.pt)"
    if name == "small":
        return GPT(GPTConfig(**SMALL_CONFIG)).eval(), NullTokenizer(65), "config/small.py shape, random weights"
    return GPT(GPTConfig(**GPT2_CONFIG)).eval(), NullTokenizer(50257), "GPT-2-small size, random weights"


def early_exit_draft(model, n_layer):
    """A draft that is the model's own first n_layer layers, then its norm and head (weights shared, no copy).
    It costs ~n_layer / model layers of a step plus the head, and needs no second trained model."""
    draft = GPT(GPTConfig(**{**model.config.__dict__, "n_layer": n_layer}))
    draft.embed_tokens, draft.norm, draft.lm_head = model.embed_tokens, model.norm, model.lm_head
    draft.layers = nn.ModuleList(model.layers[:n_layer])  # layer_idx 0..n_layer-1: they index the draft's cache
    return draft.eval()


def settings_for(batch, n_new, no_kv_cache=False, compile=False):
    return dict(num_samples=batch, max_new_tokens=n_new, temperature=0.0, top_k=None, top_p=None,
                no_kv_cache=no_kv_cache, compile=compile, draft_k=SPEC_K)


def ours(model, tokenizer, prompt_ids, batch, no_kv_cache=False, compile=False):
    """A function of n_new that runs engine.decode_batch as sample.py does, without streaming."""
    def run(n_new):
        samples = Samples(batch, tokenizer, [], stream=False)
        decode_batch(model, prompt_ids, settings_for(batch, n_new, no_kv_cache, compile), samples,
                     torch.Generator().manual_seed(0))
        assert samples.n_tokens == batch * n_new  # no sample ended early: the step count is what it says
    return run


def speculative(model, draft, tokenizer, prompt_ids, stats):
    """decode_speculative for one sample; stats collects (accepted, proposed) of the long runs."""
    def run(n_new):
        samples = Samples(1, tokenizer, [], stream=False)
        result = decode_speculative(model, draft, prompt_ids, settings_for(1, n_new), samples,
                                    torch.Generator().manual_seed(0))
        if n_new > 1:
            stats.append(result)
    return run


def hf_llama(config):
    """transformers' LlamaForCausalLM of the same shape (fp32, SDPA attention, tied head), or None without it."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging
    except ImportError:
        return None
    logging.set_verbosity_error()  # the generation-config notices would land between the figures
    hf_config = LlamaConfig(hidden_size=config.n_embd, intermediate_size=config.mlp_width,
                            num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
                            num_key_value_heads=config.n_kv_head, vocab_size=config.vocab_size,
                            max_position_embeddings=config.block_size, rms_norm_eps=config.norm_eps,
                            tie_word_embeddings=True, attn_implementation="sdpa", pad_token_id=0,
                            eos_token_id=None, bos_token_id=None)
    return LlamaForCausalLM(hf_config).float().eval()


def hf_generate(hf_model, prompt_ids, batch):
    input_ids = torch.tensor([prompt_ids] * batch)
    attention_mask = torch.ones_like(input_ids)

    def run(n_new):
        with torch.inference_mode():
            out = hf_model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=n_new,
                                    min_new_tokens=n_new, do_sample=False, use_cache=True)
        assert out.shape == (batch, len(prompt_ids) + n_new)
    return run


def measure(runs, n_new, repeats, warm_up=True):
    """Seconds per decode step of each run: (best time of n_new tokens - best time of 1) / (n_new - 1).
    The runs take turns, so the VM's drift hits them alike. A run of 1 token has the same prefill and setup."""
    best = {name: [float("inf"), float("inf")] for name in runs}
    for name, run in runs.items():
        if warm_up:
            run(2)  # one-time costs of these shapes: allocator, thread pool, kernel set-up
            if name == COMPILED:
                run(n_new[name])  # its cache is sized to the run: compile the timed runs' shapes beforehand
    for _ in range(repeats):
        for name, run in runs.items():
            best[name][0] = min(best[name][0], timed(lambda: run(1)))
            best[name][1] = min(best[name][1], timed(lambda: run(n_new[name])))
    return {name: (tn - t1) / (n_new[name] - 1) for name, (t1, tn) in best.items()}


def bench_model(name, args, bandwidth, summary):
    model, tokenizer, description = build_models(name, args.seed)
    config = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied head counted once
    # every step reads all weights (the tied embedding matrix too, as the output head) and each row's K and V
    kv_bytes_per_token = 2 * config.n_layer * config.n_kv_head * config.head_dim * 4
    n_new = args.new_tokens or (32 if name == "small" else 64)
    long_len = config.block_size - n_new - max(8, config.block_size // 32)  # ends near block_size without sliding
    repeats = args.repeats * (4 if name == "small" else 1)  # its steps are short: more runs steady the differences
    vocab = tokenizer.vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    prompts = {"short": torch.randint(0, vocab, (SHORT_PROMPT,), generator=generator).tolist(),
               "long": torch.randint(0, vocab, (long_len,), generator=generator).tolist()}
    if isinstance(tokenizer, Tokenizer):  # a real model: real text, so the draft has something to agree on
        text = open(os.path.join(ROOT, "data", "shakespeare", "input.txt"), encoding="utf-8").read()
        prompts = {"short": tokenizer.encode(text[:SHORT_PROMPT]), "long": tokenizer.encode(text[:long_len])}
    hf_model = hf_llama(config) if name == "gpt2" and not args.no_hf else None
    draft_layers = 1 if config.n_layer <= 4 else 2
    draft = early_exit_draft(model, draft_layers)
    mode_models = {mode: in_mode(model, mode) for mode in args.modes if mode != "float32"}

    print(f"\n== {name} on {cpu_name()}, {torch.get_num_threads()} threads: {description}; {config.n_layer} layers, {config.n_embd} wide, {config.n_head} heads "
          f"({config.n_kv_head} kv), context {config.block_size}, vocab {config.vocab_size}; "
          f"{model.num_params() / 1e6:.2f}M params, {weight_bytes / 1e6:.1f} MB fp32")
    print(f"bandwidth floor at batch 1: {weight_bytes / bandwidth * 1e3:.2f} ms/token (weights / read bandwidth)")
    if name == "gpt2" and hf_model is None and not args.no_hf:
        print("transformers is not importable (pip install transformers): no transformers column")
    print(f"{'prompt':>11} {'batch':>5}  {'method':<56} {'ms/step':>9} {'ms/token':>9} {'tokens/s':>9} {'/floor':>7}")

    stats = {}
    for prompt_name, prompt_ids in prompts.items():
        context = len(prompt_ids) + n_new // 2  # the mean context while decoding, for the KV part of the floor
        long_gpt2 = prompt_name == "long" and config.block_size >= 512
        for batch in (1, 8):
            runs = {}
            runs[CACHED] = ours(model, tokenizer, prompt_ids, batch)
            for mode, mode_model in mode_models.items():
                runs[mode_label(mode)] = ours(mode_model, tokenizer, prompt_ids, batch)
            if args.compile:
                runs[COMPILED] = ours(model, tokenizer, prompt_ids, batch, compile=True)
            if hf_model is not None:
                runs["transformers LlamaForCausalLM.generate"] = hf_generate(hf_model, prompt_ids, batch)
            spec_stats = []
            if batch == 1:  # decode_speculative decodes the samples in turn: batch 8 is 8 x batch 1
                spec_name = f"speculative, draft = first {draft_layers} layer(s), k={SPEC_K}"
                runs[spec_name] = speculative(model, draft, tokenizer, prompt_ids, spec_stats)
            runs[FLOOR] = memory_read(weight_bytes + batch * context * kv_bytes_per_token)
            results = measure(runs, dict.fromkeys(runs, n_new), repeats)
            floor = results[FLOOR]
            # Recomputing ~1000 tokens makes each step slow, batched the more: time a few steps, once.
            if not (long_gpt2 and batch == 8 and args.quick):
                nc_steps = (3 if batch == 1 else 2) if long_gpt2 else (8 if args.quick else 16)
                nc = ours(model, tokenizer, prompt_ids, batch, no_kv_cache=True)
                # the cached runs' prefill has already run these shapes: no warm-up for the slow path
                results["no-cache (--no_kv_cache)"] = measure({"nc": nc}, {"nc": nc_steps}, 1 if long_gpt2 else repeats,
                                                              warm_up=not long_gpt2)["nc"]
            for run_name, seconds in results.items():
                label = run_name
                if run_name.startswith("speculative") and spec_stats:
                    accepted, proposed = spec_stats[-1]
                    label += f", {accepted / max(1, proposed):.0%} accepted"
                tokens_per_s = batch / seconds
                print(f"{prompt_name + f' ({len(prompt_ids)})':>11} {batch:>5}  {label:<56} {seconds * 1e3:>9.2f} "
                      f"{seconds / batch * 1e3:>9.2f} {tokens_per_s:>9.1f} {seconds / floor:>6.2f}x")
            stats[(prompt_name, batch)] = (results, floor)
    if name == "gpt2":
        print("  (speculative on random weights: the early-exit draft agrees with the model because a fresh model's"
              " residual stream is mostly the token embedding; it shows the cost at that acceptance, not a real one)")
    summary[name] = stats


def print_summary(summary, modes):
    print("\n== targets")
    for name, stats in summary.items():
        for prompt_name in ("short", "long"):
            for batch in (1, 8):
                results, floor = stats[(prompt_name, batch)]
                cached = results[CACHED]
                parts = [f"{name} {prompt_name} batch {batch}: cached {cached * 1e3:.1f} ms/step"]
                if "no-cache (--no_kv_cache)" in results:
                    parts.append(f"no-cache / cached {results['no-cache (--no_kv_cache)'] / cached:.1f}x")
                hf = results.get("transformers LlamaForCausalLM.generate")
                if hf is not None:
                    parts.append(f"transformers / cached {hf / cached:.2f}x")
                parts.append(f"cached / bandwidth floor {cached / floor:.2f}x")
                compiled = results.get(COMPILED)
                if compiled is not None:
                    parts.append(f"compiled: cached / compiled {cached / compiled:.2f}x, / floor {compiled / floor:.2f}x")
                    if hf is not None:
                        parts.append(f"transformers / compiled {hf / compiled:.2f}x")
                print(", ".join(parts))
        print_modes(name, stats, modes)
    print("targets: no-cache / cached >= 25 at ~1000 context; batch 1 float32 / floor <= 1.3; the fastest mode within "
          "1% bits per byte of float32 (bench_quality.py): batch 1 <= 0.7x the float32 floor, transformers / it >= 2.5 "
          "at batch 1 and 8; in each mode, batch 8 step / batch 1 step <= 1.5")


def print_modes(name, stats, modes):
    """Per mode: the batch-1 step against the float32 floor, transformers (float32) against it, batch 8 / batch 1."""
    for prompt_name in ("short", "long"):
        for mode in modes:
            (one, floor), (eight, _) = stats[(prompt_name, 1)], stats[(prompt_name, 8)]
            label = mode_label(mode)
            parts = [f"{name} {prompt_name} {mode}: batch 1 {one[label] * 1e3:.1f} ms = {one[label] / floor:.2f}x the "
                     f"float32 floor; batch 8 / batch 1 step {eight[label] / one[label]:.2f}x"]
            hf = "transformers LlamaForCausalLM.generate"
            if hf in one:
                parts.append(f"transformers / it {one[hf] / one[label]:.2f}x (batch 1), {eight[hf] / eight[label]:.2f}x (batch 8)")
            print(", ".join(parts))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="small,gpt2", help="comma-separated: small, gpt2 (default: both)")
    parser.add_argument("--quick", action="store_true", help="1 repeat, fewer no-cache steps, no long no-cache batch 8")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per method, best kept (default 2)")
    parser.add_argument("--new_tokens", type=int, default=0, help="tokens per timed run (default 32 small, 64 gpt2)")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--no_hf", action="store_true", help="skip the transformers column")
    parser.add_argument("--compile", action="store_true", help="add a row for sample.py --compile=True (compiles "
                        "once per prompt, batch and run length: minutes on 2 cores, less with inductor's cache warm)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)} (default: all)")
    parser.add_argument("--seed", type=int, default=1337)
    args = parser.parse_args()
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(args.modes) - set(MODES):
        sys.exit(f"error: --modes takes {', '.join(MODES)}, got {','.join(args.modes)!r}")
    args.modes = ["float32"] + [m for m in args.modes if m != "float32"]  # the reference row is always run
    args.repeats = args.repeats or (1 if args.quick else 2)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or set(models) - {"small", "gpt2"}:
        sys.exit(f"error: --models takes small and/or gpt2, got {args.models!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compile:  # every prompt, batch and run length is a new cache shape; sample.py compiles one per run
        torch._dynamo.config.recompile_limit = 64

    print(machine())
    bandwidth = read_bandwidth()
    print(f"memory read bandwidth: {bandwidth / 1e9:.1f} GB/s (best sum() of a filled 1 GiB fp32 buffer)")
    print("ms/step: one decode step of the whole batch; tokens/s counts every row; /floor: ms/step over the time to "
          "read the weights and the batch's KV cache once at the mean context (the floor row: a sum() over that many bytes, "
          "timed interleaved with the methods); speculative (batch 1 only, as "
          "decode_speculative runs samples in turn): ms per token, a step yields 1 to k+1")
    start = time.perf_counter()
    summary = {}
    with torch.inference_mode():
        for name in models:
            bench_model(name, args, bandwidth, summary)
    print_summary(summary, args.modes)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
