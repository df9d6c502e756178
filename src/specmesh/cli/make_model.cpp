// `specmesh make-model`: writes a synthetic (random-weight) llama / qwen2 / qwen3 GGUF.
#include <cctype>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include "specmesh/cli/commands.hpp"
#include "specmesh/formats/gguf.hpp"
#include "specmesh/model/synthetic.hpp"

namespace specmesh {

namespace {

const std::map<std::string, DType>& type_names() {
  static const std::map<std::string, DType> m{
      {"f32", DType::F32},   {"f16", DType::F16},   {"bf16", DType::BF16}, {"q8_0", DType::Q8_0},
      {"q4_0", DType::Q4_0}, {"q4_k", DType::Q4_K}, {"q6_k", DType::Q6_K},
  };
  return m;
}

DType parse_type(std::string s) {
  for (auto& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  auto it = type_names().find(s);
  if (it == type_names().end()) throw CLI::ValidationError("--type", "unknown type '" + s + "'");
  return it->second;
}

struct MakeModelArgs {
  std::string preset, arch, type = "f16", embd_type, vocab_from, output;
  int n_vocab = 0, n_embd = 0, n_layer = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n_ff = 0, n_ctx = 0, threads = 0;
  float rope_theta = 0, rms_eps = 0;
  uint64_t seed = 1;
  bool tied = false, untied = false;
};

}  // namespace

void register_make_model(CLI::App& app) {
  auto a = std::make_shared<MakeModelArgs>();
  CLI::App* cmd = app.add_subcommand("make-model", "Write a synthetic (random-weight) GGUF model");
  std::string presets;
  for (const auto& p : synthetic_preset_names()) presets += (presets.empty() ? "" : ", ") + p;
  std::string types;
  for (const auto& [name, t] : type_names()) types += (types.empty() ? "" : "|") + name;

  cmd->add_option("--preset", a->preset, "Start from a named shape: " + presets)
      ->check(CLI::IsMember(synthetic_preset_names()));
  cmd->add_option("--arch", a->arch, "llama | qwen2 | qwen3")->check(CLI::IsMember({"llama", "qwen2", "qwen3"}));
  cmd->add_option("--vocab", a->n_vocab, "Vocabulary size of the synthetic vocabulary (>= 259)");
  cmd->add_option("--dim", a->n_embd, "Embedding width n_embd");
  cmd->add_option("--layers", a->n_layer, "Number of blocks");
  cmd->add_option("--heads", a->n_head, "Attention heads");
  cmd->add_option("--kv-heads", a->n_head_kv, "Key/value heads (GQA when fewer than --heads)");
  cmd->add_option("--head-dim", a->head_dim, "Head size (default dim / heads)");
  cmd->add_option("--ff", a->n_ff, "Feed-forward hidden size");
  cmd->add_option("--ctx", a->n_ctx, "Training context length written to the metadata");
  cmd->add_option("--rope-theta", a->rope_theta, "RoPE base frequency");
  cmd->add_option("--rms-eps", a->rms_eps, "RMSNorm epsilon");
  cmd->add_option("--type", a->type, "Type of the weight matrices: " + types)
      ->capture_default_str()
      ->check(CLI::IsMember(type_names(), CLI::ignore_case));
  cmd->add_option("--embd-type", a->embd_type, "Type of token_embd.weight (default: --type)")
      ->check(CLI::IsMember(type_names(), CLI::ignore_case));
  cmd->add_option("--seed", a->seed, "RNG seed (same seed, same file)")->capture_default_str();
  cmd->add_option("--vocab-from", a->vocab_from, "Copy the tokenizer of this GGUF or llama2.c tok*.bin (sets --vocab)")
      ->check(CLI::ExistingFile);
  cmd->add_flag("--tied", a->tied, "No output.weight: the classifier is token_embd");
  cmd->add_flag("--untied", a->untied, "Write output.weight even if the preset ties it");
  cmd->add_option("--threads", a->threads, "Worker threads (default: all cores)");
  cmd->add_option("-o,--output", a->output, "Path of the GGUF to write")->required();

  cmd->callback([a, cmd] {
    SyntheticSpec s;
    if (!a->preset.empty()) s = *synthetic_preset(a->preset);
    auto given = [&](const char* flag) { return cmd->count(flag) > 0; };
    if (given("--arch")) s.arch = a->arch;
    if (given("--vocab")) s.n_vocab = a->n_vocab;
    if (given("--dim")) s.n_embd = a->n_embd;
    if (given("--layers")) s.n_layer = a->n_layer;
    if (given("--heads")) s.n_head = a->n_head;
    if (given("--kv-heads")) s.n_head_kv = a->n_head_kv;
    if (given("--head-dim")) s.head_dim = a->head_dim;
    if (given("--ff")) s.n_ff = a->n_ff;
    if (given("--ctx")) s.n_ctx = a->n_ctx;
    if (given("--rope-theta")) s.rope_theta = a->rope_theta;
    if (given("--rms-eps")) s.rms_eps = a->rms_eps;
    // A head size inherited from a preset no longer fits once the width or head count changes.
    if (!given("--head-dim") && (given("--dim") || given("--heads"))) s.head_dim = 0;
    if (a->tied && a->untied) throw CLI::ValidationError("--tied", "--tied and --untied exclude each other");
    if (a->tied) s.tied_output = true;
    if (a->untied) s.tied_output = false;
    s.weight_type = parse_type(a->type);
    s.embd_type = a->embd_type.empty() ? s.weight_type : parse_type(a->embd_type);
    s.seed = a->seed;
    s.vocab_from = a->vocab_from;
    s.n_threads = a->threads;

    const auto t0 = std::chrono::steady_clock::now();
    write_synthetic_model(s, a->output);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    GgufFile f(a->output);
    int64_t params = 0;
    for (const auto& t : f.tensors()) params += t.n_elements();
    std::printf("wrote %s: %s, %.1fM parameters, %zu tensors, %s matrices, %.1f MiB in %.2f s\n", a->output.c_str(),
                s.arch.c_str(), double(params) / 1e6, f.tensors().size(), std::string(dtype_name(s.weight_type)).c_str(),
                double(f.file_size()) / (1 << 20), secs);
  });
}

}  // namespace specmesh
