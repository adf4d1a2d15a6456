"""Which kernel multiplies a decode step's few rows by each weight matrix on this CPU: measured on the machine once,
and remembered in kernels.json under cache_dir() (docs/sampling.md).

    with decode_linears(model, rows=1):   # inside, each linear layer is a DecodeLinear running the kernel chosen
        ...decode steps...

A decode step is bound by how fast a kernel streams the weights, and which does that best depends on the CPU and torch's
build (each candidate won somewhere: bench/RESULTS.md), so measure times them all. All compute the same product in the
same precision, in another order: the logits change within float rounding (usable_kernels checks).
"""

import contextlib
import functools
import hashlib
import json
import os
import sys
import time
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt.files import atomic_open
from gpt.cpuinfo import cpu_flags, cpu_name

DECODE_ROWS = 16  # inputs of at most this many rows are decode-sized (batched samples, speculative chunks)
REPEATS = 5  # timings of each candidate, interleaved; the best is kept
CACHE_ENV = "GPT_CACHE_DIR"  # where choices and compiled kernels are kept; default ~/.cache/gpt


def float_rows(x):
    """int8 rows (a W8A8Linear's) as float32, as its forward sums them: whole-number products, exact below 2^24."""
    return x if x.is_floating_point() else x.float()


def torch_linear(x, weight, bias):  # torch's own choice: MKL's sgemm for fp32 on x86 builds, oneDNN for bf16
    x = float_rows(x)
    return F.linear(x, weight.to(x.dtype), bias)


OPS = torch.library.Library("gpt", "FRAGMENT")  # the products compiled steps call as they are (opaque_when_compiled)


def opaque_when_compiled(name):
    """Eager, the product itself; compiling, an op gpt::name that inductor calls as is: it lowers none of these
    library calls but on weights frozen in (torch._inductor.config.freezing), and one looks up weights at run time.
    Registered for the CPU directly: torch.library.custom_op's wrappers cost ~5 us more a call, ~0.4 ms a token."""
    def decorate(product):
        OPS.define(f"{name}(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
        OPS.impl(name, product, "CPU")
        torch.library.register_fake(f"gpt::{name}", lib=OPS)(lambda x, weight, bias: x.new_empty(  # int8 rows: float32
            *x.shape[:-1], weight.size(0), dtype=x.dtype if x.is_floating_point() else torch.float32))
        op = getattr(torch.ops.gpt, name).default
        return functools.wraps(product)(lambda x, weight, bias: (op if torch.compiler.is_compiling() else product)(
            x, weight, bias))  # eager: without the op's dispatch
    return decorate


@opaque_when_compiled("onednn_linear")
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight.to(x.dtype), bias, "none", [], "")


def matrix_vector_linear(x, weight, bias):
    """W @ x (torch.mv at one row): with the input as the thin side, some BLAS stream W faster than in x @ W^T."""
    rows = float_rows(x).reshape(-1, x.size(-1))  # (M, in)
    weight = weight.to(rows.dtype)
    y = torch.mv(weight, rows[0])[None] if rows.size(0) == 1 else (weight @ rows.T).T  # (M, out)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.size(0))


@torch.library.custom_op("gpt::computed_first", mutates_args=())
def computed_first(x: torch.Tensor) -> torch.Tensor:
    """x as it is, an op inductor cannot see into: what feeds a reduction_linear is computed once, before it."""
    return x.clone()


computed_first.register_fake(lambda x: torch.empty_like(x))


def reduction_linear(x, weight, bias):
    """y[..., o] = sum_i x[..., i] W[o, i] as products and sums, one per input row: compiled (COMPILED_ONLY), inductor
    fuses them into one loop that streams the weights once for all rows (an int8 weight's cast included)."""
    rows = float_rows(x).reshape(-1, x.size(-1))  # (M, in)
    weight = weight.to(rows.dtype)
    # rows computed first: else inductor fuses what makes them (a norm; int8 rows' quantization, a reduction) into the
    # loop and redoes it for every weight. One float row is faster fused.
    if torch.compiler.is_compiling() and (rows.size(0) > 1 or not x.is_floating_point()):
        rows = computed_first(rows)
    y = torch.stack([(row * weight).sum(-1) for row in rows])  # (M, out); one broadcast product would read W M times
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.size(0))


