"""int8 weight products of a few rows on an x86 CPU with AVX2 (kernels.py's "avx2-int8"): C++ of our own, built once
with the C++ compiler inductor uses (kept in kernels.cache_dir()), called through ctypes. Neither torch's kernels nor
inductor's loops stream int8 weights fast where there is no AVX-512: they run 2-5x slower than float32 weights there
(bench/RESULTS.md), so --quantize was a loss on most laptops.

- int8 weights, float32 rows (--quantize=int8): each weight sign-extended to int32 (8 a load), converted and multiplied
  in float32: the same sums as F.linear(x, weight.float()), in another order.
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
static void fetch_ahead(const int8_t* w, int64_t at, int64_t size) {
    if (at + AHEAD < size) _mm_prefetch((const char*)(w + at + AHEAD), _MM_HINT_T0);
}

static __m256 weights_at(const int8_t* w) {  // 8 int8 weights as float32
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)w)));
}

// y (M, N) = x (M, K) float32 times w (N, K) int8, transposed
extern "C" void float_rows(const float* x, const int8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t* wn = w + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float* xm = x + m * K;
            __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps(), c = _mm256_setzero_ps(), d = _mm256_setzero_ps();
            int64_t k = 0;
            for (; k + 32 <= K; k += 32) {  // four sums: the adds of one wait for none of the others
                fetch_ahead(w, n * K + k, N * K);
                a = _mm256_fmadd_ps(weights_at(wn + k), _mm256_loadu_ps(xm + k), a);
                b = _mm256_fmadd_ps(weights_at(wn + k + 8), _mm256_loadu_ps(xm + k + 8), b);
                c = _mm256_fmadd_ps(weights_at(wn + k + 16), _mm256_loadu_ps(xm + k + 16), c);
                d = _mm256_fmadd_ps(weights_at(wn + k + 24), _mm256_loadu_ps(xm + k + 24), d);
            }
            float sum = sum_of(_mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
            for (; k < K; k++) sum += xm[k] * wn[k];
            y[m * N + n] = sum;
        }
    }
}

// y (M, N) = x (M, K) int8 times w (N, K) int8, transposed: the exact int32 sums, as float32
extern "C" void int8_rows(const int8_t* x, const int8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
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
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


@functools.cache
def library(cache_dir):
    """The kernels, built on first use into the folder cache_dir() names (a file per source and flags, written
    whole), loaded once a process."""
    compiler = os.environ.get("CXX", "g++")  # inductor's choice of compiler too
    digest = hashlib.sha1(" ".join([SOURCE, compiler, *FLAGS]).encode()).hexdigest()[:12]
    folder = cache_dir()
    path = os.path.join(folder, f"int8_avx2_{digest}.so")
    if not os.path.exists(path):
        if not shutil.which(compiler):
            raise RuntimeError(f"the AVX2 int8 kernels are C++ built here, and there is no {compiler}")
        try:
            build(compiler, path)
        except OSError as e:  # an unwritable cache folder: no candidate (RuntimeError), not a failed run
            raise RuntimeError(f"cannot build the AVX2 int8 kernels in {folder} ({e.strerror})") from None
    lib = ctypes.CDLL(path)
    for kernel in (lib.float_rows, lib.int8_rows):
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
            raise RuntimeError(f"building the AVX2 int8 kernels failed: {result.stderr.strip()[-300:]}")
        os.replace(built, path)
    finally:
        for leftover in (source, built):
            if os.path.exists(leftover):
                os.remove(leftover)


def product(x, weight, cache_dir):
    """x (M, K) float32 or int8 times weight (N, K) int8, transposed: (M, N) float32 (library(cache_dir)'s)."""
    x, weight = x.contiguous(), weight.contiguous()  # each itself where it is already (a quantized layer's weight is)
    y = torch.empty(x.size(0), weight.size(0))
    kernels = library(cache_dir)
    (kernels.int8_rows if x.dtype == torch.int8 else kernels.float_rows)(x.data_ptr(), weight.data_ptr(), y.data_ptr(),
                                                                         x.size(0), *weight.shape)
    return y
