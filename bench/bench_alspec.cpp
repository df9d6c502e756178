// ALSpec through the actor protocol, timed: real tokens flow through the two pair stages (or one
// plain stage) in this process, and the devices pace each op to a measured accelerator profile.
//
// Emulation (default). A 32-layer synthetic model stands in for Llama 3 8B (same layer count,
// tiny widths: real compute is far below the modelled times); each device's virtual context is
// the emulated K. Verdicts follow the strategy's emulate_hit_rate pattern: round(h x 32) hits
// per token. Two tables:
//   Table 3: plain decoding on one h100-tp4 device against alspec on two, at 65 % hits
//            (21 of 32 layers; the paper's projection counts 20.8).
//   N150:    alspec on two 4-chip groups (SP + TP4 on 8 chips: each group a tensor-parallel
//            stage over 4 device actors, every chip paced to the n300x2 profile's TP4 timing,
//            the ranks exchanging their shares each layer; `--tp-ranks 1`: each group one
//            device with that timing) against plain decoding on one t3k device (TP8), at 16,
//            20, 24, 28 hits of 32 (50 to 87.5 %).
// Each is compared with Appendix F's closed form on the same profile numbers. Every modelled
// time is stretched by a dilation factor and the measured times divided by it, so the actor
// messages between layers (about 0.1 ms on this machine, against H100 layers of 0.1 ms) weigh
// that much less: 48 by default (`--dilate F`; at 16-24 the 8 device threads of SP + TP4 on
// the 2 cores of the development machine added 2-6 % to a token, at 48 they add 1-2.5 %).
//
// `--cpu`: real compute only, no profiles. Two single-thread devices run alspec against one
// single-thread device running plain decoding, on a synthetic model at a context where
// attention is a large share of the layer time. The pair runs twice: with the check at
// `--lambda` (the default 2 accepts every check on random weights), and with the verdicts on
// emulate_hit_rate's fixed pattern at `--hits` (round(h x layers) hits per token; the work is
// real, the verdicts are not the check's). Two controls: the pair with every speculation
// rejected, and the pair's ops in sequence on one thread (what its kernels cost without
// overlap; the pair uses the speculative flash-decode kernel, plain decoding does not). The
// per-layer sync is the pair over plain decoding at 16 keys of context (run_cpu). The sender
// sends its hand-off as soon as the sink + window output is ready, so the receiver's rest of
// the layer overlaps the middle of the sender's attention.
//
// Usage: bench_alspec [--tokens N] [--dilate F] [--csv FILE] [--tp-ranks 4]
//        bench_alspec --cpu [--context 3072] [--tokens 64] [--lambda 2] [--hits 0.8] [--rounds 5]
//                           [--embd 1024] [--heads 8] [--ff 2816] [--layers 5] [--type q8_0]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <unistd.h>
#include <vector>

#include "specmesh/devices/latency_tables.hpp"
#include "specmesh/devices/tenstorrent.hpp"
#include "specmesh/model/batch.hpp"
#include "specmesh/model/context.hpp"
#include "specmesh/model/model.hpp"
#include "specmesh/model/synthetic.hpp"
#include "specmesh/runtime.hpp"
#include "specmesh/speculation/alspec_gating.hpp"
#include "specmesh/speculation/alspec_pair.hpp"
#include "specmesh/speculation/registry.hpp"
#include "specmesh/speculation/strategy.hpp"
#include "specmesh/topology.hpp"

#include "bench_util.hpp"

