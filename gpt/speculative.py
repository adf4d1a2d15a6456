"""
Speculative decoding (sample.py --draft): something cheap proposes tokens, the model checks them in one forward pass.

- decode_speculative: a smaller draft model proposes draft_k tokens; the output follows the model's own
  distribution exactly (speculative_step's acceptance rule).
- decode_lookup: the context is the draft (prompt lookup): what followed the last tokens where they occurred
  before; its text is plain decoding's, greedy or sampled, in fewer forward passes where the text repeats.

Both decode the samples one after another and return (accepted, proposed) counts; the rest is engine.py's. load_draft
loads and checks --draft's model.
"""

import os
import shlex
import sys

import torch

from gpt import UserError
from gpt.checkpoint import checkpoint_path, load_model
from gpt.engine import cpu_kernels, device_of, last_logits, next_tokens, prefill, slide
from gpt.sampling import draw, sampling_probs
from gpt.static_step import compile_decode_step, compiled_cache_length, decode_step, mark_static


DRAFT_CONFIG = "config/small_draft.py"  # a draft for config/small.py's model: a smaller one on the same dataset


def load_draft(name, meta, dataset, device, dtype):
    """sample.py --draft's model, from a checkpoint (one missing: the command that trains a draft on the model's
    dataset, if known) or a Hugging Face folder, with the model's vocabulary (meta)."""
    path = checkpoint_path(name)
    if not name.startswith("hf:") and not os.path.exists(path):
        from gpt.hints import train_command

        extra = f" --dataset={shlex.quote(dataset)}" if dataset else ""
        on = "the model's dataset" if dataset else "the model's dataset (pass it as --dataset)"
        raise UserError(f"the draft {name}: no checkpoint at {path}; train a draft on {on} first: "
                        f"{train_command(path, DRAFT_CONFIG, extra)}")
    draft, draft_meta, _ = load_model(name, device, dtype)
    if draft_meta != meta:
        raise UserError(f"the draft {name} has another vocabulary ({draft_meta['tokenizer']}, "
                        f"{draft_meta['vocab_size']} tokens) than the model ({meta['tokenizer']}, "
                        f"{meta['vocab_size']} tokens); use a draft trained on the same dataset")
    return draft


def next_token_probs(logits, settings, vocab_size):
    """Probabilities (B, vocab_size) of the next token: the model's padding past the tokenizer's is never chosen."""
    return sampling_probs(logits[:, :vocab_size], settings["temperature"], settings["top_k"], settings["top_p"])


@torch.inference_mode()
def speculative_step(target, draft, tokens, target_cache, draft_cache, k, settings, vocab_size, generator):
    """Extend tokens (a list) by 1 to k + 1 tokens distributed exactly as the target model would sample them.

    The draft proposes k tokens from its probabilities q; the target scores all of them in one forward
    over its cache and gives p. Token i is accepted with probability min(1, p_i / q_i); at the first
    rejection the replacement is drawn from normalize(max(0, p - q)), and if all k are accepted one more
    is drawn from the target. tokens: the draft's window (draft_cache holds a prefix of it), which ends as the
    target's does (target_cache holds all of its window but the last token).
    Returns the new tokens and how many of the proposed ones were accepted.
    """
    device = device_of(target)
    proposed, draft_probs = [], []
    feed = tokens[draft_cache.pos:]  # what the draft has not seen yet (one or two tokens)
    for _ in range(k):
        logits = last_logits(draft, torch.tensor([feed], device=device), draft_cache)
        q = next_token_probs(logits, settings, vocab_size)[0]
        feed = [int(draw(q, generator))]
        if feed[0] == vocab_size:  # draw's no token: the target's own is engine.Samples' to stop at
            raise UserError("the draft's logits hold NaN or inf; try --dtype=float32 or another draft")
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
            new_token = int(draw(residual, generator))  # draw normalizes
            break
        accepted.append(token)
    else:
        new_token = int(draw(p[k], generator))
    # Roll both caches back to the accepted tokens: the target keeps tokens[-1] and the accepted ones.
    target_cache.truncate(start + 1 + len(accepted))
    draft_cache.truncate(min(draft_cache.pos, len(tokens) + len(accepted)))
    return accepted + [new_token], len(accepted)


