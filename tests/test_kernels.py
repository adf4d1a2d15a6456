"""Tests for kernels.py, the choice of the kernel that multiplies decode-sized inputs by each weight on a CPU: every
candidate computes nn.Linear's product (int8 weights included); a candidate that fails or disagrees is never
chosen; the fastest is chosen (timed by a fake clock here: a test cannot time a real machine reliably); a choice
is remembered in kernels.json and trusted only on the machine, torch and thread count it was measured with; a
cache folder that cannot be written costs one line, not the run; and decode_linears applies the choice by swapping
each linear layer for a DecodeLinear that print(model) shows (nothing patched), only inside its block, only to
decode-sized inputs, and a compiled-only kernel only while compiling."""

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt import kernels
from gpt.cpuinfo import cpu_flags
from gpt.quantize import Int8WeightOnlyLinear, W8A8Linear, replace_linears
from model import GPT, GPTConfig
from conftest import finished


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A fresh cache folder and no choices of this process's: each test measures or reads for itself."""
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "choices", {})
    monkeypatch.setattr(kernels, "said", set())
    return tmp_path / "cache"


def tiny_model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=16)).eval()


def linears_of(model):
    return [m for m in model.modules() if kernels.is_decode_linear(m)]


INT8_ONLY, FLOAT_ONLY = ("int8pack", "int8-words"), ("onednn-packed",)  # each takes one kind of weight
NOT_FLOAT32 = ("avx2",)  # int8 and 16-bit weights only: float32 ones it would read no faster than torch does
INT8_ROWS = ("onednn-int8", "int-mm")  # the kernels for int8 rows (a W8A8Linear's) and int8 weights only
ONEDNN = ("onednn", "onednn-packed")  # the kernels a torch build may lack


def has_avx2():
    """Whether gpt/avx2.py's kernels run here (an x86 CPU with AVX2, FMA and F16C: CI's, and nearly every x86 since
    2015)."""
    return {"avx2", "fma", "f16c"} <= set(cpu_flags())


def has_vnni():
    """Whether this CPU has int8 dot products (AVX-512 VNNI or AVX-VNNI), which oneDNN's int8 products need to be exact."""
    return bool({"avx512_vnni", "avx_vnni"} & set(cpu_flags()))


@pytest.mark.parametrize("name", [name for name in kernels.KERNELS if name not in INT8_ONLY + INT8_ROWS + NOT_FLOAT32])
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_every_kernel_computes_the_linear_layers_product_in_the_inputs_shape(name, rows, bias):
    torch.manual_seed(0)
    layer, x = nn.Linear(48, 80, bias=bias), torch.randn(rows, 1, 48)
    if name not in kernels.usable_kernels(layer, rows, compiled=True):
        assert name in ONEDNN and not torch.backends.mkldnn.is_available()
        return
    actual = kernels.KERNELS[name](x, layer.weight, layer.bias)
    assert actual.shape == (rows, 1, 80)
    torch.testing.assert_close(actual, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", [name for name in kernels.KERNELS if name not in FLOAT_ONLY + INT8_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_casts_an_int8_weight_to_the_inputs_dtype(name, dtype):
    """Weight-only int8 layers (quantize.py) hand their int8 weight to the kernel, which multiplies in x's dtype."""
    torch.manual_seed(0)
    weight, x = torch.randint(-127, 128, (40, 32), dtype=torch.int8), torch.randn(2, 1, 32, dtype=dtype)
    if name == "onednn" and not torch.backends.mkldnn.is_available():
        return
    if name == "onednn" and dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return  # no bfloat16 inner product in oneDNN on this CPU (AVX2 only): usable_kernels drops it on its error
    if name == "avx2" and dtype != torch.float32:  # int8 weights by float32 rows (or int8 ones): no candidate for bf16
        assert name not in kernels.usable_kernels(Int8WeightOnlyLinear(nn.Linear(32, 40).to(dtype)), 1, compiled=False)
        return
    expected = x.double() @ weight.double().T
    error = (kernels.KERNELS[name](x, weight, None).double() - expected).abs().max() / expected.abs().max()
    assert error < (1e-6 if dtype == torch.float32 else 2e-2)  # as usable_kernels accepts: relative to the largest


@pytest.mark.parametrize("name, weight_dtype", [("int8pack", torch.float32), ("onednn-packed", torch.int8)])
def test_a_kernel_for_one_kind_of_weight_is_no_candidate_for_the_other(name, weight_dtype):
    """int8pack is torch's int8 kernel; onednn-packed on an int8 weight would pack a float copy, more bytes to read."""
    layer = nn.Linear(32, 24)
    if weight_dtype == torch.int8:
        layer = Int8WeightOnlyLinear(layer)
    assert name not in kernels.usable_kernels(layer, 1, compiled=False)


@pytest.mark.parametrize("name", INT8_ROWS + ("torch", "matrix-vector", "reduction", "int8-words", "avx2"))
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_an_int8_rows_kernel_gives_the_exact_integer_sums(name, rows):
    """int8 rows times int8 weights, every sum exact, the largest ones too (rows of +-127 against a weight row of 127:
    127 * 127 * 256 = 4.1M, where a sum of int8 pairs in int16 would saturate at 32767), as float32; with a bias
    added after. The float kernels multiply the rows in float32 (exact below 2^24) and are always candidates; on a
    CPU with VNNI the two int8 ones are too; without it they may not be (the next test)."""
    torch.manual_seed(0)
    layer = W8A8Linear(nn.Linear(256, 80))
    x = torch.randint(-127, 128, (rows, 1, 256), dtype=torch.int8)
    x[0, 0], layer.weight[0] = 127, 127
    if rows > 1:
        x[-1, 0, :128] = -127
    usable = kernels.usable_kernels(layer, rows, compiled=True)
    if name not in usable:
        assert (name in INT8_ROWS and not has_vnni()) or (name == "avx2" and not has_avx2()), (
            f"{name} is no candidate: {usable}")
        return
    expected = x.double() @ layer.weight.double().T  # (rows, 1, 80)
    actual = kernels.KERNELS[name](x, layer.weight, None)
    assert actual.shape == (rows, 1, 80) and actual.dtype == torch.float32
    assert torch.equal(actual.double(), expected) and actual[0, 0, 0] == 127 * 127 * 256
    with_bias = kernels.KERNELS[name](x, layer.weight, layer.bias)
    torch.testing.assert_close(with_bias.double(), expected + layer.bias.double(),  # float32 rounding of the sums
                               atol=1e-6 * expected.abs().max().item(), rtol=1e-6)


@pytest.fixture(scope="module", autouse=True)
def avx2_process():
    """The check of test_an_int8_rows_kernel_that_saturates_is_no_candidate, in a process with oneDNN capped at AVX2
    (a setting read once per process), started with the module: its second of importing torch passes on the core the
    in-process tests leave. It prints usable_kernels' candidates for 8 int8 rows, then _int_mm's sum of 768 products
    127 x 127. None off x86."""
    if platform.machine() not in ("x86_64", "AMD64"):
        yield None
        return
    script = ("import torch, torch.nn as nn; from gpt import kernels; from gpt.quantize import W8A8Linear; torch.manual_seed(0); "
              "layer = W8A8Linear(nn.Linear(768, 64)); print(kernels.usable_kernels(layer, 8, compiled=False)); "
              "x, weight = torch.full((1, 768), 127, dtype=torch.int8), torch.full((64, 768), 127, dtype=torch.int8); "
              "print(int(kernels.int_mm_linear(x, weight, None)[0, 0]))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", OMP_NUM_THREADS="1"))
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="ONEDNN_MAX_CPU_ISA names x86 instruction sets")
def test_an_int8_rows_kernel_that_saturates_is_no_candidate(avx2_process):
    """oneDNN's int8 products without VNNI (ONEDNN_MAX_CPU_ISA=AVX2: what an AVX2-only CPU runs) sum pairs of
    products in int16, which saturates: capped at AVX2 on an AVX-512 AMD EPYC, 127 x 127 x 768 came out as 97920. The
    check in usable_kernels must drop both int8-rows kernels there, leaving float32 products of the int8 rows; where
    the sum comes out exact (an AVX2-only Zen 3 EPYC), it must keep int_mm."""
    result = finished(avx2_process)
    assert result.returncode == 0, result.stderr
    usable, saturated = result.stdout.strip().splitlines()
    usable = eval(usable)
    assert "avx2" in usable or not has_avx2()  # its int16 pair sums stay below saturation: exact everywhere
    if int(saturated) == 127 * 127 * 768:  # some AVX2 CPUs (an AMD EPYC Zen 3) sum exactly: int_mm is kept there
        assert "torch" in usable and "int-mm" in usable
        return
    assert "torch" in usable and not set(INT8_ROWS) & set(usable)  # saturating: only float32 products are left


