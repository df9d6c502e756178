// `specmesh strategies`: the registered strategies, their pipeline roles and parameters.
#include <cstdio>

#include "specmesh/cli/commands.hpp"
#include "specmesh/speculation/registry.hpp"

namespace specmesh {

void register_strategies(CLI::App& app) {
  auto markdown = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand("strategies", "List the decoding strategies, their roles and parameters");
  cmd->add_flag("--markdown", *markdown, "print the README's tables");
  cmd->callback([markdown] { std::fputs((*markdown ? strategies_markdown() : strategies_text()).c_str(), stdout); });
}

}  // namespace specmesh
