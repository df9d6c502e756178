// Tokenizers against llama.cpp's test vectors, llama2.c's prompt ids, and expected ids made
// independently with Hugging Face tokenizers (tests/data/README.md says how).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "specmesh/formats/gguf.hpp"
#include "specmesh/formats/mapped_file.hpp"
#include "refdata.hpp"
#include "specmesh/tokenizer/tokenizer.hpp"
#include "memory_limit.hpp"

using namespace specmesh;
using specmesh::test::refdata;

namespace {

using Ids = std::vector<int32_t>;

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string data_path(const std::string& name) { return std::string(SPECMESH_SOURCE_DIR) + "/tests/data/" + name; }

// llama.cpp's .inp format: every input is followed by "\n__ggml_vocab_test__\n".
std::vector<std::string> read_inputs() {
  const std::string all = read_file(refdata("gguf-vocab/ggml-vocab-llama-spm.gguf.inp"));
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> out;
  for (size_t pos = 0;;) {
    const size_t hit = all.find(sep, pos);
    if (hit == std::string::npos) break;
    out.push_back(all.substr(pos, hit - pos));
    pos = hit + sep.size();
  }
  return out;
}

// One line of ids per input; an empty line is an input without tokens.
std::vector<Ids> read_outputs(const std::string& path) {
  std::istringstream in(read_file(path));
  std::vector<Ids> out;
  for (std::string line; std::getline(in, line);) {
    std::istringstream ls(line);
    Ids ids;
    for (int32_t x; ls >> x;) ids.push_back(x);
    out.push_back(std::move(ids));
  }
  return out;
}

// Big vocabularies are loaded once per test binary.
const Tokenizer& tokenizer(const std::string& rel) {
  static std::map<std::string, std::unique_ptr<Tokenizer>> cache;
  auto& t = cache[rel];
  if (!t) t = std::make_unique<Tokenizer>(vocab_from_gguf(GgufFile(refdata(rel))));
  return *t;
}

std::string show(const Ids& ids) {
  std::string s;
  for (int32_t x : ids) s += " " + std::to_string(x);
  return s;
}

std::string escape(const std::string& s) {
  std::string o;
  for (unsigned char c : s) {
    if (c == '\n') o += "\\n";
    else if (c == '\t') o += "\\t";
    else o += char(c);
  }
  return o;
}

// Runs all 46 inputs, reports every mismatch, and returns how many matched.
int check_vectors(const Tokenizer& tok, const std::vector<Ids>& expected, bool round_trip) {
  const auto inputs = read_inputs();
  EXPECT_EQ(inputs.size(), 46u);
  EXPECT_EQ(expected.size(), inputs.size());
  int ok = 0;
  for (size_t i = 0; i < inputs.size() && i < expected.size(); ++i) {
    const Ids got = tok.encode(inputs[i], false);
    EXPECT_EQ(got, expected[i]) << "input " << i << " '" << escape(inputs[i]) << "'\n got:" << show(got)
                                << "\nwant:" << show(expected[i]);
    ok += got == expected[i];
    if (round_trip) {
      EXPECT_EQ(tok.decode(got), inputs[i]) << "round trip of input " << i;
    }
  }
  return ok;
}

void vectors_from_refdata(const std::string& name) {
  SPECMESH_REQUIRE_REFDATA();
  const Tokenizer& tok = tokenizer("gguf-vocab/ggml-vocab-" + name + ".gguf");
  EXPECT_EQ(check_vectors(tok, read_outputs(refdata("gguf-vocab/ggml-vocab-" + name + ".gguf.out")), true), 46);
}

void vectors_from_tests_data(const std::string& gguf, const std::string& out) {
  SPECMESH_REQUIRE_REFDATA();
  EXPECT_EQ(check_vectors(tokenizer(gguf), read_outputs(data_path(out)), true), 46);
}

}  // namespace

// --- llama.cpp's own vectors (tests/test-tokenizer-0: add_special = false, parse_special = false)

TEST(TokenizerVectors, LlamaSpm) { vectors_from_refdata("llama-spm"); }
TEST(TokenizerVectors, Phi3) { vectors_from_refdata("phi-3"); }
TEST(TokenizerVectors, Gpt2) { vectors_from_refdata("gpt-2"); }

// --- expected ids made with Hugging Face tokenizers (tests/data/README.md)

