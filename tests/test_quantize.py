"""Tests for quantize.py and the --quantize / --dtype modes of sample.py and eval.py: int8 weights round-trip within
half a quantization step of their row's scale; the weight-only int8 layer computes with its dequantized weight,
each row independently of the others (its activations are never quantized); quantize() replaces every linear layer
(the tied head too) and the model still runs every decoding path of engine.py with every eager kernel kernels.py
may choose; int8, bfloat16 and float16 logits stay within measured tolerances of float32, and int8 costs under
0.1% of the held-out log-likelihood; greedy text is reproducible, and int8 on a CPU, compiled by default, decodes
with real inductor what it decodes eager, in one graph whose int8 weights are read as int8 (a reduction, never a
float copy into a matrix product; on a GPU the same is shown by tracing); speculative decoding stays exact with a
quantized draft (greedy token for token, sampling in distribution); and a mode that cannot run is a one-line error.

The model is a tiny character GPT trained here for a few seconds (its logits mean something, a random model's do
not); its snapshot from earlier in training is the draft; the tests that compile with real inductor decode a one-layer
GPT trained alike (its step compiles faster). float32's compiled greedy text against its eager one, with real
inductor, is test_sample.py's (test_compiled_greedy_with_inductor_in_a_separate_process).
"""

import copy
import json
import os
import re
import runpy
import subprocess
import sys
from dataclasses import asdict
from math import prod

import pytest
import torch
import torch.nn as nn

import eval as evaluate
import sample
from gpt import engine, kernels, speculative, static_step
from gpt.quantize import Int8WeightOnlyLinear, W8A8Linear, quantize, quantize_rows, replace_linears
from gpt.tokenizer import Tokenizer, char_meta
from model import GPT, GPTConfig
from test_engine import (ALPHA, SPEC_PROMPT, V, chi_square, chi_square_threshold, first_two_token_probs, spec_models,
                         speculative_counts)

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
# On the CPU whatever TEST_DEVICE: the runs below measure the CPU's int8 (Int8WeightOnlyLinear and kernels.py's
# decode kernels, eager and compiled); the tests that take the `device` fixture run on TEST_DEVICE.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 64
HELD_OUT = 4000  # the last characters of Tiny Shakespeare, never trained on
PROMPT = "KING HENRY:\nO"
ACCEPTANCE = re.compile(r"draft acceptance rate [\d.]+% \((\d+)/(\d+)\)")


@pytest.fixture(scope="module", autouse=True)
def int4_process(tmp_path_factory):
    """sample.py --quantize=int4 as a script, started first: its seconds of `import torch` overlap the training."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "sample.py"), "--quantize=int4", "--device=cpu"],
                            cwd=tmp_path_factory.mktemp("cwd"), env=dict(os.environ, OMP_NUM_THREADS="1"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def train_char_gpt(data, vocab_size, n_layer, snapshot_at=None):
    """A character GPT with a tied head, trained from seed 0 for 250 AdamW steps; and its snapshot at step
    snapshot_at (None: none)."""
    snapshot = None
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=vocab_size, block_size=BLOCK, n_layer=n_layer, n_head=2, n_kv_head=1,
                              n_embd=64))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(250):
            if step == snapshot_at:
                snapshot = copy.deepcopy(model).eval()
            starts = torch.randint(len(data) - BLOCK, (16,)).tolist()
            x, y = (torch.stack([data[s + i:s + i + BLOCK] for s in starts]) for i in (0, 1))
            optimizer.zero_grad()
            model(x, y)[1].backward()
            optimizer.step()
    return model.eval(), snapshot


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A two-layer character GPT (train_char_gpt: ~4 s; loss ~1.9), its snapshot at step 100 as the draft (they agree
    often, not always), and a one-layer GPT trained alike (~2 s), each saved as a checkpoint; and the held-out text.
    The tests that compile with real inductor decode the one-layer model: its step compiles in about 60% of the
    two-layer one's time (4.3 s against 7 s, cold, on 2 cores), and each of them compiles one or two."""
    with open(os.path.join(ROOT, "data", "shakespeare", "input.txt"), encoding="utf-8") as f:
        text = f.read()
    meta = char_meta(text)
    tokenizer = Tokenizer(meta)
    data = torch.tensor(tokenizer.encode(text[:-HELD_OUT]))
    model, draft = train_char_gpt(data, meta["vocab_size"], n_layer=2, snapshot_at=100)
    one_layer, _ = train_char_gpt(data, meta["vocab_size"], n_layer=1)
    paths = {}
    for name, m in (("target", model), ("draft", draft), ("one_layer", one_layer)):
        paths[name] = str(tmp_path_factory.mktemp(name) / "ckpt.pt")
        torch.save({"model": m.state_dict(), "model_config": asdict(m.config), "meta": meta}, paths[name])
    held_out = tmp_path_factory.mktemp("text") / "held_out.txt"
    held_out.write_text(text[-HELD_OUT:], encoding="utf-8")
    return dict(model=model, one_layer_model=one_layer, tokenizer=tokenizer, held_out=str(held_out),
                held_out_ids=tokenizer.encode(text[-HELD_OUT:]), **paths)


