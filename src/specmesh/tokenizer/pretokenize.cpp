// Pre-tokenizers of byte-level BPE vocabularies: llama.cpp's regex lists per
// tokenizer.ggml.pre family, applied the way its unicode_regex_split applies them.
#include <unicode/normalizer2.h>
#include <unicode/regex.h>
#include <unicode/unistr.h>

#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "specmesh/tokenizer/tokenizer.hpp"

namespace specmesh {

namespace {

// llama.cpp's GPT-2 regex. It lacks GPT-2's final `\s+` alternative (llama.cpp's custom
// splitter for this string has it), but that changes nothing here: the only text it would
// match is a lone whitespace before a non-space, which stays a fragment of its own anyway.
constexpr const char* kGpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))";

// Qwen2 and Llama 3 differ only in how many digits form a group.
constexpr const char* kQwen2 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// DeepSeek's character classes. Written with universal character names because several of
// these code points (U+1F7D, U+1FBE, U+2126, U+212A, ...) change under NFC, which editors and
// tools apply silently; the compiled bytes equal the strings in llama.cpp.
constexpr const char* kDeepseekCjk = "[\u4E00-\u9FA5\u0800-\u4E00\uAC00-\uD7FF]+";
constexpr const char* kDeepseekLlmLetters =
    "\\s?[A-Za-z\u00B5\u00C0-\u00D6\u00D8-\u00F6\u00F8-\u01BA\u01BC-\u01BF\u01C4-\u0293\u0295-\u02AF"
    "\u0370-\u0373\u0376\u0377\u037B-\u037D\u037F\u0386\u0388-\u038A\u038C\u038E-\u03A1\u03A3-\u03F5"
    "\u03F7-\u0481\u048A-\u052F\u0531-\u0556\u10A0-\u10C5\u13A0-\u13F5\u13F8-\u13FD\u1C90-\u1CBA"
    "\u1CBD-\u1CBF\u1D00-\u1D2B\u1D6B-\u1D77\u1D79-\u1D9A\u1E00-\u1F15\u1F18-\u1F1D\u1F20-\u1F45"
    "\u1F48-\u1F4D\u1F50-\u1F57\u1F59\u1F5B\u1F5D\u1F5F-\u1F7D\u1F80-\u1FB4\u1FB6-\u1FBC\u1FBE"
    "\u1FC2-\u1FC4\u1FC6-\u1FCC\u1FD0-\u1FD3\u1FD6-\u1FDB\u1FE0-\u1FEC\u1FF2-\u1FF4\u1FF6-\u1FFC"
    "\u2102\u2107\u210A-\u2113\u2115\u2119-\u211D\u2124\u2126\u2128\u212A-\u212D\u212F-\u2134\u2139"
    "\u213C-\u213F\u2145-\u2149\u214E\u2183\u2184\u2C00-\u2C7B\u2C7E-\u2CE4\u2CEB-\u2CEE\u2CF2\u2CF3"
    "\uA640-\uA66D\uA680-\uA69B\uA722-\uA76F\uA771-\uA787\uA78B-\uA78E\uAB70-\uABBF\uFB00-\uFB06"
    "\uFB13-\uFB17\uFF21-\uFF3A\uFF41-\uFF5A\U00010400-\U0001044F\U000104B0-\U000104D3"
    "\U000104D8-\U000104FB\U00010C80-\U00010CB2\U00010CC0-\U00010CF2\U000118A0-\U000118DF"
    "\U0001E900-\U0001E943]+";
constexpr const char* kDeepseekLlmPunct = "\\s?[!-/:-~\uFF01-\uFF0F\uFF1A-\uFF5E\u2018-\u201F\u3000-\u3002]+";

struct FamilyDef {
  std::vector<const char*> names;  // tokenizer.ggml.pre values (llama.cpp's spellings)
  std::vector<const char*> regexes;
  bool nfc = false;
};

