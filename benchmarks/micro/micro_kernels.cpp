// Micro-kernels that measure this machine's limits for the kernel
// benchmark's bound (benchmarks/machine.py compiles this file at run time):
// read bandwidth and compute peaks, one thread or many. Each loop is built
// for one instruction set with __attribute__((target(...))); Python picks
// the variant from the CPU's flags (`isa` "avx512" or "avx2"), so the file
// compiles and runs on any x86-64 CPU and never runs an instruction the CPU
// lacks.
#include <ATen/cpu/Utils.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <omp.h>
#include <torch/extension.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "amx_tile_config.h"

namespace {

volatile int64_t g_isink = 0;
volatile float g_fsink = 0.0f;

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Sums `bytes` (a multiple of 512) at p, `reps` times, with 8 independent
// 512-bit integer accumulators.
__attribute__((target("avx512f"))) int64_t ReadSumAvx512(const char* p,
                                                         int64_t bytes,
                                                         int64_t reps) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  __m512i a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t r = 0; r < reps; ++r) {
    const char* q = p;
    asm volatile("" : "+r"(q));  // The compiler may not fold repetitions.
    for (int64_t i = 0; i + 512 <= bytes; i += 512) {
      a0 = _mm512_add_epi32(a0, _mm512_loadu_si512(q + i));
      a1 = _mm512_add_epi32(a1, _mm512_loadu_si512(q + i + 64));
      a2 = _mm512_add_epi32(a2, _mm512_loadu_si512(q + i + 128));
      a3 = _mm512_add_epi32(a3, _mm512_loadu_si512(q + i + 192));
      a4 = _mm512_add_epi32(a4, _mm512_loadu_si512(q + i + 256));
      a5 = _mm512_add_epi32(a5, _mm512_loadu_si512(q + i + 320));
      a6 = _mm512_add_epi32(a6, _mm512_loadu_si512(q + i + 384));
      a7 = _mm512_add_epi32(a7, _mm512_loadu_si512(q + i + 448));
    }
  }
  a0 = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
  a4 = _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a4));
}

// The same with 256-bit loads: 8 independent accumulators, 256 bytes a step.
__attribute__((target("avx2"))) int64_t ReadSumAvx2(const char* p,
                                                    int64_t bytes,
                                                    int64_t reps) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  __m256i a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t r = 0; r < reps; ++r) {
    const char* q = p;
    asm volatile("" : "+r"(q));  // The compiler may not fold repetitions.
    for (int64_t i = 0; i + 256 <= bytes; i += 256) {
      const auto* v = reinterpret_cast<const __m256i*>(q + i);
      a0 = _mm256_add_epi32(a0, _mm256_loadu_si256(v));
      a1 = _mm256_add_epi32(a1, _mm256_loadu_si256(v + 1));
      a2 = _mm256_add_epi32(a2, _mm256_loadu_si256(v + 2));
      a3 = _mm256_add_epi32(a3, _mm256_loadu_si256(v + 3));
      a4 = _mm256_add_epi32(a4, _mm256_loadu_si256(v + 4));
      a5 = _mm256_add_epi32(a5, _mm256_loadu_si256(v + 5));
      a6 = _mm256_add_epi32(a6, _mm256_loadu_si256(v + 6));
      a7 = _mm256_add_epi32(a7, _mm256_loadu_si256(v + 7));
    }
  }
  a0 = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
  a4 = _mm256_add_epi32(_mm256_add_epi32(a4, a5), _mm256_add_epi32(a6, a7));
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                     _mm256_add_epi32(a0, a4));
  int64_t sum = 0;
  for (int32_t lane : lanes) sum += lane;
  return sum;
}

// Independent accumulators: more than latency x ports. AVX-512 has 32
// vector registers; AVX2 has 16, so it keeps 12 (FMA latency 4-5 cycles on
// 2 ports needs 8-10) and two operands without spilling.
constexpr int kAcc = 24;
constexpr int kAccAvx2 = 12;

__attribute__((target("avx512f,avx512bf16"))) float DpBf16Loop(int64_t iters,
                                                               float seed) {
  __m512 acc[kAcc];
  for (int j = 0; j < kAcc; ++j) acc[j] = _mm512_set1_ps(seed * j);
  const __m512 fa = _mm512_set1_ps(seed), fb = _mm512_set1_ps(0.5f * seed);
  __m512bh a = _mm512_cvtne2ps_pbh(fa, fa);
  __m512bh b = _mm512_cvtne2ps_pbh(fb, fb);
  // The loop may not move across the caller's clock reads: its inputs come
  // out of, and its results go into, opaque statements with a memory clobber.
  asm volatile("" : "+v"(a), "+v"(b)::"memory");
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 24
    for (int j = 0; j < kAcc; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
  }
  __m512 s = acc[0];
  asm volatile("" : "+v"(s)::"memory");
  for (int j = 1; j < kAcc; ++j) s = _mm512_add_ps(s, acc[j]);
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx512f"))) float FmaLoopAvx512(int64_t iters,
                                                       float seed) {
  __m512 acc[kAcc];
  for (int j = 0; j < kAcc; ++j) acc[j] = _mm512_set1_ps(seed * j);
  __m512 a = _mm512_set1_ps(seed), b = _mm512_set1_ps(0.5f * seed);
  asm volatile("" : "+v"(a), "+v"(b)::"memory");
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 24
    for (int j = 0; j < kAcc; ++j) acc[j] = _mm512_fmadd_ps(a, b, acc[j]);
  }
  __m512 s = acc[0];
  asm volatile("" : "+v"(s)::"memory");
  for (int j = 1; j < kAcc; ++j) s = _mm512_add_ps(s, acc[j]);
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx2,fma"))) float FmaLoopAvx2(int64_t iters,
                                                      float seed) {
  __m256 acc[kAccAvx2];
  for (int j = 0; j < kAccAvx2; ++j) acc[j] = _mm256_set1_ps(seed * j);
  __m256 a = _mm256_set1_ps(seed), b = _mm256_set1_ps(0.5f * seed);
  asm volatile("" : "+x"(a), "+x"(b)::"memory");
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < kAccAvx2; ++j) acc[j] = _mm256_fmadd_ps(a, b, acc[j]);
  }
  __m256 s = acc[0];
  asm volatile("" : "+x"(s)::"memory");
  for (int j = 1; j < kAccAvx2; ++j) s = _mm256_add_ps(s, acc[j]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, s);
  float sum = 0.0f;
  for (float lane : lanes) sum += lane;
  return sum;
}

