// chat/template_format and tokenizer special-token parsing: a model's chat template as the
// chat format (picked in auto mode, overridden by --chat-template), its prompts encoded with
// special tokens parsed as llama.cpp's parse_special does, and the chat binary using it.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "template_data.hpp"
#include "processes.hpp"
#include "refdata.hpp"
#include "specmesh/chat/conversation.hpp"
#include "specmesh/chat/framing.hpp"
#include "specmesh/chat/jinja.hpp"
#include "specmesh/chat/template_format.hpp"
#include "specmesh/formats/gguf.hpp"
#include "specmesh/tokenizer/tokenizer.hpp"

using namespace specmesh;
using specmesh::test::refdata;
namespace fs = std::filesystem;

namespace {

using Ids = std::vector<int32_t>;
const fs::path kData = test::kTemplateData;
using test::slurp;


const Tokenizer& gguf_tokenizer(const std::string& rel) {
  static std::map<std::string, std::unique_ptr<Tokenizer>> cache;
  auto& t = cache[rel];
  if (!t) t = std::make_unique<Tokenizer>(vocab_from_gguf(GgufFile(refdata(rel))));
  return *t;
}

Ids join(std::initializer_list<Ids> parts) {
  Ids out;
  for (const Ids& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// The "no-system" case of cases.json as ChatMessages.
std::vector<ChatMessage> no_system_case() {
  return {{ChatRole::User, "Hello"}, {ChatRole::Assistant, " Hi there"}, {ChatRole::User, "Who are you?\n"}};
}

}  // namespace

// --- parse_special

TEST(TokenizerSpecial, Qwen3ControlTokensAreParsedOnlyWhenAsked) {
  SPECMESH_REQUIRE_REFDATA();
  const Tokenizer& tok = gguf_tokenizer("qwen3-tokenizer/ggml-vocab-qwen3-helper.gguf");
  const std::string text = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n";
  // As llama.cpp: the special tokens whole, the text between them encoded piece by piece.
  const Ids want = join({{151644}, tok.encode("user\nHello", false), {151645}, tok.encode("\n", false), {151644},
                         tok.encode("assistant\n", false)});
  EXPECT_EQ(tok.encode(text, false, true), want);
  EXPECT_EQ(tok.encode("user", false), (Ids{872}));  // tokenizer.json's ids
  EXPECT_EQ(tok.encode("\n", false), (Ids{198}));
  EXPECT_EQ(tok.encode_prompt(text, true), want);  // Qwen adds no BOS
  // Without parse_special the markers stay text, as before.
  const Ids plain = tok.encode(text, false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 151644), 0);
  EXPECT_EQ(tok.decode(plain), text);
}

TEST(TokenizerSpecial, SpmGetsItsSpacePrefixAfterASpecialToken) {
  SPECMESH_REQUIRE_REFDATA();
  const Tokenizer& tok = gguf_tokenizer("gguf-vocab/ggml-vocab-phi-3.gguf");
  // <s> is CONTROL: the BOS token when parsed, and the text after it starts a new fragment.
  EXPECT_EQ(tok.encode("<s>Hi", false, true), join({{1}, tok.encode("Hi", false)}));
  EXPECT_EQ(tok.encode("<s>Hi", true, true), join({{1, 1}, tok.encode("Hi", false)}));
  const Ids plain = tok.encode("<s>Hi", false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 1), 0);
}

TEST(TokenizerSpecial, LongestSpecialTokenWins) {
  Vocab v;
  v.kind = VocabKind::Spm;
  v.add_bos = false;
  v.tokens = {"<unk>", "<a>", "<a><b>", "\xE2\x96\x81"};
  v.types = {TokenType::Unknown, TokenType::Control, TokenType::Control, TokenType::Normal};
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    v.tokens.push_back(buf);
    v.types.push_back(TokenType::Byte);
  }
  v.unk = 0;
  const Tokenizer tok(v);
  const int32_t byte_x = 4 + 'x';
  EXPECT_EQ(tok.encode("x<a><b><a>", false, true), (Ids{3, byte_x, 2, 1}));
  EXPECT_EQ(tok.encode("<unk>", false, true), (Ids{0}));
  EXPECT_NE(tok.encode("<a>", false, false), (Ids{1}));
}

// --- TemplateFormat

TEST(TemplateFormat, TheModelsOwnTemplateIsPickedAndRendersAsJinja2) {
  SPECMESH_REQUIRE_REFDATA();
  const Tokenizer& tok = gguf_tokenizer("qwen3-tokenizer/ggml-vocab-qwen3-helper.gguf");
  const nlohmann::json config = nlohmann::json::parse(slurp(refdata("qwen3-tokenizer/tokenizer_config.json")));
  EXPECT_EQ(tok.vocab().chat_template, config["chat_template"].get<std::string>());
  const auto format = make_chat_format("auto", tok);
  EXPECT_EQ(format->name(), "template");
  EXPECT_TRUE(format->parse_special());
  EXPECT_EQ(format->render(no_system_case()), slurp(kData / "qwen3.no-system.txt"));
  const auto stops = format->stop_strings();
  EXPECT_NE(std::find(stops.begin(), stops.end(), "<|im_end|>"), stops.end());
  // Explicit modes still give the plain formats.
  EXPECT_EQ(make_chat_format("chat", tok)->name(), "chat");
}

