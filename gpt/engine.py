"""The decoding engine (docs/sampling.md): from a prompt's token ids to new tokens, fast, for sample.py, bench/ and
evaluation. Speculative decoding is speculative.py's, scoring given tokens scoring.py's, settings sample.py's."""

import contextlib
import sys
import time
import types

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpt.sampling import sample_next_token, sampling_probs


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


def next_token_probs(logits, settings, vocab_size):
    """Probabilities (B, vocab_size) of the next token: the model's padding past the tokenizer's is never chosen."""
    return sampling_probs(logits[:, :vocab_size], settings["temperature"], settings["top_k"], settings["top_p"])


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


def slide(contexts, block_size):
    """A full context's (B, T) last block_size // 2 tokens, prefilled again: the next slide is that far, not one."""
    return contexts[:, -(block_size // 2):]


def decode_step(model, tokens, cache, input_pos):
    """Logits (B, V) after tokens (B, 1) at position input_pos (1,), a tensor, on a static cache: the same shapes
    every step, so torch.compile compiles it once. The caller advances cache.pos."""
    return chunk_logits(model, tokens, cache, input_pos)[:, -1]


def decode_attention(model):
    """SDPA's math kernel on a CPU in float16 (compiled, inductor fuses it), where torch's CPU flash kernel is slow
    (bench/RESULTS.md); elsewhere the default. Both compute the same attention."""
    if device_of(model).type == "cpu" and model.embed_tokens.weight.dtype == torch.float16:
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def chunk_logits(model, tokens, cache, input_pos):
    """Logits (B, T, V) after each of tokens (B, T) at positions input_pos (T,) on a static cache: one token for
    decode_step, or a speculative step's check of T - 1 proposed tokens."""
    with decode_attention(model):
        return model.logits(model.hidden_states(tokens, cache, input_pos))


def last_logits(model, tokens, cache):
    """Logits (B, V) after tokens (B, T): fed to the cache, or with no cache the whole context (B, T)."""
    if cache is None:
        tokens = tokens[:, -model.config.block_size:]
    return model.logits(model.hidden_states(tokens, cache)[:, -1])  # only the last position needs logits


# On CUDA: CUDA graphs (eager, a step is hundreds of kernel launches) and gpt-fast's coordinate-descent tuning, with
# which a batch-1 step's products become reductions fusing --quantize=int8's cast (tests/test_quantize.py shows it).
CUDA_COMPILE_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": True}
COMPILED_CACHE_STEP = 256  # compiled code is per cache length; attending over <= 255 unused slots costs little
# Compiling pays where reading the weights (a CPU) or launching kernels (CUDA, eager) bounds a step, or for int8 weights
# (eager, each step makes a float copy); a smaller model's compiled code costs more to load than its tokens gain.
COMPILE_BY_DEFAULT_BYTES = 64 * 2**20


def compile_decode_step(device, step=decode_step):
    """step compiled for one decoding call, its guards skipping the model's modules (checking them costs a share of
    every CPU step). Safe: the model does not change during one call, and no other call can reuse this compiled code
    (dynamo keeps it per code object, here a copy of step's; another model of the same shapes would pass the guards)."""
    step = types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__)
    options = {**(CUDA_COMPILE_OPTIONS if device.type == "cuda" else {}),
               "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}  # a new dict: compile pops it
    return torch.compile(step, fullgraph=True, dynamic=False, options=options)


def compiled_cache_length(positions, block_size):
    """A compiled step's static cache length (attended over whole), rounded up so other run lengths reuse its code."""
    return min(block_size, -(-positions // COMPILED_CACHE_STEP) * COMPILED_CACHE_STEP)


def compiles_by_default(model):
    """Whether sample.py compiles the decode step by default (not on MPS: the repo doesn't test torch.compile there)."""
    weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])  # tied once
    return device_of(model).type in ("cpu", "cuda") and (int8_weights(model) or weight_bytes > COMPILE_BY_DEFAULT_BYTES)


def int8_weights(model):  # --quantize's (gpt/quantize.py)
    return any(t.dtype == torch.int8 for t in model.state_dict().values())


def graphs_by_default(model):
    """Whether sample.py replays the eager decode step as a CUDA graph by default: on CUDA, for float weights (int8's
    eager step makes a float copy of every weight, so int8 compiles)."""
    return device_of(model).type == "cuda" and not int8_weights(model)


def cuda_graph_step(step=decode_step):
    """step(model, tokens, cache, input_pos), captured in a CUDA graph at its first call and replayed at every later
    one: an eager step's hundreds of kernels launched as one, and no compiler. A graph reads and writes the addresses
    it recorded, so every call must pass the same tensors (new tokens and positions copied into them, a slide's
    refill copied into the same cache): a call with another raises. On a CPU the step runs eagerly, with that check."""
    recorded, graph, logits = None, None, None

    def replay(model, tokens, cache, input_pos):
        nonlocal recorded, graph, logits
        addresses = [t.data_ptr() for t in (tokens, input_pos, cache.k, cache.v, cache.tokens, cache.layer_ids)]
        if recorded is None:
            recorded = addresses
            if tokens.is_cuda:
                graph, logits = capture(lambda: step(model, tokens, cache, input_pos))
        elif addresses != recorded:
            raise RuntimeError("a CUDA graph's input moved: the decode step must be given the tensors it was captured "
                               "with (copy new values into them)")
        if graph is None:
            return step(model, tokens, cache, input_pos)
        graph.replay()
        return logits  # (B, V), the graph's own tensor: rewritten by the next replay

    return replay


def capture(step):
    """A CUDA graph of step() and its output, captured as torch's docs ask: warmed up on a side stream first (cuBLAS
    and SDPA set up their workspaces there, not inside the graph). The warm-up runs the step for real: a decode step
    writes its token's keys and values into its own cache slot, as the first replay then does again."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()
    return graph, output


def cpu_kernels(model, rows, compiled=False):
    """On a CPU, for a compiled step or int8 weights, kernels.decode_linears (the matrix kernels chosen for this CPU);
    elsewhere nothing changes (an eager float step runs torch's own, what config/small.py's model chooses anyway)."""
    if device_of(model).type != "cpu" or not (compiled or int8_weights(model)):
        return contextlib.nullcontext()
    from gpt.kernels import decode_linears  # here, where the choice is made
    return decode_linears(model, rows, compiled)


def chosen_kernels_note():
    """gpt/kernels.py's one line on the kernels this process chose, or None where it chose none."""
    kernels = sys.modules.get("gpt.kernels")  # imported by cpu_kernels where it chose
    return kernels.chosen_note() if kernels and kernels.choices else None


@torch.inference_mode()
def decode_batch(model, prompt_ids, settings, samples, generator):
    """Decode num_samples continuations of the prompt together, one token per step (no_kv_cache: recomputing the whole
    context); samples that end leave the batch, except on a static cache (compiled, or a CUDA graph): a smaller batch
    would be a new shape to compile or capture."""
    with cpu_kernels(model, settings["num_samples"], compiled=settings["compile"] and not settings["no_kv_cache"]):
        decode_loop(model, prompt_ids, settings, samples, generator)


def decode_loop(model, prompt_ids, settings, samples, generator):
    """decode_batch's steps, with the model as it is given."""
    n, block_size, device = settings["num_samples"], model.config.block_size, device_of(model)
    vocab_size = samples.tokenizer.vocab_size
    compiled = settings["compile"] and not settings["no_kv_cache"]
    static = bool(compiled or settings.get("cuda_graph")) and not settings["no_kv_cache"]  # one step shape, replayed
    if compiled:
        from gpt.kernels import use_compile_cache
        use_compile_cache()  # compiled once per machine: a later run loads the kernels
        step_fn = compile_decode_step(device)
    elif static:
        step_fn = cuda_graph_step()
    if static:
        step_tokens, input_pos = torch.zeros(n, 1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device)
    max_len = min(block_size, len(prompt_ids) + settings["max_new_tokens"])
    max_len = compiled_cache_length(max_len, block_size) if compiled else max_len
    contexts = torch.tensor([prompt_ids], device=device)  # (1, T): the prompt, prefilled once
    cache, tokens = (None, contexts) if settings["no_kv_cache"] else prefill(model, contexts, max_len, static)
    if static:  # eager: this batch of 1 would be a second shape to compile or capture
        logits = decode_step(model, tokens, cache, torch.tensor([cache.pos], device=device)).expand(n, -1)
        cache.pos += 1
    else:
        logits = last_logits(model, tokens, cache).expand(n, -1)
    contexts = contexts.expand(n, -1)
    if cache is not None:
        cache.select_rows([0] * n)  # every sample starts from the prompt's cache
    if compiled:  # the step writes these tensors in place; a graph replays only on the addresses it recorded
        for buffer in (cache.k, cache.v, cache.tokens):
            torch._dynamo.mark_static_address(buffer)
    rows = list(range(n))  # the sample each batch row belongs to; None: it has ended (static only)
    for step in range(settings["max_new_tokens"]):
        tokens = next_tokens(logits, settings, vocab_size, generator)  # (B, 1)
        contexts = torch.cat([contexts, tokens], dim=1)  # (B, T + 1)
        for i, token in enumerate(tokens[:, 0].tolist()):
            if rows[i] is not None and samples.add(rows[i], token):
                rows[i] = None
        if rows.count(None) == len(rows) or step == settings["max_new_tokens"] - 1:  # no unused forward pass
            break
        if None in rows and not static:  # finished samples stop costing work
            alive = [i for i, row in enumerate(rows) if row is not None]
            rows, contexts, tokens = [rows[i] for i in alive], contexts[alive], tokens[alive]
            if cache is not None:
                cache.select_rows(alive)
        if cache is not None and cache.pos == block_size:  # the context is full: slide the window
            refilled, tokens = prefill(model, slide(contexts, block_size), block_size, static)
            if static:  # into the same tensors, which keep their static addresses
                for name in ("k", "v", "tokens"):
                    getattr(cache, name).copy_(getattr(refilled, name))
                cache.pos = refilled.pos
            else:
                cache = refilled
        if static:  # the same two input tensors every step: a slice of contexts has other strides to guard on
            step_tokens.copy_(tokens)
            input_pos.fill_(cache.pos)
            logits = step_fn(model, step_tokens, cache, input_pos)
            cache.pos += 1
        else:
            logits = last_logits(model, contexts if cache is None else tokens, cache)
