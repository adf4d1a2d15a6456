"""Tests that model.py's attention, RoPE and KV cache compute what they claim (fp32, on TEST_DEVICE: conftest.py)."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gpt.sampling import draw, sample_next_token, sampling_probs
from model import GPT, GPTConfig, KVCache, Positions, attention, rope

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

HEADS = {"mha": 4, "gqa": 2, "mqa": 1}  # n_kv_head for n_head = 4


def tiny_config(**overrides):
    settings = dict(vocab_size=97, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    settings.update(overrides)
    return GPTConfig(**settings)


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).eval()


# ----------------------------------------------------------------------------------------------------
# 1. Attention is softmax(Q K^T / sqrt(hd) + causal mask) V


def attention_by_hand(q, k, v, n_cached):
    """The textbook formula, one query head at a time; query head h reads kv head h // group."""
    n_head, n_kv_head, T, S, hd = q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)
    group = n_head // n_kv_head
    outputs = []
    for h in range(n_head):
        kh, vh = k[:, h // group], v[:, h // group]  # (B, S, hd)
        scores = q[:, h] @ kh.transpose(-1, -2) / math.sqrt(hd)  # (B, T, S)
        query_pos = torch.arange(T, device=q.device)[:, None] + n_cached
        key_pos = torch.arange(S, device=q.device)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        outputs.append(torch.softmax(scores, dim=-1) @ vh)
    return torch.stack(outputs, dim=1)  # (B, nh, T, hd)


@pytest.mark.parametrize("kind", HEADS)
@pytest.mark.parametrize("n_cached,T", [(0, 9), (11, 1), (11, 6)], ids=["full", "decode", "chunk"])
def test_attention_matches_formula(kind, n_cached, T, device):
    torch.manual_seed(0)
    B, hd = 2, 8
    q = torch.randn(B, 4, T, hd, device=device)
    k = torch.randn(B, HEADS[kind], n_cached + T, hd, device=device)
    v = torch.randn(B, HEADS[kind], n_cached + T, hd, device=device)
    expected = attention_by_hand(q, k, v, n_cached)
    positions = Positions(torch.arange(n_cached, n_cached + T, device=device), hd, 1e4)
    actual = attention(q, k, v, positions, SimpleNamespace(config=tiny_config(), layer_idx=0))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", HEADS)
@pytest.mark.parametrize("T", [1, 4], ids=["decode", "chunk"])
def test_static_attention_over_whole_cache_matches_formula(kind, T, device):
    """A static cache is read whole: the unfilled rest (garbage here) must not count."""
    torch.manual_seed(0)
    B, hd, n_cached, max_len = 2, 8, 11, 24
    q = torch.randn(B, 4, T, hd, device=device)
    k, v = (torch.randn(B, HEADS[kind], max_len, hd, device=device) * 5 for _ in range(2))
    expected = attention_by_hand(q, k[:, :, :n_cached + T], v[:, :, :n_cached + T], n_cached)
    positions = Positions(torch.arange(n_cached, n_cached + T, device=device), hd, 1e4)
    actual = attention(q, k, v, positions, SimpleNamespace(config=tiny_config(), layer_idx=0))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def rope_by_hand(x, positions, base):
    """RoPE as complex multiplication: the pair (x[i], x[i + hd/2]) is the complex number
    x[i] + j x[i + hd/2], turned by the angle position * base^(-2i/hd). x is (B, T, nh, hd)."""
    hd = x.size(-1)
    pairs = torch.complex(x[..., : hd // 2].double(), x[..., hd // 2:].double())
    freqs = base ** (-torch.arange(0, hd, 2, dtype=torch.float64, device=x.device) / hd)
    turn = torch.polar(torch.ones(len(positions), hd // 2, dtype=torch.float64, device=x.device),
                       positions.double()[:, None] * freqs)
    turned = pairs * turn[:, None, :]
    return torch.cat((turned.real, turned.imag), dim=-1).float()


@pytest.mark.parametrize("kind", HEADS)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("head_dim", [0, 24])  # 24: heads wider than n_embd / n_head, as in Qwen3
def test_attention_layer_matches_formula(kind, qk_norm, head_dim, device):
    """The whole attention layer, from x to its output, recomputed from its weights."""
    model = tiny_model(n_kv_head=HEADS[kind], qk_norm=qk_norm, head_dim=head_dim).to(device)
    attn = model.layers[0].self_attn
    with torch.no_grad():  # make the qk-norm weights non-trivial so a skipped norm would show
        for module in (attn.q_norm, attn.k_norm):
            if qk_norm:
                module.weight.uniform_(0.5, 1.5)
    B, T, hd = 2, 10, model.config.head_dim
    x = torch.randn(B, T, model.config.n_embd, device=device)

    def rms_norm_by_hand(t, weight):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + model.config.norm_eps) * weight

    q = (x @ attn.q_proj.weight.T).view(B, T, 4, hd)
    k = (x @ attn.k_proj.weight.T).view(B, T, HEADS[kind], hd)
    v = (x @ attn.v_proj.weight.T).view(B, T, HEADS[kind], hd)
    if qk_norm:
        q, k = rms_norm_by_hand(q, attn.q_norm.weight), rms_norm_by_hand(k, attn.k_norm.weight)
    positions = torch.arange(T, device=device)
    q, k = rope_by_hand(q, positions, model.config.rope_base), rope_by_hand(k, positions, model.config.rope_base)
    y = attention_by_hand(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), n_cached=0)
    expected = y.transpose(1, 2).reshape(B, T, -1) @ attn.o_proj.weight.T
    with torch.no_grad():
        actual = attn(x, Positions(positions, hd, model.config.rope_base))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# 2. GQA is MHA with each kv head shared by its group of query heads


@pytest.mark.parametrize("n_kv_head", [2, 1])
def test_gqa_equals_mha_with_repeated_kv_weights(n_kv_head, device):
    gqa = tiny_model(n_kv_head=n_kv_head).to(device)
    mha = tiny_model(seed=1, n_kv_head=4).to(device)
    group, hd = 4 // n_kv_head, gqa.config.head_dim
    state = gqa.state_dict()
    for name, tensor in list(state.items()):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            # rows are (kv head, hd): repeat each kv head's block for the query heads of its group
            state[name] = tensor.view(n_kv_head, hd, -1).repeat_interleave(group, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(state)
    idx = torch.randint(0, 97, (2, 20), device=device)
    with torch.no_grad():
        torch.testing.assert_close(mha(idx)[0], gqa(idx)[0], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# 3. Causality


@pytest.mark.parametrize("kind", HEADS)
def test_changing_a_token_leaves_earlier_logits_unchanged(kind, device):
    model = tiny_model(n_kv_head=HEADS[kind]).to(device)
    idx = torch.randint(0, 97, (2, 24), device=device)
    changed = idx.clone()
    t = 13
    changed[:, t] = (idx[:, t] + 1) % 97
    with torch.no_grad():
        before, after = model(idx)[0], model(changed)[0]
    assert torch.equal(before[:, :t], after[:, :t])
    assert not torch.allclose(before[:, t:], after[:, t:])  # the change is seen from t on


# ----------------------------------------------------------------------------------------------------
# 4. The KV cache gives the logits of one full forward, whatever the chunking


def garbage_(tensor, generator, std=100.0):
    """Fill tensor (on any device) with large values drawn from a CPU generator: the same values everywhere."""
    tensor.copy_(torch.empty(tensor.shape).normal_(0, std, generator=generator))


def random_chunks(total, generator):
    sizes = []
    while sum(sizes) < total:
        sizes.append(min(int(torch.randint(1, 9, (1,), generator=generator)), total - sum(sizes)))
    return sizes


@pytest.mark.parametrize("kind", HEADS)
def test_cached_chunks_equal_full_forward(kind, device):
    model = tiny_model(n_kv_head=HEADS[kind]).to(device)
    generator = torch.Generator().manual_seed(0)  # on the CPU: the chunk sizes and tokens are the same everywhere
    idx = torch.randint(0, 97, (3, 48), generator=generator).to(device)
    with torch.no_grad():
        full = model(idx)[0]
        for trial in range(3):
            sizes = random_chunks(48, generator)
            if trial == 0:
                sizes = [5, 1, 1] + random_chunks(41, generator)  # decode steps early on, for sure
            cache = model.new_kv_cache(batch_size=3, max_len=48)
            pieces, start = [], 0
            for size in sizes:
                pieces.append(model(idx[:, start:start + size], kv_cache=cache)[0])
                start += size
            assert cache.pos == 48
            assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-5, sizes

            # Roll back as if tokens from position 20 on were rejected, feed other tokens, then the
            # original ones again: each time the logits are those of a full forward of that sequence.
            cache.truncate(20)
            other = torch.randint(0, 97, (3, 9), generator=generator).to(device)
            other_full = model(torch.cat([idx[:, :20], other], dim=1))[0][:, 20:]
            assert (model(other, kv_cache=cache)[0] - other_full).abs().max() < 1e-5
            cache.truncate(20)
            assert (model(idx[:, 20:31], kv_cache=cache)[0] - full[:, 20:31]).abs().max() < 1e-5
            assert (model(idx[:, 31:32], kv_cache=cache)[0] - full[:, 31:32]).abs().max() < 1e-5


@pytest.mark.parametrize("kind", HEADS)
def test_static_shape_path_equals_the_growing_cache(kind, device):
    """A static cache (the path torch.compile uses): k and v written at positions given as a tensor (input_pos),
    attention over the whole cache with a mask. Same logits as the growing cache, for decode steps and chunks,
    after a rollback too, whatever the unfilled part of the cache holds."""
    model = tiny_model(n_kv_head=HEADS[kind], tie_embeddings=False).to(device)
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 97, (2, 40), generator=generator).to(device)
    with torch.no_grad():
        growing, static = model.new_kv_cache(2, 48), model.new_kv_cache(2, 48, static=True)
        garbage_(static.k, generator)  # stale values where nothing was written: masked out
        garbage_(static.v, generator)
        start = 0
        for size in [6, 1, 1, 4, 1, 9, 1, 1, 1]:
            chunk = idx[:, start:start + size]
            expected = model(chunk, kv_cache=growing)[0]
            actual = model(chunk, kv_cache=static, input_pos=torch.arange(start, start + size, device=device))[0]
            assert (actual - expected).abs().max() < 1e-5, (start, size)
            assert static.pos == 0  # the caller keeps count on this path
            start += size
        growing.truncate(10)  # reject the tokens from position 10 on; the static cache is just overwritten
        other = torch.randint(0, 97, (2, 3), generator=generator).to(device)
        for i in range(3):
            expected = model(other[:, i:i + 1], kv_cache=growing)[0]
            actual = model(other[:, i:i + 1], kv_cache=static, input_pos=torch.tensor([10 + i], device=device))[0]
            assert (actual - expected).abs().max() < 1e-5
        # the mask matters: positions one further on see one more key, and give other logits
        shifted = model(other[:, 2:3], kv_cache=static, input_pos=torch.tensor([13], device=device))[0]
        assert (shifted - expected).abs().max() > 1e-3


@pytest.mark.parametrize("window", [0, 3])
def test_the_mask_is_built_once_per_forward_where_every_layer_shares_it(window, monkeypatch):
    """With no window the rule is key <= query in every layer: a static cache's step asks can_attend once and every
    layer reads that mask; with a window (which an edit may make per layer) each layer asks. Same logits either way."""
    import model as model_py
    model = tiny_model(n_layer=3, window=window)
    idx = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(0))
    asked, rule = [], model_py.can_attend
    monkeypatch.setattr(model_py, "can_attend", lambda *args: asked.append(args[3]) or rule(*args))
    with torch.no_grad():
        expected = model(idx)[0][:, -3:]
        cache = model.new_kv_cache(1, 12, static=True)
        model(idx[:, :6], kv_cache=cache, input_pos=torch.arange(6))
        asked.clear()
        chunk = model(idx[:, 6:], kv_cache=cache, input_pos=torch.arange(6, 9))[0]
    assert asked == ([0] if window == 0 else [0, 1, 2])
    assert (chunk - expected).abs().max() < 1e-5


class SdpaOutputTransposed(TorchDispatchMode):
    """SDPA's CPU kernel giving its output (B, H, T, hd) in (B, T, H, hd) memory, the layout CUDA's memory-efficient
    kernel returns: the same values, other strides (a view across H and T then fails, as it did on an H100 without
    cuDNN's kernel)."""
    hits = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
            SdpaOutputTransposed.hits += 1
            return (out[0].transpose(1, 2).contiguous().transpose(1, 2), *out[1:])
        return out


def test_one_token_attention_takes_any_layout_of_sdpa_output():
    model = tiny_model(n_kv_head=2)
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(idx)[0][:, -1]
        SdpaOutputTransposed.hits = 0
        for static in (False, True):
            cache = model.new_kv_cache(2, 12, static=static)
            model(idx[:, :-1], kv_cache=cache, input_pos=torch.arange(8) if static else None)
            with SdpaOutputTransposed():
                actual = model(idx[:, -1:], kv_cache=cache, input_pos=torch.tensor([8]) if static else None)[0][:, -1]
            assert (actual - expected).abs().max() < 1e-5
        assert SdpaOutputTransposed.hits == 2 * model.config.n_layer  # the layout came from every one-token step


def test_static_decode_step_compiles_once(device):
    """torch.compile of a decode step on a static cache traces one graph for every step; the growing cache
    (a new shape each step) traces one per step. The backend counts traced graphs and runs them eagerly."""
    model = tiny_model(tie_embeddings=False).to(device)
    idx = torch.randint(0, 97, (2, 30), device=device)
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    with torch.no_grad():
        expected = model(idx)[0][:, 8:]
        torch._dynamo.reset()
        static_step = torch.compile(lambda tokens, cache, pos: model(tokens, kv_cache=cache, input_pos=pos)[0],
                                    backend=counting_backend, fullgraph=True, dynamic=False)
        cache = model.new_kv_cache(2, 32, static=True)
        model(idx[:, :8], kv_cache=cache, input_pos=torch.arange(8, device=device))  # prefill, not compiled
        logits = [static_step(idx[:, t:t + 1], cache, torch.tensor([t], device=device)) for t in range(8, 30)]
        assert len(graphs) == 1
        assert (torch.cat(logits, dim=1) - expected).abs().max() < 1e-5

        graphs.clear()
        torch._dynamo.reset()
        growing_step = torch.compile(lambda tokens, cache: model(tokens, kv_cache=cache)[0],
                                     backend=counting_backend, dynamic=False)
        cache = model.new_kv_cache(2, 32)
        model(idx[:, :8], kv_cache=cache)
        for t in range(8, 11):
            growing_step(idx[:, t:t + 1], cache)
        assert len(graphs) == 3  # the counter sees recompiles: the assertion above could fail
        torch._dynamo.reset()


def test_gqa_cache_is_smaller_by_the_group_factor():
    gqa, mha = tiny_model(n_kv_head=1), tiny_model(n_kv_head=4)
    assert mha.new_kv_cache(2, 32).k.numel() == 4 * gqa.new_kv_cache(2, 32).k.numel()


# ----------------------------------------------------------------------------------------------------
# 5. Generation


def naive_greedy(model, idx, max_new_tokens):
    """Recompute the whole sequence at every step, no cache."""
    for _ in range(max_new_tokens):
        logits = model(idx)[0][:, -1]
        idx = torch.cat([idx, logits.argmax(dim=-1, keepdim=True)], dim=1)
    return idx


@pytest.mark.parametrize("kind", HEADS)
def test_greedy_generate_equals_naive_loop(kind, device):
    # Untied: a fresh tied model mostly repeats its last token, which would hide position errors.
    model = tiny_model(n_kv_head=HEADS[kind], tie_embeddings=False).to(device)
    prompt = torch.randint(0, 97, (2, 7), device=device)
    with torch.no_grad():
        expected = naive_greedy(model, prompt, 30)
    actual = model.generate(prompt, 30, temperature=0.0)
    assert actual.shape == (2, 37)
    assert torch.equal(actual, expected)
    assert len(expected[:, 7:].unique()) > 10  # the continuation is varied enough to mean something


def test_generate_uses_the_output_head_only_for_the_last_position(device):
    model = tiny_model().to(device)
    rows_seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: rows_seen.append(args[0].shape[:-1].numel()))
    model.generate(torch.randint(0, 97, (2, 10), device=device), 5, temperature=0.0)
    assert rows_seen == [2] * 5  # batch of 2, one position per step, the 10-token prefill included


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_stops_in_one_line_at_logits_of_nan(temperature, device):
    """A row of NaN logits (broken weights, an edit of model.py) gives no token (sampling's V): generate says so at that
    step, rather than an IndexError at the next (V fed back), or V among its tokens when it was the last step."""
    model, calls = tiny_model().to(device), []

    def nan_at_the_third_step(module, args, out):
        calls.append(out)
        return torch.full_like(out, float("nan")) if len(calls) == 3 else out
    model.lm_head.register_forward_hook(nan_at_the_third_step)
    for max_new_tokens in (5, 3):
        calls.clear()
        with pytest.raises(RuntimeError, match=r"^generate: the logits for new token 3 hold NaN or inf \(") as error:
            model.generate(torch.randint(0, 97, (2, 4), device=device), max_new_tokens, temperature=temperature)
        assert "\n" not in str(error.value) and len(calls) == 3


def test_sampling_is_reproducible_with_a_generator(device):
    model = tiny_model().to(device)
    prompt = torch.randint(0, 97, (2, 5), device=device)
    runs = [model.generate(prompt, 20, temperature=1.0, top_k=20, generator=torch.Generator(device).manual_seed(s))
            for s in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_sampling_probs_top_k_and_top_p(device):
    def tensor(rows):
        return torch.tensor(rows, device=device)

    logits = torch.log(tensor([[0.05, 0.5, 0.15, 0.3]]))
    # top_p = 0.7: 0.5 alone is short of it, 0.5 + 0.3 reaches it, so exactly those two stay.
    torch.testing.assert_close(sampling_probs(logits, top_p=0.7), tensor([[0.0, 0.5, 0.0, 0.3]]) / 0.8)
    torch.testing.assert_close(sampling_probs(logits, top_k=3), tensor([[0.0, 0.5, 0.15, 0.3]]) / 0.95)
    torch.testing.assert_close(sampling_probs(logits, top_p=1.0), tensor([[0.05, 0.5, 0.15, 0.3]]))
    # temperature 0.5 squares the probabilities before renormalizing
    squared = tensor([[0.05, 0.5, 0.15, 0.3]]) ** 2
    torch.testing.assert_close(sampling_probs(logits, temperature=0.5), squared / squared.sum())
    assert sample_next_token(logits, temperature=0.0).item() == 1


def test_greedy_takes_the_first_most_likely_token_and_no_token_from_nan_or_inf(device):
    """temperature 0: the first of equal maxima; V (no token, as draw's) for a row holding NaN or inf, where argmax
    would name the NaN's token (or the inf's); as probabilities (speculative decoding's), such a row holds none."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[1.0, 3.0, 3.0], [1.0, nan, 3.0], [nan, nan, nan], [0.0, inf, 1.0], [-inf, -inf, -inf],
                           [-inf, 2.0, -inf]], device=device)
    assert sample_next_token(logits, temperature=0.0).tolist() == [[1], [3], [3], [3], [3], [1]]
    probs = sampling_probs(logits, temperature=0.0)
    assert probs.tolist() == [[0, 1, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 1, 0]]
    assert draw(probs).tolist() == [[1], [3], [3], [3], [3], [1]]


def test_top_p_keeps_the_smallest_most_likely_set_reaching_it_whatever_its_size(device):
    """top_p over 6,000 tokens, rows whose nucleus holds a few tokens, about a thousand and most: on a CPU the top 256
    are taken first and 16x more while they fall short (each row here stops at another size), elsewhere all are sorted
    at once; the rule written out in float64 below keeps exactly the same tokens, with the same probabilities."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.stack([torch.randn(6000, generator=generator) * scale for scale in (8.0, 2.0, 0.2)])  # (3, V)
    probs = torch.softmax(scores.double(), dim=-1)
    expected = torch.zeros_like(probs)
    for row, p in enumerate(probs):
        order = p.argsort(descending=True)
        before = p[order].cumsum(0) - p[order]  # the probability of the tokens more likely than each
        n_kept = int((before < 0.9).sum())
        assert before[n_kept] - 0.9 > 1e-6 and 0.9 - before[n_kept - 1] > 1e-6  # no cut within float32's rounding
        expected[row, order[:n_kept]] = p[order[:n_kept]] / p[order[:n_kept]].sum()
    kept_sizes = [int((row > 0).sum()) for row in expected]
    assert kept_sizes[0] < 256 < kept_sizes[1] < 4096 < kept_sizes[2], kept_sizes
    together = sampling_probs(scores.to(device), temperature=1.0, top_p=0.9).cpu()  # one size for the batch: all
    apart = torch.cat([sampling_probs(row[None].to(device), temperature=1.0, top_p=0.9).cpu() for row in scores])
    for actual in (together, apart):
        assert [int((row > 0).sum()) for row in actual] == kept_sizes
        torch.testing.assert_close(actual.double(), expected, atol=1e-6, rtol=1e-5)


def test_draw_follows_the_probabilities_and_never_a_token_of_probability_zero():
    """draw (sample_next_token's, speculative decoding's): 200,000 rows drawn at once, each token as often as its
    probability says (within 5 standard deviations), none of probability 0 (first, between, last), whatever the rows
    sum to; the generator decides the draws."""
    probs, n = torch.tensor([0.0, 0.1, 0.0, 0.6, 0.3, 0.0], dtype=torch.float64), 200_000
    rows = 3 * probs.float().expand(n, -1)  # unnormalized
    picks = draw(rows, torch.Generator().manual_seed(0))
    assert picks.shape == (n, 1) and picks.dtype == torch.long
    frequencies = torch.bincount(picks[:, 0], minlength=len(probs)).double() / n
    assert (frequencies[probs == 0] == 0).all(), frequencies
    assert ((frequencies - probs).abs() <= 5 * (probs * (1 - probs) / n).sqrt()).all(), frequencies
    assert torch.equal(draw(rows, torch.Generator().manual_seed(0)), picks)
    assert not torch.equal(draw(rows, torch.Generator().manual_seed(1)), picks)
    assert draw(torch.tensor([0.0, 0.0, 2.0])).tolist() == [2]  # one row (..., V) -> (..., 1)
    nan, inf = float("nan"), float("inf")  # rows that are no distribution draw V, no token (engine.Samples stops there)
    assert draw(torch.tensor([[0.5, nan, 0.5], [0.0, inf, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])).tolist() == \
        [[3], [3], [3], [1]]


# ----------------------------------------------------------------------------------------------------
# 6. RoPE encodes relative position


def test_rope_score_depends_only_on_relative_position():
    torch.manual_seed(0)
    hd = 16
    q, k = torch.randn(1, 1, 1, hd), torch.randn(1, 1, 1, hd)

    def score(m, n):
        q_m = rope(q, Positions(torch.tensor([m]), hd, base=10000.0))
        k_n = rope(k, Positions(torch.tensor([n]), hd, base=10000.0))
        return (q_m * k_n).sum().item()

    for m, n in [(5, 2), (9, 9), (3, 17)]:
        for shift in (1, 40, 150):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)  # yet the offset itself matters


# ----------------------------------------------------------------------------------------------------
# 7. Learning, init and accounting


@pytest.mark.parametrize("mlp", ["swiglu", "gelu", "relu2"])
def test_tiny_model_overfits_one_batch(mlp, device):
    torch.manual_seed(0)
    model = GPT(tiny_config(mlp=mlp, block_size=32)).to(device)
    idx = torch.randint(0, 97, (4, 33), device=device)
    x, y = idx[:, :-1], idx[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(100):  # each mlp's loss is below 0.1 from about step 47 on, 0.016 to 0.028 at step 100 (a CPU)
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.1


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_fresh_model_loss_is_about_ln_vocab(tie_embeddings, device):
    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=1000, n_embd=128, tie_embeddings=tie_embeddings)).to(device)
    idx, targets = torch.randint(0, 1000, (8, 64), device=device), torch.randint(0, 1000, (8, 64), device=device)
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(1000)) < 0.1


