// Stop strings on a streamed reply: the reply ends where the model starts writing one, and
// neither the stop string nor any beginning of it ever reaches the client.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace specmesh {

// Feed it the pieces of a reply as they are generated; it passes on the text that is known
// not to belong to a stop string. Text that could be the beginning of one is held back until
// the next pieces decide it. Matching is byte-wise, so pieces may split UTF-8 characters
// anywhere; a valid UTF-8 stop string can only match at character boundaries, so whole
// characters that come in leave whole.
class StopFilter {
 public:
  // Empty strings are ignored (they would end every reply before it starts).
  explicit StopFilter(std::vector<std::string> stops);

  // The text that can be shown now; nothing once stopped().
  std::string feed(std::string_view piece);
  // At the end of the reply: the text still held back (a stop string's beginning that the
  // reply ended in). Nothing once stopped().
  std::string flush();
  // True once a stop string has been generated: the caller should stop generating.
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string pending_;  // held back: a suffix of the reply that begins some stop string
  bool stopped_ = false;
};

}  // namespace specmesh
