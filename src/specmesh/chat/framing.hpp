// How a conversation becomes the text a model continues: the ChatFormat interface, the plain
// transcript and story formats, and choosing a format (the model's own chat template, see
// template_format.hpp, when it has one).
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
  // turn. Callers encode it with the vocabulary's BOS (Tokenizer::encode_prompt), so it has
  // none at its start.
  virtual std::string render(const std::vector<ChatMessage>& messages) const = 0;
  // True when the rendered text holds special tokens as text ("<|im_start|>"): encode it with
  // parse_special (GenerationRequest::parse_special). Plain formats are plain text.
  virtual bool parse_special() const { return false; }
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

// The format for --mode: "template" (the model's chat template, or `chat_template` when
// given: the text of --chat-template FILE), "chat", "story", or "auto": the template when
// there is one, else chat when has_chat_turn_tokens, else story. Throws
// std::invalid_argument for any other mode or "template" without a template, jinja::Error
// for a template that does not parse.
std::unique_ptr<ChatFormat> make_chat_format(std::string_view mode, const Tokenizer& tok,
                                             std::string_view chat_template = {});

}  // namespace specmesh