// Four independent C tiles (16 x 16 fp32) fed by two A and two B tiles
// (16 rows x 64 bytes): each tdpbf16ps is 16 x 16 x 32 x 2 = 16384 flops.
__attribute__((target("amx-tile,amx-bf16"))) float AmxLoop(int64_t iters,
                                                           float seed) {
  vllm_cpu_lora::TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t in[16 * 32];
  const c10::BFloat16 v(seed);
  for (int i = 0; i < 16 * 32; ++i) in[i] = v.x;
  alignas(64) float res[16 * 16];
  _tile_loadd(4, in, 64);
  _tile_loadd(5, in, 64);
  _tile_loadd(6, in, 64);
  _tile_loadd(7, in, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  float sum = 0.0f;
  _tile_stored(0, res, 64);
  sum += res[0];
  _tile_stored(3, res, 64);
  sum += res[255];
  _tile_release();
  return sum;
}

// Runs body(thread id), which returns a value to keep alive, on `threads`
// threads. Timed from a barrier after every thread has started to one after
// all finished, so a late thread start (a busy machine) is not counted.
struct Timed {
  double seconds;
  int threads;
  double sink;
};

template <class Body>
Timed TimedParallel(int64_t threads, Body body) {
  double sink = 0.0;
  int used = 1;
  double t0 = 0.0, t1 = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
#pragma omp barrier
#pragma omp master
    t0 = Now();
    const int tid = omp_get_thread_num();
    if (tid == 0) used = omp_get_num_threads();
    sink += static_cast<double>(body(tid));
#pragma omp barrier
#pragma omp master
    t1 = Now();
  }
  return Timed{t1 - t0, used, sink};
}

bool IsAvx512(const std::string& isa) {
  TORCH_CHECK(isa == "avx512" || isa == "avx2",
              "isa must be avx512 or avx2, got ", isa);
  return isa == "avx512";
}

}  // namespace

// FLOP/s of `threads` threads each running `iters` x 4 tdpbf16ps; 0 when
// the OS does not grant AMX tile state.
double amx_bf16_peak(int64_t iters, int64_t threads, double seed) {
  if (!at::cpu::init_amx()) return 0.0;
  const Timed r = TimedParallel(
      threads, [&](int) { return AmxLoop(iters, static_cast<float>(seed)); });
  g_fsink = static_cast<float>(r.sink);
  return 16384.0 * 4 * iters * r.threads / r.seconds;
}

// Bytes per second read from `buf` by `threads` threads, each summing its own
// slice `reps` times with `isa`'s vector loads.
double read_bandwidth(torch::Tensor buf, int64_t reps, int64_t threads,
                      const std::string& isa) {
  const bool avx512 = IsAvx512(isa);
  const char* p = static_cast<const char*>(buf.data_ptr());
  const int64_t bytes = buf.numel() * buf.element_size();
  const int64_t slice = bytes / threads / 512 * 512;
  const Timed r = TimedParallel(threads, [&](int tid) {
    return avx512 ? ReadSumAvx512(p + tid * slice, slice, reps)
                  : ReadSumAvx2(p + tid * slice, slice, reps);
  });
  g_isink = static_cast<int64_t>(r.sink);
  return static_cast<double>(slice) * r.threads * reps / r.seconds;
}

// FLOP/s of `threads` threads each running `iters` x kAcc vdpbf16ps
// (64 flops each: 16 lanes x 2 products x multiply-add).
double bf16_dot_peak(int64_t iters, int64_t threads, double seed) {
  const Timed r = TimedParallel(threads, [&](int) {
    return DpBf16Loop(iters, static_cast<float>(seed));
  });
  g_fsink = static_cast<float>(r.sink);
  return 64.0 * kAcc * iters * r.threads / r.seconds;
}

// FLOP/s of `threads` threads each running `iters` x kAcc vfmadd231ps:
// 32 flops each on zmm registers (avx512), 16 on ymm (avx2, kAccAvx2 of
// them).
double fp32_fma_peak(int64_t iters, int64_t threads, double seed,
                     const std::string& isa) {
  const bool avx512 = IsAvx512(isa);
  const Timed r = TimedParallel(threads, [&](int) {
    const float s = static_cast<float>(seed);
    return avx512 ? FmaLoopAvx512(iters, s) : FmaLoopAvx2(iters, s);
  });
  g_fsink = static_cast<float>(r.sink);
  const double per_iter = avx512 ? 32.0 * kAcc : 16.0 * kAccAvx2;
  return per_iter * iters * r.threads / r.seconds;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("read_bandwidth", &read_bandwidth, "read bytes/s");
  m.def("bf16_dot_peak", &bf16_dot_peak, "vdpbf16ps flop/s");
  m.def("fp32_fma_peak", &fp32_fma_peak, "vfmadd231ps flop/s");
  m.def("amx_bf16_peak", &amx_bf16_peak, "tdpbf16ps flop/s (0: no AMX)");
}
