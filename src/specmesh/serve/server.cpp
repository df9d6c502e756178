#include "specmesh/serve/server.hpp"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <ctime>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include <spdlog/spdlog.h>

#include "specmesh/chat/framing.hpp"
#include "specmesh/chat/jinja.hpp"
#include "specmesh/serve/api_error.hpp"
#include "specmesh/serve/api_response.hpp"
#include "specmesh/serve/chat_page.hpp"
#include "specmesh/serve/connection.hpp"
#include "specmesh/serve/reply.hpp"
#include "specmesh/serve/server_metrics.hpp"
#include "specmesh/speculation/registry.hpp"
#include "specmesh/tokenizer/tokenizer.hpp"

namespace specmesh::serve {

namespace {

using nlohmann::json;
using std::chrono::milliseconds;

// How often a handler waiting for tokens looks at its client and at the server stopping.
constexpr milliseconds kPoll{50};

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(json_text(body), "application/json");
}

// Compares without stopping at the first difference, so the time taken tells nothing of the key.
bool same_key(const std::string& a, const std::string& b) {
  unsigned diff = a.size() != b.size();
  for (size_t i = 0; i < a.size(); ++i) diff |= unsigned(uint8_t(a[i]) ^ uint8_t(i < b.size() ? b[i] : 0));
  return diff == 0;
}

// The routes by name, for the metrics' labels (anything else counts as "other").
std::string route_label(const std::string& path) {
  static const std::set<std::string> known = {"/",           "/health",        "/metrics",
                                              "/v1/models",  "/v1/completions", "/v1/chat/completions"};
  return known.count(path) ? path : "other";
}

// What the handlers of every request share.
struct Shared {
  ServerMetrics metrics;
  std::atomic<bool> stopping{false};
  std::mutex mu;             // guards replies
  std::set<Reply*> replies;  // in progress: stop() cancels them
};

// A generation that a request runs: registered for stop(), counted in the metrics when it
// ends, and never left running when its request goes away.
class Job {
 public:
  Job(Shared& impl, Runtime& rt, GenerationRequest request, std::vector<std::string> stops) : impl_(impl) {
    impl_.metrics.generation_started();
    reply_ = std::make_unique<Reply>(rt, std::move(request), std::move(stops));
    std::lock_guard lk(impl_.mu);
    impl_.replies.insert(reply_.get());
  }
  ~Job() {
    reply_->cancel();  // nothing when it has ended
    while (!finished_) take(reply_->next(kPoll));
    {
      std::lock_guard lk(impl_.mu);
      impl_.replies.erase(reply_.get());
    }
    const GenerationResult& r = reply_->result();
    impl_.metrics.count_generation(r, client_gone_ || r.finish_reason == FinishReason::cancelled ? "cancelled"
                                      : r.ok()                                                    ? "ok"
                                                                                                  : to_string(r.error_kind));
    impl_.metrics.generation_ended();
  }
  // Waits for news; cancels when the client has gone or the server stops.
  Reply::Update next(const ConnectionWatch& client) {
    Reply::Update u = take(reply_->next(kPoll));
    if (!u.finished && !client_gone_ && (impl_.stopping || client.closed())) {
      client_gone_ = true;
      reply_->cancel();
    }
    return u;
  }
  // Waits for the first token or the end, watching the client meanwhile; true when a token came.
  bool wait_started(const ConnectionWatch& client) {
    while (!reply_->wait_started(kPoll))
      if (!client_gone_ && (impl_.stopping || client.closed())) {
        client_gone_ = true;
        reply_->cancel();
      }
    return reply_->started();
  }
  bool finished() const { return finished_; }
  bool client_gone() const { return client_gone_; }
  const Reply& reply() const { return *reply_; }

 private:
  Reply::Update take(Reply::Update u) {
    finished_ = finished_ || u.finished;
    return u;
  }
  Shared& impl_;
  std::unique_ptr<Reply> reply_;
  bool finished_ = false, client_gone_ = false;
};

}  // namespace

struct Server::Impl {
  ServeOptions opts;
  Loader load;
  httplib::Server http;
  Shared shared;
  int port = -1;
  const int64_t created = int64_t(std::time(nullptr));

