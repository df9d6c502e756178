// The CURVE keys of a topology's nodes and the security rules a node is started under.
//
// Key files (what `specmesh keygen` writes, in ZeroMQ's zcert text format):
//   DIR/NODE.key         the node's public key, mode 0644: every node reads every one of these
//   DIR/NODE.key_secret  its public and secret key, mode 0600: only NODE's process reads it
// Each holds `public-key = "Z85"` (and `secret-key = "Z85"`) under a `curve` section.
//
// Rules (check_security): tcp:// always runs CURVE, so a topology with tcp:// nodes needs
// [security] keys; a tcp:// node binds an address other than loopback only with
// allow_remote, and allow_remote needs keys. Errors are ConfigError "file:line: key: what",
// and errors about key files name the file.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "specmesh/topology.hpp"
#include "specmesh/transport/curve.hpp"
#include "specmesh/transport/gateway.hpp"

namespace specmesh {

std::string public_key_path(const std::string& dir, const std::string& node);
std::string secret_key_path(const std::string& dir, const std::string& node);

// Writes a fresh key pair for `node` into `dir` (created 0700 when missing); refuses to
// replace existing files unless `overwrite`. Throws ConfigError naming the file.
void write_node_keys(const std::string& dir, const std::string& node, bool overwrite = false);

// Reads a public key file / a secret key file (which must be this user's, mode 0600 or
// stricter, and hold a matching pair). Throws ConfigError naming the file (and line).
std::string read_public_key(const std::string& path);
CurveKeyPair read_secret_key(const std::string& path);

// Whether any node listens on tcp:// (then every node of the topology needs keys).
bool uses_tcp(const Topology& topo);

// The rules above, for a process that hosts `here`. Throws ConfigError.
void check_security(const Topology& topo, const std::vector<std::string>& here);

// Node `node`'s CURVE settings from the key directory: its own secret file and every other
// node's public key. Nothing when the topology has no tcp:// node. Throws ConfigError.
std::optional<CurveConfig> node_curve(const Topology& topo, const std::string& node);

// Throwaway keys for every node of a topology in a new private directory (mkdtemp, 0700),
// removed with this object: what `specmesh run --spawn` uses for a tcp topology without keys.
class EphemeralKeys {
 public:
  explicit EphemeralKeys(const Topology& topo);
  ~EphemeralKeys();
  EphemeralKeys(const EphemeralKeys&) = delete;
  EphemeralKeys& operator=(const EphemeralKeys&) = delete;
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
};

}  // namespace specmesh