def test_targets_of_minus_one_are_ignored(device):
    model = tiny_model().to(device)
    idx, targets = torch.randint(0, 97, (2, 10), device=device), torch.randint(0, 97, (2, 10), device=device)
    masked = targets.clone()
    masked[:, 4:] = -1
    logits, loss = model(idx, masked)
    expected = F.cross_entropy(logits[:, :4].reshape(-1, 97), targets[:, :4].reshape(-1))
    torch.testing.assert_close(loss, expected)


def test_every_norm_gets_its_scale_in_the_input_dtype_under_autocast(device, monkeypatch):
    """Under bf16 autocast (train.py's mixed precision) q and k leave their projections in bf16 while the norms'
    scales are fp32 parameters; on that mismatch torch skips CUDA's fused rms_norm kernel for the composite one
    (seen on an H100: a warning in every run). Every call must see one dtype, the scale still learn in fp32, and
    the result match fp32 arithmetic to bf16's precision."""
    calls, rms_norm = [], F.rms_norm

    def spy(x, shape, weight=None, eps=None):
        calls.append((x.dtype, weight.dtype))
        return rms_norm(x, shape, weight, eps)

    model = tiny_model(qk_norm=True).to(device)
    idx = torch.randint(0, 97, (2, 16), device=device)
    expected, _ = model(idx)
    monkeypatch.setattr(F, "rms_norm", spy)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        logits, loss = model(idx, idx)
    loss.backward()
    assert len(calls) == 2 * 4 + 1  # 2 blocks of 4 (attention's and MLP's inputs, q, k) and the final norm
    assert all(x == weight for x, weight in calls), calls
    assert {dtype for dtype, _ in calls} == {torch.float32, torch.bfloat16}  # the residual stream stays fp32
    assert model.layers[0].self_attn.q_norm.weight.grad.dtype == torch.float32
    torch.testing.assert_close(logits.float(), expected, atol=0.05, rtol=0.05)


