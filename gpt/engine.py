"""The decoding engine (docs/sampling.md): from a prompt's token ids to new tokens, for sample.py, bench/ and
evaluation. The compiled or graphed step is static_step.py's, speculative decoding speculative.py's, scoring given
tokens scoring.py's, settings sample.py's."""

import contextlib
import time

import torch

from gpt import UserError
from gpt.sampling import sample_next_token


class Samples:
    """The text of each sample so far, whether it has ended, when each token came, and the streaming of sample 0."""

    def __init__(self, n, tokenizer, stops, stream):
        self.tokenizer, self.stops, self.stream = tokenizer, stops, stream
        self.longest_stop = max(map(len, stops), default=0)
        self.decoders = [tokenizer.decoder() for _ in range(n)]
        self.texts, self.n_tokens = [""] * n, 0
        self.added_at = []  # time.perf_counter() of each token's arrival, for the speed after the first ones

    def add(self, sample, token):
        """Record one new token of a sample; True if it ended the sample. A sample ends right after its first stop
        string: the rest of the token that completed it (a BPE token can hold more) is dropped."""
        self.n_tokens += 1
        self.added_at.append(time.perf_counter())
        if token == self.tokenizer.eot:
            return True
        if token >= self.tokenizer.vocab_size:  # sampling.draw's answer to logits of NaN or inf
            raise UserError(f"the model's logits hold NaN or inf at new token {self.n_tokens}; try --dtype=float32")
        text, piece = self.texts[sample], self.decoders[sample](token)
        stop_end = self.stop_end(text, piece)
        if stop_end is not None:
            piece = piece[:stop_end - len(text)]
        self.texts[sample] = text + piece
        if sample == 0 and self.stream:
            print(piece, end="", flush=True)
        return stop_end is not None

    def tokens_per_second_after(self, n):
        """Tokens/s from the n-th token on, past the prefill and first (compiling) steps; None if fewer than n + 2."""
        if len(self.added_at) < n + 2:
            return None
        return (len(self.added_at) - 1 - n) / max(self.added_at[-1] - self.added_at[n], 1e-9)

    def stop_end(self, text, piece):
        """Where in text + piece the earliest stop string ends, if piece completes one (text holds none)."""
        before = text[max(0, len(text) - self.longest_stop):]  # a new stop starts here or in piece
        tail = before + piece
        ends = [tail.find(stop) + len(stop) for stop in self.stops if stop in tail]
        return len(text) - len(before) + min(ends) if ends else None


def device_of(model):
    """The device a model runs on (its embedding's: the linear layers may be quantized and hold no .weight)."""
    return model.embed_tokens.weight.device


def next_tokens(logits, settings, vocab_size, generator):
    """The next tokens (B, 1) from logits (B, V) as settings choose them, never past the tokenizer's vocabulary."""
    return sample_next_token(logits[:, :vocab_size], settings["temperature"], settings["top_k"], settings["top_p"],
                             generator)


def prefill(model, contexts, max_len, static=False):
    """A fresh KV cache holding each context (B, T) but its last token, and the last tokens (B, 1): left out so that
    the next step feeds them and gets the logits that follow."""
    cache = model.new_kv_cache(contexts.size(0), max_len, static=static)
    n_cached = contexts.size(1) - 1
    if n_cached:
        input_pos = torch.arange(n_cached, device=contexts.device) if static else None
        model.hidden_states(contexts[:, :-1], cache, input_pos)
    cache.pos = n_cached  # a static cache leaves the count to its caller
    return cache, contexts[:, -1:]


def select_rows(cache, rows):
    """Keep the cache's batch rows `rows` (indices; repeat one to copy it): share a prefill, drop finished samples."""
    rows = torch.as_tensor(rows, device=cache.k.device)
    cache.k, cache.v, cache.tokens = cache.k[:, rows], cache.v[:, rows], cache.tokens[rows]


def slide(contexts, block_size):
    """A full context's (B, T) last block_size // 2 tokens, prefilled again: the next slide is that far, not one."""
    return contexts[:, -(block_size // 2):]


def last_logits(model, tokens, cache):
    """Logits (B, V) after tokens (B, T): fed to the cache, or with no cache the whole context (B, T). The eager step:
    its key length is new at every call, so on CUDA without cuDNN's SDPA kernel, which builds a plan for each."""
    kernels = contextlib.nullcontext()
    if tokens.is_cuda:
        from gpt.sdpa import new_key_length_kernels
        kernels = new_key_length_kernels()
    with kernels:
        return model.logits(model.hidden_states(tokens, cache)[:, -1])  # only the last position needs logits


# Compiling pays where reading the weights (a CPU) or launching kernels (CUDA, eager) bounds a step, or for int8 weights
# (eager, each step makes a float copy); a smaller model's compiled code costs more to load than its tokens gain.
COMPILE_BY_DEFAULT_BYTES = 64 * 2**20


def compiles_by_default(model):
    """Whether sample.py compiles the decode step by default (not on MPS: the repo doesn't test torch.compile there)."""
    weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])  # tied once
    return device_of(model).type in ("cpu", "cuda") and (int8_weights(model) or weight_bytes > COMPILE_BY_DEFAULT_BYTES)


