"""A machine with CUDA GPUs, as far as torch's queries go, on a CPU-only torch: faked at torch's C boundary only.

torch.cuda.set_device, is_available, device_count and current-device lookups stay torch's own Python, so their
checks run on the project's real arguments (torch.cuda.set_device("cuda") raised in torch while a test that had
replaced set_device itself passed); only the C functions under them answer as a GPU machine would. The first call
that needs the CUDA runtime itself (an allocation, a .to("cuda"), a generator) still fails, in
torch.cuda._lazy_init: a test runs an entry point up to there.

The property queries (capability, name, bfloat16 support) are faked at torch.cuda's level: torch reads them from
the runtime after _lazy_init, which cannot run here.

Used two ways: tests/conftest.py's fake_cuda fixture calls install() in the test's process; a subprocess started
with this folder on PYTHONPATH and FAKE_CUDA="8.0" (a compute capability) installs it at start-up, as Python
imports sitecustomize (bench/gpu_check.py's rows, torchrun's workers).
"""

import os

GPUS = 2
NAME = "Fake GPU"


def install(setattr, capability=(8, 0)):
    """Fake a machine with GPUS CUDA devices of this compute capability; setattr(obj, name, value) does the
    patching (the fixture's monkeypatch, undone after the test). Returns the current device as a one-item list."""
    import torch
    import torch._dynamo  # before the fake: on import it binds CUDA's C functions wherever torch was built with CUDA

    current = [0]

    def set_device(index):  # what the C function gets: torch's Python has turned the argument into an index
        if not isinstance(index, int) or not 0 <= index < GPUS:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index!r}")
        current[0] = index

    setattr(torch._C, "_cuda_getDeviceCount", lambda: GPUS)  # torch.cuda.is_available, device_count; "compiled"
    setattr(torch._C, "_cuda_setDevice", set_device)
    setattr(torch._C, "_cuda_getDevice", lambda: current[0])
    setattr(torch._C, "_get_accelerator", lambda check=None: torch.device("cuda"))  # the build's accelerator
    setattr(torch._C, "_accelerator_getAccelerator", lambda: torch.device("cuda"))
    setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    setattr(torch.cuda, "get_device_name", lambda device=None: NAME)
    setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: capability >= (8, 0))
    return current


if os.environ.get("FAKE_CUDA"):
    install(setattr, tuple(int(part) for part in os.environ["FAKE_CUDA"].split(".")))
