"""
The decode step on a static KV cache: the same shapes every step, so torch.compile compiles it once and a CUDA graph
replays it. gpt/engine.py's decode_batch imports this only with --compile or --cuda_graph, prompt lookup
(gpt/speculative.py) for its checks; an eager float step runs without it.
"""

import contextlib
import types

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# On CUDA: CUDA graphs (eager, a step is hundreds of kernel launches) and gpt-fast's coordinate-descent tuning, with
# which a batch-1 step's products become reductions fusing --quantize=int8's cast (tests/test_quantize.py shows it).
CUDA_COMPILE_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": True}
COMPILED_CACHE_STEP = 256  # compiled code is per cache length; attending over <= 255 unused slots costs little


def decode_step(model, tokens, cache, input_pos):
    """Logits (B, T, V) after tokens (B, T) at positions input_pos (T,), a tensor, on a static cache: one token for
    decode_batch, or prompt lookup's check of T - 1 proposed tokens. One function for both, so that a one-token step
    compiles to the same code for each (inductor's cache). The caller advances cache.pos."""
    with decode_attention(model):
        return model.logits(model.hidden_states(tokens, cache, input_pos))


def decode_attention(model):
    """SDPA's math kernel on a CPU in float16 (compiled, inductor fuses it), where torch's CPU flash kernel is slow
    (bench/RESULTS.md); elsewhere the default. Both compute the same attention."""
    weight = model.embed_tokens.weight  # the linear layers may be quantized and hold no .weight
    if weight.device.type == "cpu" and weight.dtype == torch.float16:
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def compile_decode_step(device):
    """decode_step compiled for one decoding call, its guards skipping the model's modules (checking them costs a
    share of every CPU step). Safe: the model does not change during one call, and no other call can reuse this
    compiled code (dynamo keeps it per code object, here a copy of decode_step's; another model of the same shapes
    would pass the guards)."""
    from gpt.kernels import use_compile_cache
    use_compile_cache(device.type)  # compiled once per machine: a later run loads the kernels
    step = types.FunctionType(decode_step.__code__.replace(), decode_step.__globals__, decode_step.__name__)
    options = {**(CUDA_COMPILE_OPTIONS if device.type == "cuda" else {}),
               "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}  # a new dict: compile pops it
    return torch.compile(step, fullgraph=True, dynamic=False, options=options)


def compiled_cache_length(positions, block_size):
    """A compiled step's static cache length (attended over whole), rounded up so other run lengths reuse its code."""
    return min(block_size, -(-positions // COMPILED_CACHE_STEP) * COMPILED_CACHE_STEP)


def mark_static(cache):
    """A compiled step writes the cache's tensors in place; a CUDA graph of it replays only on the addresses it
    recorded: tell dynamo they stay."""
    for buffer in (cache.k, cache.v, cache.tokens):
        torch._dynamo.mark_static_address(buffer)


def static_step(device, batch_size, compiled):
    """decode_batch's step(model, tokens (B, 1), cache) -> logits (B, V) on a static cache, advancing cache.pos:
    decode_step compiled, or else replayed as a CUDA graph (cuda_graph_step), from the second step on; the first runs
    eagerly, so the first token is out before the seconds of compiling or capturing. It is given the same two input
    tensors every step, the new tokens and position copied into them: a slice of the caller's has other strides to
    guard on, and another address."""
    step = compile_decode_step(device) if compiled else cuda_graph_step()
    step_tokens = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
    input_pos = torch.zeros(1, dtype=torch.long, device=device)
    first, marked = True, None  # marked: the cache whose tensors are marked static (a slide refills them in place)

    def forward(model, tokens, cache):
        nonlocal first, marked
        if compiled and marked is not cache:
            mark_static(cache)
            marked = cache
        # V, no token (sampling.greedy's and draw's for logits of NaN or inf), is read back a step late; kept in the
        # model's vocabulary, a vocabulary unpadded past the tokenizer's embeds it meanwhile instead of failing
        torch.clamp(tokens, max=model.config.vocab_size - 1, out=step_tokens)
        input_pos.fill_(cache.pos)
        logits = (decode_step if first else step)(model, step_tokens, cache, input_pos)[:, -1]  # (B, V)
        first = False
        cache.pos += 1
        return logits

    return forward


def cuda_graph_step(step=decode_step):
    """step(model, tokens, cache, input_pos), captured in a CUDA graph at its first call and replayed at every later
    one: an eager step's hundreds of kernels launched as one, and no compiler. A graph reads and writes the addresses
    it recorded, so every call must pass the same tensors (new tokens and positions copied into them, a slide's
    refill copied into the same cache): a call with another raises. On a CPU the step runs eagerly, with that check."""
    recorded, graph, logits = None, None, None

    def replay(model, tokens, cache, input_pos):
        nonlocal recorded, graph, logits
        addresses = [t.data_ptr() for t in (tokens, input_pos, cache.k, cache.v, cache.tokens, cache.layer_ids,
                                            *cache.rotary)]
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
        return logits  # (B, T, V), the graph's own tensor: rewritten by the next replay

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