avx2 = pytest.mark.skipif(not has_avx2(), reason="gpt/avx2.py's kernels need an x86 CPU with AVX2, FMA and F16C")


@avx2
@pytest.mark.parametrize("width", [1, 31, 32, 33, 100, 768])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_the_avx2_kernels_give_the_product_at_every_width_and_row_count(width, rows):
    """Every width (the 32-wide loop and the one-at-a-time tail), every decode row count, rows not contiguous in
    memory: float32 rows within float32 rounding of F.linear, int8 rows exactly, signs and extremes included (-127 x
    -127 and 127 x -127, where the unsigned |x| meets the weight given x's sign, and zeros, which have no sign)."""
    torch.manual_seed(0)
    weight = torch.randint(-127, 128, (70, width), dtype=torch.int8)
    weight[0], weight[1] = -127, 127
    x = torch.randn(width, rows).T  # (rows, width), its rows strided
    expected = x.double() @ weight.double().T
    actual = kernels.avx2_linear(x, weight, None)
    assert actual.shape == (rows, 70) and actual.dtype == torch.float32
    assert (actual.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    rows_int8 = torch.randint(-127, 128, (rows, width), dtype=torch.int8)
    rows_int8[0] = -127
    if rows > 1:
        rows_int8[-1, : width // 2] = 0
    expected = rows_int8.double() @ weight.double().T
    assert torch.equal(kernels.avx2_linear(rows_int8, weight, None).double(), expected)
    assert expected[0, 0] == 127 * 127 * width and expected[0, 1] == -127 * 127 * width


@avx2
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 31, 33, 768])
@pytest.mark.parametrize("rows", [1, 5])
def test_the_avx2_kernels_multiply_16_bit_weights_in_float32(dtype, width, rows):
    """16-bit weights by rows of their dtype (--dtype=float16 or bfloat16), rows strided, with a bias: each weight
    made float32 exactly and the sums taken in float32, so the result is the exact product rounded once to the dtype,
    not a sum of 16-bit roundings; extremes included (65504, float16's largest)."""
    torch.manual_seed(0)
    weight, bias = torch.randn(70, width).to(dtype), torch.randn(70).to(dtype)
    weight[0, 0] = 65504.0 if dtype == torch.float16 else 3.0e38
    x = torch.randn(width, rows).to(dtype).T  # (rows, width), its rows strided
    x[:, 0] = 2 ** -4  # the largest weight's product stays finite in the dtype: a sum in it, not an overflow
    exact = (x.double() @ weight.double().T + bias.double()).float()
    actual = kernels.avx2_linear(x, weight, bias)
    assert actual.shape == (rows, 70) and actual.dtype == dtype and actual.isfinite().all()
    torch.testing.assert_close(actual, exact.to(dtype), atol=0, rtol=2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)


