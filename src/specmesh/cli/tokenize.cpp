// `specmesh tokenize` and `specmesh inspect`: look inside model and vocabulary files.
#include <cstdio>
#include <cstring>

#include <nlohmann/json.hpp>

#include "specmesh/cli/commands.hpp"
#include "specmesh/formats/gguf.hpp"
#include "specmesh/model/model.hpp"

namespace specmesh {

namespace {

// A GGUF vocabulary works alone (vocab-only files have no tensors); llama2.c needs its -z file.
Tokenizer load_tokenizer(const std::string& model, const std::string& tokenizer) {
  if (is_gguf_file(model)) return Tokenizer(vocab_from_gguf(GgufFile(model)));
  return Tokenizer(Model::load(model, tokenizer)->tokenizer().vocab());
}

std::string value_summary(const GgufValue& v) {
  nlohmann::json j;
  if (v.is_array()) {
    return "[" + std::string(gguf_type_name(v.elem_type)) + " x " + std::to_string(v.array_size()) + "]";
  }
  switch (v.type) {
    case GgufType::STRING: j = v.s.size() > 120 ? v.s.substr(0, 120) + "..." : v.s; break;
    case GgufType::F32: case GgufType::F64: j = v.f; break;
    case GgufType::BOOL: j = v.i != 0; break;
    case GgufType::U64: j = uint64_t(v.i); break;
    default: j = v.i;
  }
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void print_tokenizer(const Tokenizer& tok) {
  const Vocab& v = tok.vocab();
  std::printf("tokenizer: %s (pre %s), %d tokens, %zu merges, bos %d eos %d unk %d, add_bos %d add_space_prefix %d\n",
              v.kind == VocabKind::Spm ? "spm" : "bpe", v.pre.c_str(), tok.n_vocab(), v.merges.size(), v.bos, v.eos,
              v.unk, v.add_bos, v.add_space_prefix);
}

void inspect(const std::string& path, const std::string& tokenizer) {
  if (is_gguf_file(path)) {
    GgufFile f(path);
    std::printf("file: %s\nformat: GGUF v%u, %zu metadata entries, %zu tensors, alignment %zu, data at %zu\n",
                path.c_str(), f.version(), f.metadata().size(), f.tensors().size(), f.alignment(), f.data_offset());
    std::printf("\nmetadata:\n");
    for (const auto& kv : f.metadata()) std::printf("  %-44s %s\n", kv.key.c_str(), value_summary(kv.value).c_str());
    if (!f.tensors().empty()) {
      std::printf("\ntensors:\n");
      size_t total = 0;
      for (const auto& t : f.tensors()) {
        std::string shape;
        for (uint32_t d = 0; d < t.n_dims; ++d) shape += (d ? " x " : "") + std::to_string(t.ne[d]);
        std::printf("  %-36s %-5s %-20s %12zu bytes @ %zu\n", t.name.c_str(), std::string(dtype_name(t.type)).c_str(),
                    shape.c_str(), t.nbytes, t.offset);
        total += t.nbytes;
      }
      std::printf("  total %zu bytes\n", total);
      auto m = Model::load(path);
      const HParams& h = m->hparams();
      std::printf("\nmodel: %s, n_embd %d, n_layer %d, n_head %d, n_head_kv %d, head_dim %d, n_ff %d, n_vocab %d, "
                  "ctx %d, rope %s theta %g n_rot %d, rms_eps %g\n",
                  arch_name(h.arch), h.n_embd, h.n_layer, h.n_head, h.n_head_kv, h.head_dim, h.n_ff, h.n_vocab,
                  h.n_ctx_train, h.rope == RopeStyle::Neox ? "neox" : "interleaved", h.rope_theta, h.n_rot, h.rms_eps);
    }
    print_tokenizer(Tokenizer(vocab_from_gguf(f)));
    return;
  }
  auto m = Model::load(path, tokenizer);
  const HParams& h = m->hparams();
  std::printf("file: %s\nformat: llama2.c checkpoint (float32, %s classifier)\n", path.c_str(),
              m->output.data == m->tok_embd.data ? "shared" : "separate");
  std::printf("model: llama, n_embd %d, n_layer %d, n_head %d, n_head_kv %d, head_dim %d, n_ff %d, n_vocab %d, ctx %d\n",
              h.n_embd, h.n_layer, h.n_head, h.n_head_kv, h.head_dim, h.n_ff, h.n_vocab, h.n_ctx_train);
  std::printf("weights read per token: %zu bytes\n", m->weight_bytes_per_token());
  print_tokenizer(m->tokenizer());
}

}  // namespace

void register_tokenize(CLI::App& app) {
  struct Opts { std::string model, tokenizer, text; bool no_bos = false; };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand("tokenize", "Print the token ids of a text as a JSON array");
  cmd->add_option("-m,--model", o->model, "GGUF (model or vocabulary-only) or llama2.c checkpoint")->required()->check(CLI::ExistingFile);
  cmd->add_option("-z,--tokenizer", o->tokenizer, "tokenizer of a llama2.c checkpoint")->check(CLI::ExistingFile);
  cmd->add_flag("--no-bos", o->no_bos, "do not add BOS/EOS even when the vocabulary asks for them");
  cmd->add_option("text", o->text, "text to tokenize (special-token text is plain text)")->required();
  cmd->callback([o] {
    Tokenizer tok = load_tokenizer(o->model, o->tokenizer);
    std::puts(nlohmann::json(tok.encode(o->text, !o->no_bos)).dump().c_str());
  });
}

void register_inspect(CLI::App& app) {
  struct Opts { std::string model, tokenizer; };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand("inspect", "Show a model's architecture, hyper-parameters, tensors and tokenizer");
  cmd->add_option("model", o->model, "GGUF file or llama2.c checkpoint")->required()->check(CLI::ExistingFile);
  cmd->add_option("-z,--tokenizer", o->tokenizer, "tokenizer of a llama2.c checkpoint")->check(CLI::ExistingFile);
  cmd->callback([o] { inspect(o->model, o->tokenizer); });
}

}  // namespace specmesh