def int8(model, scheme="int8"):
    return quantize(copy.deepcopy(model), scheme)


# ----------------------------------------------------------------------------------------------------
# Int8WeightOnlyLinear and quantize()


def test_int8_weights_round_trip_within_half_a_step_of_their_rows_scale():
    """Rows whose magnitudes span 1e-4 to 10 (and a zero row): a scale per tensor would lose the small rows."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, bias=True))
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                layer.weight.mul_(10 ** torch.empty(layer.out_features, 1).uniform_(-4, 1))
        model.layers[0].mlp.down_proj.weight[3] = 0
    originals = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    quantize(model, "int8")
    for name, weight in originals.items():
        dequantized = model.get_submodule(name).dequantized_weight()
        absmax = weight.abs().amax(dim=1, keepdim=True)
        step = absmax / 127  # the row's scale
        assert ((dequantized - weight).abs() <= step / 2 + 1e-6 * absmax).all(), name
        steps = dequantized / step.clamp(min=1e-30)  # whole numbers of the row's step: the scale is absmax / 127
        torch.testing.assert_close(steps, steps.round(), atol=1e-3, rtol=0)
        assert steps.abs().amax(dim=1).tolist() == pytest.approx([127.0 if m > 0 else 0.0 for m in absmax[:, 0]])


def test_an_int8_linear_computes_with_its_dequantized_weight_and_its_bias(device):
    """Nothing of the activations is quantized: the one difference from the dequantized weight's product is where the
    scale is applied (after the product, not before), float rounding (measured 4e-7 of outputs up to 1.6)."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    layer, x = Int8WeightOnlyLinear(linear).to(device), torch.randn(5, 64)
    assert layer.weight.dtype == torch.int8 and layer.weight.shape == (48, 64) and layer.scales.shape == (48,)
    assert (layer.in_features, layer.out_features) == (64, 48)
    expected = nn.functional.linear(x.double(), layer.dequantized_weight().cpu().double(), linear.bias.double())
    torch.testing.assert_close(layer(x.to(device)).cpu().double(), expected, atol=1e-5, rtol=1e-5)


