"""Grouped-query attention never falls back to SDPA's math kernel on CUDA, and the CPU is untouched.

F.scaled_dot_product_attention(..., enable_gqa=True) with fewer kv heads than query heads runs fused only where a
fused kernel accepts GQA; elsewhere torch runs its math kernel, which holds all (B, nh, T, S) scores. model.attention
asks sdpa.sdpa_fuses_gqa and, where it says no, repeats k and v to n_head heads so that a fused kernel takes the call.

The tables below are torch 2.13's kernel choice, read from aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
(select_sdp_backend, can_use_flash_attention, can_use_mem_efficient_attention, can_use_cudnn_attention) and
sdp_utils_cpp.h (check_for_attn_mask, check_batch_size_and_num_heads_dense), with the priority order in ATen/Context.h
(flash, efficient, math, cudnn). They are written out by hand, not computed from model.py. No GPU is needed:
torch.backends.cuda.can_use_flash_attention / can_use_efficient_attention answer False for everything on a CPU build
(they check that the tensors are on CUDA, and this wheel has neither kernel compiled in), so they cannot check them.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import model as model_py  # the module: tests swap its attention
from gpt import sdpa  # the module: tests swap its sdpa_fuses_gqa
from gpt.sdpa import sdpa_fuses_gqa
from model import GPT, GPTConfig, Positions, attention

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
CARDS = {"V100": (7, 0), "T4": (7, 5), "A100": (8, 0), "A10/3090": (8, 6), "L4/4090": (8, 9), "H100": (9, 0)}

# Which kernel runs for 12 query heads on 4 kv heads, head_dim 64, default backends, training (grad, dropout) and
# inference alike (flash and memory-efficient both take dropout and gradients here), on NVIDIA cards:
# - flash: no attn_mask (check_for_attn_mask), fp16/bf16 only on sm80..sm121 (check_dtypes_low_precision,
#   check_flash_attention_hardware_support), head_dim <= 256, takes enable_gqa;
# - memory-efficient: masks and dropout fine, fp16/fp32 from sm50 and bf16 from sm80, but different head counts
#   are refused: check_batch_size_and_num_heads_dense<supports_gqa=false> (torch 2.13's docstring: "GQA ... works
#   only for Flash_attention and math kernel on CUDA"; 2.14 adds GQA to it);
# - math: anything, holding the scores. cuDNN sits behind math unless check_prefer_cudnn_attention puts it first
#   (sm90/sm100 with cuDNN > 9.15): it takes GQA and masks in fp16/bf16, which changes no "fused or not" below.
# Columns: (dtype, masked): masked is a chunk after a cached prefix (or a window); unmasked is is_causal, T == S.
COLUMNS = [(FP32, False), (FP32, True), (FP16, False), (FP16, True), (BF16, False), (BF16, True)]
WITH_GQA = {  # enable_gqa=True, k and v with 4 heads
    "V100": ["math", "math", "math", "math", "math", "math"],  # flash needs sm80; efficient refuses GQA
    "T4": ["math", "math", "math", "math", "math", "math"],
    "A100": ["math", "math", "flash", "math", "flash", "math"],  # flash: fp16/bf16 without a mask only
    "A10/3090": ["math", "math", "flash", "math", "flash", "math"],
    "L4/4090": ["math", "math", "flash", "math", "flash", "math"],
    "H100": ["math", "math", "flash", "math", "flash", "math"],
}
REPEATED = {  # k and v repeated to 12 heads, enable_gqa=False
    "V100": ["efficient", "efficient", "efficient", "efficient", "math", "math"],  # no bf16 kernel before sm80
    "T4": ["efficient", "efficient", "efficient", "efficient", "math", "math"],
    "A100": ["efficient", "efficient", "flash", "efficient", "flash", "efficient"],
    "A10/3090": ["efficient", "efficient", "flash", "efficient", "flash", "efficient"],
    "L4/4090": ["efficient", "efficient", "flash", "efficient", "flash", "efficient"],
    "H100": ["efficient", "efficient", "flash", "efficient", "flash", "efficient"],
}


@pytest.mark.parametrize("card", CARDS)
def test_enable_gqa_is_kept_exactly_where_a_fused_kernel_takes_it(card):
    for (dtype, masked), with_gqa, repeated in zip(COLUMNS, WITH_GQA[card], REPEATED[card]):
        keeps = sdpa_fuses_gqa("cuda", CARDS[card], dtype, masked, 64)
        assert keeps == (with_gqa != "math"), (card, dtype, masked)
        assert sdpa_fuses_gqa("cuda", CARDS[card], dtype, masked, 128) == keeps  # Llama and Qwen3 head widths
        runs = with_gqa if keeps else repeated
        assert runs != "math" or repeated == "math", (card, dtype, masked)  # math only where nothing else would do


def test_wide_heads_other_cards_and_the_cpu():
    # head_dim 193..256: flash refuses training on sm86/89/120 (check_requires_grad_and_head_dim_gt192_...);
    # the repeated k and v go to the efficient kernel instead, which has no such limit
    assert not any(sdpa_fuses_gqa("cuda", capability, BF16, False, 256) for capability in CARDS.values())
    assert sdpa_fuses_gqa("cuda", (12, 0), BF16, False, 64)  # flash's range ends at sm121
    assert not sdpa_fuses_gqa("cuda", (12, 2), BF16, False, 64)
    assert not sdpa_fuses_gqa("cuda", None, BF16, False, 64)  # ROCm: its own rules; repeating is always safe
    for dtype in (FP32, FP16, BF16):  # the CPU's flash kernel takes GQA, masks and every dtype: calls unchanged
        assert sdpa_fuses_gqa("cpu", None, dtype, False, 64) and sdpa_fuses_gqa("cpu", None, dtype, True, 256)


# ----------------------------------------------------------------------------------------------------
# The repeated-kv path computes what enable_gqa computes (forced on the CPU, where the model never takes it)


def tiny_config(**overrides):
    return GPTConfig(**{**dict(vocab_size=61, block_size=40, n_layer=2, n_head=4, n_kv_head=2, n_embd=32), **overrides})


def recording_sdpa(monkeypatch):
    """Replace F.scaled_dot_product_attention with one that records each call's kv heads and keywords."""
    calls, original = [], F.scaled_dot_product_attention

    def recorder(q, k, v, **kwargs):
        calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), v=tuple(v.shape), **kwargs))
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorder)
    return calls


