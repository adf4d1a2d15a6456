"""Tests for engine.py and speculative.py beyond what sample.py's end-to-end tests show: speculative sampling follows
the target model's distribution (a chi-square test over many steps), each speculative step leaves both KV caches
holding exactly the accepted tokens, when a model compiles by default, compiled steps of two models stay apart, the
CUDA-graph step's logic (on the CPU), a float16 CPU step's attention kernel, and prompt lookup's proposals."""

import copy
import math
import os
from statistics import NormalDist

import pytest
import torch

import model as model_py
from gpt import engine, speculative, static_step
from model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


# ----------------------------------------------------------------------------------------------------
# Speculative sampling reproduces the target's distribution


V = 8  # vocabulary of the random models


def random_gpt(seed, std, device="cpu"):
    """A tiny random GPT whose weights have standard deviation std (drawn on the CPU), on device: larger std,
    peakier distributions."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = GPT(GPTConfig(vocab_size=V, block_size=16, n_layer=1, n_head=2, n_kv_head=1, n_embd=16,
                              qk_norm=False, mlp="relu2"))
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 2:
                    param.normal_(0, std)
    return model.to(device).eval()


def chi_square_threshold(df, alpha):
    """The 1 - alpha quantile of the chi-square distribution with df degrees of freedom (Wilson-Hilferty)."""
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts, probs, min_expected=5.0):
    """Pearson's statistic of counts against probs, cells expecting fewer than min_expected pooled; and df."""
    n = counts.sum()
    expected = n * probs
    small = expected < min_expected
    observed = torch.cat([counts[~small], counts[small].sum().view(1)])
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    return float(((observed - expected) ** 2 / expected).sum()), len(expected) - 1


SPEC_PROMPT = [3]  # one token: the caches start empty, and a stale cache entry weighs the most


def spec_models(device="cpu"):
    """A target and a draft that differ a lot (the draft is flatter, and seeded differently)."""
    return random_gpt(1, 0.35, device), random_gpt(2, 0.2, device)


def first_two_token_probs(model, prompt):
    """The model's own probabilities of the first token (V,) and of the first two tokens (V * V,), computed
    directly: one forward for the first, one batch of V continuations for the second; on the CPU, as the counts."""
    device = engine.device_of(model)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt], device=device))[0][0, -1].double(), -1).cpu()
        continuations = torch.tensor([prompt + [x] for x in range(V)], device=device)
        second = torch.softmax(model(continuations)[0][:, -1].double(), -1).cpu()
    return first, (first[:, None] * second).flatten()


def speculative_counts(target, draft, prompt, k, trials, seed):
    """Counts (V * V,) of the first two new tokens over `trials` runs of speculative steps from the prompt,
    and the number of steps taken. Both caches are prefilled once and truncated back after each run."""
    settings, device = dict(temperature=1.0, top_k=None, top_p=None), engine.device_of(target)
    generator = torch.Generator(device).manual_seed(seed)
    target_cache, _ = engine.prefill(target, torch.tensor([prompt], device=device), target.config.block_size)
    draft_cache, _ = engine.prefill(draft, torch.tensor([prompt], device=device), draft.config.block_size)
    start = target_cache.pos
    counts = torch.zeros(V * V, dtype=torch.float64)
    steps = 0
    for _ in range(trials):
        tokens = list(prompt)
        while len(tokens) < len(prompt) + 2:  # a rejection at the first proposal gives one token: step again
            new, accepted = speculative.speculative_step(target, draft, tokens, target_cache, draft_cache, k,
                                                         settings, V, generator)
            assert 1 <= len(new) <= k + 1 and accepted == len(new) - 1
            tokens += new
            steps += 1
        counts[tokens[len(prompt)] * V + tokens[len(prompt) + 1]] += 1
        target_cache.truncate(start)
        draft_cache.truncate(start)
    return counts, steps


ALPHA = 1e-6  # the seeds are fixed; this is the chance that they were unlucky, were the code right


