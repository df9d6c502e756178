// Writes the seed corpora of the fuzz targets, small inputs that reach deep into each format,
// in two sets (OUT_DIR/gguf, llama2c, messages, safetensors, topology):
//
//   fuzz_seeds own SOURCE_DIR OUT_DIR       made here from code alone: committed in fuzz/corpus
//   fuzz_seeds refdata REFDATA_DIR OUT_DIR  cut from the reference data: written before each fuzz
//                                           run (scripts/fuzz.sh), never committed
//
// Own: tiny random-weight GGUF models of each architecture and weight type, a reader-only GGUF
// with every value type and the K-quant tensors, tiny llama2.c checkpoints (shared and separate
// classifier, grouped KV heads) with a made-up tokenizer, one envelope of every message kind,
// the example topologies and a few files with the keys they do not use.
// Refdata: tiny models with a reference vocabulary cut down (SPM and byte-level BPE),
// stories260K's GGUF metadata and llama2.c header without their weights, and tok512.bin.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "specmesh/formats/gguf.hpp"
#include "specmesh/formats/gguf_writer.hpp"
#include "specmesh/formats/safetensors.hpp"
#include "specmesh/messages/protocol.hpp"
#include "specmesh/model/synthetic.hpp"

using namespace specmesh;
namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;

namespace {

Bytes read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + p.string());
  return Bytes(std::istreambuf_iterator<char>(f), {});
}

void write_file(const fs::path& p, std::span<const uint8_t> b) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
  if (!f) throw std::runtime_error("cannot write " + p.string());
}

template <class T>
void append(Bytes& b, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  b.insert(b.end(), p, p + sizeof v);
}

// --- GGUF -------------------------------------------------------------------------------------

// The tokenizer keys of a vocabulary GGUF with only its first n_tokens tokens and n_merges merges.
void cut_vocab(const fs::path& from, const fs::path& to, size_t n_tokens, size_t n_merges) {
  GgufFile src(from.string());
  GgufWriter w;
  for (const GgufKV& kv : src.metadata()) {
    if (!kv.key.starts_with("tokenizer.")) continue;
    GgufValue v = kv.value;
    const size_t n = kv.key == "tokenizer.ggml.merges" ? n_merges : n_tokens;
    if (v.strings.size() > n) v.strings.resize(n);
    if (v.ints.size() > n) v.ints.resize(n);
    if (v.floats.size() > n) v.floats.resize(n);
    w.set(kv.key, v);
  }
  w.write(to.string());
}

SyntheticSpec tiny(std::string arch, DType type, int n_embd, int n_head, int n_head_kv) {
  SyntheticSpec s;
  s.arch = std::move(arch);
  s.n_vocab = 259;
  s.n_embd = n_embd;
  s.n_layer = 1;
  s.n_head = n_head;
  s.n_head_kv = n_head_kv;
  s.n_ff = 2 * n_embd;
  s.n_ctx = 32;
  s.weight_type = type;
  s.embd_type = type;
  s.n_threads = 1;
  return s;
}

void write_model(const fs::path& out, const fs::path& tmp, const std::string& name, const SyntheticSpec& s) {
  const fs::path p = tmp / (name + ".gguf");
  write_synthetic_model(s, p.string());
  write_file(out / name, read_file(p));
}