def test_an_int8_linear_keeps_the_models_dtype():
    """A bfloat16 model's int8 layer holds its scales and bias in bfloat16 and returns bfloat16: the model's dtype."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(torch.bfloat16)
    layer, x = Int8WeightOnlyLinear(linear), torch.randn(5, 64, dtype=torch.bfloat16)
    assert layer.scales.dtype == layer.bias.dtype == torch.bfloat16 and layer.weight.dtype == torch.int8
    y = layer(x)
    assert y.dtype == torch.bfloat16
    expected = nn.functional.linear(x.double(), layer.dequantized_weight().double(), linear.bias.double())
    torch.testing.assert_close(y.double(), expected, atol=0.05, rtol=0.02)  # bfloat16 rounding: measured 0.006


def test_an_int8_linear_computes_each_row_independently_of_the_others():
    """A large row in the batch must not change a small row's result: it would if the activations were quantized
    per call (with one scale for the whole input, as fbgemm's dynamic int8 did), and greedy speculative decoding,
    whose chunks hold several rows, would no longer equal plain greedy."""
    torch.manual_seed(0)
    layer, x = Int8WeightOnlyLinear(nn.Linear(64, 32)), torch.randn(1, 64)
    torch.testing.assert_close(layer(torch.cat([x, 100 * torch.randn(1, 64)]))[:1], layer(x), atol=1e-5, rtol=0)


def test_w8a8_rows_are_quantized_each_on_its_own_grid():
    """Rows whose magnitudes span 1e-6 to 1e3, and a zero row: each row's largest magnitude maps to 127 and every
    value lands within half of its own row's step (one scale for all rows would zero the small ones)."""
    torch.manual_seed(0)
    x = torch.randn(5, 1, 64) * torch.tensor([1e-6, 1e-2, 1.0, 1e3, 0.0])[:, None, None]
    rows, scales = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == x.shape and scales.shape == (5, 1, 1)
    assert rows.abs().amax(dim=-1).flatten().tolist() == [127, 127, 127, 127, 0]
    assert ((rows.float() * scales - x).abs() <= scales / 2 + 1e-6 * x.abs().amax(-1, keepdim=True)).all()


def test_a_w8a8_linear_is_the_product_of_its_quantized_rows_and_weights_plus_its_bias(device):
    """y = (x_int8 W_int8^T) * x_scale * w_scale + b: the dequantized rows times the dequantized weight, up to float
    rounding (the sums themselves are whole numbers); and within the two quantizations of the float layer."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    layer, x = W8A8Linear(linear).to(device), torch.randn(5, 64)
    assert layer.weight.dtype == torch.int8 and layer.scales.dtype == torch.float32 and layer.scales.shape == (48,)
    rows, scales = quantize_rows(x)
    expected = nn.functional.linear((rows.double() * scales.double()), layer.dequantized_weight().cpu().double(),
                                    linear.bias.double())
    actual = layer(x.to(device)).cpu()
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-5)
    error = (actual - linear(x)).abs().max() / linear(x).abs().max()
    assert 0 < error < 0.03  # two 8-bit roundings: measured 0.0098


def test_a_w8a8_linear_keeps_the_models_dtype_and_computes_each_row_independently_of_the_others():
    """A bfloat16 model's layer returns bfloat16. A large row in the batch leaves a small row's result exactly as it
    was alone: each row has its own scale and integer sums do not depend on their order, which is what keeps
    greedy speculative decoding (chunks of several rows) equal to plain greedy."""
    torch.manual_seed(0)
    layer = W8A8Linear(nn.Linear(64, 32).to(torch.bfloat16))
    assert layer(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
    layer, x = W8A8Linear(nn.Linear(64, 32)), torch.randn(1, 64)
    assert torch.equal(layer(torch.cat([x, 100 * torch.randn(3, 64)]))[:1], layer(x))


@pytest.mark.parametrize("rows", [1, 8])
def test_compiled_on_a_gpu_a_one_row_product_reads_int8_weights(rows):
    """What inductor makes of Int8WeightOnlyLinear under static_step.CUDA_COMPILE_OPTIONS, traced with its own
    decompositions on the meta device (any device but the CPU and MPS counts as a GPU to them). One row (batch-1
    decoding): the product becomes multiply-and-sum, a reduction that takes the int8-to-bf16 cast into its kernel, so
    the weights are read as int8. Several rows: a matrix multiplication of a bf16 copy of the weight made each step
    (docs/sampling.md says int8 pays at batch 1 only)."""
    from torch._inductor import config
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    layer = Int8WeightOnlyLinear(nn.Linear(64, 32, bias=False).to(torch.bfloat16)).to("meta")
    x = torch.empty(1, rows, 64, device="meta", dtype=torch.bfloat16)
    with config.patch(static_step.CUDA_COMPILE_OPTIONS):
        graph = make_fx(layer, decomposition_table=select_decomp_table())(x).graph
    ops = [str(node.target) for node in graph.nodes if node.op == "call_function"]
    if rows == 1:
        assert "aten.mm.default" not in ops and "aten.sum.dim_IntList" in ops, ops
    else:
        assert "aten.mm.default" in ops, ops


def test_quantize_replaces_every_linear_with_the_tied_head_and_keeps_the_embedding(trained):
    model = trained["model"]
    quantized = int8(model)
    assert not any(isinstance(m, nn.Linear) for m in quantized.modules())
    layers = [m for m in quantized.modules() if isinstance(m, Int8WeightOnlyLinear)]
    assert len(layers) == 2 * 7 + 1  # q k v o gate up down, and the head
    assert isinstance(quantized.lm_head, Int8WeightOnlyLinear) and quantized.lm_head.weight.dtype == torch.int8
    assert quantized.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(quantized.embed_tokens.weight, model.embed_tokens.weight)


# ----------------------------------------------------------------------------------------------------
# Each mode against float32


INT8_TOLERANCE = 0.25  # max |logit error|, logits spanning -7 to 8; measured 0.067 (0.055 along the decode paths)
EAGER_KERNELS = [name for name in kernels.KERNELS if name not in kernels.COMPILED_ONLY]


def force_kernel(monkeypatch, eager, compiled="reduction"):
    """kernels.fastest_kernel answers `eager` for eager steps (None: what this machine measures) and `compiled` for
    compiled ones: which kernel is fastest depends on the machine, and each test here is about one of them."""
    measured = kernels.fastest_kernel
    monkeypatch.setattr(kernels, "fastest_kernel", lambda layers, rows, is_compiled: compiled if is_compiled else (
        eager or measured(layers, rows, is_compiled)))


W8A8_KERNELS = {1: "int-mm", 5: "onednn-int8"}  # at one row, and at --draft=lookup's checks of draft_k + 1 rows


def force_w8a8_kernels(monkeypatch, trained):
    """The int8-rows kernels, eager and compiled, where they are exact here (torch's _int_mm for one row, oneDNN's
    packed product for more; what an AMD EPYC measures fastest), else the layer's own product."""
    layer = int8(trained["one_layer_model"], "w8a8").lm_head
    monkeypatch.setattr(kernels, "fastest_kernel", lambda layers, rows, compiled: W8A8_KERNELS[rows] if
                        W8A8_KERNELS[rows] in kernels.usable_kernels(layer, rows, compiled) else "torch")


@pytest.mark.parametrize("path, n, kernel", [("generate", 1, None)] +
                         [("decode_batch", n, kernel) for n in (1, 8) for kernel in EAGER_KERNELS])
def test_int8_kv_cache_decoding_runs_and_gives_logits_close_to_fp32(trained, monkeypatch, path, n, kernel):
    """decode_batch with each eager kernel decode_linears may choose on a CPU (forced: which is fastest depends on
    the machine), at batch 1 and 8: each is handed the int8 weight and the layer scales its rows afterwards
    ("torch" leaves the layers' own forward)."""
    model, tokenizer = trained["model"], trained["tokenizer"]
    quantized, steps, prompt = int8(model), [], tokenizer.encode(PROMPT)
    if kernel in ("onednn-packed", "onednn-int8", "int-mm"):  # float weights, or int8 rows, only: never measured
        assert kernel not in kernels.usable_kernels(quantized.lm_head, n, compiled=False)
        return
    if kernel and kernel not in kernels.usable_kernels(quantized.lm_head, n, compiled=False):
        assert kernel == "onednn" and not torch.backends.mkldnn.is_available()  # the one a build may lack
        pytest.skip("this torch build has no oneDNN")
    force_kernel(monkeypatch, kernel)
    quantized.lm_head.register_forward_hook(lambda module, args, logits: steps.append(logits.expand(n, -1)))
    if path == "generate":
        tokens = quantized.generate(torch.tensor([prompt]), 40, temperature=0)
    else:
        settings = dict(num_samples=n, max_new_tokens=40, temperature=1.0, top_k=None, top_p=None, no_kv_cache=False,
                        compile=False)
        samples = engine.Samples(n, tokenizer, [], stream=False)
        engine.decode_batch(quantized, prompt, settings, samples, torch.Generator().manual_seed(0))
        tokens = torch.tensor([prompt + tokenizer.encode(text) for text in samples.texts])
    assert tokens.shape == (n, len(prompt) + 40) and len(steps) == 40
    with torch.no_grad():
        expected = model(tokens[:, :-1])[0][:, len(prompt) - 1:]  # fp32, the whole sequence at once
    error = (torch.stack(steps, 1) - expected).abs().max()
    assert 0 < error < INT8_TOLERANCE


@pytest.mark.parametrize("mode, tolerance", [
    ("int8", INT8_TOLERANCE),
    ("w8a8", INT8_TOLERANCE),  # measured 0.12
    ("bfloat16", 0.15),  # measured 0.064
    ("float16", 0.03),  # measured 0.006 (0.013 on two threads)
])
def test_each_mode_gives_logits_close_to_fp32(trained, mode, tolerance):
    model = trained["model"]
    inputs = torch.tensor(trained["held_out_ids"][:4 * BLOCK]).view(4, BLOCK)
    other = int8(model, mode) if mode in ("int8", "w8a8") else copy.deepcopy(model).to(getattr(torch, mode))
    with torch.no_grad():
        expected, actual = model(inputs)[0], other(inputs)[0]
    assert actual.dtype == (torch.float32 if mode in ("int8", "w8a8") else getattr(torch, mode))
    error = (actual.float() - expected).abs().max()
    assert 0 < error < tolerance
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean() > 0.95  # measured 0.973 (w8a8), 0.984 (int8) to 1.0


@pytest.mark.parametrize("scheme", ["int8", "w8a8"])
def test_int8_changes_the_held_out_log_likelihood_by_under_a_tenth_of_a_percent(trained, tmp_path, capsys, scheme):
    def loss(*extra):
        evaluate.main([f"--out_dir={trained['target']}", f"--text={trained['held_out']}", "--device=cpu",
                       f"--out_json={tmp_path / 'figures.json'}", *extra])
        return json.loads((tmp_path / "figures.json").read_text())["text"]["loss"]  # -mean log p, nats per token

    fp32, int8_loss = loss(), loss(f"--quantize={scheme}")
    assert 0 < abs(int8_loss / fp32 - 1) < 0.001  # measured 0.005% both (fbgemm's dynamic int8: 0.04%)


# ----------------------------------------------------------------------------------------------------
# sample.py in each mode


def greedy(capsys, trained, *extra, checkpoint="target"):
    capsys.readouterr()
    sample.main([f"--out_dir={trained[checkpoint]}", f"--prompt={PROMPT}", "--temperature=0", "--max_new_tokens=100",
                 "--device=cpu", *extra])
    return capsys.readouterr()


def record_models(monkeypatch, name, module=sample):
    """(head type, dtype) of the models sample.main hands to `name` (decode_batch, or speculative.py's
    decode_speculative, which sample.py imports where it calls it), and settings["compile"], per call."""
    calls, decode = [], getattr(module, name)

    def recording(*args):
        settings = next(arg for arg in args if isinstance(arg, dict))
        calls.append(([(type(m.lm_head), m.embed_tokens.weight.dtype) for m in args if isinstance(m, GPT)],
                      settings["compile"]))
        return decode(*args)
    monkeypatch.setattr(module, name, recording)
    return calls


@pytest.mark.parametrize("mode, head, dtype, compiled", [
    ("--quantize=int8", Int8WeightOnlyLinear, torch.float32, True),  # int8 on a CPU is compiled by default
    ("--quantize=w8a8", W8A8Linear, torch.float32, True),
    ("--dtype=bfloat16", nn.Linear, torch.bfloat16, False)], ids=["int8", "w8a8", "bf16"])
def test_greedy_text_in_each_mode_is_the_same_run_to_run(trained, capsys, monkeypatch, mode, head, dtype, compiled):
    """Two runs of the one-layer model in this process, each compiling its step where the mode compiles by default.
    The compiled kernels are forced to those the inductor tests below compile (int8: the reduction; w8a8: the
    int8-rows kernels), so that each mode's step is compiled once for both tests (inductor's cache) and not once per
    candidate kernel: measuring them compiled costs an inductor compile each, and the second run would reuse the
    first run's choice all the same (kernels.choices). sample.py measuring them compiled is bench/gpu_check.py's int8
    and w8a8 rows (on the CPU in tests/test_gpu_check.py)."""
    if mode == "--quantize=int8":
        force_kernel(monkeypatch, eager=None)
    elif mode == "--quantize=w8a8":
        force_w8a8_kernels(monkeypatch, trained)
    decoded = record_models(monkeypatch, "decode_batch")
    first = greedy(capsys, trained, mode, checkpoint="one_layer").out
    assert len(first) == len(PROMPT) + 100 + 1
    assert greedy(capsys, trained, mode, checkpoint="one_layer").out == first
    assert decoded == [([(head, dtype)], compiled)] * 2  # the mode was applied, and compile's default for it


def test_quantize_int8_applies_to_the_draft_too(trained, capsys, monkeypatch):
    decoded = record_models(monkeypatch, "decode_speculative", speculative)
    greedy(capsys, trained, "--quantize=int8", f"--draft={trained['draft']}", "--max_new_tokens=5")
    assert [models for models, _ in decoded] == [[(Int8WeightOnlyLinear, torch.float32)] * 2]  # the target, the draft


def test_speculative_greedy_with_an_int8_draft_is_the_fp32_targets_greedy_text(trained, capsys, monkeypatch):
    plain = greedy(capsys, trained).out
    load_model = speculative.load_model

    def load_int8_draft(source, *args):  # speculative.load_draft's load
        model, meta, dataset = load_model(source, *args)
        return (int8(model) if source == trained["draft"] else model), meta, dataset
    monkeypatch.setattr(speculative, "load_model", load_int8_draft)
    decoded = record_models(monkeypatch, "decode_speculative", speculative)
    for draft_k in (1, 3, 7):
        spec = greedy(capsys, trained, f"--draft={trained['draft']}", f"--draft_k={draft_k}")
        assert spec.out == plain
        accepted, proposed = map(int, ACCEPTANCE.search(spec.err).groups())
        assert 0 < accepted < proposed  # the draft is right sometimes, not always: both paths ran
    fp32_target_int8_draft = [(nn.Linear, torch.float32), (Int8WeightOnlyLinear, torch.float32)]
    assert [models for models, _ in decoded] == [fp32_target_int8_draft] * 3


@pytest.mark.parametrize("scheme", ["int8", "w8a8"])
def test_speculative_greedy_with_int8_on_both_is_the_int8_targets_greedy_text(trained, capsys, scheme):
    """The target scores the draft's k + 1 tokens in one chunk: each row must come out as it would alone (w8a8: its
    rows quantized each on its own grid). Both eager (decode_speculative compiles nothing); prompt lookup's chunks,
    compiled, are test_w8a8_compiled...'s; compiled against eager is test_int8_on_a_cpu_compiles_by_default...'s."""
    plain = greedy(capsys, trained, f"--quantize={scheme}", "--compile=False").out
    for draft_k in (1, 3, 7):
        assert greedy(capsys, trained, f"--quantize={scheme}", f"--draft={trained['draft']}",
                      f"--draft_k={draft_k}").out == plain, draft_k


def test_speculative_sampling_with_an_int8_draft_follows_the_fp32_target():
    """test_engine.py's chi-square test of the first two tokens (k=2, 1000 runs, ~2 s), with the draft in int8."""
    target, draft = spec_models()
    quantize(draft, "int8")
    p1, p12 = first_two_token_probs(target, SPEC_PROMPT)
    q1, _ = first_two_token_probs(draft, SPEC_PROMPT)
    assert 0.5 * (p1 - q1).abs().sum() > 0.25  # far apart: a wrong acceptance rule would show
    counts, steps = speculative_counts(target, draft, SPEC_PROMPT, 2, 1000, seed=1236)
    assert 1100 < steps < 1900  # some proposals rejected, some accepted
    for observed, p in ((counts.view(V, V).sum(1), p1), (counts, p12)):
        stat, df = chi_square(observed, p)
        assert stat < chi_square_threshold(df, ALPHA / 2), f"chi-square {stat:.1f} on {df} df"


# ----------------------------------------------------------------------------------------------------
# Compiled: the text eager decodes, and on a CPU the int8 weights read as int8


def counting_compiles(monkeypatch, backend):
    """torch.compile of static_step.decode_step through `backend` (a name), each graph it is given recorded; the other
    compilations (kernels.measure's) as they are. Returns the list of graphs."""
    graphs, torch_compile = [], torch.compile

    def counting_backend(graph_module, example_inputs, **kwargs):  # kwargs: static_step.CUDA_COMPILE_OPTIONS on CUDA
        graphs.append(graph_module)
        return torch._dynamo.lookup_backend(backend)(graph_module, example_inputs)

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: torch_compile(
        fn, **({**kwargs, "backend": counting_backend} if fn.__name__ == "decode_step" else kwargs)))
    torch._dynamo.reset()  # nothing compiled earlier is reused
    return graphs


