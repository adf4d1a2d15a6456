"""
Low-precision weights for decoding: a model's linear layers with int8 weights, for sample.py and eval.py.

    model = quantize(model, "int8")   # in place: every nn.Linear (the output head too) becomes an Int8WeightOnlyLinear
    model = quantize(model, "w8a8")   # ... a W8A8Linear: int8 weights times int8 rows

Batch-1 decoding reads every weight once per token, so a quarter of the bytes is up to 4x the speed. Each weight
row (output channel) is stored as int8 with one scale (its largest magnitude / 127), and the layer computes
y = (x W_int8^T) * scale, the int8 weight cast to the activations' dtype inside the product (gpt-fast's form): the
activations keep the model's precision, nothing of them is quantized. The same layer on every device:
- Compiled (sample.py --compile=True), a step reads int8 weights: on a CPU, kernels.py writes each decode-sized
  product as a reduction, which inductor compiles into one loop that casts and multiplies as it streams the int8
  weights (about llama.cpp's q8_0 speed: bench/RESULTS.md); on CUDA, coordinate-descent tuning
  (static_step.CUDA_COMPILE_OPTIONS) makes inductor turn a one-row product into such a reduction itself. At batch > 1
  on a GPU (a one-row product no more), and eager anywhere, each step first writes a float copy of every weight and
  multiplies that: more bytes than float32, so slower; sample.py compiles int8 on a CPU by default. (torch 2.13
  ignores inductor's use_mixed_mm; its prologue fusion needs max-autotune's Triton templates.) Shown by tracing on
  the CPU (tests/test_quantize.py); the GPU's speed is bench/gpu_check.py's.
- Not fbgemm's dynamic int8 (torch's quantize_dynamic, this repo's earlier CPU form): it quantizes the activations
  too, so its rows' results depended on how their range was pinned, and torch.compile cannot trace its packed
  weights; compiled, the weight-only form is faster (bench/RESULTS.md).

"w8a8" quantizes the activations too, each row on its own grid at run time (its largest magnitude / 127), and
multiplies int8 by int8 with exact integer sums: llama.cpp's q8_0 does the same with a scale per 32 values. A
one-row product reads the same int8 weights as "int8"; several rows (a batch, a speculative check) cost little more,
where weight-only int8 converts every weight for every row and runs out of arithmetic on a CPU. So "int8" is the
faster at batch 1 and "w8a8" at several rows (bench/bench_kernels.py; kernels.py picks each product's kernel by
measurement, and drops oneDNN's int8 x int8 kernels on a CPU without VNNI, where their sums saturate; gpt/avx2.py's
do not). Each row keeps its own scale, so a row's result never depends on the others in its batch (fbgemm's dynamic
int8, above, took one scale per call). Its layer's own forward, for prefills and devices without such a kernel,
multiplies the rows' integers in float32. The quality cost is measured by bench/bench_quality.py (bits per byte,
greedy agreement with float32).
"""


import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt import UserError

SCHEMES = ("int8", "w8a8")


def check_quantize(scheme, device="cpu"):
    """Raise UserError unless scheme is one this file knows (None or "" for none) and pays on device. Both
    layers are plain torch ops that run wherever F.linear does, but w8a8's int8 products have kernels on a CPU only
    (kernels.py): elsewhere its layers multiply a float32 copy of every weight each step, slower than float32."""
    if scheme and scheme not in SCHEMES:
        raise UserError(f"quantize must be one of {', '.join(SCHEMES)} (or None), got {scheme!r}")
    if scheme == "w8a8" and not device.startswith("cpu"):
        raise UserError(f"--quantize=w8a8 is a CPU mode (on {device} it would multiply a float32 copy of every "
                        "weight each step); use --quantize=int8 there")


def quantize_rows(x):
    """x (..., in) as int8 rows, each on its own grid (its largest magnitude maps to 127): (x_int8, scales (..., 1)
    float32) with x ~ x_int8 * scales. A weight's rows (output channels) once; w8a8's activations at every step."""
    x = x.float()
    scales = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127  # (..., 1)
    return torch.round(x / scales).to(torch.int8), scales


