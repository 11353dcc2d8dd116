// The AMX tile configuration that _tile_loadconfig reads (palette 1), shared
// by the kernels and the benchmark's peak micro-kernel.
#pragma once

#include <cstdint>

namespace vllm_cpu_lora {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

}  // namespace vllm_cpu_lora
