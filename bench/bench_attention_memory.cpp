// What bounds decode attention at depth: flash_decode over a deep KV cache, timed three ways in
// one run, round by round interleaved, on the decode's thread pool:
//
//   memory    one call per layer over `--layers` layers' own rows (from memory, as in decode)
//   cached    the same calls with every layer's cell list naming the first 1024 cells, so the
//             arithmetic is the same and the rows come from the caches
//   read      each thread summing its share of the same layers' key and value rows, as fast as
//             this CPU streams (bench_util's read_sum): the memory floor of `memory`
//
// and memory and cached again without the asks for the next partial's rows (FlashLayout::
// ask_ahead off): what the asks give from memory, and what they cost in cache.
//
// If the attention were bound by its arithmetic, memory would sit near cached; if by memory,
// near read. The ratios memory / max(cached, read) and memory / (cached + read) show how far
// the two overlap. The shape is a TinyLlama layer (32 query heads, 4 KV heads of 64).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "specmesh/kernels/aligned_buffer.hpp"
#include "specmesh/kernels/flash_decode.hpp"
#include "specmesh/kernels/kv_rows.hpp"

#include "bench_util.hpp"

namespace {

using namespace specmesh;

struct Options {
  size_t keys = 16384;
  int layers = 22, rounds = 15, threads = 2;
  std::string kv_type = "f16";
};

constexpr HeadShape kShape{32, 4, 64};
constexpr size_t kCachedCells = 1024;

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Decode attention at depth: flash_decode from memory, from the caches, and a plain read of its rows"};
  app.add_option("--keys", o.keys, "keys per layer (the context)")->check(CLI::Range(size_t(kCachedCells), size_t(1) << 20))->capture_default_str();
  app.add_option("--layers", o.layers, "layers, each with its own rows")->check(CLI::Range(1, 256))->capture_default_str();
  app.add_option("--rounds", o.rounds, "interleaved rounds (medians are reported)")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--threads", o.threads, "threads of the pool")->check(CLI::Range(1, 64))->capture_default_str();
  app.add_option("--kv-type", o.kv_type, "KV cache type: f32, f16 or q8_0")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  DType type;
  try {
    type = parse_kv_type(o.kv_type);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "--kv-type: %s\n", e.what());
    return 2;
  }

  const size_t stride = size_t(kShape.n_head_kv) * size_t(kShape.head_dim);
  const size_t row_bytes = kv_row_bytes(type, stride);
  const size_t layer_bytes = o.keys * row_bytes;  // keys or values of one layer
  std::printf("%zu keys x %d layers, %s cache: %.1f MB of keys and values per layer, %d threads\n", o.keys, o.layers,
              kv_type_name(type).c_str(), 2.0 * double(layer_bytes) / 1e6, o.threads);

  // Each layer's keys and values (huge pages where the kernel gives them, as the KV cache).
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> row(stride);
  std::vector<AlignedBuffer> k, v;
  for (int l = 0; l < o.layers; ++l) {
    k.emplace_back(layer_bytes, false);
    v.emplace_back(layer_bytes, false);
    for (size_t c = 0; c < o.keys; ++c) {
      for (float& x : row) x = g(rng);
      kv_store(type, row.data(), stride, k.back().data() + c * row_bytes);
      for (float& x : row) x = g(rng);
      kv_store(type, row.data(), stride, v.back().data() + c * row_bytes);
    }
  }
  std::vector<float> q(size_t(kShape.n_head) * size_t(kShape.head_dim)), out(q.size());
  for (float& x : q) x = g(rng);
  std::vector<int32_t> cells(o.keys), cached(o.keys);
  std::iota(cells.begin(), cells.end(), 0);
  for (size_t t = 0; t < o.keys; ++t) cached[t] = int32_t(t % kCachedCells);
  const float scale = 1.0f / std::sqrt(float(kShape.head_dim));
  ThreadPool& pool = bench::pool(o.threads);

  auto attend = [&](const std::vector<int32_t>& c, bool asks = true) {
    FlashLayout layout;
    layout.ask_ahead = asks;
    const auto t0 = std::chrono::steady_clock::now();
    for (int l = 0; l < o.layers; ++l)
      flash_decode(q.data(), kShape, scale, KvRows{k[size_t(l)].data(), v[size_t(l)].data(), stride, type}, c.data(),
                   o.keys, out.data(), layout, &pool);
    return bench::seconds_since(t0) / o.layers;
  };
  std::vector<uint64_t> sums(size_t(o.threads) * 8);  // a cache line per thread
  auto read = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    for (int l = 0; l < o.layers; ++l)
      pool.run([&](int ith, int nth) {
        for (const AlignedBuffer* b : {&k[size_t(l)], &v[size_t(l)]}) {
          const auto* words = reinterpret_cast<const uint64_t*>(b->data());
          sums[size_t(ith) * 8] += bench::read_share(words, layer_bytes / 8, ith, nth);
        }
      });
    return bench::seconds_since(t0) / o.layers;
  };

  attend(cells);  // first touches and the pool's scratch
  std::vector<double> mem, cache, rd, mem_quiet, cache_quiet, over_max, over_sum, gain, cost;
  for (int r = 0; r < o.rounds; ++r) {
    const double a = attend(cells), b = attend(cached), c = read();
    const double d = attend(cells, false), e = attend(cached, false);
    mem.push_back(a);
    cache.push_back(b);
    rd.push_back(c);
    mem_quiet.push_back(d);
    cache_quiet.push_back(e);
    over_max.push_back(a / std::max(b, c));
    over_sum.push_back(a / (b + c));
    gain.push_back(a / d);
    cost.push_back(b / e);
  }
  if (std::accumulate(sums.begin(), sums.end(), uint64_t(0)) == 0) std::fprintf(stderr, "impossible\n");

  const double read_s = bench::median(rd);
  std::printf("per layer, median of %d rounds:\n", o.rounds);
  std::printf("  memory  %8.3f ms   (%.1f GB/s of keys and values)\n", 1e3 * bench::median(mem),
              2.0 * double(layer_bytes) / bench::median(mem) / 1e9);
  std::printf("  cached  %8.3f ms\n", 1e3 * bench::median(cache));
  std::printf("  read    %8.3f ms   (%.1f GB/s)\n", 1e3 * read_s, 2.0 * double(layer_bytes) / read_s / 1e9);
  std::printf("  without the asks for the next partial's rows: memory %.3f ms, cached %.3f ms\n",
              1e3 * bench::median(mem_quiet), 1e3 * bench::median(cache_quiet));
  std::printf("memory / max(cached, read): %.2f   memory / (cached + read): %.2f   memory / read: %.2f\n",
              bench::median(over_max), bench::median(over_sum), bench::median(mem) / read_s);
  std::printf("asks: memory with / without %.2f   cached with / without %.2f\n", bench::median(gain),
              bench::median(cost));
  return 0;
}
