// `specmesh keygen`: CURVE key pairs for the nodes of a topology (see runtime/keys.hpp).
//
//   specmesh keygen DIR NAME...          keys for the named nodes into DIR
//   specmesh keygen --topology FILE      keys for every node into the file's [security] keys
//   specmesh keygen --topology FILE DIR  ... or into DIR
#include <cstdio>

#include "specmesh/cli/commands.hpp"
#include "specmesh/runtime/keys.hpp"
#include "specmesh/topology.hpp"

namespace specmesh {

void register_keygen(CLI::App& app) {
  struct Opts {
    std::string dir, topology;
    std::vector<std::string> names;
    bool force = false;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "keygen", "Write CURVE key pairs for nodes: DIR/NAME.key (public, for every node) and DIR/NAME.key_secret (0600)");
  cmd->add_option("dir", o->dir, "key directory (created 0700 when missing; default with --topology: its [security] keys)");
  cmd->add_option("names", o->names, "node names (default with --topology: every node)");
  cmd->add_option("--topology", o->topology, "topology file (TOML) whose nodes get keys")->check(CLI::ExistingFile);
  cmd->add_flag("--force", o->force, "replace existing key files");
  cmd->callback([o] {
    std::string dir = o->dir;
    std::vector<std::string> names = o->names;
    if (!o->topology.empty()) {
      const Topology t = Topology::load(o->topology);
      if (dir.empty()) dir = t.security.keys;
      if (dir.empty())
        throw ConfigError(o->topology + ": security.keys: not set; add [security] keys = \"keys\" or name a directory: "
                          "specmesh keygen --topology " + o->topology + " DIR");
      if (names.empty())
        for (const auto& [n, spec] : t.nodes) names.push_back(n);
      for (const std::string& n : names)
        if (!t.nodes.count(n)) throw ConfigError(o->topology + ": no node named '" + n + "' in [nodes]");
    }
    if (dir.empty() || names.empty()) throw CLI::ValidationError("keygen", "name a directory and nodes, or --topology FILE");
    for (const std::string& n : names) {
      write_node_keys(dir, n, o->force);
      std::printf("%s %s\n", public_key_path(dir, n).c_str(), secret_key_path(dir, n).c_str());
    }
  });
}

}  // namespace specmesh