CASES = {  # name: (T, n_cached, window): the three paths of attention, and the mask path over a whole sequence
    "full": (9, 0, 0), "decode": (1, 11, 0), "chunk": (6, 11, 0), "window": (9, 0, 4)}


@pytest.mark.parametrize("n_kv_head", [2, 1])
@pytest.mark.parametrize("case", CASES)
def test_repeated_kv_equals_enable_gqa_with_gradients(case, n_kv_head, monkeypatch):
    T, n_cached, window = CASES[case]
    config, B, hd = tiny_config(n_kv_head=n_kv_head, window=window), 2, 8
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(B, 4, T, hd, generator=generator)
    k, v = (torch.randn(B, n_kv_head, n_cached + T, hd, generator=generator) for _ in range(2))
    positions = Positions(torch.arange(n_cached, n_cached + T), hd, 10000.0)
    target = torch.randn(B, 4, T, hd, generator=generator)

    def output_and_grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        y = attention(*leaves, positions, SimpleNamespace(config=config, layer_idx=0))
        (y * target).sum().backward()
        return [y.detach()] + [t.grad for t in leaves]

    expected = output_and_grads()
    calls = recording_sdpa(monkeypatch)
    monkeypatch.setattr(sdpa, "sdpa_fuses_gqa", lambda *args: False)  # as on a card with no fused GQA kernel
    actual = output_and_grads()
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-5)
    if case == "decode":  # the query-rows trick has equal heads already: nothing to repeat
        rows = (B, n_kv_head, 4 // n_kv_head, hd)
        assert calls == [dict(q=rows, k=k.shape, v=v.shape, attn_mask=calls[0]["attn_mask"], dropout_p=0.0)]
    else:  # the path under test did run: k and v with 4 heads, no enable_gqa
        assert [(c["k"][1], c["v"][1], c["enable_gqa"]) for c in calls] == [(4, 4, False)]


def test_model_loss_and_gradients_equal_with_repeated_kv(monkeypatch):
    torch.manual_seed(0)
    model = GPT(tiny_config(dropout=0.0))
    idx, targets = torch.randint(0, 61, (2, 24)), torch.randint(0, 61, (2, 24))

    def loss_and_grads():
        model.zero_grad()
        loss = model(idx, targets)[1]
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    expected = loss_and_grads()
    monkeypatch.setattr(sdpa, "sdpa_fuses_gqa", lambda *args: False)
    for a, e in zip(loss_and_grads(), expected):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# On the CPU the model keeps grouped-query attention in SDPA's own hands: k and v never repeated


@pytest.mark.parametrize("window", [0, 5])
def test_cpu_calls_keep_grouped_query_attention(window, monkeypatch):
    """Each path's SDPA call on the CPU, as the fix for CUDA left it: a whole sequence is_causal (no window) with
    enable_gqa and 2 kv heads; a chunk masked, with enable_gqa and 2 kv heads; one token as query rows of its kv
    group (q (B, n_kv, group, hd)), unrepeated; and no CUDA property asked for."""
    def no_cuda_query(*args, **kwargs):
        raise AssertionError("attention asked for CUDA properties on the CPU")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_cuda_query)
    torch.manual_seed(0)
    model = GPT(tiny_config(window=window)).eval()
    idx = torch.randint(0, 61, (2, 20))
    calls = recording_sdpa(monkeypatch)
    with torch.no_grad():  # a full sequence, then through the cache: a prefix, a chunk after it, two decode steps
        model(idx)
        cache = model.new_kv_cache(batch_size=2, max_len=20)
        for a, b in [(0, 8), (8, 14), (14, 15), (15, 16)]:
            model(idx[:, a:b], kv_cache=cache)
    assert len(calls) == 2 * 5  # two layers, five forwards
    for call, (T, S) in zip(calls, [(T, S) for T, S in [(20, 20), (8, 8), (6, 14), (1, 15), (1, 16)] for _ in "ab"]):
        masked = window > 0 or T != S
        assert ("attn_mask" in call) == masked and call.get("is_causal", False) == (not masked)
        if T == 1:  # 4 query heads on 2 kv heads: 2 kv groups of 2 query rows each
            assert call["q"] == (2, 2, 2, 8) and call["k"] == (2, 2, S, 8) and "enable_gqa" not in call
        else:
            assert call["q"] == (2, 4, T, 8) and call["k"] == call["v"] == (2, 2, S, 8) and call["enable_gqa"]


