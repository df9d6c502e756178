#include "specmesh/serve/connection.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

namespace specmesh::serve {

namespace {

// Address and port of a socket address, as httplib writes them into a Request.
bool address_of(const sockaddr_storage& sa, std::string& addr, int& port) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (sa.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(sa);
    inet_ntop(AF_INET, &in.sin_addr, buf, sizeof buf);
    port = ntohs(in.sin_port);
  } else if (sa.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(sa);
    inet_ntop(AF_INET6, &in6.sin6_addr, buf, sizeof buf);
    port = ntohs(in6.sin6_port);
  } else {
    return false;
  }
  addr = buf;
  return true;
}

// One end of a socket: getsockname or getpeername.
bool end_matches(int fd, int (*get)(int, sockaddr*, socklen_t*), const std::string& want_addr, int want_port) {
  sockaddr_storage sa{};
  socklen_t len = sizeof sa;
  if (get(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) return false;
  std::string addr;
  int port = -1;
  return address_of(sa, addr, port) && port == want_port && addr == want_addr;
}

}  // namespace

ConnectionWatch::ConnectionWatch(const std::string& local_addr, int local_port, const std::string& remote_addr,
                                 int remote_port) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    const std::string name = entry.path().filename();
    int fd = -1;
    try {
      fd = std::stoi(name);
    } catch (...) {
      continue;
    }
    std::error_code link_ec;
    const std::string target = std::filesystem::read_symlink(entry.path(), link_ec).string();
    if (link_ec || target.rfind("socket:", 0) != 0) continue;
    if (end_matches(fd, ::getsockname, local_addr, local_port) && end_matches(fd, ::getpeername, remote_addr, remote_port)) {
      fd_ = fd;
      return;
    }
  }
}

bool ConnectionWatch::closed() const {
  if (fd_ < 0) return false;
  pollfd p{fd_, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
  char byte;
  // Readable: either a next request already sent (keep-alive), or the end of the stream.
  return ::recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

}  // namespace specmesh::serve
