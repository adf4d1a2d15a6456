"""Tests for attention.py: the captured weights are the model's own attention (times v they give the output
the model computes), rows sum to 1, the masked part is exactly 0, capturing changes nothing; the statistics
by hand; the picture's panels; one-line errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

import attention
import model as model_py
from gpt import UserError
from gpt.checkpoint import save_checkpoint
from gpt.tokenizer import char_meta
from model import GPT, GPTConfig, can_attend

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "ROMEO: But soft, what light through yonder window breaks?\n"
CONFIGS = {
    "mha": dict(n_head=4, n_kv_head=4),
    "gqa": dict(n_head=4, n_kv_head=2),
    "mqa": dict(n_head=4, n_kv_head=1, qk_norm=False),
    "window": dict(n_head=4, n_kv_head=2, window=5),
}


def tiny_model(**overrides):
    torch.manual_seed(0)
    config = dict(vocab_size=64, block_size=32, n_layer=2, n_embd=32, **overrides)
    return GPT(GPTConfig(**config)).eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_weights_times_v_are_the_models_attention_output(name, device):
    model = tiny_model(**CONFIGS[name]).to(device)
    idx = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1)).to(device)
    values, outputs = [], []  # per layer: v_proj's output and o_proj's input (the attention output), as computed
    hooks = [layer.self_attn.v_proj.register_forward_hook(lambda m, a, out: values.append(out)) for layer in model.layers]
    hooks += [layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: outputs.append(a[0])) for layer in model.layers]
    with torch.no_grad():
        plain = model(idx)[0]  # the model's own pass: its v and attention outputs
        for hook in hooks:
            hook.remove()
        logits, weights = attention.attention_weights(model, idx)
    assert torch.equal(logits, plain)  # capturing changes nothing
    config, (B, T) = model.config, idx.shape
    positions = torch.arange(T, device=device)
    visible = can_attend(positions[:, None], positions[None, :], config)
    for w, v, y in zip(weights, values, outputs, strict=True):
        assert w.shape == (B, config.n_head, T, T)
        assert torch.allclose(w.sum(-1), torch.ones(B, config.n_head, T, device=device), atol=1e-6)
        assert torch.all(w[..., ~visible] == 0) and torch.all(w[..., visible] > 0)
        v = v.view(B, T, config.n_kv_head, config.head_dim).transpose(1, 2)  # (B, n_kv, T, hd)
        v = v.repeat_interleave(config.n_head // config.n_kv_head, dim=1)  # query head h reads kv head h // group
        mixed = (w @ v).transpose(1, 2).reshape(B, T, -1)
        assert torch.allclose(mixed, y, atol=1e-5), (mixed - y).abs().max()


def test_an_edited_rule_shows_in_the_map(monkeypatch):
    """model.py's rule edited (here: no query sees the token just before it): the map follows it, with no error. The
    model is windowed so that its attention builds the mask from the rule (a whole causal sequence with no window
    takes SDPA's is_causal shortcut, which does not read it: there the model and the edited rule disagree, and
    attention.py refuses, as the next test shows for an edit to the scores)."""
    rule = model_py.can_attend
    monkeypatch.setattr(model_py, "can_attend", lambda q, k, config: rule(q, k, config) & (k != q - 1))
    model = tiny_model(n_head=4, n_kv_head=2, window=8)
    idx = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    _, weights = attention.attention_weights(model, idx)
    for w in weights:
        assert torch.all(w.diagonal(offset=-1, dim1=-2, dim2=-1) == 0) and torch.all(w.diagonal(dim1=-2, dim2=-1) > 0)


def test_an_edit_to_the_scores_the_map_does_not_follow_is_refused(monkeypatch):
    """A bias added inside model.py's attention (here: every score doubled, as sharper attention would) changes what
    the model attends with but not q, k or the rule: the picture would be wrong, so attention.py refuses by layer."""
    attend = model_py.attention
    monkeypatch.setattr(model_py, "attention", lambda q, k, v, *args, **kwargs: attend(2 * q, k, v, *args, **kwargs))
    idx = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    with pytest.raises(UserError, match=r"^layer 0: the model's attention output differs by .* from the weights"):
        attention.attention_weights(tiny_model(n_head=4, n_kv_head=2), idx)


def test_head_statistics_by_hand():
    T = 4
    previous = torch.zeros(T, T)
    previous[0, 0] = 1
    previous[torch.arange(1, T), torch.arange(T - 1)] = 1  # each token reads the one before it
    stats = attention.head_stats(previous)
    assert stats == pytest.approx(dict(entropy=0.0, previous=1.0, first=0.5, same=0.25))
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]  # row t spreads over t + 1 tokens
    stats = attention.head_stats(uniform)
    assert stats["entropy"] == pytest.approx(sum(torch.log(torch.arange(1, T + 1.0))).item() / T)
    assert stats["first"] == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)


def test_picture_has_a_panel_per_chosen_layer_and_head(tmp_path):
    pytest.importorskip("matplotlib")
    model = tiny_model(**CONFIGS["gqa"])
    _, weights = attention.attention_weights(model, torch.arange(10)[None])
    fig = attention.draw(weights, [1], [0, 1, 3], 2, [str(i) for i in range(10)], str(tmp_path / "a.png"))
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["layer 1, head 0 (kv 0)", "layer 1, head 1 (kv 0)", "layer 1, head 3 (kv 1)"]
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """A folder holding a ckpt.pt of a tiny character model of TEXT's characters (what train.py writes)."""
    folder = tmp_path_factory.mktemp("run")
    meta = char_meta(TEXT)
    model = tiny_model(**CONFIGS["gqa"])
    save_checkpoint(str(folder / "ckpt.pt"), dict(model=model.state_dict(), model_config=vars(model.config), meta=meta))
    return folder


def test_command_writes_the_picture_and_the_statistics(checkpoint_dir, tmp_path, capsys, device):
    pytest.importorskip("matplotlib")
    out, stats = tmp_path / "maps.png", tmp_path / "stats.json"
    attention.main([f"--out_dir={checkpoint_dir}", f"--prompt={TEXT[:12]}", "--layers=1", "--heads=2,3",
                    f"--out={out}", f"--json={stats}", f"--device={device}"])
    assert out.read_bytes()[:4] == b"\x89PNG"
    record = json.loads(stats.read_text())
    assert list(record["heads"]) == ["layer 1 head 2", "layer 1 head 3"] and len(record["tokens"]) == 12
    for head in record["heads"].values():
        assert all(sum(row) == pytest.approx(1) for row in head["weights"])
    assert "layer 1 head 3" in capsys.readouterr().out


@pytest.mark.parametrize("args, needle", [
    (["--layers=2"], "--layers '2': the model has 2 layers"),
    (["--heads=0,4"], "--heads '0,4': the model has 4 heads"),
    (["--prompt="], "the prompt is empty"),
    ([f"--prompt={TEXT * 2}"], "reads at most block_size=32"),
])
def test_bad_input_is_a_one_line_error(checkpoint_dir, tmp_path, args, needle):
    with pytest.raises(UserError) as error:
        attention.main([f"--out_dir={checkpoint_dir}", f"--out={tmp_path / 'x.png'}", *args])
    assert needle in str(error.value) and "\n" not in str(error.value)
    assert not os.path.exists(tmp_path / "x.png")


def test_missing_checkpoint_exits_with_one_line(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "attention.py"), f"--out_dir={tmp_path}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "no checkpoint at" in result.stderr
