#!/usr/bin/env bash
# What a GPU owner waits for, at the GPT-2 124M shape on one GPU, in ~7 minutes (bench/RESULTS.md has its runs):
#   train.py ms/iter, tokens/s, MFU at batch 16 and 64 (compiled), and at 16 with the chunked loss (loss_chunk);
#   sample.py's time to its first token and tokens/s eager, by default (a CUDA graph of the eager step; greedy, and
#   sampled as a user runs it, without a host sync: gpt/sampling.py's draw), and with
#   --compile=True on a cold and a warm inductor cache; where the graphed step's GPU time goes
#   (bench/gpu_decode_kernels.py); Muon's Newton-Schulz batched or not (bench/bench_muon.py).
#   Run from the repo root: bash bench/gpu_probe.sh [> log]
# SAMPLE_ONLY=1: sample.py's rows alone (~3 minutes), on a checkpoint of 2 eager iterations.
# DEV=cpu SHAPE="..." BATCHES=2 tries its plumbing on a CPU with a tiny shape.
W=$(mktemp -d); export GPT_CACHE_DIR=$W/cache PYTHONUNBUFFERED=1 DEV=${DEV:-cuda}   # sample.py's compile cache starts cold
PY=$(command -v python3 || command -v python)
SHAPE=${SHAPE:-"--n_layer=12 --n_head=12 --n_kv_head=4 --n_embd=768 --block_size=1024 --vocab_size=50304 --loss_chunk=0"}
BATCHES=${BATCHES:-"16 64"}; FIRST=${BATCHES%% *}
$PY data/shakespeare_char/prepare.py >/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null
$PY -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"; git log -1 --oneline 2>/dev/null
train() {  # $1: batch, $2: out_dir name, the rest: more settings. A log (a sync) every 5 iters.
  local B=$1 D=$2; shift 2; local t=$(date +%s)
  $PY train.py --dataset=shakespeare_char $SHAPE --batch_size=$B --max_iters=20 --eval_interval=20 --eval_iters=2 \
    --log_interval=5 --warmup_iters=5 --compile=True --overwrite=True --device=$DEV --out_dir=$W/$D "$@" >$W/$D.log 2>&1
  $PY -c "import json; r=[json.loads(l) for l in open('$W/$D/metrics.jsonl')]; t=[x for x in r if 'ms_per_iter' in x][1:]
f=next(x for x in r if 'first_step_s' in x); print(f'train $D (batch $B $*): {min(x[\"ms_per_iter\"] for x in t):.1f} ms/iter',
 f'{max(x[\"tokens_per_sec\"] for x in t):,.0f} tokens/s, MFU {100*max(x.get(\"mfu\",0) for x in t):.1f}%,',
 f'first step {f[\"first_step_s\"]:.1f} s, peak {max(x.get(\"peak_memory_gb\",0) for x in r):.1f} GB, whole run $(($(date +%s)-t)) s')" \
    || tail -3 $W/$D.log
}
ttft() {  # $1: a label, the rest: the command. Time to the first streamed byte after the prompt, and sample.py's figures
  $PY - "$@" <<'PYEOF'
import hashlib, subprocess, sys, time; t = time.time(); p = subprocess.Popen(sys.argv[2:], stdout=-1, stderr=-1)
head = p.stdout.read(7); first = time.time() - t; out, err = p.communicate()  # "ROMEO:" is 6 bytes, then a token
text = hashlib.md5(head + out).hexdigest()[:8]  # the same text greedy on every path: the same digest, same length
print(f"{sys.argv[1]}: first token {first:.1f} s, wall {time.time() - t:.1f} s, text {text} |",
      err.decode().strip().splitlines()[-1])
PYEOF
}
if [ "${SAMPLE_ONLY:-0}" = 1 ]; then  # a checkpoint to sample from, quickly: 2 eager iterations
  $PY train.py --dataset=shakespeare_char $SHAPE --batch_size=$FIRST --max_iters=2 --eval_interval=2 --eval_iters=1 \
    --compile=False --overwrite=True --device=$DEV --out_dir=$W/b$FIRST >$W/b$FIRST.log 2>&1 || tail -3 $W/b$FIRST.log
else
  train $FIRST b$FIRST
fi
A="--out_dir=$W/b$FIRST --device=$DEV --prompt=ROMEO: --temperature=0"; S="$PY sample.py $A"
ttft sample-eager $S --compile=False --cuda_graph=False --max_new_tokens=100
# again with SDPA's cuDNN kernel off: eager leaves it out anyway (a plan per new key length: gpt/sdpa.py), the default
# keeps it (the fastest at one length), and without it takes another kernel, with other output strides
NO_CUDNN="import runpy, sys, torch; torch.backends.cuda.enable_cudnn_sdp(False); sys.argv[0] = 'sample.py'; \
runpy.run_path('sample.py', run_name='__main__')"
ttft sample-eager-no-cudnn $PY -c "$NO_CUDNN" $A --compile=False --cuda_graph=False --max_new_tokens=100
ttft sample-default-no-cudnn $PY -c "$NO_CUDNN" $A --max_new_tokens=300
ttft sample-default $S --max_new_tokens=300
ttft sample-default-sampled $PY sample.py ${A% --temperature=0} --max_new_tokens=300  # as a user runs it: temperature 0.8
if [ "${SAMPLE_COMPILE:-1}" = 1 ]; then  # SAMPLE_COMPILE=0 leaves out the two compiled rows (~3 minutes)
  GPT_CACHE_DIR=$W/cache2 ttft sample-compile-cold $S --max_new_tokens=300 --compile=True
  GPT_CACHE_DIR=$W/cache2 ttft sample-compile-warm $S --max_new_tokens=300 --compile=True
fi
$PY bench/gpu_decode_kernels.py --cache=320 --steps=100
$PY bench/bench_muon.py --rounds=3  # Newton-Schulz matrix by matrix or batched by shape: does batching pay here?
[ "${SAMPLE_ONLY:-0}" = 1 ] && exit
for B in ${BATCHES#$FIRST}; do train $B b$B; done
train $FIRST b${FIRST}_chunked_loss --loss_chunk=8192  # what the chunked loss costs compiled (it breaks the graph)
