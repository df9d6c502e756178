#include "specmesh/runtime/keys.hpp"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "specmesh/transport/endpoint.hpp"

namespace specmesh {

namespace {

namespace fs = std::filesystem;

bool is_tcp(const std::string& ep) { return ep.rfind("tcp://", 0) == 0; }

// Node names become file names: nothing that leaves the directory.
void check_file_name(const std::string& node) {
  if (node.empty() || node == "." || node == ".." || node.find('/') != std::string::npos ||
      node.find('\0') != std::string::npos)
    throw ConfigError("node name '" + node + "' cannot name a key file (no '/', not '.' or '..')");
}

std::string octal(mode_t m) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%04o", unsigned(m & 07777));
  return buf;
}

std::string line_of(const Topology& topo, const std::string& key) {
  auto it = topo.lines.find(key);
  return it == topo.lines.end() ? "" : ":" + std::to_string(it->second);
}

// Names the first of `prefer` on tcp://, else the first tcp:// node.
[[noreturn]] void missing_keys(const Topology& topo, const std::vector<std::string>& prefer) {
  std::string node;
  for (const std::string& n : prefer)
    if (node.empty() && is_tcp(topo.nodes.at(n).endpoint)) node = n;
  for (const auto& [n, spec] : topo.nodes)
    if (node.empty() && is_tcp(spec.endpoint)) node = n;
  throw ConfigError(topo.path + line_of(topo, "nodes." + node + ".endpoint") + ": security.keys: missing: node '" +
                    node + "' uses tcp://, which always runs CURVE and needs the nodes' keys; add [security] keys = "
                    "\"keys\" to " + topo.path + " and create them with `specmesh keygen --topology " + topo.path +
                    "` (`specmesh run --spawn` makes throwaway keys by itself)");
}

// `name = "value"` of a zcert file, by name; the line number in *line.
std::optional<std::string> field(const std::string& path, const std::string& text, const std::string& name, int* line) {
  std::istringstream in(text);
  std::string l;
  for (int n = 1; std::getline(in, l); ++n) {
    const auto b = l.find_first_not_of(" \t");
    if (b == std::string::npos || l[b] == '#') continue;
    if (l.compare(b, name.size(), name) != 0) continue;
    std::string rest = l.substr(b + name.size());
    const auto eq = rest.find('=');
    if (eq == std::string::npos || rest.find_first_not_of(" \t") != eq) continue;
    rest = rest.substr(eq + 1);
    const auto q1 = rest.find('"'), q2 = rest.rfind('"');
    *line = n;
    if (q1 == std::string::npos || q2 == q1)
      throw ConfigError(path + ":" + std::to_string(n) + ": " + name + ": expected a quoted Z85 key");
    return rest.substr(q1 + 1, q2 - q1 - 1);
  }
  return std::nullopt;
}

std::string key_field(const std::string& path, const std::string& text, const std::string& name) {
  int line = 0;
  auto v = field(path, text, name, &line);
  if (!v) throw ConfigError(path + ": no " + name + " = \"...\" line: not a key file written by `specmesh keygen`");
  if (!is_z85_key(*v))
    throw ConfigError(path + ":" + std::to_string(line) + ": " + name + ": not a Z85 CURVE key (40 characters)");
  return *v;
}

std::string read_text(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  if (!in) throw ConfigError(path + ": cannot read the " + what + ": " + std::strerror(errno) + " (`specmesh keygen` writes it)");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& text, mode_t mode, bool overwrite) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | (overwrite ? 0 : O_EXCL), mode);
  if (fd < 0) {
    if (errno == EEXIST)
      throw ConfigError(path + ": exists; pass --force to replace it (every node then needs the new public key)");
    throw ConfigError(path + ": cannot write: " + std::strerror(errno));
  }
  const bool ok = ::fchmod(fd, mode) == 0 && ::write(fd, text.data(), text.size()) == ssize_t(text.size());
  const int err = errno;
  ::close(fd);
  if (!ok) throw ConfigError(path + ": cannot write: " + std::strerror(err));
}

}  // namespace

std::string public_key_path(const std::string& dir, const std::string& node) {
  check_file_name(node);
  return (fs::path(dir) / (node + ".key")).string();
}

std::string secret_key_path(const std::string& dir, const std::string& node) {
  check_file_name(node);
  return (fs::path(dir) / (node + ".key_secret")).string();
}

