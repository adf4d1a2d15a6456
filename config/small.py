# Character-level Tiny Shakespeare on a laptop CPU: the first run of this repo.
#   python data/shakespeare_char/prepare.py && python train.py config/small.py
out_dir = "out-small"
dataset = "shakespeare_char"
eval_interval = 250
eval_iters = 20
log_interval = 10
batch_size = 12
block_size = 64
n_layer = 4
n_head = 4
n_kv_head = 4
n_embd = 128
max_iters = 2000
lr_decay_iters = 2000
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 100