  std::thread loader;
  std::atomic<bool> loaded{false};
  std::atomic<bool> run_called{false}, listen_returned{false};
  std::string load_error;                   // set when loading failed
  std::unique_ptr<Runtime> runtime;         // set once, before `loaded`
  std::unique_ptr<ChatFormat> format;
  std::string default_strategy;
  std::vector<std::string> strategies;      // those a request may ask for

  std::mutex mu;                            // guards what follows
  std::mt19937_64 rng{std::random_device{}()};
  uint64_t next_id = 0;

  void load_runtime();
  void halt();
  void routes();
  Runtime& ready_runtime();
  void complete(const httplib::Request& req, httplib::Response& res, bool chat);
  json models() const;
  std::pair<int, json> health() const;
};

void Server::Impl::load_runtime() {
  try {
    std::unique_ptr<Runtime> rt = load();
    const std::string name = opts.chat_template_name.empty() ? "the model's chat template" : opts.chat_template_name;
    try {
      format = make_chat_format(opts.chat_mode, rt->tokenizer(), opts.chat_template);
    } catch (const jinja::Error& e) {
      throw std::runtime_error(name + ": " + e.what());
    }
    default_strategy = rt->topology().run.strategy;
    const auto roles = rt->topology().role_models();
    for (const StrategyInfo& s : specmesh::strategies()) {
      bool runnable = s.pair_role.empty() || s.name == default_strategy;  // a pair is built at load
      for (const std::string& role : s.needed_roles(s.resolve({}))) runnable = runnable && roles.count(role);
      if (runnable) strategies.push_back(s.name);
    }
    runtime = std::move(rt);
    loaded = true;
    spdlog::info("serve: {} ready ({} chat format, strategy {}, {} sessions of {} tokens)", opts.model_id, format->name(),
                 default_strategy, runtime->options().max_sessions, runtime->session_context());
  } catch (const std::exception& e) {
    load_error = e.what();
    spdlog::error("serve: loading failed: {}", load_error);
    halt();
  }
}

Runtime& Server::Impl::ready_runtime() {
  if (!loaded) throw ApiError(503, "server_error", "model_loading", "the model is loading; try again shortly");
  return *runtime;
}

std::pair<int, json> Server::Impl::health() const {
  if (!loaded) return {503, {{"status", "loading"}}};
  const RuntimeStatus s = runtime->status();
  json body = {{"status", to_string(s.health)},
               {"sessions_running", s.sessions_running},
               {"sessions_queued", s.sessions_queued}};
  if (!s.nodes_down.empty()) body["nodes_down"] = s.nodes_down;
  return {s.health == Health::ready ? 200 : 503, body};
}

json Server::Impl::models() const {
  json model = {{"id", opts.model_id}, {"object", "model"}, {"created", created}, {"owned_by", "specmesh"}};
  if (loaded)
    model["specmesh"] = {{"strategy", default_strategy},
                         {"strategies", strategies},
                         {"context_size", runtime->session_context()},
                         {"parallel", runtime->options().max_sessions},
                         {"chat_format", std::string(format->name())}};
  return {{"object", "list"}, {"data", json::array({model})}};
}