@pytest.fixture
def fresh_dynamo():
    """Dynamo's compiled code and guards reset after the test: no later test reuses them."""
    yield
    torch._dynamo.reset()


def test_a_weight_only_int8_model_decodes_the_same_compiled_as_eager(trained, monkeypatch, fresh_dynamo, device):
    """--quantize=int8 --compile=True runs this model through the compiled static-cache step (on CUDA as CUDA graphs;
    on a CPU with decode_linears' reduction, forced here): it must trace in one graph (fullgraph) and decode what the
    eager model decodes, the window sliding once. aot_eager here: dynamo and AOT autograd, what inductor is given, on
    TEST_DEVICE; real inductor is the next test's, on the CPU."""
    model = replace_linears(copy.deepcopy(trained["model"]).to(device), Int8WeightOnlyLinear)
    force_kernel(monkeypatch, eager=None)
    graphs = counting_compiles(monkeypatch, "aot_eager")
    prompt = trained["tokenizer"].encode(PROMPT)
    texts = []
    for compile in (False, True):
        samples = engine.Samples(1, trained["tokenizer"], [], stream=False)
        settings = dict(num_samples=1, max_new_tokens=BLOCK + 10, temperature=0.0, top_k=None, top_p=None,
                        no_kv_cache=False, compile=compile)
        engine.decode_batch(model, prompt, settings, samples, torch.Generator(device).manual_seed(0))
        texts.append(samples.texts[0])
    assert len(graphs) == 1 and texts[1] == texts[0] and len(texts[0]) == BLOCK + 10


