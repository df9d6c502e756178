// chat/: conversations, their framing as prompts (transcript and story), stop strings held
// back on a streamed reply, and trimming a conversation to a token budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "refdata.hpp"
#include "specmesh/chat/conversation.hpp"
#include "specmesh/chat/framing.hpp"
#include "specmesh/chat/stop.hpp"
#include "specmesh/formats/gguf.hpp"
#include "specmesh/tokenizer/tokenizer.hpp"

using namespace specmesh;
using specmesh::test::refdata;

namespace {

using Messages = std::vector<ChatMessage>;

// SPM with only the byte tokens and U+2581: every byte of text is one token and every space
// one more, so prompt sizes are easy to reason about. `extra` pieces are appended.
Tokenizer byte_tokenizer(const std::vector<std::string>& extra = {}) {
  Vocab v;
  v.kind = VocabKind::Spm;
  auto add = [&](std::string piece, TokenType type) {
    v.tokens.push_back(std::move(piece));
    v.types.push_back(type);
    v.scores.push_back(0);
  };
  add("<unk>", TokenType::Unknown);
  add("<s>", TokenType::Control);
  add("</s>", TokenType::Control);
  v.unk = 0, v.bos = 1, v.eos = 2;
  for (int b = 0; b < 256; ++b) {
    char s[8];
    std::snprintf(s, sizeof s, "<0x%02X>", b);
    add(s, TokenType::Byte);
  }
  add("\xE2\x96\x81", TokenType::Normal);
  for (const auto& e : extra) add(e, TokenType::Control);
  return Tokenizer(std::move(v));
}

int prompt_tokens(const Tokenizer& tok, const std::string& prompt) { return int(tok.encode(prompt, true).size()); }

// True when s is well-formed UTF-8 by lead-byte lengths (enough for the texts below).
bool whole_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = uint8_t(s[i]);
    const size_t n = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k)
      if ((uint8_t(s[i + k]) & 0xC0) != 0x80) return false;
    i += n;
  }
  return true;
}

// Feeds `pieces` through a filter and returns what came out (flushed at the end unless stopped).
struct Streamed {
  std::vector<std::string> out;
  std::string text;
  bool stopped = false;
};
Streamed stream(const std::vector<std::string>& stops, const std::vector<std::string>& pieces) {
  StopFilter f(stops);
  Streamed s;
  for (const auto& p : pieces) {
    s.out.push_back(f.feed(p));
    if (f.stopped()) break;
  }
  s.out.push_back(f.flush());
  for (const auto& o : s.out) s.text += o;
  s.stopped = f.stopped();
  return s;
}

}  // namespace

// --- messages and roles

TEST(ChatConversation, RolesHaveTheApiNames) {
  for (ChatRole r : {ChatRole::System, ChatRole::User, ChatRole::Assistant}) EXPECT_EQ(parse_role(role_name(r)), r);
  EXPECT_EQ(role_name(ChatRole::Assistant), "assistant");
  EXPECT_EQ(parse_role("tool"), std::nullopt);
  EXPECT_EQ(parse_role("User"), std::nullopt);  // the API's names are lower case
}

TEST(ChatConversation, AddAndReset) {
  Conversation c;
  c.add(ChatRole::System, "Be brief.");
  c.add(ChatRole::User, "Hi");
  EXPECT_EQ(c.messages(), (Messages{{ChatRole::System, "Be brief."}, {ChatRole::User, "Hi"}}));
  c.reset();
  EXPECT_TRUE(c.messages().empty());
  EXPECT_EQ(Conversation(Messages{{ChatRole::User, "x"}}).messages().size(), 1u);
}

// --- framing