@pytest.mark.parametrize("k, trials", [(1, 1500), (2, 1000)])
def test_speculative_sampling_reproduces_the_target_distribution(k, trials, device):
    """The first two tokens after a prompt, over many speculative steps, are distributed as the target
    samples them. The first token tests the acceptance rule and the replacement distribution; the pair also
    tests the bonus token drawn when every proposal is accepted (k=1), the next proposal's verification (k=2),
    and both caches rolled back after a rejection (a rejection of the first proposal needs a second step,
    which reads both caches)."""
    target, draft = spec_models(device)
    p1, p12 = first_two_token_probs(target, SPEC_PROMPT)
    q1, q12 = first_two_token_probs(draft, SPEC_PROMPT)
    # the draft must differ from the target a lot, or a wrong acceptance rule would go unnoticed
    assert 0.5 * (p1 - q1).abs().sum() > 0.25 and 0.5 * (p12 - q12).abs().sum() > 0.35
    counts, steps = speculative_counts(target, draft, SPEC_PROMPT, k, trials, seed=1234 + k)
    assert trials * 1.1 < steps < trials * 1.9  # some runs took one step, some two
    stat, df = chi_square(counts.view(V, V).sum(1), p1)
    assert stat < chi_square_threshold(df, ALPHA / 2), f"first token: chi-square {stat:.1f} on {df} df"
    stat, df = chi_square(counts, p12)
    assert stat < chi_square_threshold(df, ALPHA / 2), f"first two tokens: chi-square {stat:.1f} on {df} df"


def test_the_distribution_test_sees_the_draft_distribution():
    """Sanity of the statistics above: as many draws from the draft's distribution fail them (so would a rule
    that accepted every proposal), and draws from the target's pass."""
    target, draft = spec_models()
    p1, p12 = first_two_token_probs(target, SPEC_PROMPT)
    q1, q12 = first_two_token_probs(draft, SPEC_PROMPT)
    generator = torch.Generator().manual_seed(0)
    for p, q in ((p1, q1), (p12, q12)):
        from_q = torch.bincount(torch.multinomial(q, 1000, replacement=True, generator=generator), minlength=len(p))
        from_p = torch.bincount(torch.multinomial(p, 1000, replacement=True, generator=generator), minlength=len(p))
        stat, df = chi_square(from_q.double(), p)
        assert stat > chi_square_threshold(df, ALPHA / 2)
        stat, df = chi_square(from_p.double(), p)
        assert stat < chi_square_threshold(df, ALPHA / 2)


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_steps_leave_each_cache_holding_the_accepted_tokens(k, device):
    """What speculative_step promises its caller: after every step the target's cache holds exactly the
    tokens but the last, and the draft's cache a prefix of them; the same keys a fresh prefill computes."""
    target, draft = spec_models(device)
    settings = dict(temperature=1.0, top_k=None, top_p=None)
    generator = torch.Generator(device).manual_seed(k)
    block_size = target.config.block_size
    n_rejected = n_all_accepted = 0
    for prompt in ([3], [3, 1, 4]):
        tokens = list(prompt)
        target_cache, _ = engine.prefill(target, torch.tensor([tokens], device=device), block_size)
        draft_cache, _ = engine.prefill(draft, torch.tensor([tokens], device=device), block_size)
        while len(tokens) + k <= block_size:
            new, accepted = speculative.speculative_step(target, draft, tokens, target_cache, draft_cache, k,
                                                         settings, V, generator)
            n_rejected, n_all_accepted = n_rejected + (accepted < k), n_all_accepted + (accepted == k)
            tokens += new
            assert target_cache.pos == len(tokens) - 1
            assert draft_cache.pos <= len(tokens) - 1
            for model, cache in ((target, target_cache), (draft, draft_cache)):
                fresh = model.new_kv_cache(1, block_size)
                with torch.no_grad():
                    model.hidden_states(torch.tensor([tokens[:cache.pos]], device=device), fresh)
                for mine, theirs in ((cache.k, fresh.k), (cache.v, fresh.v)):
                    torch.testing.assert_close(mine[:, :, :, :cache.pos], theirs[:, :, :, :cache.pos], atol=1e-5, rtol=0)
    assert n_rejected > 0 and n_all_accepted > 0  # both ways a step ends, each followed by another step