const std::vector<FamilyDef>& family_defs() {
  static const std::vector<FamilyDef> defs = {
      {{"default"}, {R"([\p{P}\$\+<=>\^~\|]+)", kGpt2, R"(\p{N}+)", "[0-9][0-9][0-9]"}},
      {{"llama3", "llama-v3", "llama-bpe", "falcon3"}, {kLlama3}},
      {{"deepseek-llm"},
       {"[\r\n]", kDeepseekLlmLetters, kDeepseekLlmPunct, R"(\s+$)", kDeepseekCjk, R"(\p{N}+)"}},
      {{"deepseek-coder"}, {"[\r\n]", R"(\s?\p{L}+)", R"(\s?\p{P}+)", kDeepseekCjk, R"(\p{N})"}},
      {{"falcon"}, {R"([\p{P}\$\+<=>\^~\|`]+)", kGpt2, "[0-9][0-9][0-9]"}},
      {{"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"}, {R"(\p{N})", kGpt2}},
      // gpt-neox is not a llama.cpp spelling (its GGUF has no pre key, so llama.cpp uses
      // "default"); the name is accepted for vocabularies built by hand, as HF's NeoX split.
      {{"gpt-2", "mpt", "gpt-neox", "olmo", "jais", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v1-en",
        "jina-v2-es", "jina-v2-de", "jina-v2-code", "roberta-bpe"},
       {kGpt2}},
      // Qwen's HF tokenizer normalises to NFC before splitting.
      {{"qwen2", "deepseek-r1-qwen"}, {kQwen2}, true},
      {{"stablelm2"}, {kQwen2}},
  };
  return defs;
}

struct Family {
  std::vector<std::unique_ptr<icu::RegexPattern>> patterns;
  bool nfc = false;
};

// Compiled once per process; RegexPattern is immutable and safe to share between threads.
const Family* find_family(std::string_view pre) {
  static const auto families = [] {
    std::map<std::string, std::shared_ptr<Family>, std::less<>> m;
    for (const auto& d : family_defs()) {
      auto f = std::make_shared<Family>();
      f->nfc = d.nfc;
      for (const char* re : d.regexes) {
        UErrorCode st = U_ZERO_ERROR;
        UParseError pe;
        std::unique_ptr<icu::RegexPattern> p(icu::RegexPattern::compile(icu::UnicodeString::fromUTF8(re), 0, pe, st));
        if (U_FAILURE(st)) throw std::logic_error(std::string("bad pre-tokenizer regex: ") + u_errorName(st) + ": " + re);
        f->patterns.push_back(std::move(p));
      }
      for (const char* n : d.names) m.emplace(n, f);
    }
    return m;
  }();
  auto it = families.find(pre);
  return it == families.end() ? nullptr : it->second.get();
}

// UTF-8 to code points exactly as llama.cpp's unicode_cpts_from_utf8: a byte that does not
// start a well-formed sequence becomes U+FFFD and decoding resumes at the next byte. Values
// above U+10FFFF (which llama.cpp cannot re-encode) become U+FFFD too.
std::vector<UChar32> decode_lenient(std::string_view s) {
  std::vector<UChar32> out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  auto cont = [&](size_t i) { return i < n && (p[i] & 0xC0) == 0x80; };
  for (size_t i = 0; i < n;) {
    const uint8_t c = p[i];
    UChar32 cp;
    size_t len;
    if (c < 0x80) {
      cp = c, len = 1;
    } else if (!(c & 0x40)) {
      cp = 0xFFFD, len = 1;
    } else if (!(c & 0x20)) {
      if (cont(i + 1)) cp = ((c & 0x1F) << 6) | (p[i + 1] & 0x3F), len = 2;
      else cp = 0xFFFD, len = 1;
    } else if (!(c & 0x10)) {
      if (cont(i + 1) && cont(i + 2)) cp = ((c & 0x0F) << 12) | ((p[i + 1] & 0x3F) << 6) | (p[i + 2] & 0x3F), len = 3;
      else cp = 0xFFFD, len = 1;
    } else if (!(c & 0x08)) {
      if (cont(i + 1) && cont(i + 2) && cont(i + 3)) {
        cp = ((c & 0x07) << 18) | ((p[i + 1] & 0x3F) << 12) | ((p[i + 2] & 0x3F) << 6) | (p[i + 3] & 0x3F), len = 4;
        if (cp > 0x10FFFF) cp = 0xFFFD;
      } else {
        cp = 0xFFFD, len = 1;
      }
    } else {
      cp = 0xFFFD, len = 1;
    }
    out.push_back(cp);
    i += len;
  }
  return out;
}