void Server::Impl::complete(const httplib::Request& req, httplib::Response& res, bool chat) {
  Runtime& rt = ready_runtime();
  const json body = parse_body(req.body);
  uint64_t seed, serial;
  {
    std::lock_guard lk(mu);
    seed = rng();
    serial = next_id++;
  }
  const CompletionOptions o = parse_options(body, opts.defaults, seed);
  if (!o.model.empty() && o.model != opts.model_id)
    throw ApiError(404, "invalid_request_error", "model_not_found",
                   "the model '" + o.model + "' is not served here; this server has '" + opts.model_id + "'", "model");

  GenerationRequest g;
  std::vector<std::string> stops = o.stop;
  if (chat) {
    const std::vector<ChatMessage> messages = parse_messages(body);
    try {
      g.prompt = format->render(messages);
    } catch (const jinja::Raised& e) {  // the template's own complaint about the messages
      throw bad_field("messages", std::string("the chat template refused the messages: ") + e.what());
    }
    g.parse_special = format->parse_special();
    for (const std::string& s : format->stop_strings()) stops.push_back(s);
  } else {
    g.prompt = parse_prompt(body);
  }
  g.strategy = o.strategy;
  g.params = o.params;

  // The runtime refuses a prompt that does not fit too; counted here, the error can say by
  // how much. A reply stops where the session's context is full ("length"), unless the
  // context shifts.
  const int n_prompt = int(rt.tokenizer().encode_prompt(g.prompt, g.parse_special).size());
  int n_ctx = 0;
  try {
    n_ctx = rt.session_context(g);  // less what the request's strategy may hold beyond its tokens
  } catch (const std::invalid_argument& e) {
    throw ApiError(400, "invalid_request_error", "invalid_value", e.what(), "specmesh");
  }
  if (n_prompt >= n_ctx)
    throw ApiError(413, "invalid_request_error", "context_length_exceeded",
                   "the prompt is " + std::to_string(n_prompt) + " tokens long; a session's context holds " +
                       std::to_string(n_ctx) + " for prompt and reply together",
                   chat ? "messages" : "prompt");
  if (opts.context_shift) {
    g.context_shift = true;
    g.n_predict = o.max_tokens;
  } else {
    g.n_predict = o.max_tokens < 0 ? n_ctx - n_prompt : std::min(o.max_tokens, n_ctx - n_prompt);
  }
  g.sampling = o.sampling;
  g.ignore_eos = o.ignore_eos;

  const ReplyHeader header{std::string(chat ? "chatcmpl-" : "cmpl-") + std::to_string(created) + "-" + std::to_string(serial),
                           opts.model_id, int64_t(std::time(nullptr)), chat};
  auto job = std::make_shared<Job>(shared, rt, std::move(g), std::move(stops));
  ConnectionWatch client(req.local_addr, req.local_port, req.remote_addr, req.remote_port);

  if (!o.stream) {
    std::string text;
    while (!job->finished()) text += job->next(client).text();
    const GenerationResult& r = job->reply().result();
    if (!r.ok()) throw generation_error(r);
    send_json(res, 200, response_json(header, text, finish_reason(r), r));
    return;
  }

  // Streaming: the status is decided by the first token. A generation refused or failed before
  // it gets an error status; later errors arrive as an error event in the stream.
  if (!job->wait_started(client)) {  // ended (or its client left) before any token
    while (!job->finished()) job->next(client);
    const GenerationResult& r = job->reply().result();
    if (!r.ok() && r.ids.empty()) throw generation_error(r);
  }
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  struct Stream {
    std::shared_ptr<Job> job;
    ConnectionWatch client;
    bool first = true;
  };
  auto stream = std::make_shared<Stream>(Stream{job, client});
  res.set_chunked_content_provider(
      "text/event-stream",
      [stream, header, include_usage = o.include_usage](size_t, httplib::DataSink& sink) {
        Job& job = *stream->job;
        Reply::Update u = job.next(stream->client);
        if (job.client_gone()) return false;
        auto write = [&](const std::string& event) { return sink.write(event.data(), event.size()); };
        if (header.chat && stream->first && u.pieces.empty()) u.pieces.emplace_back();  // the role comes first
        for (const std::string& piece : u.pieces) {
          if (!write(sse_event(chunk_json(header, piece, stream->first)))) return false;
          stream->first = false;
        }
        if (!u.finished) return true;
        const GenerationResult& r = job.reply().result();
        if (r.ok()) {
          const std::string finish = finish_reason(r);
          if (!write(sse_event(chunk_json(header, "", false, finish, &r)))) return false;
          if (include_usage && !write(sse_event(usage_chunk_json(header, r)))) return false;
        } else if (!write(sse_event(generation_error(r).body()))) {
          return false;
        }
        if (!write(kSseDone)) return false;
        sink.done();
        return true;
      });
}

