#include "specmesh/serve/reply.hpp"

namespace specmesh::serve {

Reply::Reply(Runtime& runtime, GenerationRequest request, std::vector<std::string> stops) : stop_(std::move(stops)) {
  generation_ = runtime.submit(
      std::move(request), [this](int32_t, const std::string& piece) { return on_token(piece); },
      [this](const GenerationResult& r) { on_result(r); });
}

Reply::~Reply() {
  cancel();
  // The runtime calls on_result once more at most: wait for it (it ends the moment it unlocks).
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return finished_; });
}

bool Reply::on_token(const std::string& piece) {
  std::lock_guard lk(mu_);
  started_ = true;
  streamed_bytes_ += piece.size();
  push(stop_.feed(piece));
  stopped_ = stop_.stopped();
  cv_.notify_all();
  return !stopped_;
}

void Reply::on_result(const GenerationResult& r) {
  std::lock_guard lk(mu_);
  // Bytes of an unfinished UTF-8 character held back at the end reach only the result's text.
  if (!stopped_ && r.text.size() > streamed_bytes_) push(stop_.feed(std::string_view(r.text).substr(streamed_bytes_)));
  stopped_ = stop_.stopped();
  push(stop_.flush());
  result_ = r;
  finished_ = true;
  cv_.notify_all();  // under the lock: once it is released, nothing of this Reply is touched
}

void Reply::push(std::string text) {
  if (!text.empty()) pending_.push_back(std::move(text));
}

Reply::Update Reply::next(std::chrono::milliseconds timeout) {
  std::unique_lock lk(mu_);
  cv_.wait_for(lk, timeout, [&] { return finished_ || !pending_.empty(); });
  Update u;
  u.pieces.swap(pending_);
  u.finished = finished_;
  return u;
}

std::string Reply::Update::text() const {
  std::string all;
  for (const std::string& p : pieces) all += p;
  return all;
}

bool Reply::wait_started(std::chrono::milliseconds timeout) {
  std::unique_lock lk(mu_);
  return cv_.wait_for(lk, timeout, [&] { return started_ || finished_; });
}

bool Reply::started() {
  std::lock_guard lk(mu_);
  return started_;
}

void Reply::cancel() { generation_->cancel(); }

}  // namespace specmesh::serve
