"""
Low-precision weights for decoding: a model's linear layers with int8 weights, for sample.py and eval.py.

    model = quantize(model, "int8")   # in place: every nn.Linear (the output head too) becomes an Int8Linear

Batch-1 decoding reads every weight once per token, so a quarter of the bytes is up to 4x the speed. Each weight
row (output channel) is stored as int8 with one float scale (its largest magnitude / 127).
- On CPU (Int8Linear): dynamic int8, what torch's quantize_dynamic makes: at run time each input row is quantized
  to int8 too, and fbgemm's kernel multiplies in int32 and scales back to float; nothing is dequantized in Python.
  On the 50304 x 768 output head it runs 3-7x faster than fp32, bf16 or torchao's int8 kernels, on an Intel Xeon
  and on an AMD EPYC (bench/RESULTS.md). torch.compile cannot trace it.
- Elsewhere (Int8WeightOnlyLinear, for GPUs): weight-only int8, gpt-fast's form: y = (x W_int8^T) * scale, the
  int8 weight cast to the activations' dtype inside the product. Only compiled at batch 1 does a step read int8
  weights: sample.py --compile=True on CUDA compiles with coordinate-descent tuning (engine.CUDA_COMPILE_OPTIONS),
  under which inductor turns a one-row product into a reduction that takes the cast into its kernel. At batch > 1
  (a one-row product no more), and eager, each step first writes a 16-bit copy of every weight and multiplies that:
  more bytes than --dtype=bfloat16, so slower. (torch 2.13 ignores inductor's use_mixed_mm; its prologue fusion
  needs max-autotune's Triton templates.) Shown by tracing on the CPU (tests/test_quantize.py); the speed is
  bench/gpu_check.py's to measure.
The quality cost is measured by bench/bench_quality.py (bits per byte, greedy agreement with float32).
"""

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

SCHEMES = ("int8",)
KEEP_ROWS = 16  # Int8Linear keeps its input buffer between calls of up to this many rows (decode steps)
CPU_INT8_ENGINES = ("x86", "fbgemm", "onednn", "qnnpack")  # torch's quantized engines that run linear_dynamic


class QuantizeError(Exception):
    """A quantization the user asked for that cannot run here; the message is one line saying what to do."""


def check_quantize(scheme, device, compile=False):
    """Raise QuantizeError unless scheme (None or "" for none) can run on device (a str or torch.device)."""
    if not scheme:
        return
    if scheme not in SCHEMES:
        raise QuantizeError(f"quantize must be one of {', '.join(SCHEMES)} (or None), got {scheme!r}")
    if torch.device(device).type != "cpu":
        return  # Int8WeightOnlyLinear: plain torch ops, wherever F.linear runs
    if not set(CPU_INT8_ENGINES) & set(torch.backends.quantized.supported_engines):
        raise QuantizeError(f"this torch build has no int8 kernel for this CPU (quantized engines: "
                            f"{torch.backends.quantized.supported_engines}); drop --quantize")
    if compile:
        raise QuantizeError(f"--quantize={scheme} cannot be compiled on CPU (torch.compile cannot trace fbgemm's "
                            "int8 kernel); drop --compile: the int8 step is the faster of the two on CPU")


def row_scales(weight):
    """One scale per output channel of a weight (out, in): the row's largest magnitude maps to 127."""
    return weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # (out,)


full_range_exact = None  # whether 8-bit activations are exact on this CPU: measured once, by full_range_is_exact


