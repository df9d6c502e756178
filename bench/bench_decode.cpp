// Decode and prompt-processing speed of 1.1B-shaped models next to the machine's memory
// bandwidth, measured in the same run: decode reads every weight once per token, so
// bandwidth / weight bytes per token is its roofline.
//
//   bench_decode [--types f16,q8_0,q4_0] [--threads 1,2] [--tokens 16] [--prompt 64]
//                [--dir DIR] [--preset tinyllama-1.1b]
// Models are generated once into DIR (default /tmp/specmesh-bench) and reused.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

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
  for (std::string item; std::getline(ss, item, ',');) out.push_back(item);
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
  throw std::invalid_argument("unknown type " + s);
}

// Streaming read bandwidth (GB/s) over a buffer much larger than the caches, like the
// read-only part of STREAM: each thread sums its own contiguous share with 64-bit loads
// (two loads per cycle outrun DRAM, so no SIMD is needed to saturate it).
double read_bandwidth(ThreadPool& pool, size_t bytes) {
  static std::vector<uint64_t> buf;
  if (buf.size() * 8 < bytes) buf.assign(bytes / 8, 1);
  const size_t n = buf.size();
  double best = 0;
  std::vector<uint64_t> partial(pool.size());
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = Clock::now();
    pool.run([&](int ith, int nth) {
      const size_t per = n / nth / 4 * 4, b = per * ith, e = ith == nth - 1 ? n : b + per;
      uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
      for (size_t i = b; i + 4 <= e; i += 4) {
        a0 += buf[i];
        a1 += buf[i + 1];
        a2 += buf[i + 2];
        a3 += buf[i + 3];
      }
      partial[ith] = a0 + a1 + a2 + a3;
    });
    const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
    uint64_t check = 0;
    for (uint64_t p : partial) check += p;
    if (check == 0) std::fprintf(stderr, "impossible\n");  // keeps the loads alive
    best = std::max(best, n * 8.0 / sec / 1e9);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  std::string types = "f16,q8_0,q4_0", threads = "1,2", dir = "/tmp/specmesh-bench", preset = "tinyllama-1.1b";
  int n_tokens = 16, n_prompt = 64;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i], v = argv[i + 1];
    if (a == "--types") types = v;
    else if (a == "--threads") threads = v;
    else if (a == "--tokens") n_tokens = std::stoi(v);
    else if (a == "--prompt") n_prompt = std::stoi(v);
    else if (a == "--dir") dir = v;
    else if (a == "--preset") preset = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  std::filesystem::create_directories(dir);

  std::printf("# specmesh decode benchmark: preset %s, matmul isa %s, %d decode tokens, %d-token prompt\n",
              preset.c_str(), matmul_isa(), n_tokens, n_prompt);
  std::printf("%-6s %3s %12s %10s %12s %12s %10s %12s\n", "type", "thr", "weights MB", "bw GB/s", "roofline t/s",
              "decode t/s", "% roof", "prompt t/s");
  for (const std::string& tname : split(types)) {
    auto spec = synthetic_preset(preset);
    if (!spec) {
      std::fprintf(stderr, "unknown preset %s\n", preset.c_str());
      return 2;
    }
    spec->weight_type = spec->embd_type = parse_type(tname);
    const std::string path = dir + "/" + preset + "-" + tname + ".gguf";
    if (!std::filesystem::exists(path)) {
      std::fprintf(stderr, "writing %s ...\n", path.c_str());
      write_synthetic_model(*spec, path + ".tmp");
      std::filesystem::rename(path + ".tmp", path);
    }
    auto model = Model::load(path);
    const double mb = model->weight_bytes_per_token() / 1e6;
    for (const std::string& th : split(threads)) {
      ThreadPool pool(std::stoi(th));
      const double bw = read_bandwidth(pool, size_t(1) << 30);
      Context ctx(*model, {.n_ctx = n_prompt + n_tokens + 8}, &pool);
      std::vector<int32_t> prompt(n_prompt);
      for (int i = 0; i < n_prompt; ++i) prompt[i] = 1 + (i * 37) % (model->hparams().n_vocab - 1);
      prefill(ctx, {1}, 0, 1);  // touch every weight page once, so neither figure pays for disk reads
      ctx.kv().clear();
      auto t0 = Clock::now();
      prefill(ctx, prompt, 0, n_prompt);
      const double prompt_tps = n_prompt / std::chrono::duration<double>(Clock::now() - t0).count();
      ctx.kv().clear();
      GenerateParams gp;
      gp.n_predict = n_tokens + 1;
      gp.ignore_eos = true;
      GenerateStats st = generate(ctx, {1}, gp, [](int32_t) { return true; });
      const double roof = bw * 1e3 / mb;
      std::printf("%-6s %3s %12.1f %10.2f %12.2f %12.2f %9.1f%% %12.2f\n", tname.c_str(), th.c_str(), mb, bw, roof,
                  st.decode_tokens_per_s, 100.0 * st.decode_tokens_per_s / roof, prompt_tps);
      std::fflush(stdout);
    }
  }
  return 0;
}
