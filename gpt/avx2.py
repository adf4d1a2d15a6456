"""Products of int8 or 16-bit weights by a few rows on an x86 CPU with AVX2 (kernels.py's "avx2"): C++ of our own,
built once with the C++ compiler inductor uses (kept in kernels.cache_dir()), called through ctypes. Neither torch's
kernels nor inductor's loops stream such weights fast where there is no AVX-512: int8 ran 2-5x slower than float32
weights there, 16-bit no faster (bench/RESULTS.md), so --quantize and --dtype were a loss on most laptops.

- int8, float16 or bfloat16 weights, float32 rows (--quantize=int8; --dtype's 16-bit rows, made float32): eight
  weights a load made float32 and multiplied in float32, the same sums as F.linear(x, weight.float()) in another order.
- int8 weights, int8 rows (--quantize=w8a8): whole-number sums, exact, as llama.cpp's q8_0 takes them on AVX2: the
  unsigned |x| times w given x's sign, so that the pair sums of _mm256_maddubs_epi16 (at most 2 * 127 * 127) never
  saturate int16, as oneDNN's int8 products do without VNNI.
Each output row is one thread's (OpenMP: torch's own threads, so torch.set_num_threads holds for these too)."""

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess

import torch

from gpt.cpuinfo import cpu_flags

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

static float sum_of(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Weights are read once a token, from memory: each core asks for them AHEAD bytes before it reads them, as one row's
// stream into the next (the hardware prefetcher alone kept a core at ~6 GB/s where it can read ~10: bench/RESULTS.md).
// Only inside the weights: an address past them is never formed.
#define AHEAD 4096
static void fetch_ahead(const void* w, int64_t at, int64_t size) {  // at, size: in bytes
    if (at + AHEAD < size) _mm_prefetch((const char*)w + at + AHEAD, _MM_HINT_T0);
}

// Each kind of weight: eight of them as float32, and one (a row's tail)
struct Int8 {
    typedef int8_t T;
    static __m256 eight(const int8_t* w) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)w)));
    }
    static float one(const int8_t* w) { return *w; }
};
struct Half {
    typedef uint16_t T;
    static __m256 eight(const uint16_t* w) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w)); }
    static float one(const uint16_t* w) { return _cvtsh_ss(*w); }
};
struct BFloat {  // a bfloat16 is the upper half of a float32
    typedef uint16_t T;
    static __m256 eight(const uint16_t* w) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)w)), 16));
    }
    static float one(const uint16_t* w) {
        uint32_t bits = (uint32_t)*w << 16;
        float f;
        __builtin_memcpy(&f, &bits, 4);
        return f;
    }
};

// y (M, N) = x (M, K) float32 times w (N, K) of kind W, transposed
template <typename W>
static void by_float(const float* x, const typename W::T* w, float* y, int64_t M, int64_t N, int64_t K) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const typename W::T* wn = w + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float* xm = x + m * K;
            __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps(), c = _mm256_setzero_ps(), d = _mm256_setzero_ps();
            int64_t k = 0;
            for (; k + 32 <= K; k += 32) {  // four sums: the adds of one wait for none of the others
                fetch_ahead(w, sizeof(*w) * (n * K + k), sizeof(*w) * N * K);
                a = _mm256_fmadd_ps(W::eight(wn + k), _mm256_loadu_ps(xm + k), a);
                b = _mm256_fmadd_ps(W::eight(wn + k + 8), _mm256_loadu_ps(xm + k + 8), b);
                c = _mm256_fmadd_ps(W::eight(wn + k + 16), _mm256_loadu_ps(xm + k + 16), c);
                d = _mm256_fmadd_ps(W::eight(wn + k + 24), _mm256_loadu_ps(xm + k + 24), d);
            }
            float sum = sum_of(_mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
            for (; k < K; k++) sum += xm[k] * W::one(wn + k);
            y[m * N + n] = sum;
        }
    }
}

extern "C" void int8_by_float(const float* x, const int8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
    by_float<Int8>(x, w, y, M, N, K);
}