def decode_speculative(target, draft, prompt_ids, settings, samples, generator):
    """Decode each sample in turn with speculative steps; returns (accepted, proposed) counts."""
    with cpu_kernels(target, (settings["draft_k"] + 1, 1)), cpu_kernels(draft, 1):
        return speculative_loop(target, draft, prompt_ids, settings, samples, generator)


def speculative_loop(target, draft, prompt_ids, settings, samples, generator):
    """decode_speculative's steps, with the models as they are given. Each model's window slides at its own block_size:
    the target's as plain decoding's does (so that greedy text is plain decoding's), a smaller draft's within it."""
    block_size, draft_block_size = target.config.block_size, draft.config.block_size
    vocab_size = samples.tokenizer.vocab_size
    device = device_of(target)
    n_accepted = n_proposed = 0
    for sample in range(settings["num_samples"]):
        tokens, n_new, ended = list(prompt_ids), 0, False
        target_cache, draft_cache = None, None
        while n_new < settings["max_new_tokens"] and not ended:
            if target_cache is None or len(tokens) > block_size:  # start, or slide the window
                window = torch.tensor([tokens], device=device)
                window = window if target_cache is None else slide(window, block_size)
                target_cache, _ = prefill(target, window, block_size)
                tokens, draft_cache = window[0].tolist(), None
            if draft_cache is None or len(tokens) - draft_start > draft_block_size:  # the draft's window: all, or
                draft_start = 0 if len(tokens) <= draft_block_size else len(tokens) - draft_block_size // 2  # slid
                draft_cache, _ = prefill(draft, torch.tensor([tokens[draft_start:]], device=device), draft_block_size)
            # room in the target's cache for the last token and k proposals, in the draft's for k - 1 more fed to it
            k = min(settings["draft_k"], settings["max_new_tokens"] - n_new - 1, block_size - len(tokens),
                    draft_block_size + 1 - (len(tokens) - draft_start))
            if k < 1:  # no room to propose: one plain step of the target
                logits = last_logits(target, torch.tensor([tokens[-1:]], device=device), target_cache)
                new_tokens = [int(draw(next_token_probs(logits, settings, vocab_size)[0], generator))]
            else:
                new_tokens, accepted = speculative_step(target, draft, tokens[draft_start:], target_cache,
                                                        draft_cache, k, settings, vocab_size, generator)
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
    with cpu_kernels(model, (settings["draft_k"] + 1, 1), compiled=settings["compile"]):
        return lookup_loop(model, prompt_ids, settings, samples, generator)


def lookup_loop(model, prompt_ids, settings, samples, generator):
    """decode_lookup's steps. Each step feeds the last token and the proposal (padded to draft_k: one shape to
    compile) and draws the model's token at each position, as plain decoding draws it (one draw each, in order); it
    keeps going while the drawn token is the proposed one. So the text is plain decoding's, greedy or sampled, up
    to float rounding: only the number of forward passes changes. A step with nothing proposed feeds the last token
    alone (a second compiled shape, plain decoding's: the same compiled code)."""
    k, block_size, device = settings["draft_k"], model.config.block_size, device_of(model)
    vocab_size = samples.tokenizer.vocab_size
    step = compile_decode_step(device) if settings["compile"] else decode_step
    longest = len(prompt_ids) + settings["max_new_tokens"] + k  # a cache that fits the run, as decode_batch sizes it
    max_len = compiled_cache_length(longest, block_size)  # compiled or not: one cache sizing for both
    n_accepted = n_proposed = 0
    unwarmed = settings["compile"]
    for sample in range(settings["num_samples"]):
        tokens, n_new, ended, cache = list(prompt_ids), 0, False, None
        while n_new < settings["max_new_tokens"] and not ended:
            if cache is None or cache.pos == block_size:  # start, or slide the window where decode_batch does
                window = torch.tensor([tokens], device=device)
                window = window if cache is None else slide(window, block_size)
                cache, _ = prefill(model, window, max_len, static=True)
                tokens = window[0].tolist()
                if settings["compile"]:
                    mark_static(cache)
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
                token = int(next_tokens(logits[i:i + 1], settings, vocab_size, generator))
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
