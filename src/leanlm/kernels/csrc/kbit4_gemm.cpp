// Weight-only 4-bit linear for x86 CPUs: y = x @ W^T, W given as packed 4-bit codes (two per byte, the first code
// in the high nibble), one float absmax per block of `block` consecutive weights of a row, and a 16-entry code
// book (NF4, FP4, int4, ...). W is never materialised in float32 for small M: codes are decoded into registers
// and multiplied into every row of x, so the memory traffic is the packed weights (4 bits) plus the constants;
// that is the point at batch-1 decode, which is memory-bound.
//
// The decode is the cost that remains, and it is shuffle-bound, so the small-M kernels never put codes back in
// order. Loaded as 32-bit lanes, packed bytes hold 8 codes per lane, and shifting the lanes right by 4j leaves
// nibble j of every lane in its low bits, which is all a register table lookup (vpermps) reads. Lane d's nibble j
// is code 8d + (j ^ 1) of the chunk (little-endian lanes, high nibble first). The dot product does not care about
// order, so x is permuted once per call into that order (`permute_x`) instead of W on every row:
//   AVX-512: one vpermps over a 16-entry table decodes 16 weights; chunks of 128 codes (and a 64 tail);
//   AVX2:    8-entry tables, so two vpermps and a blend decode 8 weights; chunks of 64 codes.
// The block scale is per lane (a lane's 8 codes always share a block: blocks are multiples of 16), applied to a
// per-chunk partial sum; it is a broadcast (or two) wherever blocks allow, because a gather per chunk cost as
// much as the decode. Rows whose length is not a multiple of 64 use `gemv_rows_in_order`, which decodes codes
// in order (the older, slower AVX2 path). The AVX-512 kernel is chosen at run time (`cpu_has_avx512`); the
// file is compiled for AVX2, with only the AVX-512 namespace under a target pragma.
//
// Threads: at::parallel_for splits output rows; it is OpenMP in ATen's headers, so the extension must be built
// with -fopenmp or every call runs on one thread (it did, until the speed benchmark showed 2 cores = 1).
//
// `dequantize_rows` decodes a range of output rows (3-, 4- or 8-bit codes) into a float32 or bfloat16 tile, in
// order, for the large-M path (decode a tile, then an ordinary GEMM) that Python drives.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// The block constants of W, one per block of a row: float32, or as double quantization (QLoRA) stores them:
// 8-bit codes into a 256-entry table, one float32 scale per `group` codes and one offset. Those are decoded a row
// at a time into a small scratch buffer (in_features / block floats), so no float32 copy of every constant (half
// a bit per weight at blocks of 64) is kept beside the quantized ones.
struct BlockConstants {
  const float* direct = nullptr;
  const uint8_t* codes = nullptr;
  const float* code_values = nullptr;
  const float* scales = nullptr;
  float offset = 0.0f;
  int64_t group = 256;
  int64_t per_row = 0;

  // The constants of output row n: the float32 array's own, or decoded into `scratch`.
  const float* row(int64_t n, float* scratch) const {
    if (direct != nullptr) return direct + n * per_row;
    // The group index is stepped, not divided for: a 64-bit division per block cost more than the row's
    // dot product (the int8 kernel ran at half speed with double-quantized constants).
    int64_t i = n * per_row, g = i / group, group_end = (g + 1) * group;
    for (int64_t b = 0; b < per_row; ++b, ++i) {
      if (i == group_end) ++g, group_end += group;
      scratch[b] = decoded(i, g);
    }
    return scratch;
  }

  // Double-quantized block i of group g. Rounded after the product and after the sum, as the reference computes
  // it: the file is built with -ffp-contract=off, so no fused multiply-add is formed here (explicit _fmadd_
  // intrinsics still are). Every scalar decode goes through here; `eight` is its vector twin.
  float decoded(int64_t i, int64_t g) const { return code_values[codes[i]] * scales[g] + offset; }

  // Block b's constant (any block, in isolation: a division for the group).
  float value(int64_t b) const { return direct != nullptr ? direct[b] : decoded(b, b / group); }

  // The constants of the 8 consecutive blocks from b, rounded as `row` rounds them: a load, or (double
  // quantization) a gather from the 256-entry table and a blend across a group boundary (see EightChunkScales).
  __m256 eight(int64_t b) const {
    if (direct != nullptr) return _mm256_loadu_ps(direct + b);
    if (group < 8) {
      alignas(32) float out[8];
      for (int j = 0; j < 8; ++j) out[j] = value(b + j);
      return _mm256_load_ps(out);
    }
    const __m256i lanes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + b)));
    const __m256 decoded = _mm256_i32gather_ps(code_values, lanes, 4);
    const int64_t g = b / group, boundary = (g + 1) * group - b;  // lanes from `boundary` on are in group g + 1
    __m256 scale = _mm256_set1_ps(scales[g]);
    if (boundary < 8) {
      const __m256i after = _mm256_cmpgt_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                               _mm256_set1_epi32(static_cast<int32_t>(boundary) - 1));
      scale = _mm256_blendv_ps(scale, _mm256_set1_ps(scales[g + 1]), _mm256_castsi256_ps(after));
    }
    return _mm256_add_ps(_mm256_mul_ps(decoded, scale), _mm256_set1_ps(offset));
  }
};