extern "C" void half_by_float(const float* x, const uint16_t* w, float* y, int64_t M, int64_t N, int64_t K) {
    by_float<Half>(x, w, y, M, N, K);
}

extern "C" void bfloat_by_float(const float* x, const uint16_t* w, float* y, int64_t M, int64_t N, int64_t K) {
    by_float<BFloat>(x, w, y, M, N, K);
}

// y (M, N) = x (M, K) int8 times w (N, K) int8, transposed: the exact int32 sums, as float32
extern "C" void int8_by_int8(const int8_t* x, const int8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
    const __m256i ones = _mm256_set1_epi16(1);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t* wn = w + n * K;
        for (int64_t m = 0; m < M; m++) {
            const int8_t* xm = x + m * K;
            __m256i sums = _mm256_setzero_si256();  // 8 int32 sums
            int64_t k = 0;
            for (; k + 32 <= K; k += 32) {
                fetch_ahead(w, n * K + k, N * K);
                __m256i xv = _mm256_loadu_si256((const __m256i*)(xm + k));
                __m256i wv = _mm256_loadu_si256((const __m256i*)(wn + k));
                __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(wv, xv));  // 16 int16
                sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, ones));
            }
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
            int32_t sum = _mm_cvtsi128_si32(s);
            for (; k < K; k++) sum += (int32_t)xm[k] * wn[k];
            y[m * N + n] = (float)sum;
        }
    }
}
"""
# the kernel for each (weight dtype, row dtype)
KERNELS = {(torch.int8, torch.float32): "int8_by_float", (torch.float16, torch.float32): "half_by_float",
           (torch.bfloat16, torch.float32): "bfloat_by_float", (torch.int8, torch.int8): "int8_by_int8"}
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]


@functools.cache
def library(cache_dir):
    """The kernels, built on first use into the folder cache_dir() names (a file per source and flags, written
    whole), loaded once a process; a RuntimeError where this CPU cannot run them (checked here: once a process)."""
    if not {"avx2", "fma", "f16c"} <= set(cpu_flags()):  # an Arm CPU, an x86 one without them
        raise RuntimeError("the AVX2 kernels need an x86 CPU with AVX2, FMA and F16C")
    compiler = os.environ.get("CXX", "g++")  # inductor's choice of compiler too
    digest = hashlib.sha1(" ".join([SOURCE, compiler, *FLAGS]).encode()).hexdigest()[:12]
    folder = cache_dir()
    path = os.path.join(folder, f"avx2_{digest}.so")
    if not os.path.exists(path):
        if not shutil.which(compiler):
            raise RuntimeError(f"the AVX2 kernels are C++ built here, and there is no {compiler}")
        try:
            build(compiler, path)
        except OSError as e:  # an unwritable cache folder: no candidate (RuntimeError), not a failed run
            raise RuntimeError(f"cannot build the AVX2 kernels in {folder} ({e.strerror})") from None
    lib = ctypes.CDLL(path)
    for kernel in map(functools.partial(getattr, lib), KERNELS.values()):
        kernel.argtypes, kernel.restype = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3, None
    return lib


def build(compiler, path):
    """SOURCE compiled into path, written whole: built beside it under this process's name, then moved there."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    source, built = f"{path}.{os.getpid()}.cpp", f"{path}.{os.getpid()}"
    try:
        with open(source, "w") as f:
            f.write(SOURCE)
        result = subprocess.run([compiler, *FLAGS, source, "-o", built], capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"building the AVX2 kernels failed: {result.stderr.strip()[-300:]}")
        os.replace(built, path)
    finally:
        for leftover in (source, built):
            if os.path.exists(leftover):
                os.remove(leftover)


def product(x, weight, cache_dir):
    """x (M, K) float32 or int8 times weight (N, K) as KERNELS pairs them, transposed: (M, N) float32 (the kernels of
    library(cache_dir))."""
    x, weight = x.contiguous(), weight.contiguous()  # each itself where it is already (a model's weight is)
    y = torch.empty(x.size(0), weight.size(0))
    kernel = getattr(library(cache_dir), KERNELS[weight.dtype, x.dtype])
    kernel(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.size(0), *weight.shape)
    return y