void gguf_seeds(const fs::path& out, const fs::path& tmp) {
  auto model = [&](const std::string& name, const SyntheticSpec& s) { write_model(out, tmp, name, s); };
  SyntheticSpec s = tiny("llama", DType::F32, 8, 2, 1);
  s.tied_output = true;
  model("llama-f32-tied", s);
  model("llama-f16", tiny("llama", DType::F16, 8, 2, 2));
  model("qwen2-q8_0", tiny("qwen2", DType::Q8_0, 32, 2, 1));
  s = tiny("qwen3", DType::Q4_0, 32, 2, 1);
  s.head_dim = 32;
  model("qwen3-q4_0", s);
  model("llama-bf16", tiny("llama", DType::BF16, 8, 1, 1));

  // Every metadata value type and the K-quant tensors (the reader only: no architecture).
  GgufWriter w;
  w.set_u8("u8", 200);
  w.set_i8("i8", -100);
  w.set_u16("u16", 60000);
  w.set_i16("i16", -30000);
  w.set_u32("u32", 4000000000u);
  w.set_i32("i32", -2000000000);
  w.set_u64("u64", ~0ull);
  w.set_i64("i64", INT64_MIN);
  w.set_f32("f32", 0.5f);
  w.set_f64("f64", -1e300);
  w.set_bool("bool", true);
  w.set_string("string", "naïve");
  w.set_array_i32("array.i32", std::vector<int32_t>{-1, 0, 1});
  w.set_array_ints("array.u8", GgufType::U8, std::vector<int64_t>{1, 2, 255});
  w.set_array_ints("array.bool", GgufType::BOOL, std::vector<int64_t>{0, 1});
  w.set_array_floats("array.f64", GgufType::F64, std::vector<double>{1.5, -2});
  w.set_array_f32("array.f32", std::vector<float>{0.25f});
  w.set_array_strings("array.string", std::vector<std::string>{"a", "", "bc"});
  w.set_alignment(64);
  std::vector<float> ramp(256);
  for (size_t i = 0; i < ramp.size(); ++i) ramp[i] = float(i) / 64 - 2;
  w.add_tensor_f32("q4_k", DType::Q4_K, {256}, ramp);
  w.add_tensor_f32("q6_k", DType::Q6_K, {256}, ramp);
  w.add_tensor_f32("q8_0", DType::Q8_0, {32, 2}, std::vector<float>(ramp.begin(), ramp.begin() + 64));
  w.add_tensor_f32("f32", DType::F32, {2, 2, 2, 2}, std::vector<float>(ramp.begin(), ramp.begin() + 16));
  w.set_threads(1);
  w.write((tmp / "types.gguf").string());
  write_file(out / "value-and-tensor-types", read_file(tmp / "types.gguf"));
}

void gguf_refdata_seeds(const fs::path& refdata, const fs::path& out, const fs::path& tmp) {
  // Real vocabularies, cut down: SPM with scores and types, byte-level BPE with merges.
  const struct {
    const char* name;
    const char* file;
    const char* arch;
  } vocabs[] = {
      {"llama-spm-vocab", "gguf-vocab/ggml-vocab-llama-spm.gguf", "llama"},
      {"gpt2-vocab", "gguf-vocab/ggml-vocab-gpt-2.gguf", "llama"},
      {"qwen2-vocab", "qwen3-tokenizer/ggml-vocab-qwen3-helper.gguf", "qwen3"},
      {"falcon-vocab", "gguf-vocab/ggml-vocab-falcon.gguf", "qwen2"},
  };
  for (const auto& v : vocabs) {
    const fs::path cut = tmp / (std::string(v.name) + "-cut.gguf");
    cut_vocab(refdata / v.file, cut, 400, 300);
    SyntheticSpec m = tiny(v.arch, DType::F32, 8, 2, 1);
    if (m.arch == "qwen3") m.head_dim = 4;
    m.vocab_from = cut.string();
    write_model(out, tmp, v.name, m);
  }

  // A real model's metadata and tensor table, without the weights.
  const Bytes stories = read_file(refdata / "gguf-models/stories260K.gguf");
  const size_t header = GgufFile((refdata / "gguf-models/stories260K.gguf").string()).data_offset();
  write_file(out / "stories260K-header", std::span(stories).first(header));
}

// --- llama2.c ---------------------------------------------------------------------------------

// The first n_vocab entries of a llama2.c tokenizer file.
Bytes cut_tokenizer(const Bytes& tok, int n_vocab) {
  size_t off = 4;
  for (int i = 0; i < n_vocab; ++i) {
    int32_t len;
    std::memcpy(&len, tok.data() + off + 4, 4);
    off += 8 + size_t(len);
  }
  return Bytes(tok.begin(), tok.begin() + off);
}