// Walks one output row's block constants in order, as the int8 kernels read them (one per block, inside their
// chunk loop, where the scalar work overlaps the vector work): the float32 array's own, or double-quantized
// ones decoded as reached, rounded as `BlockConstants::row` rounds them.
struct RowConstants {
  const BlockConstants& c;
  int64_t i, g = 0, group_end = 0;
  RowConstants(const BlockConstants& constants, int64_t n) : c(constants), i(n * constants.per_row) {
    if (c.direct == nullptr) g = i / c.group, group_end = (g + 1) * c.group;
  }
  float next() {
    if (c.direct != nullptr) return c.direct[i++];
    if (i == group_end) ++g, group_end += c.group;
    return c.decoded(i++, g);
  }
};

// 16 codes (8 packed bytes) -> two vectors of 8 floats, in order, through the 16-entry code book.
inline void decode16(const uint8_t* bytes, __m256 low_table, __m256 high_table, __m256& first, __m256& second) {
  const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
  const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0F));
  const __m128i codes = _mm_unpacklo_epi8(high, low);  // c0 c1 c2 ... c15 (high nibble is the earlier code)
  const __m256i codes_a = _mm256_cvtepu8_epi32(codes);
  const __m256i codes_b = _mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8));
  // permutevar8x32 uses the low 3 bits of each index; bit 3 picks the table.
  const __m256 a_low = _mm256_permutevar8x32_ps(low_table, codes_a);
  const __m256 a_high = _mm256_permutevar8x32_ps(high_table, codes_a);
  const __m256 b_low = _mm256_permutevar8x32_ps(low_table, codes_b);
  const __m256 b_high = _mm256_permutevar8x32_ps(high_table, codes_b);
  const __m256 a_mask = _mm256_castsi256_ps(_mm256_slli_epi32(codes_a, 28));  // bit 3 -> sign bit
  const __m256 b_mask = _mm256_castsi256_ps(_mm256_slli_epi32(codes_b, 28));
  first = _mm256_blendv_ps(a_low, a_high, a_mask);
  second = _mm256_blendv_ps(b_low, b_high, b_mask);
}

// 16 consecutive 3-bit codes of a planes chunk (leanlm/formats/packing.py), the quarter-th 16 of its 64, as two
// vectors of 8 floats through the 8-entry code book: the low pairs are bits 2q..2q+1 of the 16 low bytes, the high
// bits 16q..16q+15 of the little-endian word that follows them.
inline void decode16_planes(const uint8_t* chunk, int64_t quarter, __m256 table, __m256& first, __m256& second) {
  const __m128i low_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk));
  // a 16-bit lane shift: what the high byte moves into a low byte's top bits is masked off
  const __m128i low = _mm_and_si128(_mm_srl_epi16(low_bytes, _mm_cvtsi32_si128(static_cast<int>(2 * quarter))),
                                    _mm_set1_epi8(3));
  uint64_t high_word;
  std::memcpy(&high_word, chunk + 16, sizeof(high_word));
  const uint32_t high = static_cast<uint32_t>(high_word >> (16 * quarter));
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i four = _mm256_set1_epi32(4);
  const auto with_high = [&](__m256i codes, uint32_t bits) {
    const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), bit), bit);
    return _mm256_or_si256(codes, _mm256_and_si256(set, four));
  };
  first = _mm256_permutevar8x32_ps(table, with_high(_mm256_cvtepu8_epi32(low), high & 0xFF));
  second = _mm256_permutevar8x32_ps(table, with_high(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)), (high >> 8) & 0xFF));
}

// 16 8-bit codes (one byte each) -> two vectors of 8 floats through the 256-entry code book.
inline void decode16_bytes(const uint8_t* bytes, const float* table, __m256& first, __m256& second) {
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  first = _mm256_i32gather_ps(table, _mm256_cvtepu8_epi32(codes), 4);
  second = _mm256_i32gather_ps(table, _mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8)), 4);
}

// Batch-1 kernels read each weight once, in order, and do a few instructions per byte: with the hardware
// prefetcher alone the 4-bit int8 kernel waits on its weight loads. Each step asks for the line `kPrefetchBytes`
// ahead as it starts (benchmarks/kbit_speed.py's streaming part compares the share of the read bandwidth reached).
constexpr int64_t kPrefetchBytes = 2048;

// Output rows [first, last) a tile at a time, each tile's weights (row_bytes a row) few enough to stay in cache
// while every row (or group of rows) of x passes over them: a batch reads each weight from memory once, not once
// per group of rows. Each output is computed as without tiles.
constexpr int64_t kWeightTileBytes = 128 * 1024;
template <class Body>
inline void over_weight_tiles(int64_t first, int64_t last, int64_t row_bytes, Body&& body) {
  const int64_t tile = std::max<int64_t>(16, kWeightTileBytes / std::max<int64_t>(row_bytes, 1));
  for (int64_t start = first; start < last; start += tile) body(start, std::min(last, start + tile));
}

// Asks for the BYTES bytes from `p` (one request per line) into the cache level HINT names.
template <int64_t BYTES, int HINT = _MM_HINT_T0>
inline void prefetch_lines(const void* p) {
  for (int64_t offset = 0; offset < BYTES; offset += 64)
    _mm_prefetch(static_cast<const char*>(p) + offset, static_cast<_mm_hint>(HINT));
}

// Prefetches what a step reading `bytes` bytes from `p` will read `kPrefetchBytes` later.
template <int64_t BYTES>
inline void prefetch_ahead(const void* p) {
  prefetch_lines<BYTES>(static_cast<const char*>(p) + kPrefetchBytes);
}

