// AMX kernel for bf16 weights (bf16 inputs, or fp32 inputs with bf16
// output, rounded to bf16 as in bgmv_impl.h), both blockings. Included inside
// the ISA namespace after vec_avx512.h and bgmv_impl.h, by kernels_amx.cpp
// (real tiles) and kernels_amx_emulated.cpp (amx_emulation.h).
//
// Per work item and block of 64 output columns, the weight rows are packed
// once into VNNI pairs (the layout LoraKernel::Pack already produces: pair
// row j holds (w[c][2j], w[c][2j+1]) for 64 columns c), which is exactly the
// B-tile layout. Tokens go 16 at a time: their rows are gathered (and rounded
// to bf16) into a contiguous A buffer; four C tiles accumulate 16 tokens x 64
// columns in fp32 over the whole reduction; the result is scaled, added and
// converted by the AVX-512 row store.
#pragma once

using AmxVec = VecAvx512<true>;

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

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

template <class TX, class TO>
struct AmxKernel {
  using Avx = LoraKernel<AmxVec, TX, c10::BFloat16, TO>;
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
      Avx::Pack(w + kc, row_stride, std::min(kMaxPackK, k - kc), nc,
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

  // Per work item: pack all of its columns (PairRows(k) x 64 per block of 64
  // columns), then per 16 tokens gather their inputs once and sweep along
  // the columns, so output rows are written front to back.
  template <KernelFn kFallback>
  static void Run(const LoraArgs& a, const WorkItem* items, int64_t begin,
                  int64_t end) {
    const int64_t pair_rows = PairRows(a.k);
    const int64_t block_size = pair_rows * kNT;
    std::unique_ptr<uint32_t[]> P;
    std::unique_ptr<uint16_t[]> X;
    int64_t packed_blocks = 0;
    alignas(64) float C[kTileRows * kNT];
    bool configured = false;
    const c10::BFloat16* w = static_cast<const c10::BFloat16*>(a.w);
    for (int64_t it = begin; it < end; ++it) {
      const WorkItem& item = items[it];
      const Group& g = a.groups[item.group];
      if (g.token_count < a.amx_min_tokens) {
        kFallback(a, items, it, it + 1);
        continue;
      }
      if (!configured) {
        X.reset(new uint16_t[kTileRows * 2 * pair_rows]);
        ConfigureTiles();
        configured = true;
      }
      const int64_t blocks = (item.n1 - item.n0 + kNT - 1) / kNT;
      if (blocks > packed_blocks) {
        P.reset(new uint32_t[blocks * block_size]);
        packed_blocks = blocks;
      }
      auto block_cols = [&](int64_t b) {
        return static_cast<int>(
            std::min<int64_t>(kNT, item.n1 - item.n0 - b * kNT));
      };
      const int64_t* tok = a.tokens + g.token_begin;
      const c10::BFloat16* wa = w + g.adapter * a.w_adapter_stride;
      for (int64_t b = 0; b < blocks; ++b) {
        PackAll(wa + (item.n0 + b * kNT) * a.w_row_stride, a.w_row_stride, a.k,
                block_cols(b), P.get() + b * block_size);
      }
      for (int64_t m = item.m0; m < item.m1; m += kTileRows) {
        const int mt =
            static_cast<int>(std::min<int64_t>(kTileRows, item.m1 - m));
        // Whole tiles of consecutive bf16 rows are read in place (sgmv,
        // prefill); anything else is gathered into X first.
        const uint16_t* A = X.get();
        int64_t a_stride = 2 * pair_rows * sizeof(uint16_t);
        if (std::is_same_v<TX, c10::BFloat16> && mt == kTileRows &&
            a.k % 32 == 0 && tok[m + kTileRows - 1] - tok[m] == kTileRows - 1) {
          A = static_cast<const uint16_t*>(a.x) + tok[m] * a.x_row_stride;
          a_stride = a.x_row_stride * sizeof(uint16_t);
        } else {
          GatherRows(a, tok + m, mt, 2 * pair_rows, X.get());
        }
        for (int64_t b = 0; b < blocks; ++b) {
          Tiles(a, tok + m, mt, item.n0 + b * kNT, block_cols(b),
                P.get() + b * block_size, A, a_stride, C);
        }
      }
    }
    if (configured) _tile_release();
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
    if constexpr (LoraKernel<AmxVec, TX, decltype(tw), TO>::kPairs) {
      AmxKernel<TX, TO>::template Run<kFallback>(a, items, begin, end);
      done = true;
    }
  });
  if (!done) kFallback(a, items, begin, end);
}

inline IsaKernels MakeAmxKernels() {
  constexpr KernelFn kDot = &RunDot<AmxVec>;
  constexpr KernelFn kPack = &RunPack<AmxVec>;
  return IsaKernels{&RunAmx<kDot, kPack, false>, &RunAmx<kDot, kPack, true>,
                    AmxVec::kTileM};
}