def int8_words_linear(x, weight, bias):
    """reduction_linear for int8 weights read four at a time, as int32 words, each weight sign-extended from its byte
    by two shifts: compiled (COMPILED_ONLY), inductor's loop then loads whole vectors of weights. Its own load of a
    float vector's worth of int8 weights (8 on AVX2) copies them through memory first where the CPU has no masked
    byte loads (AVX2): 4x slower than float32 weights there (bench/RESULTS.md); with AVX-512 that load is fast."""
    if weight.dtype != torch.int8 or sys.byteorder != "little":
        raise RuntimeError("int8 words take int8 weights, on a little-endian CPU")
    if weight.size(-1) % 4 or weight.storage_offset() % 4:  # no whole words (mlp_hidden=50): a weight at a time
        return reduction_linear(x, weight, bias)
    rows = float_rows(x).reshape(-1, x.size(-1))  # (M, in)
    words = weight.view(torch.int32)  # (out, in/4): word j holds weight[:, 4j + b] in its byte b
    parts = rows.unflatten(1, (-1, 4)).transpose(1, 2).contiguous()  # (M, 4, in/4): parts[:, b, j] = rows[:, 4j + b]
    if torch.compiler.is_compiling():
        parts = computed_first(parts)  # as in reduction_linear: made once, before the loop
    weights = [((words << (24 - 8 * b)) >> 24).to(rows.dtype) for b in range(4)]  # byte b of each word, sign-extended
    y = torch.stack([sum((part[b] * weights[b]).sum(-1) for b in range(4)) for part in parts])  # (M, out)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.size(0))


# (address, shape, dtype) -> (weight, packed copy) until decode_linears ends; held, the weight's address is not reused
packed_weights = {}


def packed_copy(weight, pack):
    key = (weight.data_ptr(), tuple(weight.shape), weight.dtype)
    if key not in packed_weights:
        packed_weights[key] = weight, pack(weight)
    return packed_weights[key][1]


@opaque_when_compiled("packed_onednn_linear")
def packed_onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """oneDNN's inner product on a copy of the weight packed once in its blocked layout (else it reorders the weight
    every call). The copy doubles the weights' memory (room_for_a_copy); an int8 weight is not copied to float."""
    if not weight.is_floating_point():
        raise RuntimeError("packed oneDNN takes float weights only")
    rows = x.reshape(-1, x.size(-1))  # (M, in)
    # the layout depends on the rows packed for: packed for one, even one row ran slower (bench/RESULTS.md)
    packed = packed_copy(weight, lambda w: torch.ops.mkldnn._reorder_linear_weight(w, DECODE_ROWS))
    y = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")  # (M, out)
    return y.view(*x.shape[:-1], weight.size(0))


def int8_packed(weight):
    """oneDNN's int8 weight packed once, with the ones and zeros it takes as the weight's scales and zero points."""
    out_features = weight.size(0)
    return (torch.ops.onednn.qlinear_prepack(weight, [DECODE_ROWS, weight.size(1)]), torch.ones(out_features),
            torch.zeros(out_features, dtype=torch.int64))


