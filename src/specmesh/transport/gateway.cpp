#include "specmesh/transport/gateway.hpp"

#include "specmesh/transport/curve.hpp"
#include "specmesh/transport/delivery.hpp"
#include "specmesh/transport/link.hpp"
#include "specmesh/transport/liveness.hpp"

#include <stdexcept>

namespace specmesh {

uint64_t GatewayStats::rejected_total() const {
  uint64_t n = 0;
  for (auto v : rejected) n += v;
  return n;
}

namespace {

bool is_tcp(const std::string& ep) { return ep.rfind("tcp://", 0) == 0; }

void check_curve(const GatewayConfig& c) {
  const std::string me = "gateway '" + c.node + "': CURVE: ";
  if (!curve_supported()) throw std::invalid_argument(me + "this libzmq is built without CURVE");
  if (c.node.size() > 246) throw std::invalid_argument(me + "node names are at most 246 bytes with CURVE");
  const CurveConfig& k = *c.curve;
  if (!is_z85_key(k.secret_key)) throw std::invalid_argument(me + "the secret key is not a Z85 key (40 characters)");
  if (!is_z85_key(k.public_key)) throw std::invalid_argument(me + "the public key is not a Z85 key (40 characters)");
  if (curve_public_of(k.secret_key) != k.public_key)
    throw std::invalid_argument(me + "the public key does not belong to the secret key");
  for (const auto& [name, ep] : c.peers)
    if (name.find('\0') != std::string::npos || c.node.find('\0') != std::string::npos)
      throw std::invalid_argument(me + "node names must not hold NUL bytes");
  for (const auto& [name, key] : k.peer_keys) {
    if (!c.peers.count(name)) throw std::invalid_argument(me + "a key for '" + name + "', which is no peer");
    if (!is_z85_key(key)) throw std::invalid_argument(me + "the key of peer '" + name + "' is not a Z85 key");
  }
  for (const auto& [name, ep] : c.peers)
    if ((is_tcp(c.bind) || is_tcp(ep)) && !k.peer_keys.count(name))
      throw std::invalid_argument(me + "no public key for peer '" + name + "'");
}

GatewayConfig checked(GatewayConfig c) {
  if (c.node.empty() || c.node.size() > 255 || c.node[0] == '\0')
    throw std::invalid_argument("gateway: node name must be 1..255 bytes and not start with NUL");
  if (c.peers.count(c.node)) throw std::invalid_argument("gateway '" + c.node + "': peers must not include itself");
  if (c.heartbeat.count() <= 0 || c.peer_timeout <= c.heartbeat)
    throw std::invalid_argument("gateway '" + c.node + "': need 0 < heartbeat < peer_timeout");
  if (c.first_contact_timeout < c.peer_timeout)
    throw std::invalid_argument("gateway '" + c.node + "': need first_contact_timeout >= peer_timeout");
  if (c.curve) check_curve(c);
  return c;
}

}  // namespace

// Wires the parts together: what the links receive is delivered, what they hear keeps peers alive.
struct Gateway::Impl final : gw::LinkEvents {
  GatewayConfig cfg;
  gw::Subscriptions subs{cfg.node};
  gw::Links links{cfg};
  gw::Liveness liveness{cfg, links, subs};

  explicit Impl(GatewayConfig c) : cfg(checked(std::move(c))) { links.start(*this); }
  // The I/O thread calls into every part, so it stops before any part goes.
  ~Impl() override { links.stop(); }

  void heard(uint32_t peer) override { liveness.heard(peer); }
  void arrived(const std::string& from, Envelope&& env) override {
    // A heartbeat has done its job in heard(); held for nobody, it would only fill the queue.
    if (env.type() == MsgType::heartbeat && !subs.has_subscriber(MsgType::heartbeat)) return;
    subs.deliver(from, std::move(env));
  }
  void tick(gw::Clock::time_point now) override { liveness.tick(now); }
  gw::Clock::time_point next_tick() const override { return liveness.next_tick(); }
};

Gateway::Gateway(GatewayConfig cfg) : impl_(std::make_unique<Impl>(std::move(cfg))) {}
Gateway::~Gateway() = default;

bool Gateway::send(const std::string& peer, Envelope env) { return impl_->links.send(peer, std::move(env)); }

void Gateway::subscribe(MsgType type, caf::actor who, Delivery how) { impl_->subs.subscribe({type}, std::move(who), how); }
void Gateway::subscribe(const std::vector<MsgType>& types, caf::actor who, Delivery how) {
  impl_->subs.subscribe(types, std::move(who), how);
}
void Gateway::unsubscribe(const caf::actor& who) { impl_->subs.unsubscribe(who); }

GatewayStats Gateway::stats() const {
  GatewayStats s;
  s.sent = impl_->links.sent();
  s.received = impl_->links.received();
  s.delivered = impl_->subs.delivered();
  s.unrouted = impl_->subs.unrouted();
  s.held = impl_->subs.held();
  s.send_dropped = impl_->liveness.heartbeats_dropped();
  s.handshakes_failed = impl_->links.handshakes_failed();
  s.auth_denied = impl_->links.auth_denied();
  for (std::size_t i = 0; i < kRejectReasonCount; ++i) s.rejected[i] = impl_->links.rejected(RejectReason(i));
  return s;
}

bool Gateway::peer_alive(const std::string& peer) const {
  const gw::Link* l = impl_->links.find(peer);
  return l != nullptr && impl_->liveness.alive(l->index);
}

const GatewayConfig& Gateway::config() const { return impl_->cfg; }
std::string Gateway::data_endpoint() const { return impl_->links.endpoint(gw::kData); }
std::string Gateway::control_endpoint() const { return impl_->links.endpoint(gw::kControl); }

}  // namespace specmesh