inline float horizontal_sum(__m256 v) {
  const __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
  return _mm_cvtss_f32(_mm_add_ss(sum2, _mm_movehdup_ps(sum2)));
}

// ROWS rows of x against output rows [first, last) of W, codes decoded in order (any row length).
template <int ROWS>
void gemv_rows_in_order(const float* x, int64_t x_stride, const uint8_t* packed, const BlockConstants& constants,
                        const float* table, int64_t in_features, int64_t block, float* out, int64_t out_stride,
                        int64_t first, int64_t last) {
  const __m256 low_table = _mm256_loadu_ps(table);
  const __m256 high_table = _mm256_loadu_ps(table + 8);
  const int64_t blocks_per_row = in_features / block;
  std::vector<float> scratch(blocks_per_row);
  for (int64_t n = first; n < last; ++n) {
    const uint8_t* row_codes = packed + n * in_features / 2;
    const float* row_absmax = constants.row(n, scratch.data());
    __m256 total[ROWS];
    for (int r = 0; r < ROWS; ++r) total[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks_per_row; ++b) {
      __m256 partial[ROWS];
      for (int r = 0; r < ROWS; ++r) partial[r] = _mm256_setzero_ps();
      const int64_t start = b * block;
      for (int64_t k = start; k < start + block; k += 16) {
        __m256 w0, w1;
        decode16(row_codes + k / 2, low_table, high_table, w0, w1);
        for (int r = 0; r < ROWS; ++r) {
          const float* xr = x + r * x_stride + k;
          partial[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), partial[r]);
          partial[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), partial[r]);
        }
      }
      const __m256 scale = _mm256_set1_ps(row_absmax[b]);
      for (int r = 0; r < ROWS; ++r) total[r] = _mm256_fmadd_ps(partial[r], scale, total[r]);
    }
    for (int r = 0; r < ROWS; ++r) out[r * out_stride + n] = horizontal_sum(total[r]);
  }
}

// x (rows, K) -> the lane order of chunks of 8 * lanes codes: out[k + lanes * j + d] = x[k + 8 * d + (j ^ 1)],
// with a last chunk of 64 codes (lanes 8) where fewer than 8 * lanes remain. K is a multiple of 64.
void permute_x(const float* x, float* out, int64_t rows, int64_t K, int64_t lanes) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * K;
    float* outr = out + r * K;
    for (int64_t k = 0; k < K;) {
      const int64_t width = k + 8 * lanes <= K ? lanes : 8;
      for (int64_t j = 0; j < 8; ++j)
        for (int64_t d = 0; d < width; ++d) outr[k + width * j + d] = xr[k + 8 * d + (j ^ 1)];
      k += 8 * width;
    }
  }
}

// Per chunk, the block index of each lane: (k + 8 d) / block, relative to the row's first block.
std::vector<int32_t> lane_blocks(int64_t K, int64_t block, int64_t lanes) {
  std::vector<int32_t> index;
  for (int64_t k = 0; k < K;) {
    const int64_t width = k + 8 * lanes <= K ? lanes : 8;
    for (int64_t d = 0; d < lanes; ++d) index.push_back(static_cast<int32_t>((k + 8 * (d < width ? d : 0)) / block));
    k += 8 * width;
  }
  return index;
}

namespace avx2 {

struct Ops {
  using Vec = __m256;
  static constexpr int64_t kLanes = 8;  // chunks of 64 codes: rows are multiples of 64, so there is no tail
  __m256 low_table, high_table;         // AVX2 permutes 8 floats at a time: the 16-entry book in two halves
  int64_t block;
  Ops(const float* table, int64_t block)
      : low_table(_mm256_loadu_ps(table)), high_table(_mm256_loadu_ps(table + 8)), block(block) {}
  static __m256 zero() { return _mm256_setzero_ps(); }
  static __m256 add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
  static __m256 fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256i codes(const uint8_t* p, bool) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  __m256 decode(__m256i codes, int j) const {
    const __m256i index = _mm256_srli_epi32(codes, 4 * j);  // vpermps reads the low 3 bits
    const __m256 pick_high = _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28 - 4 * j));  // bit 3 -> sign bit
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low_table, index),
                            _mm256_permutevar8x32_ps(high_table, index), pick_high);
  }
  static __m256 x(const float* p, bool) { return _mm256_loadu_ps(p); }
  __m256 scales(const float* absmax, int64_t k, bool, const int32_t* blocks) const {
    if (block % 64 == 0) return _mm256_set1_ps(absmax[k / block]);
    if (block == 32) return _mm256_set_m128(_mm_set1_ps(absmax[k / 32 + 1]), _mm_set1_ps(absmax[k / 32]));
    return _mm256_i32gather_ps(absmax, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks)), 4);
  }
  static float sum(__m256 v) { return horizontal_sum(v); }
};