TEST(TokenizerVectors, Qwen3) { vectors_from_tests_data("qwen3-tokenizer/ggml-vocab-qwen3-helper.gguf", "qwen3.out"); }
TEST(TokenizerVectors, Mpt) { vectors_from_tests_data("gguf-vocab/ggml-vocab-mpt.gguf", "mpt.out"); }
TEST(TokenizerVectors, Falcon) { vectors_from_tests_data("gguf-vocab/ggml-vocab-falcon.gguf", "falcon.out"); }
TEST(TokenizerVectors, Starcoder) { vectors_from_tests_data("gguf-vocab/ggml-vocab-starcoder.gguf", "starcoder.out"); }
TEST(TokenizerVectors, Refact) { vectors_from_tests_data("gguf-vocab/ggml-vocab-refact.gguf", "refact.out"); }
TEST(TokenizerVectors, DeepseekLlm) { vectors_from_tests_data("gguf-vocab/ggml-vocab-deepseek-llm.gguf", "deepseek-llm.out"); }
TEST(TokenizerVectors, DeepseekCoder) { vectors_from_tests_data("gguf-vocab/ggml-vocab-deepseek-coder.gguf", "deepseek-coder.out"); }

// gpt-neox's GGUF has no tokenizer.ggml.pre, so llama.cpp (and we) fall back to the "default"
// regex list, which is not NeoX's split; with the NeoX split it equals MPT's ids (same vocab).
TEST(TokenizerVectors, GptNeoxWithNeoxSplitEqualsMpt) {
  SPECMESH_REQUIRE_REFDATA();
  Vocab v = vocab_from_gguf(GgufFile(refdata("gguf-vocab/ggml-vocab-gpt-neox.gguf")));
  EXPECT_EQ(v.pre, "default");
  EXPECT_EQ(Tokenizer(v).encode("3333", false), (Ids{20084, 20}));  // "[0-9][0-9][0-9]" splits "333" off
  v.pre = "gpt-neox";
  EXPECT_EQ(check_vectors(Tokenizer(v), read_outputs(data_path("mpt.out")), true), 46);
}

// --- llama2.c: tok512.bin (run.c's encode) and the same vocabulary inside stories260K.gguf

namespace {

const std::vector<std::pair<std::string, Ids>> kStoriesPrompts = {
    {"Once upon a time", {1, 403, 407, 261, 378}},
    {"Zoo", {1, 410, 469, 347}},
    {"Lily and Tom", {1, 317, 269, 274, 287}},
    {"", {1}},
};

void check_stories(const Tokenizer& tok) {
  EXPECT_EQ(tok.n_vocab(), 512);
  EXPECT_EQ(tok.bos(), 1);
  EXPECT_EQ(tok.eos(), 2);
  for (const auto& [text, ids] : kStoriesPrompts) {
    EXPECT_EQ(tok.encode(text, true), ids) << "'" << text << "'";
    EXPECT_EQ(tok.decode(ids), text);
  }
  // Characters outside the 512 pieces fall back to byte tokens (id = byte + 3).
  const Ids han = tok.encode("\xE4\xB8\xAD", false);  // U+4E2D
  EXPECT_EQ(han, (Ids{410, 0xE4 + 3, 0xB8 + 3, 0xAD + 3}));  // 410 is the lone U+2581 prefix
  EXPECT_EQ(tok.piece(0xE4 + 3), "\xE4");
  EXPECT_EQ(tok.decode(han), "\xE4\xB8\xAD");
}

}  // namespace

TEST(TokenizerLlama2c, Tok512MatchesRunC) {
  SPECMESH_REQUIRE_REFDATA();
  const Vocab v = vocab_from_llama2c(refdata("llama2c/tok512.bin"), 512);
  EXPECT_EQ(v.tokens[1], "<s>");
  EXPECT_EQ(v.tokens[2], "</s>");
  EXPECT_EQ(v.types[0], TokenType::Unknown);
  EXPECT_EQ(v.types[3], TokenType::Byte);
  EXPECT_EQ(v.types[258], TokenType::Byte);
  EXPECT_EQ(v.types[259], TokenType::Normal);
  check_stories(Tokenizer(v));
}

