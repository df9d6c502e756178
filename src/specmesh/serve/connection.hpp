// Whether the client of a request in progress has gone away.
//
// cpp-httplib 0.11 (Debian bookworm's) gives a handler neither the connection's socket nor a
// way to ask whether the peer closed it (Request::is_connection_closed came in a later
// version), and a write succeeds into the kernel's buffer after the peer has gone. So the
// socket is found by the addresses the request carries (local and remote address and port:
// unique among this process's TCP sockets) and asked directly: a peer that closed its side
// makes the socket readable with nothing to read (EOF) or raises POLLRDHUP.
#pragma once

#include <string>

namespace specmesh::serve {

class ConnectionWatch {
 public:
  // The socket of the connection between local_addr:local_port and remote_addr:remote_port;
  // when none is found (not a TCP socket of this process), closed() is always false.
  ConnectionWatch(const std::string& local_addr, int local_port, const std::string& remote_addr, int remote_port);
  // True once the peer has closed or reset the connection. Never blocks.
  bool closed() const;
  bool found() const { return fd_ >= 0; }

 private:
  int fd_ = -1;  // owned by the HTTP server, valid while the request is handled
};

}  // namespace specmesh::serve
