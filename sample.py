"""
Sample text from a trained model, streamed to the terminal as it is produced:

    python sample.py --prompt "ROMEO:"                        # the model config/small.py trains (out-small)
    python sample.py --out_dir=out-gpt2-124m --prompt "The meaning of life is" --num_samples=3
    python sample.py --prompt FILE:prompt.txt                 # or --prompt - to read it from stdin
    python sample.py --prompt "ROMEO:" --draft=out-draft      # speculative decoding with a smaller model
    python sample.py --init_from=hf:hf-folder --prompt "Hi"   # a Hugging Face Llama/Qwen3 folder (export.py)
    python sample.py --prompt "ROMEO:" --compile=True         # torch.compile the decode step (pays off on long runs)

The prompt goes through the model once (prefill) and its KV cache is copied to every sample; the samples
then decode together, one token per step, and a sample that ends (end-of-text or a stop string) leaves
the batch. The first sample is streamed, the others are printed when the batch is done. When the context
reaches block_size, the window slides: the cache is refilled from the last block_size // 2 tokens.
Speed figures go to stderr.
"""

import codecs
import os
import sys
import time
import unicodedata

import torch

from configurator import ConfigError, configure
from model import GPT, GPTConfig, sampling_probs

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
    stop=None,  # a string, or a list of strings, that ends a sample (it is printed)
    device="auto",  # "auto" (cuda, then mps, then cpu), or e.g. "cpu", "cuda:1"
    dtype="auto",  # "auto" (bfloat16 on CUDA, else float32), "float32", "bfloat16" or "float16"
    no_kv_cache=False,  # recompute the whole context every step (slow; for comparison and tests)
    compile=False,  # torch.compile the decode step: static cache shapes, compiled once (~1-2 min on a 2-core CPU)
    draft="",  # out_dir (or .pt, or hf:path) of a smaller model with the same tokenizer, for speculative decoding
    draft_k=4,  # tokens the draft proposes per step
)
SEPARATOR = "\n" + "-" * 40 + "\n"


class SampleError(Exception):
    """A problem the user can fix; the message is one line saying what to do."""


# ----------------------------------------------------------------------------------------------------
# Checkpoint, tokenizer and settings


def load_model(path, device, dtype):
    """The model saved by train.py in path (a folder with ckpt.pt, or the file), and its dataset's meta;
    or, for path "hf:folder", a Hugging Face Llama/Qwen3 model and its tokenizer."""
    if path.startswith("hf:"):
        return load_hf_model(path[3:], device, dtype)
    ckpt_path = path if path.endswith(".pt") else os.path.join(path, "ckpt.pt")
    if not os.path.exists(ckpt_path):
        raise SampleError(f"no checkpoint at {ckpt_path}; train one first, e.g. python train.py config/small.py")
    try:
        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True)  # never runs code
    except Exception as e:
        raise SampleError(f"cannot read checkpoint {ckpt_path} ({str(e).splitlines()[0]}); it is truncated or corrupt") from None
    try:
        model = GPT(GPTConfig(**checkpoint["model_config"]))
        model.load_state_dict(checkpoint["model"])
        meta = checkpoint["meta"]
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise SampleError(f"{ckpt_path} is not a checkpoint written by train.py ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return model.to(device=device, dtype=dtype).eval(), meta


def load_hf_model(folder, device, dtype):
    from export import ConvertError, load_hf  # needs safetensors, which only this path uses

    try:
        model, meta = load_hf(folder)
    except ConvertError as e:
        raise SampleError(str(e)) from None
    if meta is None:
        raise SampleError(f"{folder} has no tokenizer.json; sample.py needs the model's tokenizer to read the prompt")
    return model.to(device=device, dtype=dtype).eval(), meta


class Tokenizer:
    """Text to token ids and back, for the tokenizer recorded in the dataset's meta.json."""

    def __init__(self, meta):
        self.meta, self.vocab_size, self.eot = meta, meta["vocab_size"], meta.get("eot_token")
        if meta["tokenizer"] == "char":
            self.chars = meta["chars"]
            self.index = {c: i for i, c in enumerate(self.chars)}
        elif meta["tokenizer"] == "bpe":  # another byte-level BPE, from a Hugging Face folder's tokenizer.json
            from export import tiktoken_encoding

            self.enc = tiktoken_encoding(meta["path"])
        else:
            import tiktoken

            self.enc = tiktoken.get_encoding(meta["tokenizer"])

    def encode(self, text):
        if self.meta.get("nfc"):
            text = unicodedata.normalize("NFC", text)
        if self.meta["tokenizer"] != "char":
            return self.enc.encode(text, allowed_special="all")  # "<|endoftext|>" in a prompt is the token
        unknown = sorted(set(text) - self.index.keys())
        if unknown:
            raise SampleError(f"the prompt has characters the model's tokenizer does not know: "
                              f"{''.join(unknown)!r}; use only characters of its training text")
        return [self.index[c] for c in text]

    def decoder(self):
        """A function from one token to its text, for streaming. BPE tokens are bytes, and a character may
        be split across tokens: the incremental UTF-8 decoder holds such a part back until it is whole."""
        if self.meta["tokenizer"] == "char":
            return self.chars.__getitem__
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda token: utf8.decode(self.enc.decode_single_token_bytes(token))


def read_prompt(prompt):
    if prompt == "-":
        return sys.stdin.read()
    if prompt.startswith("FILE:"):
        try:
            with open(prompt[5:], encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise SampleError(f"cannot read the prompt file {prompt[5:]}: {e.strerror}") from None
    return prompt


def check_settings(settings):
    if not isinstance(settings["num_samples"], int) or settings["num_samples"] < 1:
        raise SampleError(f"num_samples must be a positive integer, got {settings['num_samples']!r}")
    if settings["max_new_tokens"] < 1:
        raise SampleError(f"max_new_tokens must be at least 1, got {settings['max_new_tokens']}")
    if settings["temperature"] < 0:
        raise SampleError(f"temperature must be >= 0 (0 is greedy), got {settings['temperature']}")
    top_k, top_p = settings["top_k"], settings["top_p"]
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise SampleError(f"top_k must be an integer >= 1, got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise SampleError(f"top_p must be in (0, 1], got {top_p!r}")
    if settings["draft_k"] < 1:
        raise SampleError(f"draft_k must be at least 1, got {settings['draft_k']}")
    stop = settings["stop"]
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) and s for s in stops):
        raise SampleError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return stops


# ----------------------------------------------------------------------------------------------------
# Decoding


def next_token_probs(logits, settings, vocab_size):
    """Probabilities (B, vocab_size) of the next token under the sampling settings; at temperature 0, all
    mass on the most likely token, so greedy decoding is sampling from a one-hot distribution."""
    logits = logits[:, :vocab_size]  # the model's vocabulary may be padded past the tokenizer's
    if settings["temperature"] == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), vocab_size).float()
    return sampling_probs(logits, settings["temperature"], settings["top_k"], settings["top_p"])


