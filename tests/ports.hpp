// Loopback ports for tests: a tcp:// endpoint uses its port and the next one (control).
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <stdexcept>

namespace specmesh::test {

// Two consecutive ports that are free right now (the kernel picks the first).
inline int free_port_pair() {
  for (int attempt = 0; attempt < 50; ++attempt) {
    int s = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
    int port = ntohs(a.sin_port);
    int s2 = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in b = a;
    b.sin_port = htons(port + 1);
    bool ok = port < 65534 && ::bind(s2, reinterpret_cast<sockaddr*>(&b), sizeof b) == 0;
    ::close(s2);
    ::close(s);
    if (ok) return port;
  }
  throw std::runtime_error("no free port pair");
}

}  // namespace specmesh::test