// [u32 checkpoint length][checkpoint][tokenizer], as the llama2c target reads it.
Bytes checkpoint(int dim, int hidden, int n_layers, int n_heads, int n_kv, int vocab, bool shared, int seq_len,
                 const Bytes& tok) {
  const size_t L = n_layers, head = dim / n_heads, kv_dim = n_kv * head;
  const size_t floats = size_t(vocab) * dim + L * dim + L * dim * dim + 2 * L * dim * kv_dim + L * dim * dim +
                        L * dim + 3 * L * dim * hidden + dim + size_t(seq_len) * head + (shared ? 0 : size_t(vocab) * dim);
  Bytes model;
  for (int32_t h : {dim, hidden, n_layers, n_heads, n_kv, shared ? vocab : -vocab, seq_len}) append(model, h);
  std::mt19937 rng(uint32_t(dim * 131 + vocab));
  std::normal_distribution<float> normal(0, 0.5f);
  for (size_t i = 0; i < floats; ++i) append(model, normal(rng));
  Bytes out;
  append(out, uint32_t(model.size()));
  out.insert(out.end(), model.begin(), model.end());
  const Bytes t = cut_tokenizer(tok, vocab);
  out.insert(out.end(), t.begin(), t.end());
  return out;
}

// A llama2.c tokenizer file of n_vocab made-up tokens in tok512.bin's layout: <unk>, <s>, </s>,
// the 256 byte tokens (scored below every piece), then two-letter pieces (every other one
// word-initial) with falling scores.
Bytes made_up_tokenizer(int n_vocab) {
  Bytes tok;
  append(tok, int32_t(8));  // max_token_length
  for (int i = 0; i < n_vocab; ++i) {
    std::string text;
    if (i < 3) {
      text = i == 0 ? "<unk>" : i == 1 ? "<s>" : "</s>";
    } else if (i < 259) {
      char byte[8];
      std::snprintf(byte, sizeof byte, "<0x%02X>", i - 3);
      text = byte;
    } else {
      text = std::string(i % 2 ? "\xe2\x96\x81" : "") + char('a' + i % 26) + char('a' + i / 26 % 26);
    }
    append(tok, i < 259 ? -1000.0f : -float(i));
    append(tok, int32_t(text.size()));
    tok.insert(tok.end(), text.begin(), text.end());
  }
  return tok;
}

void llama2c_seeds(const fs::path& out) {
  const Bytes tok = made_up_tokenizer(300);
  write_file(out / "shared-classifier", checkpoint(8, 16, 1, 2, 2, 300, true, 8, tok));
  write_file(out / "separate-classifier", checkpoint(8, 12, 2, 2, 1, 280, false, 4, tok));
  write_file(out / "one-head", checkpoint(4, 4, 1, 1, 1, 260, true, 2, tok));
}

void llama2c_refdata_seeds(const fs::path& refdata, const fs::path& out) {
  const Bytes tok = read_file(refdata / "llama2c/tok512.bin");
  write_file(out / "tok512-checkpoint", checkpoint(8, 16, 1, 2, 2, 512, true, 8, tok));
  // stories260K.bin's header (its weights cut off) with the whole tok512.bin.
  Bytes header;
  const Bytes stories = read_file(refdata / "llama2c/stories260K.bin");
  append(header, uint32_t(28));
  header.insert(header.end(), stories.begin(), stories.begin() + 28);
  header.insert(header.end(), tok.begin(), tok.end());
  write_file(out / "stories260K-header", header);
}

// --- messages ---------------------------------------------------------------------------------

Tensor ramp_tensor(WireDType dtype, std::vector<int64_t> shape) {
  size_t n = 1;
  for (int64_t d : shape) n *= size_t(d);
  std::vector<uint8_t> bytes(n * dtype_size(dtype));
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = uint8_t(i * 7);
  return Tensor::from(dtype, std::move(shape), std::move(bytes));
}

// k, k frame lengths, the frames, the header: as the messages target reads it.
Bytes frames(const Envelope& e) {
  std::vector<char> header;
  std::vector<Blob> blobs;
  encode(e, header, blobs);
  Bytes out{uint8_t(blobs.size())};
  for (const Blob& b : blobs) append(out, uint16_t(b.size()));
  for (const Blob& b : blobs) {
    const auto* p = reinterpret_cast<const uint8_t*>(b.data());
    out.insert(out.end(), p, p + b.size());
  }
  out.insert(out.end(), header.begin(), header.end());
  return out;
}

