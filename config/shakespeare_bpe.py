# Tiny Shakespeare in GPT-2 BPE tokens (302K train tokens), a small model from scratch on a CPU:
#   python data/shakespeare/prepare.py && python train.py config/shakespeare_bpe.py
#   python sample.py --out_dir=out-shakespeare-bpe --prompt "ROMEO:"
# Measured on a 2-core x86-64 VM (CPU only, fp32, 2026-11-22): 300 iterations at ~0.9 s, val loss 5.23
# after 5.5 minutes. The text is word salad with Shakespeare's names and layout: 300K tokens are too few to
# learn a 50K-token vocabulary from scratch. For real quality, fine-tune a pretrained Llama/Qwen3 with
# --init_from=hf:folder (docs/interop.md), or use config/small.py's character-level model.
out_dir = "out-shakespeare-bpe"
dataset = "shakespeare"
eval_interval = 100
eval_iters = 20
log_interval = 10

batch_size = 8
block_size = 128

# The 50,304-token output layer costs more than the 4 blocks here: keep the width small on a CPU.
n_layer = 4
n_head = 4
n_kv_head = 2
n_embd = 128
dropout = 0.0  # 300 x 1,024 tokens: about one pass over the 302K training tokens

learning_rate = 2e-3
min_lr = 1e-4
warmup_iters = 50
max_iters = 300