#include "kbit4_lanes.inc"

}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace avx512 {

struct Ops {
  using Vec = __m512;
  static constexpr int64_t kLanes = 16;  // chunks of 128 codes, and a 64-code tail in the low 8 lanes
  __m512 book;                           // the whole 16-entry code book: one vpermps decodes 16 weights
  int64_t block;
  Ops(const float* table, int64_t block) : book(_mm512_loadu_ps(table)), block(block) {}
  static __m512 zero() { return _mm512_setzero_ps(); }
  static __m512 add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
  static __m512 fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
  static __mmask16 live(bool full) { return full ? 0xFFFF : 0x00FF; }
  static __m512i codes(const uint8_t* p, bool full) { return _mm512_maskz_loadu_epi32(live(full), p); }
  __m512 decode(__m512i codes, int j) const { return _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4 * j), book); }
  static __m512 x(const float* p, bool full) { return _mm512_maskz_loadu_ps(live(full), p); }
  __m512 scales(const float* absmax, int64_t k, bool full, const int32_t* blocks) const {
    if (block % 128 == 0) return _mm512_set1_ps(absmax[k / block]);
    if (block == 64) {  // the tail chunk has no second block (and reading one would pass the row's end)
      const __m512 low = _mm512_set1_ps(absmax[k / 64]);
      return full ? _mm512_insertf32x8(low, _mm256_set1_ps(absmax[k / 64 + 1]), 1) : low;
    }
    return _mm512_i32gather_ps(_mm512_loadu_si512(blocks), absmax, 4);
  }
  static float sum(__m512 v) { return _mm512_reduce_add_ps(v); }
};

#include "kbit4_lanes.inc"

}  // namespace avx512
#pragma GCC pop_options

#include "float_gemv.inc"
#include "kbit4_int8.inc"
#include "w8a8_gemv.inc"

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

void check(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& absmax,
           const torch::Tensor& table, int64_t out_features, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 (M, K)");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed: contiguous uint8");
  TORCH_CHECK(table.scalar_type() == torch::kFloat && table.numel() == 16, "table: 16 float32 values");
  const int64_t in_features = x.size(1);
  TORCH_CHECK(block % 16 == 0 && in_features % block == 0, "block must be a multiple of 16 dividing in_features");
  TORCH_CHECK(packed.numel() == out_features * in_features / 2, "packed has the wrong size");
  TORCH_CHECK(absmax.numel() == out_features * in_features / block, "absmax has the wrong size");
}

// absmax: float32 constants, or uint8 codes of them with `dq_scales` (float32, one per `dq_group` codes),
// `dq_values` (256 float32) and `dq_offset` (double quantization).
BlockConstants constants_of(const torch::Tensor& absmax, const c10::optional<torch::Tensor>& dq_scales,
                            const c10::optional<torch::Tensor>& dq_values, double dq_offset, int64_t dq_group,
                            int64_t per_row) {
  TORCH_CHECK(absmax.is_contiguous(), "absmax: contiguous");
  BlockConstants constants;
  constants.per_row = per_row;
  if (absmax.scalar_type() == torch::kFloat) {
    constants.direct = absmax.data_ptr<float>();
    return constants;
  }
  TORCH_CHECK(absmax.scalar_type() == torch::kUInt8 && dq_scales.has_value() && dq_values.has_value(),
              "absmax: float32, or uint8 codes with dq_scales and dq_values (double quantization)");
  TORCH_CHECK(dq_scales->scalar_type() == torch::kFloat && dq_scales->is_contiguous() &&
                  dq_scales->numel() == (absmax.numel() + dq_group - 1) / dq_group,
              "dq_scales: one contiguous float32 per dq_group codes");
  TORCH_CHECK(dq_values->scalar_type() == torch::kFloat && dq_values->is_contiguous() && dq_values->numel() == 256,
              "dq_values: 256 float32 values");
  constants.codes = absmax.data_ptr<uint8_t>();
  constants.scales = dq_scales->data_ptr<float>();
  constants.code_values = dq_values->data_ptr<float>();
  constants.offset = static_cast<float>(dq_offset);
  constants.group = dq_group;
  return constants;
}

// Every double-quantized block constant in float32, as the kernels decode them (`BlockConstants::value`): the
// fused decode step's copy (kernels read float32 constants without decoding them), written straight into its
// tensor (the same in PyTorch ops would allocate several index tensors of the weight's block count).
torch::Tensor decode_block_constants(torch::Tensor absmax, torch::Tensor dq_scales, torch::Tensor dq_values,
                                     double dq_offset, int64_t dq_group) {
  const int64_t count = absmax.numel();
  const BlockConstants constants = constants_of(absmax, dq_scales, dq_values, dq_offset, dq_group, count);
  auto out = torch::empty({count}, torch::dtype(torch::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, count, 1 << 16, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) op[b] = constants.value(b);
  });
  return out;
}

#include "fused_decode.inc"

}  // namespace

// Which small-M kernel runs: the best this CPU has, or one named (tests compare each with the reference).
enum Isa : int64_t { kAuto = 0, kAvx512 = 1, kAvx2 = 2, kInOrder = 3 };

