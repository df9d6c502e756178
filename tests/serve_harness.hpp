// An in-process `specmesh serve` on a free port for tests, and a small HTTP client for it.
#pragma once

#include <httplib.h>

#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "processes.hpp"
#include "refdata.hpp"
#include "specmesh/runtime.hpp"
#include "specmesh/serve/server.hpp"

namespace specmesh::test {

// stories260K as the target, with a draft (so requests may ask for spec), in this process.
// `layer_ms` > 0 paces each layer of the target as a slower device would (an emulated device
// profile), so a reply lasts long enough to be stopped part-way.
inline Topology serve_topology(double layer_ms = 0) {
  Topology t = Topology::single_process({"target", refdata("gguf-models/stories260K.gguf"), ""},
                                        {{"draft", {"draft", refdata("gguf-models/stories260K-draft-small.gguf"), ""}}}, 1);
  t.run.strategy = "ar";
  if (layer_ms > 0) {
    DeviceProfile slow;
    slow.name = "test-slow";
    slow.layer_s = layer_ms / 1000;
    t.devices.at("target").profile = slow;
  }
  return t;
}

// A Server running on its own thread; stops and joins when destroyed.
class TestServer {
 public:
  TestServer(serve::ServeOptions options, serve::Server::Loader load) {
    options.host = "127.0.0.1";
    options.port = 0;
    if (options.model_id.empty()) options.model_id = "stories260K";
    server_ = std::make_unique<serve::Server>(options, std::move(load));
    port_ = server_->bind();
    thread_ = std::thread([this] {
      try {
        server_->run();
      } catch (const std::exception& e) {
        error_ = e.what();
      }
    });
  }
  TestServer(Topology topo, RuntimeOptions ro = {}, serve::ServeOptions options = {})
      : TestServer(options, [topo, ro] { return std::make_unique<Runtime>(topo, ro); }) {}
  ~TestServer() {
    server_->stop();
    thread_.join();
  }
  bool wait_ready(std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    return wait_until([&] { return server_->ready(); }, timeout);
  }
  int port() const { return port_; }
  serve::Server& server() { return *server_; }
  const std::string& error() const { return error_; }

 private:
  std::unique_ptr<serve::Server> server_;
  int port_ = 0;
  std::thread thread_;
  std::string error_;
};

struct HttpReply {
  int status = 0;  // 0: no answer (connection failed or cancelled)
  std::string body;
  std::string content_type;
  nlohmann::json json() const { return nlohmann::json::parse(body, nullptr, false); }
};

// One request; `on_data` (optional) sees the body as it arrives and may end the request by
// returning false (the connection is then closed, as a client that goes away closes it).
inline HttpReply http(int port, const std::string& method, const std::string& path, const std::string& body = {},
                      const httplib::Headers& headers = {},
                      const std::function<bool(const std::string& so_far)>& on_data = {}) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(std::chrono::seconds(120));
  httplib::Request req;
  req.method = method;
  req.path = path;
  req.headers = headers;
  if (!body.empty()) {
    req.body = body;
    req.set_header("Content-Type", "application/json");
  }
  HttpReply out;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    out.body.append(data, n);
    return !on_data || on_data(out.body);
  };
  auto res = cli.send(req);
  if (res) {
    out.status = res->status;
    out.content_type = res->get_header_value("Content-Type");
  }
  return out;
}

inline HttpReply post(int port, const std::string& path, const nlohmann::json& body, const httplib::Headers& headers = {}) {
  return http(port, "POST", path, body.dump(), headers);
}

// The JSON payloads of a server-sent event stream, in order; "[DONE]" becomes a string.
inline std::vector<nlohmann::json> sse_payloads(const std::string& stream) {
  std::vector<nlohmann::json> out;
  size_t pos = 0;
  while (true) {
    const size_t end = stream.find("\n\n", pos);
    if (end == std::string::npos) break;
    const std::string event = stream.substr(pos, end - pos);
    pos = end + 2;
    if (event.rfind("data: ", 0) != 0) continue;
    const std::string data = event.substr(6);
    out.push_back(data == "[DONE]" ? nlohmann::json("[DONE]") : nlohmann::json::parse(data, nullptr, false));
  }
  return out;
}

// The text a stream carried: chat deltas or completion texts, concatenated.
inline std::string sse_text(const std::vector<nlohmann::json>& events) {
  std::string text;
  for (const auto& e : events) {
    if (!e.is_object() || !e.contains("choices") || e["choices"].empty()) continue;
    const auto& c = e["choices"][0];
    if (c.contains("delta") && c["delta"].contains("content")) text += c["delta"]["content"].get<std::string>();
    if (c.contains("text")) text += c["text"].get<std::string>();
  }
  return text;
}

// The value of a Prometheus sample line "name{labels} value" (labels as written), or -1.
inline double metric_value(const std::string& exposition, const std::string& series) {
  const size_t at = exposition.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(exposition.substr(at + series.size() + 2));
}

}  // namespace specmesh::test
