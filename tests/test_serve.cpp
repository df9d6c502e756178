// `specmesh serve` over stories260K, in this process: replies equal `specmesh generate`'s,
// streamed and whole; every error status has a request that gets it; a client that goes away
// stops its generation in the pipeline; /health, /v1/models, /metrics and the page answer.
#include <gtest/gtest.h>

#include <cstdlib>
#include <future>
#include <thread>

#include "serve_harness.hpp"
#include "specmesh/serve/heap_bytes.hpp"

namespace specmesh::test {
namespace {

using nlohmann::json;

const std::string kPrompt = "Once upon a time";

json generate_json(int n) {
  auto r = shell(std::string(SPECMESH_CLI_PATH) + " generate -m " + refdata("gguf-models/stories260K.gguf") + " -p '" +
                 kPrompt + "' -n " + std::to_string(n) + " --temp 0 --json 2>/dev/null");
  EXPECT_EQ(r.status, 0) << r.out;
  return last_json(r.out);
}

class Serve : public ::testing::Test {
 protected:
  void SetUp() override {
    if (refdata_dir().empty())
      GTEST_SKIP() << "\n\n*** REFERENCE DATA MISSING: ../shared/refdata not found; this test did NOT run ***\n";
  }
};

TEST_F(Serve, CompletionsEqualGenerateStreamedAndWhole) {
  TestServer srv(serve_topology());
  ASSERT_TRUE(srv.wait_ready()) << srv.error();
  const json want = generate_json(40);
  ASSERT_TRUE(want.contains("ids"));

  const json req = {{"model", "stories260K"}, {"prompt", kPrompt}, {"max_tokens", 40}, {"temperature", 0}};
  HttpReply whole = post(srv.port(), "/v1/completions", req);
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json j = whole.json();
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"], want["text"]);
  EXPECT_EQ(j["specmesh"]["ids"], want["ids"]);
  EXPECT_EQ(j["usage"]["prompt_tokens"], want["prompt_ids"].size());
  EXPECT_EQ(j["usage"]["completion_tokens"], want["ids"].size());
  EXPECT_EQ(j["usage"]["total_tokens"], want["prompt_ids"].size() + want["ids"].size());
  EXPECT_EQ(j["choices"][0]["finish_reason"], want["ids"].size() == 40u ? "length" : "stop");
  EXPECT_EQ(j["specmesh"]["strategy"], "ar");

  json sreq = req;
  sreq["stream"] = true;
  sreq["stream_options"] = {{"include_usage", true}};
  HttpReply streamed = post(srv.port(), "/v1/completions", sreq);
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  EXPECT_EQ(streamed.content_type.rfind("text/event-stream", 0), 0u) << streamed.content_type;
  auto events = sse_payloads(streamed.body);
  ASSERT_GE(events.size(), 4u) << streamed.body;
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_EQ(sse_text(events), want["text"].get<std::string>());
  // The last choice chunk carries the finish, the usage and the reply's statistics; then the
  // usage chunk that include_usage asks for.
  const json& last = events[events.size() - 3];
  EXPECT_EQ(last["choices"][0]["finish_reason"], j["choices"][0]["finish_reason"]);
  EXPECT_EQ(last["usage"], j["usage"]);
  EXPECT_GT(last["specmesh"]["tokens_per_second"].get<double>(), 0);
  EXPECT_EQ(last["specmesh"]["strategy"], "ar");
  EXPECT_TRUE(events[events.size() - 2]["choices"].empty());
  EXPECT_EQ(events[events.size() - 2]["usage"], j["usage"]);
}

TEST_F(Serve, PerRequestStrategyIsLosslessAndReported) {
  TestServer srv(serve_topology());
  ASSERT_TRUE(srv.wait_ready()) << srv.error();
  const json base = {{"prompt", kPrompt}, {"max_tokens", 48}, {"temperature", 0}};
  HttpReply ar = post(srv.port(), "/v1/completions", base);
  ASSERT_EQ(ar.status, 200) << ar.body;
  json spec_req = base;
  spec_req["specmesh"] = {{"strategy", "spec"}, {"params", {{"n_draft", 3}}}};
  HttpReply spec = post(srv.port(), "/v1/completions", spec_req);
  ASSERT_EQ(spec.status, 200) << spec.body;
  EXPECT_EQ(spec.json()["specmesh"]["ids"], ar.json()["specmesh"]["ids"]);
  EXPECT_EQ(spec.json()["specmesh"]["strategy"], "spec");
  EXPECT_GT(spec.json()["specmesh"]["drafted"].get<int>(), 0);
  EXPECT_TRUE(spec.json()["specmesh"]["acceptance"].is_number());
  EXPECT_TRUE(ar.json()["specmesh"]["acceptance"].is_null());
}

TEST_F(Serve, ChatCompletionsStreamWithRoleThenDeltas) {
  TestServer srv(serve_topology());
  ASSERT_TRUE(srv.wait_ready()) << srv.error();
  const json req = {{"messages", {{{"role", "system"}, {"content", "Tell stories."}}, {{"role", "user"}, {"content", kPrompt}}}},
                    {"max_tokens", 24},
                    {"temperature", 0},
                    {"stream", true}};
  HttpReply r = post(srv.port(), "/v1/chat/completions", req);
  ASSERT_EQ(r.status, 200) << r.body;
  auto events = sse_payloads(r.body);
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.front()["object"], "chat.completion.chunk");
  EXPECT_EQ(events.front()["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(events.back(), "[DONE]");
  const std::string text = sse_text(events);
  EXPECT_FALSE(text.empty());

  json whole = req;
  whole["stream"] = false;
  HttpReply w = post(srv.port(), "/v1/chat/completions", whole);
  ASSERT_EQ(w.status, 200) << w.body;
  EXPECT_EQ(w.json()["object"], "chat.completion");
  EXPECT_EQ(w.json()["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(w.json()["choices"][0]["message"]["content"], text);
}

TEST_F(Serve, StopStringEndsTheReplyBeforeIt) {
  TestServer srv(serve_topology());
  ASSERT_TRUE(srv.wait_ready()) << srv.error();
  HttpReply full = post(srv.port(), "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 64}, {"temperature", 0}});
  ASSERT_EQ(full.status, 200);
  const std::string text = full.json()["choices"][0]["text"];
  const size_t cut = text.find(' ', 12);  // a word boundary inside the reply
  ASSERT_NE(cut, std::string::npos) << text;
  const std::string stop = text.substr(cut, 4);
  for (bool stream : {false, true}) {
    HttpReply r = post(srv.port(), "/v1/completions",
                       {{"prompt", kPrompt}, {"max_tokens", 64}, {"temperature", 0}, {"stop", {stop}}, {"stream", stream}});
    ASSERT_EQ(r.status, 200) << r.body;
    const std::string got = stream ? sse_text(sse_payloads(r.body)) : r.json()["choices"][0]["text"].get<std::string>();
    EXPECT_EQ(got, text.substr(0, text.find(stop))) << "stream " << stream;
  }
}

TEST_F(Serve, BadFieldsAre400NamingTheField) {
  TestServer srv(serve_topology());
  ASSERT_TRUE(srv.wait_ready()) << srv.error();
  const json ok = {{"prompt", kPrompt}, {"max_tokens", 4}};
  auto with = [&](const std::string& key, const json& value) {
    json j = ok;
    j[key] = value;
    return j;
  };
  struct Case {
    json body;
    std::string param;
  };
  const std::vector<Case> cases = {
      {with("temperature", 3), "temperature"},
      {with("temperature", "hot"), "temperature"},
      {with("top_p", -0.5), "top_p"},
      {with("top_k", 1.5), "top_k"},
      {with("min_p", 2), "min_p"},
      {with("seed", "x"), "seed"},
      {with("max_tokens", 0), "max_tokens"},
      {with("stop", json::array({1})), "stop"},
      {with("stop", json::array({"a", "b", "c", "d", "e"})), "stop"},
      {with("n", 2), "n"},
      {with("logprobs", true), "logprobs"},
      {with("stream", "yes"), "stream"},
      {with("specmesh", {{"strategy", "warp"}}), "specmesh.strategy"},
      {with("specmesh", {{"color", 1}}), "specmesh.color"},
      {with("specmesh", {{"params", {{"n_draft", "many"}}}}), "specmesh.params.n_draft"},
      {{{"max_tokens", 4}}, "prompt"},
  };
  for (const Case& c : cases) {
    HttpReply r = post(srv.port(), "/v1/completions", c.body);
    EXPECT_EQ(r.status, 400) << c.body.dump() << " -> " << r.body;
    EXPECT_EQ(r.json()["error"]["param"], c.param) << r.body;
    EXPECT_EQ(r.json()["error"]["type"], "invalid_request_error") << r.body;
  }
  // A parameter the strategy does not have reaches the runtime, which refuses it: 400 as well.
  HttpReply p = post(srv.port(), "/v1/completions", with("specmesh", {{"strategy", "spec"}, {"params", {{"n_draft", 1000}}}}));
  EXPECT_EQ(p.status, 400) << p.body;
  EXPECT_NE(p.json()["error"]["message"].get<std::string>().find("n_draft"), std::string::npos) << p.body;
  // Malformed JSON, and chat messages without a valid role.
  EXPECT_EQ(http(srv.port(), "POST", "/v1/completions", "{not json").status, 400);
  HttpReply m = post(srv.port(), "/v1/chat/completions", {{"messages", {{{"role", "robot"}, {"content", "hi"}}}}});
  EXPECT_EQ(m.status, 400) << m.body;
  EXPECT_EQ(m.json()["error"]["param"], "messages[0].role");
  EXPECT_EQ(post(srv.port(), "/v1/chat/completions", {{"messages", json::array()}}).status, 400);
}

TEST_F(Serve, UnknownRouteAndModelAre404) {
  TestServer srv(serve_topology());
  ASSERT_TRUE(srv.wait_ready()) << srv.error();
  HttpReply route = http(srv.port(), "GET", "/v1/engines");
  EXPECT_EQ(route.status, 404);
  EXPECT_EQ(route.json()["error"]["code"], "not_found") << route.body;
  HttpReply model = post(srv.port(), "/v1/completions", {{"model", "gpt-4"}, {"prompt", kPrompt}});
  EXPECT_EQ(model.status, 404);
  EXPECT_EQ(model.json()["error"]["code"], "model_not_found") << model.body;
}

TEST_F(Serve, PromptLongerThanTheContextIs413) {
  TestServer srv(serve_topology());
  ASSERT_TRUE(srv.wait_ready()) << srv.error();
  const int n_ctx = http(srv.port(), "GET", "/v1/models").json()["data"][0]["specmesh"]["context_size"];
  std::string longer;
  for (int i = 0; i < n_ctx / 2; ++i) longer += "Once upon a time ";
  for (bool stream : {false, true}) {
    HttpReply r = post(srv.port(), "/v1/completions", {{"prompt", longer}, {"stream", stream}});
    EXPECT_EQ(r.status, 413) << r.body;
    EXPECT_EQ(r.json()["error"]["code"], "context_length_exceeded");
  }
  // A prompt that fits with a max_tokens that would not: the reply stops where the context is full.
  std::string fits;
  for (int i = 0; i < 100; ++i) fits += "Once upon a time ";
  HttpReply r = post(srv.port(), "/v1/completions", {{"prompt", fits}, {"max_tokens", 5000}, {"temperature", 0},
                                                     {"specmesh", {{"ignore_eos", true}}}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json()["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(r.json()["usage"]["total_tokens"].get<int>(), n_ctx);
}

TEST_F(Serve, ApiKeyGuardsTheApiWith401) {
  serve::ServeOptions o;
  o.api_key = "sesame";
  TestServer srv(serve_topology(), {}, o);
  ASSERT_TRUE(srv.wait_ready()) << srv.error();
  const json req = {{"prompt", kPrompt}, {"max_tokens", 4}};
  HttpReply none = post(srv.port(), "/v1/completions", req);
  EXPECT_EQ(none.status, 401);
  EXPECT_EQ(none.json()["error"]["code"], "invalid_api_key");
  EXPECT_EQ(post(srv.port(), "/v1/completions", req, {{"Authorization", "Bearer wrong"}}).status, 401);
  EXPECT_EQ(http(srv.port(), "GET", "/v1/models").status, 401);
  EXPECT_EQ(http(srv.port(), "GET", "/metrics").status, 401);
  EXPECT_EQ(post(srv.port(), "/v1/completions", req, {{"Authorization", "Bearer sesame"}}).status, 200);
  // The page and the health check stay open.
  EXPECT_EQ(http(srv.port(), "GET", "/health").status, 200);
  EXPECT_EQ(http(srv.port(), "GET", "/").status, 200);
}

TEST_F(Serve, LoadingIs503UntilTheRuntimeIsReady) {
  std::promise<void> go;
  std::shared_future<void> released = go.get_future().share();
  TestServer srv(serve::ServeOptions{}, [released] {
    released.wait();
    return std::make_unique<Runtime>(serve_topology());
  });
  HttpReply health = http(srv.port(), "GET", "/health");
  EXPECT_EQ(health.status, 503);
  EXPECT_EQ(health.json()["status"], "loading");
  HttpReply early = post(srv.port(), "/v1/completions", {{"prompt", kPrompt}});
  EXPECT_EQ(early.status, 503);
  EXPECT_EQ(early.json()["error"]["code"], "model_loading");
  go.set_value();
  ASSERT_TRUE(srv.wait_ready()) << srv.error();
  EXPECT_EQ(http(srv.port(), "GET", "/health").json()["status"], "ready");
}

TEST_F(Serve, QueueFullIs429) {
  // One session and no queue: while a long reply streams, the next request is refused.
  RuntimeOptions ro;
  ro.max_sessions = 1;
  ro.max_queued = 0;
  TestServer srv(serve_topology(4), ro);
  ASSERT_TRUE(srv.wait_ready()) << srv.error();
  std::promise<void> streaming;
  bool told = false;
  std::thread first([&] {
    http(srv.port(), "POST", "/v1/completions",
         json{{"prompt", kPrompt}, {"max_tokens", 200}, {"stream", true}, {"specmesh", {{"ignore_eos", true}}}}.dump(), {},
         [&](const std::string& so_far) {
           if (!told && so_far.find("data: ") != std::string::npos) {
             told = true;
             streaming.set_value();
           }
           return true;
         });
  });
  ASSERT_EQ(streaming.get_future().wait_for(std::chrono::seconds(30)), std::future_status::ready);
  for (bool stream : {false, true}) {
    HttpReply busy = post(srv.port(), "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 4}, {"stream", stream}});
    EXPECT_EQ(busy.status, 429) << busy.body;
    EXPECT_EQ(busy.json()["error"]["type"], "rate_limit_error") << busy.body;
  }
  srv.server().stop();  // cancels the long reply
  first.join();
}

TEST_F(Serve, StageDownIs503AndHealthSaysDegraded) {
  // The two-stage ipc example with its stages as child processes; one of them frozen.
  const std::string config = std::string(SPECMESH_SOURCE_DIR) + "/examples/pipeline-2stage-ipc.toml";
  RuntimeOptions ro = node_options(true);
  ro.port_base = 0;  // endpoints of its own, beside any other run of the file
  serve::ServeOptions so;
  so.model_id = "stories";
  TestServer srv(so, [config, ro] { return Runtime::open(config, ro); });
  ASSERT_TRUE(srv.wait_ready()) << srv.error();
  // (On a loaded machine a heartbeat may come late and a first request fail; it comes back.)
  ASSERT_TRUE(wait_until(
      [&] { return post(srv.port(), "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 8}}).status == 200; },
      std::chrono::seconds(10)));
  const auto stage1 = processes_where([&](const ProcessInfo& p) {
    return p.ppid == ::getpid() && p.cmdline.find("--name stage1") != std::string::npos;
  });
  ASSERT_EQ(stage1.size(), 1u);
  ::kill(stage1[0].pid, SIGSTOP);
  HttpReply health;
  EXPECT_TRUE(wait_until([&] { return (health = http(srv.port(), "GET", "/health")).status == 503; }, std::chrono::seconds(5)));
  EXPECT_EQ(health.json()["status"], "degraded") << health.body;
  EXPECT_EQ(health.json()["nodes_down"], json::array({"stage1"})) << health.body;
  for (bool stream : {false, true}) {
    HttpReply r = post(srv.port(), "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 8}, {"stream", stream}});
    EXPECT_EQ(r.status, 503) << r.body;
    EXPECT_EQ(r.json()["error"]["code"], "unavailable") << r.body;
  }
  ::kill(stage1[0].pid, SIGCONT);
  // Back: ready again, and requests go through.
  EXPECT_TRUE(wait_until([&] { return http(srv.port(), "GET", "/health").status == 200; }, std::chrono::seconds(10)));
  EXPECT_TRUE(wait_until(
      [&] { return post(srv.port(), "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 8}}).status == 200; },
      std::chrono::seconds(10)));
}

TEST_F(Serve, ClientThatGoesAwayStopsItsGeneration) {
  // 4 ms per layer: a reply of 400 tokens would take 8 s.
  TestServer srv(serve_topology(4));
  ASSERT_TRUE(srv.wait_ready()) << srv.error();
  for (bool stream : {true, false}) {
    const auto t0 = std::chrono::steady_clock::now();
    const json req = {{"prompt", kPrompt}, {"max_tokens", 400}, {"stream", stream}, {"specmesh", {{"ignore_eos", true}}}};
    // The streaming client leaves after its third event; the other one gives up after 300 ms.
    if (stream) {
      http(srv.port(), "POST", "/v1/completions", req.dump(), {},
           [&](const std::string& so_far) { return sse_payloads(so_far).size() < 3; });
    } else {
      httplib::Client cli("127.0.0.1", srv.port());
      cli.set_read_timeout(std::chrono::milliseconds(300));
      EXPECT_FALSE(cli.Post("/v1/completions", req.dump(), "application/json"));
    }
    // The generation ends soon after, far short of its 400 tokens, and says it was cancelled.
    std::string m;
    ASSERT_TRUE(wait_until(
        [&] {
          m = http(srv.port(), "GET", "/metrics").body;
          return metric_value(m, "specmesh_generations_total{strategy=\"ar\",outcome=\"cancelled\"}") >= (stream ? 1 : 2);
        },
        std::chrono::seconds(5)))
        << m;
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
    EXPECT_LT(metric_value(m, "specmesh_generated_tokens_total{strategy=\"ar\"}"), stream ? 200 : 400) << m;
    // Nothing runs on.
    EXPECT_TRUE(wait_until(
        [&] { return metric_value(http(srv.port(), "GET", "/metrics").body, "specmesh_generations_in_flight") == 0; },
        std::chrono::seconds(2)));
  }
}

TEST_F(Serve, ModelsHealthMetricsAndPage) {
  TestServer srv(serve_topology());
  ASSERT_TRUE(srv.wait_ready()) << srv.error();
  HttpReply models = http(srv.port(), "GET", "/v1/models");
  ASSERT_EQ(models.status, 200);
  const json m = models.json()["data"][0];
  EXPECT_EQ(m["id"], "stories260K");
  EXPECT_EQ(m["object"], "model");
  EXPECT_EQ(m["specmesh"]["strategy"], "ar");
  EXPECT_NE(std::find(m["specmesh"]["strategies"].begin(), m["specmesh"]["strategies"].end(), "spec"),
            m["specmesh"]["strategies"].end());

  HttpReply health = http(srv.port(), "GET", "/health");
  EXPECT_EQ(health.status, 200);
  EXPECT_EQ(health.json()["status"], "ready");

  ASSERT_EQ(post(srv.port(), "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 16}, {"temperature", 0}}).status, 200);
  post(srv.port(), "/v1/completions", {{"prompt", kPrompt}, {"n", 3}});
  HttpReply metrics = http(srv.port(), "GET", "/metrics");
  ASSERT_EQ(metrics.status, 200);
  EXPECT_EQ(metrics.content_type.rfind("text/plain; version=0.0.4", 0), 0u);
  const std::string& e = metrics.body;
  EXPECT_EQ(metric_value(e, "specmesh_http_requests_total{path=\"/v1/completions\",status=\"200\"}"), 1) << e;
  EXPECT_EQ(metric_value(e, "specmesh_http_errors_total{status=\"400\"}"), 1) << e;
  EXPECT_EQ(metric_value(e, "specmesh_generations_total{strategy=\"ar\",outcome=\"ok\"}"), 1) << e;
  EXPECT_GT(metric_value(e, "specmesh_generated_tokens_total{strategy=\"ar\"}"), 0) << e;
  EXPECT_GT(metric_value(e, "specmesh_decode_tokens_per_second{strategy=\"ar\"}"), 0) << e;
  EXPECT_EQ(metric_value(e, "specmesh_time_to_first_token_seconds_count{strategy=\"ar\"}"), 1) << e;
  EXPECT_EQ(metric_value(e, "specmesh_inter_token_latency_seconds_count{strategy=\"ar\"}"), 1) << e;
  EXPECT_EQ(metric_value(e, "specmesh_acceptance_ratio{strategy=\"ar\"}"), 0) << e;
  EXPECT_NE(e.find("# TYPE specmesh_time_to_first_token_seconds histogram"), std::string::npos);
  EXPECT_GT(metric_value(e, "specmesh_heap_allocated_bytes"), 0) << e;

  HttpReply page = http(srv.port(), "GET", "/");
  EXPECT_EQ(page.status, 200);
  EXPECT_EQ(page.content_type.rfind("text/html", 0), 0u);
  EXPECT_NE(page.body.find("/v1/chat/completions"), std::string::npos);
}

// What the allocator holds for the process: up by a block's size while it is allocated, down
// again once it is freed.
TEST(HeapBytes, FollowAnAllocationAndItsFree) {
  const auto before = serve::heap_allocated_bytes();
  ASSERT_TRUE(before);
  constexpr std::size_t kBlock = std::size_t{8} << 20;
  auto* block = static_cast<volatile char*>(std::malloc(kBlock));
  ASSERT_NE(block, nullptr);
  for (std::size_t i = 0; i < kBlock; i += 4096) block[i] = 1;
  const auto during = serve::heap_allocated_bytes();
  std::free(const_cast<char*>(block));
  const auto after = serve::heap_allocated_bytes();
  ASSERT_TRUE(during && after);
  EXPECT_GE(*during, *before + kBlock);
  EXPECT_LT(*after, *during - kBlock / 2);
}

}  // namespace
}  // namespace specmesh::test