@pytest.mark.parametrize("flags, usable", [("fpu sse4_2 avx f16c avx2 fma", True),
                                           ("fpu sse4_2 avx f16c avx2 fma avx512f", True), ("fpu sse4_2 avx f16c", False),
                                           ("fp asimd evtstrm aes crc32 atomics", False)])
def test_the_avx2_kernels_are_a_candidate_where_the_cpu_has_avx2_and_fma(monkeypatch, flags, usable):
    """Chosen from the CPU's flags (faked here): an AVX2 CPU (most laptops) and an AVX-512 one measure them beside the
    others, an x86 CPU without AVX2 and an Arm one (Apple Silicon) never run them."""
    if usable and not has_avx2():
        pytest.skip("this CPU cannot run them, whatever its flags say")
    from gpt import avx2 as avx2_module
    monkeypatch.setattr(avx2_module, "cpu_flags", lambda: flags.split())
    avx2_module.library.cache_clear()  # as a process on that CPU
    for layer in (Int8WeightOnlyLinear(nn.Linear(64, 48)), W8A8Linear(nn.Linear(64, 48)),
                  nn.Linear(64, 48).to(torch.float16), nn.Linear(64, 48).to(torch.bfloat16)):
        assert ("avx2" in kernels.usable_kernels(layer, 1, compiled=False)) == usable
    assert "avx2" not in kernels.usable_kernels(nn.Linear(64, 48), 1, compiled=False)  # not float32 weights