namespace {

using namespace specmesh;
using bench::median;

constexpr int64_t K = 1024;
constexpr int64_t kContexts[] = {1 * K, 32 * K, 64 * K, 96 * K, 128 * K};
constexpr double kN150Rates[] = {0.5, 0.625, 0.75, 0.875};
constexpr int kLayers = 32;

std::string tmp(const std::string& name) { return "/tmp/specmesh-bench-alspec-" + std::to_string(::getpid()) + "-" + name; }

std::string write_model(const std::string& name, SyntheticSpec s) {
  const std::string path = tmp(name + ".gguf");
  write_synthetic_model(s, path);
  return path;
}

// The strategy that runs a speculative pair (the one with a pair role), and plain decoding.
const StrategyInfo& pair_strategy() {
  for (const StrategyInfo& s : strategies())
    if (!s.pair_role.empty()) return s;
  throw std::runtime_error("no registered strategy runs an attention-level pair");
}

// One group per device for the pair, one device for plain decoding; every node in this process,
// and both groups on one node: their messages go through the router and the actors, not
// through a second gateway's sockets and I/O thread (which a 2-core machine starves while both
// devices compute).
// ranks > 1: each group of the pair is a tensor-parallel stage over that many devices.
std::string topology_text(const std::string& model, bool pair, const std::string& params, int threads, int ranks = 1) {
  static int n = 0;
  const std::string id = std::to_string(::getpid()) + "-" + std::to_string(n++);
  const StrategyInfo& s = pair ? pair_strategy() : default_strategy({kTargetRole});
  std::string t = "[run]\nmodel = \"m\"\nstrategy = \"" + s.name +
                  "\"\ntemperature = 0.0\n[models.m]\npath = \"" + model + "\"\n" +
                  "[nodes.head]\nendpoint = \"inproc://bench-alspec-" + id + "-head\"\nhead = true\n" +
                  "[nodes.a]\nendpoint = \"inproc://bench-alspec-" + id + "-a\"\n" +
                  "[devices.ga]\nnode = \"a\"\nthreads = " + std::to_string(threads) + "\n" +
                  "[[stages]]\nrole = \"target\"\ndevice = \"ga\"\nfraction = 1.0\n";
  auto further = [&](const std::string& g) {
    std::string devices, list;
    for (int r = 1; r < ranks; ++r) {
      devices += "[devices." + g + std::to_string(r) + "]\nnode = \"a\"\nthreads = " + std::to_string(threads) + "\n";
      list += (list.empty() ? "\"" : ", \"") + g + std::to_string(r) + "\"";
    }
    return std::make_pair(devices, ranks > 1 ? "tensor_parallel = [" + list + "]\n" : std::string());
  };
  if (pair) {
    const auto [da, ta] = further("ga");
    const auto [db, tb] = further("gb");
    t += ta + da + "[run.params]\n" + params + "\n[run.roles]\n" + s.pair_role + " = \"m\"\n" +
         "[devices.gb]\nnode = \"a\"\nthreads = " + std::to_string(threads) + "\n" + db +
         "[[stages]]\nrole = \"" + s.pair_role + "\"\ndevice = \"gb\"\nfraction = 1.0\n" + tb;
  }
  return t;
}

// A profile timed as if the context were `context`, every modelled time stretched by `dilate`.
DeviceProfile emulated(const std::string& name, int64_t context, double dilate) {
  DeviceProfile p = *device_profile(name);
  p.virtual_context = context;
  for (ContextCurve* c : {&p.times->non_attention, &p.times->flash, &p.times->spec_sender, &p.times->spec_receiver,
                          &p.times->fixed})
    for (auto& pt : c->points) pt.second *= dilate;
  return p;
}

struct Measured {
  double token_s = 0;  // per decode token
  double hit_rate = 0;
};

Measured measure(Topology topo, const std::string& prompt, int tokens) {
  Runtime rt(std::move(topo));
  GenerationResult r = rt.generate({.prompt = prompt, .n_predict = tokens + 1, .sampling = SamplingParams{}, .ignore_eos = true});
  if (!r.ok()) throw std::runtime_error(r.error);
  Measured m;
  m.token_s = 1.0 / r.stats.decode_tokens_per_s;
  m.hit_rate = r.metrics.attention_checks ? double(r.metrics.attention_hits) / double(r.metrics.attention_checks) : 0;
  return m;
}

Measured emulate(const std::string& model, const std::string& profile, int64_t context, double rate, double dilate,
                 int tokens, int ranks = 1) {
  const bool pair = rate >= 0;
  const std::string params = "window = 8\nemulate_hit_rate = " + std::to_string(rate);
  Topology t = Topology::parse(topology_text(model, pair, params, 1, ranks), "bench", "/");
  for (auto& [name, d] : t.devices) d.profile = emulated(profile, context, dilate);
  Measured m = measure(std::move(t), "Once upon a time", tokens);
  m.token_s /= dilate;
  return m;
}

struct Row {
  std::string table, system;
  int64_t context;
  double hit_rate, measured_s, formula_s, paper_tok_s;
};

std::string paper(double tok_s) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", tok_s);
  return b;
}