TEST(TokenizerLlama2c, Stories260KGgufVocabMatchesRunC) {
  SPECMESH_REQUIRE_REFDATA();
  const Tokenizer gguf(vocab_from_gguf(GgufFile(refdata("gguf-models/stories260K.gguf"))));
  check_stories(gguf);
  // Both sources hold the same vocabulary once tok512's spaces are written as U+2581.
  const Vocab bin = vocab_from_llama2c(refdata("llama2c/tok512.bin"), 512);
  EXPECT_EQ(bin.tokens, gguf.vocab().tokens);
  EXPECT_EQ(bin.scores, gguf.vocab().scores);
  EXPECT_EQ(bin.types, gguf.vocab().types);
}

TEST(TokenizerLlama2c, TruncatedFileIsAFormatError) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string all = read_file(refdata("llama2c/tok512.bin"));
  const std::string path = (std::filesystem::temp_directory_path() / "specmesh_tok_truncated.bin").string();
  std::ofstream(path, std::ios::binary) << all.substr(0, all.size() - 3);
  EXPECT_THROW(vocab_from_llama2c(path, 512), FormatError);
  EXPECT_NO_THROW(vocab_from_llama2c(path, 511));
  std::filesystem::remove(path);
}

// Found by fuzzing (fuzz/llama2c.cpp): a 2.5 KB tokenizer file with max_token_length near 1 GiB
// and a token claiming that length made the loader allocate it before finding the file too
// short. Here: 17 bytes and 2^30. Checked in a child process under an address-space limit, so a
// regression fails instead of eating the machine's memory.
TEST(TokenizerLlama2c, HostileTokenLengthIsRefusedBeforeAllocating) {
  auto put = [](std::string& b, auto v) { b.append(reinterpret_cast<const char*>(&v), sizeof v); };
  std::string bytes;
  put(bytes, int32_t(1) << 30);       // max_token_length
  put(bytes, 0.0f);                   // token 0: score,
  put(bytes, (int32_t(1) << 30) - 1);  // length,
  bytes += "<unk>";                   // and the few bytes there are
  const MappedFile file = MappedFile::copy_of(
      {reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}, "hostile-tok.bin");
  auto refused_within_limit = [&] {
    test::cap_address_space();
    try {
      vocab_from_llama2c(file, 3);
    } catch (const FormatError& e) {
      const std::string msg = e.what();
      return msg.find("hostile-tok.bin: truncated at text of token 0") != std::string::npos ? 0 : 2;
    } catch (...) {
      return 3;  // std::bad_alloc: it tried
    }
    return 1;
  };
  // _exit: the forked child must not run static destructors.
  EXPECT_EXIT(::_exit(refused_within_limit()), ::testing::ExitedWithCode(0), "");
}

// llama2.c's test.c vectors for the Llama-2 32000 vocabulary (with BOS), as listed in EXPECTED.md.
TEST(TokenizerLlama2c, Llama2VectorsFromTestC) {
  SPECMESH_REQUIRE_REFDATA();
  const Tokenizer& tok = tokenizer("gguf-vocab/ggml-vocab-llama-spm.gguf");
  const std::string ind = "        ";
  const std::vector<std::pair<std::string, Ids>> cases = {
      {"", {1}},
      {"I believe the meaning of life is", {1, 306, 4658, 278, 6593, 310, 2834, 338}},
      {"Simply put, the theory of relativity states that ",
       {1, 3439, 17632, 1925, 29892, 278, 6368, 310, 14215, 537, 5922, 393, 29871}},
      {"A brief message congratulating the team on the launch:\n\n" + ind + "Hi everyone,\n\n" + ind + "I just ",
       {1, 319, 11473, 2643, 378, 629, 271, 18099, 278, 3815, 373, 278, 6826, 29901, 13, 13, 4706, 6324, 14332, 29892,
        13, 13, 4706, 306, 925, 29871}},
      {"Translate English to French:\n\n" + ind + "sea otter => loutre de mer\n" + ind +
           "peppermint => menthe poivr\xC3\xA9" "e\n" + ind + "plush girafe => girafe peluche\n" + ind + "cheese =>",
       {1, 4103, 9632, 4223, 304, 5176, 29901, 13, 13, 4706, 7205, 4932, 357, 1149, 301, 449, 276, 316, 2778, 13, 4706,
        1236, 407, 837, 524, 1149, 6042, 354, 772, 440, 29878, 1318, 13, 4706, 715, 1878, 330, 3055, 1725, 1149, 330,
        3055, 1725, 4639, 28754, 13, 4706, 923, 968, 1149}},
  };
  for (const auto& [text, ids] : cases) {
    EXPECT_EQ(tok.encode(text, true), ids) << "'" << escape(text) << "'";
    EXPECT_EQ(tok.decode(ids), text);
  }
}

