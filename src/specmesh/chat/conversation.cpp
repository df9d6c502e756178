// Conversation: role names and trimming to a token budget.
#include "specmesh/chat/conversation.hpp"

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <stdexcept>

#include "specmesh/chat/framing.hpp"
#include "specmesh/tokenizer/tokenizer.hpp"

namespace specmesh {

namespace {

constexpr std::string_view kRoleNames[] = {"system", "user", "assistant"};

// The text of ids[from..]: a cut among byte tokens can fall inside a UTF-8 character, and
// whitespace at a cut means nothing, so the kept end starts after both.
std::string tail_text(const Tokenizer& tok, const std::vector<int32_t>& ids, size_t from) {
  const std::string s = tok.decode({ids.begin() + ptrdiff_t(from), ids.end()});
  size_t i = 0;
  while (i < s.size() && ((uint8_t(s[i]) & 0xC0) == 0x80 || std::isspace(uint8_t(s[i])))) ++i;
  return s.substr(i);
}

}  // namespace

std::string_view role_name(ChatRole role) { return kRoleNames[size_t(role)]; }

std::optional<ChatRole> parse_role(std::string_view name) {
  for (size_t i = 0; i < std::size(kRoleNames); ++i)
    if (kRoleNames[i] == name) return ChatRole(i);
  return std::nullopt;
}

std::string Conversation::fit(const ChatFormat& format, const Tokenizer& tok, int budget) {
  const auto fits = [&] { return int(tok.encode_prompt(format.render(messages_), format.parse_special()).size()) <= budget; };
  const auto not_system = [](const ChatMessage& m) { return m.role != ChatRole::System; };

  while (messages_.size() > 1 && !fits()) {
    const auto newest = messages_.end() - 1;
    auto oldest = std::find_if(messages_.begin(), newest, not_system);
    if (oldest == newest) break;
    oldest = messages_.erase(oldest);
    // The replies to a dropped message go with it: the kept part then opens with a user turn,
    // as chat templates that check the order of turns require.
    while (oldest != messages_.end() - 1 && oldest->role == ChatRole::Assistant) oldest = messages_.erase(oldest);
  }
  if (fits()) return format.render(messages_);

  const auto too_long = [&] {
    return std::length_error("the system messages and the " + std::string(format.name()) +
                             " framing alone take more than the " + std::to_string(budget) +
                             " prompt tokens there is room for");
  };
  if (messages_.empty() || messages_.back().role == ChatRole::System) throw too_long();
  // Keep the newest message's end: drop the fewest leading tokens that make the prompt fit,
  // found by bisection (the prompt shrinks as more is dropped, give or take a re-tokenised
  // merge at the cut; whatever the bisection settles on is checked to fit).
  ChatMessage& newest = messages_.back();
  const std::vector<int32_t> ids = tok.encode(newest.content, false);
  const auto fits_from = [&](size_t from) {
    newest.content = tail_text(tok, ids, from);
    return fits();
  };
  size_t lo = 0, hi = ids.size();  // the whole message (lo) does not fit
  if (!fits_from(hi)) throw too_long();
  while (hi - lo > 1) {
    const size_t mid = lo + (hi - lo) / 2;
    (fits_from(mid) ? hi : lo) = mid;
  }
  newest.content = tail_text(tok, ids, hi);
  return format.render(messages_);
}

}  // namespace specmesh