void append_utf8(std::string& out, UChar32 cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

}  // namespace

bool is_known_pre_tokenizer(std::string_view pre) { return find_family(pre) != nullptr; }

std::vector<std::string> pre_tokenize(std::string_view text, std::string_view pre) {
  const Family* fam = find_family(pre);
  if (!fam) throw std::invalid_argument("unknown pre-tokenizer '" + std::string(pre) + "'");
  if (text.empty()) return {};

  icu::UnicodeString u;
  for (UChar32 c : decode_lenient(text)) u.append(c);
  if (fam->nfc) {
    UErrorCode st = U_ZERO_ERROR;
    const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(st);
    if (U_SUCCESS(st) && !nfc->isNormalized(u, st)) {
      st = U_ZERO_ERROR;
      icu::UnicodeString norm = nfc->normalize(u, st);
      if (U_FAILURE(st)) throw std::runtime_error(std::string("NFC normalisation failed: ") + u_errorName(st));
      u = norm;
    }
  }
  // Code points as the regexes see them (a surrogate pair appended in halves reads as one).
  std::vector<UChar32> cps;
  cps.reserve(size_t(u.length()));
  for (int32_t i = 0; i < u.length(); i = u.moveIndex32(i, 1)) cps.push_back(u.char32At(i));

  // Fragments are kept as UTF-16 ranges of `u`; every regex of the family splits each
  // fragment on its own, as a separate subject: lookahead and `$` stop at the fragment's end.
  std::vector<std::pair<int32_t, int32_t>> frags{{0, u.length()}}, next;
  for (const auto& pat : fam->patterns) {
    UErrorCode st = U_ZERO_ERROR;
    std::unique_ptr<icu::RegexMatcher> m(pat->matcher(u, st));
    if (U_FAILURE(st)) throw std::runtime_error(std::string("regex matcher: ") + u_errorName(st));
    next.clear();
    for (auto [s, e] : frags) {
      m->region(s, e, st);
      int32_t pos = s;
      while (m->find(st) && U_SUCCESS(st)) {
        const int32_t ms = m->start(st), me = m->end(st);
        if (me == ms) continue;
        if (ms > pos) next.emplace_back(pos, ms);  // unmatched text stays a fragment of its own
        next.emplace_back(ms, me);
        pos = me;
      }
      if (U_FAILURE(st)) throw std::runtime_error(std::string("regex search: ") + u_errorName(st));
      if (pos < e) next.emplace_back(pos, e);
    }
    frags.swap(next);
  }

  // Map UTF-16 offsets back to code points and re-encode each fragment.
  std::vector<int32_t> cp_at(size_t(u.length()) + 1, 0);
  {
    int32_t k = 0, i = 0;
    for (; i < u.length(); ++k) {
      cp_at[i] = k;
      const int32_t nx = u.moveIndex32(i, 1);
      for (int32_t j = i + 1; j < nx; ++j) cp_at[j] = k;
      i = nx;
    }
    cp_at[u.length()] = k;
  }
  std::vector<std::string> words;
  words.reserve(frags.size());
  for (auto [s, e] : frags) {
    std::string w;
    for (int32_t k = cp_at[s]; k < cp_at[e]; ++k) append_utf8(w, cps[k]);
    words.push_back(std::move(w));
  }
  return words;
}

}  // namespace specmesh
