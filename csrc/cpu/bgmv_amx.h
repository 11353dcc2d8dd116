// AMX kernel for bf16 weights (bf16 inputs, or fp32 inputs with bf16
// output, rounded to bf16 as in bgmv_impl.h), both blockings. Included by
// kernels_amx.cpp (real tiles) and kernels_amx_emulated.cpp (after
// amx_emulation.h, whose tiles then replace the real ones).
//
// Per work item and block of 64 output columns, the weight rows are packed
// once into VNNI pairs (the layout PackKernel::Pack already produces: pair
// row j holds (w[c][2j], w[c][2j+1]) for 64 columns c), which is exactly the
// B-tile layout. Tokens go 16 at a time: their rows are gathered (and rounded
// to bf16) into a contiguous A buffer; four C tiles accumulate 16 tokens x 64
// columns in fp32 over the whole reduction; the result is scaled, added and
// converted by the AVX-512 row store.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <type_traits>

#include "amx_tile_config.h"
#include "bgmv_impl.h"
#include "kernel_common.h"
#include "kernel_interface.h"
#include "kernel_pack.h"
#include "tuning.h"
#include "vec_avx512.h"

#include "kernel_isa_namespace.h"

namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS {

using AmxVec = VecAvx512<true>;

// Tiles 0-3: C (16 x 16 fp32); 4: A (16 tokens x 32 bf16); 5-6: B (16 pair
// rows x 16 columns). All 16 rows of 64 bytes.
inline void ConfigureTiles() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// The tiles with the operands swapped, for groups of a few tokens: the
// weight rows are the A operand, read in place (no repacking), and the
// group's token rows, interleaved into bf16 pairs ("zipped"), the B operand
// of P columns (the token count rounded up to a power of two). C then holds
// 16 outputs x P tokens and is transposed back in registers ("unzipped").
// The repacking this avoids costs per weight row, the zipping per token row:
// for a few tokens the tiles' throughput then serves both LoRA shrink (k =
// hidden size) and expand (k = rank). Needs even k (the pairs of a row).
template <class TX, class TO>
struct AmxSwapped {
  using Avx = PackKernel<AmxVec, TX, c10::BFloat16, TO>;
  using F = AmxVec::F;
  static constexpr int kTileRows = 16;
  static constexpr int64_t kZipSlots = 8;
  static constexpr int64_t kZipAhead = 6;

  static bool Applies(const LoraArgs& a) { return a.k % 2 == 0; }

  // Tiles 0 C (rows x p fp32), 1 A (rows x 32 bf16), 2 B (16 pair rows x
  // p), 3 and 4 A and B for the reduction's tail of `rest` < 32 elements;
  // Configure and ConfigureStreamed give tiles 5-7 their roles.
  static TileConfig BaseConfig(int rows, int p, int rest) {
    TileConfig cfg{};
    cfg.palette_id = 1;
    cfg.rows[0] = rows;
    cfg.colsb[0] = p * 4;
    cfg.rows[1] = rows;
    cfg.colsb[1] = 64;
    cfg.rows[2] = 16;
    cfg.colsb[2] = p * 4;
    if (rest > 0) {
      cfg.rows[3] = rows;
      cfg.colsb[3] = rest * 2;
      cfg.rows[4] = rest / 2;
      cfg.colsb[4] = p * 4;
    }
    return cfg;
  }

  // BaseConfig's tiles, and 5 and 6 B and A for a second 32-element block
  // kept beside the first; with a single block of k (`full` + (rest > 0) ==
  // 1), 6 and 7 are A and C of a second group of rows, so that two groups'
  // tile work overlaps.
  static void Configure(int rows, int p, int64_t full, int rest) {
    TileConfig cfg = BaseConfig(rows, p, rest);
    cfg.rows[5] = 16;
    cfg.colsb[5] = p * 4;
    cfg.rows[6] = rows;
    cfg.colsb[6] = full == 0 ? rest * 2 : 64;
    cfg.rows[7] = rows;
    cfg.colsb[7] = p * 4;
    _tile_loadconfig(&cfg);
  }

  // 32 elements of row x from e0 (fewer where the row ends) as 16 bf16
  // pair dwords, zero beyond the row.
  static __m512i LoadPairDwords(const TX* x, int64_t e0, int64_t k) {
    const int n = static_cast<int>(std::min<int64_t>(32, k - e0));
    return _mm512_castps_si512(
        (__m512)(n == 32 ? AmxVec::LoadPairs(x + e0)
                         : AmxVec::LoadPairsPartial(x + e0, n)));
  }

  // Bt[j * p + t] = bf16 pair j of token row t's 32 elements from e0 (zero
  // for t >= mt), j < 16: p vectors (one per token) go through log2(p)
  // stages of interleaving in registers.
  template <int p>
  static void ZipBlock(const LoraArgs& a, const int64_t* tok, int mt,
                       int64_t e0, uint32_t* Bt) {
    const TX* x = static_cast<const TX*>(a.x);
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5,
                                         21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28,
                                         13, 29, 14, 30, 15, 31);
    __m512i v[p], w[p];
    for (int t = 0; t < p; ++t) {
      v[t] = t < mt ? LoadPairDwords(x + tok[t] * a.x_row_stride, e0, a.k)
                    : _mm512_setzero_si512();
    }
    // log2(p) rounds of the same perfect shuffle.
    const int h = p / 2;
    for (int round = 1; round < p; round *= 2) {
      for (int i = 0; i < h; ++i) {
        w[2 * i] = _mm512_permutex2var_epi32(v[i], lo, v[i + h]);
        w[2 * i + 1] = _mm512_permutex2var_epi32(v[i], hi, v[i + h]);
      }
      for (int i = 0; i < p; ++i) v[i] = w[i];
    }
    for (int i = 0; i < p; ++i) _mm512_storeu_si512(Bt + i * 16, v[i]);
  }

  // The inverse of ZipBlock's interleaving on C (16 rows x p, row-major):
  // col[t] = column t.
  template <int p>
  static void Unzip(const float* C, F (&col)[p]) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18,
                                           20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21,
                                          23, 25, 27, 29, 31);
    F v[p], w[p];
    for (int i = 0; i < p; ++i) v[i] = _mm512_loadu_ps(C + 16 * i);
    const int h = p / 2;
    for (int round = 1; round < p; round *= 2) {
      for (int i = 0; i < h; ++i) {
        w[i] = _mm512_permutex2var_ps(v[2 * i], even, v[2 * i + 1]);
        w[i + h] = _mm512_permutex2var_ps(v[2 * i], odd, v[2 * i + 1]);
      }
      for (int i = 0; i < p; ++i) v[i] = w[i];
    }
    for (int i = 0; i < p; ++i) col[i] = v[i];
  }

  // Outputs [n, n + rows) of tokens tok[0..mt) from C (rows x p fp32).
  template <int p>
  static void StoreColumns(const LoraArgs& a, const float* C,
                           const int64_t* tok, int mt, int64_t n, int rows) {
    TO* out = static_cast<TO*>(a.out);
    F col[p];
    Unzip<p>(C, col);
    for (int t = 0; t < mt; ++t) {
      Avx::StoreVec(a, out + tok[t] * a.out_row_stride + n, col[t], rows);
    }
  }

  // How many equal groups of at most 16 rows RunStreamed splits `rows` into,
  // one C tile each; 0 where they do not split into at most four.
  static int StreamedGroups(int64_t rows) {
    const int64_t groups = (rows + kTileRows - 1) / kTileRows;
    return groups <= 4 && rows % groups == 0 ? static_cast<int>(groups) : 0;
  }

  // Tiles of RunStreamed: BaseConfig's, with 5, 6 and 7 C tiles like 0, one
  // for each of up to four groups of rows.
  static void ConfigureStreamed(int rows, int p, int rest) {
    TileConfig cfg = BaseConfig(rows, p, rest);
    for (int t : {5, 6, 7}) {
      cfg.rows[t] = rows;
      cfg.colsb[t] = p * 4;
    }
    _tile_loadconfig(&cfg);
  }

  // Tokens tok[0..mt), mt <= p, against the item's rows (`groups` groups of
  // StreamedGroups) over a reduction of more than two blocks (shrinks, and
  // expands of rank above 64 into at most 64 columns): each block of 32
  // elements is zipped kZipAhead blocks before its products, into a ring of
  // kZipSlots blocks that stays in L1, so that zipping overlaps the tiles'
  // work instead of preceding all of it (#amx-zip-ahead).
  template <int p>
  static void RunStreamed(const LoraArgs& a, const WorkItem& item,
                          const c10::BFloat16* wa, const int64_t* tok, int mt,
                          int groups, uint32_t* Bt) {
    const int64_t full = a.k / 32;
    const int rest = static_cast<int>(a.k % 32);
    const int64_t blocks = full + (rest > 0);
    const int rows = static_cast<int>((item.n1 - item.n0) / groups);
    const int64_t w_stride = a.w_row_stride * 2;
    const int64_t group_stride = rows * a.w_row_stride;
    const c10::BFloat16* wn = wa + item.n0 * a.w_row_stride;
    auto slot = [&](int64_t b) { return Bt + b % kZipSlots * 16 * p; };
    ConfigureStreamed(rows, p, rest);
    _tile_zero(0);
    if (groups > 1) _tile_zero(5);
    if (groups > 2) _tile_zero(6);
    if (groups > 3) _tile_zero(7);
    for (int64_t b = 0; b < std::min(kZipAhead, blocks); ++b)
      ZipBlock<p>(a, tok, mt, 32 * b, slot(b));
    for (int64_t b = 0; b < full; ++b) {
      if (b + kZipAhead < blocks)
        ZipBlock<p>(a, tok, mt, 32 * (b + kZipAhead), slot(b + kZipAhead));
      const c10::BFloat16* wb = wn + 32 * b;
      _tile_loadd(2, slot(b), p * 4);
      _tile_loadd(1, wb, w_stride);
      _tile_dpbf16ps(0, 1, 2);
      if (groups > 1) {
        _tile_loadd(1, wb + group_stride, w_stride);
        _tile_dpbf16ps(5, 1, 2);
      }
      if (groups > 2) {
        _tile_loadd(1, wb + 2 * group_stride, w_stride);
        _tile_dpbf16ps(6, 1, 2);
      }
      if (groups > 3) {
        _tile_loadd(1, wb + 3 * group_stride, w_stride);
        _tile_dpbf16ps(7, 1, 2);
      }
    }
    // The tail repeats the products above with tiles 3 and 4: GCC's tile
    // intrinsics paste their tile numbers into the assembly as written, so
    // no template or variable can choose them.
    if (rest > 0) {
      const c10::BFloat16* wb = wn + 32 * full;
      _tile_loadd(4, slot(full), p * 4);
      _tile_loadd(3, wb, w_stride);
      _tile_dpbf16ps(0, 3, 4);
      if (groups > 1) {
        _tile_loadd(3, wb + group_stride, w_stride);
        _tile_dpbf16ps(5, 3, 4);
      }
      if (groups > 2) {
        _tile_loadd(3, wb + 2 * group_stride, w_stride);
        _tile_dpbf16ps(6, 3, 4);
      }
      if (groups > 3) {
        _tile_loadd(3, wb + 3 * group_stride, w_stride);
        _tile_dpbf16ps(7, 3, 4);
      }
    }
    alignas(64) float C[kTileRows * p];
    _tile_stored(0, C, p * 4);
    StoreColumns<p>(a, C, tok, mt, item.n0, rows);
    if (groups > 1) {
      _tile_stored(5, C, p * 4);
      StoreColumns<p>(a, C, tok, mt, item.n0 + rows, rows);
    }
    if (groups > 2) {
      _tile_stored(6, C, p * 4);
      StoreColumns<p>(a, C, tok, mt, item.n0 + 2 * rows, rows);
    }
    if (groups > 3) {
      _tile_stored(7, C, p * 4);
      StoreColumns<p>(a, C, tok, mt, item.n0 + 3 * rows, rows);
    }
  }

  // Tokens tok[0..mt), mt <= p, against the item's weight rows, 16 at a
  // time. With at most two 32-element blocks of k (expand) the B tiles stay
  // loaded across the rows.
  template <int p>
  static void RunTokens(const LoraArgs& a, const WorkItem& item,
                        const c10::BFloat16* wa, const int64_t* tok, int mt,
                        uint32_t* Bt) {
    const int64_t full = a.k / 32;
    const int rest = static_cast<int>(a.k % 32);
    const bool resident = full + (rest > 0) <= 2;
    const int64_t w_stride = a.w_row_stride * 2;
    const int64_t blocks = full + (rest > 0);
    alignas(64) float C[2 * kTileRows * p];
    int configured_rows = 0;
    auto configure = [&](int rows) {
      if (rows == configured_rows) return;
      Configure(rows, p, full, rest);  // Clears the tiles.
      configured_rows = rows;
      if (resident) {
        if (full >= 1) _tile_loadd(2, Bt, p * 4);
        if (full == 2) _tile_loadd(5, Bt + 16 * p, p * 4);
        if (rest > 0) _tile_loadd(4, Bt + full * 16 * p, p * 4);
      }
    };
    auto store = [&](const float* c, int64_t n, int rows) {
      StoreColumns<p>(a, c, tok, mt, n, rows);
    };
    for (int64_t b = 0; b < blocks; ++b)
      ZipBlock<p>(a, tok, mt, 32 * b, Bt + b * 16 * p);
    int64_t n = item.n0;
    if (full + (rest > 0) == 1) {
      // Two groups of 16 rows at a time (C tiles 0 and 7).
      for (; n + 2 * kTileRows <= item.n1; n += 2 * kTileRows) {
        configure(kTileRows);
        const c10::BFloat16* wn = wa + n * a.w_row_stride;
        const c10::BFloat16* wn2 = wn + kTileRows * a.w_row_stride;
        _tile_zero(0);
        _tile_zero(7);
        if (full == 1) {
          _tile_loadd(1, wn, w_stride);
          _tile_loadd(6, wn2, w_stride);
          _tile_dpbf16ps(0, 1, 2);
          _tile_dpbf16ps(7, 6, 2);
        } else {
          _tile_loadd(3, wn, w_stride);
          _tile_loadd(6, wn2, w_stride);
          _tile_dpbf16ps(0, 3, 4);
          _tile_dpbf16ps(7, 6, 4);
        }
        _tile_stored(0, C, p * 4);
        _tile_stored(7, C + kTileRows * p, p * 4);
        store(C, n, kTileRows);
        store(C + kTileRows * p, n + kTileRows, kTileRows);
      }
    }
    for (; n < item.n1; n += kTileRows) {
      const int rows =
          static_cast<int>(std::min<int64_t>(kTileRows, item.n1 - n));
      configure(rows);
      const c10::BFloat16* wn = wa + n * a.w_row_stride;
      _tile_zero(0);
      if (resident) {
        if (full >= 1) {
          _tile_loadd(1, wn, w_stride);
          _tile_dpbf16ps(0, 1, 2);
        }
        if (full == 2) {
          _tile_loadd(6, wn + 32, w_stride);
          _tile_dpbf16ps(0, 6, 5);
        }
      } else {
        for (int64_t c = 0; c < full; ++c) {
          _tile_loadd(1, wn + 32 * c, w_stride);
          _tile_loadd(2, Bt + c * 16 * p, p * 4);
          _tile_dpbf16ps(0, 1, 2);
        }
        if (rest > 0) _tile_loadd(4, Bt + full * 16 * p, p * 4);
      }
      if (rest > 0) {
        _tile_loadd(3, wn + 32 * full, w_stride);
        _tile_dpbf16ps(0, 3, 4);
      }
      _tile_stored(0, C, p * 4);
      store(C, n, rows);
    }
  }

  // One work item: its tokens, up to 16 at a time.
  static void RunItem(const LoraArgs& a, const WorkItem& item,
                      AlignedArray<uint32_t>& bt, int64_t& bt_size) {
    const Group& g = a.groups[item.group];
    const int64_t* tok = a.tokens + g.token_begin;
    const c10::BFloat16* wa =
        static_cast<const c10::BFloat16*>(a.w) + g.adapter * a.w_adapter_stride;
    const int64_t blocks = (a.k + 31) / 32;
    const int groups = blocks > 2 ? StreamedGroups(item.n1 - item.n0) : 0;
    const int64_t zipped_blocks = groups > 0 ? kZipSlots : blocks;
    // Zipped blocks that fit the ring go on the stack: a heap buffer per
    // call cost more than a short call's tiles (#amx-zip-ahead).
    alignas(64) uint32_t ring[kZipSlots * 16 * kTileRows];
    uint32_t* zipped = ring;
    if (zipped_blocks > kZipSlots) {
      if (zipped_blocks * 16 * kTileRows > bt_size) {
        bt_size = zipped_blocks * 16 * kTileRows;
        bt = NewAligned<uint32_t>(bt_size);
      }
      zipped = bt.get();
    }
    for (int64_t m = item.m0; m < item.m1; m += kTileRows) {
      const int mt =
          static_cast<int>(std::min<int64_t>(kTileRows, item.m1 - m));
      const int64_t* tm = tok + m;
      auto run = [&](auto p) {
        if (groups > 0) {
          RunStreamed<decltype(p)::value>(a, item, wa, tm, mt, groups, zipped);
        } else {
          RunTokens<decltype(p)::value>(a, item, wa, tm, mt, zipped);
        }
      };
      if (mt == 1) {
        run(std::integral_constant<int, 1>{});
      } else if (mt == 2) {
        run(std::integral_constant<int, 2>{});
      } else if (mt <= 4) {
        run(std::integral_constant<int, 4>{});
      } else if (mt <= 8) {
        run(std::integral_constant<int, 8>{});
      } else {
        run(std::integral_constant<int, 16>{});
      }
    }
  }
};

