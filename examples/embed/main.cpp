// An edge app embedding specmesh: it loads a topology, streams a story token by token,
// prints the run's statistics, then starts a second story and cancels it after N tokens.
//
//   embed TOPOLOGY.toml [PROMPT] [N]
#include <chrono>
#include <cstdio>
#include <exception>
#include <future>
#include <stdexcept>
#include <string>

#include "specmesh/runtime.hpp"

namespace {

void print_stats(const char* what, const specmesh::GenerationResult& r) {
  std::printf("\n[%s: %d prompt tokens, %d generated, first token %.1f ms, %.1f tokens/s]\n", what,
              r.stats.prompt_tokens, r.stats.generated_tokens, r.stats.ttft_ms, r.stats.decode_tokens_per_s);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s TOPOLOGY.toml [PROMPT] [N]\n", argv[0]);
    return 2;
  }
  const std::string prompt = argc > 2 ? argv[2] : "Once upon a time";
  const int cancel_after = argc > 3 ? std::stoi(argv[3]) : 8;
  specmesh::set_log_level("warn");
  try {
    // Nodes of the topology that live in other processes are started here and stopped when
    // the runtime goes away; an app on a real cluster would leave spawn_nodes off.
    specmesh::RuntimeOptions options;
    options.spawn_nodes = true;
    options.specmesh_binary = SPECMESH_BINARY;
    auto rt = specmesh::Runtime::open(argv[1], options);

    // Tokens arrive on a runtime thread as soon as they are accepted.
    std::printf("%s", prompt.c_str());
    auto story = rt->generate({.prompt = prompt, .n_predict = 48}, [](int32_t, const std::string& piece) {
      std::printf("%s", piece.c_str());
      std::fflush(stdout);
      return true;  // false would stop here
    });
    if (!story.ok()) throw std::runtime_error(story.error);
    print_stats("story", story);

    // submit() returns at once; cancel() may come from any thread (a stop button, a deadline).
    // Here the main thread cancels once the stream has delivered N tokens.
    std::promise<void> enough;
    int seen = 0;
    std::printf("%s", prompt.c_str());
    auto gen = rt->submit({.prompt = prompt, .n_predict = 256, .ignore_eos = true}, [&](int32_t, const std::string& piece) {
      std::printf("%s", piece.c_str());
      std::fflush(stdout);
      if (++seen == cancel_after) enough.set_value();
      return true;
    });
    enough.get_future().wait_for(std::chrono::seconds(30));
    gen->cancel();
    auto cut = gen->wait();  // keeps every token accepted before the cancel took effect
    if (!cut.ok()) throw std::runtime_error(cut.error);
    print_stats("cancelled", cut);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "embed: %s\n", e.what());
    return 1;
  }
  return 0;
}