// --- SPM details on a hand-made vocabulary

namespace {

Vocab tiny_spm(float score_sp_a, float score_ab) {
  Vocab v;
  v.kind = VocabKind::Spm;
  const std::string sp = "\xE2\x96\x81";
  v.tokens = {"<unk>", "<s>", "</s>", sp, "a", "b", sp + "a", "ab"};
  v.types = {TokenType::Unknown, TokenType::Control, TokenType::Control, TokenType::Normal,
             TokenType::Normal,  TokenType::Normal,  TokenType::Normal,  TokenType::Normal};
  v.scores = {0, 0, 0, -1, -1, -1, score_sp_a, score_ab};
  v.bos = 1, v.eos = 2, v.unk = 0;
  return v;
}

}  // namespace

TEST(TokenizerSpm, HighestScoreMergesFirstAndTiesGoLeft) {
  EXPECT_EQ(Tokenizer(tiny_spm(-5, -2)).encode("ab", false), (Ids{3, 7}));  // "ab" scores higher
  EXPECT_EQ(Tokenizer(tiny_spm(-2, -5)).encode("ab", false), (Ids{6, 5}));
  EXPECT_EQ(Tokenizer(tiny_spm(-3, -3)).encode("ab", false), (Ids{6, 5}));  // tie: left-most pair
}

TEST(TokenizerSpm, UnknownWithoutByteTokensAndSpecialDefaults) {
  Tokenizer tok(tiny_spm(-2, -5));
  EXPECT_EQ(tok.encode("ac", false), (Ids{6, 0}));  // no byte tokens: one <unk> for "c"
  EXPECT_EQ(tok.encode("a", true), (Ids{1, 6}));
  EXPECT_EQ(tok.encode("", true), (Ids{1}));
  EXPECT_EQ(tok.encode("", false), (Ids{}));
  Vocab v = tiny_spm(-2, -5);
  v.add_space_prefix = false;
  v.add_eos = true;
  EXPECT_EQ(Tokenizer(v).encode("ab", true), (Ids{1, 7, 2}));
  EXPECT_EQ(Tokenizer(v).encode("ba", false), (Ids{5, 4}));
  EXPECT_EQ(tok.piece(0), "");  // unknown and control tokens have no text
  EXPECT_EQ(tok.piece(1), "");
  EXPECT_EQ(tok.piece(6), " a");
  EXPECT_EQ(tok.decode({1, 6, 5}), "ab");
  EXPECT_TRUE(tok.is_eog(2));
  EXPECT_FALSE(tok.is_eog(1));
}

// phi-3 marks "</s>" USER_DEFINED: it is cut out of plain text, and the text after it gets
// its own space prefix again (llama.cpp's fragment rule).
TEST(TokenizerSpm, UserDefinedTokenIsCutOutOfText) {
  SPECMESH_REQUIRE_REFDATA();
  const Tokenizer& tok = tokenizer("gguf-vocab/ggml-vocab-phi-3.gguf");
  const Ids a = tok.encode("Hello", false), b = tok.encode("world", false);
  Ids want = a;
  want.push_back(2);
  want.insert(want.end(), b.begin(), b.end());
  EXPECT_EQ(tok.encode("Hello</s>world", false), want);
  // "<s>" is CONTROL: plain text when special tokens are not parsed.
  const Ids s = tok.encode("<s>", false);
  EXPECT_TRUE(std::find(s.begin(), s.end(), 1) == s.end()) << show(s);
}

// --- BPE details

TEST(TokenizerBpe, Llama3KeepsWholeWordsThatAreTokens) {
  Vocab v;
  v.kind = VocabKind::Bpe;
  v.tokens = {"a", "b", "c", "bc", "abc"};
  v.types.assign(5, TokenType::Normal);
  v.merges = {"b c"};  // no merge reaches "abc"
  v.pre = "gpt-2";
  EXPECT_EQ(Tokenizer(v).encode("abc", false), (Ids{0, 3}));
  v.pre = "llama-bpe";  // llama.cpp's ignore_merges
  EXPECT_EQ(Tokenizer(v).encode("abc", false), (Ids{4}));
  EXPECT_EQ(Tokenizer(v).encode("abcb", false), (Ids{0, 3, 1}));
}