int run_emulation(int tokens, double dilate_h100, double dilate_n150, const std::string& csv, int tp_ranks) {
  SyntheticSpec s = *synthetic_preset("tiny-llama");
  s.n_layer = kLayers;
  s.n_ctx = 256;
  const std::string model = write_model("32L", s);
  const MeshTiming& h100 = h100_llama3_8b();
  const MeshTiming& wh = wormhole_llama31_8b();
  std::vector<Row> rows;
  std::printf("Emulated mesh through the actors: %d tokens per point, modelled times stretched x%g (Table 3) and "
              "x%g (N150)\n", tokens, dilate_h100, dilate_n150);
  std::printf("Hits per token: round(h x 32) on a fixed pattern; 65 %% is 21 of 32 (the paper's projection counts "
              "20.8; the formula column uses 21).\n");
  std::printf("Table 3 prints no fixed per-token time: the h100-tp4 profile derives it per row from the 4xH100 "
              "column (1/tok_s - 32 x layer).\n");
  if (tp_ranks > 1)
    std::printf("N150 SP+TP4 runs each 4-chip group as a tensor-parallel stage over %d device actors (each chip one "
                "device, paced to the TP4 per-chip timing; the ranks exchange their shares every layer).\n\n", tp_ranks);
  else
    std::printf("N150 SP+TP4 runs each 4-chip group as one device with the TP4 timing (--tp-ranks 1).\n\n");
  std::printf("%-7s %-14s %6s %6s %10s %10s %7s %9s %9s %9s\n", "table", "system", "ctx", "hit%", "meas ms",
              "formula ms", "ratio", "meas t/s", "form t/s", "paper t/s");
  auto add = [&](Row r, const char* paper_tok_s) {
    rows.push_back(r);
    std::printf("%-7s %-14s %5lldK %6.1f %10.3f %10.3f %7.3f %9.1f %9.1f %9s\n", r.table.c_str(), r.system.c_str(),
                (long long)(r.context / K), 100 * r.hit_rate, 1e3 * r.measured_s, 1e3 * r.formula_s,
                r.measured_s / r.formula_s, 1 / r.measured_s, 1 / r.formula_s, paper_tok_s);
    std::fflush(stdout);
  };
  const auto table = h100_llama3_8b_table();
  for (size_t i = 0; i < table.size(); ++i) {
    const H100Row& p = table[i];
    const int64_t k = p.context;
    Measured tp = emulate(model, "h100-tp4", k, -1, dilate_h100, tokens);
    add({"table3", "4xH100 TP", k, 0, tp.token_s, tp_token_seconds(h100, 4, k), p.tp4_tok_s}, paper(p.tp4_tok_s).c_str());
    const double h = double(emulated_hits(kLayers, 0.65)) / kLayers;
    Measured al = emulate(model, "h100-tp4", k, 0.65, dilate_h100, tokens);
    add({"table3", "ALSpec@65%", k, al.hit_rate, al.token_s, alspec_token_seconds(h100, 4, k, h), p.alspec65_tok_s},
        paper(p.alspec65_tok_s).c_str());
  }
  for (int64_t k : kContexts) {
    Measured tp8 = emulate(model, "t3k", k, -1, dilate_n150, tokens);
    add({"n150", "TP8", k, 0, tp8.token_s, tp_token_seconds(wh, 8, k), 0}, "-");
    Measured tp4 = emulate(model, "n300x2", k, -1, dilate_n150, tokens);
    add({"n150", "TP4", k, 0, tp4.token_s, tp_token_seconds(wh, 4, k), 0}, "-");
    for (double r : kN150Rates) {
      Measured al = emulate(model, "n300x2", k, r, dilate_n150, tokens, tp_ranks);
      add({"n150", "SP+TP4", k, al.hit_rate, al.token_s, alspec_token_seconds(wh, 4, k, r), 0}, "-");
    }
  }
  std::printf("\nN150 speedup of SP+TP4 over TP8 (measured / formula)\n%6s", "ctx");
  for (double r : kN150Rates) std::printf("   %5.1f%% hits   ", 100 * r);
  std::printf("\n");
  for (int64_t k : kContexts) {
    std::printf("%5lldK", (long long)(k / K));
    const Row* tp8 = nullptr;
    for (const Row& r : rows)
      if (r.table == "n150" && r.system == "TP8" && r.context == k) tp8 = &r;
    for (const Row& r : rows)
      if (r.table == "n150" && r.system == "SP+TP4" && r.context == k)
        std::printf("   %5.3f / %5.3f  ", tp8->measured_s / r.measured_s, tp8->formula_s / r.formula_s);
    std::printf("\n");
  }
  if (!csv.empty()) {
    std::ofstream f(csv);
    f << "table,system,context,hit_rate,measured_s,formula_s,ratio,measured_tok_s,formula_tok_s,paper_tok_s\n";
    for (const Row& r : rows)
      f << r.table << "," << r.system << "," << r.context << "," << r.hit_rate << "," << r.measured_s << ","
        << r.formula_s << "," << r.measured_s / r.formula_s << "," << 1 / r.measured_s << "," << 1 / r.formula_s << ","
        << r.paper_tok_s << "\n";
    std::printf("\nwrote %s\n", csv.c_str());
  }
  std::remove(model.c_str());
  return 0;
}

