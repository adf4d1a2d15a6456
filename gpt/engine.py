"""
The decoding engine: from a prompt's token ids to new tokens, fast, for sample.py, bench/ and evaluation.

- prefill: the prompt goes through the model once; its KV cache is then copied to every sample.
- decode_batch: the samples decode together, one token per step; a sample that ends (Samples.add says so)
  leaves the batch, and when the context reaches block_size the window slides (the cache is refilled
  from the last block_size // 2 tokens). With compile, the step is torch.compiled once over a static cache.
- decode_speculative: a smaller draft model proposes draft_k tokens, the model checks them in one forward
  pass, and the output follows the model's own distribution exactly.
- decode_lookup: the same with the context as the draft (prompt lookup): what followed the last tokens where
  they occurred before; its text is plain decoding's, greedy or sampled, in fewer forward passes where text repeats.
- Samples: the text of each sample, its stop strings, and sample 0 streamed to stdout.
- On a CPU every decode step's matrix products run the kernel measured fastest on the machine (kernels.py).

Settings are sample.py's: num_samples, max_new_tokens, temperature, top_k, top_p, no_kv_cache, compile,
draft_k. The next token is always chosen by model.sample_next_token / model.sampling_probs.
"""

import contextlib
import sys
import time
import types

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpt.kernels import decode_linears, use_compile_cache
from model import sample_next_token, sampling_probs


class Samples:
    """The text of each sample so far, whether it has ended, when each token came, and the streaming of sample 0."""

    def __init__(self, n, tokenizer, stops, stream):
        self.tokenizer, self.stops, self.stream = tokenizer, stops, stream
        self.longest_stop = max(map(len, stops), default=0)
        self.decoders = [tokenizer.decoder() for _ in range(n)]
        self.texts, self.n_tokens = [""] * n, 0
        self.added_at = []  # time.perf_counter() of each token's arrival, for the speed after the first ones

    def add(self, sample, token):
        """Record one new token of a sample; True if the sample has ended with it. A sample ends right after
        its first stop string: the rest of the token that completed it (a BPE token can hold more) is dropped."""
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
        """The decoding speed from the n-th token on, without the prefill and the first steps (which compile and
        record CUDA graphs with compile=True); None if fewer than n + 2 tokens came."""
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
    """Probabilities (B, vocab_size) of the next token under the sampling settings; the model's vocabulary
    may be padded past the tokenizer's, and those padding tokens are never chosen."""
    return sampling_probs(logits[:, :vocab_size], settings["temperature"], settings["top_k"], settings["top_p"])


def prefill(model, contexts, max_len, static=False):
    """A fresh KV cache holding all but the last token of each context (B, T), and the last tokens (B, 1).
    The last token is left out so that the next step feeds it and gets the logits that follow it."""
    cache = model.new_kv_cache(contexts.size(0), max_len, static=static)
    n_cached = contexts.size(1) - 1
    if n_cached:
        input_pos = torch.arange(n_cached, device=contexts.device) if static else None
        model.hidden_states(contexts[:, :-1], cache, input_pos)
    cache.pos = n_cached  # a static cache leaves the count to its caller
    return cache, contexts[:, -1:]


def decode_step(model, tokens, cache, input_pos):
    """Logits (B, V) after tokens (B, 1) at position input_pos (1,), a tensor, on a static cache: the same
    shapes every step, so torch.compile compiles it once. The caller advances cache.pos."""
    return chunk_logits(model, tokens, cache, input_pos)[:, -1]


def decode_attention(model):
    """Which of SDPA's kernels a decode step's attention runs: on a CPU in float16, its math kernel (the formula as
    matrix products and a softmax, accumulated in float32; compiled, inductor fuses it). torch's CPU flash kernel
    in float16 took 264 us a layer for one query over ~1000 positions where bfloat16 took 117, and a GPT-2-small
    float16 step 8.0 ms where the math kernel took 5.7 (AMD EPYC, compiled). In float32 and bfloat16 the two ran
    alike (within 3%): the default (flash) stays. Either kernel computes the same attention."""
    if device_of(model).type == "cpu" and model.embed_tokens.weight.dtype == torch.float16:
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def chunk_logits(model, tokens, cache, input_pos):
    """Logits (B, T, V) after each of tokens (B, T) at positions input_pos (T,) on a static cache: one token for
    decode_step, or a speculative step's check of T - 1 proposed tokens, the same shapes every step."""
    with decode_attention(model):
        return model.lm_head(model.hidden_states(tokens, cache, input_pos))


