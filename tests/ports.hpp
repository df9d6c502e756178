// Loopback ports for tests: a tcp:// endpoint uses its port and the next one (control).
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <random>
#include <stdexcept>

namespace specmesh::test {

// Two consecutive ports that are free right now. They are drawn below the kernel's ephemeral
// range (32768 and up on Linux): a port the kernel hands out can be taken again, between this
// check and the test's bind, as the local port of any outgoing connection (tests run in
// parallel).
inline int free_port_pair() {
  std::random_device rd;
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = 10000 + int(rd() % 22000);
    bool ok = true;
    for (int p : {port, port + 1}) {
      int s = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(uint16_t(p));
      ok = ok && ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
      ::close(s);
    }
    if (ok) return port;
  }
  throw std::runtime_error("no free port pair");
}

}  // namespace specmesh::test
