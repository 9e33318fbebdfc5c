// Weight-only 4-bit linear for x86 CPUs with AVX2 + FMA: y = x @ W^T, W given as packed 4-bit codes (two per
// byte, the first code in the high nibble), one float absmax per block of `block` consecutive weights of a row,
// and a 16-entry code book (NF4, FP4, int4, ...). W is never materialised in float32 for small M: each block
// of codes is decoded into registers and multiplied into every row of x, so the memory traffic is the packed
// weights (4 bits) plus the constants; that is the point at batch-1 decode, which is memory-bound.
//
// `dequantize_rows` decodes a range of output rows into a float32 scratch tile, for the large-M path (decode a
// tile, then an ordinary SGEMM) that Python drives.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

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

inline float horizontal_sum(__m256 v) {
  const __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
  return _mm_cvtss_f32(_mm_add_ss(sum2, _mm_movehdup_ps(sum2)));
}

// ROWS rows of x against output rows [first, last) of W.
template <int ROWS>
void gemv_rows(const float* x, int64_t x_stride, const uint8_t* packed, const float* absmax, const float* table,
               int64_t in_features, int64_t block, float* out, int64_t out_stride, int64_t first, int64_t last) {
  const __m256 low_table = _mm256_loadu_ps(table);
  const __m256 high_table = _mm256_loadu_ps(table + 8);
  const int64_t blocks_per_row = in_features / block;
  for (int64_t n = first; n < last; ++n) {
    const uint8_t* row_codes = packed + n * in_features / 2;
    const float* row_absmax = absmax + n * blocks_per_row;
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

void check(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& absmax,
           const torch::Tensor& table, int64_t out_features, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 (M, K)");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed: contiguous uint8");
  TORCH_CHECK(absmax.scalar_type() == torch::kFloat && absmax.is_contiguous(), "absmax: contiguous float32");
  TORCH_CHECK(table.scalar_type() == torch::kFloat && table.numel() == 16, "table: 16 float32 values");
  const int64_t in_features = x.size(1);
  TORCH_CHECK(block % 16 == 0 && in_features % block == 0, "block must be a multiple of 16 dividing in_features");
  TORCH_CHECK(packed.numel() == out_features * in_features / 2, "packed has the wrong size");
  TORCH_CHECK(absmax.numel() == out_features * in_features / block, "absmax has the wrong size");
}

}  // namespace

torch::Tensor kbit4_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor absmax, torch::Tensor table,
                         int64_t out_features, int64_t block) {
  check(x, packed, absmax, table, out_features, block);
  const int64_t rows = x.size(0), in_features = x.size(1);
  auto out = torch::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* ap = absmax.data_ptr<float>();
  const float* tp = table.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, out_features, 16, [&](int64_t first, int64_t last) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
      gemv_rows<4>(xp + r * in_features, in_features, pp, ap, tp, in_features, block, op + r * out_features,
                   out_features, first, last);
    for (; r < rows; ++r)
      gemv_rows<1>(xp + r * in_features, in_features, pp, ap, tp, in_features, block, op + r * out_features,
                   out_features, first, last);
  });
  return out;
}

void dequantize_rows(torch::Tensor packed, torch::Tensor absmax, torch::Tensor table, int64_t block,
                     int64_t first_row, torch::Tensor out) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == torch::kFloat && out.is_contiguous(), "out: contiguous float32");
  const int64_t in_features = out.size(1), rows = out.size(0);
  TORCH_CHECK(block % 16 == 0 && in_features % block == 0, "block must be a multiple of 16 dividing in_features");
  TORCH_CHECK(packed.numel() >= (first_row + rows) * in_features / 2, "rows beyond the packed weight");
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* ap = absmax.data_ptr<float>();
  const float* tp = table.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks_per_row = in_features / block;
  at::parallel_for(0, rows, 8, [&](int64_t first, int64_t last) {
    const __m256 low_table = _mm256_loadu_ps(tp);
    const __m256 high_table = _mm256_loadu_ps(tp + 8);
    for (int64_t i = first; i < last; ++i) {
      const int64_t n = first_row + i;
      float* row_out = op + i * in_features;
      for (int64_t b = 0; b < blocks_per_row; ++b) {
        const __m256 scale = _mm256_set1_ps(ap[n * blocks_per_row + b]);
        for (int64_t k = b * block; k < (b + 1) * block; k += 16) {
          __m256 w0, w1;
          decode16(pp + (n * in_features + k) / 2, low_table, high_table, w0, w1);
          _mm256_storeu_ps(row_out + k, _mm256_mul_ps(w0, scale));
          _mm256_storeu_ps(row_out + k + 8, _mm256_mul_ps(w1, scale));
        }
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kbit4_gemv", &kbit4_gemv, "4-bit weight-only linear, weights decoded in registers (AVX2)");
  m.def("dequantize_rows", &dequantize_rows, "4-bit weights of out.size(0) output rows from first_row into out (AVX2)");
}