def test_num_params_counts_by_hand():
    cfg = tiny_config(n_kv_head=2, mlp="swiglu", qk_norm=True, tie_embeddings=True)
    C, hd, kv_width = cfg.n_embd, cfg.head_dim, 2 * cfg.head_dim
    per_layer = C * C + 2 * C * kv_width + C * C + 3 * C * cfg.mlp_width + 2 * C + 2 * hd
    assert GPT(cfg).num_params() == cfg.vocab_size * C + cfg.n_layer * per_layer + C
    untied = GPT(tiny_config(tie_embeddings=False))
    assert untied.num_params() == GPT(cfg).num_params() + cfg.vocab_size * C


# ----------------------------------------------------------------------------------------------------
# 8. Errors


@pytest.mark.parametrize("overrides,field", [
    (dict(n_embd=66), "n_embd"),  # not divisible by n_head=4
    (dict(n_head=4, n_kv_head=3), "n_head"),  # 4 query heads can't be split among 3 kv heads
    (dict(n_embd=12, n_head=4, n_kv_head=1), "head_dim"),  # head dim 3 is odd: RoPE needs pairs
    (dict(n_layer=0), "n_layer"),
    (dict(vocab_size=-5), "vocab_size"),
    (dict(block_size=0), "block_size"),
    (dict(n_kv_head=0), "n_kv_head"),
    (dict(n_embd=64.0), "n_embd"),
    (dict(dropout=1.0), "dropout"),
    (dict(mlp="moe"), "mlp"),
    (dict(head_dim=-2), "head_dim"),
])
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