template <class TX, class TO>
struct AmxKernel {
  using Avx = PackKernel<AmxVec, TX, c10::BFloat16, TO>;
  using F = AmxVec::F;
  static constexpr int kNT = Avx::kNT;  // 64 columns: four C tiles.
  static_assert(kNT == 64);
  static constexpr int kTileRows = 16;

  // Pair rows of the reduction, padded to whole tiles.
  static int64_t PairRows(int64_t k) { return (k + 31) / 32 * 16; }

  // Packs weight rows [0, nc) x the whole reduction into P (PairRows(k) x 64
  // dwords), zero padded to whole tiles (columns past nc rounded up to 16 are
  // never read).
  static void PackAll(const c10::BFloat16* w, int64_t row_stride, int64_t k,
                      int nc, uint32_t* P) {
    for (int64_t kc = 0; kc < k; kc += kMaxPackK) {
      Avx::Pack(w + kc, row_stride, std::min(kMaxPackK, k - kc), nc, kNT,
                P + kc / 2 * kNT);
    }
    const int64_t used = (k + 1) / 2;
    std::memset(P + used * kNT, 0, (PairRows(k) - used) * kNT * 4);
  }

  // X row i = x[tok[i]] as bf16, zero padded to `width`; rows >= mt zero.
  static void GatherRows(const LoraArgs& a, const int64_t* tok, int mt,
                         int64_t width, uint16_t* X) {
    const TX* x = static_cast<const TX*>(a.x);
    for (int i = 0; i < kTileRows; ++i) {
      uint16_t* dst = X + i * width;
      int64_t j = 0;
      if (i < mt) {
        const TX* src = x + tok[i] * a.x_row_stride;
        if constexpr (std::is_same_v<TX, c10::BFloat16>) {
          std::memcpy(dst, src, a.k * sizeof(uint16_t));
          j = a.k;
        } else {
          for (; j + 16 <= a.k; j += 16) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                                AmxVec::ToBf16(AmxVec::Load(src + j)));
          }
          for (; j < a.k; ++j) dst[j] = Bf16Bits(src[j]);
        }
      }
      std::memset(dst + j, 0, (width - j) * sizeof(uint16_t));
    }
  }

  // Tokens tok[0..mt) (A: 16 rows of a_stride bytes) times the packed
  // columns [n, n + nc).
  static void Tiles(const LoraArgs& a, const int64_t* tok, int mt, int64_t n,
                    int nc, const uint32_t* P, const uint16_t* A,
                    int64_t a_stride, float* C) {
    const int64_t pair_rows = PairRows(a.k);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int nv = (nc + 15) / 16;
    constexpr int kBStride = kNT * 4;
    for (int64_t j = 0; j < pair_rows; j += 16) {
      _tile_loadd(4, A + 2 * j, a_stride);
      const uint32_t* b = P + j * kNT;
      _tile_loadd(5, b, kBStride);
      _tile_dpbf16ps(0, 4, 5);
      if (nv > 1) {
        _tile_loadd(6, b + 16, kBStride);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (nv > 2) {
        _tile_loadd(5, b + 32, kBStride);
        _tile_dpbf16ps(2, 4, 5);
      }
      if (nv > 3) {
        _tile_loadd(6, b + 48, kBStride);
        _tile_dpbf16ps(3, 4, 6);
      }
    }
    _tile_stored(0, C, kNT * 4);
    _tile_stored(1, C + 16, kNT * 4);
    _tile_stored(2, C + 32, kNT * 4);
    _tile_stored(3, C + 48, kNT * 4);
    TO* out = static_cast<TO*>(a.out);
    for (int i = 0; i < mt; ++i) {
      F acc[Avx::kNV];
      for (int v = 0; v < Avx::kNV; ++v)
        acc[v] = AmxVec::Load(C + i * kNT + v * 16);
      Avx::StoreRow(a, out + tok[i] * a.out_row_stride + n, acc, nc);
    }
  }

  // Whether input rows tok[0..count) (ascending) can be read in place as A
  // tiles: consecutive rows of bf16 in whole 32-element blocks (sgmv,
  // prefill, a decode batch on one adapter).
  static bool RowsInPlace(const LoraArgs& a, const int64_t* tok,
                          int64_t count) {
    return std::is_same_v<TX, c10::BFloat16> && a.k % 32 == 0 &&
           tok[count - 1] - tok[0] == count - 1;
  }

  // Per work item: pack all of its columns (PairRows(k) x 64 per block of 64
  // columns; kept for the next item of the same columns), then per 16
  // tokens gather their inputs once and sweep along the columns, so output
  // rows are written front to back.
  template <KernelFn kFallback, bool kPackStrategy>
  static void Run(const LoraArgs& a, const WorkItem* items, int64_t begin,
                  int64_t end) {
    using Swapped = AmxSwapped<TX, TO>;
    AlignedArray<uint32_t> bt;
    int64_t bt_size = 0;
    const int64_t pair_rows = PairRows(a.k);
    const int64_t block_size = pair_rows * kNT;
    PackedBlocks<uint32_t> P;
    AlignedArray<uint16_t> X;
    alignas(64) float C[kTileRows * kNT];
    bool configured = false;
    bool used_tiles = false;
    const c10::BFloat16* w = static_cast<const c10::BFloat16*>(a.w);
    // Items for the AVX512-BF16 kernel go to it in runs [fallback, it): its
    // per-call set-up (buffers, converted inputs) is then paid once per run.
    int64_t fallback = begin;
    auto flush = [&](int64_t it) {
      if (fallback < it) kFallback(a, items, fallback, it);
      fallback = it + 1;
    };
    for (int64_t it = begin; it < end; ++it) {
      const WorkItem& item = items[it];
      const Group& g = a.groups[item.group];
      const int64_t rank = kPackStrategy ? a.k : item.n1 - item.n0;
      const int64_t* tok = a.tokens + g.token_begin;
      if (g.token_count < AmxMinTokens(kPackStrategy, rank,
                                       RowsInPlace(a, tok, g.token_count))) {
        if (Swapped::Applies(a) &&
            (a.amx_forced ||
             g.token_count >=
                 AmxSwapMinTokens(a.k, item.n1 - item.n0, kPackStrategy))) {
          flush(it);
          Swapped::RunItem(a, item, bt, bt_size);
          used_tiles = true;
          configured = false;  // The swapped tiles have their own shapes.
        }
        continue;
      }
      flush(it);
      if (!configured) {
        if (!X) X = NewAligned<uint16_t>(kTileRows * 2 * pair_rows);
        ConfigureTiles();
        configured = true;
        used_tiles = true;
      }
      const int64_t blocks = (item.n1 - item.n0 + kNT - 1) / kNT;
      auto block_cols = [&](int64_t b) {
        return static_cast<int>(
            std::min<int64_t>(kNT, item.n1 - item.n0 - b * kNT));
      };
      const c10::BFloat16* wa = w + g.adapter * a.w_adapter_stride;
      if (P.NeedsPacking(wa, item.n0, item.n1, blocks * block_size)) {
        for (int64_t b = 0; b < blocks; ++b) {
          PackAll(wa + (item.n0 + b * kNT) * a.w_row_stride, a.w_row_stride,
                  a.k, block_cols(b), P.data() + b * block_size);
        }
      }
      for (int64_t m = item.m0; m < item.m1; m += kTileRows) {
        const int mt =
            static_cast<int>(std::min<int64_t>(kTileRows, item.m1 - m));
        // Whole tiles are read in place where they can be; anything else is
        // gathered into X first.
        const uint16_t* A = X.get();
        int64_t a_stride = 2 * pair_rows * sizeof(uint16_t);
        if (mt == kTileRows && RowsInPlace(a, tok + m, kTileRows)) {
          A = static_cast<const uint16_t*>(a.x) + tok[m] * a.x_row_stride;
          a_stride = a.x_row_stride * sizeof(uint16_t);
        } else {
          GatherRows(a, tok + m, mt, 2 * pair_rows, X.get());
        }
        for (int64_t b = 0; b < blocks; ++b) {
          Tiles(a, tok + m, mt, item.n0 + b * kNT, block_cols(b),
                P.data() + b * block_size, A, a_stride, C);
        }
      }
    }
    flush(end);
    if (used_tiles) _tile_release();
  }
};

