"""
Model FLOPs utilization for train.py's log: training FLOP/s over the hardware's peak. Imported only where a peak is
known (a CUDA GPU, or --peak_flops).
"""

import torch

# Dense tensor-core peaks in FLOP/s (no sparsity; fp32 accumulation) as (bfloat16, float16), from NVIDIA's
# datasheets, keyed by the exact torch.cuda.get_device_name(); None: no bfloat16 tensor cores (auto picks float16)
PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": (989e12, 989e12), "NVIDIA H100 PCIe": (756e12, 756e12), "NVIDIA H100 NVL": (835e12, 835e12),
    "NVIDIA H200": (989e12, 989e12), "NVIDIA H200 NVL": (835e12, 835e12),
    "NVIDIA A100-SXM4-80GB": (312e12, 312e12), "NVIDIA A100-SXM4-40GB": (312e12, 312e12),
    "NVIDIA A100 80GB PCIe": (312e12, 312e12), "NVIDIA A100-PCIE-40GB": (312e12, 312e12),
    "NVIDIA A10": (125e12, 125e12), "NVIDIA L4": (121e12, 121e12), "NVIDIA L40S": (362e12, 362e12),
    "NVIDIA GeForce RTX 3090": (71e12, 71e12), "NVIDIA GeForce RTX 4090": (165e12, 165e12),
    "Tesla T4": (None, 65e12), "Tesla V100-SXM2-16GB": (None, 125e12), "Tesla V100-SXM2-32GB": (None, 125e12),
    "Tesla V100-PCIE-16GB": (None, 112e12), "Tesla V100-PCIE-32GB": (None, 112e12),
}


def flops_per_token(model, seq_len):
    """Training FLOPs per token, as in the PaLM paper (appendix B): 6 per weight of every matmul, plus
    12 * n_layer * n_head * head_dim * seq_len for attention (counted unmasked, as is the convention)."""
    cfg = model.config
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 6 * matmul_weights + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len


def mfu(model, tokens_per_second, peak, seq_len):
    """Model FLOPs utilization: training FLOP/s over the hardware's peak (e.g. 989e12 for an H100's dense bf16)."""
    return flops_per_token(model, seq_len) * tokens_per_second / peak


def peak_flops(gpu_name, dtype):
    """The peak FLOP/s of a GPU (its exact name) in a dtype, for MFU; None if the table does not have it."""
    bf16, fp16 = PEAK_FLOPS.get(gpu_name, (None, None))
    return {torch.bfloat16: bf16, torch.float16: fp16}.get(dtype)


def device_peak_flops(ptdtype, say):
    """This GPU's peak FLOP/s in ptdtype, or None (said with say) if PEAK_FLOPS does not know it."""
    gpu = torch.cuda.get_device_name()
    peak = peak_flops(gpu, ptdtype)
    if peak is None:
        say(f"no MFU: the peak FLOP/s of {gpu} in {str(ptdtype)[6:]} is not in gpt/mfu.py's PEAK_FLOPS; pass "
              "--peak_flops=<its dense FLOP/s> to see MFU")
    return peak


def peak_tokens_per_sec(model, settings, ptdtype, world_size, say):
    """train.py's tokens/s over all processes at the hardware's peak (--peak_flops, else this GPU's), or None."""
    peak = settings["peak_flops"] or device_peak_flops(ptdtype, say)
    return peak and peak * world_size / flops_per_token(model, settings["block_size"])
