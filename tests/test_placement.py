"""Placement: every tensor the code makes goes on the model's device, proven with no GPU on the meta device.

torch.device("meta") exists in every build of torch: its tensors have shapes and dtypes but no data, and it
stands in here for any accelerator (CUDA, MPS, ...). Each test runs the real code on meta inside OnMeta, which
fails the test when a tensor is made anywhere else, an intermediate one too, not only what the code returns: on a
GPU such a tensor is a crash ("expected all tensors to be on the same device") or a silent copy every step.
A meta tensor has no values: where the code asks for one (.item(), int(), bool(), .tolist(), .cpu()), OnMeta
answers a made-up one, so the code runs on to its end. These tests check where tensors go, never what they hold.

Not covered: torch.Generator cannot be made on meta ("META device type not an accelerator"), and meta kernels
ignore the generator they are given, so a generator on the wrong device (sample.py makes one on the model's
device) is not caught here; the tests pass generator=None. Nor are branches taken only on CUDA (the loader's
pinned-memory copy, decode_batch's CUDA graphs), nor torch.compile itself: the compiled decode step runs eagerly.
"""

import types

import numpy as np
import pytest
import torch
import torch.fx.experimental._config as fx_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gpt import engine, scoring, speculative
from gpt.prepare import write_shard
from gpt.shards import ShardLoader
from gpt.sampling import greedy, sample_next_token, sampling_probs
from model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

META = torch.device("meta")
VALUES = (torch.ops.aten._local_scalar_dense, torch.ops.aten.item, torch.ops.aten.is_nonzero)  # .item(), int(), bool()
MOVES = (torch.ops.aten._to_copy, torch.ops.aten.to, torch.ops.aten.copy_)  # x.to(device), x.cpu(), dst[...] = src


