"""Invariants that hold for every model setting, run over one shared list of small configs (CONFIGS).

For each config, with random weights (sharp, context-dependent distributions) in eval mode:
- the KV cache fed in any chunking, after a rollback too, gives the logits of one full forward;
- the static cache (torch.compile's path, garbage in its unwritten slots) gives the growing cache's logits;
- greedy generate equals a naive loop that recomputes the whole sequence every step;
- engine's greedy decode_batch equals a naive loop (past block_size too), and speculative decoding equals it;
  generate, decode_batch and prompt lookup by the logits they chose from too (a soft cap that one of them skips
  changes no greedy token), and eval.py's scorers give a full forward's log-probabilities;
- the full-sequence forward (SDPA's is_causal fast path when window == 0) equals the mask rule's logits;
- changing one token changes exactly the logits in its receptive field (derived layer by layer from the promises:
  causal, and n_layer * (window - 1) positions on with a sliding window);
- each query sees exactly the keys its settings promise (VISIBLE_KEYS, written apart from model.py), in every
  layer and for the tokens at hand: the mask can_attend gives each path, and, with every other layer silenced,
  which tokens move which logits through every path;
- export either refuses a model (leaving nothing behind) or writes one that loads back bit for bit, same config.

Every attention path asks model.can_attend which keys a query sees, so the last tests plant bugs in it (off by
one for single-token decoding only, a forgotten setting, one layer's rule wrong, and others) and check that these
invariants catch each of them; if model.py fails an invariant with nothing planted, they say so instead, naming the
helper and the promise that may be what needs the change.

Adding a model setting (a GPTConfig field, or a new value such as another MLP kind): add one entry to CONFIGS
that turns it on, and the field to VISIBLE_KEYS (with its promise) or SAME_KEYS. test_configs_cover_every_setting
and test_every_setting_says_whether_it_changes_the_visible_keys fail until you do.
"""

import contextlib
import copy
import functools
import math
import os
import re
from dataclasses import asdict, fields, replace

import pytest
import torch

import model as model_py  # the module: the live tests swap its can_attend
from gpt import UserError, engine, hf, speculative
from gpt.checkpoint import load_hf
from model import GPT, MLP_KINDS, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

BASE = dict(vocab_size=61, block_size=40, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
CONFIGS = {  # name -> GPTConfig keyword arguments over BASE; each entry turns on settings to exercise
    # the defaults: swiglu, 4 query heads on 2 kv heads (GQA), qk_norm, tied head
    "swiglu_gqa_qknorm_tied": dict(),
    "gelu_mha_untied": dict(mlp="gelu", n_kv_head=4, qk_norm=False, tie_embeddings=False, vocab_size=97),
    "relu2_mqa_hidden": dict(mlp="relu2", n_kv_head=1, mlp_hidden=48),
    "llama_bias": dict(qk_norm=False, bias=True, n_kv_head=4, tie_embeddings=False, rope_base=500.0),
    "qwen3_head_dim": dict(head_dim=12, norm_eps=1e-6, block_size=48),  # head_dim 12, not 32 // 4 = 8
    "qknorm_bias": dict(bias=True, n_embd=64, n_head=8, n_kv_head=4),  # no HF counterpart: Qwen3 has no MLP biases
    # a window of 5, far shorter than the sequences below, so it cuts; 3 layers: its reach compounds
    "window_gqa": dict(window=5, n_layer=3, block_size=48),
    "window_mqa_relu2_bias": dict(window=5, n_kv_head=1, mlp="relu2", bias=True, qk_norm=False,
                                  tie_embeddings=False, vocab_size=97),
    "dropout_in_eval": dict(dropout=0.1, tie_embeddings=False),  # a training switch: eval mode ignores it
}
NAMES = list(CONFIGS)

# Which keys a query sees, written down apart from model.py's can_attend: a rule can agree with itself on every
# attention path and still not do what its setting promises (a "keep the first tokens" rule that does nothing). Each
# setting that changes the visible keys maps to its promise, applied in this order to the causal set, key <= query.
# A promise is written for one query and one key, as `and`, `or`, `not` would say it, but with &, | and ~ so that it
# holds for every query and key at once (promised_mask): query (Q, 1) and key (1, K) are positions; then the setting's
# value; visible (R, Q, K): whether the key is visible so far; layer: the layer's index (an int); tokens (R, S): each
# sequence's token ids, S covering every position.
VISIBLE_KEYS = {
    "window": lambda query, key, window, visible, layer, tokens: visible & ((window == 0) | (key > query - window)),
    # Kept first tokens (StreamingLLM's), were GPTConfig to gain `keep_first` (the first `keep_first` tokens stay
    # visible past the window; not gpt-oss's "sinks", a learned logit that hides no key and needs no promise):
    # "keep_first": lambda query, key, keep, visible, layer, tokens: visible | ((key < keep) & (key <= query)),
    # Document masking, were it to gain `doc_sep` (a query sees no key before a separator token at or before it):
    # "doc_sep": lambda query, key, sep, visible, layer, tokens:
    #     visible & ((sep < 0) | ~any_between(tokens == sep, key, query)),
}
SAME_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "head_dim", "dropout", "bias",
             "mlp", "mlp_hidden", "qk_norm", "rope_base", "norm_eps", "tie_embeddings")  # change no query's keys
TOL = 1e-5  # float32 logits of two ways to compute the same thing (relative to the largest logit)
BROKEN = 1e-3  # a planted bug moves logits by far more than this


def config(name):
    return GPTConfig(**{**BASE, **CONFIGS[name]})