// Seconds per decode token of plain decoding after a prompt of `n` tokens, one thread.
double plain_token_seconds(const Model& m, int n, int tokens) {
  Context ctx(m, {.n_ctx = n + tokens + 1});
  Batch prompt;
  for (int i = 0; i < n; ++i) prompt.add(300, i, seq_bit(0), i + 1 == n);
  ctx.forward(prompt);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < tokens; ++i) {
    Batch b;
    b.add(300, n + i, seq_bit(0), true);
    ctx.forward(b);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / tokens;
}

// The same pair's ops run one after the other on one thread (alspec_pair): what the pair's
// kernels cost without any overlap.
double sequential_pair_token_seconds(const Model& m, int n, int tokens, double lambda) {
  AlspecPair pair(m, {.spec = {{64, 64, 32}, float(lambda)}, .n_ctx = n + tokens + 1});
  pair.prefill(std::vector<int32_t>(size_t(n), 300));
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < tokens; ++i) pair.decode(300, n + i);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / tokens;
}

// The --cpu model's shape: a layer of a 1B-class model in width (heads of 128, MHA) whose KV
// reads at 2K keys weigh about as much as its weights (at the default 3K keys attention is
// about 60 % of a decode token), and heavy enough (about 2.6 ms a layer) that the per-layer
// sync between the groups (0.1-0.3 ms) is small beside it. Five layers, so that 80 % hits is
// a whole number of layers.
struct CpuShape {
  int n_embd = 1024, n_head = 8, n_ff = 2816, n_layer = 5;
  DType type = DType::Q8_0;
};

