"""The device and dtype a command runs on, from its --device and --dtype settings."""

import torch

from gpt import UserError


def resolve_device(device):
    """"auto": CUDA, then MPS, then CPU; anything else as given. A CUDA device with an index is made the current one:
    torch.compile, fused AdamW and the allocator use the current device, so --device=cuda:1 would still touch cuda:0."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device={device}, but this torch ({torch.__version__}) sees no CUDA GPU; "
                            "use --device=cpu (or auto)")
        index, count = torch.device(device).index, torch.cuda.device_count()
        if index is not None:
            if index >= count:
                raise UserError(f"--device={device}, but this machine has {count} CUDA GPU(s), cuda:0 to "
                                f"cuda:{count - 1}")
            torch.cuda.set_device(index)
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