torch::Tensor kbit4_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor absmax, torch::Tensor table,
                         int64_t out_features, int64_t block, int64_t isa, c10::optional<torch::Tensor> dq_scales,
                         c10::optional<torch::Tensor> dq_values, double dq_offset, int64_t dq_group) {
  check(x, packed, absmax, table, out_features, block);
  const BlockConstants constants = constants_of(absmax, dq_scales, dq_values, dq_offset, dq_group, x.size(1) / block);
  const int64_t rows = x.size(0), in_features = x.size(1);
  if (isa == kAuto) isa = in_features % 64 ? kInOrder : (cpu_has_avx512() ? kAvx512 : kAvx2);
  TORCH_CHECK(isa >= kAvx512 && isa <= kInOrder, "unknown kernel choice ", isa);
  TORCH_CHECK(isa != kAvx512 || cpu_has_avx512(), "this CPU has no AVX-512");
  TORCH_CHECK(isa == kInOrder || in_features % 64 == 0, "the lane-order kernels need in_features % 64 == 0");
  auto out = torch::empty({rows, out_features}, x.options());
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* tp = table.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (isa == kInOrder) {
    const float* xp = x.data_ptr<float>();
    at::parallel_for(0, out_features, 16, [&](int64_t first, int64_t last) {
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4)
        gemv_rows_in_order<4>(xp + r * in_features, in_features, pp, constants, tp, in_features, block,
                              op + r * out_features, out_features, first, last);
      for (; r < rows; ++r)
        gemv_rows_in_order<1>(xp + r * in_features, in_features, pp, constants, tp, in_features, block,
                              op + r * out_features, out_features, first, last);
    });
    return out;
  }
  const int64_t lanes = isa == kAvx512 ? 16 : 8;
  auto permuted = torch::empty_like(x);
  permute_x(x.data_ptr<float>(), permuted.data_ptr<float>(), rows, in_features, lanes);
  const std::vector<int32_t> blocks = lane_blocks(in_features, block, lanes);
  const float* xp = permuted.data_ptr<float>();
  at::parallel_for(0, out_features, 16, [&](int64_t first, int64_t last) {
    // Rows of x in groups (each decoded weight serves the whole group): 8 fit AVX-512's 32 registers, 4 AVX2's 16.
    auto group = [&](auto size, int64_t r) {
      constexpr int R = decltype(size)::value;
      if (isa == kAvx512)
        avx512::gemv_rows<R>(xp + r * in_features, in_features, pp, constants, tp, in_features, block, blocks.data(),
                            op + r * out_features, out_features, first, last);
      else
        avx2::gemv_rows<(R < 4 ? R : 4)>(xp + r * in_features, in_features, pp, constants, tp, in_features, block,
                                      blocks.data(), op + r * out_features, out_features, first, last);
    };
    int64_t r = 0;
    if (isa == kAvx512)
      for (; r + 8 <= rows; r += 8) group(std::integral_constant<int, 8>{}, r);
    for (; r + 4 <= rows; r += 4) group(std::integral_constant<int, 4>{}, r);
    for (; r < rows; ++r) group(std::integral_constant<int, 1>{}, r);
  });
  return out;
}

// The int8-activation kernel (kbit4_int8.inc) for 3-, 4- or 8-bit codes: isa 1 = AVX512-VNNI, 2 = AVX2, 0 = the
// best this CPU runs. `table` is the 3- or 4-bit code book as 16 int8 values (ignored for 8 bits, whose codes are
// the int8 values plus 127), `table_inverse` the factor back to the book's own scale.
torch::Tensor kbit_gemv_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor absmax, torch::Tensor table,
                             double table_inverse, int64_t out_features, int64_t block, int64_t bits, int64_t isa,
                             c10::optional<torch::Tensor> dq_scales, c10::optional<torch::Tensor> dq_values,
                             double dq_offset, int64_t dq_group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 (M, K)");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed: contiguous uint8");
  TORCH_CHECK(table.scalar_type() == torch::kInt8 && table.numel() == 16 && table.is_contiguous(),
              "table: 16 int8 values");
  TORCH_CHECK(bits == 3 || bits == 4 || bits == 8, "the int8 kernel reads 3-, 4- or 8-bit codes, got ", bits);
  const int64_t rows = x.size(0), K = x.size(1);
  TORCH_CHECK(int8_kernel_layout(bits, block, K), "the int8 kernel needs blocks of a multiple of 64 tiling rows "
              "(3-bit codes: or of 16 or 32, rows a multiple of 64)");
  TORCH_CHECK(packed.numel() == out_features * K * bits / 8, "packed has the wrong size");
  TORCH_CHECK(absmax.numel() == out_features * K / block, "absmax has the wrong size");
  const BlockConstants constants = constants_of(absmax, dq_scales, dq_values, dq_offset, dq_group, K / block);
  if (isa == kAuto) isa = cpu_has_avx512_vnni() ? kAvx512 : kAvx2;
  TORCH_CHECK(isa == kAvx512 || isa == kAvx2, "the int8 kernel runs avx512-vnni or avx2, got ", isa);
  TORCH_CHECK(isa != kAvx512 || cpu_has_avx512_vnni(), "this CPU has no AVX512-VNNI");
  QuantizedActivations quantized;
  quantized.quantize(x.data_ptr<float>(), rows, K, bits);
  auto out = torch::empty({rows, out_features}, x.options());
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const int8_t* tp = table.data_ptr<int8_t>();
  float* op = out.data_ptr<float>();
  const float inverse = static_cast<float>(table_inverse);
  at::parallel_for(0, out_features, 16, [&](int64_t first, int64_t last) {
    gemv_int8_batch(isa == kAvx512, bits, quantized, rows, pp, constants, tp, inverse, K, block, op, out_features,
                    first, last);
  });
  return out;
}