TEST(TemplateFormat, ModelsWithoutATemplateKeepTheirFormatUnlessOneIsGiven) {
  SPECMESH_REQUIRE_REFDATA();
  const Tokenizer& tok = gguf_tokenizer("gguf-models/stories260K.gguf");
  EXPECT_TRUE(tok.vocab().chat_template.empty());
  EXPECT_EQ(make_chat_format("auto", tok)->name(), "story");
  EXPECT_THROW(make_chat_format("template", tok), std::invalid_argument);
  // --chat-template: the given text renders the prompts.
  const auto given = make_chat_format("auto", tok, slurp(kData / "chatml.jinja"));
  EXPECT_EQ(given->name(), "template");
  EXPECT_EQ(given->render(no_system_case()), slurp(kData / "chatml.no-system.txt"));
  EXPECT_THROW(make_chat_format("auto", tok, "{% if %}"), jinja::Error);
}

TEST(TemplateFormat, ALeadingBosTextGoesWhenTheTokenizerAddsBos) {
  const std::string llama3 = slurp(kData / "llama3.jinja");
  const std::string want = slurp(kData / "llama3.no-system.txt");
  ASSERT_EQ(want.rfind("<|begin_of_text|>", 0), 0u);
  EXPECT_EQ(TemplateFormat(llama3, "<|begin_of_text|>", "<|eot_id|>", false).render(no_system_case()), want);
  EXPECT_EQ(TemplateFormat(llama3, "<|begin_of_text|>", "<|eot_id|>", true).render(no_system_case()),
            want.substr(std::string("<|begin_of_text|>").size()));
  const auto stops = TemplateFormat(llama3, "<|begin_of_text|>", "<|eot_id|>", true).stop_strings();
  EXPECT_EQ(stops, (std::vector<std::string>{"<|eot_id|>", "<|start_header_id|>"}));
}

TEST(TemplateFormat, TheTemplatesOwnComplaintReachesTheCaller) {
  const TemplateFormat gemma(slurp(kData / "gemma.jinja"), "<bos>", "<eos>", true);
  try {
    gemma.render({{ChatRole::System, "Be brief."}, {ChatRole::User, "Hi"}});
    FAIL() << "rendered";
  } catch (const jinja::Raised& e) {
    EXPECT_STREQ(e.what(), slurp(kData / "gemma.system.error.txt").c_str());
  }
  // The JSON form takes tool calls and further variables.
  const TemplateFormat qwen25(slurp(kData / "qwen2.5.jinja"), "", "<|im_end|>", false);
  const nlohmann::ordered_json tools_case = nlohmann::ordered_json::parse(slurp(kData / "cases.json"))["cases"]["tools"];
  EXPECT_EQ(qwen25.render_json(tools_case["messages"], true, {{"tools", tools_case["tools"]}}),
            slurp(kData / "qwen2.5.tools.txt"));
}

TEST(TemplateFormat, FittingCountsSpecialTokensAsTokens) {
  SPECMESH_REQUIRE_REFDATA();
  const Tokenizer& tok = gguf_tokenizer("qwen3-tokenizer/ggml-vocab-qwen3-helper.gguf");
  const auto format = make_chat_format("auto", tok);
  const std::vector<ChatMessage> messages = no_system_case();
  const int exact = int(tok.encode_prompt(format->render(messages), true).size());
  ASSERT_LT(exact, int(tok.encode_prompt(format->render(messages), false).size()));
  Conversation all(messages);
  EXPECT_EQ(all.fit(*format, tok, exact), format->render(messages));
  EXPECT_EQ(all.messages().size(), 3u);
  Conversation fewer(messages);
  fewer.fit(*format, tok, exact - 1);
  EXPECT_EQ(fewer.messages().size(), 1u);  // the oldest user turn and its reply went
}

// --- the chat binary

namespace {

using Run = test::ShellRun;
using test::shell;

}  // namespace

TEST(TemplateFormat, ChatBinaryTakesAChatTemplateFile) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string chat = std::string(SPECMESH_CHAT_PATH) + " -m " + refdata("gguf-models/stories260K.gguf");
  auto ok = shell("printf 'Once upon a time\\n' | " + chat + " --chat-template " + (kData / "chatml.jinja").string() +
                  " -n 8 --temp 0 2>&1");
  EXPECT_EQ(ok.status, 0) << ok.out;
  EXPECT_NE(ok.out.find("> Once upon a time"), std::string::npos) << ok.out;

  const fs::path bad = fs::temp_directory_path() / ("specmesh-bad-template-" + std::to_string(::getpid()) + ".jinja");
  std::ofstream(bad) << "{% for m in messages %}\n{{ m.content }\n";
  auto broken = shell("printf 'Hi\\n' | " + chat + " --chat-template " + bad.string() + " 2>&1");
  fs::remove(bad);
  EXPECT_EQ(broken.status, 1) << broken.out;
  EXPECT_NE(broken.out.find(bad.string() + ": chat template line 2, column"), std::string::npos) << broken.out;

  auto missing = shell("printf 'Hi\\n' | " + chat + " --mode template 2>&1");
  EXPECT_EQ(missing.status, 1) << missing.out;
  EXPECT_NE(missing.out.find("no chat template"), std::string::npos) << missing.out;
}