def test_int8_on_a_cpu_compiles_by_default_with_inductor_and_decodes_what_eager_decodes(trained, capsys, monkeypatch,
                                                                                        fresh_dynamo):
    """sample.py --quantize=int8 on a CPU compiles its step by default (eager, every step would make a float copy
    of every weight). With real inductor, the one-layer model's greedy text (100 tokens, the window sliding) must be
    its own --compile=False run's, from one graph, whose generated code reads the int8 weights in its loops and
    allocates no float buffer the size of any weight (no copy) and calls no matrix product. The compiled kernel is
    forced to the reduction (what decode_linears measures fastest compiled on the CPUs this ran on) so that every
    machine tests it. ~12 s alone in a fresh process on 2 cores (a cold inductor cache); under 1 s after the int8
    run-to-run test compiled the step."""
    from torch._inductor.graph import GraphLowering

    force_kernel(monkeypatch, eager=None)
    graphs, codes = counting_compiles(monkeypatch, "inductor"), []
    monkeypatch.setattr(GraphLowering, "save_output_code", codes.append)  # as torch._inductor.utils.run_and_get_code
    eager = greedy(capsys, trained, "--quantize=int8", "--compile=False", checkpoint="one_layer").out
    assert graphs == [] and codes == []
    assert greedy(capsys, trained, "--quantize=int8", checkpoint="one_layer").out == eager
    assert len(graphs) == 1 and codes
    smallest = min(m.weight.numel() for m in int8(trained["one_layer_model"]).modules()
                   if isinstance(m, Int8WeightOnlyLinear))
    for code in codes:
        shapes = re.findall(r"empty_strided_cpu\(\(([\d, ]*)\)", code)  # every buffer the step allocates
        allocated = [prod(map(int, re.findall(r"\d+", shape))) for shape in shapes]
        assert allocated and max(allocated) < smallest, allocated
        assert "const int8_t*" in code and "extern_kernels.mm" not in code and "extern_kernels.addmm" not in code