def test_cache_errors():
    model = tiny_model()
    cache = model.new_kv_cache(batch_size=2, max_len=10)
    model(torch.randint(0, 97, (2, 8)), kv_cache=cache)
    with pytest.raises(ValueError, match="overflow.*max_len 10"):
        model(torch.randint(0, 97, (2, 3)), kv_cache=cache)
    assert cache.pos == 8  # a refused chunk changes nothing
    with pytest.raises(ValueError, match="batch size 2"):
        model(torch.randint(0, 97, (3, 1)), kv_cache=cache)
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(9)
    with pytest.raises(ValueError, match="max_len"):
        model.new_kv_cache(batch_size=1, max_len=65)  # longer than block_size=64
    with pytest.raises(ValueError, match="block_size"):
        model(torch.randint(0, 97, (1, 65)))
    with pytest.raises(ValueError, match="block_size"):
        model.generate(torch.randint(0, 97, (1, 60)), max_new_tokens=5)


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-1.0), "temperature"), (dict(top_k=0), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sample_next_token(torch.zeros(1, 5), **kwargs)


def test_kv_cache_is_plain_and_preallocated():
    cache = KVCache(n_layer=2, batch_size=3, n_kv_head=1, max_len=5, head_dim=4)
    assert cache.k.shape == (2, 3, 1, 5, 4) and cache.pos == 0 and cache.max_len == 5


# ----------------------------------------------------------------------------------------------------
# The chunked loss


@pytest.mark.parametrize("chunk", [1, 7, 16, 48, 1000])  # 48 = B x T: one chunk; 7 divides nothing; 1000 > B x T
@pytest.mark.parametrize("tied", [True, False])
def test_chunked_loss_equals_the_plain_loss_and_gradients(chunk, tied, device):
    """With ignored targets (-1), in fp32: the same loss and every gradient within 1e-6."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=200, block_size=16, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                          tie_embeddings=tied, dropout=0.0)).to(device)
    x, y = torch.randint(0, 200, (3, 16), device=device), torch.randint(0, 200, (3, 16), device=device)
    y[0, :5], y[2, -3:] = -1, -1
    results = []
    for loss_chunk in (0, chunk):
        model.zero_grad()
        logits, loss = model(x, y, loss_chunk=loss_chunk)
        loss.backward()
        results.append((logits, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_logits, plain_loss, plain_grads), (chunked_logits, chunked_loss, chunked_grads) = results
    assert plain_logits.shape == (3, 16, 200) and chunked_logits is None  # the point: no B x T x V tensor
    # a loss of ~5.3 nats, where one float32 step is 4.8e-7; CUDA's reductions add the terms in another order
    assert abs(chunked_loss - plain_loss) < (1e-6 if device == "cpu" else 1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, atol=1e-6, rtol=0, msg=name)


def test_chunked_loss_holds_one_chunk_of_logits_at_a_time_and_runs_the_head_once():
    """The head sees chunk rows per call, each chunk once: its gradients are taken in the forward pass (ChunkedLoss),
    not by running the head again in the backward; the same in evaluation, where nothing is differentiated."""
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_kv_head=1, n_embd=16))
    rows = []
    model.lm_head.register_forward_hook(lambda module, args, out: rows.append(out.shape[0]))
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    loss = model(x, y, loss_chunk=10)[1]
    assert rows == [10, 10, 10, 2]
    loss.backward()
    assert rows == [10, 10, 10, 2] and model.lm_head.weight.grad is not None
    with torch.no_grad():
        model(x, y, loss_chunk=10)
    assert rows == [10, 10, 10, 2] * 2
    for grad_enabled in (True, False):  # training and evaluation each summed no chunk: a loss of 0, NaN gradients
        with torch.set_grad_enabled(grad_enabled), pytest.raises(ValueError, match="loss_chunk must be at least 1"):
            model(x, y, loss_chunk=-1)


def test_a_chunked_training_step_counts_the_flops_of_the_mfu_formula():
    """FlopCounterMode over a training step with the loss in chunks counts what gpt/mfu.py's formula says (6 per
    weight per token, plus attention): no matmul run twice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    from gpt import mfu

    class CountingFlops(TorchDispatchMode):  # FlopCounterMode's count, without its module hooks (which refuse the
        flops = 0  # autograd.grad that ChunkedLoss runs inside the forward pass)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in flop_registry:
                self.flops += flop_registry[func.overloadpacket](*args, **(kwargs or {}), out_val=out)
            return out

    model = GPT(GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64))
    idx = torch.randint(0, 97, (3, 32))
    flops = {}
    for loss_chunk in (0, 40):
        with CountingFlops() as counter, sdpa_kernel(SDPBackend.MATH):  # the math kernel's matmuls are counted
            model(idx, idx, loss_chunk=loss_chunk)[1].backward()
        flops[loss_chunk] = counter.flops
    assert flops[40] == flops[0] == mfu.flops_per_token(model, 32) * idx.numel(), flops
