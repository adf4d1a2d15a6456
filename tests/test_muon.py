"""Tests for gpt/muon.py: torch.optim.Muon's step with its orthogonalization in float32 on a CPU, and how that
dtype is chosen and kept."""

import copy

import pytest
import torch

from gpt import muon

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

SETTINGS = dict(lr=0.05, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")


def three_matrices():
    """Square, tall and wide weights: Newton-Schulz iterates on the wide side, transposing a tall matrix."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 12, bias=False), torch.nn.Linear(12, 20, bias=False),
                               torch.nn.Linear(20, 7, bias=False))


def train_steps(model, optimizer, steps=3):
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def with_dtype(monkeypatch, name):
    monkeypatch.setattr(muon, "orthogonalize_dtype", lambda device: name)


def test_in_bfloat16_it_steps_exactly_as_torchs_muon(monkeypatch):
    """The same momentum, weight decay, learning-rate scaling and bfloat16 Newton-Schulz: equal weights, bit for bit,
    after 3 steps (what the bfloat16 choice promises: today's numbers wherever bfloat16 is not much slower)."""
    with_dtype(monkeypatch, "bfloat16")
    ours, torchs = three_matrices(), three_matrices()
    got = train_steps(ours, muon.Muon(ours.parameters(), **SETTINGS))
    expected = train_steps(torchs, torch.optim.Muon(torchs.parameters(), **SETTINGS))
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_in_float32_it_orthogonalizes_as_torchs_bfloat16_does():
    """Newton-Schulz in float32 on a tall, a wide and a square matrix: float32 out, within bfloat16's rounding of
    torch's own (bfloat16) result, and its singular values in the band Muon's coefficients aim at (0.5 to 1.5,
    torch's docstring says)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    coefficients, generator = (3.4445, -4.7750, 2.0315), torch.Generator().manual_seed(2)
    for shape in ((30, 10), (10, 30), (16, 16)):
        update = torch.randn(shape, generator=generator)
        got = muon.orthogonalize(update, coefficients, 5, 1e-7, torch.float32)
        expected = _zeropower_via_newtonschulz(update, coefficients, 5, 1e-7)
        assert got.dtype == torch.float32 and got.shape == shape
        torch.testing.assert_close(got, expected.float(), atol=0.03, rtol=0)
        singular_values = torch.linalg.svdvals(got)
        assert singular_values.min() > 0.5 and singular_values.max() < 1.5, singular_values


@pytest.mark.parametrize("device, chosen", [("cpu", "float32"), ("cuda", "bfloat16"), ("cuda:1", "bfloat16"),
                                            ("mps", "bfloat16")])
def test_a_cpu_orthogonalizes_in_float32_and_an_accelerator_in_torchs_bfloat16(device, chosen):
    assert muon.orthogonalize_dtype(device) == chosen


def test_a_cpu_run_steps_in_float32_without_timing_anything(monkeypatch):
    """The dtype comes from the parameters' device alone: nothing is orthogonalized to time it (a timing flipped with
    machine load, so one command made two runs), only the step's three matrices, in float32."""
    calls = []
    monkeypatch.setattr(muon, "orthogonalize", lambda *args, f=muon.orthogonalize: calls.append(args[-1]) or f(*args))
    model = three_matrices()
    optimizer = muon.Muon(model.parameters(), **SETTINGS)
    assert optimizer.param_groups[0]["ns_dtype"] == "float32"
    train_steps(model, optimizer, steps=1)
    assert calls == [torch.float32] * 3


def test_the_choice_is_saved_and_a_checkpoint_from_before_it_resumes_in_bfloat16(monkeypatch):
    """A resumed run keeps the dtype of the run it continues, not a new timing; torch.optim.Muon's state (no dtype
    in it: what checkpoints of 2026-11-24 to 26 hold) resumes in torch's bfloat16, stepping exactly as torch's."""
    with_dtype(monkeypatch, "float32")
    model = three_matrices()
    saved = muon.Muon(model.parameters(), **SETTINGS)
    assert saved.state_dict()["param_groups"][0]["ns_dtype"] == "float32"
    with_dtype(monkeypatch, "bfloat16")
    resumed = muon.Muon(model.parameters(), **SETTINGS)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.param_groups[0]["ns_dtype"] == "float32"

    ours, torchs = three_matrices(), three_matrices()
    before = torch.optim.Muon(torchs.parameters(), **SETTINGS)
    train_steps(torchs, before, steps=1)
    old = muon.Muon(ours.parameters(), **SETTINGS)
    ours.load_state_dict(torchs.state_dict())
    old.load_state_dict(copy.deepcopy(before.state_dict()))
    assert "ns_dtype" not in old.param_groups[0]
    for g, e in zip(train_steps(ours, old, steps=2), train_steps(torchs, before, steps=2)):
        assert torch.equal(g, e)


def six_matrices(device="cpu"):
    """Two square, two tall and two wide weights of three shapes: stacked by shape when batched."""
    torch.manual_seed(0)
    sizes = (12, 12, 12, 20, 12, 20, 7)
    return torch.nn.Sequential(*(torch.nn.Linear(i, o, bias=False) for i, o in zip(sizes, sizes[1:]))).to(device)


@pytest.mark.parametrize("dtype, atol", [("bfloat16", 0), ("float32", 1e-5)])
def test_matrices_batched_by_shape_step_as_each_in_turn(monkeypatch, dtype, atol):
    """CUDA's way (orthogonalized_by_shape: a stack per shape) gives the weights of the CPU's (a matrix at a time)
    after 3 steps, in the order the parameters come: bit for bit in bfloat16, CUDA's dtype (float32's batched
    products may round differently)."""
    with_dtype(monkeypatch, dtype)
    in_turn, batched = six_matrices(), six_matrices()
    expected = train_steps(in_turn, muon.Muon(in_turn.parameters(), **SETTINGS))
    monkeypatch.setattr(muon.Muon, "orthogonalized",
                        lambda self, updates, group: muon.orthogonalized_by_shape(list(updates), group))
    got = train_steps(batched, muon.Muon(batched.parameters(), **SETTINGS))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=atol, rtol=0)


def test_cuda_batches_the_matrices_of_a_shape_and_a_cpu_takes_them_in_turn(device, monkeypatch):
    """On TEST_DEVICE: one batched call for the six matrices on CUDA (measured faster there), none on a CPU."""
    batches = []
    monkeypatch.setattr(muon, "orthogonalized_by_shape",
                        lambda updates, group, f=muon.orthogonalized_by_shape: batches.append(len(updates)) or
                        f(updates, group))
    model = six_matrices(device)
    x = torch.randn(5, 12, device=device)
    model(x).square().sum().backward()
    muon.Muon(model.parameters(), **SETTINGS).step()
    assert batches == ([6] if torch.device(device).type == "cuda" else [])
