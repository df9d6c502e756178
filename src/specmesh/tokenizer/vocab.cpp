// Vocabularies from GGUF metadata (tokenizer.ggml.*) and from llama2.c tokenizer files.
#include <cstring>

#include "specmesh/formats/gguf.hpp"
#include "specmesh/formats/mapped_file.hpp"
#include "specmesh/tokenizer/tokenizer.hpp"

namespace specmesh {

namespace {

const std::string kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's visible space

bool is_byte_piece(const std::string& s) {
  auto hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'A' && c <= 'F') || (c >= 'a' && c <= 'f'); };
  return s.size() == 6 && s.compare(0, 3, "<0x") == 0 && hex(s[3]) && hex(s[4]) && s[5] == '>';
}

}  // namespace

Vocab vocab_from_gguf(const GgufFile& f) {
  const std::string& path = f.path();
  auto bad = [&](const std::string& what) { return FormatError(path + ": " + what); };

  const auto model = f.get_string("tokenizer.ggml.model");
  if (!model) throw bad("no tokenizer.ggml.model");
  Vocab v;
  if (*model == "llama") {
    v.kind = VocabKind::Spm;
  } else if (*model == "gpt2") {
    v.kind = VocabKind::Bpe;
  } else {
    throw bad("tokenizer model '" + *model + "' is not supported (only 'llama' SPM and 'gpt2' BPE)");
  }

  const GgufValue* tokens = f.find("tokenizer.ggml.tokens");
  if (!tokens || !tokens->is_array() || tokens->elem_type != GgufType::STRING || tokens->strings.empty())
    throw bad("tokenizer.ggml.tokens is missing or not a non-empty string array");
  v.tokens = tokens->strings;
  const size_t n = v.tokens.size();

  v.scores.assign(n, 0.0f);
  if (const GgufValue* s = f.find("tokenizer.ggml.scores")) {
    if (!s->is_array() || s->floats.size() != n)
      throw bad("tokenizer.ggml.scores must be a float array of " + std::to_string(n) + " entries");
    for (size_t i = 0; i < n; ++i) v.scores[i] = float(s->floats[i]);
  }
  // llama.cpp treats every token as NORMAL when the key is absent.
  v.types.assign(n, TokenType::Normal);
  if (const GgufValue* t = f.find("tokenizer.ggml.token_type")) {
    if (!t->is_array() || t->ints.size() != n)
      throw bad("tokenizer.ggml.token_type must be an integer array of " + std::to_string(n) + " entries");
    for (size_t i = 0; i < n; ++i) {
      if (t->ints[i] < 0 || t->ints[i] > 6) throw bad("token " + std::to_string(i) + " has unknown type " + std::to_string(t->ints[i]));
      v.types[i] = static_cast<TokenType>(t->ints[i]);
    }
  }

  if (v.kind == VocabKind::Bpe) {
    const GgufValue* m = f.find("tokenizer.ggml.merges");
    if (!m || !m->is_array() || (m->array_size() > 0 && m->elem_type != GgufType::STRING))
      throw bad("a gpt2 vocabulary needs tokenizer.ggml.merges (string array)");
    v.merges = m->strings;
    for (size_t r = 0; r < v.merges.size(); ++r)
      if (bpe_merge_split(v.merges[r]) == std::string::npos)
        throw bad("tokenizer.ggml.merges: merge " + std::to_string(r) + " is not two pieces split by a space: '" +
                  v.merges[r] + "'");
    v.pre = f.get_string("tokenizer.ggml.pre").value_or("default");
    if (!is_known_pre_tokenizer(v.pre)) throw bad("unknown pre-tokenizer type '" + v.pre + "'");
  } else {
    v.pre = f.get_string("tokenizer.ggml.pre").value_or("default");
  }

  // llama.cpp's defaults, then the file's values.
  if (v.kind == VocabKind::Spm) {
    v.bos = 1, v.eos = 2, v.unk = 0;
    v.add_bos = true;
    v.add_space_prefix = true;
  } else {
    v.add_bos = v.pre == "llama3" || v.pre == "llama-v3" || v.pre == "llama-bpe" || v.pre == "falcon3";
    v.add_space_prefix = false;
  }
  v.add_eos = false;
  // An id outside the vocabulary (e.g. u32 0xFFFFFFFF for "none") leaves the default, as in llama.cpp.
  auto id = [&](const char* key, int32_t& out) {
    if (auto x = f.get_int(key); x && *x >= 0 && uint64_t(*x) < n) out = int32_t(*x);
  };
  id("tokenizer.ggml.bos_token_id", v.bos);
  id("tokenizer.ggml.eos_token_id", v.eos);
  id("tokenizer.ggml.unknown_token_id", v.unk);
  id("tokenizer.ggml.padding_token_id", v.pad);
  id("tokenizer.ggml.eot_token_id", v.eot);
  if (auto b = f.get_bool("tokenizer.ggml.add_bos_token")) v.add_bos = *b;
  if (auto b = f.get_bool("tokenizer.ggml.add_eos_token")) v.add_eos = *b;
  if (auto b = f.get_bool("tokenizer.ggml.add_space_prefix")) v.add_space_prefix = *b;
  v.chat_template = f.get_string("tokenizer.chat_template").value_or("");
  return v;
}

