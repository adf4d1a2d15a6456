"""A machine with CUDA GPUs, as far as torch's queries go, on a CPU-only torch: faked at torch's C boundary only.

torch.cuda.set_device, is_available, device_count and current-device lookups stay torch's own Python, so their
checks run on the project's real arguments (torch.cuda.set_device("cuda") raised in torch while a test that had
replaced set_device itself passed); only the C functions under them answer as a GPU machine would. The first call
that needs the CUDA runtime itself (an allocation, a .to("cuda"), a generator) still fails, in
torch.cuda._lazy_init: a test runs an entry point up to there. It is a CPU-only build's fake: on a torch built with
CUDA, _lazy_init gets past that point (or fails otherwise), so install() refuses to run there and the fake_cuda
fixture skips.

The cards are real ones (CARDS): Tesla V100-SXM2-16GB (compute capability 7.0), Tesla T4 (7.5),
NVIDIA A100-SXM4-80GB (8.0), NVIDIA GeForce RTX 4090 (8.9) and NVIDIA H100 80GB HBM3 (9.0), named as
torch.cuda.get_device_name prints them. torch.cuda.get_device_name, get_device_capability and is_bf16_supported
stay torch 2.13's own and answer for them as on that card; three things under them are faked at torch.cuda's level
instead of torch._C's, because torch runs them only after _lazy_init, which cannot run here: get_device_properties
(it keeps torch's index checks), current_device (the index still comes from the faked C function) and the bfloat16
tensor probe behind is_bf16_supported(including_emulation=True). The properties carry name, major and minor only:
any other field is an AttributeError, not an invented number.

Used two ways: tests/conftest.py's fake_cuda fixture calls install() in the test's process; a subprocess started
with this folder on PYTHONPATH and FAKE_CUDA set to a card's name or a compute capability ("8.0") installs it
once it imports torch: Python imports sitecustomize at start-up (bench/gpu_check.py's rows, torchrun's workers).
"""

import collections
import importlib.abc
import importlib.machinery
import os
import re
import sys

GPUS = int(os.environ.get("FAKE_CUDA_GPUS", "2"))  # how many cards (a test's subprocesses may be shown fewer)
# The name of a card asked for by compute capability alone (install's card=(7, 5), FAKE_CUDA=7.5): it answers as
# the table's card of that capability, under this name (tests/test_gpu_check.py expects it in gpu_check's lines)
NAME = "Fake GPU"

Card = collections.namedtuple("Card", "name capability bf16_tensors")
# bf16_tensors: whether torch.tensor([1.0], dtype=torch.bfloat16, device=...) works on the card, torch 2.13's probe
# (torch.cuda._check_bf16_tensor_supported) when is_bf16_supported(including_emulation=True) asks a card below 8.0.
# It does on all of these: making the tensor is an allocation and a host-to-device copy, no bfloat16 arithmetic, so
# cards before Ampere "emulate" bfloat16 (torch computes it through float32). A V100 needs a torch built for sm_70:
# from torch 2.11 the CUDA 12.8 and 13.0 wheels start at Turing (7.5), the 12.6 ones keep Volta.
CARDS = {card.name: card for card in [
    Card("Tesla V100-SXM2-16GB", (7, 0), True),
    Card("Tesla T4", (7, 5), True),
    Card("NVIDIA A100-SXM4-80GB", (8, 0), True),
    Card("NVIDIA GeForce RTX 4090", (8, 9), True),
    Card("NVIDIA H100 80GB HBM3", (9, 0), True),
]}
# What torch.cuda.get_device_properties returns here (torch's own type cannot be made from Python)
Properties = collections.namedtuple("_CudaDeviceProperties", "name major minor")


def card_of(card):
    """The Card for a card's name in CARDS or a compute capability (major, minor) (the table's card of that
    capability, named NAME); anything else is a ValueError naming what the table has."""
    if isinstance(card, str):
        if card not in CARDS:
            raise ValueError(f"the fake CUDA has no card {card!r}; it has {', '.join(map(repr, CARDS))}")
        return CARDS[card]
    for known in CARDS.values():
        if known.capability == tuple(card):
            return known._replace(name=NAME)
    raise ValueError(f"the fake CUDA has no card of compute capability {card!r}; it has "
                     f"{', '.join(str(known.capability) for known in CARDS.values())}")


