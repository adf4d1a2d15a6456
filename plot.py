"""
Draw the loss curves of one or more training runs into a PNG, to compare runs at a glance:

    python plot.py out-small                          # writes losses.png
    python plot.py out-a out-b --out compare.png --logy

Reads each out_dir's metrics.jsonl (written by train.py). Left panel: loss vs iteration; right panel: loss vs
wall-clock seconds (evaluation included, summed over resumes). One colour per run: the training loss as a
thin line, the val loss as markers on a line. Works on a run still in progress.
"""

import argparse
import os
import sys

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # draws into files only: no display needed (ssh, CI)
import matplotlib.pyplot as plt
from matplotlib.backend_bases import FigureCanvasBase

from gpt import UserError
from gpt.files import atomic_open, failing_write
from gpt.metrics import read_jsonl


def read_metrics(out_dir):
    """(train, val): the run's training records and evaluation records, in file order."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise UserError(f"no {path}; train a run there first, e.g. python train.py config/small.py --out_dir={out_dir}")
    try:
        records, _ = read_jsonl(path)  # a last line being written right now (a running run) is left out
    except ValueError as e:
        raise UserError(str(e)) from None
    train, val = [], []
    for lineno, record in records:
        if not is_record(record):
            raise UserError(f"{path}, line {lineno}: not a metrics record (needs iter, time and loss or val_loss)")
        (val if "val_loss" in record else train).append(record)
    if not train and not val:
        raise UserError(f"{path} has no records; let the run get to its first log or evaluation")
    return train, val


def is_record(record):
    """A training record (iter, time, loss, ...) or an evaluation record (iter, time, train_loss, val_loss)."""
    if not isinstance(record, dict):
        return False
    keys = ("iter", "time", "val_loss" if "val_loss" in record else "loss")
    return all(isinstance(record.get(key), (int, float)) and not isinstance(record[key], bool) for key in keys)


def draw(runs, logy=False):
    """The figure for runs, a dict {label: (train, val)}: loss vs iteration and vs wall-clock seconds."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    for i, (label, (train, val)) in enumerate(runs.items()):
        color = f"C{i % 10}"  # the default colour cycle
        for ax, x in zip(axes, ("iter", "time")):
            ax.plot([r[x] for r in train], [r["loss"] for r in train], color=color, lw=0.8, alpha=0.6,
                    label=f"{label} train")
            ax.plot([r[x] for r in val], [r["val_loss"] for r in val], color=color, lw=1.5, marker="o", ms=4,
                    label=f"{label} val")
    return finish(fig, axes, ("iteration", "wall-clock seconds"), logy)


def finish(fig, axes, xlabels, logy):
    """Axis labels, the log scale if asked, a grid and the legend."""
    for ax, xlabel in zip(axes, xlabels):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss")
        if logy:
            ax.set_yscale("log")
            for set_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                set_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))  # 3, not 3x10^0
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    return fig


def draw_groups(groups, logy=False):
    """The figure for groups of runs, {label: [(train, val), ...]} with one pair per seed (compare.py): each
    group's mean over its seeds, the training loss thin, the val loss with markers, and a band from its lowest
    to its highest seed's val loss. Points are the iterations every seed logged; seconds are their mean."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    for i, (label, runs) in enumerate(groups.items()):
        color = f"C{i % 10}"
        for key, records, style in (("loss", [t for t, _ in runs], dict(lw=0.8, alpha=0.6)),
                                    ("val_loss", [v for _, v in runs], dict(lw=1.5, marker="o", ms=4))):
            iters, times, losses = across_seeds(records, key)
            name = f"{label} {'val' if key == 'val_loss' else 'train'} (mean of {len(runs)})"
            for ax, x in zip(axes, (iters, times)):
                ax.plot(x, [sum(l) / len(l) for l in losses], color=color, label=name, **style)
                if key == "val_loss" and len(runs) > 1:
                    ax.fill_between(x, [min(l) for l in losses], [max(l) for l in losses], color=color, alpha=0.2)
    return finish(fig, axes, ("iteration", "wall-clock seconds (mean over seeds)"), logy)


def across_seeds(runs, key):
    """(iterations, mean seconds, losses per iteration): the records of several runs at the iterations they
    all logged, for a mean and a spread."""
    by_iter = [{r["iter"]: r for r in records} for records in runs]
    shared = sorted(set.intersection(*(set(b) for b in by_iter)))
    times = [sum(b[it]["time"] for b in by_iter) / len(by_iter) for it in shared]
    return shared, times, [[b[it][key] for b in by_iter] for it in shared]


def save(fig, path):
    """Write the image atomically (a viewer never sees a half-written one), in the type its name says."""
    try:
        with failing_write(path), atomic_open(path) as f:
            fig.savefig(f, format=os.path.splitext(path)[1][1:].lower())  # a file object: savefig cannot see the name
    finally:
        plt.close(fig)


def main(argv):
    """Draws and saves the figure, and returns it (closed, but its lines still hold the plotted data)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dirs", nargs="+", help="run folders holding a metrics.jsonl")
    parser.add_argument("--out", default="losses.png", help="the image to write, .png, .svg, .pdf, ... (default: "
                        "losses.png)")
    parser.add_argument("--logy", action="store_true", help="log-scale loss axis")
    args = parser.parse_args(argv)
    types = FigureCanvasBase.get_supported_filetypes()
    if os.path.splitext(args.out)[1][1:].lower() not in types:  # before: a PNG under any name
        raise UserError(f"--out {args.out}: name the image after one of the types matplotlib writes, e.g. losses.png "
                        f"({', '.join(sorted(types))})")
    runs = {os.path.normpath(d): read_metrics(d) for d in args.out_dirs}  # labels as typed: a/out and b/out differ
    fig = draw(runs, args.logy)
    save(fig, args.out)
    print(args.out)
    return fig


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # Ctrl-C: no traceback, and the shell's status for it
        sys.exit(130)
