// Rendering conversations with a model's chat template.
#include "specmesh/chat/template_format.hpp"

#include <stdexcept>

#include "specmesh/tokenizer/tokenizer.hpp"

namespace specmesh {

namespace {

// Texts with which the chat templates of the known families begin or end a turn; those a
// template writes are where a reply ends, should the model write one as text.
constexpr const char* kTurnMarkers[] = {"<|im_end|>", "<|im_start|>", "<|eot_id|>", "<|start_header_id|>",
                                        "<end_of_turn>", "<start_of_turn>", "<|end|>", "<|user|>",
                                        "<|endoftext|>", "[INST]"};

}  // namespace

TemplateFormat::TemplateFormat(std::string_view source, std::string bos_token, std::string eos_token, bool strip_bos)
    : template_(source), bos_(std::move(bos_token)), eos_(std::move(eos_token)), strip_bos_(strip_bos) {
  for (const char* m : kTurnMarkers)
    if (source.find(m) != std::string_view::npos) stops_.emplace_back(m);
  if (!eos_.empty() && source.find("eos_token") != std::string_view::npos) {
    bool known = false;
    for (const std::string& s : stops_) known = known || s == eos_;
    if (!known) stops_.push_back(eos_);
  }
}

std::unique_ptr<TemplateFormat> TemplateFormat::for_tokenizer(const Tokenizer& tok, std::string_view source) {
  const Vocab& v = tok.vocab();
  if (source.empty()) source = v.chat_template;
  if (source.empty()) throw std::invalid_argument("the model has no chat template (tokenizer.chat_template); give one with --chat-template");
  const auto text = [&](int32_t id) { return id >= 0 && size_t(id) < v.tokens.size() ? v.tokens[size_t(id)] : std::string(); };
  return std::make_unique<TemplateFormat>(source, text(v.bos), text(v.eos), v.add_bos && v.bos >= 0);
}

std::string TemplateFormat::render_json(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                        const nlohmann::ordered_json& extra) const {
  nlohmann::ordered_json ctx = {{"messages", messages}, {"add_generation_prompt", add_generation_prompt}, {"tools", nullptr}};
  if (!bos_.empty()) ctx["bos_token"] = bos_;
  if (!eos_.empty()) ctx["eos_token"] = eos_;
  for (const auto& [k, v] : extra.items()) ctx[k] = v;
  std::string text = template_.render(ctx);
  if (strip_bos_ && !bos_.empty() && text.compare(0, bos_.size(), bos_) == 0) text.erase(0, bos_.size());
  return text;
}

std::string TemplateFormat::render(const std::vector<ChatMessage>& messages) const {
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const ChatMessage& m : messages) list.push_back({{"role", role_name(m.role)}, {"content", m.content}});
  return render_json(list, true);
}

}  // namespace specmesh
