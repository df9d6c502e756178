// Weight-type matmul throughput: gemv (decode, one token) in GB/s of weights streamed, and
// a 32-token gemm, on a 5632 x 2048 matrix (a TinyLlama-class ffn_up) at 1 and 2 threads.
//
// "hot" runs the same matrix every iteration, so it may sit in the last-level cache and
// shows the kernel's own speed; "cold" cycles through copies totalling SPECMESH_BENCH_MB
// (default 512) so weights come from DRAM, as in real decoding. mem_read gives the plain
// DRAM read bandwidth to compare against.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "specmesh/kernels/ggml_types.hpp"
#include "specmesh/kernels/matmul.hpp"
#include "specmesh/kernels/packed_weights.hpp"
#include "specmesh/kernels/quant.hpp"
#include "specmesh/kernels/thread_pool.hpp"

#include "bench_util.hpp"

namespace {

using namespace specmesh;
using bench::pool;

constexpr size_t kRows = 5632, kCols = 2048;

size_t cold_bytes() {
  const char* env = std::getenv("SPECMESH_BENCH_MB");
  const size_t mb = env != nullptr ? std::strtoull(env, nullptr, 10) : 512;
  return std::max<size_t>(mb, 1) << 20;
}

// One type's weights at a time (the cold set is large): copy 0 is quantised from Gaussian
// values, the others are byte copies of it. A type the current path reads packed (as a loaded
// model's matrices are, PackedWeights) gets packed copies instead, all packed from copy 0.
struct WeightSet {
  DType type{};
  size_t matrix_bytes = 0;
  size_t copies = 0;
  std::vector<uint8_t> data;
  std::vector<PackedWeights> packed;
  WeightView view(size_t i) const {
    if (packed.empty()) return WeightView{type, data.data() + (i % copies) * matrix_bytes, kRows, kCols};
    WeightView v{type, data.data(), kRows, kCols};
    v.packed = packed[i % copies].data();
    return v;
  }
};

// Hot runs use copy 0 of the same set, so switching between hot and cold costs nothing.
const WeightSet& weights(DType t) {
  static WeightSet set;
  const bool pack = PackedWeights::wanted(t);
  if (set.copies != 0 && set.type == t && set.packed.empty() == !pack) return set;
  set = WeightSet{};
  set.type = t;
  set.matrix_bytes = kRows * row_bytes(t, kCols);
  set.copies = std::max<size_t>(1, (cold_bytes() + set.matrix_bytes - 1) / set.matrix_bytes);
  set.data.resize((pack ? 1 : set.copies) * set.matrix_bytes);
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  std::vector<float> row(kCols);
  const size_t rb = row_bytes(t, kCols);
  for (size_t r = 0; r < kRows; ++r) {
    for (auto& v : row) v = dist(rng);
    quantize_row(t, row.data(), set.data.data() + r * rb, kCols);
  }
  if (pack) {
    set.packed.reserve(set.copies);
    for (size_t c = 0; c < set.copies; ++c) set.packed.emplace_back(WeightView{t, set.data.data(), kRows, kCols});
    return set;
  }
  for (size_t c = 1; c < set.copies; ++c)
    std::memcpy(set.data.data() + c * set.matrix_bytes, set.data.data(), set.matrix_bytes);
  return set;
}

std::vector<float> activations(size_t n) {
  std::mt19937 rng(2);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n * kCols);
  for (auto& v : x) v = dist(rng);
  return x;
}

void run_matmul(benchmark::State& state, DType t, int threads, size_t n_tokens, bool cold) {
  const WeightSet& w = weights(t);
  ThreadPool& tp = pool(threads);
  const auto x = activations(n_tokens);
  std::vector<float> y(n_tokens * kRows);
  size_t i = 0;
  for (auto _ : state) {
    matmul(w.view(cold ? i++ : 0), x.data(), n_tokens, y.data(), tp);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  const double iters = double(state.iterations());
  state.counters["GB/s"] = benchmark::Counter(iters * double(w.matrix_bytes) / 1e9, benchmark::Counter::kIsRate);
  state.counters["GFLOP/s"] =
      benchmark::Counter(iters * 2.0 * kRows * kCols * double(n_tokens) / 1e9, benchmark::Counter::kIsRate);
  const size_t copies = cold ? w.copies : 1;
  state.SetLabel(std::string(matmul_isa()) + (w.packed.empty() ? ", " : " packed, ") + std::to_string(copies) +
                 (copies == 1 ? " copy" : " copies"));
}

// Sums a large buffer with the pool: the DRAM read bandwidth the gemv numbers compare to.
void mem_read(benchmark::State& state, int threads) {
  static std::vector<uint64_t> buf;
  if (buf.size() * sizeof(uint64_t) != cold_bytes()) buf.assign(cold_bytes() / sizeof(uint64_t), 1);
  ThreadPool& tp = pool(threads);
  std::vector<uint64_t> sums(size_t(threads) * 8);
  for (auto _ : state) {
    tp.run([&](int ith, int nth) {
      const size_t n = buf.size(), b = n * size_t(ith) / size_t(nth), e = n * size_t(ith + 1) / size_t(nth);
      sums[size_t(ith) * 8] = bench::read_sum(buf.data(), b, e);
    });
    benchmark::DoNotOptimize(sums.data());
  }
  state.counters["GB/s"] =
      benchmark::Counter(double(state.iterations()) * double(cold_bytes()) / 1e9, benchmark::Counter::kIsRate);
}

void register_all() {
  const DType types[] = {DType::F32, DType::F16, DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K};
  for (int threads : {1, 2})
    benchmark::RegisterBenchmark(("mem_read/threads:" + std::to_string(threads)).c_str(),
                                 [threads](benchmark::State& s) { mem_read(s, threads); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  for (DType t : types) {
    const std::string name(dtype_name(t));
    for (bool cold : {true, false})
      for (int threads : {1, 2})
        benchmark::RegisterBenchmark(
            ("gemv/" + name + "/threads:" + std::to_string(threads) + (cold ? "/cold" : "/hot")).c_str(),
            [=](benchmark::State& s) { run_matmul(s, t, threads, 1, cold); })
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
    for (int threads : {1, 2})
      benchmark::RegisterBenchmark(("gemm32/" + name + "/threads:" + std::to_string(threads)).c_str(),
                                   [=](benchmark::State& s) { run_matmul(s, t, threads, 32, false); })
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
