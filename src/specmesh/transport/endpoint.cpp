#include "specmesh/transport/endpoint.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>

#include "specmesh/transport/gateway.hpp"

namespace specmesh {

namespace {

// Whether a listener holds the tcp port: bind as ZeroMQ does (SO_REUSEADDR, so connections
// of an earlier run still in TIME_WAIT do not count).
bool tcp_taken(const std::string& host, int port) {
  std::string h = host;
  if (h.size() > 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  sockaddr_storage addr{};
  socklen_t len = 0;
  if (h == "*" || h == "0.0.0.0") h = "0.0.0.0";
  auto* v4 = reinterpret_cast<sockaddr_in*>(&addr);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&addr);
  if (::inet_pton(AF_INET, h.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(uint16_t(port));
    len = sizeof *v4;
  } else if (::inet_pton(AF_INET6, h.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(uint16_t(port));
    len = sizeof *v6;
  } else {
    return false;  // an interface name: ZeroMQ resolves it, this check does not
  }
  const int s = ::socket(addr.ss_family, SOCK_STREAM, 0);
  if (s < 0) return false;
  const int one = 1;
  ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  const bool taken = ::bind(s, reinterpret_cast<sockaddr*>(&addr), len) != 0 && errno == EADDRINUSE;
  ::close(s);
  return taken;
}

// A port drawn by free_port_range stays free until its caller's listener binds it, which may
// be a second later in another process (a spawned node). Other processes drawing ports in that
// time (concurrent tests, a second `specmesh run --spawn`) cannot see it bound yet, so each
// drawn port is leased for kLeaseSeconds through a file per port under the temp directory:
// the lease is taken under flock (atomic between processes) by writing the file, and a file
// older than the lease is free again. No descriptor is held and nothing needs cleaning up.
// Where the directory cannot be used the lease is skipped and only the bind probe remains.
constexpr int kLeaseSeconds = 120;

std::string lease_dir() {
  const char* tmp = std::getenv("TMPDIR");
  const std::string dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/specmesh-ports-" + std::to_string(::getuid());
  ::mkdir(dir.c_str(), 0700);
  return dir;
}

bool lease_port(const std::string& dir, int port) {
  const std::string path = dir + "/" + std::to_string(port);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return true;
  bool taken = false;
  if (::flock(fd, LOCK_EX) == 0) {
    struct stat st{};
    taken = ::fstat(fd, &st) == 0 && st.st_size > 0 && std::time(nullptr) - st.st_mtime < kLeaseSeconds;
    const char one = '1';
    if (!taken && ::pwrite(fd, &one, 1, 0) == 1) ::futimens(fd, nullptr);  // ours from now on
  }
  ::close(fd);  // releases the flock
  return !taken;
}

// Whether something accepts connections on the socket file (ZeroMQ would unlink it and bind
// its own, silently taking the address from the process that has it).
bool ipc_taken(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof addr.sun_path) return false;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
  if (s < 0) return false;
  const bool taken = ::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(s);
  return taken;
}

}  // namespace

// Literal addresses only: ZeroMQ binds interface names and addresses, never DNS names.
bool is_loopback_host(std::string h) {
  if (h.size() > 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  in_addr v4{};
  if (::inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  return ::inet_pton(AF_INET6, h.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

TcpEndpoint parse_tcp(const std::string& ep) {
  auto rest = ep.substr(6);
  auto colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == rest.size())
    throw std::invalid_argument("endpoint '" + ep + "': expected tcp://HOST:PORT");
  TcpEndpoint t;
  t.host = rest.substr(0, colon);
  std::size_t used = 0;
  try {
    t.port = std::stoi(rest.substr(colon + 1), &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != rest.size() - colon - 1 || t.port <= 0 || t.port >= 65535)
    throw std::invalid_argument("endpoint '" + ep + "': port must be 1..65534 (control uses port+1)");
  return t;
}

std::string endpoint_in_use(const std::string& ep) {
  for (const std::string& e : {ep, control_endpoint_for(ep)}) {
    if (e.rfind("tcp://", 0) == 0) {
      const TcpEndpoint t = parse_tcp(e);
      if (tcp_taken(t.host, t.port)) return e;
    } else if (e.rfind("ipc://", 0) == 0) {
      if (ipc_taken(e.substr(6))) return e;
    }
  }
  return {};
}

int free_port_range(int count) {
  static std::mutex mu;
  static std::set<int> handed_out;
  std::lock_guard<std::mutex> lock(mu);
  static const std::string dir = lease_dir();
  std::random_device rd;
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = 10000 + int(rd() % uint32_t(22000 - count));
    bool ok = true;
    for (int p = port; ok && p < port + count; ++p) ok = !handed_out.count(p) && !tcp_taken("127.0.0.1", p);
    for (int p = port; ok && p < port + count; ++p) ok = lease_port(dir, p);
    if (!ok) continue;
    for (int p = port; p < port + count; ++p) handed_out.insert(p);
    return port;
  }
  throw std::runtime_error("no " + std::to_string(count) + " consecutive free tcp ports below 32000 on 127.0.0.1");
}

}  // namespace specmesh
