"""
Which kernel torch's scaled_dot_product_attention runs for grouped-query attention (fewer kv heads than query
heads), so that model.attention knows whether to pass enable_gqa=True or to repeat k and v itself, and which
kernels an eager decode step (a key length new at every step) may run. Facts about torch's kernels on each card,
not about the model, so they live apart from model.py.

Where no fused kernel takes enable_gqa, SDPA falls back to its math kernel, which holds every (B, nh, T, S) score:
config/gpt2_124m.py's batch of 64 x 12 heads x 1024 x 1024 is 805M scores a layer, 1.6 GB at 2 bytes. Repeated k and
v (n_head heads, no enable_gqa) go to a fused kernel instead. tests/test_sdpa_kernels.py holds the kernel table for
each card and dtype and where it was read from.
"""

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# An eager decode step reads a key length new at every step, and cuDNN's kernel builds an execution plan for each
# new length: eager decoding at the 124M shape on an H100 (torch 2.11) ran 19 tokens/s with it, 140 without
# (bench/RESULTS.md). torch's TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 is opt-in; SDPA's other kernels need no plan.
NEW_KEY_LENGTH_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def takes_gqa(q, masked):
    """sdpa_fuses_gqa for a call with these queries (B, nh, T, hd), with or without an attn_mask. The card's numbers
    are read only on CUDA (cached by torch; constants to torch.compile). Under autocast q can be fp32 (qk_norm's
    RMSNorm runs in fp32) while SDPA casts it to autocast's dtype: that dtype is what the kernel sees."""
    capability, dtype = None, q.dtype
    if q.is_cuda:
        props = torch.cuda.get_device_properties(q.device)
        capability = None if torch.version.hip else (props.major, props.minor)  # ROCm: other numbers, other rules
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else q.dtype
    return sdpa_fuses_gqa(q.device.type, capability, dtype, masked, q.size(-1))


def sdpa_fuses_gqa(device_type, capability, dtype, masked, head_dim):
    """Whether F.scaled_dot_product_attention(..., enable_gqa=True) runs a fused kernel, one that never holds the
    scores, given the device type, an NVIDIA card's compute capability (major, minor) (None for other cards), the
    dtype the kernel sees, whether an attn_mask is passed, and head_dim."""
    if device_type != "cuda":
        return True  # the CPU's flash kernel takes enable_gqa with or without a mask, in every float dtype
    # torch 2.13's choice on CUDA (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, select_sdp_backend): flash,
    # then memory-efficient, then math (cuDNN, which also takes GQA, goes first only on sm90/sm100 with a recent
    # cuDNN). The memory-efficient kernel refuses fewer kv heads than query heads (torch 2.14 adds GQA to it), so
    # only flash takes enable_gqa: no attn_mask, fp16 or bf16, sm80 to sm121, head_dim <= 256. Training on
    # sm86/89/120 refuses head_dim 193..224, and 225..256 with dropout: above 192, k and v are repeated on every card.
    return (capability is not None and (8, 0) <= capability <= (12, 1) and dtype in (torch.float16, torch.bfloat16)
            and not masked and head_dim <= 192)


def new_key_length_kernels():
    """SDPA's kernels for an eager decode step on CUDA (gpt/engine.py's last_logits): a key length new at every step,
    so every kernel but cuDNN's (a static cache's length stays, and keeps cuDNN's, the fastest there)."""
    return sdpa_kernel(NEW_KEY_LENGTH_KERNELS)