# ----------------------------------------------------------------------------------------------------
# The decision is plain Python: torch.compile(fullgraph=True) traces either outcome in one graph


@pytest.mark.parametrize("fused", [True, False])
def test_attention_compiles_in_one_graph_either_way(fused, monkeypatch):
    monkeypatch.setattr(sdpa, "sdpa_fuses_gqa", lambda *args: fused)
    config = tiny_config()
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=generator)
    k, v = (torch.randn(2, 2, 17, 8, generator=generator) for _ in range(2))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model_py.attention, backend="eager", fullgraph=True)  # a graph break would raise
        for T, S in [(6, 6), (6, 17)]:  # is_causal, then a chunk after a cached prefix with a mask
            positions = Positions(torch.arange(S - T, S), 8, 10000.0)
            args = (q[:, :, :T], k[:, :, :S], v[:, :, :S], positions, SimpleNamespace(config=config, layer_idx=0))
            torch.testing.assert_close(compiled(*args), model_py.attention(*args))
    finally:
        torch._dynamo.reset()


def test_an_eager_decode_step_leaves_out_cudnns_kernel():
    """cuDNN's SDPA kernel builds a plan for each new key length (7x slower eager decoding on an H100): on CUDA the
    eager decode step (engine.last_logits: sample.py without a graph, speculative decoding, model.generate) runs SDPA
    without it; the static step (one length, captured or compiled) and the CPU keep SDPA's choice. CUDA here: CPU
    tensors answering is_cuda as CUDA's (what last_logits asks)."""
    from gpt import engine, static_step

    assert torch.backends.cuda.cudnn_sdp_enabled()
    with sdpa.new_key_length_kernels():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_kv_head=2, n_embd=32)).eval()
    for ids_class, eager_flag in ((CudaLooking, False), (torch.Tensor, True)):
        idx = torch.zeros(1, 5, dtype=torch.long).as_subclass(ids_class)
        growing, static = model.new_kv_cache(1, 8), model.new_kv_cache(1, 8, static=True)
        runs = dict(growing=lambda: engine.last_logits(model, idx, growing),  # a prefill, then one token after it
                    more=lambda: engine.last_logits(model, idx[:, :1], growing),
                    generate=lambda: model.generate(idx, 2, temperature=0),
                    static=lambda: static_step.decode_step(model, idx[:, :1], static, torch.tensor([5])))
        flags = {}
        with torch.no_grad():
            for path, run in runs.items():
                with CudnnFlagInAttention() as seen:
                    run()
                flags[path] = seen.flags
        assert flags == dict(growing={eager_flag}, more={eager_flag}, generate={eager_flag}, static={True})


class CudaLooking(torch.Tensor):  # ops on it give it back: the model's activations from its token ids on
    is_cuda = True


class CudnnFlagInAttention(TorchDispatchMode):
    """torch.backends.cuda.cudnn_sdp_enabled() at each attention kernel dispatched."""

    def __init__(self):
        super().__init__()
        self.flags = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func.overloadpacket):
            self.flags.add(torch.backends.cuda.cudnn_sdp_enabled())
        return func(*args, **(kwargs or {}))
