"""
See inside attention: the attention weights softmax(q k^T / sqrt(head_dim)) under the causal mask, one matrix
per layer and head, for a prompt read by a trained model, drawn as a grid and summed up per head:

    python attention.py --prompt "ROMEO: But soft, what light"               # out-small -> attention.png
    python attention.py --out_dir=out-shakespeare-bpe --prompt FILE:prompt.txt --layers=0,3 --heads=0,1
    python attention.py --init_from=hf:hf-folder --prompt "Hello" --json=stats.json

Rows are queries, columns keys; the masked part (keys after the query, or outside a sliding window) is
blank. Per head it prints the mean entropy of the rows (in nats; low: the head looks at few tokens) and
the share of weight on the previous token, on the first token and on the token itself: "previous-token
heads" and "attention sinks" can be read off the table. Query heads that share a key/value head (GQA) sit
next to each other and are labelled with their kv head.

The weights are the model's own: while the forward pass runs, unchanged, each call it makes to
F.scaled_dot_product_attention is watched (a TorchFunctionMode), and the weights are computed once more from that
call's own arguments (q, k, the mask or is_causal, the scale), by SDPA's definition. An edit of model.py's
attention (another rule, a bias in the scores such as ALiBi's, another scale) therefore shows in the maps; each
layer's weights times v must equal what the call returned, or the command refuses rather than draw a wrong picture.
"""

import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from configurator import configure
from gpt import UserError
from gpt.checkpoint import load_model
from gpt.device import resolve_device
from gpt.files import atomic_open, failing_write, write_json
from gpt.tokenizer import Tokenizer
from sample import read_prompt

DEFAULTS = dict(
    out_dir="out-small",  # the folder holding ckpt.pt (or a path to a .pt file)
    init_from="resume",  # "resume": the checkpoint in out_dir; "hf:path": a Llama/Qwen3 folder (see export.py)
    prompt="ROMEO: But soft, what light through yonder window breaks?",  # text; FILE:path reads a file, - stdin
    layers="",  # comma-separated layer indices to draw (e.g. "0,3"); "": all
    heads="",  # comma-separated query-head indices to draw; "": all
    out="attention.png",  # the picture
    json="",  # also write each head's statistics (and its weights) to this JSON file
    device="auto",  # "auto" (cuda, then mps, then cpu), or e.g. "cpu"
)
MAX_LABELS = 48  # tokens as axis labels up to this many; past that they would not be readable


class SDPAWeights(TorchFunctionMode):
    """While active, keeps the weights softmax(q k^T * scale + mask) of every F.scaled_dot_product_attention call
    (the call itself runs as it would), and checks that they times v give what the call returned."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        output = func(*args, **kwargs)  # the mode is off inside this method: torch runs the call as usual
        if func is F.scaled_dot_product_attention:
            self.weights.append(sdpa_weights(output, *args, **kwargs))
        return output


def sdpa_weights(output, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The weights (..., L, S) of one F.scaled_dot_product_attention call, from its arguments, by its definition;
    UserError unless they times v are output (the call's own result)."""
    if enable_gqa:  # query head h reads kv head h // group
        group = q.size(-3) // k.size(-3)
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    L, S = q.size(-2), k.size(-2)
    scores = (q.float() @ k.float().transpose(-2, -1)) * (1 / math.sqrt(q.size(-1)) if scale is None else scale)
    if is_causal:
        attn_mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    weights = scores.softmax(dim=-1)
    difference = (weights @ v.float() - output.float()).abs().max().item()
    if dropout_p or difference > 1e-4 * max(1.0, output.abs().max().item()):
        raise UserError(f"an attention call's output differs by {difference:.2g} from its weights (computed from its "
                        "arguments) times v: the weights drawn would not be the model's")
    return weights


@torch.no_grad()
def attention_weights(model, idx):
    """The logits (B, T, V) of idx (B, T), and each layer's attention weights (B, n_head, T, T): rows are
    queries, columns keys, the masked part exactly 0. The model runs its ordinary forward pass; the weights are
    those of its calls to F.scaled_dot_product_attention (SDPAWeights), one a layer, or a UserError."""
    B, T = idx.shape
    with SDPAWeights() as watched:
        logits, _ = model(idx)
    n_layer, n_head = model.config.n_layer, model.config.n_head
    if len(watched.weights) != n_layer:
        raise UserError(f"the model's forward pass called F.scaled_dot_product_attention {len(watched.weights)} times, "
                        f"not once in each of its {n_layer} layers: attention.py draws the weights of those calls")
    return logits, [w.reshape(B, n_head, T, T) for w in watched.weights]  # one token: (B, n_kv, group, S) -> heads


