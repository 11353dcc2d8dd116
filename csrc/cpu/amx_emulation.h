// Software emulation of the AMX tile intrinsics bgmv_amx.h uses, with AMX's
// arithmetic: each tdpbf16ps multiplies bf16 pairs exactly in fp32 and adds
// the two products to the fp32 accumulator one after the other, per element,
// in order of the pair index. (Hardware also flushes bf16 denormal inputs and
// fp32 denormal results; the tests use no denormals.) Tile state is per
// thread, like the real registers. Test-only: it is slow.
//
// Include in kernels_amx_emulated.cpp before bgmv_amx.h: it replaces
// <immintrin.h>'s real _tile_* macros.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernel_isa_namespace.h"

namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS {

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_release

struct EmulatedTiles {
  uint8_t rows[8];
  uint16_t colsb[8];
  alignas(64) uint8_t data[8][16][64];
};

inline thread_local EmulatedTiles emulated_tiles;

inline void EmuLoadConfig(const void* config) {
  const uint8_t* c = static_cast<const uint8_t*>(config);
  for (int t = 0; t < 8; ++t) {
    std::memcpy(&emulated_tiles.colsb[t], c + 16 + 2 * t, 2);
    emulated_tiles.rows[t] = c[48 + t];
  }
}

inline void EmuLoad(int t, const void* base, int64_t stride) {
  const uint8_t* p = static_cast<const uint8_t*>(base);
  std::memset(emulated_tiles.data[t], 0, sizeof(emulated_tiles.data[t]));
  for (int r = 0; r < emulated_tiles.rows[t]; ++r) {
    std::memcpy(emulated_tiles.data[t][r], p + r * stride,
                emulated_tiles.colsb[t]);
  }
}

inline void EmuStore(int t, void* base, int64_t stride) {
  uint8_t* p = static_cast<uint8_t*>(base);
  for (int r = 0; r < emulated_tiles.rows[t]; ++r) {
    std::memcpy(p + r * stride, emulated_tiles.data[t][r],
                emulated_tiles.colsb[t]);
  }
}

inline void EmuZero(int t) {
  std::memset(emulated_tiles.data[t], 0, sizeof(emulated_tiles.data[t]));
}

inline float EmuBf16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// C[m][n] += sum over pairs k of A[m][k].{lo,hi} * B[k][n].{lo,hi}.
inline void EmuDpbf16(int c, int a, int b) {
  const int rows = emulated_tiles.rows[c];
  const int cols = emulated_tiles.colsb[c] / 4;
  const int pairs = emulated_tiles.colsb[a] / 4;
  for (int m = 0; m < rows; ++m) {
    for (int n = 0; n < cols; ++n) {
      float acc;
      std::memcpy(&acc, &emulated_tiles.data[c][m][4 * n], 4);
      for (int k = 0; k < pairs; ++k) {
        const uint8_t* pa = &emulated_tiles.data[a][m][4 * k];
        const uint8_t* pb = &emulated_tiles.data[b][k][4 * n];
        acc += EmuBf16(pa) * EmuBf16(pb);
        acc += EmuBf16(pa + 2) * EmuBf16(pb + 2);
      }
      std::memcpy(&emulated_tiles.data[c][m][4 * n], &acc, 4);
    }
  }
}

#define _tile_loadconfig(config) EmuLoadConfig(config)
#define _tile_loadd(t, base, stride) EmuLoad(t, base, stride)
#define _tile_stored(t, base, stride) EmuStore(t, base, stride)
#define _tile_zero(t) EmuZero(t)
#define _tile_dpbf16ps(c, a, b) EmuDpbf16(c, a, b)
#define _tile_release() ((void)0)

}  // namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS
