// Decode and prompt-processing speed of 1.1B-shaped models next to the machine's limits,
// measured in the same run:
//   - decode reads every weight once per token (and, at depth, every cached key and value),
//     so bandwidth / bytes per token is its roofline;
//   - prefill is compute-bound, so its roofline is the cores' peak multiply-add rate: f32 FMA
//     for float weights, 8-bit dot products for Q8_0 / Q4_0 / Q4_K / Q6_K (whose
//     activations the fastest path quantises to 8 bits: the K-quants on the packed AVX-512
//     path), bf16 pair dot products for BF16 where the CPU has AVX-512 BF16 (the peak of
//     every path is the best one's: the avx2 rows' share is lower than their own peak's).
// Every row is measured on each kernel path given by --isas, interleaved round by round so
// the paths share the machine's load; "ratio" is the tokens/s ratio to the first path.
// On a shared machine the threads of a step wait for whichever one the scheduler parked, so
// "cpu ratio" also compares the process CPU time each path spent (descheduled time does not
// count; a worker's spinning does).
//
//   bench_decode [--help] [--types f16,q8_0,q4_0,q4_k] [--threads 2] [--isas avx2,avx512]
//                [--tokens 16] [--prompts 128,512,2048] [--depths 4096,16384] [--rounds 3]
//                [--batch 512] [--dir DIR] [--preset tinyllama-1.1b] [--kv-types f16,f32]
// Decode at depth runs once per KV cache type of --kv-types (the roofline counts that type's
// bytes); the other rows use the first.
// Models are generated once into DIR (default /tmp/specmesh-bench) and reused. An empty list
// ("--prompts ''") skips those rows.
#include <immintrin.h>

#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench_util.hpp"
#include "specmesh/kernels/flash_decode.hpp"
#include "specmesh/kernels/matmul.hpp"
#include "specmesh/kernels/thread_pool.hpp"
#include "specmesh/model/context.hpp"
#include "specmesh/model/generate.hpp"
#include "specmesh/model/synthetic.hpp"

using namespace specmesh;
using Clock = std::chrono::steady_clock;

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

// The comma-separated positive integers of option `name`; throws std::invalid_argument naming
// the option and the item that is not one.
std::vector<int> split_ints(const std::string& name, const std::string& s) {
  std::vector<int> out;
  for (const auto& item : split(s)) {
    size_t used = 0;
    int v = 0;
    try {
      v = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || v <= 0) throw std::invalid_argument(name + ": '" + item + "' is not a positive integer");
    out.push_back(v);
  }
  return out;
}

DType parse_type(const std::string& s) {
  if (s == "f32") return DType::F32;
  if (s == "f16") return DType::F16;
  if (s == "bf16") return DType::BF16;
  if (s == "q8_0") return DType::Q8_0;
  if (s == "q4_0") return DType::Q4_0;
  if (s == "q4_k") return DType::Q4_K;
  if (s == "q6_k") return DType::Q6_K;
  throw std::invalid_argument("--types: unknown type '" + s + "' (f32, f16, bf16, q8_0, q4_0, q4_k, q6_k)");
}

// User + system CPU seconds of the whole process.
double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// A measurement: tokens per wall-clock second and the CPU seconds it took.
struct Sample {
  double tps = 0;
  double cpu = 0;
};

// --- peak arithmetic rates ---------------------------------------------------------------
// Twelve independent accumulator chains per thread hide the instruction latencies, so these
// loops run at the core's issue limit. Returns operations (a multiply-add counts 2) per second.

constexpr int kPeakIters = 1 << 22;

__attribute__((target("avx2,fma"))) uint64_t fma_loop_avx2() {
  __m256 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(float(i));
  const __m256 m = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-3f);
  for (int it = 0; it < kPeakIters; ++it)
    for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], m, c);
  __m256 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, a[i]);
  float out[8];
  _mm256_storeu_ps(out, s);
  if (out[0] == 12345.0f) std::fprintf(stderr, "impossible\n");
  return uint64_t(kPeakIters) * 12 * 8 * 2;
}

