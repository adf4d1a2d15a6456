"""
Sample text from a trained model, streamed to the terminal as it is produced:

    python sample.py --prompt "ROMEO:"                        # the model config/small.py trains (out-small)
    python sample.py --out_dir=out-gpt2-124m --prompt FILE:prompt.txt --num_samples=3   # --prompt - reads stdin
    python sample.py --prompt "ROMEO:" --draft=out-draft      # speculative with a draft model (config/small_draft.py)
    python sample.py --prompt FILE:code.py --draft=lookup     # speculative, the context as the draft (prompt lookup)
    python sample.py --init_from=hf:hf-folder --prompt "Hi"   # a Hugging Face Llama/Qwen3 folder (export.py)
    python sample.py --prompt "ROMEO:" --quantize=int8        # int8 weights, compiled: fast per token once started
    python sample.py --prompt "ROMEO:" --quantize=w8a8 --num_samples=8   # the fastest batched (CPU)

The decoding is gpt/engine.py's (gpt/speculative.py's with --draft): docs/sampling.md. The first sample is streamed,
the others are printed when the batch is done; notes and the speed go to stderr.
"""

import os
import re
import sys
import time

import torch

from configurator import configure
from gpt import UserError
from gpt.checkpoint import load_model
from gpt.device import resolve_device, resolve_dtype
from gpt.engine import Samples, compiles_by_default, decode_batch, graphs_by_default
from gpt.machine import SharedCpu
from gpt.sampling import check_sampling
from gpt.tokenizer import Tokenizer

DEFAULTS = dict(
    out_dir="out-small",  # the folder holding ckpt.pt (or a path to a .pt file)
    init_from="resume",  # "resume": the checkpoint in out_dir; "hf:path": a Llama/Qwen3 folder (see export.py)
    prompt="\n",  # text; FILE:path reads a file, - reads stdin
    num_samples=1,
    max_new_tokens=500,
    temperature=0.8,  # 0: always the most likely token (greedy)
    top_k=None,  # keep only the k most likely tokens
    top_p=None,  # keep only the most likely tokens whose probabilities add up to top_p
    seed=1337,
    stop=None,  # a string, or a list of strings, that ends a sample (it is printed); \n, \t, \\ and \uXXXX decoded
    device="auto",  # "auto" (cuda, then mps, then cpu), or e.g. "cpu", "cuda:1"
    dtype="auto",  # "auto" (bfloat16 on CUDA, else float32), "float32", "bfloat16" or "float16"
    quantize=None,  # "int8": int8 weights, a scale per output channel (draft too); "w8a8": rows too (gpt/quantize.py)
    no_kv_cache=False,  # recompute the whole context every step (slow; for comparison and tests)
    compile=None,  # torch.compile the decode step (kept on disk); None: where it pays (engine.compiles_by_default)
    cuda_graph=None,  # replay the eager decode step as a CUDA graph, no compiler; None: on CUDA for a float model not
                      # compiled (engine.graphs_by_default); on a CPU, True runs the same static-cache step eagerly
    draft="",  # for speculative decoding, a smaller model (out_dir, .pt, hf:path) with the same tokenizer, or "lookup"
    draft_k=4,  # tokens the draft proposes per step
)
LOOKUP = "lookup"  # draft=lookup: the context is the draft (prompt lookup; no model)
SEPARATOR = "\n" + "-" * 40 + "\n"
ESCAPES = re.compile(r"\\(u[0-9a-fA-F]{4}|[nt\\])")  # in stop strings: --stop="\n\n" reaches us as backslash, n, ...
ESCAPED = {"n": "\n", "t": "\t", "\\": "\\"}
WARMUP_TOKENS = 8  # per sample: the speed line also gives tokens/s after these (prefill, compilation, CUDA graphs)