@opaque_when_compiled("shifted_int8_product")
def shifted_int8_product(rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    packed, ones, zeros = packed_copy(weight, int8_packed)
    y = torch.ops.onednn.qlinear_pointwise(rows.reshape(-1, rows.size(-1)), 1.0, 128, packed, ones, zeros, bias, 1.0,
                                           0, torch.float32, "none", [], "")  # (M, out)
    return y.view(*rows.shape[:-1], weight.size(0))


def onednn_int8_linear(x, weight, bias):
    """oneDNN's int8 product on weights packed once: exact int32 sums as float32 (+ bias). The rows are shifted by 128
    (the sign bit flipped; compiled, in the loop that quantizes them) and oneDNN subtracts that zero point again: signed
    rows run a slow reference loop. Without VNNI its pair sums saturate in int16 (usable_kernels drops it)."""
    if x.dtype != torch.int8 or weight.dtype != torch.int8:
        raise RuntimeError("oneDNN's int8 product takes int8 rows and int8 weights only")
    return shifted_int8_product(x.view(torch.uint8) ^ 128, weight, bias)


@opaque_when_compiled("int8pack_linear")
def int8pack_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """torch's weight-only int8 product (aten._weight_int8pack_mm, gpt-fast's on a CPU) with scales of ones: the layer
    applies its own after. torch 2.13 vectorizes it for bfloat16 rows only; with float32 ones, measuring drops it."""
    if weight.dtype != torch.int8:
        raise RuntimeError("int8pack takes int8 weights only")
    rows = x.reshape(-1, x.size(-1))  # (M, in)
    y = torch._weight_int8pack_mm(rows, weight, torch.ones(weight.size(0), dtype=x.dtype))  # (M, out)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.size(0))


def int_mm_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """torch._int_mm (oneDNN's on x86) for int8 rows and weights as stored, as float32 (+ bias): less fixed cost a
    call than onednn_int8_linear, so it can win at one row where that one wins at several. It too needs VNNI."""
    if x.dtype != torch.int8 or weight.dtype != torch.int8:
        raise RuntimeError("torch._int_mm takes int8 rows and int8 weights only")
    rows = x.reshape(-1, x.size(-1))  # (M, in)
    if rows.size(0) == 1:  # torch 2.13's _int_mm on a CPU misreads one row whose row stride is not its width, and
        rows = rows.as_strided(rows.shape, (rows.size(1), 1))  # inductor may give it 0 (a size-1 dimension's)
    y = torch._int_mm(rows, weight.T).float()  # (M, out)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.size(0))


@opaque_when_compiled("avx2_linear")
def avx2_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """gpt/avx2.py's C++ products (+ bias), where torch's kernels read int8 or 16-bit weights no faster than float32
    ones: int8 weights by float32 rows, or by int8 rows with exact sums (float32 out); float16 or bfloat16 weights by
    rows of their dtype, summed in float32. On an x86 CPU with AVX2, FMA and F16C (nearly every one since 2013)."""
    half = weight.dtype in (torch.float16, torch.bfloat16) and x.dtype == weight.dtype
    if not half and (weight.dtype != torch.int8 or x.dtype not in (torch.float32, torch.int8)):
        raise RuntimeError("the AVX2 kernels take int8 weights by float32 or int8 rows, or 16-bit ones by their own")
    from gpt import avx2  # built on first use, on a CPU that has what they need
    rows = x.reshape(-1, x.size(-1))  # (M, in)
    y = avx2.product(rows.float() if half else rows, weight, cache_dir)  # (M, out) float32
    if bias is not None:
        y = y + bias
    return (y.to(x.dtype) if half else y).view(*x.shape[:-1], weight.size(0))


KERNELS = {"torch": torch_linear, "onednn": onednn_linear, "matrix-vector": matrix_vector_linear,
           "reduction": reduction_linear, "int8-words": int8_words_linear, "onednn-packed": packed_onednn_linear,
           "int8pack": int8pack_linear, "onednn-int8": onednn_int8_linear, "int-mm": int_mm_linear,
           "avx2": avx2_linear}
COMPILED_ONLY = ("reduction", "int8-words")  # eager, they would hold x * W whole
COPIES_WEIGHTS = ("onednn-packed", "onednn-int8")  # candidates only where a second copy of the weights fits

choices = {}  # (rows, dtype, shapes) -> kernel name, this process's; kernels.json keeps them between runs
seconds = {}  # the same keys -> [the chosen kernel's best seconds, float32's (measure) or None]
FLOAT32 = "float32"  # what measure names torch's own float32 product, timed beside the candidates for other weights
said = set()  # notes already printed (one line each, once per process)


def say_once(note):
    if note not in said:
        said.add(note)
        print(note, file=sys.stderr)


def cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get(CACHE_ENV) or os.path.join(base, "gpt")


def this_machine():
    """What every remembered choice holds only for, the candidates and their code included (a kernel added to KERNELS,
    or one made faster by an update of this repo, gets measured again). The thread count is in each choice's key
    instead: runs with other counts (a torchrun worker's one thread, a user's default) each keep theirs, rather than
    wiping the file for one another."""
    return {"cpu": cpu_name(), "cpu_flags": hashlib.sha1(" ".join(cpu_flags()).encode()).hexdigest()[:12],
            "torch": torch.__version__, "kernels": list(KERNELS), "code": kernels_code()}


@functools.cache
def kernels_code():
    """A digest of the candidates' code: this file and gpt/avx2.py (whose C++ some of them call)."""
    folder = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha1()
    for name in ("kernels.py", "avx2.py"):
        with open(os.path.join(folder, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


def read_kept(path):
    """kernels.json's choices and their seconds ({key: name}, {key: [fastest, float32's or None]}), for this machine."""
    try:
        with open(path) as f:
            kept = json.load(f)
    except (OSError, ValueError):
        return {}, {}
    if not isinstance(kept, dict) or kept.get("machine") != this_machine() or not isinstance(kept.get("choices"), dict):
        return {}, {}
    return kept["choices"], kept.get("seconds") if isinstance(kept.get("seconds"), dict) else {}


def remember(key, name, times):
    """Add one choice and its seconds to kernels.json (atomically); an unwritable folder costs a note, and a
    measurement each run."""
    path = os.path.join(cache_dir(), "kernels.json")
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        kept, kept_seconds = read_kept(path)
        with atomic_open(path, "w") as f:
            json.dump({"machine": this_machine(), "choices": {**kept, key: name},
                       "seconds": {**kept_seconds, key: times}}, f, indent=1)
    except OSError as e:
        say_once(f"note: cannot keep the decode kernel choice in {path} ({e.strerror}), so each run measures it "
                 f"again (about a second); set {CACHE_ENV} to a writable folder to keep it")


def row_dtype(layer):
    return getattr(layer, "row_dtype", layer.weight.dtype)


def random_rows(layer, rows):
    if row_dtype(layer) == torch.int8:
        return torch.randint(-127, 128, (rows, layer.in_features), dtype=torch.int8)
    return torch.randn(rows, layer.in_features, dtype=row_dtype(layer))


def usable_kernels(layer, rows, compiled):
    """The candidates that run here on a layer's weights (its first 64 rows: a check, not a timing) and give
    F.linear's result within float rounding (int8 rows: their exact integer sums)."""
    x, weight = random_rows(layer, rows), layer.weight[:64]
    expected = F.linear(x.double(), weight.double())
    tolerance = 2e-2 if x.dtype in (torch.bfloat16, torch.float16) else 1e-4  # relative to the largest output
    usable = []
    for name, kernel in KERNELS.items():
        if name in COMPILED_ONLY and not compiled:
            continue
        try:
            y = kernel(x, weight, None)
        except (RuntimeError, AttributeError):  # e.g. no oneDNN (or its int8 ops) in this build, none for this dtype
            continue
        if y.shape == expected.shape and (y.double() - expected).abs().max() <= tolerance * expected.abs().max():
            usable.append(name)
    return usable


def run_layers(kernel, layers, inputs):
    """Every layer's product; returned, since a compiled function that returned nothing would compute nothing."""
    return [kernel(x, layer.weight, layer.bias) for layer, x in zip(layers, inputs)]


def float32_stand_ins(layers):
    """Float32 layers of the layers' shapes, random: what int8 or 16-bit weights are timed against (slower_mode_note).
    None where the layers are float32 already, or a float32 copy of them would not fit."""
    if all(layer.weight.dtype == row_dtype(layer) == torch.float32 for layer in layers) or not room_for(
            sum(4 * layer.weight.numel() for layer in layers)):
        return None
    return [SimpleNamespace(in_features=layer.in_features, weight=torch.randn(layer.weight.shape),
                            bias=None if layer.bias is None else torch.randn(layer.bias.shape)) for layer in layers]


def measure(layers, rows, candidates, compiled, clock=time.perf_counter):
    """(the fastest candidate, its seconds, float32's seconds or None): each candidate timed on all layers in order (a
    model larger than the caches is then read from memory, as decoding reads it), compiled if the step will be
    (inductor writes some products, e.g. torch.mv, as loops of its own, faster than the library's eager). Layers
    holding other weights than float32 time torch's own eager float32 product beside them, in the same rounds."""
    inputs = [random_rows(layer, rows) for layer in layers]
    if compiled:
        use_compile_cache()  # before the process's first compilation: inductor reads the folder once
    # isolate_recompiles: dynamo keeps at most 8 graphs of one function and runs the rest eager, timing them wrong
    runs = {name: functools.partial(torch.compile(run_layers, dynamic=False, isolate_recompiles=True) if compiled
                                    else run_layers, KERNELS[name], layers, inputs) for name in candidates}
    stand_ins = float32_stand_ins(layers)
    if stand_ins:
        runs[FLOAT32] = functools.partial(run_layers, KERNELS["torch"], stand_ins,
                                          [random_rows(layer, rows) for layer in stand_ins])
    best = {}
    with torch.inference_mode():
        for run in runs.values():
            run()  # a first call compiles, or builds the library's plan for these shapes
        for _ in range(REPEATS):
            for name, run in runs.items():
                start = clock()
                run()
                best[name] = min(best.get(name, float("inf")), clock() - start)
    fastest = min(candidates, key=best.get)
    return fastest, best[fastest], best.get(FLOAT32)


def room_for(size):
    """Whether size more bytes fit in half the memory free now (Linux; elsewhere, no)."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return False
    return 2 * size < free


def room_for_a_copy(layers):
    return room_for(sum(layer.weight.numel() * layer.weight.element_size() for layer in layers))


def choice_key(layers, rows, compiled):
    shapes = sorted({(layer.out_features, layer.in_features, layer.bias is not None) for layer in layers})
    dtypes = {str(layer.weight.dtype).removeprefix("torch."): None for layer in layers}
    activations = {str(row_dtype(layer)).removeprefix("torch."): None for layer in layers}
    return (f"{'+'.join(dtypes)} weights, {'+'.join(activations)} rows: {rows}{', compiled' if compiled else ''}, "
            f"{torch.get_num_threads()} threads; "
            + ", ".join(f"{o}x{i}{'+bias' if b else ''}" for o, i, b in shapes))


def fastest_kernel(layers, rows, compiled):
    """The kernel for these layers (a model's linears) at rows rows, eager or compiled: remembered, else measured."""
    key = choice_key(layers, rows, compiled)
    if key not in choices:
        kept, kept_seconds = read_kept(os.path.join(cache_dir(), "kernels.json"))
        remembered, room = kept.get(key), room_for_a_copy(layers)
        if remembered in KERNELS and (room or remembered not in COPIES_WEIGHTS) and key in kept_seconds:
            choices[key], seconds[key] = remembered, kept_seconds[key]
        else:
            candidates = usable_kernels(max(layers, key=lambda layer: layer.weight.numel()), rows, compiled)
            candidates = [name for name in candidates if room or name not in COPIES_WEIGHTS]
            name, fastest, float32 = measure(layers, rows, candidates, compiled)
            choices[key], seconds[key] = name, [fastest, float32]
            remember(key, choices[key], seconds[key])
    return choices[key]


def slower_mode_note(key):
    """The line for a choice whose weights (int8, 16-bit) multiply slower on this CPU than float32 ones would: the mode
    saves memory there, not time (on an AVX2-only CPU int8 ran 5.7x slower than float32: bench/RESULTS.md); else None."""
    fastest, float32 = seconds[key]
    if float32 is None or fastest <= float32:
        return None
    weights, rows = key.split(":")[0], key.split(":")[1].split(",")[0].strip()
    return (f"note: on this CPU, {weights} multiply slower than float32 weights ({1e3 * fastest:.2f} vs "
            f"{1e3 * float32:.2f} ms for this model's layers at {rows} row{'s' if rows != '1' else ''}, measured): "
            "float32 (no --quantize, --dtype=float32) decodes faster here, in more memory")


class DecodeLinear(nn.Module):
    """A linear layer as decode_linears swaps it in, running the kernel chosen for a decode-sized input's row count
    (else the most rows'); a prefill, or an eager step of a compiled-only kernel, runs the layer's own forward. It
    holds the layer's tensors under their names, and its hooks: state_dict is unchanged."""

    def __init__(self, layer, chosen):
        super().__init__()
        self._parameters.update(layer._parameters)
        self._buffers.update(layer._buffers)
        self.in_features, self.out_features, self.chosen = layer.in_features, layer.out_features, chosen
        self.layer_forward, self.layer_repr = layer.forward, layer.extra_repr()  # the layer itself is no submodule
        self.layer_through = getattr(layer, "through", None)  # an int8 layer scales its rows after the product
        for hooks in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                      "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            setattr(self, hooks, getattr(layer, hooks))  # the layer's hooks still run (given this module)

    def forward(self, x):
        n_rows = x.numel() // x.size(-1)
        kernel = self.chosen.get(n_rows, self.chosen[max(self.chosen)])
        if n_rows > DECODE_ROWS or kernel == "torch" or (kernel in COMPILED_ONLY and not torch.compiler.is_compiling()):
            return self.layer_forward(x)
        if self.layer_through is not None:
            return self.layer_through(KERNELS[kernel], x)
        return KERNELS[kernel](x, self.weight, self.bias)

    def extra_repr(self):
        kernels = ", ".join(f"{name} at {rows} row{'s' if rows > 1 else ''}" for rows, name in self.chosen.items())
        return f"{self.layer_repr}, kernel {kernels}"


def is_decode_linear(module):
    """A linear layer on the CPU: an nn.Linear or an int8 one (quantize.py: it has `through`)."""
    return (isinstance(module, nn.Linear) or hasattr(module, "through")) and module.weight.device.type == "cpu"


@contextlib.contextmanager
def decode_linears(model, rows, compiled=False):
    """In the block, the model's CPU linear layers are DecodeLinears running the kernel chosen at `rows` rows, or at
    each of several (a speculative check and its one-token steps); where torch's own is chosen everywhere, none is."""
    linears = [m for m in model.modules() if is_decode_linear(m)]
    counts = {min(n, DECODE_ROWS) for n in ((rows,) if isinstance(rows, int) else rows)}
    chosen = {n: fastest_kernel(linears, n, compiled) for n in sorted(counts)} if linears else {}
    swapped = [(parent, name, child) for parent in list(model.modules()) for name, child in parent.named_children()
               if is_decode_linear(child)] if set(chosen.values()) - {"torch"} else []
    for parent, name, layer in swapped:
        setattr(parent, name, DecodeLinear(layer, chosen))
    try:
        yield
    finally:
        for parent, name, layer in swapped:
            setattr(parent, name, layer)
        packed_weights.clear()  # the weights may change after the block: packed again in the next


def chosen_note():
    path = os.path.join(cache_dir(), "kernels.json")
    kept = f"kept in {path}" if choices.keys() <= read_kept(path)[0].keys() else "not kept"
    slower = [note for note in map(slower_mode_note, choices) if note]
    return "\n".join([f"note: decode kernels chosen for this CPU: {', '.join(dict.fromkeys(choices.values()))} "
                      f"({kept})", *slower])


def use_compile_cache(device_type="cpu"):
    """Point inductor's on-disk caches at cache_dir(), so a second run loads the compiled step, unless the user chose a
    folder (importing inductor sets TORCHINDUCTOR_CACHE_DIR to its temporary default: no choice); for a CPU, check the
    vector ISAs once per machine (check_isas_once)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # no more of inductor than this
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    folder = os.path.join(cache_dir(), "inductor")
    if not chosen or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        try:
            os.makedirs(folder, exist_ok=True)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
        except OSError as e:
            say_once(f"note: cannot keep compiled code in {folder} ({e.strerror}); torch's own temporary folder is used")
    if device_type == "cpu":
        check_isas_once()


ISAS_CHECKED = "the vector ISAs the CPU's flags name: the C++ compiler builds and loads each"  # a kernels.json entry


def check_isas_once():
    """Inductor checks, in every process that compiles for a CPU, that the C++ compiler builds and loads code for each
    vector ISA the CPU's flags name (AVX2, AVX-512, AMX...): subprocesses, 2-4 s of each run's start. Where a run on this
    machine (kernels.json's) found every one good, this run skips the checks: config.cpp.vec_isa_ok=True takes the ISAs
    the flags name, as they would have passed. Not where TORCHINDUCTOR_VEC_ISA_OK decided (set, the tests' conftest.py)."""
    try:  # inductor's own, not a public API: where a torch other than requirements.txt's lacks them, nothing changes
        from torch._inductor import config
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list  # cached for the process
        if config.cpp.vec_isa_ok is not None:
            return
    except (ImportError, AttributeError):
        return
    path = os.path.join(cache_dir(), "kernels.json")
    if read_kept(path)[0].get(ISAS_CHECKED) == "all":
        config.cpp.vec_isa_ok = True
        return
    checked = [str(isa) for isa in valid_vec_isa_list()]  # inductor's checks, which it would run anyway
    config.cpp.vec_isa_ok = True  # then what skipping them gives
    valid_vec_isa_list.cache_clear()
    if [str(isa) for isa in valid_vec_isa_list()] == checked:
        remember(ISAS_CHECKED, "all", None)
    else:  # one failed (e.g. AMX with a compiler too old for it): checked in every run, as inductor does
        config.cpp.vec_isa_ok = None
        valid_vec_isa_list.cache_clear()