// The W8A8 linear on one token x (1, K) float32: `input_scale` > 0 static, else dynamic; `outlier_threshold` > 0 is
// LLM.int8(). One row only: with more, the eager path's per-tensor scale and outlier columns span all rows.
torch::Tensor w8a8_gemv(torch::Tensor x, torch::Tensor weight, torch::Tensor weight_scale,
                        c10::optional<torch::Tensor> bias, double input_scale, double outlier_threshold,
                        int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x: one contiguous float32 row (1, K)");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kInt8 && weight.is_contiguous() &&
                  weight.size(1) == x.size(1), "weight: contiguous int8 (N, K)");
  TORCH_CHECK(weight_scale.scalar_type() == torch::kFloat && weight_scale.numel() == weight.size(0) &&
                  weight_scale.is_contiguous(), "weight_scale: float32, one per output row");
  if (isa == kAuto) isa = cpu_has_avx512_vnni() ? kAvx512 : kAvx2;
  TORCH_CHECK(isa == kAvx512 || isa == kAvx2, "the W8A8 kernel runs avx512-vnni or avx2, got ", isa);
  TORCH_CHECK(isa != kAvx512 || cpu_has_avx512_vnni(), "this CPU has no AVX512-VNNI");
  const int64_t K = x.size(1), N = weight.size(0);
  w8a8::Quantization how;
  how.static_scale = static_cast<float>(input_scale);
  how.outlier_threshold = static_cast<float>(outlier_threshold);
  w8a8::QuantizedRow quantized;
  quantized.quantize(x.data_ptr<float>(), K, how);
  auto out = torch::empty({1, N}, x.options());
  at::parallel_for(0, N, 16, [&](int64_t first, int64_t last) {
    w8a8::gemv_rows(isa == kAvx512, quantized, x.data_ptr<float>(), weight.data_ptr<int8_t>(),
                    weight_scale.data_ptr<float>(), K, out.data_ptr<float>(), first, last);
  });
  if (bias.has_value()) out.add_(*bias);
  return out;
}

// The int8 codes of the eager W8A8 path (w8a8::round_row_to_codes) of x (M, K) float32 into out (x itself for in
// place), with one scale (per tensor; `rescale`: the codes times it) or one per row (per token; bare codes).
void round_to_int8_codes(torch::Tensor x, torch::Tensor out, torch::Tensor scale, int64_t zero_point, bool rescale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 (M, K)");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == torch::kFloat && out.is_contiguous(),
              "out: contiguous float32 of x's shape");
  const int64_t rows = x.size(0), K = x.size(1);
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() &&
                  (scale.numel() == 1 || scale.numel() == rows), "scale: float32, one or one per row of x");
  TORCH_CHECK(!rescale || scale.numel() == 1, "only a per-tensor scale rescales its codes");
  const bool per_row = scale.numel() != 1;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float zero = static_cast<float>(zero_point);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float s = sp[per_row ? r : 0];
      w8a8::round_row_to_codes(xp + r * K, op + r * K, K, s, zero, rescale ? s : 1.0f);
    }
  });
}

// 16 floats stored in order.
inline void store16(float* out, __m256 first, __m256 second) {
  _mm256_storeu_ps(out, first);
  _mm256_storeu_ps(out + 8, second);
}

// 16 floats rounded to bfloat16 (to nearest, ties to even, as PyTorch rounds finite values) and stored in order.
inline void store16(at::BFloat16* out, __m256 first, __m256 second) {
  const auto round = [](__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  };
  // packus works within 128-bit halves (first 0-3, second 0-3, first 4-7, second 4-7): the permute restores order
  const __m256i packed = _mm256_packus_epi32(round(first), round(second));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(packed, 0xD8));
}

