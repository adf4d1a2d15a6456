"""Tests for plot.py: the PNG is real and shows the losses written to metrics.jsonl; bad input is one line."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib", reason="plot.py draws with matplotlib")
import plot  # noqa: E402 (imports matplotlib.pyplot, which loads matplotlib.colors and matplotlib.image)
from gpt import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"  # from the PNG specification, not from our code


def write_run(out_dir, n_evals=4, scale=1.0):
    """A metrics.jsonl as train.py writes it: a training record every 10 iterations, an evaluation every 50.
    Returns the evaluation records."""
    os.makedirs(out_dir, exist_ok=True)
    records, evals = [], []
    for it in range(0, 50 * (n_evals - 1) + 1, 10):
        loss = scale * (1.5 + 3.0 / (1 + it / 20))
        if it > 0:
            records.append(dict(iter=it, time=0.1 * it + 0.5, loss=loss, lr=1e-3, grad_norm=0.5, ms_per_iter=90.0,
                                tokens_per_sec=8500.0))
        if it % 50 == 0:
            evals.append(dict(iter=it, time=0.1 * it + 0.7, train_loss=loss - 0.01, val_loss=loss + 0.05))
            records.append(evals[-1])
    with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return evals


def run_plot(*args):
    return subprocess.run([sys.executable, "plot.py", *args], cwd=ROOT, capture_output=True, text=True)


def test_two_runs_make_a_png_showing_both(tmp_path, capsys):
    write_run(tmp_path / "run-a")
    write_run(tmp_path / "run-b", scale=1.2)
    out = tmp_path / "losses.png"
    plot.main([str(tmp_path / "run-a"), str(tmp_path / "run-b"), "--out", str(out)])
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    assert set(os.listdir(tmp_path)) == {"run-a", "run-b", "losses.png"}  # no temp file left behind
    image = matplotlib.image.imread(out)
    assert image.shape == (450, 1200, 4)  # figsize (12, 4.5) at 100 dpi
    rgb = image[..., :3].reshape(-1, 3)
    for color in ("#1f77b4", "#ff7f0e"):  # the default cycle's first two colours: one per run
        target = np.array(matplotlib.colors.to_rgb(color))
        assert (np.abs(rgb - target).max(axis=1) < 0.02).sum() > 100, f"no run drawn in {color}"


def test_figure_holds_the_losses_written(tmp_path):
    evals_a = write_run(tmp_path / "run-a")
    evals_b = write_run(tmp_path / "run-b", n_evals=3, scale=1.2)
    fig = plot.main([str(tmp_path / "run-a"), str(tmp_path / "run-b"), "--out", str(tmp_path / "x.png")])
    by_iter, by_time = fig.axes
    for name, evals in (("run-a", evals_a), ("run-b", evals_b)):
        label = f"{os.path.normpath(tmp_path / name)} val"
        iter_line = next(line for line in by_iter.lines if line.get_label() == label)
        time_line = next(line for line in by_time.lines if line.get_label() == label)
        assert list(iter_line.get_xdata()) == [r["iter"] for r in evals]
        assert list(time_line.get_xdata()) == [r["time"] for r in evals]
        assert list(iter_line.get_ydata()) == list(time_line.get_ydata()) == [r["val_loss"] for r in evals]
        train_line = next(line for line in by_iter.lines if line.get_label() == label.replace(" val", " train"))
        assert list(train_line.get_xdata()) == list(range(10, 50 * (len(evals) - 1) + 1, 10))  # no eval points in it


def test_line_being_written_by_a_running_run_is_skipped(tmp_path):
    evals = write_run(tmp_path / "run")
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"iter": 160, "time": 16.7, "train_lo')  # no newline: train.py is mid-write
    fig = plot.main([str(tmp_path / "run"), "--out", str(tmp_path / "x.png")])
    val_line = next(line for line in fig.axes[0].lines if line.get_label().endswith(" val"))
    assert list(val_line.get_ydata()) == [r["val_loss"] for r in evals]


def corrupt_line_3(path):
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2] + ['{"iter": 30, "time": 3.5, "loss": \n'] + lines[3:]))


def not_a_record_on_line_3(path):
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2] + ['{"iter": 30, "time": 3.5}\n'] + lines[3:]))


@pytest.mark.parametrize("damage, expected", [
    (lambda path: path.unlink(), "metrics.jsonl; train a run there first"),
    (lambda path: path.write_text("\n\n"), "metrics.jsonl has no records"),
    (corrupt_line_3, "metrics.jsonl, line 3: not valid JSON"),
    (not_a_record_on_line_3, "metrics.jsonl, line 3: not a metrics record"),
])
def test_bad_metrics_are_a_one_line_error(tmp_path, damage, expected):
    write_run(tmp_path / "good")
    write_run(tmp_path / "bad")
    damage(tmp_path / "bad" / "metrics.jsonl")
    with pytest.raises(UserError) as error:  # main() of `python plot.py` prints it as "error: <message>"
        plot.main([str(tmp_path / "good"), str(tmp_path / "bad"), "--out", str(tmp_path / "x.png")])
    message = str(error.value)
    assert "\n" not in message
    assert str(tmp_path / "bad" / "metrics.jsonl") in message and expected in message
    assert not (tmp_path / "x.png").exists()


def test_errors_end_the_script_with_one_line(tmp_path):
    write_run(tmp_path / "run")
    result = run_plot(str(tmp_path / "run"), "--out", str(tmp_path / "no-such-dir" / "x.png"))
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [f"error: could not write {tmp_path / 'no-such-dir' / 'x.png'} "
                                                  "(No such file or directory)"]
    assert result.stdout == ""


def test_the_image_is_of_the_type_its_name_says_and_an_unknown_type_is_refused(tmp_path):
    """It was a PNG whatever the name said (a .jpg, a .pdf)."""
    write_run(tmp_path / "run")
    plot.main([str(tmp_path / "run"), "--out", str(tmp_path / "x.pdf")])
    plot.main([str(tmp_path / "run"), "--out", str(tmp_path / "x.SVG")])
    assert (tmp_path / "x.pdf").read_bytes().startswith(b"%PDF") and b"<svg" in (tmp_path / "x.SVG").read_bytes()
    for name in ("x.txt", "x"):
        with pytest.raises(UserError, match=rf"^--out {re.escape(str(tmp_path / name))}: name the image after one of "
                                            r"the types matplotlib writes, e.g. losses.png \(.*png.*\)$"):
            plot.main([str(tmp_path / "run"), "--out", str(tmp_path / name)])
        assert not (tmp_path / name).exists()


def test_logy_gives_log_axes_with_plain_labels(tmp_path):
    write_run(tmp_path / "run")
    fig = plot.main([str(tmp_path / "run"), "--out", str(tmp_path / "x.png"), "--logy"])
    assert [ax.get_yscale() for ax in fig.axes] == ["log", "log"]
    assert fig.axes[1].yaxis.get_minor_formatter()(3.0, 0) == "3"  # not 3x10^0
    assert plot.main([str(tmp_path / "run"), "--out", str(tmp_path / "x.png")]).axes[0].get_yscale() == "linear"
