# Character-level Tiny Shakespeare on a laptop CPU: the first run of this repo.
#   python data/shakespeare_char/prepare.py && python train.py config/small.py && python sample.py --prompt "ROMEO:"
# Measured on a 2-core AMD EPYC VM without AVX-512 (CPU only, fp32, 2026-11-27): 950 iterations at 135-155 ms,
# val loss 1.5582 (mean of 5 seeds 1.5617), 142-162 s for the whole command; nanoGPT's README CPU recipe, run
# alternately with it on the same machine: 1.886 in 148-167 s. Muon, the untied head, Muon's momentum, the learning
# rate and the shape (3 blocks, 10 sequences a step) each won a compare.py comparison across seeds, on characters
# and on GPT-2 tokens; what else was tried, and lost or could not be told from noise, is in bench/RESULTS.md.
out_dir = "out-small"
dataset = "shakespeare_char"
eval_interval = 500  # evaluation is ~2% of the run each time: at 0, 500 and the end
eval_iters = 40
log_interval = 10

# 3 blocks and 10 sequences of 128 a step (1,280 tokens), not 4 and 6: val -0.0504 (95% interval -0.0572 to
# -0.0436) over 5 seeds at 1000 iterations, in about the same time a step; on GPT-2 tokens -0.064 (-0.127 to
# -0.002; config/shakespeare_bpe.py's 300 iterations, 3 seeds, 1.2x the time a step): at this size, more tokens a
# step gained more than a fourth block did
batch_size = 10
block_size = 128

# 0.67M parameters: Llama-style (RoPE, RMSNorm, SwiGLU) with QK-norm, which lets the learning rate be high
n_layer = 3
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
max_iters = 950  # as many as fit in nanoGPT's CPU recipe's time on the machine above