TEST(TokenizerBpe, MergesByRankLeftMostFirst) {
  Vocab v;
  v.kind = VocabKind::Bpe;
  v.tokens = {"a", "aa", "aaa"};
  v.types.assign(3, TokenType::Normal);
  v.merges = {"a a", "aa a"};
  v.pre = "gpt-2";
  EXPECT_EQ(Tokenizer(v).encode("aaa", false), (Ids{2}));     // (aa)a -> aaa
  EXPECT_EQ(Tokenizer(v).encode("aaaa", false), (Ids{1, 1}));  // left-most pairs first
  v.merges = {"aa a", "a a"};
  EXPECT_EQ(Tokenizer(v).encode("aaaaa", false), (Ids{2, 1}));
}

TEST(TokenizerBpe, Qwen3SpecialsDefaultsAndNfc) {
  SPECMESH_REQUIRE_REFDATA();
  const Tokenizer& tok = tokenizer("qwen3-tokenizer/ggml-vocab-qwen3-helper.gguf");
  EXPECT_EQ(tok.n_vocab(), 151936);
  EXPECT_FALSE(tok.vocab().add_bos);
  EXPECT_EQ(tok.encode("Hello", true), tok.encode("Hello", false));  // no BOS for Qwen
  EXPECT_TRUE(tok.is_eog(151645));  // <|im_end|> (EOS)
  EXPECT_TRUE(tok.is_eog(151643));  // <|endoftext|>
  EXPECT_FALSE(tok.is_eog(151644));
  // <think> is USER_DEFINED: always one token. <|im_start|> is CONTROL: plain text here.
  const Ids t = tok.encode("<think>hi</think>", false);
  ASSERT_GE(t.size(), 3u);
  EXPECT_EQ(t.front(), 151667);
  EXPECT_EQ(t.back(), 151668);
  EXPECT_EQ(tok.piece(151667), "<think>");
  const Ids s = tok.encode("<|im_start|>", false);
  EXPECT_GT(s.size(), 1u);
  EXPECT_EQ(tok.decode(s), "<|im_start|>");
  EXPECT_EQ(tok.piece(151644), "");
  // NFC first: a decomposed "é" tokenizes like the composed one (GPT-2 has no normaliser).
  EXPECT_EQ(tok.encode("caf\x65\xCC\x81", false), tok.encode("caf\xC3\xA9", false));
  const Tokenizer& gpt2 = tokenizer("gguf-vocab/ggml-vocab-gpt-2.gguf");
  EXPECT_NE(gpt2.encode("caf\x65\xCC\x81", false), gpt2.encode("caf\xC3\xA9", false));
  // Invalid UTF-8 is read as U+FFFD, as llama.cpp does.
  EXPECT_EQ(tok.encode("a\xFF" "b", false), tok.encode("a\xEF\xBF\xBD" "b", false));
}

TEST(TokenizerBpe, BosDefaults) {
  SPECMESH_REQUIRE_REFDATA();
  EXPECT_EQ(tokenizer("gguf-vocab/ggml-vocab-gpt-2.gguf").encode("Hi", true),
            tokenizer("gguf-vocab/ggml-vocab-gpt-2.gguf").encode("Hi", false));
  const Tokenizer& ds = tokenizer("gguf-vocab/ggml-vocab-deepseek-coder.gguf");  // add_bos_token = true
  EXPECT_EQ(ds.encode("Hi", true).front(), 32013);
  EXPECT_EQ(tokenizer("gguf-vocab/ggml-vocab-llama-spm.gguf").encode("Hi", true).front(), 1);
  EXPECT_EQ(tokenizer("gguf-vocab/ggml-vocab-gpt-2.gguf").piece(50256), "");  // <|endoftext|> is control
  EXPECT_EQ(tokenizer("gguf-vocab/ggml-vocab-gpt-2.gguf").piece(995), " world");
  EXPECT_TRUE(tokenizer("gguf-vocab/ggml-vocab-gpt-2.gguf").is_eog(50256));
}

// --- pre-tokenizer splits