@avx2
def test_the_avx2_kernels_are_built_once_into_the_cache_folder(monkeypatch, cache):
    from gpt import avx2 as avx2_module
    weight, x = torch.randint(-127, 128, (8, 40), dtype=torch.int8), torch.randn(2, 40)
    avx2_module.library.cache_clear()  # as a new process, with this test's cache folder
    kernels.avx2_linear(x, weight, None)
    assert [path.suffix for path in cache.iterdir()] == [".so"]  # written whole: no source or half-built file left
    avx2_module.library.cache_clear()  # as a new process: the kept build is loaded, nothing compiled

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(avx2_module.subprocess, "run", no_compiler)
    expected = x.double() @ weight.double().T  # float32 rounding of another order than F.linear's, as above
    assert (kernels.avx2_linear(x, weight, None).double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@avx2
@pytest.mark.parametrize("missing", ["compiler", "writable cache folder"])
def test_without_a_compiler_or_a_writable_folder_the_avx2_kernels_are_no_candidate(monkeypatch, cache, missing):
    from gpt import avx2 as avx2_module
    if missing == "compiler":
        monkeypatch.setenv("CXX", "no-such-compiler")
    else:
        cache.write_text("a file where the folder would be")  # os.makedirs fails as in a read-only home
    avx2_module.library.cache_clear()
    usable = kernels.usable_kernels(Int8WeightOnlyLinear(nn.Linear(64, 48)), 1, compiled=False)
    avx2_module.library.cache_clear()  # built with the real compiler again in later tests
    assert "avx2" not in usable and "torch" in usable


@avx2
@pytest.mark.parametrize("scheme", [Int8WeightOnlyLinear, W8A8Linear, torch.bfloat16])
def test_the_avx2_kernels_compiled_give_the_eager_models_logits(monkeypatch, scheme):
    """Compiled, the product is an op inductor calls as it is (no graph break), eager a plain call: both give the
    quantized (or bfloat16) model's own forward."""
    model, one = tiny_model(), torch.randint(0, 64, (1, 1))
    if isinstance(scheme, torch.dtype):
        model.to(scheme)
    else:
        replace_linears(model, scheme)
    tolerance = dict(atol=2e-2, rtol=2e-2) if isinstance(scheme, torch.dtype) else dict(atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(kernels, "fastest_kernel", lambda layers, rows, compiled: "avx2")
    with torch.inference_mode():
        expected = model(one)[0]
        with kernels.decode_linears(model, rows=1, compiled=True):
            assert all(isinstance(m, kernels.DecodeLinear) for m in model.modules()
                       if hasattr(m, "through") or isinstance(m, nn.Linear))
            torch.testing.assert_close(model(one)[0], expected, **tolerance)
            compiled = torch.compile(model, dynamic=False, fullgraph=True)
            torch.testing.assert_close(compiled(one)[0], expected, **tolerance)


def test_a_w8a8_layers_rows_are_quantized_then_scaled_after_the_kernels_product(monkeypatch):
    """DecodeLinear hands a W8A8Linear's kernel the int8 rows (each on its own grid) and scales the integer sums by
    the row's and the weight row's scales: the layer's own forward, within float rounding."""
    torch.manual_seed(0)
    layer = W8A8Linear(nn.Linear(32, 24))
    handed = []

    def integer_product(x, weight, bias):
        handed.append((x.dtype, weight.dtype, bias))
        return F.linear(x.float(), weight.float())

    monkeypatch.setattr(kernels, "KERNELS", {"torch": kernels.torch_linear, "int-mm": integer_product})
    monkeypatch.setattr(kernels, "fastest_kernel", lambda layers, rows, compiled: "int-mm")
    x = torch.randn(2, 1, 32) * torch.tensor([1e-3, 1e3])[:, None, None]  # rows far apart in size
    model = nn.Sequential(layer)
    with kernels.decode_linears(model, rows=2):
        actual = model(x)
    assert handed == [(torch.int8, torch.int8, None)]
    torch.testing.assert_close(actual, type(layer).forward(layer, x), atol=0, rtol=1e-6)


@pytest.mark.parametrize("name", INT8_ROWS)
@pytest.mark.parametrize("rows", [1, 4])
def test_an_int8_rows_kernel_compiled_after_the_rows_quantization_gives_the_eager_result(name, rows):
    """Compiled with real inductor, the rows quantized in the same graph (as a decode step does). Two bugs this
    caught: the opaque op declared its output in its input's dtype (int8, not float32), and torch 2.13's _int_mm
    on a CPU misreads a (1, in) input whose row stride is 0, which inductor gives a (1, 1, in) input reshaped."""
    torch.manual_seed(0)
    layer = W8A8Linear(nn.Linear(64, 48, bias=False))
    x = torch.randn(rows, 1, 64)
    if name not in kernels.usable_kernels(layer, rows, compiled=True):
        assert not has_vnni()
        return
    step = kernels.DecodeLinear(layer, {rows: name})
    # inductor's cache of compiled graphs keys on the graph, not on an op's declared output: compiled afresh
    with torch.inference_mode(), torch._inductor.config.patch(fx_graph_cache=False):
        expected = step(x)
        torch.testing.assert_close(torch.compile(step, dynamic=False)(x), expected, atol=1e-6, rtol=1e-6)
    kernels.packed_weights.clear()


X86_LIBRARY = ("onednn", "onednn-packed", "int8pack", "onednn-int8", "int-mm")  # oneDNN's, and torch's x86 int8 paths


def test_an_arm_cpu_falls_back_to_the_kernels_it_can_run(monkeypatch, cache):
    """Apple Silicon and other Arm CPUs (NEON, no x86): nothing is chosen from the CPU's flags, so an Arm CPU, faked
    here (its name and /proc/cpuinfo "Features"), on a torch build whose x86 library kernels fail as they would there,
    gets the kernels that run (torch's own, torch.mv): the int8 model decodes as without any choice, and a choice
    kept for an x86 CPU is not trusted on it."""
    model = tiny_model()
    replace_linears(model, Int8WeightOnlyLinear)
    x = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        expected = model(x)[0][:, -1]
    layers = linears_of(model)
    key = kernels.choice_key(layers, 1, False)
    cache.mkdir()
    (cache / "kernels.json").write_text(json.dumps({"machine": kernels.this_machine(), "choices": {key: "int8pack"},
                                                    "seconds": {key: [1.0, None]}}))  # an x86 machine's

    def missing(x, weight, bias):
        raise RuntimeError("no such kernel in this build")  # what a build without oneDNN's x86 paths says

    monkeypatch.setattr(kernels, "cpu_name", lambda: "Apple M2")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics".split())
    monkeypatch.setattr(kernels, "KERNELS", {name: missing if name in X86_LIBRARY else kernel
                                             for name, kernel in kernels.KERNELS.items()})
    with torch.no_grad(), kernels.decode_linears(model, 1):
        cache_ = model.new_kv_cache(1, 8)
        model(x[:, :-1], kv_cache=cache_)
        actual = model(x[:, -1:], kv_cache=cache_)[0][:, -1]
    assert set(kernels.choices.values()) <= {"torch", "matrix-vector"}, kernels.choices
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_a_kernel_that_fails_or_disagrees_is_no_candidate(monkeypatch):
    def failing(x, weight, bias):
        raise RuntimeError("could not create a primitive descriptor")  # what oneDNN says for a dtype it lacks

    def off_by_a_little(x, weight, bias):  # 1e-3 relative: more than float32 rounding, a lower precision
        return F.linear(x, weight, bias) * (1 + 1e-3)

    monkeypatch.setattr(kernels, "KERNELS", {"torch": kernels.torch_linear, "failing": failing,
                                             "off": off_by_a_little, "reduction": kernels.reduction_linear})
    layer = nn.Linear(64, 100)
    assert kernels.usable_kernels(layer, 1, compiled=True) == ["torch", "reduction"]
    assert kernels.usable_kernels(layer, 1, compiled=False) == ["torch"]  # the reduction only pays compiled


def fake_timed_kernels(monkeypatch, costs):
    """KERNELS replaced by kernels that each advance a fake clock by their cost per layer; returns the clock."""
    now = [0.0]

    def timed(cost):
        def kernel(x, weight, bias):
            now[0] += cost
            return F.linear(x, weight.to(x.dtype), bias)
        return kernel

    monkeypatch.setattr(kernels, "KERNELS", {name: timed(cost) for name, cost in costs.items()})
    return lambda: now[0]


def test_the_fastest_candidate_is_chosen(monkeypatch):
    clock = fake_timed_kernels(monkeypatch, {"torch": 3.0, "onednn": 1.0, "matrix-vector": 2.0})
    layers = linears_of(tiny_model())
    # float32 layers: no float32 product to time beside them (None)
    assert kernels.measure(layers, 1, ["torch", "onednn", "matrix-vector"], False, clock=clock) == \
        ("onednn", 1.0 * len(layers), None)
    assert kernels.measure(layers, 1, ["torch", "matrix-vector"], False, clock=clock)[0] == "matrix-vector"


def test_a_choice_is_measured_once_then_remembered_on_disk(monkeypatch, cache):
    model, measured = tiny_model(), []
    monkeypatch.setattr(kernels, "measure", lambda layers, rows, candidates, compiled: measured.append(rows) or (
        candidates[-1], 1.0, None))
    name = kernels.fastest_kernel(linears_of(model), 1, compiled=False)
    assert measured == [1] and name in kernels.KERNELS
    kept = json.loads((cache / "kernels.json").read_text())
    assert kept["machine"] == kernels.this_machine() and list(kept["choices"].values()) == [name]
    monkeypatch.setattr(kernels, "choices", {})  # a new run: only the file remembers
    assert kernels.fastest_kernel(linears_of(model), 1, compiled=False) == name and measured == [1]
    kernels.fastest_kernel(linears_of(model), 8, compiled=False)  # another batch: another measurement
    assert measured == [1, 8] and len(json.loads((cache / "kernels.json").read_text())["choices"]) == 2


@pytest.mark.parametrize("field, other", [("cpu", "Some Other CPU"), ("cpu_flags", "0123456789ab"),
                                          ("torch", "2.0.0"), ("kernels", ["torch", "onednn"])])
def test_a_choice_from_another_machine_or_torch_is_measured_again(monkeypatch, cache, field, other):
    """... or chosen among other candidates: a kernel added since (an update of this repo) is measured."""
    model = tiny_model()
    key = kernels.choice_key(linears_of(model), 1, False)
    cache.mkdir()
    (cache / "kernels.json").write_text(json.dumps({"machine": {**kernels.this_machine(), field: other},
                                                    "choices": {key: "matrix-vector"}}))
    measured = []
    monkeypatch.setattr(kernels, "measure", lambda layers, rows, candidates, compiled: measured.append(rows) or (
        "torch", 1.0, None))
    assert kernels.fastest_kernel(linears_of(model), 1, compiled=False) == "torch" and measured == [1]
    kept = json.loads((cache / "kernels.json").read_text())
    assert kept == {"machine": kernels.this_machine(), "choices": {key: "torch"},  # the stale choice is gone
                    "seconds": {key: [1.0, None]}}


def test_a_choice_kept_before_the_kernels_code_changed_is_measured_again(monkeypatch, cache):
    """An update of this repo may make a kernel faster and leave the list of kernels as it was (gpt/avx2.py's prefetch
    did, 1.5x): a choice kept on this machine before it is measured again, not trusted."""
    model = tiny_model()
    key = kernels.choice_key(linears_of(model), 1, False)
    cache.mkdir()
    (cache / "kernels.json").write_text(json.dumps({"machine": kernels.this_machine(), "choices": {key: "matrix-vector"},
                                                    "seconds": {key: [1.0, None]}}))
    measured = []
    monkeypatch.setattr(kernels, "measure", lambda layers, rows, candidates, compiled: measured.append(rows) or (
        "torch", 1.0, None))
    monkeypatch.setattr(kernels, "kernels_code", lambda: "an edited one")
    assert kernels.fastest_kernel(linears_of(model), 1, compiled=False) == "torch" and measured == [1]


def test_each_thread_count_measures_and_keeps_its_own_choice(monkeypatch, cache):
    """A run with other threads (a torchrun worker's one, beside a user's default) measures again, and both choices
    stay: neither wipes the other's from kernels.json."""
    model, measured = tiny_model(), []
    monkeypatch.setattr(kernels, "measure", lambda layers, rows, candidates, compiled: measured.append(
        torch.get_num_threads()) or (candidates[-1], 1.0, None))
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 1, 2):
            torch.set_num_threads(count)
            monkeypatch.setattr(kernels, "choices", {})  # a new run: only the file remembers
            kernels.fastest_kernel(linears_of(model), 1, compiled=False)
    finally:
        torch.set_num_threads(threads)
    assert measured == [1, 2]
    assert len(json.loads((cache / "kernels.json").read_text())["choices"]) == 2


def test_a_cache_folder_that_cannot_be_written_costs_one_line_not_the_run(monkeypatch, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(kernels.CACHE_ENV, str(blocker / "cache"))  # under a file: no folder can be made there
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    model, x = tiny_model(), torch.randint(0, 64, (1, 4))
    expected = model(x)[0]
    for _ in range(2):  # the second run of it in this process says nothing more
        monkeypatch.setattr(kernels, "choices", {})
        with torch.no_grad(), kernels.decode_linears(model, 1):
            torch.testing.assert_close(model(x[:, :1])[0], expected[:, :1], atol=1e-5, rtol=1e-5)  # a kernel of its own
        kernels.use_compile_cache()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert "cannot keep the decode kernel choice" in lines[0] and kernels.CACHE_ENV in lines[0]
    assert "cannot keep compiled code" in lines[1]
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # importing inductor sets the variable
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir()  # torch's own


def test_compiled_code_is_kept_in_the_cache_folder_unless_the_user_chose_one(monkeypatch, cache):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what importing inductor sets: no choice
    kernels.use_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "inductor") and (cache / "inductor").is_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    kernels.use_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"


class IsaChecks:
    """inductor's valid_vec_isa_list as check_isas_once calls it (a CPU's flags naming three ISAs): with
    config.cpp.vec_isa_ok None it runs the checks (counted), which pass for `passing`; forced, it names all three."""
    NAMED = ["avx512 avx512_vnni amx_tile", "avx512", "avx2"]

    def __init__(self, passing):
        self.passing, self.runs = passing, 0

    def __call__(self):
        from torch._inductor import config
        if config.cpp.vec_isa_ok:
            return list(self.NAMED)
        self.runs += 1
        return list(self.passing)

    def cache_clear(self):
        pass


@pytest.mark.parametrize("passing", [IsaChecks.NAMED, IsaChecks.NAMED[1:]], ids=["all_pass", "amx_fails"])
def test_inductors_isa_checks_run_until_a_run_on_this_machine_saw_them_all_pass(monkeypatch, cache, passing):
    """check_isas_once: the first process compiling for this CPU runs inductor's checks; where all passed, kernels.json
    says so and later processes skip them (vec_isa_ok, the ISAs the flags name: what the checks gave). Where one
    failed (AMX with an old compiler), every process checks, as inductor alone would; TORCHINDUCTOR_VEC_ISA_OK wins."""
    from torch._inductor import config, cpu_vec_isa
    checks, all_pass = IsaChecks(passing), passing == IsaChecks.NAMED
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", checks)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache / "chosen"))  # a folder of the user's: left as it is, and
    # restored after (the session's compiled code stays where the later tests find it)
    with config.patch({"cpp.vec_isa_ok": None}):  # restored after (pytest's monkeypatch deletes a config's entry)
        for process in range(2):
            config.cpp.vec_isa_ok = None  # a new process, no TORCHINDUCTOR_VEC_ISA_OK
            kernels.use_compile_cache()
            if all_pass:
                assert checks.runs == 1 and config.cpp.vec_isa_ok is True, process
            else:
                assert checks.runs == process + 1 and config.cpp.vec_isa_ok is None, process
        remembered = kernels.read_kept(str(cache / "kernels.json"))[0].get(kernels.ISAS_CHECKED)
        assert remembered == ("all" if all_pass else None)
        config.cpp.vec_isa_ok = False  # TORCHINDUCTOR_VEC_ISA_OK=0: the user's choice
        kernels.use_compile_cache()
        assert config.cpp.vec_isa_ok is False and checks.runs == (1 if all_pass else 2)
        config.cpp.vec_isa_ok = None
        kernels.use_compile_cache("cuda")  # no CPU code to compile: nothing checked
        assert checks.runs == (1 if all_pass else 2) and config.cpp.vec_isa_ok is None


def test_a_torch_without_inductors_isa_list_checks_as_before(monkeypatch, cache):
    """check_isas_once reads inductor's private ISA list: a torch without it (not requirements.txt's) changes nothing."""
    import types
    from torch._inductor import config
    monkeypatch.setitem(sys.modules, "torch._inductor.cpu_vec_isa", types.ModuleType("torch._inductor.cpu_vec_isa"))
    with config.patch({"cpp.vec_isa_ok": None}):
        kernels.check_isas_once()
        assert config.cpp.vec_isa_ok is None
    assert not (cache / "kernels.json").exists()


def recording_kernels(monkeypatch, chosen):
    """Every kernel records the layer sizes it is called for; fastest_kernel answers `chosen`."""
    calls = []

    def recording(x, weight, bias):
        calls.append(tuple(weight.shape))
        return F.linear(x, weight.to(x.dtype), bias)

    monkeypatch.setattr(kernels, "KERNELS", {name: recording for name in kernels.KERNELS})
    monkeypatch.setattr(kernels, "fastest_kernel", lambda layers, rows, compiled: chosen)
    return calls


def test_decode_linears_apply_the_choice_inside_the_block_to_decode_sized_inputs_only(monkeypatch):
    model, calls = tiny_model(), recording_kernels(monkeypatch, "onednn")
    one, many = torch.randint(0, 64, (1, 1)), torch.randint(0, 64, (1, 16))  # 16 tokens: 16 rows, a decode chunk
    with torch.no_grad():
        expected = model(one)[0], model(many)[0]
        with kernels.decode_linears(model, rows=1):
            inside = model(one)[0]
            assert len(calls) == 8  # q, k, v, o, gate, up, down and the head
            model(many)
            assert len(calls) == 16
            model(torch.randint(0, 64, (1, 17)))  # 17 rows: a prefill, the layers' own product
            assert len(calls) == 16
        model(one)
    torch.testing.assert_close(inside, expected[0], atol=1e-5, rtol=1e-5)  # oneDNN's order of the sums, not MKL's
    assert len(calls) == 16  # outside the block: nn.Linear again
    assert not any("forward" in vars(m) for m in model.modules())


def test_torchs_own_kernel_chosen_leaves_the_layers_as_they_are(monkeypatch):
    model = tiny_model()
    recording_kernels(monkeypatch, "torch")
    before = list(model.modules())
    with kernels.decode_linears(model, rows=1):
        assert list(model.modules()) == before and not any("forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize("layer", [lambda linear: linear, Int8WeightOnlyLinear, W8A8Linear], ids=["float", "int8", "w8a8"])
def test_the_chosen_kernel_is_a_module_swap_that_print_shows(monkeypatch, layer):
    """Inside the block each linear layer is a DecodeLinear naming its kernels in print(model), holding the layer's
    own tensors under the same state_dict keys and running its hooks; no layer's forward is patched from outside (an
    instance attribute `forward`), and after the block the model holds its own layers again."""
    model, heads = replace_linears(tiny_model(), layer), []
    calls = recording_kernels(monkeypatch, "onednn")
    model.lm_head.register_forward_hook(lambda module, args, logits: heads.append(logits.shape))
    before, state = list(model.modules()), model.state_dict()
    with torch.no_grad(), kernels.decode_linears(model, rows=(5, 1)):
        model(torch.randint(0, 64, (1, 1)))
        assert len(calls) == 8 and heads == [(1, 1, 64)]  # the chosen kernel ran, and the head's hook with it
        swapped = [m for m in model.modules() if isinstance(m, kernels.DecodeLinear)]
        assert len(swapped) == 8 and not any(kernels.is_decode_linear(m) for m in model.modules())
        shown = repr(model)
        assert "DecodeLinear(in_features=16, out_features=16" in shown and "kernel onednn at 1 row, onednn at 5 rows)" in shown
        inside = model.state_dict()
        assert inside.keys() == state.keys() and all(inside[key].data_ptr() == state[key].data_ptr() for key in state)
        assert not any("forward" in vars(m) for m in model.modules())
    assert list(model.modules()) == before and "DecodeLinear" not in repr(model)
    assert not any("forward" in vars(m) for m in model.modules())


def test_a_compiled_only_kernel_runs_only_while_compiling(monkeypatch):
    """The reduction would hold x * W whole eager (the head's 50304 x 768 per row): eager steps of a compiled
    decode (the first one, a prefill) keep the layers' own product."""
    model, calls = tiny_model(), recording_kernels(monkeypatch, "reduction")
    with torch.no_grad(), kernels.decode_linears(model, rows=1, compiled=True):
        model(torch.randint(0, 64, (1, 1)))
        assert calls == []
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        model(torch.randint(0, 64, (1, 1)))
        assert len(calls) == 8


def test_an_int8_layers_rows_are_scaled_after_the_kernels_product(monkeypatch):
    torch.manual_seed(0)
    layer = Int8WeightOnlyLinear(nn.Linear(32, 24))
    model = nn.Sequential(layer)
    recording_kernels(monkeypatch, "matrix-vector")
    x = torch.randn(1, 32)
    expected = F.linear(x, layer.dequantized_weight(), layer.bias)
    with kernels.decode_linears(model, rows=1):
        torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)


def test_a_compiled_measurement_computes_every_product():
    """measure() times run_layers compiled for the compiled-only kernels: what it returns is what inductor keeps, so
    it must return every layer's product (a function returning nothing compiled to nothing and timed as fastest)."""
    layers = linears_of(tiny_model())
    inputs = [torch.randn(2, layer.in_features) for layer in layers]
    with torch.inference_mode():
        products = torch.compile(kernels.run_layers, dynamic=False)(kernels.reduction_linear, layers, inputs)
    assert len(products) == len(layers)
    for product, layer, x in zip(products, layers, inputs):
        torch.testing.assert_close(product, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_the_reduction_compiled_after_a_norm_computes_the_product_of_the_normed_rows(rows):
    """Compiled, several rows go through computed_first (an op inductor cannot fuse into the weight loop) and one
    row does not: either way the product is the normed rows' (real inductor, ~5 s with a cold cache)."""
    torch.manual_seed(0)
    norm, layer = nn.RMSNorm(32), nn.Linear(32, 40, bias=False)
    x = torch.randn(rows, 32)

    def normed_product(x):
        return kernels.reduction_linear(norm(x), layer.weight, None)

    with torch.inference_mode():
        torch.testing.assert_close(torch.compile(normed_product, dynamic=False)(x), layer(norm(x)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_int8_words_compiled_read_every_weight_from_its_byte_with_its_sign(rows):
    """int8-words reads four weights from each int32 word: compiled (real inductor), each weight's sign and place must
    come back, -128 and 127 included, for float rows and int8 rows (w8a8's exact sums); a layer of a width not
    divisible by 4 (a model's other layers may have one) has no whole words and is multiplied a weight at a time."""
    torch.manual_seed(0)
    weight = torch.randint(-128, 128, (40, 34), dtype=torch.int8)
    weight[0, :4] = torch.tensor([-128, 127, -1, 1], dtype=torch.int8)  # every byte of the first word at an edge
    compiled = torch.compile(kernels.int8_words_linear, dynamic=False)
    for width in (32, 34):
        for x in (torch.randn(rows, 1, width), torch.randint(-127, 128, (rows, 1, width), dtype=torch.int8)):
            with torch.inference_mode():
                actual = compiled(x, weight[:, :width].contiguous(), None)
            expected = x.double() @ weight[:, :width].double().T
            if x.dtype == torch.int8:
                assert torch.equal(actual.double(), expected), width
            else:
                torch.testing.assert_close(actual.double(), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_packed_weights_are_packed_once_inside_the_block_and_forgotten_after_it(monkeypatch):
    """onednn-packed packs each weight at its first product in the block, reuses it, and forgets it at the end: a
    weight changed between two decodes (training, then sampling, in one process) is packed anew."""
    model, one = tiny_model(), torch.randint(0, 64, (1, 1))
    monkeypatch.setattr(kernels, "fastest_kernel", lambda layers, rows, compiled: "onednn-packed")
    with torch.no_grad():
        with kernels.decode_linears(model, rows=1):
            model(one)
            packed = dict(kernels.packed_weights)
            assert len(packed) == 8  # q, k, v, o, gate, up, down and the head
            model(one)
            assert kernels.packed_weights == packed  # the same copies, not packed again
        assert kernels.packed_weights == {}
        for parameter in model.parameters():
            parameter.mul_(1.5)
        expected = model(one)[0]
        with kernels.decode_linears(model, rows=1):
            torch.testing.assert_close(model(one)[0], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_the_packed_kernel_compiled_finds_its_packed_weight_at_run_time(monkeypatch):
    """Compiled, the packed product is an op inductor calls as it is; it looks the packed copy up when it runs."""
    model, one = tiny_model(), torch.randint(0, 64, (1, 1))
    monkeypatch.setattr(kernels, "fastest_kernel", lambda layers, rows, compiled: "onednn-packed")
    with torch.inference_mode():
        expected = model(one)[0]
        with kernels.decode_linears(model, rows=1, compiled=True):
            torch.testing.assert_close(torch.compile(model, dynamic=False)(one)[0], expected, atol=1e-5, rtol=1e-5)
            assert len(kernels.packed_weights) == 8


def test_int8pack_compiled_gives_torchs_int8_product():
    torch.manual_seed(0)
    layer = Int8WeightOnlyLinear(nn.Linear(64, 48).to(torch.bfloat16))
    x = torch.randn(3, 1, 64, dtype=torch.bfloat16)

    def scaled_product(x):
        return kernels.int8pack_linear(x, layer.weight, None) * layer.scales + layer.bias  # as layer.through does

    with torch.inference_mode():
        actual = torch.compile(scaled_product, dynamic=False)(x)
    expected = F.linear(x.double(), layer.dequantized_weight().double(), layer.bias.double())
    torch.testing.assert_close(actual.double(), expected, atol=2e-2, rtol=2e-2)


def test_no_room_for_a_second_copy_of_the_weights_rules_out_packing(monkeypatch, cache):
    """Packing copies every weight: where half the free memory cannot hold the copy, the packed kernel is neither
    measured nor trusted from kernels.json."""
    model = tiny_model()
    measured = []
    monkeypatch.setattr(kernels, "measure", lambda layers, rows, candidates, compiled: measured.append(candidates)
                        or (candidates[-1], 1.0, None))
    monkeypatch.setattr(os, "sysconf", lambda name: 4 if name == "SC_PAGE_SIZE" else 1000)  # 4 KB free
    key = kernels.choice_key(linears_of(model), 1, False)
    cache.mkdir()
    (cache / "kernels.json").write_text(json.dumps({"machine": kernels.this_machine(), "choices": {key: "onednn-packed"},
                                                    "seconds": {key: [1.0, None]}}))
    assert kernels.fastest_kernel(linears_of(model), 1, compiled=False) != "onednn-packed"
    assert measured and "onednn-packed" not in measured[0]


def int8_layers(model):
    replace_linears(model, Int8WeightOnlyLinear)
    return linears_of(model)


@pytest.mark.parametrize("int8_cost, noted", [(3.0, True), (0.5, False)])
def test_a_mode_slower_than_float32_here_says_so_in_one_line_each_run(monkeypatch, cache, int8_cost, noted):
    """int8 weights' fastest kernel timed beside torch's own float32 product on float32 weights of the same shapes, in
    the same rounds: slower (as on an AVX2-only CPU), one line says float32 is faster here; faster, nothing. A later
    run reads both times from kernels.json and says it again without measuring."""
    clock = fake_timed_kernels(monkeypatch, {"torch": 1.0, "int8pack": int8_cost})
    monkeypatch.setattr(kernels, "usable_kernels", lambda layer, rows, compiled: ["int8pack"])
    layers = int8_layers(tiny_model())
    measure = kernels.measure
    monkeypatch.setattr(kernels, "measure", lambda *args: measure(*args, clock=clock))
    assert kernels.fastest_kernel(layers, 1, compiled=False) == "int8pack"
    key = kernels.choice_key(layers, 1, False)
    assert json.loads((cache / "kernels.json").read_text())["seconds"] == {key: [int8_cost * len(layers), len(layers)]}
    for run in range(2):  # the second: a new run, from kernels.json only
        lines = kernels.chosen_note().splitlines()  # what sample.py prints after decoding
        assert lines[0].startswith("note: decode kernels chosen for this CPU: int8pack (kept in ")
        if noted:
            assert lines[1:] == [f"note: on this CPU, int8 weights, float32 rows multiply slower than float32 weights "
                                 f"({3e3 * len(layers):.2f} vs {1e3 * len(layers):.2f} ms for this model's layers at 1 "
                                 "row, measured): float32 (no --quantize, --dtype=float32) decodes faster here, in more "
                                 "memory"]
        else:
            assert lines[1:] == []
        monkeypatch.setattr(kernels, "choices", {})
        monkeypatch.setattr(kernels, "measure", None)  # not called: both times are kept
        assert kernels.fastest_kernel(layers, 1, compiled=False) == "int8pack"


def test_a_choice_kept_without_its_seconds_is_measured_again(monkeypatch, cache):
    """A kernels.json of an earlier version (choices only): measured once more, so that a slower mode is told."""
    layers = int8_layers(tiny_model())
    key = kernels.choice_key(layers, 1, False)
    cache.mkdir()
    (cache / "kernels.json").write_text(json.dumps({"machine": kernels.this_machine(), "choices": {key: "torch"}}))
    measured = []
    monkeypatch.setattr(kernels, "measure", lambda layers, rows, candidates, compiled: measured.append(rows) or (
        "torch", 2.0, 1.0))
    assert kernels.fastest_kernel(layers, 1, compiled=False) == "torch" and measured == [1]
    assert json.loads((cache / "kernels.json").read_text())["seconds"] == {key: [2.0, 1.0]}


def test_float32_is_timed_beside_int8_and_16_bit_weights_only():
    model = tiny_model()
    assert kernels.float32_stand_ins(linears_of(model)) is None
    for layers in (int8_layers(tiny_model()), linears_of(tiny_model().to(torch.bfloat16))):
        stand_ins = kernels.float32_stand_ins(layers)
        assert [(s.weight.shape, s.weight.dtype, s.bias) for s in stand_ins] == \
            [(layer.weight.shape, torch.float32, None) for layer in layers]


def test_a_choice_for_int8_weights_is_kept_per_dtype_of_the_rows():
    """int8 weights times float32 rows, bfloat16 rows and int8 rows run different kernels best (int8pack is fast for
    bfloat16 rows only, the int8-rows kernels take int8 rows only): one choice must not stand for another."""
    float32_rows = Int8WeightOnlyLinear(nn.Linear(32, 24))
    bfloat16_rows = Int8WeightOnlyLinear(nn.Linear(32, 24).to(torch.bfloat16))
    int8_rows = W8A8Linear(nn.Linear(32, 24))
    keys = {kernels.choice_key([layer], 1, False) for layer in (float32_rows, bfloat16_rows, int8_rows)}
    assert len(keys) == 3 and any(key.startswith("int8 weights, int8 rows") for key in keys)


def test_each_row_count_listed_runs_its_own_choice_and_others_the_largest_ones(monkeypatch):
    """A speculative step's check (draft_k + 1 rows) and its one-token steps may each be fastest with another kernel."""
    model, calls = tiny_model(), []

    def recording(name):
        def kernel(x, weight, bias):
            calls.append((name, x.numel() // x.size(-1)))
            return F.linear(x, weight, bias)
        return kernel

    monkeypatch.setattr(kernels, "KERNELS", {name: recording(name) for name in ("torch", "onednn", "matrix-vector")})
    monkeypatch.setattr(kernels, "fastest_kernel", lambda layers, rows, compiled: {1: "matrix-vector", 5: "onednn"}[rows])
    with torch.no_grad(), kernels.decode_linears(model, rows=(5, 1)):
        for rows in (1, 5, 3):
            model(torch.randint(0, 64, (1, rows)))
    assert calls == [("matrix-vector", 1)] * 8 + [("onednn", 5)] * 8 + [("onednn", 3)] * 8