void message_seeds(const fs::path& out) {
  const RunStart chain{"target", {1, 2, 3}, {0, 1, 2}, {1, 1, 1}, {}, {}, false};
  const RunStart tree{"draft", {5, 6, 7, 8}, {3, 4, 4, 5}, {1, 3, 5, 1ull << 63}, {1, 0, 1, 1}, {-1, 0, 0, 2}, true};
  const std::pair<const char*, Payload> payloads[] = {
      {"run_start-chain", chain},
      {"run_start-tree", tree},
      {"activations", Activations{"target", 2, tree, {ramp_tensor(WireDType::f32, {4, 8}),
                                                       ramp_tensor(WireDType::f16, {4, 2})}}},
      {"logits", Logits{"target", {0, 2}, ramp_tensor(WireDType::f32, {2, 16})}},
      {"kv_cache_op", KvCacheOp{"target", 3, {{KvOpKind::copy, 0, 3, 0, 17}, {KvOpKind::remove, 1, -1, 5, -1},
                                               {KvOpKind::keep, 2, -1, -1, -1}}}},
      {"cancel", Cancel{{1, 2, UINT64_MAX}}},
      {"heartbeat", Heartbeat{123456789}},
      {"error", Error{ErrorCode::out_of_memory, "stage2", "KV cache full"}},
      {"hidden_states-f32", HiddenStates{"target", 3, {0, 1, 2}, {17, 18, 18}, ramp_tensor(WireDType::f32, {3, 8})}},
      {"hidden_states-f16", HiddenStates{"target", 0, {1}, {4}, ramp_tensor(WireDType::f16, {1, 8})}},
      {"attention_sync-priority", AttentionSync{"receiver", SyncKind::priority, 3, 40, 2, {}, 0}},
      {"attention_sync-handoff",
       AttentionSync{"target", SyncKind::handoff, 3, 40, 1,
                     {ramp_tensor(WireDType::f32, {8}), ramp_tensor(WireDType::f32, {4}),
                      ramp_tensor(WireDType::f32, {4}), ramp_tensor(WireDType::f32, {8})},
                     0}},
      {"attention_sync-report",
       AttentionSync{"target", SyncKind::report, 4, 40, 0, {ramp_tensor(WireDType::u8, {4})}, 0.25}},
      {"replan", Replan{"target", 2, 4, "spare", "n3", "n2", "n0", 1, false}},
      {"replan-done", Replan{"target", 2, 4, "spare", "n3", "n2", "n0", 1, true}},
  };
  uint64_t run = 7;
  for (const auto& [name, p] : payloads) {
    Envelope e = make_envelope(run++, p);
    e.seq = 1000 + run;
    e.session = 0xfeedfacecafebeefull;
    write_file(out / name, frames(e));
  }
  // The other dtypes, on a logits tensor.
  for (WireDType d : {WireDType::bf16, WireDType::i32, WireDType::i64, WireDType::i8}) {
    Envelope e = make_envelope(1, Logits{"target", {0}, ramp_tensor(d, {1, 3})});
    write_file(out / (std::string("logits-") + to_string(d)), frames(e));
  }
}

// --- topologies -------------------------------------------------------------------------------