def prefill(model, contexts, max_len):
    """A fresh KV cache holding all but the last token of each context (B, T), and the last tokens (B, 1).
    The last token is left out so that the next step feeds it and gets the logits that follow it."""
    cache = model.new_kv_cache(contexts.size(0), max_len)
    if contexts.size(1) > 1:
        model.hidden_states(contexts[:, :-1], cache)
    return cache, contexts[:, -1:]


def decode_step(model, tokens, cache, input_pos):
    """Logits (B, V) after tokens (B, 1) at position input_pos (1,), a tensor, through the static-shape path:
    the same shapes every step, so torch.compile compiles it once. The caller advances cache.pos."""
    return model.lm_head(model.hidden_states(tokens, cache, input_pos)[:, -1])


def last_logits(model, tokens, cache, no_kv_cache):
    """Logits (B, V) after tokens (B, T): fed to the cache, or (no_kv_cache) the whole context (B, T)."""
    if no_kv_cache:
        tokens = tokens[:, -model.config.block_size:]
    return model.lm_head(model.hidden_states(tokens, cache)[:, -1])  # only the last position needs logits


class Samples:
    """The text of each sample so far, whether it has ended, and the streaming of sample 0."""

    def __init__(self, n, tokenizer, stops, stream):
        self.tokenizer, self.stops, self.stream = tokenizer, stops, stream
        self.longest_stop = max(map(len, stops), default=0)
        self.decoders = [tokenizer.decoder() for _ in range(n)]
        self.texts, self.n_tokens = [""] * n, 0

    def add(self, sample, token):
        """Record one new token of a sample; True if the sample has ended with it. A sample ends right after
        its first stop string: the rest of the token that completed it (a BPE token can hold more) is dropped."""
        self.n_tokens += 1
        if token == self.tokenizer.eot:
            return True
        text, piece = self.texts[sample], self.decoders[sample](token)
        stop_end = self.stop_end(text, piece)
        if stop_end is not None:
            piece = piece[:stop_end - len(text)]
        self.texts[sample] = text + piece
        if sample == 0 and self.stream:
            print(piece, end="", flush=True)
        return stop_end is not None

    def stop_end(self, text, piece):
        """Where in text + piece the earliest stop string ends, if piece completes one (text holds none)."""
        before = text[max(0, len(text) - self.longest_stop):]  # a new stop starts here or in piece
        tail = before + piece
        ends = [tail.find(stop) + len(stop) for stop in self.stops if stop in tail]
        return len(text) - len(before) + min(ends) if ends else None