@pytest.mark.parametrize("lookup", [False, True], ids=["plain", "prompt_lookup"])
def test_w8a8_compiled_with_inductor_decodes_what_eager_decodes(trained, capsys, monkeypatch, fresh_dynamo, lookup):
    """sample.py --quantize=w8a8 compiles by default on a CPU. With real inductor, the one-layer model's greedy text
    (100 tokens, the window sliding) must be its own --compile=False run's, plain and with --draft=lookup, whose checks
    of draft_k + 1 rows run the multi-row kernel. The kernels are forced to the int8-rows ones (force_w8a8_kernels).
    Plain: one graph, the one the w8a8 run-to-run test compiled (inductor's cache: ~1 s after it); lookup: one more,
    draft_k + 1 rows (its one-row step is plain decoding's, from the cache), a test of its own."""
    force_w8a8_kernels(monkeypatch, trained)
    draft = ["--draft=lookup"] if lookup else []
    eager = greedy(capsys, trained, "--quantize=w8a8", "--compile=False", checkpoint="one_layer").out
    assert greedy(capsys, trained, "--quantize=w8a8", *draft, checkpoint="one_layer").out == eager


@pytest.mark.parametrize("rows", [1, 4])
def test_compiled_on_a_cpu_int8_weights_go_into_a_reduction_not_a_float_copy(trained, monkeypatch, fresh_dynamo, rows):
    """The decode step as inductor is given it (dynamo, then AOT autograd with inductor's decompositions), a batch of
    1 or 4, under decode_linears(compiled=True) with the reduction kernel: each of the 15 int8 weights is cast and
    multiplied by each input row, and the products summed, a reduction whose loop inductor fuses the cast into (the
    previous test shows the generated code); never handed to a matrix product (which would take a float copy of the
    weight made each step). Cheap: no code generated (~1 s)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    model, graphs = int8(trained["model"]), []
    force_kernel(monkeypatch, eager="torch", compiled="reduction")
    backend = aot_autograd(fw_compiler=lambda graph_module, inputs: graphs.append(graph_module) or graph_module.forward,
                           decompositions=select_decomp_table())
    torch._dynamo.reset()
    cache = model.new_kv_cache(rows, BLOCK, static=True)
    with torch.inference_mode(), kernels.decode_linears(model, rows, compiled=True):
        step = torch.compile(static_step.decode_step, backend=backend, fullgraph=True, dynamic=False)
        step(model, torch.zeros(rows, 1, dtype=torch.long), cache, torch.zeros(1, dtype=torch.long))
    (graph,) = [graph_module.graph for graph_module in graphs]
    weights = [node for node in graph.nodes if node.op == "placeholder" and node.meta["val"].dtype == torch.int8]
    assert len(weights) == 2 * 7 + 1
    aten = torch.ops.aten
    products = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.mv.default)
    for weight in weights:
        reached, frontier, sums = set(), [weight], 0
        while frontier:  # what the weight flows into, up to the reductions that consume it
            node = frontier.pop()
            for user in node.users:
                assert user.target not in products, f"{weight} reaches {user.target}"
                if user.target == aten.sum.dim_IntList:
                    sums += 1
                elif user not in reached:
                    reached.add(user)
                    frontier.append(user)
        assert sums == rows, (weight, sums)  # one multiply-and-sum per input row


# ----------------------------------------------------------------------------------------------------
# What cannot run: one line, what to do, no traceback


BAD_MODES = {  # name: (arguments, words the message must contain)
    "unknown_scheme": (["--quantize=int4"], ["quantize must be one of int8", "'int4'"]),
    "bfloat16_on_a_gpu_without_it": (["--dtype=bfloat16", "--device=cuda"], ["Fake GPU", "--dtype=float16"]),
}


@pytest.mark.parametrize("script, name", [(script, name) for script in ("sample", "eval") for name in BAD_MODES])
def test_a_mode_that_cannot_run_is_a_one_line_error(trained, monkeypatch, capsys, fake_cuda, script, name):
    args, needles = BAD_MODES[name]
    if "--device=cuda" in args:
        fake_cuda((7, 5))  # a GPU without bfloat16
    path = os.path.join(ROOT, f"{script}.py")
    monkeypatch.setattr(sys, "argv", [path, f"--out_dir={trained['target']}", *args])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(path, run_name="__main__")
    message = e.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    assert all(needle in message for needle in needles), message
    assert capsys.readouterr().out == ""  # before any output


def test_an_unknown_scheme_in_a_separate_process_is_one_line_without_traceback(int4_process):
    stdout, stderr = int4_process.communicate(timeout=120)
    assert int4_process.returncode != 0 and "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "int4" in lines[0], stderr
    assert stdout == ""


@pytest.mark.parametrize("script", [sample, evaluate], ids=["sample", "eval"])
def test_w8a8_off_the_cpu_is_refused_before_the_model_loads(fake_cuda, mps_present, script, tmp_path):
    """w8a8's int8 products have kernels on a CPU only: on a GPU its layers would multiply a float32 copy of every
    weight each step, slower than plain float32, so sample.py and eval.py say so instead (CUDA faked at torch's C
    boundary; no checkpoint needed: the refusal comes first). int8 gets past the check to the missing checkpoint."""
    from gpt import UserError
    fake_cuda()
    for device in ("cuda", "mps"):
        with pytest.raises(UserError, match=rf"^--quantize=w8a8 is a CPU mode \(on {device} it would multiply a "
                                                r"float32 copy of every weight each step\); use --quantize=int8 there$"):
            script.main([f"--out_dir={tmp_path}", f"--device={device}", "--quantize=w8a8"])
    with pytest.raises(Exception, match="no checkpoint at"):
        script.main([f"--out_dir={tmp_path}", "--device=cuda", "--quantize=int8"])
