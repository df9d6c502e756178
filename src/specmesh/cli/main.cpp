// specmesh: speculative LLM inference over an actor mesh.
#include <cstdio>
#include <cstdlib>
#include <exception>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "specmesh/cli/commands.hpp"

int main(int argc, char** argv) {
  // Logs go to stderr so stdout carries only generated text or JSON; SPECMESH_LOG=info|debug|...
  spdlog::set_default_logger(spdlog::stderr_color_mt("specmesh"));
  const char* level = std::getenv("SPECMESH_LOG");
  spdlog::set_level(level ? spdlog::level::from_str(level) : spdlog::level::warn);
  CLI::App app{"specmesh: speculative LLM inference on edge hardware"};
  app.require_subcommand(1);
  specmesh::register_generate(app);
  specmesh::register_tokenize(app);
  specmesh::register_inspect(app);
  specmesh::register_make_model(app);
  specmesh::register_run(app);
  specmesh::register_node(app);
  specmesh::register_strategies(app);
  specmesh::register_keygen(app);
  specmesh::register_serve(app);
  specmesh::register_dflash_data(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::Error& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "specmesh: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