// Llama 3 has no vocabulary here; its split is checked against HF tokenizers' own split with
// the regex from Llama 3's tokenizer.json (tests/data/llama-bpe.splits.json): the splits of
// llama.cpp's 46 inputs, read from the reference data, then 4 inputs of our own with their text.
TEST(TokenizerPreTokenize, Llama3MatchesHfSplit) {
  SPECMESH_REQUIRE_REFDATA();
  const auto inputs = read_inputs();
  const auto j = nlohmann::json::parse(read_file(data_path("llama-bpe.splits.json")));
  ASSERT_EQ(inputs.size(), 46u);
  ASSERT_EQ(j.size(), 50u);
  for (size_t i = 0; i < j.size(); ++i) {
    const auto& c = j[i];
    const std::string text = i < inputs.size() ? inputs[i] : c["text"].get<std::string>();
    std::string joined;
    for (const std::string& piece : c["split"]) joined += piece;
    ASSERT_EQ(joined, text) << "split " << i << " is not of its input";
    EXPECT_EQ(pre_tokenize(text, "llama-bpe"), c["split"].get<std::vector<std::string>>()) << "'" << escape(text) << "'";
  }
}

TEST(TokenizerPreTokenize, DocumentedDigitAndSpaceRules) {
  using S = std::vector<std::string>;
  EXPECT_EQ(pre_tokenize("x 1234567", "llama3"), (S{"x", " ", "123", "456", "7"}));
  EXPECT_EQ(pre_tokenize("x 1234", "qwen2"), (S{"x", " ", "1", "2", "3", "4"}));
  EXPECT_EQ(pre_tokenize("x 1234", "gpt-2"), (S{"x", " 1234"}));
  EXPECT_EQ(pre_tokenize("x 1234", "starcoder"), (S{"x", " ", "1", "2", "3", "4"}));
  EXPECT_EQ(pre_tokenize("1234567", "falcon"), (S{"123", "456", "7"}));
  EXPECT_EQ(pre_tokenize("1234567", "default"), (S{"123", "456", "7"}));
  EXPECT_EQ(pre_tokenize("a1234", "deepseek-coder"), (S{"a", "1", "2", "3", "4"}));
  EXPECT_EQ(pre_tokenize("a1234", "deepseek-llm"), (S{"a", "1234"}));
  // \s+(?!\S): the last space of a run goes with the next word.
  EXPECT_EQ(pre_tokenize("a   b", "gpt-2"), (S{"a", "  ", " b"}));
  EXPECT_EQ(pre_tokenize("I'm", "gpt-2"), (S{"I", "'m"}));
  EXPECT_EQ(pre_tokenize("I'M", "qwen2"), (S{"I", "'M"}));
  EXPECT_EQ(pre_tokenize("a\n\n b", "qwen2"), (S{"a", "\n\n", " b"}));
  EXPECT_EQ(pre_tokenize("a:=b", "falcon"), (S{"a", ":=", "b"}));
  EXPECT_EQ(pre_tokenize("", "qwen2"), S{});
  EXPECT_THROW(pre_tokenize("x", "no-such-family"), std::invalid_argument);
  Vocab v;
  v.kind = VocabKind::Bpe;
  v.tokens = {"a"};
  v.pre = "no-such-family";
  EXPECT_THROW(Tokenizer{v}, std::invalid_argument);
}

// --- vocab_from_gguf on small hand-written files

namespace {

// A vocabulary-only GGUF v3 with the given string / string-array / bool keys.
struct MiniGguf {
  std::string bytes;
  uint64_t n_kv = 0;
  void u32(uint32_t x) { bytes.append(reinterpret_cast<const char*>(&x), 4); }
  void u64(uint64_t x) { bytes.append(reinterpret_cast<const char*>(&x), 8); }
  void str(const std::string& s) { u64(s.size()), bytes += s; }
  void kv_string(const std::string& k, const std::string& v) { str(k), u32(8), str(v), ++n_kv; }
  void kv_bool(const std::string& k, bool v) { str(k), u32(7), bytes += char(v), ++n_kv; }
  void kv_u32(const std::string& k, uint32_t v) { str(k), u32(4), u32(v), ++n_kv; }
  void kv_strings(const std::string& k, const std::vector<std::string>& v) {
    str(k), u32(9), u32(8), u64(v.size());
    for (const auto& s : v) str(s);
    ++n_kv;
  }
  std::string write(const std::string& name) const {
    std::string out = "GGUF";
    const uint32_t version = 3;
    const uint64_t n_tensors = 0;
    out.append(reinterpret_cast<const char*>(&version), 4);
    out.append(reinterpret_cast<const char*>(&n_tensors), 8);
    out.append(reinterpret_cast<const char*>(&n_kv), 8);
    out += bytes;
    const std::string path = (std::filesystem::temp_directory_path() / name).string();
    std::ofstream(path, std::ios::binary) << out;
    return path;
  }
};

MiniGguf bpe_gguf(const std::string& pre) {
  MiniGguf g;
  g.kv_string("tokenizer.ggml.model", "gpt2");
  if (!pre.empty()) g.kv_string("tokenizer.ggml.pre", pre);
  g.kv_strings("tokenizer.ggml.tokens", {"a", "b", "ab", "<|begin_of_text|>"});
  g.kv_strings("tokenizer.ggml.merges", {"a b"});
  g.kv_u32("tokenizer.ggml.bos_token_id", 3);
  g.kv_u32("tokenizer.ggml.padding_token_id", 0xFFFFFFFFu);
  return g;
}

}  // namespace