// bf16 weights with bf16 inputs, or fp32 inputs and bf16 output, go through
// the tiles; every other type combination is the AVX512-BF16 kernel's.
template <KernelFn kAvxDot, KernelFn kAvxPack, bool kPack>
void RunAmx(const LoraArgs& a, const WorkItem* items, int64_t begin,
            int64_t end) {
  constexpr KernelFn kFallback = kPack ? kAvxPack : kAvxDot;
  bool done = false;
  WithTypes(a, [&](auto tx, auto tw, auto to) {
    using TX = decltype(tx);
    using TO = decltype(to);
    if constexpr (PackKernel<AmxVec, TX, decltype(tw), TO>::kPairs) {
      AmxKernel<TX, TO>::template Run<kFallback, kPack>(a, items, begin, end);
      done = true;
    }
  });
  if (!done) kFallback(a, items, begin, end);
}

inline IsaKernels MakeAmxKernels() {
  constexpr KernelFn kDot = &RunDot<AmxVec>;
  constexpr KernelFn kPack = &RunPack<AmxVec>;
  // Not measured with AMX tiles, which need 32 tokens: the general rule.
  return IsaKernels{&RunAmx<kDot, kPack, false>, &RunAmx<kDot, kPack, true>,
                    true, kSplitTokensPerThread};
}

}  // namespace vllm_cpu_lora::VLLM_CPU_LORA_ISA_NS
