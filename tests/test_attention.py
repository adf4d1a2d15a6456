"""Tests for attention.py: the captured weights are the model's own attention (times v they give the output
the model computes), rows sum to 1, the masked part is exactly 0, capturing changes nothing; the statistics
by hand; the picture's panels; one-line errors."""

import inspect
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import attention
import model as model_py
from gpt import UserError
from gpt.tokenizer import char_meta
from model import GPT, GPTConfig, can_attend
from conftest import finished

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
ATTENTION = model_py.attention  # the original, before a test patches it

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "ROMEO: But soft, what light through yonder window breaks?\n"
CONFIGS = {
    "mha": dict(n_head=4, n_kv_head=4),
    "gqa": dict(n_head=4, n_kv_head=2),
    "mqa": dict(n_head=4, n_kv_head=1, qk_norm=False),
    "window": dict(n_head=4, n_kv_head=2, window=5),
}


@pytest.fixture(scope="module", autouse=True)
def missing_checkpoint_run(tmp_path_factory):
    """attention.py as a script on a folder without a checkpoint, started with the module: its seconds of importing
    torch pass on the core the in-process tests leave. Its test waits for it."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "attention.py"),
                             f"--out_dir={tmp_path_factory.mktemp('empty')}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


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
    for layer, (w, v, y) in enumerate(zip(weights, values, outputs, strict=True)):
        assert w.shape == (B, config.n_head, T, T)
        assert torch.allclose(w.sum(-1), torch.ones(B, config.n_head, T, device=device), atol=1e-6)
        visible = can_attend(positions[:, None], positions[None, :], config, layer, idx)  # (T, T) or (B, 1, T, T)
        visible = torch.broadcast_to(visible, w.shape)
        assert torch.all(w[~visible] == 0) and torch.all(w[visible] > 0)
        v = v.view(B, T, config.n_kv_head, config.head_dim).transpose(1, 2)  # (B, n_kv, T, hd)
        v = v.repeat_interleave(config.n_head // config.n_kv_head, dim=1)  # query head h reads kv head h // group
        mixed = (w @ v).transpose(1, 2).reshape(B, T, -1)
        assert torch.allclose(mixed, y, atol=1e-5), (mixed - y).abs().max()


def test_an_edited_rule_shows_in_the_map(monkeypatch):
    """model.py's rule edited (here: no query sees the token just before it): the map follows it. The model is
    windowed so that its attention builds the mask from the rule (a whole causal sequence with no window takes SDPA's
    is_causal shortcut, which does not read it: the map then shows that plain causal attention, what the model did)."""
    rule = model_py.can_attend
    monkeypatch.setattr(model_py, "can_attend", lambda q, k, *rest: rule(q, k, *rest) & (k != q - 1))
    model = tiny_model(n_head=4, n_kv_head=2, window=8)
    idx = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    _, weights = attention.attention_weights(model, idx)
    for w in weights:
        assert torch.all(w.diagonal(offset=-1, dim1=-2, dim2=-1) == 0) and torch.all(w.diagonal(dim1=-2, dim2=-1) > 0)


def alibi_attention(*args, **kwargs):
    """ALiBi in place of model.attention: each head's scores get -slope * (query - key), slopes 1/2, 1/4, ..., added
    through SDPA's float mask (-inf after the query). Its arguments are found by name in model.attention's own
    signature, so an edit of that signature needs no edit here."""
    given = inspect.signature(ATTENTION).bind(*args, **kwargs).arguments
    q, k, v, positions = given["q"], given["k"], given["v"], given["positions"]
    n_head, group = q.size(1), q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    distance = (positions.ids[:, None] - torch.arange(k.size(2))).float()  # (T, S)
    slopes = 2.0 ** -torch.arange(1, n_head + 1.0)
    bias = (-slopes[:, None, None] * distance).masked_fill(distance < 0, float("-inf"))  # (nh, T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def doubled_scores(q, k, v, *args, **kwargs):  # sharper attention: every score doubled
    return ATTENTION(2 * q, k, v, *args, **kwargs)


@pytest.mark.parametrize("edit", ["alibi", "doubled_scores"])
def test_an_edit_to_the_scores_shows_in_the_map(edit, monkeypatch):
    """A bias or a scale inside model.py's attention changes neither q, k nor the rule; the map still shows what the
    model attends with: here it equals softmax(q k^T / sqrt(hd) + the edit), computed by hand from q and k."""
    model, (B, T) = tiny_model(n_head=4, n_kv_head=2), (1, 12)
    idx = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))
    inputs = []  # each layer's (x, positions), to compute q and k by hand
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, args: inputs.append(args)) for layer in model.layers]
    monkeypatch.setattr(model_py, "attention", alibi_attention if edit == "alibi" else doubled_scores)
    _, weights = attention.attention_weights(model, idx)
    for hook in hooks:
        hook.remove()
    distance = (torch.arange(T)[:, None] - torch.arange(T)).float()
    for layer, w in zip(model.layers, weights, strict=True):
        x, positions = inputs.pop(0)[:2]  # (x, positions, kv_cache)
        q, k = layer.self_attn.queries_and_keys(x, positions)
        scores = q @ k.repeat_interleave(2, dim=1).transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, nh, T, T)
        if edit == "alibi":
            scores = scores - 2.0 ** -torch.arange(1, 5.0)[:, None, None] * distance
        else:
            scores = 2 * scores
        expected = scores.masked_fill(distance < 0, float("-inf")).softmax(dim=-1)
        assert torch.allclose(w, expected, atol=1e-5), (w - expected).abs().max()


def test_an_attention_without_sdpa_is_refused(monkeypatch):
    """An attention written out by hand (no SDPA call to read the weights from) is refused, not drawn as something."""
    def by_hand(q, k, v, *args, **kwargs):
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        return scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf")).softmax(-1) @ v

    monkeypatch.setattr(model_py, "attention", by_hand)
    idx = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    with pytest.raises(UserError, match=r"called F.scaled_dot_product_attention 0 times, not once in each of its 2"):
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
    torch.save(dict(model=model.state_dict(), model_config=vars(model.config), meta=meta), folder / "ckpt.pt")
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
    (["--json=/nonexistent/stats.json"], "--json /nonexistent/stats.json: there is no folder /nonexistent to write"),
])
def test_bad_input_is_a_one_line_error(checkpoint_dir, tmp_path, args, needle):
    with pytest.raises(UserError) as error:
        attention.main([f"--out_dir={checkpoint_dir}", f"--out={tmp_path / 'x.png'}", *args])
    assert needle in str(error.value) and "\n" not in str(error.value)
    assert not os.path.exists(tmp_path / "x.png")


def test_missing_checkpoint_exits_with_one_line(missing_checkpoint_run):
    result = finished(missing_checkpoint_run)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "no checkpoint at" in result.stderr