TEST(ChatFraming, TranscriptLabelsEveryTurnAndOpensTheAssistants) {
  const TranscriptFormat f;
  EXPECT_EQ(f.name(), "chat");
  EXPECT_EQ(f.render({}), "Assistant:");
  // A generated reply brings its leading space; one from elsewhere gets it added.
  const Messages m = {{ChatRole::System, "Be brief."},
                      {ChatRole::User, "Hello"},
                      {ChatRole::Assistant, " Hi there."},
                      {ChatRole::User, "How are you?"},
                      {ChatRole::Assistant, "Fine."},
                      {ChatRole::User, ""}};
  EXPECT_EQ(f.render(m),
            "System: Be brief.\nUser: Hello\nAssistant: Hi there.\nUser: How are you?\nAssistant: Fine.\nUser:\n"
            "Assistant:");
  const auto stops = f.stop_strings();
  for (const char* s : {"\nUser:", "\nAssistant:", "\nSystem:"})
    EXPECT_NE(std::find(stops.begin(), stops.end(), s), stops.end()) << s;
}

TEST(ChatFraming, StoryJoinsTheUsersWordsAndContinuesExactly) {
  const StoryFormat f;
  EXPECT_EQ(f.name(), "story");
  EXPECT_TRUE(f.stop_strings().empty());
  EXPECT_EQ(f.render({}), "");
  EXPECT_EQ(f.render({{ChatRole::User, "Once upon a time"}}), "Once upon a time");
  EXPECT_EQ(f.render({{ChatRole::User, "Once upon a time"}, {ChatRole::Assistant, " there was a cat."}, {ChatRole::User, "The cat"}}),
            "Once upon a time there was a cat. The cat");
  // A continuation may finish a word; the user's words after a newline need no space.
  EXPECT_EQ(f.render({{ChatRole::User, "Once upon a ti"}, {ChatRole::Assistant, "me.\n"}, {ChatRole::User, "Then"}}),
            "Once upon a time.\nThen");
  EXPECT_EQ(f.render({{ChatRole::System, "A story."}, {ChatRole::User, " Lily"}}), "A story. Lily");
}

TEST(ChatFraming, AutoModeFollowsTheVocabulary) {
  const Tokenizer story = byte_tokenizer(), chatml = byte_tokenizer({"<|im_start|>", "<|im_end|>"}),
                  llama3 = byte_tokenizer({"<|start_header_id|>"});
  EXPECT_FALSE(has_chat_turn_tokens(story));
  EXPECT_TRUE(has_chat_turn_tokens(chatml));
  EXPECT_TRUE(has_chat_turn_tokens(llama3));
  EXPECT_EQ(make_chat_format("auto", story)->name(), "story");
  EXPECT_EQ(make_chat_format("auto", chatml)->name(), "chat");
  EXPECT_EQ(make_chat_format("chat", story)->name(), "chat");  // --mode overrides
  EXPECT_EQ(make_chat_format("story", chatml)->name(), "story");
  EXPECT_THROW(make_chat_format("chatml", story), std::invalid_argument);
}

TEST(ChatFraming, AutoModeOnRealVocabularies) {
  SPECMESH_REQUIRE_REFDATA();
  const Tokenizer stories(vocab_from_gguf(GgufFile(refdata("gguf-models/stories260K.gguf"))));
  const Tokenizer qwen3(vocab_from_gguf(GgufFile(refdata("qwen3-tokenizer/ggml-vocab-qwen3-helper.gguf"))));
  const Tokenizer phi3(vocab_from_gguf(GgufFile(refdata("gguf-vocab/ggml-vocab-phi-3.gguf"))));
  EXPECT_EQ(make_chat_format("auto", stories)->name(), "story");
  // Both carry a chat template (tokenizer.chat_template): theirs renders the prompts.
  EXPECT_EQ(make_chat_format("auto", qwen3)->name(), "template");
  EXPECT_EQ(make_chat_format("auto", phi3)->name(), "template");
  // Turn tokens without a template: the plain transcript.
  Vocab bare = phi3.vocab();
  bare.chat_template.clear();
  EXPECT_EQ(make_chat_format("auto", Tokenizer(bare))->name(), "chat");
}

// --- stop strings on a stream

