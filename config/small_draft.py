# A draft model for config/small.py's, to sample with speculative decoding. The same data and tokenizer
# (character-level Tiny Shakespeare, so the vocabularies match), one block instead of three, trained the same way.
#   python train.py config/small.py && python train.py config/small_draft.py
#   python sample.py --prompt "ROMEO:" --draft=out-draft
# Below 1M parameters a decode step on a CPU is mostly fixed overhead, so a draft saves little here: this config is
# for trying speculative decoding end to end (its acceptance rate and speed: bench/RESULTS.md, "Draft model").
out_dir = "out-draft"
dataset = "shakespeare_char"
eval_interval = 400
eval_iters = 40
log_interval = 10

batch_size = 6
block_size = 128  # the model's: a draft with less proposes from a shorter window of its own (gpt/speculative.py)

n_layer = 1  # of 3: a step costs about a third of the model's
n_head = 4
n_kv_head = 4
n_embd = 128
dropout = 0.0

learning_rate = 2e-3
min_lr = 1e-4
warmup_iters = 50
max_iters = 1200
