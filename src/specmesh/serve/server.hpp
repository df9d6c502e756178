// `specmesh serve`: an OpenAI-compatible HTTP server over a Runtime (cpp-httplib, Debian's).
//
//   POST /v1/chat/completions   messages rendered by the model's chat format (chat/)
//   POST /v1/completions        a plain prompt
//   GET  /v1/models             the served model, its strategies
//   GET  /health                loading / ready / degraded
//   GET  /metrics               Prometheus text
//   GET  /                      the chat page
//
// Both completion routes stream (server-sent events ending in `data: [DONE]`) or answer once;
// errors are OpenAI-shaped JSON with the HTTP status that fits. A client that goes away cancels
// its generation. The server listens first and loads the runtime behind, so /health says
// "loading" meanwhile.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "specmesh/runtime.hpp"
#include "specmesh/serve/api_request.hpp"

namespace specmesh::serve {

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                 // 0: any free port (port() tells which)
  std::string api_key;             // non-empty: /v1/* and /metrics need "Authorization: Bearer KEY"
  std::string model_id;            // the name /v1/models lists and requests may give
  std::string chat_mode = "auto";  // make_chat_format's mode
  std::string chat_template;       // --chat-template's text; empty: the model's
  std::string chat_template_name;  // where it came from, for error messages
  RequestDefaults defaults;
  // A reply that fills its session's context shifts it (GenerationRequest::context_shift) and
  // goes on; otherwise it ends there with finish_reason "length".
  bool context_shift = false;
  // Connections served at once (a streaming reply holds one). Give it more than the runtime's
  // sessions and queue (RuntimeOptions::max_sessions + max_queued), so a request past the
  // queue's bound is answered 429 rather than left waiting for a thread.
  int http_threads = 32;
};

class Server {
 public:
  // Builds the runtime the server answers with; runs on a thread of its own after the
  // address is bound.
  using Loader = std::function<std::unique_ptr<Runtime>()>;

  Server(ServeOptions options, Loader load);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds the address (throws std::runtime_error naming it when that fails) and returns the port.
  int bind();
  // Loads the runtime and serves until stop(); rethrows the loader's error (after stopping).
  // Binds first when bind() was not called.
  void run();
  // Ends run(): cancels the generations in progress and stops listening. Any thread.
  void stop();
  // Whether the runtime has loaded (for callers that wait for readiness).
  bool ready() const;
  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace specmesh::serve