void dequantize_rows(torch::Tensor packed, torch::Tensor absmax, torch::Tensor table, int64_t block,
                     int64_t first_row, torch::Tensor out, c10::optional<torch::Tensor> dq_scales,
                     c10::optional<torch::Tensor> dq_values, double dq_offset, int64_t dq_group, int64_t bits,
                     c10::optional<torch::Tensor> block_offsets) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() &&
                  (out.scalar_type() == torch::kFloat || out.scalar_type() == torch::kBFloat16),
              "out: contiguous float32 or bfloat16");
  TORCH_CHECK(bits == 3 || bits == 4 || bits == 8, "dequantize_rows reads 3-, 4- or 8-bit codes, got ", bits);
  const int64_t in_features = out.size(1), rows = out.size(0);
  TORCH_CHECK(block % 16 == 0 && in_features % block == 0, "block must be a multiple of 16 dividing in_features");
  // 3-bit rows must start at a chunk of the planes layout
  TORCH_CHECK(bits != 3 || in_features % 64 == 0, "3-bit codes: rows of a multiple of 64");
  TORCH_CHECK(table.scalar_type() == torch::kFloat && table.is_contiguous() && table.numel() == (bits == 8 ? 256 : 16),
              "table: the code book as float32, 16 entries (3 or 4 bits) or 256 (8 bits)");
  const int64_t packed_end = bits == 3 ? (first_row + rows) * in_features / 64 * 24 : (first_row + rows) * in_features * bits / 8;
  TORCH_CHECK(packed.numel() >= packed_end, "rows beyond the packed weight");
  const int64_t blocks_per_row = in_features / block;
  TORCH_CHECK(absmax.numel() >= (first_row + rows) * blocks_per_row, "rows beyond the block constants");
  const float* offsets = nullptr;
  if (block_offsets.has_value()) {
    TORCH_CHECK(block_offsets->scalar_type() == torch::kFloat && block_offsets->is_contiguous() &&
                    block_offsets->numel() >= (first_row + rows) * blocks_per_row,
                "block_offsets: contiguous float32, one per block of every row");
    offsets = block_offsets->data_ptr<float>();
  }
  const BlockConstants constants = constants_of(absmax, dq_scales, dq_values, dq_offset, dq_group, blocks_per_row);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* tp = table.data_ptr<float>();
  // Each weight is code value * block constant (+ block offset), rounded once per operation as the reference
  // computes it in float32, then (bfloat16 out) rounded to bfloat16.
  const auto run = [&](auto* op) {
    at::parallel_for(0, rows, 8, [&](int64_t first, int64_t last) {
      const __m256 low_table = _mm256_loadu_ps(tp);
      const __m256 high_table = _mm256_loadu_ps(tp + 8);
      std::vector<float> scratch(blocks_per_row);
      for (int64_t i = first; i < last; ++i) {
        const int64_t n = first_row + i;
        auto* row_out = op + i * in_features;
        const float* row_absmax = constants.row(n, scratch.data());
        for (int64_t b = 0; b < blocks_per_row; ++b) {
          const __m256 scale = _mm256_set1_ps(row_absmax[b]);
          const __m256 shift = _mm256_set1_ps(offsets != nullptr ? offsets[n * blocks_per_row + b] : 0.0f);
          for (int64_t k = b * block; k < (b + 1) * block; k += 16) {
            const int64_t code = n * in_features + k;  // the first of these 16 codes, in the whole weight
            __m256 w0, w1;
            if (bits == 4) {
              decode16(pp + code / 2, low_table, high_table, w0, w1);
            } else if (bits == 3) {
              decode16_planes(pp + code / 64 * 24, code % 64 / 16, low_table, w0, w1);
            } else {
              decode16_bytes(pp + code, tp, w0, w1);
            }
            w0 = _mm256_mul_ps(w0, scale);
            w1 = _mm256_mul_ps(w1, scale);
            if (offsets != nullptr) w0 = _mm256_add_ps(w0, shift), w1 = _mm256_add_ps(w1, shift);
            store16(row_out + k, w0, w1);
          }
        }
      }
    });
  };
  if (out.scalar_type() == torch::kFloat)
    run(out.data_ptr<float>());
  else
    run(out.data_ptr<at::BFloat16>());
}

