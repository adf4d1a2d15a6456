# A draft model for config/small.py's, to sample with speculative decoding. The same data and tokenizer
# (character-level Tiny Shakespeare, so the vocabularies match), one block instead of four, trained the same way.
#   python train.py config/small.py && python train.py config/small_draft.py
#   python sample.py --prompt "ROMEO:" --draft=out-draft
# Measured on a 2-core x86-64 VM (CPU only, fp32): 17-19 s of training (0.23M parameters, val loss 1.868 at 1200;
# config/small.py's model, trained with AdamW then, 1.748). With it, sample.py's 500 tokens at temperature 0.8
# accept 62% of the drafted tokens (draft_k 4) and run at ~1,520 tokens/s instead of ~1,380 without it: at 0.9M
# parameters a decode step on a CPU is mostly fixed overhead, so a draft saves little here (and at
# --temperature=0 it accepted 45%: slower).
out_dir = "out-draft"
dataset = "shakespeare_char"
eval_interval = 400
eval_iters = 40
log_interval = 10

batch_size = 6
block_size = 128  # the model's: a draft with less would cap the context of speculative decoding (sample.py)

n_layer = 1  # of 4: a step costs about a quarter of the model's
n_head = 4
n_kv_head = 4
n_embd = 128
dropout = 0.0

learning_rate = 2e-3
min_lr = 1e-4
warmup_iters = 50
max_iters = 1200
lr_decay_iters = 1200
