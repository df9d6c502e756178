// Subcommands of the specmesh binary; each file registers its own.
#pragma once

#include <CLI/CLI.hpp>

namespace specmesh {

void register_generate(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_inspect(CLI::App& app);
void register_make_model(CLI::App& app);
void register_run(CLI::App& app);
void register_node(CLI::App& app);
void register_strategies(CLI::App& app);
void register_keygen(CLI::App& app);
void register_serve(CLI::App& app);
void register_dflash_data(CLI::App& app);

}  // namespace specmesh
