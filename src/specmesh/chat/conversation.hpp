// A conversation: the messages exchanged so far, and trimming them to fit a context.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace specmesh {

class Tokenizer;
class ChatFormat;

enum class ChatRole { System, User, Assistant };

// The role names of OpenAI's chat API and of GGUF chat templates: "system", "user",
// "assistant".
std::string_view role_name(ChatRole role);
std::optional<ChatRole> parse_role(std::string_view name);

struct ChatMessage {
  ChatRole role;
  std::string content;
  bool operator==(const ChatMessage&) const = default;
};

class Conversation {
 public:
  Conversation() = default;
  explicit Conversation(std::vector<ChatMessage> messages) : messages_(std::move(messages)) {}

  void add(ChatRole role, std::string content) { messages_.push_back({role, std::move(content)}); }
  const std::vector<ChatMessage>& messages() const { return messages_; }
  // Forgets every message, system messages too.
  void reset() { messages_.clear(); }

  // Makes the prompt `format` renders fit in `budget` tokens (as the tokenizer encodes it,
  // with BOS) and returns it. The oldest messages go first, system messages stay (they say
  // how to answer) and the newest message stays; when that is still too long, only its end
  // is kept. Throws std::length_error when even the system messages and the framing alone
  // take more than `budget`.
  std::string fit(const ChatFormat& format, const Tokenizer& tok, int budget);

 private:
  std::vector<ChatMessage> messages_;
};

}  // namespace specmesh
