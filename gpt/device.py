"""The device and dtype a command runs on, from its --device and --dtype settings."""

import torch

from gpt import UserError


def resolve_device(device):
    """"auto": CUDA, then MPS, then CPU; else cpu, cuda, cuda:N or mps, where torch has it. cuda:N becomes the current
    device: torch.compile, fused AdamW and the allocator use that one, so cuda:1 would still touch cuda:0."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda", "mps") or index and not index.isdigit():  # "gpu", "meta", "cuda:x": a traceback
        raise UserError(f"--device={device} is not a device this runs on; use auto, cpu, cuda, cuda:N or mps")
    if kind != "cpu" and not (torch.cuda if kind == "cuda" else torch.backends.mps).is_available():
        raise UserError(f"--device={device}, but this torch ({torch.__version__}) sees no "
                        f"{'CUDA GPU' if kind == 'cuda' else 'MPS device'}; use --device=cpu (or auto)")
    if kind == "cuda" and index:
        if int(index) >= torch.cuda.device_count():
            raise UserError(f"--device={device}, but this machine has {torch.cuda.device_count()} CUDA GPU(s), cuda:0 "
                            f"to cuda:{torch.cuda.device_count() - 1}")
        torch.cuda.set_device(int(index))
    return device


def resolve_dtype(dtype, device):
    """The torch dtype for a dtype setting. "auto": bfloat16 on CUDA cards of compute capability 8.0 or more, float16
    on older ones (they only emulate bfloat16, slowly, and SDPA's flash kernel refuses it), float32 on CPU and MPS.
    bfloat16 asked of an older card is an error, not a slow run."""
    cuda = device.startswith("cuda")
    capability = tuple(torch.cuda.get_device_capability(device)) if cuda and dtype in ("auto", "bfloat16") else None
    if dtype == "auto":
        dtype = "float32" if not cuda else "bfloat16" if capability >= (8, 0) else "float16"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    if dtype == "bfloat16" and cuda and capability < (8, 0):
        raise UserError(f"this GPU ({torch.cuda.get_device_name(device)}, compute capability {capability[0]}."
                        f"{capability[1]}) only emulates bfloat16; use --dtype=float16 (or auto)")
    return getattr(torch, dtype)
