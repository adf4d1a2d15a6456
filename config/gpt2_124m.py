# GPT-2-small-sized model (12 layers, 768 wide, 1024 context) with GQA, on FineWeb GPT-2 tokens, for one
# node of 8 GPUs:
#   python data/fineweb/prepare.py                     # ~10B tokens, hours, once
#   torchrun --standalone --nproc_per_node=8 train.py config/gpt2_124m.py
# Measured at this shape on one H100 (bench/RESULTS.md, torch 2.11): the compiled step at batch 64, 131.8 ms
# (497k tokens/s, MFU 40%), with AdamW and a tied head over 20 iterations; this config (Muon, untied) has never been
# run to a loss. Expected: 8 x 64 x 1024 = 524,288 tokens per iteration, 19,000
# iterations = 10B tokens, one pass over sample-10BT. The model has 153M parameters (114M, GQA making it
# smaller than GPT-2's 124M, and an untied head of 38.6M) and costs ~800 MFLOPs per token; at 50% MFU on 8 x H100
# that is about 5M tokens/s, so roughly 35 minutes; on 8 x A100, about 2 hours. Val loss should end near
# 3.3, where llm.c's GPT-2 (124M) ends on the same data (3.28). 1, 2, 4 or 8 GPUs run it unchanged, each doing
# 8, 4, 2 or 1 micro-steps of 64 x 1024 per iteration: the global batch stays 524,288 tokens. 3, 5, 6 or 7 GPUs
# cannot split 512 sequences evenly; train.py stops and names a total_batch_size that works there.
out_dir = "out-gpt2-124m"
dataset = "fineweb"
eval_interval = 500
eval_iters = 40
log_interval = 10
wandb_project = "gpt2-124m"
wandb_run_name = "gpt2-124m"

total_batch_size = 524288  # tokens per iteration over all GPUs (2**19, GPT-3 small's 0.5M); accumulation follows
batch_size = 64  # per GPU and micro-step: ~46 GB eager, estimated (docs/training.md); pass 32 on 40 GB cards, 16 on 24 GB
# The loss on whole logits: compiled on one H100 (torch 2.11, the 124M shape, AdamW, batch 64; bench/RESULTS.md)
# 497k tokens/s and 43.5 GB at peak, against 368k and 29.3 GB with loss_chunk=8192, whose per-chunk gradients
# (gpt/loss.py) break the compiled graph. Where memory is short (eager, or a smaller card), loss_chunk=8192.
loss_chunk = 0
block_size = 1024

n_layer = 12
n_head = 12
n_kv_head = 4  # GQA: 3 query heads per key/value head, a 3x smaller KV cache
n_embd = 768
dropout = 0.0
# Two changes that won on this repo's small runs (characters and GPT-2 tokens, bench/RESULTS.md) and on published
# GPT-2-scale runs: an untied output head (modded-nanogpt's record of 2024-11-03, "untied embed and head weights";
# +38.6M parameters, the same compute per token), and Muon for the matrices inside the blocks (modded-nanogpt's
# records since 2024-10, nanochat; Moonlight, arXiv:2502.16982, for Muon scaled to AdamW's learning rate, as
# optimizer="muon" does). Untested at this size here: no run of this config to a loss yet.
tie_embeddings = False
optimizer = "muon"

learning_rate = 6e-4
min_lr = 6e-5
weight_decay = 0.1
warmup_iters = 700
max_iters = 19000
