// A model's own chat template (GGUF tokenizer.chat_template, or a file given with
// --chat-template) as a ChatFormat: the messages rendered by the Jinja interpreter, the
// result encoded with special-token parsing so "<|im_start|>" becomes that token.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "specmesh/chat/framing.hpp"
#include "specmesh/chat/jinja.hpp"

namespace specmesh {

class TemplateFormat final : public ChatFormat {
 public:
  // `source` is the Jinja text (throws jinja::Error on a syntax error). bos_token and
  // eos_token are the texts the template sees (empty: undefined there). With strip_bos a
  // rendered prompt loses a leading bos_token text: the tokenizer adds BOS itself, and two
  // would be one too many (llama.cpp removes it likewise).
  TemplateFormat(std::string_view source, std::string bos_token, std::string eos_token, bool strip_bos);
  // With the vocabulary's BOS/EOS texts and its add_bos; `source` empty: the vocabulary's own
  // template (std::invalid_argument when it has none).
  static std::unique_ptr<TemplateFormat> for_tokenizer(const Tokenizer& tok, std::string_view source = {});

  std::string_view name() const override { return "template"; }
  std::string render(const std::vector<ChatMessage>& messages) const override;
  std::vector<std::string> stop_strings() const override { return stops_; }
  bool parse_special() const override { return true; }

  // The general form, for front ends with richer messages (tool calls) or variables
  // (tools, enable_thinking): `messages` is a JSON list of {role, content, ...}, `extra`
  // an object of further variables. jinja::Raised carries the template's own complaint
  // (e.g. "Conversation roles must alternate user/assistant/user/assistant/...").
  std::string render_json(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                          const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;

 private:
  jinja::Template template_;
  std::string bos_, eos_;
  bool strip_bos_;
  std::vector<std::string> stops_;
};

}  // namespace specmesh