void write_node_keys(const std::string& dir, const std::string& node, bool overwrite) {
  const std::string pub_path = public_key_path(dir, node), sec_path = secret_key_path(dir, node);
  std::error_code ec;
  if (!fs::exists(dir, ec)) {
    fs::create_directories(dir, ec);
    if (ec) throw ConfigError(dir + ": cannot create the key directory: " + ec.message());
    fs::permissions(dir, fs::perms::owner_all, ec);
  }
  const CurveKeyPair k = curve_keypair();
  const std::string meta = "\nmetadata\n    name = \"" + node + "\"\ncurve\n    public-key = \"" + k.public_key + "\"\n";
  write_file(sec_path,
             "#   ****  Generated by specmesh keygen  ****\n"
             "#   ZeroMQ CURVE **Secret** Certificate of node '" + node + "'\n"
             "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.\n" +
                 meta + "    secret-key = \"" + k.secret_key + "\"\n",
             0600, overwrite);
  write_file(pub_path,
             "#   ****  Generated by specmesh keygen  ****\n"
             "#   ZeroMQ CURVE Public Certificate of node '" + node + "'\n"
             "#   Every node of the topology needs it; exchange it securely.\n" + meta,
             0644, overwrite);
}

std::string read_public_key(const std::string& path) { return key_field(path, read_text(path, "public key file"), "public-key"); }

CurveKeyPair read_secret_key(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw ConfigError(path + ": cannot read the secret key file: " + std::strerror(errno) + " (`specmesh keygen` writes it)");
  if (st.st_uid != ::geteuid())
    throw ConfigError(path + ": the secret key file belongs to uid " + std::to_string(st.st_uid) + ", not to this user");
  if (st.st_mode & 077)
    throw ConfigError(path + ": the secret key file is accessible by group or others (mode " + octal(st.st_mode) +
                      "); chmod 600 " + path);
  const std::string text = read_text(path, "secret key file");
  CurveKeyPair k{key_field(path, text, "public-key"), key_field(path, text, "secret-key")};
  if (curve_public_of(k.secret_key) != k.public_key)
    throw ConfigError(path + ": public-key does not belong to secret-key");
  return k;
}

bool uses_tcp(const Topology& topo) {
  for (const auto& [n, spec] : topo.nodes)
    if (is_tcp(spec.endpoint)) return true;
  return false;
}

void check_security(const Topology& topo, const std::vector<std::string>& here) {
  const SecuritySpec& s = topo.security;
  if (s.allow_remote && s.keys.empty())
    throw ConfigError(topo.path + line_of(topo, "security.allow_remote") +
                      ": security.allow_remote: listening beyond loopback is allowed only with CURVE keys; set "
                      "security.keys (a directory) and create them with `specmesh keygen --topology " + topo.path + "`");
  if (uses_tcp(topo) && s.keys.empty()) missing_keys(topo, here);
  for (const std::string& n : here) {
    const std::string& ep = topo.nodes.at(n).endpoint;
    if (!is_tcp(ep) || s.allow_remote) continue;
    if (!is_loopback_host(parse_tcp(ep).host))
      throw ConfigError(topo.path + line_of(topo, "nodes." + n + ".endpoint") + ": nodes." + n + ".endpoint: '" + ep +
                        "' is not a loopback address (127.x.x.x or [::1]); to listen on other interfaces set "
                        "allow_remote = true in [security] (or pass --allow-remote), with CURVE keys");
  }
}

std::optional<CurveConfig> node_curve(const Topology& topo, const std::string& node) {
  if (!uses_tcp(topo)) return std::nullopt;
  const std::string& dir = topo.security.keys;
  if (dir.empty()) missing_keys(topo, {node});
  const std::string sec_path = secret_key_path(dir, node), pub_path = public_key_path(dir, node);
  const CurveKeyPair own = read_secret_key(sec_path);
  if (fs::exists(pub_path) && read_public_key(pub_path) != own.public_key)
    throw ConfigError(pub_path + ": does not match " + sec_path +
                      ", so the other nodes would refuse this one; write both again with `specmesh keygen --force`");
  CurveConfig c{own.public_key, own.secret_key, {}};
  for (const auto& [n, spec] : topo.nodes)
    if (n != node) c.peer_keys[n] = read_public_key(public_key_path(dir, n));
  return c;
}

EphemeralKeys::EphemeralKeys(const Topology& topo) {
  std::string tmpl = (fs::temp_directory_path() / "specmesh-keys-XXXXXX").string();
  if (::mkdtemp(tmpl.data()) == nullptr)
    throw std::runtime_error("cannot create a directory for throwaway keys: " + std::string(std::strerror(errno)));
  dir_ = tmpl;  // mkdtemp: mode 0700
  try {
    for (const auto& [n, spec] : topo.nodes) write_node_keys(dir_, n);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(dir_, ec);
    throw;
  }
}

EphemeralKeys::~EphemeralKeys() {
  std::error_code ec;
  fs::remove_all(dir_, ec);
}

}  // namespace specmesh