def install(setattr, card=(8, 0)):
    """Fake a machine with GPUS CUDA devices, each this card: its name in CARDS, or a compute capability (the
    table's card of it, named NAME). setattr(obj, name, value) does the patching (the fixture's monkeypatch, undone
    after the test). Returns the current device as a one-item list."""
    import torch._dynamo  # before the fake: on import it binds CUDA's C functions wherever torch looks built with CUDA

    return fake(setattr, card)


def fake(setattr, card):
    """install() less its import of torch._dynamo, which must not happen under the fake."""
    import torch

    if torch.backends.cuda.is_built():  # torch._C._has_cuda: real C functions under the fakes, a real runtime
        raise RuntimeError(f"the fake CUDA is for a CPU-only torch; this one ({torch.__version__}) is built with "
                           "CUDA: test on the GPU itself (bench/gpu_check.py)")
    card = card_of(card)
    current = [0]

    def set_device(index):  # what the C function gets: torch's Python has turned the argument into an index
        if not isinstance(index, int) or not 0 <= index < GPUS:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index!r}")
        current[0] = index

    def get_device_properties(device=None):
        # torch.cuda.get_device_properties less its first line, _lazy_init(): the same index resolution (torch's
        # own, through the current device for None or plain "cuda") and the same check against device_count(), so a
        # wrong argument raises torch's error
        index = torch.cuda._utils._get_device_index(device, optional=True)
        if index < 0 or index >= torch.cuda.device_count():
            raise AssertionError("Invalid device id")
        return Properties(card.name, *card.capability)

    setattr(torch._C, "_cuda_getDeviceCount", lambda: GPUS)  # torch.cuda.is_available, device_count; "compiled"
    setattr(torch._C, "_cuda_setDevice", set_device)
    setattr(torch._C, "_cuda_getDevice", lambda: current[0])
    setattr(torch._C, "_get_accelerator", lambda check=None: torch.device("cuda"))  # the build's accelerator
    setattr(torch._C, "_accelerator_getAccelerator", lambda: torch.device("cuda"))
    # At torch.cuda's level (see the docstring): torch's versions call _lazy_init first, which fails on this build
    setattr(torch.cuda, "get_device_properties", get_device_properties)
    setattr(torch.cuda, "current_device", lambda: torch._C._cuda_getDevice())  # torch's, less _lazy_init()
    # torch's makes a bfloat16 tensor on the device, which needs the runtime; it is lru_cached, and the fake
    # stands in front of that cache rather than filling it
    setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: card.bf16_tensors)
    return current


def card_from_env(value):
    """FAKE_CUDA's card: a compute capability ("7.5") or a card's name ("Tesla T4")."""
    return tuple(map(int, value.split("."))) if re.fullmatch(r"\d+\.\d+", value) else value


MISSING = object()


class FakeOnImport(importlib.abc.MetaPathFinder):
    """A subprocess's fake (FAKE_CUDA set): put in once torch has been imported, not at start-up, so that a process
    that never imports torch (gpu_check's data row runs a prepare script) pays nothing for it; and lifted while
    torch._dynamo is imported (see install()), rather than importing it first: ~2 s in every process under the fake
    that compiles nothing (torchrun and its workers, gpu_check's commands)."""

    def __init__(self, card):
        self.card, self.faked = card, []  # (obj, name, value before the fake or MISSING, the fake)

    def find_spec(self, name, path, target=None):
        if name not in ("torch", "torch._dynamo"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)  # Python's own finder for both
        if spec is None:  # not installed: Python's own error
            return None
        exec_module = spec.loader.exec_module

        def exec_module_under_the_fake(module):
            self.lift()  # torch._dynamo's import (nothing to lift yet for torch's)
            exec_module(module)
            self.put_back()
            if name == "torch":
                fake(self.record, self.card)

        spec.loader.exec_module = exec_module_under_the_fake  # this spec's own loader: no other import sees it
        return spec

    def record(self, obj, name, value):
        self.faked.append((obj, name, getattr(obj, name, MISSING), value))
        setattr(obj, name, value)

    def lift(self):
        for obj, name, before, _ in self.faked:
            setattr(obj, name, before) if before is not MISSING else delattr(obj, name)

    def put_back(self):
        for obj, name, _, value in self.faked:
            setattr(obj, name, value)


if os.environ.get("FAKE_CUDA"):
    sys.meta_path.insert(0, FakeOnImport(card_from_env(os.environ["FAKE_CUDA"])))