void Server::Impl::routes() {
  // Every handler answers ApiError (and anything unexpected) as OpenAI-shaped JSON.
  auto guarded = [this](auto handler) {
    return [this, handler](const httplib::Request& req, httplib::Response& res) {
      try {
        handler(req, res);
      } catch (const ApiError& e) {
        send_json(res, e.status, e.body());
      } catch (const std::exception& e) {
        spdlog::error("serve: {} {}: {}", req.method, req.path, e.what());
        send_json(res, 500, ApiError(500, "server_error", "internal_error", e.what()).body());
      }
    };
  };
  http.Post("/v1/chat/completions", guarded([this](const auto& req, auto& res) { complete(req, res, true); }));
  http.Post("/v1/completions", guarded([this](const auto& req, auto& res) { complete(req, res, false); }));
  http.Get("/v1/models", guarded([this](const auto&, auto& res) { send_json(res, 200, models()); }));
  http.Get("/health", guarded([this](const auto&, auto& res) {
    auto [status, body] = health();
    send_json(res, status, body);
  }));
  http.Get("/metrics", guarded([this](const auto&, auto& res) {
    res.set_content(shared.metrics.exposition(), "text/plain; version=0.0.4; charset=utf-8");
  }));
  http.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(std::string(chat_page()), "text/html; charset=utf-8");
  });

  // The key guards the API and the metrics; the page and /health stay open (the page asks for
  // the key and sends it itself).
  http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (opts.api_key.empty() || req.path == "/" || req.path == "/health") return httplib::Server::HandlerResponse::Unhandled;
    const std::string auth = req.get_header_value("Authorization");
    if (auth.rfind("Bearer ", 0) == 0 && same_key(auth.substr(7), opts.api_key))
      return httplib::Server::HandlerResponse::Unhandled;
    send_json(res, 401,
              ApiError(401, "invalid_request_error", "invalid_api_key",
                       auth.empty() ? "an API key is required: send \"Authorization: Bearer KEY\"" : "the API key is not valid")
                  .body());
    return httplib::Server::HandlerResponse::Handled;
  });
  // Statuses without a body of ours: no route (404) or a method the route does not take.
  http.set_error_handler(httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    const std::string what = res.status == 404 ? "no route " + req.method + " " + req.path
                                               : "the request failed with HTTP status " + std::to_string(res.status);
    send_json(res, res.status,
              ApiError(res.status, "invalid_request_error", res.status == 404 ? "not_found" : "bad_request", what).body());
    return httplib::Server::HandlerResponse::Handled;
  }));
  // Counted before the response is written (the logger runs after it: a client that read the
  // answer could look at /metrics before it was counted).
  http.set_post_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    shared.metrics.count_request(route_label(req.path), res.status);
  });
  http.set_logger([](const httplib::Request& req, const httplib::Response& res) {
    spdlog::info("serve: {} {} {}", req.method, req.path, res.status);
  });
  http.set_payload_max_length(16u << 20);
  const size_t threads = size_t(std::max(4, opts.http_threads));
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
}

Server::Server(ServeOptions options, Loader load) : impl_(std::make_unique<Impl>()) {
  // A client that disconnects must fail the write, not end the process.
  std::signal(SIGPIPE, SIG_IGN);
  impl_->opts = std::move(options);
  impl_->load = std::move(load);
  impl_->routes();
}

Server::~Server() {
  stop();
  if (impl_->loader.joinable()) impl_->loader.join();
}

int Server::bind() {
  Impl& m = *impl_;
  if (m.port >= 0) return m.port;
  if (m.opts.port == 0) {
    m.port = m.http.bind_to_any_port(m.opts.host);
  } else if (m.http.bind_to_port(m.opts.host, m.opts.port)) {
    m.port = m.opts.port;
  }
  if (m.port <= 0)
    throw std::runtime_error("cannot listen on " + m.opts.host + ":" + std::to_string(m.opts.port) +
                             " (in use, or not an address of this machine)");
  return m.port;
}

void Server::run() {
  Impl& m = *impl_;
  bind();
  m.run_called = true;
  m.loader = std::thread([&m] { m.load_runtime(); });
  if (!m.shared.stopping) m.http.listen_after_bind();
  m.listen_returned = true;
  m.loader.join();
  m.runtime.reset();
  if (!m.load_error.empty()) throw std::runtime_error(m.load_error);
}

void Server::Impl::halt() {
  shared.stopping = true;
  {
    std::lock_guard lk(shared.mu);
    for (Reply* r : shared.replies) r->cancel();
  }
  // httplib's stop() does nothing before listening has begun: wait for that, or for run() to
  // have seen `stopping` and skipped it.
  while (run_called && !listen_returned) {
    if (http.is_running()) {
      http.stop();
      return;
    }
    std::this_thread::sleep_for(milliseconds(5));
  }
}

void Server::stop() { impl_->halt(); }

bool Server::ready() const { return impl_->loaded; }
int Server::port() const { return impl_->port; }

}  // namespace specmesh::serve