@torch.inference_mode()
def decode_batch(model, prompt_ids, settings, samples, generator):
    """Decode num_samples continuations of the prompt together, one token per step; samples that end
    leave the batch. With no_kv_cache, every step recomputes the whole context instead. With compile, the
    decode step is compiled, and samples that end stay in the batch (their tokens unused): a batch that
    shrank would be a new shape to compile."""
    n, block_size, device = settings["num_samples"], model.config.block_size, model.lm_head.weight.device
    vocab_size = samples.tokenizer.vocab_size
    compiled = settings["compile"] and not settings["no_kv_cache"]
    if compiled:
        step_fn = torch.compile(decode_step, fullgraph=True, dynamic=False)
        step_tokens, input_pos = torch.zeros(n, 1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device)
    # A cache no longer than this run needs: the compiled step attends over all of it, so size matters.
    max_len = min(block_size, len(prompt_ids) + settings["max_new_tokens"])
    contexts = torch.tensor([prompt_ids], device=device)  # (1, T): the prompt, prefilled once
    cache, tokens = (None, contexts) if settings["no_kv_cache"] else prefill(model, contexts, max_len)
    logits = last_logits(model, tokens, cache, settings["no_kv_cache"]).expand(n, -1)
    contexts = contexts.expand(n, -1)
    if cache is not None:
        cache.select_rows([0] * n)  # every sample starts from the prompt's cache
    rows = list(range(n))  # the sample each batch row belongs to; None: it has ended (compiled only)
    for step in range(settings["max_new_tokens"]):
        if settings["temperature"] == 0:  # greedy: argmax, without drawing from a one-hot distribution
            next_tokens = logits[:, :vocab_size].argmax(dim=-1, keepdim=True)
        else:
            next_tokens = torch.multinomial(next_token_probs(logits, settings, vocab_size), 1, generator=generator)
        contexts = torch.cat([contexts, next_tokens], dim=1)  # (B, T + 1)
        for i, token in enumerate(next_tokens[:, 0].tolist()):
            if rows[i] is not None and samples.add(rows[i], token):
                rows[i] = None
        if rows.count(None) == len(rows) or step == settings["max_new_tokens"] - 1:  # no forward pass for logits never used
            break
        if None in rows and not compiled:  # finished samples stop costing work
            alive = [i for i, row in enumerate(rows) if row is not None]
            rows, contexts, next_tokens = [rows[i] for i in alive], contexts[alive], next_tokens[alive]
            if cache is not None:
                cache.select_rows(alive)
        if cache is not None and cache.pos == block_size:  # the context is full: slide the window
            cache, next_tokens = prefill(model, contexts[:, -(block_size // 2):], block_size)
        if compiled:  # the same two input tensors every step: a slice of contexts has other strides to guard on
            step_tokens.copy_(next_tokens)
            input_pos.fill_(cache.pos)
            logits = step_fn(model, step_tokens, cache, input_pos)
            cache.pos += 1
        else:
            logits = last_logits(model, contexts if cache is None else next_tokens, cache, settings["no_kv_cache"])


@torch.inference_mode()
def speculative_step(target, draft, tokens, target_cache, draft_cache, k, settings, vocab_size, generator):
    """Extend tokens (a list) by 1 to k + 1 tokens distributed exactly as the target model would sample them.

    The draft proposes k tokens from its probabilities q; the target scores all of them in one forward
    over its cache and gives p. Token i is accepted with probability min(1, p_i / q_i); at the first
    rejection the replacement is drawn from normalize(max(0, p - q)), and if all k are accepted one more
    is drawn from the target. target_cache holds all of tokens but the last; draft_cache a prefix of it.
    Returns the new tokens and how many of the proposed ones were accepted.
    """
    device = target.lm_head.weight.device
    proposed, draft_probs = [], []
    feed = tokens[draft_cache.pos:]  # what the draft has not seen yet (one or two tokens)
    for _ in range(k):
        logits = last_logits(draft, torch.tensor([feed], device=device), draft_cache, False)
        q = next_token_probs(logits, settings, vocab_size)[0]
        feed = [int(torch.multinomial(q, 1, generator=generator))]
        proposed.append(feed[0])
        draft_probs.append(q)

    start = target_cache.pos
    chunk = torch.tensor([tokens[-1:] + proposed], device=device)  # (1, k + 1)
    p = next_token_probs(target(chunk, kv_cache=target_cache)[0][0], settings, vocab_size)  # (k + 1, V)
    accepted = []
    for i, (token, q) in enumerate(zip(proposed, draft_probs)):
        accept_prob = torch.clamp(p[i, token] / q[token], max=1.0)
        if torch.rand((), device=device, generator=generator) >= accept_prob:
            residual = torch.clamp(p[i] - q, min=0)
            new_token = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
            break
        accepted.append(token)
    else:
        new_token = int(torch.multinomial(p[k], 1, generator=generator))
    # Roll both caches back to the accepted tokens: the target keeps tokens[-1] and the accepted ones.
    target_cache.truncate(start + 1 + len(accepted))
    draft_cache.truncate(min(draft_cache.pos, target_cache.pos))
    return accepted + [new_token], len(accepted)


def decode_speculative(target, draft, prompt_ids, settings, samples, generator):
    """Decode each sample in turn with speculative steps; returns (accepted, proposed) counts."""
    block_size = min(target.config.block_size, draft.config.block_size)
    vocab_size = samples.tokenizer.vocab_size
    device = target.lm_head.weight.device
    n_accepted = n_proposed = 0
    for sample in range(settings["num_samples"]):
        tokens, n_new, ended = list(prompt_ids), 0, False
        target_cache, draft_cache = None, None
        while n_new < settings["max_new_tokens"] and not ended:
            if target_cache is None or len(tokens) > block_size:  # start, or slide the window
                window = torch.tensor([tokens[-(block_size // 2):] if target_cache else tokens], device=device)
                target_cache, _ = prefill(target, window, block_size)
                draft_cache, _ = prefill(draft, window, block_size)
                tokens = window[0].tolist()
            k = min(settings["draft_k"], settings["max_new_tokens"] - n_new - 1, block_size - len(tokens))
            if k < 1:  # no room to propose: one plain step of the target
                logits = last_logits(target, torch.tensor([tokens[-1:]], device=device), target_cache, False)
                new_tokens = [int(torch.multinomial(next_token_probs(logits, settings, vocab_size)[0], 1, generator=generator))]
            else:
                new_tokens, accepted = speculative_step(target, draft, tokens, target_cache, draft_cache, k,
                                                        settings, vocab_size, generator)
                n_accepted, n_proposed = n_accepted + accepted, n_proposed + k
            for token in new_tokens:
                tokens.append(token)
                n_new += 1
                if samples.add(sample, token):
                    ended = True
                    break
        if sample == 0 and samples.stream:
            sys.stdout.flush()
    return n_accepted, n_proposed


# ----------------------------------------------------------------------------------------------------


def main(argv):
    settings = configure(DEFAULTS, argv)
    stops = check_settings(settings)
    device = settings["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    dtype = settings["dtype"]
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise SampleError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    if settings["init_from"] != "resume" and not settings["init_from"].startswith("hf:"):
        raise SampleError(f"init_from must be resume or hf:path/to/folder, got {settings['init_from']!r}")
    source = settings["out_dir"] if settings["init_from"] == "resume" else settings["init_from"]
    model, meta = load_model(source, device, getattr(torch, dtype))
    tokenizer = Tokenizer(meta)
    draft = None
    if settings["draft"]:
        draft, draft_meta = load_model(settings["draft"], device, getattr(torch, dtype))
        if draft_meta != meta:
            raise SampleError(f"the draft {settings['draft']} has another vocabulary ({draft_meta['tokenizer']}, "
                              f"{draft_meta['vocab_size']} tokens) than the model ({meta['tokenizer']}, "
                              f"{meta['vocab_size']} tokens); use a draft trained on the same dataset")

    prompt = read_prompt(settings["prompt"])
    prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        if tokenizer.eot is None:
            raise SampleError("the prompt is empty; give some text to continue, e.g. --prompt='\\n'")
        prompt_ids = [tokenizer.eot]  # "a new document"
    block_size, reader = model.config.block_size, "the model"
    if draft is not None and draft.config.block_size < block_size:
        block_size, reader = draft.config.block_size, f"the draft {settings['draft']}"
    if len(prompt_ids) >= block_size:
        raise SampleError(f"the prompt is {len(prompt_ids)} tokens, but {reader} reads at most "
                          f"block_size={block_size}; shorten it")

    generator = torch.Generator(device=device).manual_seed(settings["seed"])
    samples = Samples(settings["num_samples"], tokenizer, stops, stream=True)
    print(prompt, end="", flush=True)
    start = time.perf_counter()
    if draft is None:
        decode_batch(model, prompt_ids, settings, samples, generator)
    else:
        n_accepted, n_proposed = decode_speculative(model, draft, prompt_ids, settings, samples, generator)
    seconds = time.perf_counter() - start
    for text in samples.texts[1:]:
        print(SEPARATOR + prompt + text, end="")
    print(flush=True)  # before the speed line on stderr, which is not buffered
    speed = f"{samples.n_tokens} tokens in {seconds:.2f} s ({samples.n_tokens / seconds:.1f} tokens/s)"
    if draft is not None:
        speed += f", draft acceptance rate {n_accepted / max(1, n_proposed):.1%} ({n_accepted}/{n_proposed})"
    print(speed, file=sys.stderr)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, SampleError) as e:
        sys.exit(f"error: {e}")
