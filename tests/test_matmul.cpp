// matmul / matmul_rows for every weight type on both SIMD paths: accuracy against a double
// reference, agreement between paths, and bit-exact batch / thread / row-range invariance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "specmesh/kernels/aligned_buffer.hpp"
#include "specmesh/kernels/ggml_types.hpp"
#include "specmesh/kernels/matmul.hpp"
#include "specmesh/kernels/packed_weights.hpp"
#include "specmesh/kernels/quant.hpp"
#include "specmesh/kernels/thread_pool.hpp"

#include "isa.hpp"

namespace specmesh {
namespace {

using test::isas;

constexpr DType kAllTypes[] = {DType::F32, DType::F16, DType::Q4_0, DType::Q8_0, DType::Q4_K, DType::Q6_K, DType::BF16};

bool is_kquant(DType t) { return t == DType::Q4_K || t == DType::Q6_K; }
bool is_int_dot(DType t) { return t == DType::Q4_0 || t == DType::Q8_0; }

class MatmulTest : public test::IsaTest {};

struct Matrix {
  DType type;
  size_t rows, cols;
  std::vector<uint8_t> data;
  std::vector<float> deq;  // the exact values the kernels must use
  std::shared_ptr<PackedWeights> packed;  // read when present by AVX-512, and by AVX2 for Q4_0
  WeightView view() const {
    WeightView v{type, data.data(), rows, cols};
    if (packed) v.packed = packed->data();
    return v;
  }
};

// Q8_0 / Q4_0 / Q4_K / Q6_K matrices come with their packed copy (as a loaded model's do) unless
// `pack` is false, which leaves the SIMD paths their row-major kernels.
Matrix make_matrix(DType t, size_t rows, size_t cols, uint32_t seed, bool pack = true) {
  Matrix m{t, rows, cols, std::vector<uint8_t>(rows * row_bytes(t, cols)), std::vector<float>(rows * cols), nullptr};
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<float> row(cols);
  for (size_t r = 0; r < rows; ++r) {
    for (auto& v : row) v = dist(rng);
    uint8_t* dst = m.data.data() + r * row_bytes(t, cols);
    quantize_row(t, row.data(), dst, cols);
    dequantize_row(t, dst, m.deq.data() + r * cols, cols);
  }
  if (pack && PackedWeights::packable(t)) m.packed = std::make_shared<PackedWeights>(m.view());
  return m;
}

std::vector<float> activations(size_t n_tokens, size_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n_tokens * cols);
  for (auto& v : x) v = dist(rng);
  return x;
}

// Tolerance for one output, from the standard bound on floating-point summation.
// The kernels keep 8 interleaved partial sums (one per SIMD lane or scalar lane) combined
// by a 3-level tree, so each product passes through at most cols/8 + 3 additions; each
// rounds by at most u = 2^-24, giving |err| <= (cols/8 + 3) * u * sum|w_i x_i| to first
// order. (The integer types sum 32 exact products per block first, so fewer roundings;
// packed Q8_0 / Q4_0 weights then add one block at a time, cols/32 additions.)
// A factor 2 covers the product roundings and second-order terms.
//
// For Q8_0/Q4_0 weights, packed Q4_K / Q6_K on the SIMD paths and Q4_K on every SIMD path,
// the activations are quantised per 32-block to d*q with d = amax/127, |x - d*q| <= d/2,
// adding sum_b (d_b/2) * sum_{i in b} |w_i|.
bool quantizes_activations(const Matrix& m) {
  const std::string isa = matmul_isa();
  return is_int_dot(m.type) || (m.packed && matmul_reads_packed(m.type)) || (m.type == DType::Q4_K && isa != "scalar");
}

// BF16 weights on AVX-512 BF16 meet activations rounded to bf16 (8 significant bits, to
// nearest): |x - bf16(x)| <= 2^-8 |x|,
// adding 2^-8 * sum |w_i x_i|.
bool rounds_activations_to_bf16(const Matrix& m) { return m.type == DType::BF16 && matmul_bf16_dot(); }

double tolerance(const Matrix& m, size_t r, const float* x) {
  const float* w = m.deq.data() + r * m.cols;
  double abs_sum = 0;
  for (size_t i = 0; i < m.cols; ++i) abs_sum += std::fabs(double(w[i]) * x[i]);
  double tol = 2.0 * (double(m.cols) / 8 + 3) * std::ldexp(1.0, -24) * abs_sum;
  if (rounds_activations_to_bf16(m)) tol += std::ldexp(1.0, -8) * abs_sum * (1 + 1e-4);
  if (quantizes_activations(m)) {
    for (size_t b = 0; b < m.cols; b += 32) {
      double amax = 0, wsum = 0;
      for (size_t i = b; i < b + 32; ++i) {
        amax = std::max(amax, double(std::fabs(x[i])));
        wsum += std::fabs(double(w[i]));
      }
      tol += (amax / 127 / 2) * wsum * (1 + 1e-4);  // slack for the rounding of x * (1/d)
    }
  }
  return tol + 1e-30;
}

double reference(const Matrix& m, size_t r, const float* x) {
  double s = 0;
  for (size_t i = 0; i < m.cols; ++i) s += double(m.deq[r * m.cols + i]) * x[i];
  return s;
}

std::vector<float> run(const Matrix& m, const std::vector<float>& x, size_t n_tokens, ThreadPool& pool) {
  std::vector<float> y(n_tokens * m.rows, -1.0f);
  matmul(m.view(), x.data(), n_tokens, y.data(), pool);
  return y;
}

size_t cols_for(DType t, bool ragged) {
  if (is_kquant(t)) return 512;
  if (is_int_dot(t)) return 320;
  return ragged ? 172 : 256;  // 172: a stories260K ffn_down row, not a multiple of 8
}

TEST_F(MatmulTest, IsaSelection) {
  const std::string def = matmul_isa();
  EXPECT_TRUE(def == "avx512" || def == "avx2" || def == "scalar");
  EXPECT_FALSE(matmul_set_isa("sse9"));
  EXPECT_EQ(std::string(matmul_isa()), def);
  EXPECT_TRUE(matmul_set_isa("scalar"));
  EXPECT_STREQ(matmul_isa(), "scalar");
  EXPECT_TRUE(matmul_set_isa("auto"));
  EXPECT_EQ(std::string(matmul_isa()), def);
  const char* env = std::getenv("SPECMESH_ISA");
  if (env != nullptr && std::string(env) == "scalar") EXPECT_EQ(def, "scalar");
  if (env != nullptr && std::string(env) == "avx2") EXPECT_NE(def, "avx512");
  if (env == nullptr) EXPECT_EQ(def, isas().back()) << "the default is the best path the CPU runs";
  EXPECT_FALSE(matmul_set_isa("avx5120"));
}

TEST_F(MatmulTest, MatchesDoubleReference) {
  ThreadPool pool(2);
  for (const auto& isa : isas()) {
    use(isa);
    for (DType t : kAllTypes) {
      for (bool ragged : {false, true}) {
        const size_t rows = 37, cols = cols_for(t, ragged), n = 5;
        const Matrix m = make_matrix(t, rows, cols, 100 + uint32_t(t));
        const auto x = activations(n, cols, 7);
        const auto y = run(m, x, n, pool);
        for (size_t tok = 0; tok < n; ++tok) {
          for (size_t r = 0; r < rows; ++r) {
            const float* xt = x.data() + tok * cols;
            ASSERT_NEAR(y[tok * rows + r], reference(m, r, xt), tolerance(m, r, xt))
                << isa << " " << dtype_name(t) << " cols " << cols << " token " << tok << " row " << r;
          }
        }
      }
    }
  }
}

// The quantised-activation error bound above is loose; check that Q8_0/Q4_0 results are
// typically much closer than it, so a sloppy activation quantiser would be caught.
TEST_F(MatmulTest, IntegerDotTypicalErrorIsSmall) {
  ThreadPool pool(1);
  for (const auto& isa : isas()) {
    use(isa);
    for (DType t : {DType::Q8_0, DType::Q4_0, DType::Q4_K}) {
      const Matrix m = make_matrix(t, 64, 1024, 3);
      const auto x = activations(1, 1024, 4);
      const auto y = run(m, x, 1, pool);
      double err2 = 0, ref2 = 0;
      for (size_t r = 0; r < m.rows; ++r) {
        const double ref = reference(m, r, x.data());
        err2 += (y[r] - ref) * (y[r] - ref);
        ref2 += ref * ref;
      }
      // 8-bit activations: ~0.5% relative error per value, averaging down over the row.
      EXPECT_LT(std::sqrt(err2 / ref2), 0.01) << isa << " " << dtype_name(t);
    }
  }
}

// x = unit vectors: each output is exactly one weight (all other products are +-0), so
// the kernels' weight decoding must equal dequantize_row bit for bit.
TEST_F(MatmulTest, UnitVectorsExtractExactWeights) {
  ThreadPool pool(2);
  for (const auto& isa : isas()) {
    use(isa);
    for (DType t : kAllTypes) {
      const size_t rows = 11, cols = cols_for(t, true);
      const Matrix m = make_matrix(t, rows, cols, 55);
      if (quantizes_activations(m)) continue;  // their activations are rescaled by quantisation
      std::vector<float> x(cols * cols, 0.0f);
      for (size_t i = 0; i < cols; ++i) x[i * cols + i] = 1.0f;
      const auto y = run(m, x, cols, pool);
      for (size_t i = 0; i < cols; ++i)
        for (size_t r = 0; r < rows; ++r)
          ASSERT_EQ(y[i * rows + r], m.deq[r * cols + i]) << isa << " " << dtype_name(t) << " r " << r << " i " << i;
    }
  }
}

TEST_F(MatmulTest, SimdPathsAgreeWithScalar) {
  if (isas().size() < 2) GTEST_SKIP() << "no AVX2/FMA/F16C on this CPU";
  ThreadPool pool(2);
  for (DType t : kAllTypes) {
    const size_t rows = 70, cols = is_kquant(t) ? 1024 : 1024 + (is_int_dot(t) ? 0 : 4), n = 3;
    const Matrix m = make_matrix(t, rows, cols, 9);
    const auto x = activations(n, cols, 10);
    use("scalar");
    const auto ys = run(m, x, n, pool);
    for (const auto& isa : isas()) {
    use(isa);
    const auto ya = run(m, x, n, pool);
    for (size_t tok = 0; tok < n; ++tok) {
      for (size_t r = 0; r < rows; ++r) {
        // Where both paths quantise activations (identically), only summation order differs:
        // the float-summation part of the tolerance, for each path. Q4_K on the SIMD paths
        // quantises them and the portable path does not: the whole tolerance.
        const float* xt = x.data() + tok * cols;
        double abs_sum = 0;
        for (size_t i = 0; i < cols; ++i) abs_sum += std::fabs(double(m.deq[r * cols + i]) * xt[i]);
        const double tol = (quantizes_activations(m) && !is_int_dot(t)) || rounds_activations_to_bf16(m)
                               ? 2 * tolerance(m, r, xt)
                               : 4.0 * (double(cols) / 8 + 3) * std::ldexp(1.0, -24) * abs_sum;
        ASSERT_NEAR(ya[tok * rows + r], ys[tok * rows + r], tol)
            << isa << " " << dtype_name(t) << " token " << tok << " row " << r;
      }
    }
    }
  }
}

// The AVX2 panel kernels add each block's exact integer sum into the same float steps, in the
// same order, as the AVX-512 ones (matmul_packed_avx2.cpp): the two paths give the same bits.
// Runs only where the CPU has AVX-512.
TEST_F(MatmulTest, PackedPanelsGiveTheSameBitsOnAvx2AndAvx512) {
  const auto paths = isas();
  if (std::find(paths.begin(), paths.end(), "avx512") == paths.end()) GTEST_SKIP() << "no AVX-512 on this CPU";
  ThreadPool pool(2);
  for (DType t : {DType::Q4_0, DType::Q4_K, DType::Q6_K}) {
    const Matrix m = make_matrix(t, 70, 1024, 31);
    const auto x = activations(5, 1024, 32);
    for (size_t n : {size_t(1), size_t(5)}) {
      use("avx2");
      const auto a = run(m, x, n, pool);
      use("avx512");
      const auto b = run(m, x, n, pool);
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << dtype_name(t) << " n_tokens " << n;
    }
  }
}

// The determinism contract: a batch equals single-token calls bit for bit, for any thread
// count, batch size 1..16 and row count (which changes how tiles fall). 133 rows x 512 cols
// is above the single-thread cutoff, so two threads really split; odd block counts (Q4_0,
// Q8_0 at 480 cols) take the AVX-512 kernels' half-pair tail.
TEST_F(MatmulTest, BatchEqualsSingleTokenBitwise) {
  ThreadPool pool1(1), pool2(2);
  constexpr size_t kMaxBatch = 16;
  for (const auto& isa : isas()) {
    use(isa);
    for (DType t : kAllTypes) {
      for (size_t cols : {size_t(512), is_kquant(t) ? size_t(256) : is_int_dot(t) ? size_t(480) : size_t(172)}) {
      for (bool pack : {true, false}) {
        if (!pack && !PackedWeights::packable(t)) continue;
        const size_t rows = 133;
        const Matrix m = make_matrix(t, rows, cols, 21, pack);
        const auto x = activations(kMaxBatch, cols, 22);
        std::vector<float> single(kMaxBatch * rows);
        for (size_t tok = 0; tok < kMaxBatch; ++tok)
          matmul(m.view(), x.data() + tok * cols, 1, single.data() + tok * rows, pool1);
        for (size_t n = 1; n <= kMaxBatch; ++n) {
          for (ThreadPool* pool : {&pool1, &pool2}) {
            const auto y = run(m, x, n, *pool);
            ASSERT_EQ(std::memcmp(y.data(), single.data(), n * rows * sizeof(float)), 0)
                << isa << " " << dtype_name(t) << (pack ? " packed" : "") << " cols " << cols << " n_tokens " << n
                << " threads " << pool->size();
          }
        }
        // A batch that starts elsewhere: tokens 3.. of the same activations.
        const auto y = run(m, std::vector<float>(x.begin() + 3 * cols, x.end()), kMaxBatch - 3, pool2);
        ASSERT_EQ(std::memcmp(y.data(), single.data() + 3 * rows, (kMaxBatch - 3) * rows * sizeof(float)), 0)
            << isa << " " << dtype_name(t) << " offset batch" << (pack ? " packed" : "");
      }
      }
    }
  }
}

TEST_F(MatmulTest, RowRangesMatchFullProduct) {
  ThreadPool pool(2);
  for (const auto& isa : isas()) {
    use(isa);
    for (DType t : kAllTypes) {
      const size_t rows = 133, cols = 512, n = 3;
      const Matrix m = make_matrix(t, rows, cols, 31);
      const auto x = activations(n, cols, 32);
      const auto full = run(m, x, n, pool);
      const std::pair<size_t, size_t> ranges[] = {{0, 133}, {5, 77}, {0, 1}, {132, 133}, {64, 131}, {17, 18}};
      for (auto [b, e] : ranges) {
        const size_t k = e - b;
        std::vector<float> y(n * k, -1.0f);
        matmul_rows(m.view(), b, e, x.data(), n, y.data(), pool);
        for (size_t tok = 0; tok < n; ++tok)
          ASSERT_EQ(std::memcmp(y.data() + tok * k, full.data() + tok * rows + b, k * sizeof(float)), 0)
              << isa << " " << dtype_name(t) << " rows [" << b << ", " << e << ") token " << tok;
      }
      std::vector<float> untouched(4, 42.0f);
      matmul_rows(m.view(), 40, 40, x.data(), n, untouched.data(), pool);
      EXPECT_EQ(untouched, std::vector<float>(4, 42.0f));
    }
  }
}

TEST_F(MatmulTest, OddShapes) {
  ThreadPool pool(2);
  for (const auto& isa : isas()) {
    use(isa);
    for (DType t : kAllTypes) {
      // 1 row, 3 rows, 31 rows; plus a tall matrix whose row count is not a tile multiple.
      for (size_t rows : {size_t(1), size_t(3), size_t(31), size_t(1001)}) {
        const size_t cols = is_kquant(t) ? 256 : is_int_dot(t) ? 96 : 13;
        const Matrix m = make_matrix(t, rows, cols, uint32_t(rows));
        const auto x = activations(6, cols, 77);
        const auto y = run(m, x, 6, pool);
        for (size_t tok = 0; tok < 6; ++tok)
          for (size_t r = 0; r < rows; ++r) {
            const float* xt = x.data() + tok * cols;
            ASSERT_NEAR(y[tok * rows + r], reference(m, r, xt), tolerance(m, r, xt))
                << isa << " " << dtype_name(t) << " rows " << rows << " token " << tok << " row " << r;
          }
      }
    }
  }
}

// Big enough for the blocked (row block x token block) loops to take several blocks.
TEST_F(MatmulTest, LargeBatchMatchesReference) {
  ThreadPool pool(2);
  for (const auto& isa : isas()) {
    use(isa);
    for (DType t : {DType::F16, DType::Q8_0, DType::Q4_0, DType::Q4_K}) {
      const size_t rows = 96, cols = 2048, n = 70;
      const Matrix m = make_matrix(t, rows, cols, 41);
      const auto x = activations(n, cols, 42);
      const auto y = run(m, x, n, pool);
      for (size_t tok = 0; tok < n; tok += 3)
        for (size_t r = 0; r < rows; ++r) {
          const float* xt = x.data() + tok * cols;
          ASSERT_NEAR(y[tok * rows + r], reference(m, r, xt), tolerance(m, r, xt))
              << isa << " " << dtype_name(t) << " token " << tok << " row " << r;
        }
      std::vector<float> one(rows);
      matmul(m.view(), x.data() + 69 * cols, 1, one.data(), pool);
      ASSERT_EQ(std::memcmp(one.data(), y.data() + 69 * rows, rows * sizeof(float)), 0) << isa << " " << dtype_name(t);
    }
  }
}

// The kernels' memory: 64-byte aligned, 2 MiB aligned from 2 MiB on, zeroed unless asked not
// to (then only past the requested bytes), and the same address after a move.
TEST(AlignedBuffer, AlignsZeroesAndMoves) {
  for (size_t bytes : {size_t(1), size_t(100), size_t(4096), size_t(3) << 20}) {
    AlignedBuffer b(bytes);
    ASSERT_EQ(b.size(), bytes);
    const size_t align = bytes >= (size_t(2) << 20) ? (size_t(2) << 20) : 64;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % align, 0u) << bytes;
    for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(b.data()[i], 0) << bytes << " " << i;
    const uint8_t* at = b.data();
    AlignedBuffer moved = std::move(b);
    EXPECT_EQ(moved.data(), at);
  }
  AlignedBuffer raw(100, /*zero=*/false);
  for (size_t i = 100; i < 128; ++i) EXPECT_EQ(raw.data()[i], 0) << i;  // the padding
}