def int8_weights(model):  # --quantize's (gpt/quantize.py)
    return any(t.dtype == torch.int8 for t in model.state_dict().values())


def graphs_by_default(model):
    """Whether sample.py replays the eager decode step as a CUDA graph by default: on CUDA, for float weights."""
    return device_of(model).type == "cuda" and not int8_weights(model)


def cpu_kernels(model, rows, compiled=False):
    """On a CPU, for a compiled step or int8 weights, kernels.decode_linears (the matrix kernels chosen for this CPU);
    elsewhere nothing changes (an eager float step runs torch's own, what config/small.py's model chooses anyway)."""
    if device_of(model).type != "cpu" or not (compiled or int8_weights(model)):
        return contextlib.nullcontext()
    from gpt.kernels import decode_linears  # here, where the choice is made
    return decode_linears(model, rows, compiled)


@torch.inference_mode()
def decode_batch(model, prompt_ids, settings, samples, generator):
    """Decode num_samples continuations of the prompt together, one token per step: the prompt's KV cache is computed
    once and copied to every sample, then each step feeds the newest tokens (B, 1) and draws the next ones from their
    logits (no_kv_cache: the whole context recomputed every step). Samples that end leave the batch, except on a static
    cache (compiled, or a CUDA graph: gpt/static_step.py), where a smaller batch would be a new shape to compile."""
    n, block_size, device = settings["num_samples"], model.config.block_size, device_of(model)
    cached = not settings["no_kv_cache"]
    compiled = cached and settings["compile"]
    static = cached and bool(settings["compile"] or settings.get("cuda_graph"))  # one step shape, replayed
    max_len = min(block_size, len(prompt_ids) + settings["max_new_tokens"])  # the positions this run can fill
    step = last_logits  # step(model, tokens (B, T), cache) -> logits (B, V)
    if static:
        from gpt.static_step import compiled_cache_length, static_step
        step = static_step(device, n, compiled)
        max_len = compiled_cache_length(max_len, block_size) if compiled else max_len
    with cpu_kernels(model, n, compiled):  # on a CPU, compiled or int8: the matrix kernels chosen for it
        contexts = torch.tensor([prompt_ids], device=device).expand(n, -1)  # (B, T): every sample starts as the prompt
        cache, tokens = None, contexts
        if cached:
            cache, tokens = prefill(model, contexts[:1], max_len, static)  # the prompt once: (1, T - 1) cached
            select_rows(cache, [0] * n)
            tokens = tokens.expand(n, -1)  # (B, 1)
        rows = list(range(n))  # the sample each batch row belongs to; None: it has ended (static only)
        unread = []  # tokens on their way to the host, read once the next step is launched where the batch never
        for made in range(settings["max_new_tokens"]):  # shrinks (a static cache), from the second step on
            if cache is not None and cache.pos == block_size:  # the context is full: slide the window
                refilled, tokens = prefill(model, slide(contexts, block_size), block_size, static)
                for name in ("k", "v", "tokens"):  # into the same tensors, where a static step reads them
                    getattr(cache, name).copy_(getattr(refilled, name))
                cache.pos = refilled.pos
            elif cache is None and contexts.size(1) > block_size:  # the same window, recomputed whole (once it kept
                contexts = slide(contexts, block_size)  # the last block_size tokens: other greedy text from then on)
            logits = step(model, contexts if cache is None else tokens, cache)  # (B, V)
            tokens = next_tokens(logits, settings, samples.tokenizer.vocab_size, generator)  # (B, 1)
            contexts = torch.cat([contexts, tokens], dim=1)  # (B, T + 1)
            unread.append(read_back(tokens))
            while len(unread) > (1 if static and made else 0):
                add_tokens(samples, rows, unread.pop(0)())
            if rows.count(None) == len(rows):
                break
            if None in rows and not static:  # finished samples stop costing work
                alive = [i for i, row in enumerate(rows) if row is not None]
                rows, contexts, tokens = [rows[i] for i in alive], contexts[alive], tokens[alive]
                if cache is not None:
                    select_rows(cache, alive)
        for read in unread:  # the last step's tokens
            add_tokens(samples, rows, read())


def read_back(tokens):
    """A function returning tokens (B, 1) as a list, copied to the host from now on (CUDA: pinned, behind an event)."""
    if tokens.device.type != "cuda":
        return lambda: tokens[:, 0].tolist()
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True).copy_(tokens, non_blocking=True)
    copied = torch.cuda.current_stream().record_event()
    return lambda: copied.synchronize() or host[:, 0].tolist()


def add_tokens(samples, rows, tokens):
    """tokens (a list, one per batch row) to the samples of rows, marking in rows (None) each sample they end."""
    for i, token in enumerate(tokens):
        if rows[i] is not None and samples.add(rows[i], token):
            rows[i] = None
