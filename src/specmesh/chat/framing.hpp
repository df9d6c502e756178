// How a conversation becomes the text a model continues: the ChatFormat interface and the
// two formats the tokenizer allows today.
//
// The tokenizer reads special-token text as plain text (llama.cpp's parse_special = false),
// so a model's real chat template (<|im_start|>user ...) cannot be written as text yet; chat
// models get a plain "User:/Assistant:" transcript instead. A renderer of GGUF chat templates
// is one more ChatFormat.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "specmesh/chat/conversation.hpp"

namespace specmesh {

class Tokenizer;

class ChatFormat {
 public:
  virtual ~ChatFormat() = default;
  // "chat", "story", ...: the mode names of make_chat_format.
  virtual std::string_view name() const = 0;
  // The prompt for the next assistant message: the messages, then whatever opens an assistant
  // turn. Callers encode it with the vocabulary's special tokens (BOS), so it has none.
  virtual std::string render(const std::vector<ChatMessage>& messages) const = 0;
  // Text with which the model would begin a turn that is not its own; a reply ends before it
  // (see StopFilter).
  virtual std::vector<std::string> stop_strings() const = 0;
};

// "System: ...\nUser: ...\nAssistant: ...\n" and then "Assistant:"; a reply ends where the
// model writes the next turn's label on a new line.
class TranscriptFormat final : public ChatFormat {
 public:
  std::string_view name() const override { return "chat"; }
  std::string render(const std::vector<ChatMessage>& messages) const override;
  std::vector<std::string> stop_strings() const override;
};

// Plain continuation for models that only know stories: the messages are one text, the user's
// words joined on with a space where one is missing, and the model's replies continue it.
class StoryFormat final : public ChatFormat {
 public:
  std::string_view name() const override { return "story"; }
  std::string render(const std::vector<ChatMessage>& messages) const override;
  std::vector<std::string> stop_strings() const override { return {}; }
};

// True for vocabularies with the turn markers of a chat template (ChatML, Llama 3, Gemma,
// Phi-3, Mistral): the model was tuned to chat.
bool has_chat_turn_tokens(const Tokenizer& tok);

// The format for --mode: "chat", "story", or "auto" (chat when has_chat_turn_tokens).
// Throws std::invalid_argument for any other mode.
std::unique_ptr<ChatFormat> make_chat_format(std::string_view mode, const Tokenizer& tok);

}  // namespace specmesh