Vocab vocab_from_llama2c(const std::string& path, int n_vocab) {
  return vocab_from_llama2c(MappedFile(path), n_vocab);
}

Vocab vocab_from_llama2c(const MappedFile& file, int n_vocab) {
  const std::string& path = file.path();
  if (n_vocab <= 0) throw FormatError(path + ": vocabulary size must be positive, got " + std::to_string(n_vocab));
  const uint8_t* p = file.data();
  const size_t size = file.size();
  size_t off = 0;
  auto need = [&](size_t len, const char* what, int i) {
    if (size - off < len)
      throw FormatError(path + ": truncated at " + what + " of token " + std::to_string(i) + " (offset " +
                        std::to_string(off) + ", file has " + std::to_string(size) + " bytes, expected " +
                        std::to_string(n_vocab) + " tokens)");
  };
  auto read = [&](void* dst, size_t len, const char* what, int i) {
    need(len, what, i);
    std::memcpy(dst, p + off, len);
    off += len;
  };
  int32_t max_len = 0;
  read(&max_len, 4, "header", -1);
  if (max_len <= 0) throw FormatError(path + ": max_token_length " + std::to_string(max_len) + " is not positive");

  Vocab v;
  v.kind = VocabKind::Spm;
  v.pre = "default";
  v.tokens.resize(n_vocab);
  v.scores.resize(n_vocab);
  v.types.resize(n_vocab);
  for (int i = 0; i < n_vocab; ++i) {
    float score;
    int32_t len;
    read(&score, 4, "score", i);
    read(&len, 4, "length", i);
    if (len < 0 || len > max_len)
      throw FormatError(path + ": token " + std::to_string(i) + " has length " + std::to_string(len) +
                        " (max_token_length " + std::to_string(max_len) + ")");
    need(size_t(len), "text", i);  // before allocating: a length is only as good as the bytes behind it
    std::string s(reinterpret_cast<const char*>(p + off), size_t(len));
    off += size_t(len);
    v.scores[i] = score;
    // run.c's layout: 0 <unk>, 1 "\n<s>\n" (BOS), 2 "\n</s>\n" (EOS), then <0x00>..<0xFF>.
    if (i == 0) {
      v.types[i] = TokenType::Unknown;
    } else if (i == 1 || i == 2) {
      s.erase(0, s.find_first_not_of('\n'));
      s.erase(s.find_last_not_of('\n') + 1);
      v.types[i] = TokenType::Control;
    } else if (is_byte_piece(s)) {
      v.types[i] = TokenType::Byte;
    } else {
      v.types[i] = TokenType::Normal;
      // llama.cpp's SPM code works on U+2581; run.c's pieces use plain spaces.
      std::string t;
      for (char c : s) {
        if (c == ' ') t += kSpace;
        else t += c;
      }
      s = std::move(t);
    }
    v.tokens[i] = std::move(s);
  }
  v.unk = 0;
  v.bos = n_vocab > 1 ? 1 : -1;
  v.eos = n_vocab > 2 ? 2 : -1;
  v.add_bos = true;
  v.add_eos = false;
  v.add_space_prefix = true;  // run.c's "dummy prefix" for a non-empty prompt
  return v;
}

}  // namespace specmesh
