"""Tests for experiments/: each script's claim on tiny random models (position.py: attention with neither RoPE
nor the causal mask is permutation-equivariant, with either it is not; scaling.py: unscaled scores grow like
sqrt(head_dim) and saturate the softmax, scaled ones stay ~1), the measuring functions checked against the
model's own attention, the patches undone, and both commands run end to end on a tiny checkpoint."""

import inspect
import math
import re

import pytest
import torch

import attention
import model as model_py
from experiments import position, scaling
from gpt.tokenizer import char_meta
from model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

ROPE, ATTENTION = model_py.rope, model_py.attention  # the originals, taken before any test could patch them
TEXT = "ROMEO: But soft, what light through yonder window breaks?\n"
# QK-norm on (the default): scores ~1 already at init, so RoPE changes the outputs (without it they are ~0.01 and
# attention is nearly uniform whatever the positions)
CONFIGS = {"mha": dict(n_head=4, n_kv_head=4), "gqa": dict(n_head=4, n_kv_head=2)}


def tiny_model(**overrides):
    torch.manual_seed(0)
    config = dict(vocab_size=64, block_size=32, n_layer=2, n_embd=32, **overrides)
    return GPT(GPTConfig(**config)).eval()


def tokens_and_perm(T=32):
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (2, T), generator=generator), torch.randperm(T, generator=generator)


# ----------------------------------------------------------------------------------------------------
# position.py


@pytest.mark.parametrize("name", CONFIGS)
def test_without_rope_and_mask_attention_is_permutation_equivariant(name):
    idx, perm = tokens_and_perm()
    error = position.equivariance_error(tiny_model(**CONFIGS[name]), idx, perm, rope=False, mask=False)
    assert error["hidden"] < 1e-5 and error["logits"] < 1e-5, error


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("rope, mask", [(True, True), (True, False), (False, True)])
def test_rope_or_the_mask_breaks_equivariance(name, rope, mask):
    idx, perm = tokens_and_perm()
    error = position.equivariance_error(tiny_model(**CONFIGS[name]), idx, perm, rope=rope, mask=mask)
    assert error["hidden"] > 1e-2, error


def test_the_stand_ins_are_no_rope_and_no_mask_and_are_undone():
    rope, attend = ROPE, ATTENTION
    assert model_py.rope is rope and model_py.attention is attend  # no earlier measurement left a patch behind
    q, k, v = torch.randn(3, 2, 4, 5, 8, generator=torch.Generator().manual_seed(0)).unbind(0)  # (B, nh, T, hd)
    with position.positions_and_mask(rope=False, mask=False):
        assert model_py.rope(q, None) is q
        unmasked = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1) @ v  # every key, none masked
        assert torch.allclose(model_py.attention(q, k, v, None, None, 0), unmasked, atol=1e-6)
    assert model_py.rope is rope and model_py.attention is attend
    with position.positions_and_mask(rope=True, mask=True):  # both on: the model exactly as it is
        assert model_py.rope is rope and model_py.attention is attend
    with pytest.raises(RuntimeError), position.positions_and_mask(rope=False, mask=False):
        raise RuntimeError  # an error inside still restores them
    assert model_py.rope is rope and model_py.attention is attend