def hold_int8(layer, linear, scales_dtype):
    """Give layer (a new module) linear's sizes, its weight as int8 rows with one scale each, and its bias."""
    layer.in_features, layer.out_features = linear.in_features, linear.out_features
    weight, scales = quantize_rows(linear.weight.detach())  # int8 (out, in), (out, 1)
    layer.register_buffer("weight", weight)
    layer.register_buffer("scales", scales[:, 0].to(scales_dtype))
    layer.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())


class Int8WeightOnlyLinear(nn.Module):
    """A linear layer y = (x W^T) * scale + b whose W (out, in) is held as int8 with one scale per output row;
    x, y, the scales and the bias keep the model's dtype. Fast compiled: see the module's docstring."""

    def __init__(self, linear):
        super().__init__()
        hold_int8(self, linear, linear.weight.dtype)

    @property
    def row_dtype(self):  # the dtype of the rows a kernel multiplies the int8 weight by: the model's (kernels.py)
        return self.scales.dtype

    def forward(self, x):  # x (..., in) -> (..., out)
        return self.scaled(F.linear(x, self.weight.to(x.dtype)))

    def through(self, kernel, x):
        """The layer's output with kernel(x, weight, bias) (one of kernels.py's) as its product."""
        return self.scaled(kernel(x, self.weight, None))

    def scaled(self, products):
        """The layer's output from the product (..., out) of x and the int8 weight (any kernel's)."""
        y = products * self.scales
        return y if self.bias is None else y + self.bias

    def dequantized_weight(self):
        return self.weight.float() * self.scales.float()[:, None]

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per output channel"


class W8A8Linear(nn.Module):
    """A linear layer y = (x_int8 W_int8^T) * x_scale * w_scale + b: int8 weights with one scale per output row, and
    each input row quantized to int8 at run time with its own scale (quantize_rows); the product's sums are whole
    numbers, the scales are applied after it, and y and the bias keep the model's dtype."""

    row_dtype = torch.int8  # what a kernel multiplies the int8 weight by: the rows quantized (kernels.py)

    def __init__(self, linear):
        super().__init__()
        hold_int8(self, linear, torch.float32)  # scales in float32: applied to float32 sums

    def forward(self, x):  # x (..., in) -> (..., out)
        rows, row_scales = quantize_rows(x)
        # float32 sums of int8 products are whole numbers while below 2^24: ~1000 products of 127 x 127 reach it,
        # real rows stay far below (and a kernel's int32 sums are exact)
        return self.scaled(F.linear(rows.float(), self.weight.float()), row_scales, x.dtype)

    def through(self, kernel, x):
        """The layer's output with kernel(int8 rows, weight, bias) (one of kernels.py's) giving the integer sums."""
        rows, row_scales = quantize_rows(x)  # int8 (..., in), float32 (..., 1)
        return self.scaled(kernel(rows, self.weight, None), row_scales, x.dtype)

    def scaled(self, sums, row_scales, dtype):
        """The layer's output from the integer sums (..., out) of its rows' product (any kernel's), in dtype."""
        y = (sums.float() * row_scales * self.scales).to(dtype)
        return y if self.bias is None else y + self.bias

    def dequantized_weight(self):
        return self.weight.float() * self.scales[:, None]

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per output channel and per row"


def replace_linears(model, quantized_layer):
    """Replace every nn.Linear of model (in place) by quantized_layer(that linear)."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                setattr(parent, name, quantized_layer(child))
    return model


def quantize(model, scheme):
    """model with every nn.Linear (the output head too) quantized, in place (scheme None: unchanged). The embedding
    stays in float: a step reads one row of it, not all."""
    if not scheme:
        return model
    check_quantize(scheme)
    return replace_linears(model, W8A8Linear if scheme == "w8a8" else Int8WeightOnlyLinear)