def last_logits(model, tokens, cache):
    """Logits (B, V) after tokens (B, T): fed to the cache, or with no cache the whole context (B, T)."""
    if cache is None:
        tokens = tokens[:, -model.config.block_size:]
    return model.lm_head(model.hidden_states(tokens, cache)[:, -1])  # only the last position needs logits


# The compiled decode step on CUDA: mode="reduce-overhead" (CUDA graphs: eager, a step is hundreds of kernel
# launches, launch-bound) plus coordinate-descent tuning, gpt-fast's setting: with it inductor turns a one-row
# matrix product into a reduction (its decomposition of aten.mm), which is what fuses --quantize=int8's int8-to-16-bit
# cast into the product, so that a batch-1 step reads int8 weights (tests/test_quantize.py shows the graph).
CUDA_COMPILE_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": True}
COMPILED_CACHE_STEP = 256  # compiled code is per cache length; attending over <= 255 unused slots costs ~1% here
# On a CPU or a CUDA GPU the decode step compiles by default where that pays: weights larger than this (on a CPU,
# beyond its caches, so a step is bound by reading them; on CUDA, where eager a step is hundreds of kernel launches
# and compiled one CUDA graph) or int8 weights (eager, each step makes a float copy of them). A smaller model's eager
# step is mostly per-op overhead, and loading its compiled code costs more than its tokens gain (config/small.py's
# model on a CPU: bench/RESULTS.md). MPS does not compile: torch.compile's MPS backend is not what the repo tests.
COMPILE_BY_DEFAULT_BYTES = 64 * 2**20


