// A generation an HTTP handler reads as it comes: the runtime's tokens become text, stop
// strings end it, and the handler's thread takes the text in pieces while it watches its
// client, so no socket is ever written from a runtime thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "specmesh/chat/stop.hpp"
#include "specmesh/runtime.hpp"

namespace specmesh::serve {

class Reply {
 public:
  // Submits `request` to `runtime`; the reply ends at EOS, at max tokens, at the first of
  // `stops`, on cancel() or on an error.
  Reply(Runtime& runtime, GenerationRequest request, std::vector<std::string> stops);
  // Cancels a generation still running and waits for it to end.
  ~Reply();
  Reply(const Reply&) = delete;
  Reply& operator=(const Reply&) = delete;

  struct Update {
    std::vector<std::string> pieces;  // new text since the last update, token by token
    bool finished = false;            // the generation has ended: result() is final
    std::string text() const;         // the pieces joined
  };
  // Waits up to `timeout` for new text or the end, and returns what there is.
  Update next(std::chrono::milliseconds timeout);
  // Waits up to `timeout` until the first token has come or the generation has ended.
  bool wait_started(std::chrono::milliseconds timeout);
  // Whether a token has come.
  bool started();
  // Stops the generation (the runs stop in the pipeline); the text so far stays.
  void cancel();

  // After next() reported finished:
  const GenerationResult& result() const { return result_; }

 private:
  bool on_token(const std::string& piece);
  void push(std::string text);  // a piece for next(), unless empty
  void on_result(const GenerationResult& r);  // the runtime's DoneCallback

  std::unique_ptr<Generation> generation_;
  std::mutex mu_;
  std::condition_variable cv_;
  StopFilter stop_;
  std::vector<std::string> pending_;  // text not yet taken by next(), a piece per token
  size_t streamed_bytes_ = 0;    // bytes of the pieces so far, before stop filtering
  bool started_ = false, finished_ = false, stopped_ = false;
  GenerationResult result_;
};

}  // namespace specmesh::serve