TEST(TokenizerGguf, DefaultsFollowLlamaCpp) {
  {
    const std::string p = bpe_gguf("llama-bpe").write("specmesh_tok_llama3.gguf");
    const Vocab v = vocab_from_gguf(GgufFile(p));
    EXPECT_TRUE(v.add_bos);  // llama-bpe adds BOS unless the file says otherwise
    EXPECT_FALSE(v.add_space_prefix);
    EXPECT_EQ(v.bos, 3);
    EXPECT_EQ(v.pad, -1);  // 0xFFFFFFFF means none
    EXPECT_EQ(v.types, std::vector<TokenType>(4, TokenType::Normal));
    EXPECT_EQ(Tokenizer(v).encode("ab", true), (Ids{3, 2}));
    std::filesystem::remove(p);
  }
  {
    MiniGguf g = bpe_gguf("llama-bpe");
    g.kv_bool("tokenizer.ggml.add_bos_token", false);
    const std::string p = g.write("specmesh_tok_llama3_nobos.gguf");
    EXPECT_FALSE(vocab_from_gguf(GgufFile(p)).add_bos);
    std::filesystem::remove(p);
  }
  {
    const std::string p = bpe_gguf("").write("specmesh_tok_nopre.gguf");
    const Vocab v = vocab_from_gguf(GgufFile(p));
    EXPECT_EQ(v.pre, "default");
    EXPECT_FALSE(v.add_bos);
    std::filesystem::remove(p);
  }
  {
    const std::string p = bpe_gguf("no-such-family").write("specmesh_tok_badpre.gguf");
    EXPECT_THROW(vocab_from_gguf(GgufFile(p)), FormatError);
    std::filesystem::remove(p);
  }
  {
    MiniGguf g;
    g.kv_string("tokenizer.ggml.model", "bert");
    g.kv_strings("tokenizer.ggml.tokens", {"a"});
    const std::string p = g.write("specmesh_tok_bert.gguf");
    EXPECT_THROW(vocab_from_gguf(GgufFile(p)), FormatError);
    std::filesystem::remove(p);
  }
  {
    MiniGguf g;
    g.kv_string("tokenizer.ggml.model", "gpt2");
    g.kv_strings("tokenizer.ggml.tokens", {"a"});
    const std::string p = g.write("specmesh_tok_nomerges.gguf");
    EXPECT_THROW(vocab_from_gguf(GgufFile(p)), FormatError);
    std::filesystem::remove(p);
  }
}

// --- streaming detokenisation

namespace {

bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<uint8_t>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k)
      if ((static_cast<uint8_t>(s[i + k]) & 0xC0) != 0x80) return false;
    i += n;
  }
  return true;
}

// Feeds ids one at a time; every chunk must be whole UTF-8 and the chunks must add up to text.
void check_stream(const Tokenizer& tok, const std::string& text) {
  const Ids ids = tok.encode(text, true);
  StreamDecoder dec(tok);
  std::string all;
  for (int32_t id : ids) {
    const std::string chunk = dec.feed(id);
    EXPECT_TRUE(valid_utf8(chunk)) << "partial UTF-8 after id " << id;
    all += chunk;
  }
  all += dec.flush();
  EXPECT_EQ(all, text);
}

}  // namespace