TEST(ChatStop, WithoutStopsEverythingPassesAtOnce) {
  const Streamed s = stream({}, {"Hello", " world", "\nUser:"});
  EXPECT_EQ(s.out, (std::vector<std::string>{"Hello", " world", "\nUser:", ""}));
  EXPECT_FALSE(s.stopped);
  // Empty stop strings are no stop strings.
  EXPECT_EQ(stream({""}, {"a", "b"}).text, "ab");
  EXPECT_FALSE(stream({""}, {"a", "b"}).stopped);
}

TEST(ChatStop, APrefixIsHeldBackUntilDecided) {
  const std::vector<std::string> stops = {"\nUser:", "\nAssistant:"};
  // Split across pieces: the beginning is held, then the whole stop string ends the reply.
  Streamed s = stream(stops, {" Hi.", "\nUs", "er", ": and more"});
  EXPECT_EQ(s.out, (std::vector<std::string>{" Hi.", "", "", "", ""}));
  EXPECT_TRUE(s.stopped);
  // The held text turns out to be ordinary text: it comes out with what decided it.
  s = stream(stops, {" Hi.", "\nUs", "ually"});
  EXPECT_EQ(s.out, (std::vector<std::string>{" Hi.", "", "\nUsually", ""}));
  EXPECT_FALSE(s.stopped);
  // A reply that ends inside a prefix gets it at flush.
  s = stream(stops, {" Hi.", "\nAssist"});
  EXPECT_EQ(s.out, (std::vector<std::string>{" Hi.", "", "\nAssist"}));
  // A stop string at the very start, and one inside a single piece with text on both sides.
  EXPECT_EQ(stream(stops, {"\nUser: x"}).out, (std::vector<std::string>{"", ""}));
  s = stream(stops, {"ok\nUser: go\nAssistant:"});
  EXPECT_EQ(s.text, "ok");
  EXPECT_TRUE(s.stopped);
}

TEST(ChatStop, NothingAfterTheStop) {
  StopFilter f({"END"});
  EXPECT_EQ(f.feed("abcEN"), "abc");
  EXPECT_EQ(f.feed("Dxyz"), "");
  EXPECT_TRUE(f.stopped());
  EXPECT_EQ(f.feed("more"), "");
  EXPECT_EQ(f.flush(), "");
}

TEST(ChatStop, EarliestStopWinsAndOverlapsAreHeld) {
  EXPECT_EQ(stream({"ab", "b"}, {"xab"}).text, "x");
  EXPECT_EQ(stream({"b", "ab"}, {"xa", "b"}).text, "x");
  // "ab" is held as the beginning of "abc"; "d" then completes "bd" inside it.
  EXPECT_EQ(stream({"abc", "bd"}, {"ab", "d"}).text, "a");
  // A held prefix that fails can still contain the start of the next candidate.
  const Streamed s = stream({"aab"}, {"aa", "a", "b!"});
  EXPECT_EQ(s.text, "a");
  EXPECT_TRUE(s.stopped);
}

// Every way of cutting a reply into three pieces gives the same text, and the text a stop
// string ends never shows through.
TEST(ChatStop, EverySplitGivesTheSameText) {
  const std::vector<std::string> stops = {"\nUser:", "\nAssistant:"};
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" Sure.\nUse the\nUser: more", " Sure.\nUse the"},
      {" a\n\nAssistant:\nUser:", " a\n"},
      {" no stop \nUser here\nUser", " no stop \nUser here\nUser"},
  };
  for (const auto& [text, want] : cases)
    for (size_t i = 0; i <= text.size(); ++i)
      for (size_t j = i; j <= text.size(); ++j) {
        const Streamed s = stream(stops, {text.substr(0, i), text.substr(i, j - i), text.substr(j)});
        ASSERT_EQ(s.text, want) << "split at " << i << ", " << j;
        for (const auto& o : s.out) ASSERT_EQ(o.find("\nUser:"), std::string::npos);
      }
}

