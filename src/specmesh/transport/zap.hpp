// The ZAP handler (ZeroMQ Authentication Protocol, RFC 27) that decides which CURVE clients a
// gateway's listening sockets accept (private to transport/).
//
// libzmq asks one handler per ZeroMQ context, at inproc://zeromq.zap.01, about every CURVE
// handshake on a socket that has a ZAP domain. All gateways of a process share
// process_context() (link.hpp), so there is one handler per process, started with the first
// registered domain and ended when the process's static objects go (after every gateway is
// gone, before the context). Each gateway registers a domain of its own with the public keys
// of its configured peers; the handler accepts a client whose long-term public key is one of
// them (status 200, User-Id = that peer's node name, which ZeroMQ attaches to every message
// of the connection) and refuses every other key, unknown domain or mechanism (status 400).
// Refusals are counted per domain and logged (rate-limited).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace specmesh::gw {

class ZapDomain {
 public:
  // Registers a new, process-unique domain for gateway `node` accepting `keys` (32 raw key
  // bytes -> node name). Starts the handler if it is not running; throws std::runtime_error if
  // it cannot (another ZAP handler already holds this context's address).
  ZapDomain(const std::string& node, std::map<std::string, std::string> keys);
  // Unregisters; the handler refuses later requests for the domain.
  ~ZapDomain();
  ZapDomain(const ZapDomain&) = delete;
  ZapDomain& operator=(const ZapDomain&) = delete;

  const std::string& name() const { return name_; }  // for ZMQ_ZAP_DOMAIN
  uint64_t denied() const { return denied_->load(); }  // handshakes refused for this domain

 private:
  std::string name_;
  std::shared_ptr<std::atomic<uint64_t>> denied_;
};

}  // namespace specmesh::gw