def test_a_model_compiles_by_default_when_large_or_int8_on_a_cpu_and_on_cuda(monkeypatch):
    """engine.compiles_by_default, sample.py's --compile when not given: on a CPU or CUDA, for weights beyond
    COMPILE_BY_DEFAULT_BYTES or int8 ones; a small float model's eager step is faster from launch to exit. A CUDA model
    is made of FakeTensorMode's CUDA tensors (no GPU, no memory: torch's own fake, which a CPU-only build carries)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gpt.quantize import quantize
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_kv_head=1, n_embd=16)
    model = GPT(config)
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert not engine.compiles_by_default(model)
    monkeypatch.setattr(engine, "COMPILE_BY_DEFAULT_BYTES", weight_bytes - 1)
    assert engine.compiles_by_default(model)
    assert not engine.compiles_by_default(copy.deepcopy(model).to("meta"))  # not a CPU or CUDA: never by default
    with torch.device("meta"):
        on_cuda = GPT(config)
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_cuda.to_empty(device="cuda")
        assert engine.device_of(on_cuda).type == "cuda" and engine.compiles_by_default(on_cuda)
        monkeypatch.setattr(engine, "COMPILE_BY_DEFAULT_BYTES", 10 * weight_bytes)
        assert not engine.compiles_by_default(on_cuda)
    assert engine.compiles_by_default(quantize(model, "int8"))


def test_compiled_steps_of_models_of_the_same_shapes_each_decode_their_own_text(monkeypatch):
    """compile_decode_step drops the guards on the model's modules (their cost per step): each decode_batch call's
    compiled code must then serve that call only. Two models with the same weights but another window (a constant
    of the traced graph, not a tensor) decode, compiled one after the other in one process, what each decodes eager
    (aot_eager: dynamo's guards and graphs, without inductor's compile time)."""
    from gpt.tokenizer import Tokenizer, char_meta
    tokenizer, torch_compile = Tokenizer(char_meta("abcdefgh")), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: torch_compile(fn, **{**kwargs, "backend": "aot_eager"}))
    torch._dynamo.reset()
    texts = {}
    for window in (0, 2):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=V, block_size=16, n_layer=1, n_head=2, n_kv_head=1, n_embd=16,
                              window=window)).eval()
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 1.0)  # peaky: greedy text that depends on what each position sees
        for compile in (True, False):
            samples = engine.Samples(1, tokenizer, [], stream=False)
            settings = dict(num_samples=1, max_new_tokens=12, temperature=0.0, top_k=None, top_p=None,
                            no_kv_cache=False, compile=compile)
            engine.decode_batch(model, [3], settings, samples, torch.Generator().manual_seed(0))
            texts[window, compile] = samples.texts[0]
    torch._dynamo.reset()
    assert texts[0, False] != texts[2, False]  # the window changes the text: the test can tell the graphs apart
    assert texts[0, True] == texts[0, False] and texts[2, True] == texts[2, False]


def hide_odd_tokens(query_pos, key_pos, config, layer, tokens):
    """An edited mask rule that reads the token ids (as document masking does): a key whose token id is odd is hidden
    from every query but its own."""
    visible = (key_pos <= query_pos) & (key_pos > query_pos - config.window)  # (T, S)
    return (visible & (tokens[:, None, None, :] % 2 == 0)) | (key_pos == query_pos)  # (B, 1, T, S)


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["growing_cache", "static_cache"])
def test_a_rule_of_the_tokens_holds_across_the_window_slides(monkeypatch, cuda_graph):
    """The cache's token ids, which a rule of the tokens reads, are the window's after each slide's refill: greedy
    text past block_size (4 prompt tokens + 30 new ones slide twice) is recomputing the window's, the engine's slide
    policy, under that rule; and the rule changes the text, so the test can tell."""
    import model as model_py
    from gpt.tokenizer import Tokenizer, char_meta
    tokenizer = Tokenizer(char_meta("abcdefgh"))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=V, block_size=16, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, window=16))
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 1.0)  # peaky: greedy text that depends on what each position sees
    model.eval()

    def texts():
        samples = engine.Samples(1, tokenizer, [], stream=False)
        engine.decode_batch(model, [1, 2, 3, 4], graph_settings(1, cuda_graph), samples, torch.Generator())
        context, expected = [1, 2, 3, 4], []
        with torch.no_grad():
            for _ in range(30):
                if len(context) > model.config.block_size:
                    context = context[-(model.config.block_size // 2):]
                expected.append(int(model(torch.tensor([context]))[0][0, -1, :V].argmax()))
                context.append(expected[-1])
        return samples.texts[0], tokenizer.decode(expected)

    plain, plain_expected = texts()
    monkeypatch.setattr(model_py, "can_attend", hide_odd_tokens)
    decoded, expected = texts()
    assert decoded == expected and len(decoded) == 30
    assert plain == plain_expected and decoded != plain


def test_a_compiled_step_keeps_its_code_in_the_cache_folder(monkeypatch, tmp_path):
    """compile_decode_step (decode_batch's and prompt lookup's) points inductor's caches at the folder that
    kernels.use_compile_cache chooses, so that a second run loads the compiled step (docs/sampling.md)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    monkeypatch.setenv("GPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what importing inductor sets: no choice
    static_step.compile_decode_step(torch.device("cpu"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")


# ----------------------------------------------------------------------------------------------------
# The CUDA-graph step (sample.py's default on CUDA), its logic on the CPU: the same static step, run eagerly


def test_a_float_model_replays_cuda_graphs_by_default_on_cuda_only():
    """engine.graphs_by_default: on CUDA (FakeTensorMode's CUDA tensors, as above) for float weights; not on a CPU or
    elsewhere, and not for int8 weights, whose eager step makes a float copy of every weight (they compile)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gpt.quantize import quantize
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_kv_head=1, n_embd=16)
    assert not engine.graphs_by_default(GPT(config))
    with torch.device("meta"):
        on_meta, on_cuda = GPT(config), GPT(config)
    assert not engine.graphs_by_default(on_meta)
    int8_on_cuda = quantize(GPT(config), "int8")
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_cuda.to_empty(device="cuda")
        int8_on_cuda.to_empty(device="cuda")
        assert engine.graphs_by_default(on_cuda)
        assert engine.device_of(int8_on_cuda).type == "cuda" and not engine.graphs_by_default(int8_on_cuda)


class EndingSamples(engine.Samples):
    """Samples that keep their token ids, each ending after ends[sample] tokens (as a stop string would end it)."""

    def __init__(self, n, tokenizer, ends):
        super().__init__(n, tokenizer, [], stream=False)
        self.tokens, self.ends = [[] for _ in range(n)], ends

    def add(self, sample, token):
        self.tokens[sample].append(token)
        return super().add(sample, token) or len(self.tokens[sample]) == self.ends.get(sample)


def odd_keys(query_pos, key_pos, config, layer, tokens, causal=model_py.can_attend):
    """can_attend with a rule of the tokens (as document masking is): a query sees, of the keys before it, those that
    hold an odd token id, and itself. Each key's token counts, so a row that read another sample's ids would differ."""
    odd_or_itself = (tokens[:, None, :] % 2 == 1) | (key_pos == query_pos)  # (B, T, S)
    return causal(query_pos, key_pos, config, layer, tokens) & odd_or_itself[:, None]  # (B, 1, T, S)


@pytest.mark.parametrize("rule", ["causal", "odd_keys"])
def test_samples_that_end_leave_each_other_sample_its_own_cache(monkeypatch, rule):
    """Once a sample ends, its batch row leaves the batch and the KV cache (engine.select_rows): every step's logits
    of each sample still going are a full forward's of its own text, so no row reads another's keys and values, nor,
    under a rule that reads the tokens, another's token ids."""
    from gpt.tokenizer import Tokenizer, char_meta
    model, prompt = random_gpt(seed=3, std=1.0), [1, 2, 3]
    if rule == "odd_keys":  # a window as long as the text: the rule is asked on every path, the one-token step's too
        monkeypatch.setattr(model_py, "can_attend", odd_keys)
        monkeypatch.setattr(model.config, "window", model.config.block_size)
    logits, next_tokens = [], engine.next_tokens
    monkeypatch.setattr(engine, "next_tokens", lambda step_logits, *args: logits.append(step_logits.clone()) or
                        next_tokens(step_logits, *args))
    samples = EndingSamples(4, Tokenizer(char_meta("abcdefgh")), ends={0: 2, 2: 5})
    settings = dict(graph_settings(4, cuda_graph=False), max_new_tokens=10, temperature=1.0)
    engine.decode_batch(model, prompt, settings, samples, torch.Generator().manual_seed(0))
    assert [len(tokens) for tokens in samples.tokens] == [2, 10, 5, 10]
    assert len({tuple(tokens) for tokens in samples.tokens[1::2]}) == 2  # the samples still going differ
    parities = [[token % 2 for token in tokens[:-1]] for tokens in samples.tokens[1::2]]
    assert parities[0] != parities[1]  # odd ids at different positions: odd_keys tells the samples still going apart
    with torch.no_grad():
        for step, batch in enumerate(logits):  # (B, V): the rows of the samples that made a token at this step
            going = [sample for sample, tokens in enumerate(samples.tokens) if len(tokens) > step]
            expected = [model(torch.tensor([prompt + samples.tokens[sample][:step]]))[0][0, -1] for sample in going]
            torch.testing.assert_close(batch, torch.stack(expected), atol=1e-5, rtol=1e-5)


def graph_settings(n, cuda_graph):
    return dict(num_samples=n, max_new_tokens=30, temperature=0.0, top_k=None, top_p=None, no_kv_cache=False,
                compile=False, cuda_graph=cuda_graph)


def test_a_graphed_decode_reads_and_writes_the_same_tensors_every_step_and_decodes_plain_greedy_text(monkeypatch):
    """A CUDA graph replays on the addresses it was captured with: every tensor the step reads or writes (its two
    inputs, the cache's keys, values and token ids, the model's weights) must keep its address at every step, across
    the sliding window's refill too (4 prompt tokens + 30 new ones pass block_size 16 twice); and the text is plain
    decoding's, token for token, for each of 2 samples."""
    from gpt.tokenizer import Tokenizer, char_meta
    tokenizer, steps = Tokenizer(char_meta("abcdefgh")), []
    model = random_gpt(0, 1.0)
    original = static_step.cuda_graph_step

    def recording(model, tokens, cache, input_pos):
        tensors = [tokens, input_pos, cache.k, cache.v, cache.tokens, cache.layer_ids, *cache.rotary,
                   *model.parameters()]
        steps.append([t.data_ptr() for t in tensors])
        return static_step.decode_step(model, tokens, cache, input_pos)

    monkeypatch.setattr(static_step, "cuda_graph_step", lambda: original(step=recording))
    texts = {}
    for cuda_graph in (True, False):
        samples = engine.Samples(2, tokenizer, [], stream=False)
        engine.decode_batch(model, [1, 2, 3, 4], graph_settings(2, cuda_graph), samples, torch.Generator())
        texts[cuda_graph] = samples.texts
    assert len(steps) == 29  # 30 tokens: the first from an eager step, before the graph is captured
    assert all(addresses == steps[0] for addresses in steps), "a tensor of the graphed step moved between steps"
    assert texts[True] == texts[False] and len(texts[True][0]) == 30 and len(set(texts[True][0])) > 1


def test_a_static_step_is_launched_before_the_previous_tokens_are_read(monkeypatch):
    """From the second step on, a static cache's new tokens are read (to the host: streamed, checked for stops) after
    the next step is launched, so that a GPU computes while the host waits and prints; the first token at once."""
    from gpt.tokenizer import Tokenizer, char_meta
    events, original = [], static_step.static_step

    def launching(*args):
        step = original(*args)
        return lambda *step_args: events.append("step") or step(*step_args)

    monkeypatch.setattr(static_step, "static_step", launching)
    samples = engine.Samples(1, Tokenizer(char_meta("abcdefgh")), [], stream=False)
    monkeypatch.setattr(samples, "add", lambda sample, token: events.append("add") and False)
    settings = dict(graph_settings(1, cuda_graph=True), max_new_tokens=4)
    engine.decode_batch(random_gpt(0, 1.0), [1, 2, 3, 4], settings, samples, torch.Generator())
    assert events == ["step", "add", "step", "step", "add", "step", "add", "add"]


def test_a_graphed_step_given_a_tensor_it_was_not_captured_with_raises():
    """What a new cache tensor after capture would do on CUDA (the graph writing the old one, silently): here, an
    error at the next call."""
    model = random_gpt(0, 1.0)
    cache, tokens = engine.prefill(model, torch.tensor([[1, 2, 3]]), 8, static=True)
    step, input_pos = static_step.cuda_graph_step(), torch.tensor([cache.pos])
    with torch.inference_mode():
        expected = step(model, tokens, cache, input_pos)
        torch.testing.assert_close(step(model, tokens, cache, input_pos), expected)  # the same tensors: runs again
        cache.k = cache.k.clone()
        with pytest.raises(RuntimeError, match="input moved"):
            step(model, tokens, cache, input_pos)


# ----------------------------------------------------------------------------------------------------
# The attention kernel of a CPU decode step


def attention_ops_of_a_decode_step(dtype):
    """The aten attention ops one decode_step of a tiny model in dtype runs on the CPU, and its logits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recording(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "attention" in func.__name__ or "softmax" in func.__name__:
                self.ops.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    model = random_gpt(0, 0.5).to(dtype)
    cache = model.new_kv_cache(1, 16, static=True)
    with torch.no_grad():
        model.hidden_states(torch.tensor([[1, 2, 3]]), cache, torch.arange(3))
        with Recording() as recording:
            logits = static_step.decode_step(model, torch.tensor([[4]]), cache, torch.tensor([3]))
    return recording.ops, logits


def test_a_float16_cpu_decode_step_runs_sdpas_math_kernel_and_the_same_attention():
    """torch's CPU flash kernel is slow in float16 (static_step.decode_attention): the step runs SDPA's math kernel
    there, and computes what the flash kernel does; float32 keeps the flash kernel."""
    ops, logits = attention_ops_of_a_decode_step(torch.float16)
    assert not any("flash" in op for op in ops) and any("softmax" in op for op in ops)  # the formula, op by op
    float32_ops, float32_logits = attention_ops_of_a_decode_step(torch.float32)
    assert any("flash" in op for op in float32_ops)
    torch.testing.assert_close(logits.float(), float32_logits, atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------------------------------
# Prompt lookup's proposals


@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 9, 1, 2, 3], 4, [9, 1, 2, 3]),  # the last 3 tokens occurred before: what followed them
    ([1, 2, 3, 9, 5, 2, 3], 4, []),  # only the last 2 did
    ([6, 4, 2, 7, 6, 4, 2, 8, 6, 4, 2], 2, [8, 6]),  # the latest earlier occurrence
    ([6, 4, 2, 7, 1, 6, 4, 2, 6, 4, 2], 4, [7, 1, 6, 4]),  # ... that has k tokens after it
    ([5, 5, 5, 5, 5, 5], 3, [5, 5, 5]),  # a loop of one token: k tokens, not the one token just before
    ([1, 2, 3, 4], 2, []),  # nothing recurs
    ([7, 7, 7], 3, []),  # too short to recur
])
def test_lookup_proposes_what_followed_the_last_tokens_earlier(tokens, k, expected):
    assert speculative.lookup_proposal(tokens, k) == expected