__attribute__((target("avx512f"))) uint64_t fma_loop_avx512() {
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(float(i));
  const __m512 m = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-3f);
  for (int it = 0; it < kPeakIters; ++it)
    for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], m, c);
  __m512 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
  if (_mm512_reduce_add_ps(s) == 12345.0f) std::fprintf(stderr, "impossible\n");
  return uint64_t(kPeakIters) * 12 * 16 * 2;
}

// 8-bit products with AVX2: maddubs (pairs into 16 bits) then madd (into 32 bits), the
// sequence the AVX2 integer kernels use.
__attribute__((target("avx2"))) uint64_t int8_loop_avx2() {
  __m256i a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_epi32(i);
  const __m256i u = _mm256_set1_epi8(3), s8 = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
  for (int it = 0; it < kPeakIters; ++it)
    for (int i = 0; i < 12; ++i)
      a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, s8), ones));
  __m256i s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_epi32(s, a[i]);
  if (_mm256_extract_epi32(s, 0) == 12345) std::fprintf(stderr, "impossible\n");
  return uint64_t(kPeakIters) * 12 * 32 * 2;
}

__attribute__((target("avx512f,avx512vnni"))) uint64_t int8_loop_vnni() {
  __m512i a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
  const __m512i u = _mm512_set1_epi8(3), s8 = _mm512_set1_epi8(-2);
  for (int it = 0; it < kPeakIters; ++it)
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], u, s8);
  __m512i s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_epi32(s, a[i]);
  if (_mm512_reduce_add_epi32(s) == 12345) std::fprintf(stderr, "impossible\n");
  return uint64_t(kPeakIters) * 12 * 64 * 2;
}

// bf16 pairs with AVX-512 BF16: vdpbf16ps adds two products per f32 lane.
__attribute__((target("avx512f,avx512bf16"))) uint64_t bf16_loop() {
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(float(i));
  const __m512bh u = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f));
  const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(-1e-3f));
  for (int it = 0; it < kPeakIters; ++it)
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbf16_ps(a[i], u, v);
  __m512 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
  if (_mm512_reduce_add_ps(s) == 12345.0f) std::fprintf(stderr, "impossible\n");
  return uint64_t(kPeakIters) * 12 * 32 * 2;
}

// The best of three runs on every thread at once, in G operations per second.
double peak_rate(ThreadPool& pool, uint64_t (*loop)()) {
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<uint64_t> ops(pool.size() * 8);
    const auto t0 = Clock::now();
    pool.run([&](int ith, int) { ops[ith * 8] = loop(); });
    const double sec = bench::seconds_since(t0);
    uint64_t total = 0;
    for (uint64_t o : ops) total += o;
    best = std::max(best, total / sec / 1e9);
  }
  return best;
}

struct Peaks {
  double f32 = 0;   // GFLOP/s
  double int8 = 0;  // G int8 ops/s
  double bf16 = 0;  // GFLOP/s of bf16 pairs (0 without AVX-512 BF16)
};

Peaks peaks(ThreadPool& pool) {
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const bool vnni = avx512 && __builtin_cpu_supports("avx512vnni");
  const bool bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
  return {peak_rate(pool, avx512 ? fma_loop_avx512 : fma_loop_avx2), peak_rate(pool, vnni ? int8_loop_vnni : int8_loop_avx2),
          bf16 ? peak_rate(pool, bf16_loop) : 0.0};
}

bool int8_dot(DType t) { return t == DType::Q8_0 || t == DType::Q4_0 || t == DType::Q4_K || t == DType::Q6_K; }

// Multiply-adds x 2 of a prompt of n tokens: every layer matrix once per token, attention over
// the causal triangle, and the output matrix for the last token only.
double prefill_ops(const HParams& hp, double n) {
  const double d = hp.n_embd, q = hp.q_dim(), kv = hp.kv_dim(), ff = hp.n_ff;
  const double per_token = d * q + 2 * d * kv + q * d + 3 * d * ff;
  const double attention = 2.0 * q * (n * (n + 1) / 2);  // q.k and p.v per visible pair
  return 2.0 * (hp.n_layer * (per_token * n + attention) + double(hp.n_vocab) * d);
}

