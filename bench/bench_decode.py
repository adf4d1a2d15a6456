"""Decode speed of sample.py's modes as a user runs them, beside llama.cpp's on the same model, in one run.

    bash ../shared/tools/llamacpp_decode.sh          # once: makes /tmp/llamacpp-anchor (model, its f32/f16/q8_0 GGUFs)
    python bench/bench_decode.py --out_dir=/tmp/llamacpp-anchor/gpt2shape.pt --gguf_dir=/tmp/llamacpp-anchor \
        --long_prompt=prompt.txt                     # a text of ~930 tokens for the ~1000-token context
    python bench/bench_decode.py --out_dir=out-small --modes fp32,int8 --batches 1

For each precision, llama.cpp first (if --gguf_dir has its GGUF and llama_cpp is installed: batch 1 only, its
per-token time the slope between a 72- and an 8-token run, best of 2 each, as llamacpp_decode.sh times it), then
each of our modes of that precision. For each of ours, batch (--num_samples) and context (a one-word prompt, and
--long_prompt), sample.py runs once untimed (it measures its decode kernel and compiles, both kept in
kernels.cache_dir()), then --repeats times; the figure is the best steady speed its speed line reports ("... after
the first 8" tokens per sample: prefill, the first steps and loading compiled code left out), as ms per step of the
whole batch. Last, the first and a warm start of a compiled run (seconds from launch to exit, a fresh cache folder,
then the same again) beside the same run uncompiled.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: make the repo's modules importable
from gpt.cpuinfo import cpu_name  # noqa: E402
# precision -> (llama.cpp's GGUF type, {our mode: sample.py's flags}); the defaults compile on a CPU where it pays
PRECISIONS = {
    "fp32": ("f32", {"fp32 (default)": [], "fp32 eager": ["--compile=False"]}),
    "16-bit": ("f16", {"fp16": ["--dtype=float16"], "bf16": ["--dtype=bfloat16"]}),
    "8-bit": ("q8_0", {"int8": ["--quantize=int8"], "int8 bf16": ["--quantize=int8", "--dtype=bfloat16"],
                       "w8a8": ["--quantize=w8a8"]}),
}
STEADY = re.compile(r"([\d.]+) after the first \d+\)")


def run(args, env):
    """Seconds from launch to exit, and the steady tokens/s of sample.py's speed line."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "sample.py", "--temperature=0", "--device=cpu", *args], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    seconds = time.perf_counter() - start
    match = STEADY.search(result.stderr)
    if result.returncode or not match:
        sys.exit(f"sample.py {' '.join(args)} failed: {(result.stderr or result.stdout).strip()[-300:]}")
    return seconds, float(match.group(1))


def llamacpp_ms_per_token(gguf, prompt_tokens):
    """llama.cpp's batch-1 ms per token after prompt_tokens (a list of ids): the slope of a 72- and an 8-token run."""
    from llama_cpp import Llama
    llm = Llama(model_path=gguf, n_ctx=1024, n_threads=os.cpu_count(), n_batch=512, verbose=False)

    def seconds(n):
        best = float("inf")
        for _ in range(2):
            llm.reset()
            llm.eval(prompt_tokens)
            start = time.perf_counter()
            for i in range(n):
                llm.eval([2000 + i])
            best = min(best, time.perf_counter() - start)
        return best

    seconds(4)  # warm-up
    ms = (seconds(72) - seconds(8)) / 64 * 1e3
    llm.close()
    return ms


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", required=True, help="a checkpoint (folder or .pt), as sample.py takes it")
    parser.add_argument("--gguf_dir", default="", help="a folder with gpt2shape-{f32,f16,q8_0}.gguf of the same model")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help=f"comma-separated: {', '.join(PRECISIONS)}")
    parser.add_argument("--batches", default="1,8", help="comma-separated --num_samples values")
    parser.add_argument("--long_prompt", default="", help="a text file of ~930 tokens for the ~1000-token context")
    parser.add_argument("--new_tokens", type=int, default=72)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no_starts", action="store_true", help="skip the cold and warm start of --compile=True")
    args = parser.parse_args()
    env = dict(os.environ)
    cpu = cpu_name()
    print(f"{cpu}, {os.cpu_count()} cores; ms per decode step (the whole batch); ours: best steady speed of "
          f"{args.repeats}; llama.cpp: batch 1, slope of 72 and 8 tokens", flush=True)
    prompts = {"short prompt": ("--prompt=The", list(range(1000, 1016)))}  # llama.cpp: llamacpp_decode.sh's prompt
    if args.long_prompt:
        prompts["~1000-token context"] = (f"--prompt=FILE:{args.long_prompt}", list(range(1000, 1930)))
    for precision in args.precisions.split(","):
        gguf_type, modes = PRECISIONS[precision]
        gguf = os.path.join(args.gguf_dir, f"gpt2shape-{gguf_type}.gguf")
        if args.gguf_dir and os.path.exists(gguf):
            for prompt_name, (_, prompt_tokens) in prompts.items():
                ms = llamacpp_ms_per_token(gguf, prompt_tokens)
                print(f"  llama.cpp {gguf_type:8s} {prompt_name:20s} batch 1: {ms:6.2f} ms/step", flush=True)
        for mode, flags in modes.items():
            for prompt_name, (prompt, _) in prompts.items():
                for batch in map(int, args.batches.split(",")):
                    common = [f"--out_dir={args.out_dir}", prompt, f"--num_samples={batch}", *flags]
                    run([*common, "--max_new_tokens=16"], env)  # measures the kernel choice, compiles: both kept
                    best = max(run([*common, f"--max_new_tokens={args.new_tokens}"], env)[1]
                               for _ in range(args.repeats))
                    print(f"  {mode:18s} {prompt_name:20s} batch {batch}: {batch / best * 1e3:6.2f} ms/step", flush=True)
    if args.no_starts:
        return
    with tempfile.TemporaryDirectory() as cache:  # compile once, then load: a new machine, then a second run
        env = dict(os.environ, GPT_CACHE_DIR=cache)
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        common = [f"--out_dir={args.out_dir}", "--prompt=The", f"--max_new_tokens={args.new_tokens}"]
        first, warm = run([*common, "--compile=True"], env)[0], run([*common, "--compile=True"], env)[0]
        plain = run([*common, "--compile=False"], env)[0]
        print(f"  sample.py --compile=True, {args.new_tokens} tokens, launch to exit: first run {first:.1f} s "
              f"(compiles), a second {warm:.1f} s (loads the compiled code); --compile=False {plain:.1f} s")


if __name__ == "__main__":
    main()