def full_range_is_exact():
    """Whether fbgemm's int8 products are exact here with activations in the full 8 bits. With VNNI (int8 dot
    products summed in int32) they are; AVX2 without it sums pairs of u8 x s8 products in int16, which
    saturates at extreme values, so activations must keep to 7 bits (reduce_range, as torch's own dynamic
    Linear always does on x86; that costs quality: +0.37% bits per byte instead of +0.10% on out-small).
    Measured on a product whose pair sums would overflow int16: 255 x 127 twice, 64 times."""
    global full_range_exact
    if full_range_exact is None:
        ones = nn.Linear(64, 8, bias=False)
        nn.init.ones_(ones.weight)  # int8 127 with scale 1/127; an input of ones is uint8 255 with scale 1/255
        y = torch.ops.quantized.linear_dynamic(torch.ones(1, 64), Int8Linear(ones).packed, False)  # exact: 64
        full_range_exact = bool(torch.allclose(y, torch.full_like(y, 64.0), rtol=1e-3))
    return full_range_exact


class Int8Linear(nn.Module):
    """A linear layer y = x W^T + b whose W (out, in) is held as int8 with one scale per output row, in fbgemm's
    packed layout; x and y keep the model's float dtype."""

    def __init__(self, linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float().cpu()  # (out, in)
        scales = row_scales(weight)
        self.bias = None if linear.bias is None else linear.bias.detach().float().cpu()  # added after the rescale
        with warnings.catch_warnings():  # torch warns that quantized tensors are deprecated: this is the one place
            warnings.simplefilter("ignore", UserWarning)
            q_weight = torch.quantize_per_channel(weight, scales.double(), torch.zeros_like(scales, dtype=torch.long),
                                                  axis=0, dtype=torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(q_weight, None)
        self.range_row = torch.zeros(1, self.in_features)  # see forward
        self.range_row[0, :2] = torch.tensor([1.0, -1.0])
        self.unit_rows = self.range_row  # the kernel's input (M + 1, in) of the last decode-sized call

    def forward(self, x):  # x (..., in) -> (..., out)
        # fbgemm quantizes its whole input with one scale, so a row's result would depend on the other rows (a
        # decode batch, a speculative chunk: greedy speculative decoding would no longer equal plain greedy). So
        # each row is divided by its largest magnitude, and a last row [1, -1, 0, ...] pins the range to [-1, 1]:
        # every row is quantized on its own grid, whatever else is in the batch.
        rows = x.detach().reshape(-1, self.in_features).float()  # (M, in); for inference only: no gradient
        M = rows.size(0)
        unit_rows = self.unit_rows
        if unit_rows.size(0) != M + 1:
            unit_rows = torch.cat([torch.empty(M, self.in_features), self.range_row])  # (M + 1, in)
            if M <= KEEP_ROWS:  # a decode step's: kept for the next step (~15% faster at M=1); a prefill's is not
                self.unit_rows = unit_rows
        row_max = rows.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30)  # (M, 1)
        torch.div(rows, row_max, out=unit_rows[:M])
        y = torch.ops.quantized.linear_dynamic(unit_rows, self.packed, not full_range_is_exact())[:M]
        y.mul_(row_max)  # (M, out)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def dequantized_weight(self):
        """The weight (out, in) as the kernel sees it, in float32: the int8 values times their row's scale."""
        q_weight, _ = torch.ops.quantized.linear_unpack(self.packed)
        return q_weight.dequantize()

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per output channel"


class Int8WeightOnlyLinear(nn.Module):
    """A linear layer y = (x W^T) * scale + b whose W (out, in) is held as int8 with one scale per output row;
    x, y, the scales and the bias keep the model's dtype. For GPUs, compiled: see the module's docstring."""

    def __init__(self, linear):
        super().__init__()
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


def replace_linears(model, quantized_layer):
    """Replace every nn.Linear of model (in place) by quantized_layer(that linear)."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                setattr(parent, name, quantized_layer(child))
    return model


def quantize(model, scheme):
    """model with every nn.Linear (the output head too) quantized, in place (scheme None: unchanged): Int8Linear on
    CPU, Int8WeightOnlyLinear elsewhere. The embedding stays in float: a step reads one row of it, not all."""
    if not scheme:
        return model
    device = next(model.parameters()).device
    check_quantize(scheme, device)
    return replace_linears(model, Int8Linear if device.type == "cpu" else Int8WeightOnlyLinear)