def read_prompt(prompt):
    if prompt == "-":
        return sys.stdin.read()
    if prompt.startswith("FILE:"):
        try:
            with open(prompt[5:], encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
            raise UserError(f"cannot read the prompt file {prompt[5:]}: {reason}") from None
    return prompt


def unescape(text):
    """text with the escapes a shell passes as written decoded (\\n, \\t, \\\\, \\uXXXX), the rest as it is: not
    Python's unicode_escape, which would mangle non-ASCII text."""
    return ESCAPES.sub(lambda m: ESCAPED.get(m.group(1)) or chr(int(m.group(1)[1:], 16)), text)


def check_settings(settings):
    """The stop strings, after checking every setting a run needs before anything is loaded."""
    for key in ("num_samples", "max_new_tokens", "draft_k"):
        if not isinstance(settings[key], int) or settings[key] < 1:
            raise UserError(f"{key} must be a positive integer, got {settings[key]!r}")
    if not 0 <= settings["seed"] < 2**64:  # torch.Generator's range
        raise UserError(f"seed must be at least 0 and below 2**64, got {settings['seed']}")
    try:
        check_sampling(settings["temperature"], settings["top_k"], settings["top_p"])
    except ValueError as e:
        raise UserError(str(e)) from None
    for name in ("compile", "cuda_graph"):
        if settings[name] not in (None, True, False):
            raise UserError(f"{name} must be True or False, got {settings[name]!r}")
    if settings["cuda_graph"] and (settings["compile"] or settings["draft"] or settings["no_kv_cache"]):
        raise UserError("cuda_graph=True is for plain cached decoding, not compiled: drop --compile=True, --draft or "
                        "--no_kv_cache (compiled on CUDA, the step replays as CUDA graphs already)")
    stop = settings["stop"]
    stops = list(stop) if isinstance(stop, (list, tuple)) else [] if stop is None else [stop]  # --stop=123: an int
    if not all(isinstance(s, str) and s for s in stops):
        raise UserError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return [unescape(s) for s in stops]


def main(argv):
    settings = configure(DEFAULTS, argv)
    stops = check_settings(settings)
    prompt = read_prompt(settings["prompt"])  # a file that cannot be read: said before the model loads
    device = resolve_device(settings["device"])
    dtype = resolve_dtype(settings["dtype"], device)
    cpu = SharedCpu(device)  # on a CPU: the look at how busy the machine is runs while the model loads
    if settings["quantize"]:
        from gpt.quantize import check_quantize, quantize
        check_quantize(settings["quantize"], device)
    model, meta, dataset = load_model(settings["out_dir"], device, dtype, settings["init_from"])
    draft = None  # a draft model, for speculative decoding (--draft=lookup has none)
    if settings["draft"] and settings["draft"] != LOOKUP:
        from gpt.speculative import load_draft
        draft = load_draft(settings["draft"], meta, dataset, device, dtype)
    if settings["quantize"]:  # the draft's weights too
        for each in filter(None, (model, draft)):
            quantize(each, settings["quantize"])
    tokenizer = Tokenizer(meta)
    prompt_ids = encode_prompt(prompt, tokenizer, model)  # a prompt it cannot take: one line, before any note
    choose_decode_step(settings, model)
    if busy_note := cpu.check():  # torch's threads: the cores other processes leave free
        print(busy_note, file=sys.stderr)  # stdout stays the text

    samples = Samples(settings["num_samples"], tokenizer, stops, stream=True)
    generator = torch.Generator(device=device).manual_seed(settings["seed"])
    print(prompt, end="", flush=True)
    start = time.perf_counter()
    if not settings["draft"]:
        acceptance = decode_batch(model, prompt_ids, settings, samples, generator)  # None: nothing drafted
    else:  # speculative, with a draft model or (None) prompt lookup: returns the drafted tokens (accepted, proposed)
        from gpt.speculative import decode_lookup, decode_speculative
        acceptance = (decode_lookup(model, prompt_ids, settings, samples, generator) if draft is None
                      else decode_speculative(model, draft, prompt_ids, settings, samples, generator))
    seconds = time.perf_counter() - start
    print("".join(SEPARATOR + prompt + text for text in samples.texts[1:]), end="")  # the samples after the first
    ends_line = (prompt + samples.texts[-1]).endswith("\n")  # e.g. after a stop string that ends with one
    print("" if ends_line else "\n", end="", flush=True)  # before the lines on stderr, which is not buffered
    if settings["compile"] or settings["quantize"]:  # on a CPU, gpt/kernels.py chose matrix kernels for the step
        from gpt import kernels
        if kernels.choices:
            print(kernels.chosen_note(), file=sys.stderr)
    print(speed_line(samples, seconds, settings["num_samples"], acceptance), file=sys.stderr)


def choose_decode_step(settings, model):
    """settings["cuda_graph"] and settings["compile"] where not given (None): a CUDA graph (graphs_by_default), else
    compiled where it pays (compiles_by_default); a draft model and no_kv_cache decode eagerly. Said in a note."""
    if settings["cuda_graph"] is None:
        settings["cuda_graph"] = (settings["compile"] is None and not settings["draft"] and not settings["no_kv_cache"]
                                  and graphs_by_default(model))
        if settings["cuda_graph"]:
            print("note: decoding replays the eager step as a CUDA graph (captured in about a second, no compiler; "
                  "--compile=True compiles it instead: 1-2 minutes the first time)", file=sys.stderr)
    if settings["compile"] is None:
        settings["compile"] = (not settings["cuda_graph"] and settings["draft"] in ("", LOOKUP)
                               and not settings["no_kv_cache"] and compiles_by_default(model))
        if settings["compile"]:
            from gpt.kernels import cache_dir
            print(f"note: compiling the decode step (the first time, for GPT-2 small: 1-2 minutes on an H100, 2-3 on "
                  f"two CPU cores, its matrix kernels measured; then kept in {cache_dir()}; each run still takes "
                  f"seconds to start, which a short run may not earn back: --compile=False skips it)", file=sys.stderr)


def encode_prompt(prompt, tokenizer, model):
    """The prompt's token ids, checked to fit the model's context."""
    try:
        prompt_ids = tokenizer.encode(prompt, special_tokens=True)  # "<|endoftext|>" in a prompt is the token
    except UserError as e:
        raise UserError(f"the prompt has {e}") from None
    if not prompt_ids:
        if tokenizer.eot is None:
            raise UserError("the prompt is empty; give some text to continue, e.g. --prompt='\\n'")
        prompt_ids = [tokenizer.eot]  # "a new document"
    if len(prompt_ids) >= model.config.block_size:  # a draft's smaller window slides (gpt/speculative.py)
        raise UserError(f"the prompt is {len(prompt_ids)} tokens, but the model reads at most "
                        f"block_size={model.config.block_size}; shorten it")
    return prompt_ids


def speed_line(samples, seconds, num_samples, acceptance):
    speed = f"{samples.n_tokens} tokens in {seconds:.2f} s ({samples.n_tokens / seconds:.1f} tokens/s"
    warmup = WARMUP_TOKENS * num_samples
    steady = samples.tokens_per_second_after(warmup)
    speed += f"; {steady:.1f} after the first {warmup})" if steady else ")"
    if acceptance:
        n_accepted, n_proposed = acceptance
        speed += f", draft acceptance rate {n_accepted / max(1, n_proposed):.1%} ({n_accepted}/{n_proposed})"
    return speed


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # Ctrl-C: no traceback, and the shell's status for it
        sys.exit(130)
    except BrokenPipeError:  # the reader stopped (`| head`): no traceback; stdout pointed at nothing, so that
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit raises none either
        sys.exit(1)