def randomize_(model, seed, std=0.4):
    """Every matrix N(0, std) from a fixed generator, other weights (norm scales) near 1, biases small:
    distributions sharp enough that greedy tokens vary with the context (a fresh tied model mostly repeats its
    last token), and a skipped norm, bias or head shows in the logits. By role, so that a LayerNorm's bias is a bias."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied head is listed once
            noise = torch.randn(param.shape, generator=generator)
            bias = name.endswith("bias")
            param.copy_(std * noise if param.dim() == 2 else 0.1 * noise if bias else 1 + 0.2 * noise)
    return model.eval()


def build(name, device, seed=0):
    """The config's model with randomize_'s weights (drawn on the CPU: the same everywhere), on device."""
    return randomize_(GPT(config(name)), seed).to(device)


def device_of(model):
    return model.embed_tokens.weight.device


SMALL_IDS = 4  # a quarter of the tokens drawn are ids 0 .. 3, so that a rule of the tokens (a separator) meets them


def token_ids(vocab_size, shape, seed):
    """Random token ids from a fixed CPU generator: uniform over the vocabulary, but a quarter of them among ids
    0 .. SMALL_IDS-1, often next to each other (a CONFIGS entry for a token rule names one of those: a separator)."""
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.randint(0, vocab_size, shape, generator=generator)
    small = torch.rand(shape, generator=generator) < 0.25
    drawn[small] = torch.randint(0, SMALL_IDS, shape, generator=generator)[small]
    return drawn


def tokens(model, shape, seed):
    """token_ids for the model (the same on every device), on its device."""
    return token_ids(model.config.vocab_size, shape, seed).to(device_of(model))


def garbage_(tensor, generator, std=100.0):
    """Fill tensor (on any device) with large values drawn from a CPU generator."""
    tensor.copy_(torch.empty(tensor.shape).normal_(0, std, generator=generator))


def max_error(actual, expected):
    """The largest difference, relative to the largest logit (float32 rounding grows with the logits' size);
    NaN (e.g. a row with every key masked) counts as infinite."""
    difference = torch.nan_to_num((actual - expected).abs(), nan=math.inf).max().item()
    return difference / max(1.0, expected.abs().max().item())


def assert_same_logits(actual, expected, path):
    """A decoding path's logits are a full forward's (TOL): compared as logits, not greedy tokens, which a monotone
    change of the logits (a soft cap, a temperature) that the path skips never moves."""
    error = max_error(actual, expected)
    assert error < TOL, f"{path}: logits differ from the full forward's by {error:.3g} (max |logit|)"


def recording(monkeypatch, module, name):
    """Record the logits (the first argument) of every call of module.name, which goes on as before."""
    calls, original = [], getattr(module, name)

    def record(logits, *args, **kwargs):
        calls.append(logits.detach().clone())
        return original(logits, *args, **kwargs)

    monkeypatch.setattr(module, name, record)
    return calls


def chunk_sizes(total, seed):
    """A prefix, two single-token steps, then random chunks of 1 to 8 (fixed seed) up to total tokens."""
    generator, sizes = torch.Generator().manual_seed(seed), [3, 1, 1]
    while sum(sizes) < total:
        sizes.append(min(int(torch.randint(1, 9, (1,), generator=generator)), total - sum(sizes)))
    return sizes


@torch.inference_mode()
def logits_through(model, idx, path, seed=0, cache=None):
    """idx's logits (B, T, vocab) by one attention path: "full" forward; "tokens" one at a time on a growing cache;
    "chunks" (chunk_sizes) on a growing cache; "static" the same chunks on a static cache holding large garbage
    where nothing was written. cache: the empty cache to fill (the caller's, to go on with), else a new one."""
    if path == "full":
        return model(idx)[0]
    B, T = idx.shape
    if cache is None:
        cache = model.new_kv_cache(B, T, static=path == "static")
    if path == "static":
        garbage_(cache.k, torch.Generator().manual_seed(seed))
        garbage_(cache.v, torch.Generator().manual_seed(seed + 1))
        cache.tokens.copy_(tokens(model, cache.tokens.shape, seed + 2))  # and token ids no rule may read
    pieces, start = [], 0
    for size in [1] * T if path == "tokens" else chunk_sizes(T, seed):
        input_pos = torch.arange(start, start + size, device=idx.device) if path == "static" else None
        pieces.append(model(idx[:, start:start + size], kv_cache=cache, input_pos=input_pos)[0])
        start += size
    return torch.cat(pieces, dim=1)


PATHS = ("full", "tokens", "chunks", "static")


# ----------------------------------------------------------------------------------------------------
# The invariants, each a function of a model that returns how far it is from holding (0 when exact)


@torch.inference_mode()
def cache_vs_full(model, batch=2, seed=0):
    """Logits fed through a growing KV cache in chunks vs one full forward; then roll back to half way,
    feed other tokens (a chunk, then one token) and compare with a full forward of that other sequence."""
    T = model.config.block_size
    idx = tokens(model, (batch, T), seed)
    cache = model.new_kv_cache(batch, T)
    worst = max_error(logits_through(model, idx, "chunks", seed, cache), model(idx)[0])

    k = T // 2
    cache.truncate(k)
    other = tokens(model, (batch, T - k), seed + 1)
    expected = model(torch.cat([idx[:, :k], other], dim=1))[0][:, k:]
    actual = torch.cat([model(other[:, :-1], kv_cache=cache)[0], model(other[:, -1:], kv_cache=cache)[0]], dim=1)
    return max(worst, max_error(actual, expected))


@torch.inference_mode()
def static_vs_growing(model, batch=2, seed=1):
    """A static cache (written at input_pos, read whole with a mask) holding large garbage where nothing
    was written yet, vs the growing cache, chunk by chunk (single tokens included)."""
    idx = tokens(model, (batch, model.config.block_size), seed)
    return max_error(logits_through(model, idx, "static", seed), logits_through(model, idx, "chunks", seed))


@torch.inference_mode()
def fast_path_vs_mask(model, batch=2, seed=2):
    """The full-sequence forward (no cache: SDPA is_causal when window == 0) vs the same tokens in one chunk
    on a static cache longer than them, where attention reads every slot through can_attend's mask."""
    T = model.config.block_size - 8  # 8 slots of garbage past the tokens: S > T, so the mask path
    idx = tokens(model, (batch, T), seed)
    static = model.new_kv_cache(batch, T + 8, static=True)
    garbage_(static.k, torch.Generator().manual_seed(seed))
    garbage_(static.v, torch.Generator().manual_seed(seed + 1))
    static.tokens.copy_(tokens(model, static.tokens.shape, seed + 2))
    return max_error(model(idx, kv_cache=static, input_pos=torch.arange(T, device=idx.device))[0], model(idx)[0])


def any_between(flags, start, stop):
    """(R, Q, K) bool: whether any of flags (R, S) is set at a position s with start <= s < stop, for every start (1, K)
    and stop (Q, 1): `any(flags[start:stop])` for each pair, the way a promise would say it in plain Python."""
    positions = torch.arange(flags.shape[-1])
    between = (start[..., None] <= positions) & (positions < stop[..., None])  # (Q, K, S)
    return (flags[:, None, None, :] & between).any(dim=-1)


def promised_mask(config, tokens, layer=0):
    """(R, n, n) bool: which of the keys at 0 .. n-1 the query at each position 0 .. n-1 is promised in layer `layer`,
    for each of the R sequences of token ids tokens (R, n), from VISIBLE_KEYS alone."""
    R, n = tokens.shape
    query, key = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = (key <= query).expand(R, n, n)
    for setting, promise in VISIBLE_KEYS.items():
        visible = promise(query, key, getattr(config, setting), visible, layer, tokens)
    return torch.broadcast_to(visible, (R, n, n))


def reached_by_a_change(config, original, changed, changed_at):
    """(T,) bool: the positions whose logits changing the token at changed_at may move, from the promises alone, layer
    by layer: a position is reached when it sees (in either sequence) a position reached before, or when the keys it
    sees differ between the two sequences (a rule of the tokens). original, changed: token ids (T,)."""
    T = len(original)
    reached = torch.arange(T) == changed_at
    for layer in range(config.n_layer):
        before, after = promised_mask(config, torch.stack([original, changed]).cpu(), layer)
        reached = reached | ((before | after) & reached).any(dim=1) | (before != after).any(dim=1)
    return reached


@torch.inference_mode()
def receptive_field(model, changed_at=10, seed=3):
    """Change the token at changed_at and see which positions' logits move. Returns (the largest change
    outside the receptive field, the change at its far edge): the field derived from VISIBLE_KEYS
    (reached_by_a_change), not from model.py."""
    T = model.config.block_size
    idx = tokens(model, (1, T), seed)
    changed = idx.clone()
    changed[0, changed_at] = (idx[0, changed_at] + 1) % model.config.vocab_size
    moved = (model(idx)[0] - model(changed)[0]).abs().amax(dim=-1)[0].cpu()  # (T,)
    reached = reached_by_a_change(model.config, idx[0], changed[0], changed_at)
    last = int(reached.nonzero().max())
    outside = moved[~reached]
    return (outside.max().item() if outside.numel() else 0.0), moved[last].item()


def receptive_field_error(model):
    """receptive_field as one number for BREAKS and INVARIANTS: a change outside the field, or 1 if the field stops short."""
    return field_as_one_number(*receptive_field(model))


def field_as_one_number(outside, edge):
    return max(outside, 1.0 if edge <= BROKEN else 0.0)


def mask_vs_promise(config, seed=0):
    """can_attend's mask vs the promise, in every layer and for two token sequences, for what each attention path asks
    it: one query at every position over a whole static cache (later slots too), and chunks over a growing cache
    (keys up to the chunk's end) and over a static one. Returns the first disagreement, in words, or None."""
    n = config.block_size
    asks, start = [(torch.tensor([q]), n) for q in range(n)], 0
    for size in chunk_sizes(n, seed):
        positions = torch.arange(start, start + size)
        asks += [(positions, start + size), (positions, n)]
        start += size
    rows = token_ids(config.vocab_size, (2, n), seed)
    for layer in range(config.n_layer):
        expected = promised_mask(config, rows, layer)  # (rows, n, n)
        for positions, n_keys in asks:
            mask = model_py.can_attend(positions[:, None], torch.arange(n_keys), config, layer, rows[:, :n_keys])
            mask = torch.broadcast_to(mask, (len(rows), 1, len(positions), n_keys))[:, 0]  # (rows, queries, keys)
            promise = expected[:, positions, :n_keys]
            if not torch.equal(mask, promise):
                row, i = (mask != promise).any(dim=2).nonzero()[0].tolist()  # the first row, then its first query
                return (f"layer {layer}, token row {row}, asked for {len(positions)} queries over {n_keys} keys: "
                        f"the query at {int(positions[i])} sees keys {mask[row, i].nonzero().flatten().tolist()}, "
                        f"promised {promise[row, i].nonzero().flatten().tolist()}")
    return None


@contextlib.contextmanager
def one_layer_per_group(model, groups):
    """model's rows in `groups` equal groups, group i run as if every block but block i added nothing to the
    residual stream (its o_proj and down_proj outputs zeroed, row by row, through forward hooks): the logits of group
    i then show what layer i's attention reads, whatever the other layers' rules, all layers in one forward."""
    hooks = []
    for layer, block in enumerate(model.layers):
        def keep_own_group(module, args, output, layer=layer):
            rows = output.shape[0] // groups  # (groups * rows, T, C): group `layer`'s rows kept, the others zeroed
            keep = (torch.arange(groups, device=output.device) == layer).repeat_interleave(rows)
            return output * keep[:, None, None]
        hooks += [linear.register_forward_hook(keep_own_group)
                  for linear in (block.self_attn.o_proj, block.mlp.down_proj)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def visible_keys_error(model, seed=4):
    """visible_keys_errors as one number: the largest move of a hidden key, or 1 if some visible key moved the logits
    less than BROKEN; 0 when the outputs keep the promise."""
    return keys_as_one_number(*visible_keys_errors(model, seed))


def keys_as_one_number(hidden_moved, visible_still):
    return max(hidden_moved, 1.0 if visible_still else 0.0)


@torch.inference_mode()
def visible_keys_errors(model, seed=4):
    """What the model does vs what its settings promise, through every path and in every layer (the others
    silenced): changing the token at key k must move the logits at query q (k != q) exactly when the promise says q
    sees k, and q sees the same keys before and after the change (a rule of the tokens may change which). Returns
    (the largest move of a hidden key, whether some visible key moved them less than BROKEN). Weights of std 0.2, not
    0.4: softer attention, so that every visible key weighs (moves >= 1e-2)."""
    soft = randomize_(GPT(model.config), seed, std=0.2).to(device_of(model))
    T, n_layer = model.config.block_size, model.config.n_layer
    idx = tokens(soft, (1, T), seed).repeat(T + 1, 1)  # row 0 as drawn, row 1 + k with the token at k changed
    keys = torch.arange(T)
    idx[keys + 1, keys] = (idx[keys + 1, keys] + 1) % model.config.vocab_size
    own = torch.eye(T, dtype=torch.bool)  # a query's own token always moves its logits: left out
    hidden_moved, visible_still = 0.0, False
    for path in PATHS:
        with one_layer_per_group(soft, n_layer):
            every_layer = logits_through(soft, idx.repeat(n_layer, 1), path, seed)  # (n_layer * (1 + T), T, vocab)
        for layer, logits in enumerate(every_layer.chunk(n_layer)):  # (1 + T, T, vocab): layer `layer` alone
            masks = promised_mask(model.config, idx.cpu(), layer)  # (1 + T, q, keys)
            before = masks[0]  # (q, k)
            same_keys = (masks[1:] == before).all(dim=2).T  # (q, k): q sees the same keys with token k changed
            promise, hidden = before & same_keys & ~own, ~before & same_keys & ~own
            scale = max(1.0, logits[0].abs().max().item())
            moved = ((logits[1:] - logits[:1]).abs().amax(dim=-1) / scale).T.cpu()  # (q, k): query q, token k changed
            hidden_moved = max(hidden_moved, moved[hidden].max().item())
            visible_still = visible_still or bool((moved[promise] <= BROKEN).any())
    return hidden_moved, visible_still


@functools.cache
def unplanted(invariant, name, device):
    """invariant of the config's model under model.py's own rule, nothing planted: computed once a session. A one-number
    form is read from the result its own test computed (the planted bugs' check that nothing fails before planting,
    ~1.7 s of the fast check otherwise)."""
    if invariant in AS_ONE_NUMBER:
        result, as_one_number = AS_ONE_NUMBER[invariant]
        return as_one_number(*unplanted(result, name, device))
    return invariant(build(name, device))


AS_ONE_NUMBER = {receptive_field_error: (receptive_field, field_as_one_number),
                 visible_keys_error: (visible_keys_errors, keys_as_one_number)}


# ----------------------------------------------------------------------------------------------------
# The configs cover every setting


def test_configs_cover_every_setting():
    """Every GPTConfig field takes two values across CONFIGS (a new field fails here until an entry sets
    it), every MLP kind appears, and multi-head, grouped-query and multi-query attention all appear."""
    configs = [config(name) for name in NAMES]
    for field in fields(GPTConfig):
        values = {getattr(c, field.name) for c in configs}
        assert len(values) >= 2, f"no entry of CONFIGS sets {field.name}: add one that does"
    missing = set(MLP_KINDS) - {c.mlp for c in configs}
    assert not missing, f"no entry of CONFIGS sets mlp={sorted(missing)[0]!r}: add one that does"
    kv = {"mha" if c.n_kv_head == c.n_head else "mqa" if c.n_kv_head == 1 else "gqa" for c in configs}
    assert kv == {"mha", "gqa", "mqa"}
    assert any(c.head_dim != c.n_embd // c.n_head for c in configs)
    assert any(0 < c.window < c.block_size // 4 for c in configs)  # a window that really cuts


# settings that leave the logits of the same weights as they are: dropout in eval mode, block_size within the context
SAME_LOGITS = ("dropout", "block_size")
# settings whose defaults need other parameters (GPT-2's 50k vocabulary, 12 layers...): the model changes by them
GEOMETRY = ("vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "head_dim", "mlp", "mlp_hidden", "qk_norm")


def test_every_setting_an_entry_turns_on_changes_its_logits():
    """Each field an entry of CONFIGS sets away from its default, on the same weights with that field back at its
    default, gives other logits: a new setting whose code runs on no path (a soft cap never applied, skips never
    added) fails here, where the cache and decoding checks, comparing the model with itself, all pass. A field whose
    default needs other parameters (other shapes, a norm fewer) changes the model by them: nothing to compare; one
    that adds parameters (a learned scalar) is compared without them."""
    checked = []
    for name in NAMES:
        model = build(name, "cpu")
        idx = token_ids(model.config.vocab_size, (2, 16), seed=1)
        with torch.no_grad():
            on = model(idx)[0]
        state = model.state_dict()
        for f in fields(GPTConfig):
            if f.name in SAME_LOGITS + GEOMETRY or getattr(model.config, f.name) == f.default:
                continue
            try:
                off_config = replace(model.config, **{f.name: f.default})
            except ValueError:  # the default does not fit the rest of this entry (a head count, a width)
                continue
            if off_config == model.config:  # a default that resolves to this value (head_dim 0: n_embd // n_head)
                continue
            off = GPT(off_config).eval()
            if any(key not in state or state[key].shape != value.shape for key, value in off.state_dict().items()):
                continue
            off.load_state_dict({key: state[key] for key in off.state_dict()})
            with torch.no_grad():
                difference = (off(idx)[0] - on).abs().max().item()
            assert difference > TOL * on.abs().max().item(), f"{name}: {f.name}={getattr(model.config, f.name)!r} " \
                f"gives the logits of {f.name}={f.default!r} (max difference {difference:.2g}): its code runs on no path"
            checked.append(f.name)
    assert {"bias", "window", "rope_base", "tie_embeddings", "norm_eps"} <= set(checked), checked


def test_every_setting_says_whether_it_changes_the_visible_keys():
    for field in fields(GPTConfig):
        assert (field.name in VISIBLE_KEYS) != (field.name in SAME_KEYS), (
            f"GPTConfig.{field.name} must be in exactly one of VISIBLE_KEYS (with its promise: which keys a query "
            f"then sees) and SAME_KEYS (it changes no query's keys) in tests/test_invariants.py")


# ----------------------------------------------------------------------------------------------------
# Each query sees the keys its settings promise


@pytest.mark.parametrize("name", NAMES)
def test_the_mask_rule_gives_each_query_its_promised_keys(name):
    base = config(name)
    for checked in [base] + [replace(base, window=w) for w in (1, 2, 7, base.block_size - 1, base.block_size + 3)]:
        disagreement = mask_vs_promise(checked)
        assert disagreement is None, f"{name}, window {checked.window}: {disagreement}"


@pytest.mark.parametrize("name", NAMES)
def test_each_query_is_moved_by_its_promised_keys_only(name, device):
    hidden_moved, visible_still = unplanted(visible_keys_errors, name, device)
    assert hidden_moved < TOL, (f"{name}: a query's output moved by {hidden_moved:.3g} when keys outside its promised "
                                "ones changed (model.py's attention reads keys that can_attend and VISIBLE_KEYS do not "
                                "promise)")
    assert not visible_still, (f"{name}: a key a query is promised to see changed and its output did not move "
                               "(model.py's attention hides keys that can_attend and VISIBLE_KEYS promise, or a term "
                               "of the scores drowns them)")


# ----------------------------------------------------------------------------------------------------
# a, b, f: every attention path gives the same logits


@pytest.mark.parametrize("name", NAMES)
def test_cache_in_chunks_equals_full_forward(name, device):
    error = unplanted(cache_vs_full, name, device)
    assert error < TOL, f"{name}: the KV cache fed in chunks differs from the full forward by {error:.3g} (max |logit|)"


@pytest.mark.parametrize("name", NAMES)
def test_static_cache_equals_growing_cache(name, device):
    error = unplanted(static_vs_growing, name, device)
    assert error < TOL, f"{name}: the static (compiled) cache differs from the growing one by {error:.3g} (max |logit|)"


@pytest.mark.parametrize("name", NAMES)
def test_full_forward_fast_path_equals_the_mask_rule(name, monkeypatch, device):
    model, calls = build(name, device), []
    original = model_py.can_attend

    def counting(query_pos, key_pos, *settings):
        calls.append(query_pos.numel())
        return original(query_pos, key_pos, *settings)

    monkeypatch.setattr(model_py, "can_attend", counting)
    error = fast_path_vs_mask(model)
    assert error < TOL, (f"{name}: the full forward's fast path (SDPA's is_causal) differs from the mask rule's path by "
                         f"{error:.3g} (max |logit|): an edit of can_attend must change the fast path's condition too")
    assert any(n > 1 for n in calls)  # the static side did go through the mask rule, for a whole chunk


@pytest.mark.parametrize("name", NAMES)
def test_a_token_changes_exactly_the_logits_of_its_receptive_field(name, device):
    outside, edge = unplanted(receptive_field, name, device)
    assert outside < TOL, (f"{name}: changing one token moved logits outside its receptive field by {outside:.3g} "
                           "(before it: not causal; or past the window's reach)")
    assert edge > BROKEN, (f"{name}: the logits at the window's reach moved only {edge:.3g}: the window reaches less "
                           "far than promised")


# ----------------------------------------------------------------------------------------------------
# c, d: decoding


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generate_equals_naive_loop(name, device, monkeypatch):
    """generate's text is the naive loop's, which recomputes the whole sequence at every step and takes its last
    logits' argmax: the full forward is causal (test_a_token_changes_exactly_the_logits_of_its_receptive_field), so
    one full forward of generate's text gives every step's logits, and each token must be the argmax of its step's."""
    from gpt import sampling
    model = build(name, device)
    prompt = tokens(model, (2, 6), seed=4)
    n = model.config.block_size - 6
    chosen_from = recording(monkeypatch, sampling, "sample_next_token")
    out = model.generate(prompt, n, temperature=0.0)
    with torch.inference_mode():
        naive_logits = model(out)[0][:, 5:-1]  # (2, n, V): step i's, of the text before token 6 + i
    assert torch.equal(out[:, :6], prompt) and torch.equal(out[:, 6:], naive_logits.argmax(dim=-1))
    assert len(out[:, 6:].unique()) > 3  # varied output: positions and context matter to the check
    # and the logits it chose from, a full forward's: a monotone edit (a soft cap) that generate skips changes no token
    assert_same_logits(torch.stack(chosen_from, 1), naive_logits, "generate")


class NoTextTokenizer:
    """What engine.Samples needs from a tokenizer: a vocabulary size, no end-of-text, no text."""

    def __init__(self, vocab_size):
        self.vocab_size, self.eot = vocab_size, None

    def decoder(self):
        return lambda token: ""


class RecordingSamples(engine.Samples):
    """Samples that also keep each sample's token ids."""

    def __init__(self, n, vocab_size):
        super().__init__(n, NoTextTokenizer(vocab_size), [], stream=False)
        self.tokens = [[] for _ in range(n)]

    def add(self, sample, token):
        self.tokens[sample].append(token)
        return super().add(sample, token)


def greedy_settings(max_new_tokens, draft_k=3):
    return dict(num_samples=1, max_new_tokens=max_new_tokens, temperature=0.0, top_k=None, top_p=None,
                no_kv_cache=False, compile=False, draft_k=draft_k)


@torch.inference_mode()
def sliding_window_logits(model, prompt, out):
    """Each step's logits (len(out), V) of the naive greedy loop that recomputes its whole context at every step,
    with the engine's documented window policy (when the context would pass block_size, it restarts from its last
    block_size // 2 tokens), had it chosen the tokens out: one full forward per window, causal as the naive loop's
    shorter ones (test_a_token_changes_exactly_the_logits_of_its_receptive_field)."""
    text, block, start, starts = list(prompt) + list(out), model.config.block_size, 0, []
    for end in range(len(prompt), len(text)):  # step end - len(prompt) reads text[start:end]
        if end - start > block:
            start = end - block // 2
        starts.append(start)
    logits = []
    for start in sorted(set(starts)):
        ends = [len(prompt) + step for step, s in enumerate(starts) if s == start]
        window = model(torch.tensor([text[start:ends[-1]]], device=device_of(model)))[0][0]  # (T, V)
        logits += [window[end - 1 - start] for end in ends]
    return torch.stack(logits)


def noised(model, seed, scale=0.03):
    """A draft: the model's weights plus noise, so that it agrees with the model often, not always (measured over
    CONFIGS: 30-50% of its proposals accepted; at scale 0.15, 2-10%, and twice the verification steps)."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator).to(param.device))
    return draft


@pytest.mark.parametrize("name", NAMES)
def test_speculative_greedy_equals_plain_greedy(name, device, monkeypatch):
    model = build(name, device)
    vocab, prompt = model.config.vocab_size, tokens(model, (5,), seed=5).tolist()
    n = model.config.block_size + 5  # past block_size: the context window slides once

    # plain decoding and prompt lookup, by their tokens and by the logits they chose them from (see generate's test):
    # plain decoding's text is the naive loop's, each token the argmax of its step's logits as the naive loop has them
    plain, decoded = RecordingSamples(1, vocab), recording(monkeypatch, engine, "next_tokens")
    engine.decode_batch(model, prompt, greedy_settings(n), plain, torch.Generator(device).manual_seed(0))
    expected_logits = sliding_window_logits(model, prompt, plain.tokens[0])  # (n, V)
    expected = expected_logits.argmax(dim=-1).tolist()
    assert plain.tokens[0] == expected
    assert len(set(expected)) > 3, (f"{name}: greedy decoding gives only {sorted(set(expected))}: too few tokens for "
                                    "agreeing to mean something; change this CONFIGS entry (its shape), not model.py")
    assert_same_logits(torch.cat(decoded), expected_logits, "decode_batch")
    lookup, checked = RecordingSamples(1, vocab), recording(monkeypatch, speculative, "next_tokens")
    speculative.decode_lookup(model, prompt, greedy_settings(n), lookup, torch.Generator(device))
    assert lookup.tokens[0] == expected
    assert_same_logits(torch.cat(checked)[:n], expected_logits, "prompt lookup's checks")

    # Both ways a speculative step ends: the model as its own draft is always right (every proposal accepted and
    # one more token drawn), a noised copy is sometimes wrong (a rejected proposal replaced).
    for draft, all_accepted in ((model, True), (noised(model, seed=6), False)):
        spec = RecordingSamples(1, vocab)
        accepted, proposed = speculative.decode_speculative(model, draft, prompt, greedy_settings(n), spec,
                                                       torch.Generator(device).manual_seed(0))
        assert spec.tokens[0] == expected
        assert (accepted == proposed) == all_accepted and proposed > 0


# ----------------------------------------------------------------------------------------------------
# Every path to logits is model.logits: an edit there (Gemma 2's soft cap) reaches generate, sample.py and eval.py

CAP = 2.0  # far inside the random models' logits (up to ~10): a path that skips the cap shows at once


def assert_capped_and_equal(actual, expected, path):
    """A path's logits went through the capped model.logits (none past CAP) and are the full forward's."""
    assert actual.abs().max() <= CAP * (1 + 1e-6), f"{path}: logits past the cap: computed without model.logits"
    assert_same_logits(actual, expected, path)


# Logits made from the head outside model.logits: calling it (or its forward), or multiplying by its weight
HEAD_PRODUCT = re.compile(r"lm_head\s*(\(|\.forward\b)|lm_head\.weight\s*\.\s*(T|mT|t\(\))|@\s*[\w.]*lm_head|"
                          r"linear\([^)]*lm_head")


def test_no_code_outside_model_py_calls_the_head():
    """model.logits is the one way from hidden states to logits: a product with lm_head anywhere else would skip an
    edit of it (reading lm_head.weight, as export and experiments/kv_cache.py do, is not one)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    callers = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if not name.startswith(".") and name != "tests"]  # .venv, .git
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and path != os.path.join(root, "model.py"):
                with open(path, encoding="utf-8") as f:
                    callers += [f"{path}:{n}" for n, line in enumerate(f, 1) if HEAD_PRODUCT.search(line)]
    assert not callers, f"logits computed outside model.logits: {callers}"


@pytest.mark.parametrize("scheme", ["int8", "w8a8"])
@torch.inference_mode()
def test_a_quantized_head_keeps_what_model_logits_does_around_it(scheme, monkeypatch):
    """--quantize replaces every nn.Linear, the output head too; model.logits, where an edit around the head goes
    (a soft cap), still runs on the quantized head's output: capped, and the float model's logits within int8's
    rounding (test_quantize.py measures that on a trained model)."""
    from gpt.quantize import quantize
    original = GPT.logits
    monkeypatch.setattr(GPT, "logits", lambda self, hidden: CAP * torch.tanh(original(self, hidden) / CAP))
    model = build("gelu_mha_untied", "cpu")  # an untied head: a linear of its own
    idx = tokens(model, (2, 8), seed=3)
    expected = model(idx)[0]
    actual = quantize(model, scheme)(idx)[0]
    assert actual.abs().max() <= CAP * (1 + 1e-6), "the quantized head's logits past the cap: model.logits skipped"
    assert (actual - expected).abs().max() < 0.25 * CAP  # measured 0.20 int8, 0.28 w8a8 (random weights)


@pytest.mark.parametrize("name", ["swiglu_gqa_qknorm_tied", "window_mqa_relu2_bias", "gelu_mha_untied"])
@torch.inference_mode()
def test_every_path_gives_the_logits_of_model_logits(name, monkeypatch, device):
    """With model.logits edited (a soft cap), the logits that generate, the engine's decoding (a growing cache, the
    static cache of compiled and CUDA-graph steps, batched samples, the sliding window), prompt lookup's speculative
    checks and eval.py's scorers use are each capped and equal to a full forward's: not only their greedy tokens,
    which a monotone edit of the logits never changes."""
    from gpt import sampling
    original = GPT.logits
    monkeypatch.setattr(GPT, "logits", lambda self, hidden: CAP * torch.tanh(original(self, hidden) / CAP))
    model = build(name, device)
    vocab, block = model.config.vocab_size, model.config.block_size

    generated = recording(monkeypatch, sampling, "sample_next_token")
    prompt = tokens(model, (2, 6), seed=7)
    out = model.generate(prompt, 10, temperature=0.0)
    assert_capped_and_equal(torch.stack(generated, 1), model(out)[0][:, 5:15], "generate")

    prompt, n = tokens(model, (5,), seed=8).tolist(), block + 5  # past block_size: the window slides
    expected = None  # (n, V): each step's logits, as the naive loop has them for the text the first path chose
    for path, settings in (("decode_batch", {}), ("decode_batch, static cache", dict(cuda_graph=True))):
        decoded, samples = recording(monkeypatch, engine, "next_tokens"), RecordingSamples(2, vocab)
        engine.decode_batch(model, prompt, dict(greedy_settings(n), num_samples=2, **settings), samples,
                            torch.Generator(device).manual_seed(0))
        if expected is None:
            expected = sliding_window_logits(model, prompt, samples.tokens[0])
        assert samples.tokens == [expected.argmax(dim=-1).tolist()] * 2, path  # greedy: the naive loop's text
        for row in range(2):
            assert_capped_and_equal(torch.stack([logits[row] for logits in decoded]), expected, f"{path}, sample {row}")
    checked = recording(monkeypatch, speculative, "next_tokens")
    speculative.decode_lookup(model, prompt, greedy_settings(n), RecordingSamples(1, vocab), torch.Generator(device))
    assert_capped_and_equal(torch.cat(checked)[:n], expected, "prompt lookup's checks")

    assert_scorers_follow_the_full_forward(model)  # eval.py's: a cap skipped changes every log-probability


def assert_scorers_follow_the_full_forward(model):
    """eval.py's scorers (gpt/scoring.py: a sliding window of token log-probabilities, continuations after one cached
    context, and (context, continuation) pairs as rows of a padded batch) give a full forward's log-probabilities."""
    from gpt import scoring
    block = model.config.block_size
    text = tokens(model, (block + 9,), seed=9)  # longer than a window: token_logprobs slides
    logprobs = torch.log_softmax(model(text[None, :block])[0][0].float(), -1)  # the first window's (block, V)
    expected = logprobs[:-1].gather(1, text[1:block, None])[:, 0].cpu()  # log p(text[i + 1] | text[:i + 1])
    assert (scoring.token_logprobs(model, text)[:block - 1] - expected).abs().max() < 1e-4, "token_logprobs"

    def forward_logprob(context, continuation):  # log p(continuation | context), the sequence cut to block + 1
        sequence = (context + continuation)[-(block + 1):]
        logprobs = torch.log_softmax(model(torch.tensor([sequence[:-1]], device=text.device))[0][0].float(), -1)
        start = len(sequence) - 1 - len(continuation)
        return sum(logprobs[start + i, token].item() for i, token in enumerate(continuation))

    context, continuations = text[:6].tolist(), [text[6:9].tolist(), text[6:12].tolist()]
    for (actual, _), continuation in zip(scoring.continuation_logprobs(model, context, continuations), continuations):
        assert abs(actual - forward_logprob(context, continuation)) < 1e-4, "continuation_logprobs"
    pairs = [(context, continuations[0]), (text[:block + 4].tolist(), text[block + 4:].tolist())]  # one cut short
    for (actual, _), pair in zip(scoring.sequence_logprobs(model, pairs), pairs):
        assert abs(actual - forward_logprob(*pair)) < 1e-4, "sequence_logprobs"


@pytest.mark.parametrize("name", NAMES)
@torch.inference_mode()
def test_the_scorers_give_a_full_forwards_log_probabilities(name, device):
    assert_scorers_follow_the_full_forward(build(name, device))


# ----------------------------------------------------------------------------------------------------
# e: export to Hugging Face and back


@pytest.mark.parametrize("name", NAMES)
def test_export_round_trip_is_exact_or_refused(name, tmp_path, monkeypatch):
    """Whatever the model (an edited model.py included): export_hf either refuses it, leaving nothing behind, or
    writes a folder that loads back bit for bit with the same config. A setting exported as if it were absent (a
    window, a GELU MLP) would come back as another config. That Llama/Qwen3-shaped models do export, and match
    transformers, is tests/test_export.py's: here export_hf's comparison with transformers is left out (importing
    transformers and building its models was a third of this file's time), which changes no verdict: a model it
    would refuse round-trips here instead, and either passes."""
    pytest.importorskip("safetensors")
    monkeypatch.setattr(hf, "check_logits", lambda folder, idx, ours: False)  # as where transformers is not installed
    model, folder = build(name, "cpu"), str(tmp_path / "hf")  # export.py exports a CPU float32 model only
    try:
        hf.export_hf(model, None, folder)
    except UserError:
        assert os.listdir(tmp_path) == []  # no folder, no temp folder left behind
        return
    loaded, meta = load_hf(folder)
    assert meta is None
    assert asdict(loaded.config) == asdict(replace(model.config, dropout=0.0))  # dropout: a training switch
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)


# ----------------------------------------------------------------------------------------------------
# A rule may depend on the layer and on the tokens: its promise is checked on every layer and for the tokens at hand.
# Stood in for here by patched rules and promises (as an edit of model.py and of VISIBLE_KEYS would be) on a model
# whose window covers the whole sequence, so that every path builds the mask from the rule.

SEPARATOR = 1  # one of token_ids' frequent small ids


def window_in_even_layers(query_pos, key_pos, config, layer, tokens):  # per-layer windows: odd layers see it all
    window = config.window if layer % 2 == 0 else 0
    return ORIGINAL_CAN_ATTEND(query_pos, key_pos, replace(config, window=window), layer, tokens)


def window_in_even_layers_promised(query, key, window, visible, layer, tokens):
    return visible & ((window == 0) | (layer % 2 == 1) | (key > query - window))


def documents(query_pos, key_pos, config, layer, tokens):
    """Document masking: a query sees no key before a SEPARATOR at or before it (a separator ends its document)."""
    separators = (tokens == SEPARATOR).long()
    before = separators.cumsum(-1) - separators  # (B, S): the separators before each position
    same_document = before[:, query_pos] == before[:, None, key_pos]  # (B, T, S)
    return ORIGINAL_CAN_ATTEND(query_pos, key_pos, config, layer, tokens) & same_document[:, None]  # (B, 1, T, S)


def documents_promised(query, key, window, visible, layer, tokens):
    not_after_a_separator = ~any_between(tokens == SEPARATOR, key, query)
    return VISIBLE_KEYS_WINDOW(query, key, window, visible, layer, tokens) & not_after_a_separator


def separator_in_the_next_document(query_pos, key_pos, config, layer, tokens):
    """Off by one at a document's edge: the separator starts the next document instead of ending its own."""
    separators = (tokens == SEPARATOR).long().cumsum(-1)
    same_document = separators[:, query_pos] == separators[:, None, key_pos]
    return ORIGINAL_CAN_ATTEND(query_pos, key_pos, config, layer, tokens) & same_document[:, None]


def documents_forgotten_when_decoding(query_pos, key_pos, config, layer, tokens):
    """The token rule on every path but single-token decoding."""
    rule = ORIGINAL_CAN_ATTEND if query_pos.numel() == 1 else documents
    return rule(query_pos, key_pos, config, layer, tokens)


VISIBLE_KEYS_WINDOW = VISIBLE_KEYS["window"]
EDITS = {  # an edit of the rule, its promise: every invariant holds
    "per_layer_windows": (window_in_even_layers, window_in_even_layers_promised, 5),
    "documents": (documents, documents_promised, 48),  # a window as long as the sequence: the rule alone
}


INVARIANTS = dict(mask_vs_promise=lambda model: mask_vs_promise(model.config), cache_vs_full=cache_vs_full,
                  static_vs_growing=static_vs_growing, fast_path_vs_mask=fast_path_vs_mask,
                  receptive_field=receptive_field_error, visible_keys=visible_keys_error)


def every_invariant(model):
    return {name: invariant(model) for name, invariant in INVARIANTS.items()}


@pytest.mark.parametrize("edit", EDITS)
def test_a_rule_of_the_layer_or_the_tokens_keeps_its_promise(edit, monkeypatch):
    rule, promise, window = EDITS[edit]
    monkeypatch.setattr(model_py, "can_attend", rule)
    monkeypatch.setitem(VISIBLE_KEYS, "window", promise)
    model = randomize_(GPT(replace(config("window_gqa"), window=window)), seed=0)
    results = every_invariant(model)
    assert results.pop("mask_vs_promise") is None
    assert all(error < TOL for error in results.values()), (
        f"{edit}: {results}. This test puts its own rule in can_attend and expects every layer to reach it; where "
        "model.py's attention() now lets layers skip the mask (its plain_causal condition), make the rule here hide "
        "no more keys there than the plain causal rule")
    if edit == "documents":  # the tokens do hold separators, and they cut: the plain causal rule breaks the promise
        monkeypatch.setattr(model_py, "can_attend", ORIGINAL_CAN_ATTEND)
        assert mask_vs_promise(model.config) is not None


@pytest.mark.parametrize("bug, caught_by", [(separator_in_the_next_document, "mask_vs_promise"),
                                            (separator_in_the_next_document, "visible_keys"),
                                            (documents_forgotten_when_decoding, "cache_vs_full")])
def test_a_planted_bug_in_a_rule_of_the_tokens_is_caught(bug, caught_by, monkeypatch):
    monkeypatch.setitem(VISIBLE_KEYS, "window", documents_promised)
    monkeypatch.setattr(model_py, "can_attend", bug)
    model = randomize_(GPT(replace(config("window_gqa"), window=48)), seed=0)
    result = INVARIANTS[caught_by](model)  # the one invariant named: the others hold or not, whatever the bug
    assert (result is not None) if caught_by == "mask_vs_promise" else result > BROKEN, result


# ----------------------------------------------------------------------------------------------------
# The suite is live: a planted bug in the mask rule is caught


ORIGINAL_CAN_ATTEND = model_py.can_attend  # each planted bug passes on whatever else the rule is given (*rest)


def hide_previous_key_when_decoding(query_pos, key_pos, config, *rest):
    """Off by one for a single query only (token-by-token decoding): it loses the key just before it."""
    visible = ORIGINAL_CAN_ATTEND(query_pos, key_pos, config, *rest)
    return visible & (key_pos != query_pos - 1) if query_pos.numel() == 1 else visible


def see_next_key_when_decoding(query_pos, key_pos, config, *rest):
    """Off by one for a single query only: it also sees the slot after it (only a static cache has one)."""
    visible = ORIGINAL_CAN_ATTEND(query_pos, key_pos, config, *rest)
    return visible | (key_pos == query_pos + 1) if query_pos.numel() == 1 else visible


def hide_first_key_in_chunks(query_pos, key_pos, config, *rest):
    """Wrong for several queries only: all but the first lose key 0; is_causal does not ask can_attend."""
    visible = ORIGINAL_CAN_ATTEND(query_pos, key_pos, config, *rest)
    return visible & ((key_pos != 0) | (query_pos == 0)) if query_pos.numel() > 1 else visible


def window_one_too_wide(query_pos, key_pos, config, *rest):
    """The same wrong window on every path: the cache invariants cannot see it, the receptive field can."""
    wider = replace(config, window=config.window + 1) if config.window else config
    return ORIGINAL_CAN_ATTEND(query_pos, key_pos, wider, *rest)


def window_forgotten(query_pos, key_pos, config, *rest):
    """A setting the rule ignores on every path alike (as a kept-first-tokens rule that does nothing would be): the
    paths agree with each other, and only what the setting promises can tell."""
    return ORIGINAL_CAN_ATTEND(query_pos, key_pos, replace(config, window=0), *rest)


def window_forgotten_in_the_last_layer(query_pos, key_pos, config, layer, tokens):
    """One layer's rule wrong, on every path alike: only a check of every layer's promise can tell."""
    last = layer == config.n_layer - 1
    return ORIGINAL_CAN_ATTEND(query_pos, key_pos, replace(config, window=0) if last else config, layer, tokens)


BREAKS = {  # a planted bug -> the invariants that must catch it (one of them, for some config)
    "hide_previous_key_when_decoding": (hide_previous_key_when_decoding, [cache_vs_full]),
    "see_next_key_when_decoding": (see_next_key_when_decoding, [static_vs_growing]),
    "hide_first_key_in_chunks": (hide_first_key_in_chunks, [fast_path_vs_mask]),
    # the receptive field sees it unless some layer sees everything (per-layer windows); each layer's keys always
    "window_one_too_wide": (window_one_too_wide, [receptive_field_error, visible_keys_error]),
    "window_forgotten": (window_forgotten, [visible_keys_error]),
    "window_forgotten_in_the_last_layer": (window_forgotten_in_the_last_layer, [visible_keys_error]),
}
HELPERS = {  # what each invariant derives its expectation from, for the self-test's message
    cache_vs_full: "cache_vs_full (a full forward)", static_vs_growing: "static_vs_growing (the growing cache)",
    fast_path_vs_mask: "fast_path_vs_mask (the mask path)",
    receptive_field_error: "receptive_field (reached_by_a_change, from VISIBLE_KEYS)",
    visible_keys_error: "visible_keys_error (one_layer_per_group and promised_mask, from VISIBLE_KEYS)",
}


# The configs that set a VISIBLE_KEYS setting first, the smaller first: a bug planted in the mask rule shows there most
# often, and the search below stops at the first config that catches it (whatever the order, the verdict is the same)
MASK_SETTINGS_FIRST = sorted(NAMES, key=lambda name: (not CONFIGS[name].keys() & VISIBLE_KEYS.keys(),
                                                      config(name).n_layer * config(name).block_size))


@pytest.mark.parametrize("bug", BREAKS)
def test_a_planted_mask_bug_is_caught(bug, monkeypatch, device):
    broken, invariants = BREAKS[bug]
    for invariant in invariants:
        failing = [name for name in NAMES if unplanted(invariant, name, device) >= TOL]
        assert not failing, (f"model.py as it is fails {invariant.__name__} on {', '.join(failing)} before any bug is "
                             f"planted, so this self-test cannot plant one. Either model.py breaks that invariant (its "
                             f"own test fails too: fix model.py), or the expectation is what is wrong: the helper "
                             f"{HELPERS[invariant]} in tests/test_invariants.py, or your setting's promise in "
                             f"VISIBLE_KEYS, does not describe the rule you meant")
    monkeypatch.setattr(model_py, "can_attend", broken)  # attention looks it up at call time
    caught = any(invariant(build(name, device)) > BROKEN for name in MASK_SETTINGS_FIRST for invariant in invariants)
    assert caught, f"{bug} planted: no config's {' or '.join(i.__name__ for i in invariants)} moved past {BROKEN}"