TEST(ChatStop, Utf8StaysWhole) {
  // Whole characters in, whole characters out, also when the stop string has multi-byte
  // characters and a held prefix ends up being plain text.
  const std::vector<std::string> stops = {"\xE3\x80\x82\n\xE7\x94\xA8\xE6\x88\xB7\xEF\xBC\x9A"};  // "。\n用户："
  const std::string good = "\xE5\xA5\xBD\xE7\x9A\x84";                                         // "好的"
  const std::string dot = "\xE3\x80\x82", nl = "\n", user = "\xE7\x94\xA8\xE6\x88\xB7", colon = "\xEF\xBC\x9A";
  Streamed s = stream(stops, {good, dot, nl, user, colon, "x"});
  EXPECT_EQ(s.text, good);
  EXPECT_TRUE(s.stopped);
  s = stream(stops, {good, dot, nl, "\xC3\xA9", user});  // "é" breaks the match
  EXPECT_EQ(s.text, good + dot + nl + "\xC3\xA9" + user);
  for (const auto& o : s.out) EXPECT_TRUE(whole_utf8(o));

  // Pieces that split characters (a byte at a time) still give exactly the text before the stop.
  const std::string text = "caf\xC3\xA9 \xF0\x9F\x98\x80" + dot + nl + user + colon + "after";
  std::vector<std::string> bytes;
  for (char c : text) bytes.emplace_back(1, c);
  s = stream(stops, bytes);
  EXPECT_EQ(s.text, "caf\xC3\xA9 \xF0\x9F\x98\x80");
  EXPECT_TRUE(s.stopped);
  // ASCII stop strings after multi-byte text.
  s = stream({"\nUser:"}, {"\xC3\xA9\n", "Us", "\xC3\xA9"});
  EXPECT_EQ(s.out, (std::vector<std::string>{"\xC3\xA9", "", "\nUs\xC3\xA9", ""}));
}

// A reply as the chat binary handles it: streamed through the format's stop strings, then
// part of the next prompt.
TEST(ChatStop, TranscriptReplyEndsAtTheNextTurn) {
  const TranscriptFormat f;
  Conversation c;
  c.add(ChatRole::User, "Hello");
  EXPECT_EQ(f.render(c.messages()), "User: Hello\nAssistant:");
  const Streamed s = stream(f.stop_strings(), {" Hi", " there", ".", "\n", "User", ":", " Bye"});
  EXPECT_TRUE(s.stopped);
  c.add(ChatRole::Assistant, s.text);
  c.add(ChatRole::User, "Bye");
  EXPECT_EQ(f.render(c.messages()), "User: Hello\nAssistant: Hi there.\nUser: Bye\nAssistant:");
}

// --- trimming to a budget

TEST(ChatBudget, AConversationThatFitsIsUntouched) {
  const Tokenizer tok = byte_tokenizer();
  const TranscriptFormat f;
  const Messages m = {{ChatRole::User, "Hello"}, {ChatRole::Assistant, " Hi."}, {ChatRole::User, "Bye"}};
  Conversation c(m);
  const int need = prompt_tokens(tok, f.render(m));
  EXPECT_EQ(c.fit(f, tok, need), f.render(m));
  EXPECT_EQ(c.messages(), m);
}

TEST(ChatBudget, OldestTurnsGoFirstWithTheirReplies) {
  const Tokenizer tok = byte_tokenizer();
  const TranscriptFormat f;
  const ChatMessage sys{ChatRole::System, "Be brief."}, u1{ChatRole::User, "one"}, a1{ChatRole::Assistant, " 1"},
      u2{ChatRole::User, "two"}, a2{ChatRole::Assistant, " 2"}, u3{ChatRole::User, "three"};
  const Messages all = {sys, u1, a1, u2, a2, u3};

  // Room for exactly the last two turns: the first user message goes and its reply with it.
  Messages want = {sys, u2, a2, u3};
  Conversation c(all);
  EXPECT_EQ(c.fit(f, tok, prompt_tokens(tok, f.render(want))), f.render(want));
  EXPECT_EQ(c.messages(), want);

  // One token less: only the system message and the newest one are left.
  want = {sys, u3};
  c = Conversation(all);
  EXPECT_EQ(c.fit(f, tok, prompt_tokens(tok, f.render({sys, u2, a2, u3})) - 1), f.render(want));
  EXPECT_EQ(c.messages(), want);

  // The same in story mode.
  const StoryFormat story;
  want = {u3};
  c = Conversation({u1, a1, u2, a2, u3});
  EXPECT_EQ(c.fit(story, tok, prompt_tokens(tok, "three")), "three");
  EXPECT_EQ(c.messages(), want);
}

