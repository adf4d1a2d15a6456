"""
Export a checkpoint as a Hugging Face folder (config.json, model.safetensors, tokenizer.json):

    python export.py --out_dir out-small --to hf-small/   # then AutoModelForCausalLM.from_pretrained("hf-small")
    python sample.py --init_from=hf:hf-small              # and back (gpt/hf.py reads such folders)

Our model with bias=False, mlp="swiglu", window=0 is exactly a Llama (qk_norm=False) or a Qwen3 (qk_norm=True),
and its parameter names are the Hugging Face ones without the "model." prefix, so an export is renaming plus
a config.json. Nothing is exported approximately. A setting with no counterpart (a GELU MLP, a sliding
window...) is refused with the reason; then what is written is checked against the architecture itself:
the exact tensor names and shapes a Llama or Qwen3 of that config has, the token ids read by the embedding lookup
alone, the causal mask rule at every pair of positions, and, when transformers is installed, its outputs against ours
on random ids at every position (gpt/hf.py, "The proof"). An edited model.py that no longer computes a Llama (learned
positions, LayerNorm, a separator in the mask rule...) is refused there, naming what differs, and no folder is
left behind. Weights are safetensors: loading them never runs code, unlike a pickle.
"""

import os
import sys

from configurator import configure
from gpt import UserError
from gpt.checkpoint import load_model
from gpt.hf import EXPORT_FILES, PROOF_POSITIONS, export_hf

DEFAULTS = dict(
    out_dir="out-small",  # the folder holding ckpt.pt (or a path to a .pt file)
    to="",  # the folder to write the Hugging Face model to
    overwrite=False,  # replace an earlier export in that folder (else it is refused)
    unchecked=False,  # without transformers installed, write the folder with its logits not compared (else refused)
)


def main(argv):
    settings = configure(DEFAULTS, argv)
    if not settings["to"]:
        raise UserError("say where to write the Hugging Face folder with --to, e.g. --to hf-small/")
    earlier = sorted(set(os.listdir(settings["to"])) & EXPORT_FILES) if os.path.isdir(settings["to"]) else []
    if earlier and not settings["overwrite"]:
        raise UserError(f"{settings['to']} holds an export already ({', '.join(earlier)}); pass --overwrite=True to "
                        "replace it, or choose another --to")
    if not settings["unchecked"]:
        try:
            import transformers  # noqa: F401  (the logits check needs it: said before anything is loaded)
        except ImportError:
            raise UserError("transformers is not installed, so the export's logits cannot be compared with ours; "
                            "pip install transformers, or pass --unchecked=True to write it unchecked") from None
    model, meta, _ = load_model(settings["out_dir"])
    config, checked = export_hf(model, meta, settings["to"])
    check = "same logits in transformers" if checked else "logits not compared: transformers is not installed"
    if checked and model.config.block_size > PROOF_POSITIONS:
        check += f" at the first {PROOF_POSITIONS} of its {model.config.block_size} positions"
    print(f"wrote {config['architectures'][0]} ({model.num_params() / 1e6:.2f}M parameters; {check}) to "
          f"{settings['to']}; load it with transformers.AutoModelForCausalLM.from_pretrained({settings['to']!r})")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # Ctrl-C: no traceback, and the shell's status for it
        sys.exit(130)