// Keys and values a decode step reads at `depth` cached tokens stored as `type`.
double kv_bytes(const HParams& hp, double depth, DType type) {
  return depth * hp.n_layer * 2.0 * double(kv_row_bytes(type, size_t(hp.kv_dim())));
}

// Where the bandwidth roofline of a decode row at depth cannot be met by a step that reads the
// weights and then computes the attention: the attention's products alone at the peak rates of
// the products this CPU's best path uses (8-bit dot products for a Q8_0 cache's scores, bf16
// pairs where flash_bf16_products says so, f32 multiply-adds otherwise), against the time its
// keys and values take to read. When the first is the larger, the attention is bound by
// arithmetic, and the step's time phase by phase (weights read, then the larger of the two)
// is the nearer bound.
void print_depth_bound(const HParams& hp, double depth, DType kv_type, double weight_bytes, double bw,
                       const Peaks& pk) {
  // Operations (two per product) of each half, q . k and p . v, over every query head and layer.
  const double ops = 2.0 * hp.q_dim() * depth * hp.n_layer, read_ms = kv_bytes(hp, depth, kv_type) / (bw * 1e6);
  const double pv_peak = flash_bf16_products(kv_type, hp.head_dim) ? pk.bf16 : pk.f32;
  const double qk_peak = kv_type == DType::Q8_0 ? pk.int8 : pv_peak;
  const double arith_ms = ops / (qk_peak * 1e6) + ops / (pv_peak * 1e6);
  const double step_ms = weight_bytes / (bw * 1e6) + std::max(read_ms, arith_ms);
  std::printf("#   its attention: %.2f G op a token, %.2f ms at the peak rates, %.2f ms to read its keys and values;"
              " weights read, then attention: %.2f ms a token (%.2f tok/s)\n",
              2 * ops / 1e9, arith_ms, read_ms, step_ms, 1e3 / step_ms);
}

// Runs fn once per round on each path in turn and returns, per path, the medians of its
// tokens/s and of the CPU seconds it took. With `bandwidth`, the read bandwidth is measured
// before every run and its median written there: this machine's bandwidth moves with its
// neighbours' load (16 to 60 GB/s within minutes), so a roofline measured once would not be
// the one the runs met.
std::vector<Sample> per_path(const std::vector<std::string>& isas, int rounds, const std::function<double()>& fn,
                             ThreadPool* pool = nullptr, double* bandwidth = nullptr) {
  std::vector<std::vector<double>> tps(isas.size()), cpu(isas.size());
  std::vector<double> bw;
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < isas.size(); ++i) {
      if (bandwidth) bw.push_back(bench::read_bandwidth(*pool, size_t(1) << 29, 2));
      if (!matmul_set_isa(isas[i].c_str())) throw std::runtime_error("this CPU cannot run the " + isas[i] + " path");
      const double c0 = cpu_seconds();
      tps[i].push_back(fn());
      cpu[i].push_back(cpu_seconds() - c0);
    }
  matmul_set_isa(nullptr);
  if (bandwidth) *bandwidth = bench::median(bw);
  std::vector<Sample> med;
  for (size_t i = 0; i < isas.size(); ++i) med.push_back({bench::median(tps[i]), bench::median(cpu[i])});
  return med;
}

