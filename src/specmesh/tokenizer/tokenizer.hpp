// Text <-> token ids: SentencePiece-style BPE (llama) and GPT-2-style byte-level BPE.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace specmesh {

class GgufFile;
class MappedFile;

// tokenizer.ggml.token_type values.
enum class TokenType : int32_t {
  Undefined = 0, Normal = 1, Unknown = 2, Control = 3, UserDefined = 4, Unused = 5, Byte = 6,
};

enum class VocabKind { Spm, Bpe };

// Everything a tokenizer needs, as stored in GGUF metadata (or converted from tok512.bin).
struct Vocab {
  VocabKind kind = VocabKind::Spm;
  std::string pre = "default";          // pre-tokenizer family of BPE vocabularies
  std::vector<std::string> tokens;      // SPM: U+2581 for space; BPE: GPT-2 byte-to-unicode text
  std::vector<float> scores;            // SPM merge priority
  std::vector<TokenType> types;
  std::vector<std::string> merges;      // BPE: "left right", rank = index
  int32_t bos = -1, eos = -1, unk = -1, pad = -1, eot = -1;
  bool add_bos = true;
  bool add_eos = false;
  bool add_space_prefix = true;
  std::string chat_template;            // tokenizer.chat_template (Jinja), empty when there is none
};

// Reads tokenizer.ggml.* from a GGUF (model or vocabulary-only); throws FormatError.
Vocab vocab_from_gguf(const GgufFile& file);
// Reads a llama2.c tokenizer file (tok512.bin / tokenizer.bin) for a model of n_vocab tokens.
Vocab vocab_from_llama2c(const std::string& path, int n_vocab);
Vocab vocab_from_llama2c(const MappedFile& file, int n_vocab);

// Where a BPE merge "left right" splits: at the first space after its first character, as
// llama.cpp splits it; npos when there is none (a malformed merge).
size_t bpe_merge_split(std::string_view merge);

// Pre-tokenizer families of byte-level BPE vocabularies (tokenizer.ggml.pre values, as
// llama.cpp spells them). Unknown names are rejected, as llama.cpp does.
bool is_known_pre_tokenizer(std::string_view pre);
// Splits text into the words that BPE merges within, as llama.cpp's unicode_regex_split does
// with the family's regex list (each regex splits every fragment left by the previous ones;
// unmatched text stays a fragment). Returns raw UTF-8 (NFC first for qwen2), before the
// byte-to-unicode mapping; invalid UTF-8 bytes become U+FFFD. Throws std::invalid_argument.
std::vector<std::string> pre_tokenize(std::string_view text, std::string_view pre);

class Tokenizer {
 public:
  explicit Tokenizer(Vocab vocab);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // Text to ids as llama.cpp's llama_tokenize(add_special, parse_special) does. Without
  // parse_special, control-token text is plain text (only user-defined tokens are cut out);
  // with it, the text of every control, unknown and user-defined token becomes that token,
  // longest first, and the text between is encoded as usual (as a rendered chat template
  // needs: "<|im_start|>user\n..."). SPM adds the space prefix at the start and after each
  // such token; BOS/EOS when add_special and the vocabulary asks for them.
  std::vector<int32_t> encode(std::string_view text, bool add_special, bool parse_special = false) const;
  // A prompt as every generator feeds it: encode(text, true, parse_special), and never empty
  // (a model needs one token to start from: BOS, or token 0 for vocabularies without one).
  std::vector<int32_t> encode_prompt(std::string_view text, bool parse_special = false) const;

  // The bytes a token stands for (byte tokens -> the raw byte, U+2581 -> space,
  // byte-level BPE unicode -> bytes; user-defined tokens -> their text; control, unknown and
  // unused tokens -> empty, as llama.cpp's token_to_piece without `special`).
  std::string piece(int32_t id) const;
  // Concatenated pieces; for SPM with add_space_prefix the single leading space is removed
  // (from the first piece with text, and again after a BOS, as run.c prints). No
  // clean-up of spaces before punctuation, so decode(encode(x)) == x for these vocabularies.
  std::string decode(const std::vector<int32_t>& ids) const;

  // End of generation: EOS, EOT, and tokens llama.cpp treats so by name (<|im_end|>,
  // <|endoftext|>, <|eot_id|>, <|end|>, <end_of_turn>, <|eom_id|>, <EOT>).
  bool is_eog(int32_t id) const;
  int32_t bos() const;
  int32_t eos() const;
  int n_vocab() const;
  const Vocab& vocab() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Turns a stream of ids into text without ever emitting a broken UTF-8 sequence:
// bytes of an incomplete character are held back until it completes, bytes that can never
// form one come out as U+FFFD. For SPM with a space prefix, the first piece (and the piece
// after each BOS) loses its leading space, as run.c prints it.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok) : tok_(tok) {}
  std::string feed(int32_t id);   // complete text made available by this token
  std::string flush();            // whatever is held back (invalid bytes become U+FFFD)
 private:
  const Tokenizer& tok_;
  std::string pending_;
  bool first_ = true;
};

}  // namespace specmesh