// y = x @ W^T for M <= 8 rows of x (float32) and W float32 or bfloat16: see float_gemv.inc.
torch::Tensor float_gemv(torch::Tensor x, torch::Tensor weight, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 (M, K)");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  (weight.scalar_type() == torch::kFloat || weight.scalar_type() == torch::kBFloat16),
              "weight: contiguous float32 or bfloat16 (N, K)");
  const int64_t rows = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(rows >= 1 && rows <= 8, "float_gemv takes 1 to 8 rows, got ", rows);
  TORCH_CHECK(weight.size(1) == K, "weight has ", weight.size(1), " columns, x has ", K);
  if (isa == kAuto) isa = cpu_has_avx512() ? kAvx512 : kAvx2;
  TORCH_CHECK(isa == kAvx512 || isa == kAvx2, "float_gemv runs avx512 or avx2, got ", isa);
  TORCH_CHECK(isa != kAvx512 || cpu_has_avx512(), "this CPU has no AVX-512");
  auto out = torch::empty({rows, N}, x.options());
  const float* xs = x.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  auto run = [&](auto* w) {
    at::parallel_for(0, N, 64, [&](int64_t first, int64_t last) {
      if (isa == kAvx512)
        gemv512::rows_avx512(xs, rows, K, w, N, first, last, ys);
      else
        gemv::rows_avx2(xs, rows, K, w, N, first, last, ys);
    });
  };
  if (weight.scalar_type() == torch::kFloat)
    run(weight.data_ptr<float>());
  else
    run(weight.data_ptr<at::BFloat16>());
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The enums' values by name: Python looks them up here rather than keeping copies.
  m.attr("ISAS") = py::dict(py::arg("auto") = int64_t{kAuto}, py::arg("avx512") = int64_t{kAvx512},
                            py::arg("avx2") = int64_t{kAvx2}, py::arg("in-order") = int64_t{kInOrder});
  m.attr("LINEAR_KINDS") =
      py::dict(py::arg("float32") = int64_t{fused::kFloat32}, py::arg("bfloat16") = int64_t{fused::kBFloat16},
               py::arg("kbit3") = int64_t{fused::kKbit3}, py::arg("kbit4") = int64_t{fused::kKbit4},
               py::arg("kbit8") = int64_t{fused::kKbit8}, py::arg("w8a8") = int64_t{fused::kW8A8});
  m.attr("ACTIVATIONS") = py::dict(py::arg("swiglu") = int64_t{fused::kSiLU}, py::arg("geglu") = int64_t{fused::kGeluTanh});
  m.attr("BMM_MODES") =
      py::dict(py::arg("none") = int64_t{fused::kBmmNone}, py::arg("per_tensor") = int64_t{fused::kBmmPerTensor},
               py::arg("per_token") = int64_t{fused::kBmmPerToken}, py::arg("static") = int64_t{fused::kBmmStatic});
  m.def("float_gemv", &float_gemv, "float32 / bfloat16 weight times at most 8 float32 rows, threads over outputs");
  m.def("kbit4_gemv", &kbit4_gemv, "4-bit weight-only linear, weights decoded in registers", py::arg("x"),
        py::arg("packed"), py::arg("absmax"), py::arg("table"), py::arg("out_features"), py::arg("block"),
        py::arg("isa"), py::arg("dq_scales") = py::none(), py::arg("dq_values") = py::none(),
        py::arg("dq_offset") = 0.0, py::arg("dq_group") = 256);
  m.def("kbit_gemv_int8", &kbit_gemv_int8, "4- or 8-bit weight x int8-quantized activations (llama.cpp's Q8_0 way)",
        py::arg("x"), py::arg("packed"), py::arg("absmax"), py::arg("table"), py::arg("table_inverse"),
        py::arg("out_features"), py::arg("block"), py::arg("bits"), py::arg("isa"), py::arg("dq_scales") = py::none(),
        py::arg("dq_values") = py::none(), py::arg("dq_offset") = 0.0, py::arg("dq_group") = 256);
  m.def("w8a8_gemv", &w8a8_gemv, "int8 weight x one int8-quantized token (SmoothQuant W8A8, LLM.int8())", py::arg("x"),
        py::arg("weight"), py::arg("weight_scale"), py::arg("bias") = py::none(), py::arg("input_scale") = 0.0,
        py::arg("outlier_threshold") = 0.0, py::arg("isa") = 0);
  py::class_<fused::Decoder>(m, "FusedDecoder")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, double, int64_t, torch::Tensor, double,
                    torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>(),
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("attention_scale"), py::arg("activation"), py::arg("embedding"), py::arg("embedding_scale"),
           py::arg("final_norm"), py::arg("embedding_absmax") = py::none(), py::arg("embedding_values") = py::none())
      .def("add_linear", &fused::Decoder::add_linear, py::arg("kind"), py::arg("weight"), py::arg("in_features"),
           py::arg("out_features"), py::arg("bias") = py::none(), py::arg("absmax") = py::none(),
           py::arg("table") = py::none(), py::arg("table_inverse") = 1.0, py::arg("block") = 0,
           py::arg("dq_scales") = py::none(), py::arg("dq_values") = py::none(), py::arg("dq_offset") = 0.0,
           py::arg("dq_group") = 256)
      .def("add_layer", &fused::Decoder::add_layer, py::arg("attention_norm"), py::arg("mlp_norm"), py::arg("q"),
           py::arg("k"), py::arg("v"), py::arg("o"), py::arg("gate"), py::arg("up"), py::arg("down"),
           py::arg("inverse_frequencies"), py::arg("rope_scale"), py::arg("window"),
           py::arg("attention_output_norm") = py::none(), py::arg("mlp_output_norm") = py::none(),
           py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(), py::arg("bmm_mode") = 0,
           py::arg("bmm_q_scale") = 0.0, py::arg("bmm_k_scale") = 0.0, py::arg("bmm_v_scale") = 0.0,
           py::arg("bmm_probabilities") = false)
      .def("add_w8a8_linear", &fused::Decoder::add_w8a8_linear, py::arg("weight"), py::arg("weight_scale"),
           py::arg("bias") = py::none(), py::arg("input_scale") = 0.0, py::arg("outlier_threshold") = 0.0)
      .def("add_spqr_parts", &fused::Decoder::add_spqr_parts, py::arg("id"), py::arg("block_offsets"),
           py::arg("permutation") = py::none(), py::arg("outlier_row_offsets") = py::none(),
           py::arg("outlier_columns") = py::none(), py::arg("outlier_values") = py::none())
      .def("set_head", &fused::Decoder::set_head)
      .def("step", &fused::Decoder::step, py::arg("token"), py::arg("position"), py::arg("keys"), py::arg("values"),
           py::arg("sinks") = 0, py::arg("window") = 0,
           // without the GIL: a server's other threads stream text while a conversation's token is computed
           py::call_guard<py::gil_scoped_release>())
      .def("step_batch", &fused::Decoder::step_batch, py::arg("tokens"), py::arg("positions"), py::arg("keys"),
           py::arg("values"), py::arg("sinks"), py::arg("windows"), py::call_guard<py::gil_scoped_release>());
  m.def("has_avx512_vnni", &cpu_has_avx512_vnni, "whether this CPU runs the AVX512-VNNI int8 kernel");
  m.def("has_avx512", &cpu_has_avx512, "whether this CPU runs the AVX-512 kernel");
  m.def("decode_block_constants", &decode_block_constants, "double-quantized block constants as float32",
        py::arg("absmax"), py::arg("dq_scales"), py::arg("dq_values"), py::arg("dq_offset"), py::arg("dq_group"));
  m.def("round_to_int8_codes", &round_to_int8_codes,
        "x's int8 activation codes into out (round half to even, clamp), per-tensor codes times their scale",
        py::arg("x"), py::arg("out"), py::arg("scale"), py::arg("zero_point"), py::arg("rescale"));
  m.def("dequantize_rows", &dequantize_rows,
        "3-, 4- or 8-bit weights of out.size(0) output rows from first_row into out (float32 or bfloat16; AVX2)",
        py::arg("packed"), py::arg("absmax"), py::arg("table"), py::arg("block"), py::arg("first_row"), py::arg("out"),
        py::arg("dq_scales") = py::none(), py::arg("dq_values") = py::none(), py::arg("dq_offset") = 0.0,
        py::arg("dq_group") = 256, py::arg("bits") = 4, py::arg("block_offsets") = py::none());
}