// bandwidth: the row's own median read bandwidth (GB/s), printed when given.
void print_row(const char* type, int threads, const std::string& what, const std::vector<std::string>& isas,
               const std::vector<Sample>& got, double roof_tps, const char* roof_what, double ops_per_token,
               double bandwidth = 0) {
  for (size_t i = 0; i < isas.size(); ++i) {
    const double tps = got[i].tps;
    std::printf("%-6s %3d %-19s %-7s %10.2f %10.2f %8.1f%%", type, threads, what.c_str(), isas[i].c_str(), tps,
                roof_tps, 100.0 * tps / roof_tps);
    if (ops_per_token > 0) std::printf(" %9.1f", tps * ops_per_token / 1e9);
    else std::printf(" %9s", "-");
    std::printf(" %-6s %6.2fx %8.2fx", roof_what, tps / got[0].tps, got[0].cpu / got[i].cpu);
    if (bandwidth > 0) std::printf(" %7.1f", bandwidth);
    std::printf("\n");
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::string types = "f16,q8_0,q4_0,q4_k", threads = "2", dir = "/tmp/specmesh-bench", preset = "tinyllama-1.1b";
  std::string isa_list = "", prompt_list = "128,512,2048", depth_list = "4096,16384", kv_list = "f16,f32";
  int n_tokens = 16, rounds = 3, n_batch = 512;
  CLI::App app{"Decode and prompt-processing speed of 1.1B-shaped synthetic models beside the machine's read "
               "bandwidth and peak multiply-add rates, measured in the same run"};
  app.add_option("--types", types, "weight types, comma-separated")->capture_default_str();
  app.add_option("--threads", threads, "thread counts, comma-separated")->capture_default_str();
  app.add_option("--isas", isa_list, "kernel paths to compare round by round (scalar, avx2, avx512; default: this CPU's best)");
  app.add_option("--tokens", n_tokens, "decode tokens per round")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--prompts", prompt_list, "prefill rows: prompt lengths ('' for none)")->capture_default_str();
  app.add_option("--depths", depth_list, "decode-at-depth rows: cached tokens ('' for none)")->capture_default_str();
  app.add_option("--rounds", rounds, "rounds per row (the median is shown)")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--batch", n_batch, "prefill batch size")->check(CLI::Range(1, 1 << 16))->capture_default_str();
  app.add_option("--dir", dir, "where the synthetic models are generated once and reused")->capture_default_str();
  app.add_option("--preset", preset, "model shape")->capture_default_str();
  app.add_option("--kv-types", kv_list, "KV cache types of the depth rows (f16, f32, q8_0)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  std::vector<std::string> isas = split(isa_list);
  if (isas.empty()) isas.push_back(matmul_isa());
  for (const auto& isa : isas)
    if (!matmul_set_isa(isa.c_str())) {
      std::fprintf(stderr, "--isas: this CPU cannot run the %s path (scalar, avx2, avx512)\n", isa.c_str());
      return 2;
    }
  matmul_set_isa(nullptr);
  std::vector<int> prompts, depths, thread_counts;
  std::vector<DType> kv_types;
  try {
    prompts = split_ints("--prompts", prompt_list);
    depths = split_ints("--depths", depth_list);
    thread_counts = split_ints("--threads", threads);
    for (const auto& t : split(types)) parse_type(t);
    try {
      for (const auto& t : split(kv_list)) kv_types.push_back(parse_kv_type(t));
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("--kv-types: ") + e.what());
    }
    if (!synthetic_preset(preset)) throw std::invalid_argument("--preset: unknown preset '" + preset + "'");
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  if (kv_types.empty()) kv_types.push_back(kDefaultKvType);
  std::filesystem::create_directories(dir);

  std::printf("# specmesh decode/prefill benchmark: preset %s, paths %s, %d decode tokens, prefill batch %d, "
              "median of %d rounds\n",
              preset.c_str(), isa_list.empty() ? matmul_isa() : isa_list.c_str(), n_tokens, n_batch, rounds);
  for (const std::string& tname : split(types)) {
    auto spec = synthetic_preset(preset);  // checked above
    spec->weight_type = spec->embd_type = parse_type(tname);
    const std::string path = dir + "/" + preset + "-" + tname + ".gguf";
    if (!std::filesystem::exists(path)) {
      std::fprintf(stderr, "writing %s ...\n", path.c_str());
      write_synthetic_model(*spec, path + ".tmp");
      std::filesystem::rename(path + ".tmp", path);
    }
    auto model = Model::load(path);
    const HParams& hp = model->hparams();
    const double weight_bytes = double(model->weight_bytes_per_token());
    for (int th : thread_counts) {
      ThreadPool pool(th);
      const double bw = bench::read_bandwidth(pool, size_t(1) << 30);
      double row_bw = 0;
      const Peaks pk = peaks(pool);
      // BF16 weights take bf16 dot products where the path has them (matmul_bf16_dot).
      const bool bf16_dot = parse_type(tname) == DType::BF16 && pk.bf16 > 0;
      const double peak = int8_dot(parse_type(tname)) ? pk.int8 : bf16_dot ? pk.bf16 : pk.f32;
      const char* peak_name = int8_dot(parse_type(tname)) ? "int8" : bf16_dot ? "bf16" : "f32";
      std::printf("\n## %s, %d thread(s): weights %.1f MB, read bandwidth %.2f GB/s, peak f32 FMA %.1f GFLOP/s, "
                  "peak int8 dot %.1f GOP/s, peak bf16 dot %.1f GFLOP/s\n",
                  tname.c_str(), th, weight_bytes / 1e6, bw, pk.f32, pk.int8, pk.bf16);
      std::printf("%-6s %3s %-19s %-7s %10s %10s %9s %9s %-6s %7s %9s\n", "type", "thr", "row", "path", "tok/s",
                  "roof tok/s", "% roof", "G op/s", "roof", "ratio", "cpu ratio");
      std::printf("# decode rows: roof tok/s from the read bandwidth measured before each of their runs "
                  "(median, GB/s, last column)\n");
      std::fflush(stdout);

      // Short-context decode.
      {
        Context ctx(*model, {.n_ctx = n_tokens + 8, .kv_type = kv_types[0]}, &pool);
        prefill(ctx, {1}, 0, 1);  // touch every weight page once, so no figure pays for disk reads
        const auto tps = per_path(isas, rounds, [&] {
          ctx.kv().clear();
          GenerateParams gp;
          gp.n_predict = n_tokens + 1;
          gp.ignore_eos = true;
          return generate(ctx, {1}, gp, [](int32_t) { return true; }).decode_tokens_per_s;
        }, &pool, &row_bw);
        print_row(tname.c_str(), th, "decode", isas, tps, row_bw * 1e9 / weight_bytes, "bw", 0, row_bw);
      }
      // Prompt processing.
      for (int n : prompts) {
        Context ctx(*model, {.n_ctx = n + 8, .kv_type = kv_types[0]}, &pool);
        std::vector<int32_t> prompt(n);
        for (int i = 0; i < n; ++i) prompt[i] = 1 + (i * 37) % (hp.n_vocab - 1);
        const double ops_per_token = prefill_ops(hp, n) / n;
        const auto tps = per_path(isas, rounds, [&] {
          ctx.kv().clear();
          const auto t0 = Clock::now();
          prefill(ctx, prompt, 0, n_batch);
          return n / bench::seconds_since(t0);
        });
        print_row(tname.c_str(), th, "prefill " + std::to_string(n), isas, tps, peak * 1e9 / ops_per_token,
                  peak_name, ops_per_token);
      }
      // Decode after `depth` cached tokens. The cache cells are claimed without running the
      // prompt (their keys and values are zeros): attention reads every one all the same.
      for (int depth : depths) {
        for (DType kv_type : kv_types) {
          Context ctx(*model, {.n_ctx = depth + n_tokens + 8, .kv_type = kv_type}, &pool);
          const auto tps = per_path(isas, rounds, [&] {
            ctx.kv().clear();
            Batch fill;
            for (int i = 0; i < depth; ++i) fill.add(1, i, seq_bit(0), false);
            ctx.kv().place(fill);
            const auto t0 = Clock::now();
            for (int i = 0; i < n_tokens; ++i) prefill(ctx, {1 + i}, depth + i, 1);
            return n_tokens / bench::seconds_since(t0);
          }, &pool, &row_bw);
          const double bytes = weight_bytes + kv_bytes(hp, depth + n_tokens / 2.0, kv_type);
          print_row(tname.c_str(), th, "decode @" + std::to_string(depth) + " " + kv_type_name(kv_type), isas, tps,
                    row_bw * 1e9 / bytes, "bw", 0, row_bw);
          print_depth_bound(hp, depth + n_tokens / 2.0, kv_type, weight_bytes, row_bw, pk);
        }
      }
    }
  }
  return 0;
}
