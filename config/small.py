# Character-level Tiny Shakespeare on a laptop CPU: the first run of this repo.
#   python data/shakespeare_char/prepare.py && python train.py config/small.py && python sample.py --prompt "ROMEO:"
# Measured on a 2-core AMD EPYC VM (CPU only, fp32, 2026-11-26): 1000 iterations at 80-105 ms, val loss 1.6024
# (mean of 5 seeds 1.608), 90-116 s for the whole command; nanoGPT's README CPU recipe, run alternately with it
# on the same machine: 1.886 in 105-115 s (a slow hour of the VM). Muon, the untied head, Muon's momentum and the
# learning rate each won a compare.py comparison across seeds, on characters and on GPT-2 tokens; what else was
# tried, and lost or could not be told from noise, is in bench/RESULTS.md.
out_dir = "out-small"
dataset = "shakespeare_char"
eval_interval = 400
eval_iters = 40
log_interval = 10

# 768 tokens per step: on two cores, more frequent small steps beat fewer large ones in a budget of minutes
batch_size = 6
block_size = 128

# 0.9M parameters: Llama-style (RoPE, RMSNorm, SwiGLU) with QK-norm, which lets the learning rate be high
n_layer = 4
n_head = 4
n_kv_head = 4
n_embd = 128
dropout = 0.0  # one pass over the data: nothing to regularize yet
# An output head of its own, not the token embedding's transpose (modded-nanogpt unties them too): val -0.0083 (95%
# interval -0.0116 to -0.0049) over 5 seeds at 1000 iterations, and -0.17 on GPT-2 tokens (config/shakespeare_bpe.py
# with Muon, 120 iterations, 3 seeds); 16K more parameters here. Llama and Qwen3 have it too: still exportable.
tie_embeddings = False

# Muon for the matrices inside the blocks, AdamW for the rest: val -0.150 (95% interval -0.180 to -0.119) against
# AdamW over 3 seeds at 1000 iterations, for ~30% more time per step
optimizer = "muon"
# Muon's momentum 0.9, not torch's 0.95: val -0.0078 (95% interval -0.0132 to -0.0023) over 11 seeds at 1000
# iterations, and -0.036 on GPT-2 tokens (config/shakespeare_bpe.py with Muon, 120 iterations, 3 seeds)
muon_momentum = 0.9
# A learning rate of 4e-3, not 2e-3: val -0.0095 (95% interval -0.0138 to -0.0053) over 7 seeds at 1000
# iterations, and -0.27 on GPT-2 tokens (config/shakespeare_bpe.py with Muon, 120 iterations, 3 seeds)
learning_rate = 4e-3
min_lr = 1e-4
warmup_iters = 50
max_iters = 1000