TEST(ChatBudget, ANewestMessageTooLongKeepsItsEnd) {
  const Tokenizer tok = byte_tokenizer();
  const TranscriptFormat transcript;
  const StoryFormat story;
  for (const ChatFormat* f : {static_cast<const ChatFormat*>(&transcript), static_cast<const ChatFormat*>(&story)}) {
    SCOPED_TRACE(std::string(f->name()));
    const std::string long_text = "the quick brown fox jumps over the lazy dog and runs far away";
    const int framing = prompt_tokens(tok, f->render({{ChatRole::User, ""}}));
    for (int room : {3, 10, 25}) {
      const int budget = framing + room;
      Conversation c({{ChatRole::User, "an old turn"}, {ChatRole::Assistant, " ok"}, {ChatRole::User, long_text}});
      const std::string prompt = c.fit(*f, tok, budget);
      ASSERT_EQ(c.messages().size(), 1u);
      const std::string kept = c.messages()[0].content;
      EXPECT_EQ(prompt, f->render(c.messages()));
      EXPECT_LE(prompt_tokens(tok, prompt), budget);
      // A cut before a space drops the space too, so one token may be left over.
      EXPECT_GE(prompt_tokens(tok, prompt), budget - 1) << "more was cut than needed: '" << kept << "'";
      ASSERT_LE(kept.size(), long_text.size());
      EXPECT_EQ(long_text.substr(long_text.size() - kept.size()), kept);
      EXPECT_FALSE(kept.empty() || kept[0] == ' ');
    }
  }
}

TEST(ChatBudget, ACutNeverSplitsACharacter) {
  const Tokenizer tok = byte_tokenizer();
  const StoryFormat f;
  std::string text;
  for (int i = 0; i < 20; ++i) text += "\xC3\xA9\xE2\x82\xAC";  // "é€": 2 + 3 byte tokens
  for (int budget = 3; budget < 40; ++budget) {
    Conversation c({{ChatRole::User, text}});
    const std::string prompt = c.fit(f, tok, budget);
    EXPECT_LE(prompt_tokens(tok, prompt), budget);
    EXPECT_TRUE(whole_utf8(prompt)) << budget;
    EXPECT_EQ(text.substr(text.size() - prompt.size()), prompt);
  }
}

TEST(ChatBudget, SystemMessagesAndFramingThatCannotFitThrow) {
  const Tokenizer tok = byte_tokenizer();
  const TranscriptFormat f;
  Conversation c({{ChatRole::System, "A very long system message."}, {ChatRole::User, "Hi"}});
  EXPECT_THROW(c.fit(f, tok, 10), std::length_error);
  c = Conversation({{ChatRole::User, "Hi"}});
  EXPECT_THROW(c.fit(f, tok, prompt_tokens(tok, "User:\nAssistant:") - 1), std::length_error);
  EXPECT_EQ(c.fit(f, tok, prompt_tokens(tok, "User:\nAssistant:")), "User:\nAssistant:");
}

TEST(ChatBudget, RealVocabularyFits) {
  SPECMESH_REQUIRE_REFDATA();
  const Tokenizer tok(vocab_from_gguf(GgufFile(refdata("gguf-models/stories260K.gguf"))));
  const StoryFormat f;
  Conversation c;
  const char* lines[] = {"Once upon a time", "The dog ran", "Then the sun", "She was happy", "The end"};
  for (const char* line : lines) {
    c.add(ChatRole::User, line);
    const std::string prompt = c.fit(f, tok, 16);
    EXPECT_LE(prompt_tokens(tok, prompt), 16) << prompt;
    c.add(ChatRole::Assistant, " and they played all day long in the big green park with a ball");
  }
  EXPECT_EQ(c.messages().back().role, ChatRole::Assistant);
  EXPECT_EQ(c.messages().front().role, ChatRole::User);
}