TEST_F(MatmulTest, RejectsBadArguments) {
  ThreadPool pool(1);
  std::vector<uint8_t> data(64 * 64 * 4);
  std::vector<float> x(64), y(64);
  EXPECT_THROW(matmul(WeightView{DType::Q4_0, data.data(), 2, 48}, x.data(), 1, y.data(), pool), std::invalid_argument);
  EXPECT_THROW(matmul(WeightView{DType::Q6_K, data.data(), 2, 128}, x.data(), 1, y.data(), pool), std::invalid_argument);
  EXPECT_THROW(matmul(WeightView{static_cast<DType>(3), data.data(), 2, 32}, x.data(), 1, y.data(), pool),
               std::invalid_argument);
  EXPECT_THROW(matmul_rows(WeightView{DType::F32, data.data(), 4, 8}, 2, 5, x.data(), 1, y.data(), pool),
               std::out_of_range);
  EXPECT_THROW(matmul_rows(WeightView{DType::F32, data.data(), 4, 8}, 3, 2, x.data(), 1, y.data(), pool),
               std::out_of_range);
  // Only Q8_0, Q4_0, Q4_K and Q6_K have a packed form, of rows of whole blocks.
  EXPECT_THROW(PackedWeights(WeightView{DType::F16, data.data(), 2, 32}), std::invalid_argument);
  EXPECT_THROW(PackedWeights(WeightView{DType::BF16, data.data(), 2, 32}), std::invalid_argument);
  EXPECT_THROW(PackedWeights(WeightView{DType::Q6_K, data.data(), 1, 128}), std::invalid_argument);
  EXPECT_THROW(PackedWeights(WeightView{DType::Q8_0, data.data(), 2, 48}), std::invalid_argument);
}

}  // namespace
}  // namespace specmesh
