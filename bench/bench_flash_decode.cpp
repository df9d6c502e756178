// Speculative flash decode (ALSpec: full + speculative output + fused lambda check) against the
// same kernel without speculation, for one decode token of one layer with the Llama-3.1-8B
// attention shape (32 query heads, 8 KV heads, head_dim 128, fp32 KV), at 4K-32K context and
// 1 and 2 threads. "sequential" is textbook flash decode for reference: the same partial and
// combine routines over chunks [0, n) in order, without the sink/window layout.
//
// After the Google Benchmark runs, the three variants are timed again interleaved, round by
// round, and the table gives median times and the median per-round ratio, so the ratios come
// from the same run under the same load. SPECMESH_BENCH_ROUNDS sets the rounds (default 15).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "specmesh/kernels/aligned_buffer.hpp"
#include "specmesh/kernels/flash_decode.hpp"
#include "specmesh/kernels/ggml_types.hpp"
#include "specmesh/kernels/kv_rows.hpp"
#include "specmesh/kernels/matmul.hpp"
#include "specmesh/kernels/thread_pool.hpp"

#include "bench_util.hpp"

namespace {

using namespace specmesh;
using bench::median;
using bench::pool;

constexpr HeadShape kShape{32, 8, 128};
constexpr size_t kContexts[] = {4096, 8192, 16384, 32768};
constexpr size_t kMaxContext = 32768;

// One layer's KV cache at the largest context (shorter contexts use its first rows) and one
// token's queries.
struct Data {
  size_t stride = size_t(kShape.n_head_kv) * kShape.head_dim;
  std::vector<float> k, v, q;
  std::vector<int32_t> cells;
  float scale = 1.0f / std::sqrt(float(kShape.head_dim));
  KvRows kv() const { return KvRows{k.data(), v.data(), stride}; }
};

const Data& data() {
  static const Data d = [] {
    Data d;
    std::mt19937 rng(3);
    std::normal_distribution<float> g(0.0f, 1.0f);
    d.k.resize(kMaxContext * d.stride);
    d.v.resize(kMaxContext * d.stride);
    d.q.resize(size_t(kShape.n_head) * kShape.head_dim);
    for (auto* vec : {&d.k, &d.v, &d.q})
      for (auto& x : *vec) x = g(rng);
    d.cells.resize(kMaxContext);
    std::iota(d.cells.begin(), d.cells.end(), 0);
    return d;
  }();
  return d;
}

enum class Variant { Plain, Spec, Sequential };
const char* name(Variant v) { return v == Variant::Plain ? "plain" : v == Variant::Spec ? "speculative" : "sequential"; }

struct Outputs {
  std::vector<float> full = std::vector<float>(size_t(kShape.n_head) * kShape.head_dim);
  std::vector<float> spec = full;
  FlashPartials parts;
};

void sequential(const Data& d, size_t n, ThreadPool& tp, Outputs& out) {
  const size_t chunk = FlashLayout{}.chunk, slots = (n + chunk - 1) / chunk;
  const int group = kShape.n_head / kShape.n_head_kv, D = kShape.head_dim;
  out.parts.reset(slots, kShape.n_head, D);
  tp.run([&](int ith, int nth) {
    for (size_t s = slots * size_t(ith) / size_t(nth); s < slots * size_t(ith + 1) / size_t(nth); ++s) {
      const size_t b = s * chunk, e = std::min(n, b + chunk);
      flash_partial(d.q.data(), kShape.n_head, group, d.kv(), 0, d.scale, d.cells.data() + b, e - b, out.parts, s);
    }
  });
  for (int h = 0; h < kShape.n_head; ++h) {
    float* o = out.full.data() + size_t(h) * D;
    float m, l;
    flash_combine(out.parts, 0, slots, h, o, m, l);
    for (int i = 0; i < D; ++i) o[i] /= l;
  }
}

void run_once(Variant v, size_t n, ThreadPool& tp, Outputs& out) {
  const Data& d = data();
  switch (v) {
    case Variant::Plain:
      flash_decode(d.q.data(), kShape, d.scale, d.kv(), d.cells.data(), n, out.full.data(), FlashLayout{}, &tp);
      break;
    case Variant::Spec: {
      const SpecCheck c = speculative_flash_decode(d.q.data(), kShape, d.scale, d.kv(), d.cells.data(), n,
                                                   out.full.data(), out.spec.data(), SpecConfig{}, &tp);
      benchmark::DoNotOptimize(c);
      break;
    }
    case Variant::Sequential:
      sequential(d, n, tp, out);
      break;
  }
  benchmark::DoNotOptimize(out.full.data());
  benchmark::ClobberMemory();
}

void measure(benchmark::State& state, Variant v, size_t n, int threads) {
  ThreadPool& tp = pool(threads);
  Outputs out;
  for (auto _ : state) run_once(v, n, tp, out);
  const double kv_bytes = 2.0 * double(n) * double(data().stride) * sizeof(float);
  state.counters["GB/s"] = benchmark::Counter(double(state.iterations()) * kv_bytes / 1e9, benchmark::Counter::kIsRate);
  state.SetLabel(matmul_isa());
}

// Interleaved timing: each round runs every variant once, in an order that rotates per round.
// Timed rounds per table row: SPECMESH_BENCH_ROUNDS, at least 3 (default 15).
int timing_rounds() {
  const char* env = std::getenv("SPECMESH_BENCH_ROUNDS");
  return std::max(3, env != nullptr ? std::atoi(env) : 15);
}

void ratio_table() {
  const int rounds = timing_rounds();
  const Variant variants[] = {Variant::Plain, Variant::Spec, Variant::Sequential};
  std::printf("\nspeculative flash decode overhead, %d/%d heads, head_dim %d, S = %zu, chunk = %zu, %s, %d rounds\n",
              kShape.n_head, kShape.n_head_kv, kShape.head_dim, FlashLayout{}.spec_len, FlashLayout{}.chunk,
              matmul_isa(), rounds);
  std::printf("%8s %7s %10s %10s %10s %11s %11s\n", "context", "threads", "plain ms", "spec ms", "seq ms",
              "spec/plain", "spec/seq");
  Outputs out;
  for (int threads : {1, 2}) {
    ThreadPool& tp = pool(threads);
    for (size_t n : kContexts) {
      std::map<Variant, std::vector<double>> ms;
      std::vector<double> r_plain, r_seq;
      for (Variant v : variants) run_once(v, n, tp, out);  // warm-up
      for (int r = 0; r < rounds; ++r) {
        std::map<Variant, double> t;
        for (int i = 0; i < 3; ++i) {
          const Variant v = variants[(i + r) % 3];
          const auto t0 = std::chrono::steady_clock::now();
          run_once(v, n, tp, out);
          t[v] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
          ms[v].push_back(t[v]);
        }
        r_plain.push_back(t[Variant::Spec] / t[Variant::Plain]);
        r_seq.push_back(t[Variant::Spec] / t[Variant::Sequential]);
      }
      std::printf("%8zu %7d %10.3f %10.3f %10.3f %11.3f %11.3f\n", n, threads, median(ms[Variant::Plain]),
                  median(ms[Variant::Spec]), median(ms[Variant::Sequential]), median(r_plain), median(r_seq));
    }
  }
}

// What bounds long-context decode: the decode shape of bench_decode's tinyllama-1.1b preset (32
// query heads, 4 KV heads of 64, 22 layers), 2 threads, the keys and values read as KV bytes
// per second in two places, for an F16 cache and a Q8_0 one. In cache: one layer of 4096 keys
// (4 MiB of F16, within the two cores' L2 and the L3) again and again, so the rate is the
// kernel's compute (fewer keys would time the pool's wake-up and the merge more than the
// kernel). From memory: 22 layers of 16384 keys (360 MiB of F16) in turn, as a decode step
// reads them, so nothing stays cached between passes. If the first rate is not well above the
// second, or is below the machine's read bandwidth (measured last), the kernel's arithmetic and
// not the memory bounds decode at depth.
void ceiling_table() {
  constexpr HeadShape shape{32, 4, 64};
  constexpr int kLayers = 22;
  const size_t stride = size_t(shape.n_head_kv) * shape.head_dim;
  const int rounds = timing_rounds();
  ThreadPool& tp = pool(2);
  std::mt19937 rng(5);
  std::normal_distribution<float> g(0.0f, 1.0f);  // as data()'s keys, values and queries
  std::vector<float> q(size_t(shape.n_head) * shape.head_dim), out(q.size()), row(stride);
  for (auto& x : q) x = g(rng);
  const float scale = 1.0f / std::sqrt(float(shape.head_dim));
  std::printf("\nKV decode ceiling, %d/%d heads, head_dim %d, %s, 2 threads, %d rounds\n", shape.n_head,
              shape.n_head_kv, shape.head_dim, matmul_isa(), rounds);
  std::printf("%-6s %-34s %10s %12s %10s\n", "cache", "where the keys are", "keys", "ms / layer", "KV GB/s");
  const struct { const char* where; size_t n; int layers; } cases[] = {
      {"in cache (one layer, again)", 4096, 1}, {"from memory (22 layers in turn)", 16384, kLayers}};
  std::vector<double> in_cache;
  for (DType type : {DType::F16, DType::Q8_0}) {
    const size_t row_bytes = kv_row_bytes(type, stride);
    double rate[2] = {0, 0};
    for (int c = 0; c < 2; ++c) {
      const size_t n = cases[c].n;
      const int layers = cases[c].layers;
      // Allocated as the KV cache allocates its layers (AlignedBuffer: huge pages where the
      // kernel gives them), so the rows cost the same page walks.
      std::vector<AlignedBuffer> k, v;
      for (int l = 0; l < layers; ++l) {
        k.emplace_back(n * row_bytes, false);
        v.emplace_back(n * row_bytes, false);
        for (AlignedBuffer* b : {&k.back(), &v.back()})
          for (size_t r = 0; r < n; ++r) {
            for (auto& x : row) x = g(rng);
            kv_store(type, row.data(), stride, b->data() + r * row_bytes);
          }
      }
      std::vector<int32_t> cells(n);
      std::iota(cells.begin(), cells.end(), 0);
      const int calls = kLayers;  // per round, in both cases
      std::vector<double> ms;
      for (int r = 0; r <= rounds; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < calls; ++i) {
          const size_t l = size_t(i % layers);
          flash_decode(q.data(), shape, scale, KvRows{k[l].data(), v[l].data(), stride, type}, cells.data(), n,
                       out.data(), FlashLayout{}, &tp);
        }
        const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (r > 0) ms.push_back(t / calls);  // round 0 warms up
      }
      const double per_layer = median(ms);
      rate[c] = 2.0 * double(n) * double(row_bytes) / (per_layer * 1e6);
      std::printf("%-6s %-34s %10zu %12.3f %10.1f\n", kv_type_name(type).c_str(), cases[c].where, n, per_layer, rate[c]);
    }
    std::printf("%-6s in cache / from memory %.2fx\n", kv_type_name(type).c_str(), rate[0] / rate[1]);
    in_cache.push_back(rate[0]);
  }
  const double bw = bench::read_bandwidth(tp, size_t(1) << 30);
  std::printf("read bandwidth %.1f GB/s; in cache / read bandwidth: f16 %.2fx, q8_0 %.2fx\n", bw, in_cache[0] / bw,
              in_cache[1] / bw);
}

void register_all() {
  for (Variant v : {Variant::Plain, Variant::Spec, Variant::Sequential})
    for (int threads : {1, 2})
      for (size_t n : kContexts)
        benchmark::RegisterBenchmark(
            (std::string("flash_decode/") + name(v) + "/ctx:" + std::to_string(n) + "/threads:" + std::to_string(threads))
                .c_str(),
            [=](benchmark::State& s) { measure(s, v, n, threads); })
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  data();  // fill the cache before anything is timed
  benchmark::RunSpecifiedBenchmarks();
  ratio_table();
  ceiling_table();
  benchmark::Shutdown();
  return 0;
}