int run_cpu(int context, int tokens, double lambda, double hit_rate, int rounds, const CpuShape& shape) {
  SyntheticSpec s = *synthetic_preset("tiny-llama");
  s.n_embd = shape.n_embd;
  s.n_head = shape.n_head;
  s.n_head_kv = shape.n_head;
  s.head_dim = 0;  // n_embd / n_head
  s.n_ff = shape.n_ff;
  s.n_layer = shape.n_layer;
  s.weight_type = shape.type;
  s.n_ctx = context + tokens + 64;
  s.n_threads = 1;
  const std::string model = write_model("cpu", s);
  auto m = Model::load(model);
  const HParams& hp = m->hparams();
  // Attention's share: what the context adds to a decode token, as a share of the whole.
  const double t_short = plain_token_seconds(*m, 16, 8), t_long = plain_token_seconds(*m, context, 8);
  std::printf("Real CPU: synthetic llama, %d layers, n_embd %d, %d heads (MHA), n_ff %d, %s weights, context %d, 1 "
              "thread per device\n", hp.n_layer, hp.n_embd, hp.n_head, hp.n_ff, std::string(dtype_name(shape.type)).c_str(), context);
  std::printf("attention share of a decode token at this context: %.0f %% (%.3f ms at 16 keys, %.3f ms at %d)\n",
              100 * (1 - t_short / t_long), 1e3 * t_short, 1e3 * t_long, context);
  std::string prompt;
  for (int i = 0; int(prompt.size()) < context - 1; ++i) prompt += char('a' + i % 26);
  auto run = [&](bool pair, const std::string& params, const std::string& text) {
    return measure(Topology::parse(topology_text(model, pair, params, 1), "bench", "/"), text, tokens);
  };
  // The per-layer sync: at 16 keys attention is a sliver, so with every speculation accepted
  // each op runs once, on one device or the other, and what the pair adds over plain decoding
  // is the sync itself: the hand-off and the verdict, per layer.
  const std::string short_prompt = prompt.substr(0, 15);
  const std::string window = "window = 64\n";
  // Rounds of every variant in turn, so that the machine's drift (2 shared cores) hits all of
  // them alike; the medians of per-round ratios are the figures.
  // A first pair in a process runs slower (about 1.3x here) than the ones after it: one untimed
  // run of each kind first.
  run(false, "", prompt);
  run(true, window + "lambda = " + std::to_string(lambda), prompt);
  std::vector<double> speedup, emu_speedup, miss_ratio, seq_ratio, sync_us, hits, emu_hits;
  double ar_s = 0, al_s = 0, emu_s = 0;
  for (int r = 0; r < rounds; ++r) {
    const Measured ar = run(false, "", prompt);
    const Measured al = run(true, window + "lambda = " + std::to_string(lambda), prompt);
    const Measured emu = run(true, window + "emulate_hit_rate = " + std::to_string(hit_rate), prompt);
    const Measured miss = run(true, window + "force_miss = true", prompt);
    const Measured ar_short = run(false, "", short_prompt);
    const Measured al_short = run(true, window + "lambda = " + std::to_string(lambda), short_prompt);
    const double seq = sequential_pair_token_seconds(*m, context, tokens, lambda);
    speedup.push_back(ar.token_s / al.token_s);
    emu_speedup.push_back(ar.token_s / emu.token_s);
    miss_ratio.push_back(ar.token_s / miss.token_s);
    seq_ratio.push_back(ar.token_s / seq);
    sync_us.push_back(1e6 * (al_short.token_s - ar_short.token_s) / hp.n_layer);
    hits.push_back(al.hit_rate);
    emu_hits.push_back(emu.hit_rate);
    ar_s += ar.token_s / rounds;
    al_s += al.token_s / rounds;
    emu_s += emu.token_s / rounds;
    std::printf("round %d: ar %.1f tok/s, alspec %.1f tok/s (x%.3f), at %.0f %% hits %.1f tok/s (x%.3f), all rejected "
                "x%.3f, in sequence x%.3f\n", r + 1, 1 / ar.token_s, 1 / al.token_s, speedup.back(),
                100 * emu.hit_rate, 1 / emu.token_s, emu_speedup.back(), miss_ratio.back(), seq_ratio.back());
    std::fflush(stdout);
  }
  const size_t bytes = (size_t(hp.n_embd) + 2 * size_t(hp.kv_dim()) + size_t(hp.q_dim())) * sizeof(float);
  std::printf("medians over %d rounds, against ar on one device (mean %.1f tok/s):\n", rounds, 1 / ar_s);
  std::printf("  alspec (2 devices), lambda %.2f: x%.3f (mean %.1f tok/s), hit rate %.1f %%\n", lambda, median(speedup),
              1 / al_s, 100 * median(hits));
  std::printf("  alspec (2 devices), verdicts at %.1f %% hits (emulate_hit_rate %.2f): x%.3f (mean %.1f tok/s)\n",
              100 * median(emu_hits), hit_rate, median(emu_speedup), 1 / emu_s);
  std::printf("  alspec, every speculation rejected: x%.3f (the receiver's wasted rest of the layer reads the weights the "
              "sender reads next, into the shared cache)\n", median(miss_ratio));
  std::printf("  the pair's ops in sequence on one thread: x%.3f (no overlap: kernel and layout effects alone)\n",
              median(seq_ratio));
  std::printf("  per-layer sync (hand-off of %zu bytes + verdict): %.1f us (alspec over ar at 16 keys, every "
              "speculation accepted, per layer)\n", bytes, median(sync_us));
  std::remove(model.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int tokens = 0, context = 3072, rounds = 5;
  double dilate = 0, lambda = 2.0, hits = 0.8;
  bool cpu = false;
  CpuShape shape;
  std::string csv;
  int tp_ranks = 4;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--tokens") tokens = std::stoi(next());
    else if (a == "--dilate") dilate = std::stod(next());
    else if (a == "--csv") csv = next();
    else if (a == "--tp-ranks") tp_ranks = std::stoi(next());
    else if (a == "--cpu") cpu = true;
    else if (a == "--rounds") rounds = std::max(1, std::stoi(next()));
    else if (a == "--context") context = std::stoi(next());
    else if (a == "--lambda") lambda = std::stod(next());
    else if (a == "--hits") hits = std::stod(next());
    else if (a == "--embd") shape.n_embd = std::stoi(next());
    else if (a == "--heads") shape.n_head = std::stoi(next());
    else if (a == "--ff") shape.n_ff = std::stoi(next());
    else if (a == "--layers") shape.n_layer = std::stoi(next());
    else if (a == "--type") {
      const std::string t = next();
      std::optional<DType> d;
      for (uint32_t id = 0; id < 64 && !d; ++id)
        if (const DTypeTraits* tr = dtype_traits(id); tr && tr->name == t) d = DType(id);
      if (!d) {
        std::fprintf(stderr, "--type: unknown weight type '%s'\n", t.c_str());
        return 2;
      }
      shape.type = *d;
    } else {
      std::fprintf(stderr, "usage: %s [--tokens N] [--dilate F] [--csv FILE] [--tp-ranks 4|1] | --cpu [--context K] [--tokens N] "
                           "[--lambda L] [--hits H] [--rounds R] [--embd N] [--heads N] [--ff N] [--layers N] [--type T]\n", argv[0]);
      return 2;
    }
  }
  if (!(hits > 0 && hits <= 1)) {
    std::fprintf(stderr, "--hits: %g is not a hit rate in (0, 1]\n", hits);
    return 2;
  }
  set_log_level("error");
  try {
    return cpu ? run_cpu(context, tokens > 0 ? tokens : 64, lambda, hits, rounds, shape) : run_emulation(tokens > 0 ? tokens : 6, dilate > 0 ? dilate : 48, dilate > 0 ? dilate : 48, csv, tp_ranks);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_alspec: %s\n", e.what());
    return 1;
  }
}
