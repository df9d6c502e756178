// Encoding and decoding: llama.cpp's llm_tokenizer_spm (SentencePiece BPE with byte fallback)
// and llm_tokenizer_bpe (byte-level BPE over a pre-tokenizer), with its partition of
// user-defined tokens and its add_bos / add_eos / space-prefix rules.
#include <algorithm>
#include <array>
#include <cstdio>
#include <queue>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "specmesh/tokenizer/tokenizer.hpp"

namespace specmesh {

namespace {

const std::string kSpace = "\xE2\x96\x81";  // U+2581

size_t utf8_len(char c) {
  static constexpr size_t lookup[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return lookup[static_cast<uint8_t>(c) >> 4];
}

std::string cpt_to_utf8(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
  return out;
}

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the other 68 to U+0100...
struct ByteUnicode {
  std::array<std::string, 256> to_text;
  std::unordered_map<std::string, uint8_t> to_byte;
  ByteUnicode() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_text[b] = cpt_to_utf8(printable ? uint32_t(b) : uint32_t(256 + n++));
      to_byte.emplace(to_text[b], uint8_t(b));
    }
  }
};
const ByteUnicode& byte_unicode() {
  static const ByteUnicode m;
  return m;
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

// A piece "<0xNN>" stands for the byte NN.
int byte_of_piece(const std::string& s) {
  if (s.size() != 6 || s.compare(0, 3, "<0x") != 0 || s[5] != '>') return -1;
  const int hi = hex_value(s[3]), lo = hex_value(s[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

struct Symbol {
  int prev, next;
  const char* text;
  size_t n;
};

// One symbol per UTF-8 character of `text`, linked in order: what both BPE variants merge.
void split_symbols(std::string_view text, std::vector<Symbol>& sym) {
  sym.clear();
  for (size_t off = 0; off < text.size();) {
    const size_t len = std::min(utf8_len(text[off]), text.size() - off);
    sym.push_back({int(sym.size()) - 1, -1, text.data() + off, len});
    off += len;
    if (off < text.size()) sym.back().next = int(sym.size());
  }
}

}  // namespace

struct Tokenizer::Impl {
  Vocab v;
  std::unordered_map<std::string, int32_t> token_to_id;
  std::unordered_map<std::string, int32_t> bpe_ranks;  // "left\xFFright" -> rank
  std::array<int32_t, 256> byte_token{};               // SPM byte fallback, -1 when absent
  std::vector<int32_t> user_defined;                   // longest text first
  std::vector<int32_t> special;                        // control, unknown and user-defined, longest first
  std::unordered_set<int32_t> eog;
  bool ignore_merges = false;                          // Llama 3: a word that is a token stays whole

  int32_t find(const std::string& text) const {
    auto it = token_to_id.find(text);
    return it == token_to_id.end() ? -1 : it->second;
  }

  int32_t rank(const std::string& left, const std::string& right) const {
    std::string key;
    key.reserve(left.size() + right.size() + 1);
    key.append(left).append(1, '\xFF').append(right);
    auto it = bpe_ranks.find(key);
    return it == bpe_ranks.end() ? -1 : it->second;
  }

  void encode_spm(const std::string& text, std::vector<int32_t>& out) const;
  void encode_bpe(std::string_view text, std::vector<int32_t>& out) const;
};

size_t bpe_merge_split(std::string_view merge) { return merge.find(' ', 1); }

Tokenizer::Tokenizer(Vocab vocab) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.v = std::move(vocab);
  Vocab& v = m.v;
  const size_t n = v.tokens.size();
  if (n == 0) throw std::invalid_argument("tokenizer: empty vocabulary");
  if (v.types.empty()) v.types.assign(n, TokenType::Normal);
  if (v.scores.empty()) v.scores.assign(n, 0.0f);
  if (v.types.size() != n || v.scores.size() != n)
    throw std::invalid_argument("tokenizer: tokens, scores and types differ in length");
  auto check_id = [&](int32_t& id) {
    if (id >= int32_t(n)) id = -1;
  };
  check_id(v.bos), check_id(v.eos), check_id(v.unk), check_id(v.pad), check_id(v.eot);

  // Later duplicates win, as in llama.cpp's token_to_id.
  m.token_to_id.reserve(n);
  for (size_t i = 0; i < n; ++i) m.token_to_id[v.tokens[i]] = int32_t(i);

  if (v.kind == VocabKind::Bpe) {
    if (!is_known_pre_tokenizer(v.pre)) throw std::invalid_argument("tokenizer: unknown pre-tokenizer '" + v.pre + "'");
    m.ignore_merges = v.pre == "llama3" || v.pre == "llama-v3" || v.pre == "llama-bpe" || v.pre == "falcon3";
    m.bpe_ranks.reserve(v.merges.size());
    for (size_t r = 0; r < v.merges.size(); ++r) {
      const std::string& s = v.merges[r];
      const size_t sp = bpe_merge_split(s);
      if (sp == std::string::npos) throw std::invalid_argument("tokenizer: merge " + std::to_string(r) + " has no space: '" + s + "'");
      std::string key = s.substr(0, sp);
      key += '\xFF';
      key.append(s, sp + 1);
      m.bpe_ranks.emplace(std::move(key), int32_t(r));  // the first (lowest) rank wins
    }
  }

  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    int32_t id = m.find(buf);
    if (id < 0) id = m.find(std::string(1, char(b)));
    m.byte_token[b] = id;
  }

  // User-defined tokens are cut out of plain text before anything else, even when special
  // tokens are not parsed (HF does the same for added tokens; NeoX's space runs rely on it).
  for (size_t i = 0; i < n; ++i)
    if (v.types[i] == TokenType::UserDefined && !v.tokens[i].empty()) m.user_defined.push_back(int32_t(i));
  std::stable_sort(m.user_defined.begin(), m.user_defined.end(),
                   [&](int32_t a, int32_t b) { return v.tokens[a].size() > v.tokens[b].size(); });
  // With parse_special, llama.cpp's cache_special_tokens: control, user-defined and unknown.
  for (size_t i = 0; i < n; ++i) {
    const TokenType t = v.types[i];
    if ((t == TokenType::Control || t == TokenType::UserDefined || t == TokenType::Unknown) && !v.tokens[i].empty())
      m.special.push_back(int32_t(i));
  }
  std::stable_sort(m.special.begin(), m.special.end(),
                   [&](int32_t a, int32_t b) { return v.tokens[a].size() > v.tokens[b].size(); });

  // End of generation: EOS, EOT, and the end-of-turn tokens llama.cpp recognises by name.
  if (v.eos >= 0) m.eog.insert(v.eos);
  if (v.eot >= 0) m.eog.insert(v.eot);
  for (const char* t : {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                        "<EOT>", "_<EOT>"}) {
    if (int32_t id = m.find(t); id >= 0) m.eog.insert(id);
  }
}

Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

// llm_tokenizer_spm: start from UTF-8 characters, repeatedly merge the adjacent pair whose
// concatenation is the vocabulary's highest-scoring token (left-most on ties), then emit
// symbols, falling back to byte tokens for anything that is not a token.
void Tokenizer::Impl::encode_spm(const std::string& text, std::vector<int32_t>& out) const {
  struct Bigram {
    int left, right;
    float score;
    size_t size;
  };
  auto worse = [](const Bigram& a, const Bigram& b) {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };
  std::vector<Symbol> sym;
  split_symbols(text, sym);
  std::priority_queue<Bigram, std::vector<Bigram>, decltype(worse)> queue(worse);
  std::unordered_map<std::string, std::pair<int, int>> rev_merge;
  auto try_add = [&](int l, int r) {
    if (l < 0 || r < 0) return;
    std::string s(sym[l].text, sym[l].n + sym[r].n);
    const int32_t id = find(s);
    if (id < 0) return;
    queue.push({l, r, v.scores[id], s.size()});
    rev_merge[std::move(s)] = {l, r};
  };
  for (int i = 1; i < int(sym.size()); ++i) try_add(i - 1, i);
  while (!queue.empty()) {
    const Bigram b = queue.top();
    queue.pop();
    Symbol& l = sym[b.left];
    Symbol& r = sym[b.right];
    if (l.n == 0 || r.n == 0 || l.n + r.n != b.size) continue;  // stale: one side already merged
    l.n += r.n;
    r.n = 0;
    l.next = r.next;
    if (r.next >= 0) sym[r.next].prev = b.left;
    try_add(l.prev, b.left);
    try_add(b.left, l.next);
  }

  // Resegment: a symbol that is not a token is split back along the merge that made it,
  // and what is left is spelled with byte tokens (or <unk> where the vocabulary has none).
  auto resegment = [&](auto& self, const Symbol& s) -> void {
    const std::string t(s.text, s.n);
    if (int32_t id = find(t); id >= 0) {
      out.push_back(id);
      return;
    }
    if (auto it = rev_merge.find(t); it != rev_merge.end()) {
      self(self, sym[it->second.first]);
      self(self, sym[it->second.second]);
      return;
    }
    bool all_bytes = true;
    for (char c : t) all_bytes = all_bytes && byte_token[uint8_t(c)] >= 0;
    if (all_bytes) {
      for (char c : t) out.push_back(byte_token[uint8_t(c)]);
    } else if (v.unk >= 0) {
      out.push_back(v.unk);
    }
  };
  if (!sym.empty())
    for (int i = 0; i != -1; i = sym[i].next) resegment(resegment, sym[i]);
}

// llm_tokenizer_bpe: pre-tokenize, map each word's bytes to GPT-2 unicode, then merge the
// adjacent pair with the lowest merge rank (left-most on ties) until none applies.
void Tokenizer::Impl::encode_bpe(std::string_view text, std::vector<int32_t>& out) const {
  const ByteUnicode& bu = byte_unicode();
  struct Bigram {
    int left, right;
    int32_t rank;
    size_t left_n, right_n;
  };
  auto worse = [](const Bigram& a, const Bigram& b) { return a.rank > b.rank || (a.rank == b.rank && a.left > b.left); };
  std::vector<Symbol> sym;
  for (const std::string& raw : pre_tokenize(text, v.pre)) {
    std::string word;
    word.reserve(raw.size() * 2);
    for (char c : raw) word += bu.to_text[uint8_t(c)];

    if (ignore_merges && find(word) >= 0) {
      sym.assign(1, {-1, -1, word.data(), word.size()});
    } else {
      split_symbols(word, sym);
    }
    std::priority_queue<Bigram, std::vector<Bigram>, decltype(worse)> queue(worse);
    auto try_add = [&](int l, int r) {
      if (l < 0 || r < 0) return;
      const int32_t rk = rank(std::string(sym[l].text, sym[l].n), std::string(sym[r].text, sym[r].n));
      if (rk >= 0) queue.push({l, r, rk, sym[l].n, sym[r].n});
    };
    for (int i = 1; i < int(sym.size()); ++i) try_add(i - 1, i);
    while (!queue.empty()) {
      const Bigram b = queue.top();
      queue.pop();
      Symbol& l = sym[b.left];
      Symbol& r = sym[b.right];
      // Stale when either side has changed since the pair was queued.
      if (l.n != b.left_n || r.n != b.right_n || l.n == 0 || r.n == 0) continue;
      l.n += r.n;
      r.n = 0;
      l.next = r.next;
      if (r.next >= 0) sym[r.next].prev = b.left;
      try_add(l.prev, b.left);
      try_add(b.left, l.next);
    }
    for (const Symbol& s : sym) {
      if (s.n == 0) continue;
      const std::string t(s.text, s.n);
      if (int32_t id = find(t); id >= 0) {
        out.push_back(id);
        continue;
      }
      // Not a token (only in odd vocabularies): llama.cpp tries each byte alone.
      for (char c : t)
        if (int32_t id = find(std::string(1, c)); id >= 0) out.push_back(id);
    }
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special, bool parse_special) const {
  const Impl& m = *impl_;
  const Vocab& v = m.v;
  const std::vector<int32_t>& cut = parse_special ? m.special : m.user_defined;

  // Cut special tokens out of the text, longest first, each at every occurrence (llama.cpp's
  // tokenizer_st_partition): user-defined ones only, or all of them with parse_special.
  struct Frag {
    int32_t token;  // -1: raw text [begin, end)
    size_t begin, end;
  };
  std::vector<Frag> frags;
  if (!text.empty()) frags.push_back({-1, 0, text.size()});
  std::array<bool, 256> present{};  // vocabularies with thousands of such tokens: skip most fast
  if (!cut.empty())
    for (char c : text) present[uint8_t(c)] = true;
  for (int32_t id : cut) {
    const std::string& t = v.tokens[id];
    if (!present[uint8_t(t[0])]) continue;
    std::vector<Frag> next;
    next.reserve(frags.size());
    for (const Frag& f : frags) {
      if (f.token >= 0) {
        next.push_back(f);
        continue;
      }
      size_t pos = f.begin;
      for (;;) {
        const size_t hit = text.substr(0, f.end).find(t, pos);
        if (hit == std::string_view::npos) break;
        if (hit > pos) next.push_back({-1, pos, hit});
        next.push_back({id, hit, hit + t.size()});
        pos = hit + t.size();
      }
      if (pos < f.end) next.push_back({-1, pos, f.end});
    }
    frags.swap(next);
  }

  std::vector<int32_t> out;
  if (add_special && v.add_bos && v.bos >= 0) out.push_back(v.bos);
  bool prev_special = true;  // SPM: a space prefix at the start and after each cut-out token
  for (const Frag& f : frags) {
    if (f.token >= 0) {
      out.push_back(f.token);
      prev_special = true;
      continue;
    }
    const std::string_view raw = text.substr(f.begin, f.end - f.begin);
    if (v.kind == VocabKind::Spm) {
      std::string s;
      s.reserve(raw.size() * 3 + 3);
      if (v.add_space_prefix && prev_special) s += kSpace;
      for (char c : raw) {
        if (c == ' ') s += kSpace;
        else s += c;
      }
      m.encode_spm(s, out);
    } else {
      m.encode_bpe(raw, out);
    }
    prev_special = false;
  }
  if (add_special && v.add_eos && v.eos >= 0) out.push_back(v.eos);
  return out;
}

std::string Tokenizer::piece(int32_t id) const {
  const Vocab& v = impl_->v;
  if (id < 0 || id >= int32_t(v.tokens.size())) return {};
  const std::string& t = v.tokens[id];
  switch (v.types[id]) {
    case TokenType::Normal:
      break;
    case TokenType::UserDefined:
      return t;
    case TokenType::Byte: {
      const int b = byte_of_piece(t);
      return b < 0 ? std::string() : std::string(1, char(b));
    }
    default:  // control, unknown, unused: not text
      return {};
  }
  if (v.kind == VocabKind::Spm) {
    std::string s;
    s.reserve(t.size());
    for (size_t i = 0; i < t.size();) {
      if (t.compare(i, kSpace.size(), kSpace) == 0) {
        s += ' ';
        i += kSpace.size();
      } else {
        s += t[i++];
      }
    }
    return s;
  }
  // Byte-level BPE: each character stands for one byte; one outside the mapping (not in a
  // well-formed vocabulary) is kept as it is.
  const ByteUnicode& bu = byte_unicode();
  std::string s;
  s.reserve(t.size());
  for (size_t i = 0; i < t.size();) {
    const size_t len = std::min(utf8_len(t[i]), t.size() - i);
    const std::string ch = t.substr(i, len);
    auto it = bu.to_byte.find(ch);
    if (it != bu.to_byte.end()) s += char(it->second);
    else s += ch;
    i += len;
  }
  return s;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  const Vocab& v = impl_->v;
  const bool strip = v.kind == VocabKind::Spm && v.add_space_prefix;
  bool first = true;  // the first text after the start (or after BOS) loses its prefix space
  std::string out;
  for (int32_t id : ids) {
    std::string p = piece(id);
    if (strip) {
      if (id == v.bos) {
        first = true;
        continue;
      }
      if (p.empty()) continue;
      if (first && p[0] == ' ') p.erase(0, 1);
      first = false;
    }
    out += p;
  }
  return out;
}

bool Tokenizer::is_eog(int32_t id) const { return impl_->eog.count(id) != 0; }
int32_t Tokenizer::bos() const { return impl_->v.bos; }
int32_t Tokenizer::eos() const { return impl_->v.eos; }
int Tokenizer::n_vocab() const { return int(impl_->v.tokens.size()); }
const Vocab& Tokenizer::vocab() const { return impl_->v; }

std::vector<int32_t> Tokenizer::encode_prompt(std::string_view text, bool parse_special) const {
  std::vector<int32_t> ids = encode(text, true, parse_special);
  if (ids.empty()) ids.push_back(bos() >= 0 ? bos() : 0);
  return ids;
}

}  // namespace specmesh
