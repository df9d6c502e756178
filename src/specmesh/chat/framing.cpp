// The transcript and story formats, and choosing a format.
#include "specmesh/chat/framing.hpp"

#include <cctype>
#include <stdexcept>

#include "specmesh/chat/template_format.hpp"
#include "specmesh/tokenizer/tokenizer.hpp"

namespace specmesh {

namespace {

// Joins `next` on with one space between, unless either side already has whitespace there
// (a reply generated after "Assistant:" brings its own leading space).
void append_spaced(std::string& text, std::string_view next) {
  if (!text.empty() && !next.empty() && !std::isspace(uint8_t(text.back())) && !std::isspace(uint8_t(next.front())))
    text += ' ';
  text += next;
}

std::string_view label(ChatRole role) {
  switch (role) {
    case ChatRole::System: return "System:";
    case ChatRole::User: return "User:";
    case ChatRole::Assistant: return "Assistant:";
  }
  throw std::logic_error("unknown chat role");
}

}  // namespace

std::string TranscriptFormat::render(const std::vector<ChatMessage>& messages) const {
  std::string prompt;
  for (const ChatMessage& m : messages) {
    std::string turn(label(m.role));
    append_spaced(turn, m.content);
    prompt += turn + "\n";
  }
  return prompt += label(ChatRole::Assistant);
}

std::vector<std::string> TranscriptFormat::stop_strings() const {
  std::vector<std::string> stops;
  for (ChatRole r : {ChatRole::User, ChatRole::Assistant, ChatRole::System}) stops.emplace_back("\n").append(label(r));
  return stops;
}

std::string StoryFormat::render(const std::vector<ChatMessage>& messages) const {
  std::string text;
  for (const ChatMessage& m : messages) {
    if (m.role == ChatRole::Assistant) text += m.content;  // a continuation, joined exactly
    else append_spaced(text, m.content);
  }
  return text;
}

bool has_chat_turn_tokens(const Tokenizer& tok) {
  static const char* const markers[] = {"<|im_start|>", "<|start_header_id|>", "<start_of_turn>", "<|user|>", "[INST]"};
  for (const std::string& t : tok.vocab().tokens)
    for (const char* m : markers)
      if (t == m) return true;
  return false;
}

std::unique_ptr<ChatFormat> make_chat_format(std::string_view mode, const Tokenizer& tok, std::string_view chat_template) {
  const bool has_template = !chat_template.empty() || !tok.vocab().chat_template.empty();
  if (mode == "auto") mode = has_template ? "template" : has_chat_turn_tokens(tok) ? "chat" : "story";
  if (mode == "template") return TemplateFormat::for_tokenizer(tok, chat_template);
  if (mode == "chat") return std::make_unique<TranscriptFormat>();
  if (mode == "story") return std::make_unique<StoryFormat>();
  throw std::invalid_argument("unknown chat mode '" + std::string(mode) + "' (auto, template, chat or story)");
}

}  // namespace specmesh