const char* const kTopologies[][2] = {
    {"params-and-roles", R"(link = { latency_us = 500, gbps = 0.1 }

[run]
model = "big"
draft = "small"
strategy = "spec"
n_predict = 16
n_ctx = 256
temperature = 0.7
top_k = 40
top_p = 0.9
min_p = 0.05
seed = 42
metrics_csv = "metrics.csv"

[run.params]
n_draft = 6
p_accept = 0.4
tree = "1,2,1"
tree_nodes = 32

[run.roles]
draft2 = "small"

[models.big]
path = "/models/big.gguf"

[models.small]
path = "small.bin"
tokenizer = "tok512.bin"

[nodes.head]
endpoint = "tcp://127.0.0.1:5555"
head = true

[nodes.worker]
endpoint = "tcp://127.0.0.1:5556"

[devices.gpu]
node = "worker"
threads = 4
profile = { flops_per_s = 5e12, bytes_per_s = 1e11, op_overhead_us = 3, layer_ms = 0.5, layer_token_ms = 0.01 }

[devices.cpu]
node = "head"
profile = "rpi5"

[[stages]]
model = "big"
device = "gpu"
layers = [0, 2]

[[stages]]
model = "big"
device = "cpu"
fraction = 0.5

[[stages]]
role = "draft2"
device = "cpu"
fraction = 1.0
)"},
    {"pipeinfer", R"(link = "10gbe"
[run]
model = "t"
strategy = "pipeinfer"
draft = "d"
[run.params]
max_runs = 8
p_recovery = 0.1
p_decay = 0.02
cancel = false
n_parallel = 3
p_split = 0.7
max_micro_batch = 2
[models.t]
path = "t.gguf"
[models.d]
path = "d.gguf"
[devices.n300]
profile = "n300"
)"},
    {"alspec", R"([run]
strategy = "alspec"
[run.params]
lambda = 0.2
window = 16
chunk = 8
force_miss = true
emulate_hit_rate = 0.5
[models.m]
path = "m.gguf"
[devices.a]
profile = "h100-tp4"
)"},
    {"tree-array", R"([run]
draft = "m"
[run.params]
tree = [1, 1, 3, 1]
[models.m]
path = "m.gguf"
)"},
};

void topology_seeds(const fs::path& source, const fs::path& out) {
  for (const auto& e : fs::directory_iterator(source / "examples"))
    if (e.path().extension() == ".toml") write_file(out / e.path().stem(), read_file(e.path()));
  for (const auto& [name, text] : kTopologies)
    write_file(out / name, std::span(reinterpret_cast<const uint8_t*>(text), std::strlen(text)));
}

}  // namespace

// --- safetensors ------------------------------------------------------------------------------

// Drafter-shaped files in every dtype the reader takes, with metadata and an empty one.
void safetensors_seeds(const fs::path& out) {
  const std::vector<float> a = {1.0f, -2.0f, 0.5f, 3.0f, 0.25f, -1.5f}, b = {0.125f, 7.0f};
  write_file(out / "f32-f16-bf16", safetensors_bytes({{"fc.weight", {2, 3}, a, DType::F32},
                                                      {"norm.weight", {2}, b, DType::F16},
                                                      {"layers.0.self_attn.q_norm.weight", {2, 1}, b, DType::BF16}},
                                                     {{"format", "pt"}}));
  write_file(out / "scalar-and-empty", safetensors_bytes({{"s", {}, std::span<const float>(a.data(), 1), DType::F32},
                                                          {"z", {0, 4}, {}, DType::F16}}));
  write_file(out / "no-tensors", safetensors_bytes({}));
}

int main(int argc, char** argv) {
  const std::string set = argc == 4 ? argv[1] : "";
  if (set != "own" && set != "refdata") {
    std::cerr << "usage: fuzz_seeds own SOURCE_DIR OUT_DIR | fuzz_seeds refdata REFDATA_DIR OUT_DIR\n";
    return 2;
  }
  const fs::path in = argv[2], out = argv[3];
  const fs::path tmp = fs::temp_directory_path() / ("specmesh-fuzz-seeds-" + std::to_string(::getpid()));
  try {
    const std::vector<std::string> dirs =
        set == "own" ? std::vector<std::string>{"gguf", "llama2c", "messages", "safetensors", "topology"} : std::vector<std::string>{"gguf", "llama2c"};
    for (const std::string& d : dirs) {
      fs::remove_all(out / d);
      fs::create_directories(out / d);
    }
    fs::create_directories(tmp);
    if (set == "own") {
      gguf_seeds(out / "gguf", tmp);
      llama2c_seeds(out / "llama2c");
      message_seeds(out / "messages");
      safetensors_seeds(out / "safetensors");
      topology_seeds(in, out / "topology");
    } else {
      gguf_refdata_seeds(in, out / "gguf", tmp);
      llama2c_refdata_seeds(in, out / "llama2c");
    }
    fs::remove_all(tmp);
  } catch (const std::exception& e) {
    fs::remove_all(tmp);
    std::cerr << "fuzz_seeds: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
