# Character-level Tiny Shakespeare on a laptop CPU: the first run of this repo.
#   python data/shakespeare_char/prepare.py && python train.py config/small.py && python sample.py --prompt "ROMEO:"
# Measured on a 2-core x86-64 VM (CPU only, fp32, 2026-11-22): 1200 iterations at ~100 ms, val loss 1.748
# after 136 s of training, evaluation included (141 s with start-up). nanoGPT's README CPU recipe reaches
# 1.886 in about 125 s on the same machine. What was tried to get here: bench/RESULTS.md.
out_dir = "out-small"
dataset = "shakespeare_char"
eval_interval = 400
eval_iters = 40
log_interval = 10

# 768 tokens per step: on two cores, more frequent small steps beat fewer large ones in a 2-minute budget
batch_size = 6
block_size = 128

# 0.9M parameters: Llama-style (RoPE, RMSNorm, SwiGLU) with QK-norm, which lets the learning rate be high
n_layer = 4
n_head = 4
n_kv_head = 4
n_embd = 128
dropout = 0.0  # one pass over the data: nothing to regularize yet

learning_rate = 2e-3
min_lr = 1e-4
warmup_iters = 50
max_iters = 1200
lr_decay_iters = 1200
