"""
Low-precision weights for decoding: a model's linear layers with int8 weights, for sample.py and eval.py.

    model = quantize(model, "int8")   # in place: every nn.Linear (the output head too) becomes an Int8WeightOnlyLinear

Batch-1 decoding reads every weight once per token, so a quarter of the bytes is up to 4x the speed. Each weight
row (output channel) is stored as int8 with one scale (its largest magnitude / 127), and the layer computes
y = (x W_int8^T) * scale, the int8 weight cast to the activations' dtype inside the product (gpt-fast's form): the
activations keep the model's precision, nothing of them is quantized. The same layer on every device:
- Compiled (sample.py --compile=True), a step reads int8 weights: on a CPU, kernels.py writes each decode-sized
  product as a reduction, which inductor compiles into one loop that casts and multiplies as it streams the int8
  weights (3.2-3.4 ms a token for GPT-2-small on a 2-core AMD EPYC, 0.77-0.93x llama.cpp's q8_0; bench/RESULTS.md); on CUDA,
  coordinate-descent tuning (engine.CUDA_COMPILE_OPTIONS) makes inductor turn a one-row product into such a
  reduction itself. At batch > 1 on a GPU (a one-row product no more), and eager anywhere, each step first writes
  a float copy of every weight and multiplies that: more bytes than float32, so slower; sample.py compiles int8
  on a CPU by default. (torch 2.13 ignores inductor's use_mixed_mm; its prologue fusion needs max-autotune's
  Triton templates.) Shown by tracing on the CPU (tests/test_quantize.py); the GPU's speed is bench/gpu_check.py's.
- Not fbgemm's dynamic int8 (torch's quantize_dynamic, this repo's CPU form until issue 28): it quantizes the
  activations too, so its rows' results depended on how their range was pinned, and torch.compile cannot trace
  its packed weights. Compiled, the weight-only form is ~2x faster (bench/RESULTS.md).
The quality cost is measured by bench/bench_quality.py (bits per byte, greedy agreement with float32).
"""


import torch
import torch.nn as nn
import torch.nn.functional as F

SCHEMES = ("int8",)


class QuantizeError(Exception):
    """A quantization the user asked for that cannot run here; the message is one line saying what to do."""


def check_quantize(scheme):
    """Raise QuantizeError unless scheme is one this file knows (None or "" for none). Int8WeightOnlyLinear is
    plain torch ops: it runs wherever F.linear does."""
    if scheme and scheme not in SCHEMES:
        raise QuantizeError(f"quantize must be one of {', '.join(SCHEMES)} (or None), got {scheme!r}")


def row_scales(weight):
    """One scale per output channel of a weight (out, in): the row's largest magnitude maps to 127."""
    return weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # (out,)


class Int8WeightOnlyLinear(nn.Module):
    """A linear layer y = (x W^T) * scale + b whose W (out, in) is held as int8 with one scale per output row;
    x, y, the scales and the bias keep the model's dtype. Fast compiled: see the module's docstring."""

    def __init__(self, linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()  # (out, in)
        scales = row_scales(weight)
        self.register_buffer("weight", torch.round(weight / scales[:, None]).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x):  # x (..., in) -> (..., out)
        y = F.linear(x, self.weight.to(x.dtype)) * self.scales
        return y if self.bias is None else y + self.bias

    def dequantized_weight(self):
        return self.weight.float() * self.scales.float()[:, None]

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per output channel"


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
    return replace_linears(model, Int8WeightOnlyLinear)