def compile_decode_step(device, step=decode_step):
    """step (decode_step, or chunk_logits) compiled for one decoding call. Its guards skip the model's modules:
    checking them before every step cost ~0.7 ms of a 4-11 ms CPU step (GPT-2-small). Safe because the model does
    not change during one call, and no other call can reuse this one's compiled code: dynamo keeps compiled code per
    code object, and this one is a copy of step's own (another model of the same shapes would pass the guards that
    are left)."""
    step = types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__)
    options = {**(CUDA_COMPILE_OPTIONS if device.type == "cuda" else {}),
               "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}  # a new dict: compile pops it
    return torch.compile(step, fullgraph=True, dynamic=False, options=options)


def compiled_cache_length(positions, block_size):
    """The length of a compiled step's static cache for a run of positions: rounded up to a multiple of
    COMPILED_CACHE_STEP, so that runs of other lengths reuse the compiled code (the step attends over all of it),
    at most block_size."""
    return min(block_size, -(-positions // COMPILED_CACHE_STEP) * COMPILED_CACHE_STEP)


def compiles_by_default(model):
    """Whether sample.py compiles this model's decode step when --compile is not given."""
    tensors = [*model.parameters(), *model.buffers()]
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors)
    int8 = any(t.dtype == torch.int8 for t in tensors)
    return device_of(model).type in ("cpu", "cuda") and (int8 or weight_bytes > COMPILE_BY_DEFAULT_BYTES)


@torch.inference_mode()
def decode_batch(model, prompt_ids, settings, samples, generator):
    """Decode num_samples continuations of the prompt together, one token per step; samples that end
    leave the batch. With no_kv_cache, every step recomputes the whole context instead. With compile, the
    decode step is compiled, and samples that end stay in the batch (their tokens unused): a batch that
    shrank would be a new shape to compile."""
    with decode_linears(model, settings["num_samples"], compiled=settings["compile"] and not settings["no_kv_cache"]):
        decode_loop(model, prompt_ids, settings, samples, generator)


def decode_loop(model, prompt_ids, settings, samples, generator):
    """decode_batch's steps, with the model as it is given."""
    n, block_size, device = settings["num_samples"], model.config.block_size, device_of(model)
    vocab_size = samples.tokenizer.vocab_size
    compiled = settings["compile"] and not settings["no_kv_cache"]
    if compiled:
        use_compile_cache()  # compiled once per machine: a later run loads the kernels
        step_fn = compile_decode_step(device)
        step_tokens, input_pos = torch.zeros(n, 1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device)
    # A cache no longer than this run needs: the compiled step attends over all of it, so size matters
    max_len = len(prompt_ids) + settings["max_new_tokens"]
    max_len = compiled_cache_length(max_len, block_size) if compiled else min(block_size, max_len)
    contexts = torch.tensor([prompt_ids], device=device)  # (1, T): the prompt, prefilled once
    cache, tokens = (None, contexts) if settings["no_kv_cache"] else prefill(model, contexts, max_len, compiled)
    if compiled:  # eager: this batch of 1 would be a second shape to compile
        logits = decode_step(model, tokens, cache, torch.tensor([cache.pos], device=device)).expand(n, -1)
        cache.pos += 1
    else:
        logits = last_logits(model, tokens, cache).expand(n, -1)
    contexts = contexts.expand(n, -1)
    if cache is not None:
        cache.select_rows([0] * n)  # every sample starts from the prompt's cache
    if compiled:  # the step writes these tensors in place; a graph replays only on the addresses it recorded
        torch._dynamo.mark_static_address(cache.k)
        torch._dynamo.mark_static_address(cache.v)
    rows = list(range(n))  # the sample each batch row belongs to; None: it has ended (compiled only)
    for step in range(settings["max_new_tokens"]):
        next_tokens = sample_next_token(logits[:, :vocab_size], settings["temperature"], settings["top_k"],
                                        settings["top_p"], generator)  # (B, 1)
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
            refilled, next_tokens = prefill(model, contexts[:, -(block_size // 2):], block_size, compiled)
            if compiled:  # into the same tensors, which keep their static addresses
                cache.k.copy_(refilled.k)
                cache.v.copy_(refilled.v)
                cache.pos = refilled.pos
            else:
                cache = refilled
        if compiled:  # the same two input tensors every step: a slice of contexts has other strides to guard on
            step_tokens.copy_(next_tokens)
            input_pos.fill_(cache.pos)
            logits = step_fn(model, step_tokens, cache, input_pos)
            cache.pos += 1
        else:
            logits = last_logits(model, contexts if cache is None else next_tokens, cache)


@torch.inference_mode()
def speculative_step(target, draft, tokens, target_cache, draft_cache, k, settings, vocab_size, generator):
    """Extend tokens (a list) by 1 to k + 1 tokens distributed exactly as the target model would sample them.

    The draft proposes k tokens from its probabilities q; the target scores all of them in one forward
    over its cache and gives p. Token i is accepted with probability min(1, p_i / q_i); at the first
    rejection the replacement is drawn from normalize(max(0, p - q)), and if all k are accepted one more
    is drawn from the target. target_cache holds all of tokens but the last; draft_cache a prefix of it.
    Returns the new tokens and how many of the proposed ones were accepted.
    """
    device = device_of(target)
    proposed, draft_probs = [], []
    feed = tokens[draft_cache.pos:]  # what the draft has not seen yet (one or two tokens)
    for _ in range(k):
        logits = last_logits(draft, torch.tensor([feed], device=device), draft_cache)
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
    with decode_linears(target, (settings["draft_k"] + 1, 1)), decode_linears(draft, 1):
        return speculative_loop(target, draft, prompt_ids, settings, samples, generator)


def speculative_loop(target, draft, prompt_ids, settings, samples, generator):
    """decode_speculative's steps, with the models as they are given."""
    block_size = min(target.config.block_size, draft.config.block_size)
    vocab_size = samples.tokenizer.vocab_size
    device = device_of(target)
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
                logits = last_logits(target, torch.tensor([tokens[-1:]], device=device), target_cache)
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
# Prompt lookup: speculative decoding whose draft is the context itself


# How many of the last tokens must have occurred before for their continuation to be proposed. Fewer propose more
# often and are kept less: on config/small.py's characters, 1 or 2 made more checks than tokens they saved at
# temperature 0.8, and 3 kept the most per step greedy too (bench/bench_lookup.py; bench/RESULTS.md).
LOOKUP_NGRAM = 3


def lookup_proposal(tokens, k):
    """Up to k tokens to propose after tokens (a list): those that followed the latest earlier occurrence of its last
    LOOKUP_NGRAM tokens with k tokens after it, else the latest; [] where they occur nowhere earlier. A draft with no
    model (prompt lookup, as in Hugging Face's and llama.cpp's): it pays where a text repeats what it has read (a
    quote, code being edited, names, a list), and costs a lookup where it does not."""
    n = LOOKUP_NGRAM
    if len(tokens) <= n:
        return []
    context = torch.tensor(tokens)
    runs = context[:-1].unfold(0, n, 1)  # (len - n, n): every run of n tokens that has a token after it
    afters = (runs == context[-n:]).all(dim=1).nonzero()[:, 0] + n  # where each match's continuation starts
    if not len(afters):
        return []
    whole = afters[afters + k <= len(tokens)]  # matches followed by k tokens, as a loop of one token is not
    after = int(whole[-1] if len(whole) else afters[-1])
    return tokens[after:after + k]


@torch.inference_mode()
def decode_lookup(model, prompt_ids, settings, samples, generator):
    """Decode each sample in turn, lookup_proposal's tokens checked by the model in one pass per step (see
    lookup_loop); returns (accepted, proposed) counts."""
    with decode_linears(model, (settings["draft_k"] + 1, 1), compiled=settings["compile"]):
        return lookup_loop(model, prompt_ids, settings, samples, generator)


def lookup_loop(model, prompt_ids, settings, samples, generator):
    """decode_lookup's steps. Each step feeds the last token and the proposal (padded to draft_k: one shape to
    compile) and draws the model's token at each position, as plain decoding draws it (one sample_next_token each,
    in order); it keeps going while the drawn token is the proposed one. So the text is plain decoding's, greedy
    or sampled, up to float rounding: only the number of forward passes changes. A step with nothing proposed feeds
    the last token alone (a second compiled shape)."""
    k, block_size, device = settings["draft_k"], model.config.block_size, device_of(model)
    vocab_size = samples.tokenizer.vocab_size
    step = chunk_logits
    if settings["compile"]:
        use_compile_cache()
        step = compile_decode_step(device, chunk_logits)
    longest = len(prompt_ids) + settings["max_new_tokens"] + k  # a cache that fits the run, as decode_loop sizes it
    max_len = compiled_cache_length(longest, block_size)  # compiled or not: one cache sizing for both
    n_accepted = n_proposed = 0
    unwarmed = settings["compile"]
    for sample in range(settings["num_samples"]):
        tokens, n_new, ended, cache = list(prompt_ids), 0, False, None
        while n_new < settings["max_new_tokens"] and not ended:
            if cache is None or cache.pos == block_size:  # start, or slide the window where decode_loop does
                tokens = tokens if cache is None else tokens[-(block_size // 2):]
                cache, _ = prefill(model, torch.tensor([tokens], device=device), max_len, static=True)
                if settings["compile"]:
                    torch._dynamo.mark_static_address(cache.k)
                    torch._dynamo.mark_static_address(cache.v)
            if unwarmed and cache.pos + k < max_len:  # compile the k + 1 shape before the first token is out, not
                # at the first proposal (a stall of seconds); what it writes past cache.pos is masked, then overwritten
                step(model, torch.tensor([tokens[-1:] * (k + 1)], device=device), cache,
                     torch.arange(cache.pos, cache.pos + k + 1, device=device))
                unwarmed = False
            proposal = lookup_proposal(tokens, k) if cache.pos + k < max_len else []  # no room: one token
            chunk = tokens[-1:] + proposal + proposal[-1:] * (k - len(proposal))  # (1 or k + 1,)
            input_pos = torch.arange(cache.pos, cache.pos + len(chunk), device=device)
            logits = step(model, torch.tensor([chunk], device=device), cache, input_pos)[0]  # (len(chunk), V)
            for i in range(len(proposal) + 1):
                token = int(sample_next_token(logits[i:i + 1, :vocab_size], settings["temperature"], settings["top_k"],
                                              settings["top_p"], generator))
                tokens.append(token)
                n_new += 1
                ended = samples.add(sample, token)
                if ended or n_new == settings["max_new_tokens"] or i == len(proposal) or token != proposal[i]:
                    break
                n_accepted += 1
            n_proposed += len(proposal)
            cache.pos += i + 1  # the cache keeps the chunk's first i + 1 tokens: the last one and i accepted ones
        if sample == 0 and samples.stream:
            sys.stdout.flush()
    return n_accepted, n_proposed


# ----------------------------------------------------------------------------------------------------
# Scoring: the log-probabilities a model gives to given tokens (eval.py, harness.py)


def target_logprobs(model, hidden, targets):
    """log p(target) (N,) float32 for hidden states (N, C) and their next tokens targets (N,), and the most likely
    next tokens (N,): the output head runs on these positions only, where most of a long window's memory would go."""
    logits = model.lm_head(hidden).float()
    return -F.cross_entropy(logits, targets, reduction="none"), logits.argmax(-1)


def token_logprobs(model, tokens, stride=None, batch_size=8):
    """log p(tokens[i] | the tokens before it) for i = 1 .. N-1, as (N-1,) float32: see token_predictions."""
    return token_predictions(model, tokens, stride, batch_size)[0]


@torch.inference_mode()
def token_predictions(model, tokens, stride=None, batch_size=8):
    """log p(tokens[i] | the tokens before it) for i = 1 .. N-1, as (N-1,) float32, and the model's most likely
    token there (N-1,), with a sliding window: windows of block_size + 1 tokens start every `stride` tokens
    (default block_size // 2), and each scores only the tokens earlier windows did not, so every token past the
    first block is predicted from at least block_size - stride tokens of context. batch_size windows at a time."""
    block_size, device = model.config.block_size, device_of(model)
    stride = stride or max(1, block_size // 2)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    n_targets = len(tokens) - 1
    # window w: inputs tokens[start : start + block_size], scoring the targets from index `first` on
    starts = list(range(0, max(1, n_targets - block_size + stride), stride))
    starts[-1] = max(0, n_targets - block_size)  # the last window ends at the last token, with a full context
    windows, scored_until = [], 0
    for start in starts:
        end = min(start + block_size, n_targets)
        windows.append((start, end, scored_until))  # scores targets scored_until .. end - 1
        scored_until = end
    logprobs, top1 = [], []
    for i in range(0, len(windows), batch_size):
        batch = windows[i:i + batch_size]
        inputs = torch.stack([tokens[start:end] for start, end, _ in batch]).to(device)  # (B, T): equal lengths
        hidden = model.hidden_states(inputs)  # (B, T, C)
        keep = torch.cat([hidden[b, first - start:] for b, (start, _, first) in enumerate(batch)])  # (kept, C)
        targets = torch.cat([tokens[first + 1:end + 1] for start, end, first in batch]).to(device)
        window_logprobs, window_top1 = target_logprobs(model, keep, targets)
        logprobs.append(window_logprobs)
        top1.append(window_top1)
    if not logprobs:
        return torch.zeros(0), torch.zeros(0, dtype=torch.long)
    return torch.cat(logprobs).cpu(), torch.cat(top1).cpu()


@torch.inference_mode()
def continuation_logprobs(model, context, continuations):
    """(log p(continuation | context), whether each of its tokens was the most likely one) for each of the
    continuations (token lists) of one context (a token list): the context runs once into a KV cache, then
    the continuations together as a chunk after that cached prefix. len(context) + the longest continuation
    must be at most block_size + 1 (the last token is scored, never fed)."""
    device, n, longest = device_of(model), len(continuations), max(map(len, continuations))
    cache, last = prefill(model, torch.tensor([context], device=device), len(context) - 1 + longest)
    cache.select_rows([0] * n)
    inputs = torch.zeros(n, longest, dtype=torch.long, device=device)  # each row: the context's last token,
    targets = torch.full((n, longest), -1, dtype=torch.long, device=device)  # then the continuation, padded
    for row, continuation in enumerate(continuations):
        inputs[row, 0], inputs[row, 1:len(continuation)] = last[0, 0], torch.tensor(continuation[:-1])
        targets[row, :len(continuation)] = torch.tensor(continuation)
    return scores(model, model.hidden_states(inputs, cache), targets)  # hidden states (n, longest, C)


@torch.inference_mode()
def sequence_logprobs(model, pairs):
    """continuation_logprobs for (context, continuation) pairs of different contexts, each as one sequence of
    a padded batch; a sequence longer than block_size + 1 loses its first tokens."""
    device, block_size = device_of(model), model.config.block_size
    sequences = [(context + continuation)[-(block_size + 1):] for context, continuation in pairs]
    longest = max(map(len, sequences)) - 1
    inputs = torch.zeros(len(pairs), longest, dtype=torch.long, device=device)
    targets = torch.full((len(pairs), longest), -1, dtype=torch.long, device=device)
    for row, (sequence, (_, continuation)) in enumerate(zip(sequences, pairs)):
        inputs[row, :len(sequence) - 1] = torch.tensor(sequence[:-1])
        start = len(sequence) - 1 - len(continuation)  # the targets of the continuation's tokens
        targets[row, start:len(sequence) - 1] = torch.tensor(continuation)
    return scores(model, model.hidden_states(inputs), targets)  # hidden states (B, T, C)


def scores(model, hidden, targets):
    """(sum of log p(target), all targets the argmax) per row of hidden states (B, T, C) and targets (B, T; -1:
    none). The output head runs on the positions with a target only: most of a padded batch's are not."""
    mask = targets >= 0
    logits = model.lm_head(hidden[mask]).float()  # (K, V): the K positions with a target
    logprobs, greedy = torch.zeros(targets.shape, device=hidden.device), torch.ones_like(mask)
    logprobs[mask] = -F.cross_entropy(logits, targets[mask], reduction="none")
    greedy[mask] = logits.argmax(-1) == targets[mask]
    return list(zip(logprobs.sum(1).tolist(), greedy.all(1).tolist()))