TEST(TokenizerStream, HoldsBackSplitCharacters) {
  SPECMESH_REQUIRE_REFDATA();
  const auto inputs = read_inputs();
  for (const char* rel : {"gguf-vocab/ggml-vocab-llama-spm.gguf", "gguf-vocab/ggml-vocab-gpt-2.gguf",
                          "qwen3-tokenizer/ggml-vocab-qwen3-helper.gguf"}) {
    SCOPED_TRACE(rel);
    for (const auto& text : inputs) check_stream(tokenizer(rel), text);
  }
  // The llama emoji is four byte tokens in the Llama-2 vocabulary: nothing until the last.
  const Tokenizer& spm = tokenizer("gguf-vocab/ggml-vocab-llama-spm.gguf");
  const Ids ids = spm.encode("\xF0\x9F\xA6\x99", false);
  ASSERT_EQ(ids.size(), 5u);  // "▁" then <0xF0> <0x9F> <0xA6> <0x99>
  StreamDecoder dec(spm);
  EXPECT_EQ(dec.feed(ids[0]), "");  // the prefix space of the first piece is dropped
  EXPECT_EQ(dec.feed(ids[1]), "");
  EXPECT_EQ(dec.feed(ids[2]), "");
  EXPECT_EQ(dec.feed(ids[3]), "");
  EXPECT_EQ(dec.feed(ids[4]), "\xF0\x9F\xA6\x99");
  EXPECT_EQ(dec.flush(), "");
}

TEST(TokenizerStream, InvalidBytesBecomeReplacementCharacters) {
  SPECMESH_REQUIRE_REFDATA();
  const Tokenizer& spm = tokenizer("gguf-vocab/ggml-vocab-llama-spm.gguf");
  const int32_t e2 = 3 + 0xE2, x80 = 3 + 0x80;
  const int32_t a = spm.encode("a", false).back();
  StreamDecoder dec(spm);
  EXPECT_EQ(dec.feed(a), "a");
  EXPECT_EQ(dec.feed(e2), "");
  EXPECT_EQ(dec.feed(x80), "");
  EXPECT_EQ(dec.feed(a), "\xEF\xBF\xBD a");  // E2 80 cannot go on with ' ': one U+FFFD
  EXPECT_EQ(dec.feed(x80), "\xEF\xBF\xBD");  // a stray continuation byte
  EXPECT_EQ(dec.feed(e2), "");
  EXPECT_EQ(dec.flush(), "\xEF\xBF\xBD");  // unfinished at the end
}

TEST(TokenizerStream, RunCSpaceRule) {
  SPECMESH_REQUIRE_REFDATA();
  const Tokenizer tok(vocab_from_llama2c(refdata("llama2c/tok512.bin"), 512));
  StreamDecoder dec(tok);
  EXPECT_EQ(dec.feed(1), "");
  EXPECT_EQ(dec.feed(403), "Once");  // the piece after BOS loses its space
  EXPECT_EQ(dec.feed(407), " upon");
  EXPECT_EQ(dec.feed(1), "");
  EXPECT_EQ(dec.feed(403), "Once");
  EXPECT_EQ(tok.decode({1, 403, 407, 261, 378}), "Once upon a time");
  // Byte-level BPE has no space prefix: nothing is stripped.
  const Tokenizer& gpt2 = tokenizer("gguf-vocab/ggml-vocab-gpt-2.gguf");
  StreamDecoder d2(gpt2);
  EXPECT_EQ(d2.feed(995), " world");
}

// --- speed: the 151936-token vocabulary

TEST(TokenizerSpeed, Qwen3BuildsFastAndEncodesInMilliseconds) {
  SPECMESH_REQUIRE_REFDATA();
  using clock = std::chrono::steady_clock;
  const auto tf = clock::now();
  const GgufFile f(refdata("qwen3-tokenizer/ggml-vocab-qwen3-helper.gguf"));
  const auto t0 = clock::now();
  const Tokenizer tok(vocab_from_gguf(f));
  const auto t1 = clock::now();
  const auto inputs = read_inputs();
  size_t n = 0;
  for (const auto& s : inputs) n += tok.encode(s, false).size();
  const auto t2 = clock::now();
  const double build_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
  const double enc_ms = std::chrono::duration<double, std::milli>(t2 - t1).count();
  std::printf("qwen3: GGUF read in %.1f ms, vocab + tokenizer built in %.1f ms, 46 inputs (%zu tokens) encoded in %.2f ms\n",
              std::chrono::duration<double, std::milli>(t0 - tf).count(), build_ms, n, enc_ms);
  // Generous bounds for a loaded 2-core machine; typical values are ~10x lower.
  EXPECT_LT(build_ms, 1500.0);
  EXPECT_LT(enc_ms, 100.0);
}
