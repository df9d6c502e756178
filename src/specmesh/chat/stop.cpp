// Stop strings on a streamed reply, held back while undecided.
#include "specmesh/chat/stop.hpp"

#include <algorithm>
#include <utility>

namespace specmesh {

StopFilter::StopFilter(std::vector<std::string> stops) : stops_(std::move(stops)) {
  std::erase_if(stops_, [](const std::string& s) { return s.empty(); });
}

std::string StopFilter::feed(std::string_view piece) {
  if (stopped_) return {};
  pending_ += piece;

  // A whole stop string: the reply ends where the earliest one begins.
  size_t cut = std::string::npos;
  for (const std::string& s : stops_) cut = std::min(cut, pending_.find(s));
  if (cut != std::string::npos) {
    stopped_ = true;
    pending_.resize(cut);
    return std::exchange(pending_, {});
  }

  // Hold back the longest suffix that is a proper prefix of some stop string; everything
  // before it can no longer be part of one (no whole stop string occurs in pending_).
  size_t hold = 0;
  for (const std::string& s : stops_)
    for (size_t k = std::min(s.size() - 1, pending_.size()); k > hold; --k)
      if (pending_.compare(pending_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StopFilter::flush() { return stopped_ ? std::string() : std::exchange(pending_, {}); }

}  // namespace specmesh