def test_the_no_mask_stand_in_follows_an_edited_signature_of_attention(monkeypatch):
    """An edit that gives model.attention another parameter (here a bias, before dropout_p) needs no edit of
    position.py: its stand-in finds q, k, v and dropout_p by name in the signature, as the model passes them."""
    def edited(q, k, v, positions, module, bias=None, dropout_p=0.0):
        raise AssertionError("only its signature is read")

    monkeypatch.setattr(position, "ATTENTION_SIGNATURE", inspect.signature(edited))
    q, k, v = torch.randn(3, 2, 4, 5, 8, generator=torch.Generator().manual_seed(0)).unbind(0)
    unmasked = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1) @ v
    assert torch.allclose(position.unmasked_attention(q, k, v, None, None, None, 0.0), unmasked, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# scaling.py


def test_unscaled_scores_grow_like_sqrt_head_dim_and_scaled_ones_do_not():
    generator = torch.Generator().manual_seed(0)
    stats = {hd: scaling.measure(*scaling.random_queries_and_keys(8, 64, hd, generator)) for hd in (16, 64, 256)}
    for hd, m in stats.items():
        assert m["std_raw"] / math.sqrt(hd) == pytest.approx(1, abs=0.1), (hd, m)
        assert 0.5 < m["std_scaled"] < 2, (hd, m)
        assert m["entropy_raw"] < m["entropy_scaled"], (hd, m)
    assert stats[256]["std_raw"] / stats[16]["std_raw"] == pytest.approx(4, rel=0.1)  # sqrt(256 / 16)
    assert stats[16]["entropy_raw"] > stats[64]["entropy_raw"] > stats[256]["entropy_raw"]  # saturating


def test_causal_statistics_by_hand():
    T = 4
    future = torch.full((T, T), 1e4).triu(diagonal=1)  # large scores on keys no query may see
    assert scaling.causal_entropy(future) == pytest.approx(scaling.uniform_entropy(T))  # so still uniform rows
    assert scaling.uniform_entropy(T) == pytest.approx(sum(math.log(t) for t in range(1, T + 1)) / T)
    assert scaling.causal_std(future) == 0.0
    diagonal = torch.eye(T) * 1e4  # every row all on its own token
    assert scaling.causal_entropy(diagonal) == pytest.approx(0.0, abs=1e-6)
    visible = torch.tensor([[1.0, 0, 0], [2, 3, 0], [4, 5, 6]])
    hidden_above = visible + 100 * torch.ones(3, 3).triu(1)  # masked entries do not count
    assert scaling.causal_std(hidden_above) == pytest.approx(torch.arange(1.0, 7).std().item())


@pytest.mark.parametrize("name", CONFIGS)
def test_model_scores_are_the_ones_the_model_attends_with(name):
    model = tiny_model(**CONFIGS[name])
    idx, _ = tokens_and_perm(20)
    captured = scaling.model_queries_and_keys(model, idx)
    _, weights = attention.attention_weights(model, idx)  # (B, nh, T, T) per layer
    assert len(captured) == len(weights) == model.config.n_layer
    for (q, k), w in zip(captured, weights):
        assert q.shape == k.shape == (2, model.config.n_head, 20, model.config.head_dim)
        s = scaling.scores(q, k, scaled=True).masked_fill(~scaling.causal(20), float("-inf"))
        assert torch.allclose(s.softmax(-1), w, atol=1e-6)
        mean_entropy = sum(attention.head_stats(w[b, h])["entropy"] for b in range(2) for h in range(4)) / 8
        assert scaling.measure(q, k)["entropy_scaled"] == pytest.approx(mean_entropy, abs=1e-5)


# ----------------------------------------------------------------------------------------------------
# the commands


@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    """A ckpt.pt of a tiny character model of TEXT's characters, and a text whose val part (its last 10%)
    holds 2 windows of block_size 32 tokens."""
    folder = tmp_path_factory.mktemp("run")
    model = tiny_model(**CONFIGS["gqa"])
    torch.save(dict(model=model.state_dict(), model_config=vars(model.config), meta=char_meta(TEXT)),
               folder / "ckpt.pt")
    (folder / "input.txt").write_text(TEXT * 12)
    return folder


def table_rows(out, first_word):
    return [line.split() for line in out.splitlines() if line.split()[:1] == [first_word]]


def test_position_command_prints_the_table(run_files, capsys):
    position.main([f"--out_dir={run_files}", f"--text={run_files / 'input.txt'}", "--batch_size=2"])
    out = capsys.readouterr().out
    assert re.search(r"^cpu: .+, torch \d", out, re.M)
    rows = table_rows(out, "trained") + table_rows(out, "random")
    assert len(rows) == 8
    for row in rows:  # e.g. [trained, on, off, hidden, logits, scale] or [random, init, ...]
        rope, mask, hidden = row[-5], row[-4], float(row[-3])
        assert (hidden < 1e-5) == (rope == mask == "off"), row


def test_scaling_command_prints_both_tables(run_files, capsys):
    scaling.main([f"--out_dir={run_files}", f"--text={run_files / 'input.txt'}", "--batch_size=2", "--n=2", "--T=16"])
    out = capsys.readouterr().out
    assert re.search(r"^cpu: .+, torch \d", out, re.M)
    random_rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d+( \(model\))? +\d+\.\d\d ", line)]
    assert [row[0] for row in random_rows] == ["8", "16", "64", "256"]  # the tiny model's head_dim is 8
    layer_rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d+ +\d+\.\d{3} ", line)]
    assert [row[0] for row in layer_rows] == ["0", "1"]


@pytest.mark.parametrize("script", [position, scaling])
def test_missing_checkpoint_is_a_one_line_error(script, tmp_path):
    with pytest.raises(SystemExit) as exit:
        script.main([f"--out_dir={tmp_path}"])
    message = str(exit.value.code)
    assert message.startswith("error: no checkpoint at") and "\n" not in message


@pytest.mark.parametrize("script, arg, message", [(position, "--batch_size=0", "--batch_size must be at least 1"),
                                                  (scaling, "--n=0", "--batch_size, --n and --T must be at least 1")])
def test_a_count_below_one_is_refused_before_any_work(script, arg, message, tmp_path, capsys):
    """Before: an empty batch's RuntimeError (position.py), a table of nan with exit 0 (scaling.py)."""
    with pytest.raises(SystemExit) as exit:
        script.main([f"--out_dir={tmp_path}", arg])  # no checkpoint there: the count is checked first
    assert exit.value.code == 2 and capsys.readouterr().err.strip().endswith(f"error: {message}")
