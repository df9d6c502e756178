// specmesh: speculative LLM inference over an actor mesh.
#include <cstdio>
#include <exception>

#include "cli/commands.hpp"

int main(int argc, char** argv) {
  CLI::App app{"specmesh: speculative LLM inference on edge hardware"};
  app.require_subcommand(1);
  specmesh::register_generate(app);
  specmesh::register_tokenize(app);
  specmesh::register_inspect(app);
  specmesh::register_make_model(app);
  specmesh::register_run(app);
  specmesh::register_node(app);
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