def head_stats(w):
    """For one head's weights (T, T): mean row entropy (nats) and mean share of weight on the previous token
    (rows after the first), the first token and the token itself."""
    T = w.size(0)
    entropy = -(w * w.clamp_min(1e-30).log()).sum(-1).mean().item()
    previous = w.diagonal(offset=-1).mean().item() if T > 1 else 0.0
    return dict(entropy=entropy, previous=previous, first=w[:, 0].mean().item(), same=w.diagonal().mean().item())


def parse_indices(text, count, what):
    """The indices a --layers/--heads setting names (all when empty), each checked to be in range."""
    if not text:
        return list(range(count))
    try:
        indices = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--{what} must be comma-separated integers, got {text!r}") from None
    bad = [i for i in indices if not 0 <= i < count]
    if bad or not indices:
        raise UserError(f"--{what} {text!r}: the model has {count} {what} (0 .. {count - 1})")
    return indices


def token_labels(tokenizer, ids):
    """Each token's text, for axis labels: whitespace made visible."""
    return [tokenizer.decode([i]).replace("\n", "\\n").replace(" ", "\u2423") for i in ids]


def draw(weights, layers, heads, group, labels, path):
    """A grid, one panel per (layer, head): layers down, heads across."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    T = weights[0].size(-1)
    size = 1.6 + 0.12 * min(T, MAX_LABELS)
    fig, axes = plt.subplots(len(layers), len(heads), figsize=(size * len(heads), size * len(layers)), squeeze=False)
    for r, layer in enumerate(layers):
        for c, head in enumerate(heads):
            ax = axes[r][c]
            w = weights[layer][0, head].cpu()
            shown = w.masked_fill(w == 0, float("nan"))  # the masked part (exactly 0) blank, not dark
            ax.imshow(shown.numpy(), cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
            ax.set_title(f"layer {layer}, head {head} (kv {head // group})", fontsize=8)
            if T <= MAX_LABELS:
                ax.set_xticks(range(T), labels, rotation=90, fontsize=6)
                ax.set_yticks(range(T), labels, fontsize=6)
            else:
                ax.set_xticks([]), ax.set_yticks([])
    fig.tight_layout()
    with failing_write(path), atomic_open(path) as f:
        fig.savefig(f, format="png", dpi=100)
    return fig


def main(argv):
    settings = configure(DEFAULTS, argv)
    for key in ("out", "json"):  # else found once the maps are drawn (the picture written before the JSON failed)
        folder = os.path.dirname(os.path.abspath(settings[key]))
        if settings[key] and not os.path.isdir(folder):
            raise UserError(f"--{key} {settings[key]}: there is no folder {folder} to write it in")
    prompt = read_prompt(settings["prompt"])
    device = resolve_device(settings["device"])
    from gpt.machine import SharedCpu
    cpu = SharedCpu(device)  # on a CPU: the look at how busy the machine is runs while the model loads
    model, meta, _ = load_model(settings["out_dir"], device, torch.float32, settings["init_from"])
    config, tokenizer = model.config, Tokenizer(meta)
    layers = parse_indices(settings["layers"], config.n_layer, "layers")
    heads = parse_indices(settings["heads"], config.n_head, "heads")
    try:
        ids = tokenizer.encode(prompt, special_tokens=True)
    except UserError as e:
        raise UserError(f"the prompt has {e}") from None
    if not ids:
        raise UserError("the prompt is empty; give some text, e.g. --prompt='ROMEO:'")
    if len(ids) > config.block_size:
        raise UserError(f"the prompt is {len(ids)} tokens, but the model reads at most block_size="
                             f"{config.block_size}; shorten it")

    busy_note = cpu.check()  # torch's threads: the cores other processes leave free
    if busy_note:
        print(busy_note, file=sys.stderr)
    _, weights = attention_weights(model, torch.tensor([ids], device=device))
    group = config.n_head // config.n_kv_head
    stats = {f"layer {layer} head {head}": head_stats(weights[layer][0, head]) for layer in layers for head in heads}
    print(f"{len(ids)} tokens; per head: mean row entropy (nats), and the share of weight on the previous "
          f"token, the first token and the token itself")
    print(f"{'head':>20} {'kv head':>7} {'entropy':>8} {'previous':>8} {'first':>8} {'same':>8}")
    for name, s in stats.items():
        head = int(name.split()[-1])
        print(f"{name:>20} {head // group:>7} {s['entropy']:8.3f} {s['previous']:8.3f} {s['first']:8.3f} {s['same']:8.3f}")
    draw(weights, layers, heads, group, token_labels(tokenizer, ids), settings["out"])
    print(f"wrote {settings['out']} ({len(layers)} x {len(heads)} panels)")
    if settings["json"]:
        record = dict(tokens=token_labels(tokenizer, ids), heads={
            name: dict(s, weights=weights[int(name.split()[1])][0, int(name.split()[3])].tolist())
            for name, s in stats.items()})
        write_json(settings["json"], record)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # Ctrl-C: no traceback, and the shell's status for it
        sys.exit(130)