class OnMeta(TorchDispatchMode):
    """Runs every aten op as usual and, on leaving the block, fails if one of them put a tensor off meta:
    - an op that makes a tensor from nothing (zeros, arange, full, rand, ...) made it on another device, or
    - an op read a tensor on another device together with meta ones (a move between them is not counted).
    Host work on Python values is allowed: torch.tensor(list) is made on the CPU, and must be moved to meta
    before it meets a meta tensor. Where code asks for the value of a meta tensor (.item(), int(), bool(), or
    .tolist() and .cpu(), which copy it to the CPU), the answer is `value`: one number, or a CPU tensor of it.
    """

    def __init__(self, value=0):
        super().__init__()
        self.value, self.n_ops, self.misplaced = value, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.n_ops += 1
        devices = {t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        if devices == {META} and func.overloadpacket in VALUES:
            return self.value
        if devices == {META} and func.overloadpacket in MOVES[:2]:  # to a device given by keyword or position
            to = kwargs.get("device") or next((a for a in args[1:] if isinstance(a, torch.device)), META)
            if to != META:
                dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), args[0].dtype)
                return torch.full(args[0].shape, self.value, dtype=dtype, device=to)
        if len(devices) > 1 and func.overloadpacket not in MOVES:
            self.misplaced.append(f"{func} read tensors on {sorted(map(str, devices))}")
        out = func(*args, **kwargs)
        made = {t.device for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
        if not devices and made - {META}:
            self.misplaced.append(f"{func} made a tensor on {sorted(map(str, made))}")
        return out

    def __exit__(self, exc_type, exc, tb):
        super().__exit__(exc_type, exc, tb)
        if exc_type is None:
            assert self.n_ops > 0, "no tensor op ran on meta"
            assert not self.misplaced, "tensors off the meta device:\n" + "\n".join(self.misplaced)


def assert_on_meta(*tensors):
    for t in tensors:
        assert t.device == META, f"a tensor of shape {tuple(t.shape)} is on {t.device}"


def tiny_gpt(**changes):
    config = dict(vocab_size=16, block_size=16, n_layer=2, n_head=4, n_kv_head=4, n_embd=16)
    return GPT(GPTConfig(**dict(config, **changes))).to(META).eval()


def meta_tokens(B, T):
    return torch.zeros(B, T, dtype=torch.long, device=META)


# ----------------------------------------------------------------------------------------------------
# The loader


def test_loader_batches_on_the_device(tmp_path):
    """The batch goes to any non-CPU device, not only CUDA (training on MPS crashed at iteration 0)."""
    write_shard(tmp_path / "toy_train_000000.bin", np.arange(100))
    x, y = ShardLoader(tmp_path, "train", batch_size=2, block_size=8, device="meta").next_batch()
    assert_on_meta(x, y)
    assert x.shape == y.shape == (2, 8) and x.dtype == y.dtype == torch.int64


# ----------------------------------------------------------------------------------------------------
# The model: the three attention paths, the masks, RoPE tables and KV cache


MODELS = {"mha": dict(n_kv_head=4), "gqa": dict(n_kv_head=2, mlp="gelu", bias=True, tie_embeddings=False),
          "mqa_window": dict(n_kv_head=1, window=3, mlp="relu2", qk_norm=False)}


@pytest.mark.parametrize("kind", MODELS)
def test_model_on_meta(kind):
    """A full sequence with a loss (plain, chunked, and its backward pass); a prefix into a KV cache, one token
    after it and a chunk after it (the mask path); one token into a static cache (indexed by layer_ids)."""
    model = tiny_gpt(**MODELS[kind])
    idx = meta_tokens(2, 6)
    with OnMeta():
        logits, loss = model(idx, targets=idx)
        loss.backward()
        _, chunked_loss = model(idx, targets=idx, loss_chunk=5)
        cache = model.new_kv_cache(2, 12)
        model(idx[:, :5], kv_cache=cache)
        one, _ = model(idx[:, :1], kv_cache=cache)
        chunk, _ = model(idx[:, :3], kv_cache=cache)
        positions = model.positions(idx[:, :2], cache, None)
        engine.select_rows(cache, [1, 0])
        static = model.new_kv_cache(2, 12, static=True)
        static_one, _ = model(idx[:, :1], kv_cache=static, input_pos=torch.tensor([4], device=META))
    assert cache.pos == 9
    assert logits.shape == (2, 6, 16) and one.shape == (2, 1, 16) and chunk.shape == (2, 3, 16)
    assert_on_meta(logits, loss, chunked_loss, one, chunk, static_one, *(p.grad for p in model.parameters()),
                   positions.ids, positions.cos, positions.sin, cache.k, cache.v, cache.layer_ids,
                   static.k, static.v, static.layer_ids)


# ----------------------------------------------------------------------------------------------------
# Choosing the next token


def test_sampling_on_meta():
    """greedy, sampling_probs and sample_next_token (temperature 0, and with top_k and top_p), and GPT.generate."""
    logits, model = torch.zeros(3, 16, device=META), tiny_gpt(n_kv_head=2)
    with OnMeta():
        picks = [greedy(logits), sample_next_token(logits, 0), sample_next_token(logits, 0.8, 5, 0.9)]
        probs = [sampling_probs(logits, 0), sampling_probs(logits, 0.8, 5, 0.9), sampling_probs(logits, 1.0)]
        generated = [model.generate(meta_tokens(2, 3), 4, temperature) for temperature in (0, 0.8)]
    assert all(p.shape == (3, 1) for p in picks) and all(p.shape == (3, 16) for p in probs)
    assert all(g.shape == (2, 7) for g in generated)
    assert_on_meta(*picks, *probs, *generated)


# ----------------------------------------------------------------------------------------------------
# engine.py: decoding, speculative decoding, scoring


TOKENIZER_VOCAB = 12  # smaller than the model's 16: the padding tokens are cut off the logits


class Record:
    """What decode_batch and decode_speculative need of engine.Samples: sample i ends after ends[i] tokens."""

    def __init__(self, ends):
        self.tokenizer = types.SimpleNamespace(vocab_size=TOKENIZER_VOCAB)
        self.ends, self.tokens, self.stream = ends, [[] for _ in ends], False

    def add(self, sample, token):
        self.tokens[sample].append(token)
        return len(self.tokens[sample]) == self.ends[sample]


def settings(**changes):
    return dict(dict(num_samples=3, max_new_tokens=14, temperature=0.8, top_k=5, top_p=0.9, no_kv_cache=False,
                     compile=False, draft_k=3), **changes)


@pytest.mark.parametrize("static", [False, True])
def test_prefill_on_meta(static):
    model = tiny_gpt(n_kv_head=2)
    with OnMeta():
        cache, last = engine.prefill(model, meta_tokens(1, 5), 10, static=static)
    assert cache.pos == 4 and last.shape == (1, 1)
    assert_on_meta(last, cache.k, cache.v, cache.layer_ids)


@pytest.mark.parametrize("mode", ["kv_cache", "no_kv_cache", "compile"])
def test_decode_on_meta(mode, monkeypatch):
    """6 prompt tokens + 14 new ones pass block_size 16, so the window slides; sample 1 ends after 2 tokens and
    leaves the batch. compile: the static-cache step, run eagerly (torch.compile is not the subject here)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    model, record = tiny_gpt(n_kv_head=2, window=5), Record([14, 2, 14])
    with OnMeta():
        engine.decode_batch(model, [1, 2, 3, 4, 5, 6], settings(no_kv_cache=mode == "no_kv_cache",
                                                                compile=mode == "compile"), record, None)
    assert record.tokens == [[0] * 14, [0] * 2, [0] * 14]  # every step ran (0: OnMeta's stand-in token)


@pytest.mark.parametrize("value", [0, 1], ids=["all_accepted", "first_rejected"])
def test_speculative_on_meta(value):
    """value answers every `if` on a tensor: 0 accepts every draft token, 1 rejects the first (the residual
    distribution). 6 + 14 tokens pass block_size 16 (the window slides) and the last step has no room to propose."""
    target, draft = tiny_gpt(n_kv_head=2), tiny_gpt(n_layer=1, n_head=2, n_kv_head=1)
    record = Record([14, 14])
    with OnMeta(value):
        accepted, proposed = speculative.decode_speculative(target, draft, [1, 2, 3, 4, 5, 6], settings(num_samples=2),
                                                       record, None)
    assert record.tokens == [[value] * 14] * 2 and proposed > 0 and accepted == (proposed if value == 0 else 0)


def test_scoring_on_meta():
    """token_predictions over several windows in batches; continuation_logprobs (a shared context in a KV cache);
    sequence_logprobs (a padded batch, one sequence longer than block_size + 1); and their shared scores."""
    model = tiny_gpt(n_kv_head=2)
    with OnMeta(), fx_config.patch(meta_nonzero_assume_all_nonzero=True):  # meta x[mask]: all of x
        logprobs, top1 = scoring.token_predictions(model, [i % 16 for i in range(40)], stride=8, batch_size=2)
        continuations = scoring.continuation_logprobs(model, [1, 2, 3, 4], [[5], [6, 7, 8], [9, 10]])
        sequences = scoring.sequence_logprobs(model, [([1, 2, 3], [4, 5]), (list(range(16)), [1, 2, 3])])
    assert logprobs.shape == top1.shape == (39,) and logprobs.device == top1.device == torch.device("cpu")
    assert len(continuations) == 3 and len(sequences) == 2
