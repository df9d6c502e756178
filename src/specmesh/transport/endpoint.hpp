// Endpoint strings (tcp://HOST:PORT, ipc://PATH, inproc://NAME) and whether one is taken.
#pragma once

#include <string>

namespace specmesh {

struct TcpEndpoint {
  std::string host;
  int port = 0;
};

// tcp://HOST:PORT with PORT in 1..65534 (the control channel uses PORT+1); throws
// std::invalid_argument.
TcpEndpoint parse_tcp(const std::string& endpoint);

// Whether a tcp host is a literal loopback address (127.x.x.x, [::1]); names, "*" and other
// interfaces are not.
bool is_loopback_host(std::string host);

// The address that is taken if a listener holds `endpoint` or its control endpoint right now
// (a tcp port bound on that host, an ipc socket file that accepts connections), else empty.
// inproc names live in one process and are never taken from outside. A tcp host that is not
// a literal address is not probed. Throws std::invalid_argument for a malformed endpoint.
std::string endpoint_in_use(const std::string& endpoint);

// The first of `count` consecutive tcp ports that are all free on 127.0.0.1 right now, drawn
// below the kernel's ephemeral range (32768 and up on Linux): a port the kernel hands out can
// be taken again, between this check and the bind, as the local port of any outgoing
// connection. A port this process handed out before is never handed out again (it is free
// until its caller binds it, and several endpoints are usually drawn before any is bound),
// and for two minutes no other process of this user draws it either (a lease file per port
// in $TMPDIR/specmesh-ports-<uid>), so concurrent launches do not pick the same free port.
// Throws std::runtime_error when no such range turns up.
int free_port_range(int count);

}  // namespace specmesh
