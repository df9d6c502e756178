#include "specmesh/transport/zap.hpp"

#include "specmesh/transport/link.hpp"

#include <spdlog/spdlog.h>
#include <zmq.hpp>

#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace specmesh::gw {

namespace {

std::string z85_of(const std::string& raw) {
  if (raw.size() != 32) return "(" + std::to_string(raw.size()) + " bytes)";
  char out[41] = {};
  zmq_z85_encode(out, reinterpret_cast<const uint8_t*>(raw.data()), raw.size());
  return out;
}

class Handler {
 public:
  static Handler& instance() {
    static Handler h;
    return h;
  }

  void add(const std::string& domain, const std::string& node, std::map<std::string, std::string> keys,
           std::shared_ptr<std::atomic<uint64_t>> denied) {
    std::lock_guard<std::mutex> g(mu_);
    domains_[domain] = Domain{node, std::move(keys), std::move(denied)};
  }
  void remove(const std::string& domain) {
    std::lock_guard<std::mutex> g(mu_);
    domains_.erase(domain);
  }

 private:
  struct Domain {
    std::string node;
    std::map<std::string, std::string> keys;
    std::shared_ptr<std::atomic<uint64_t>> denied;
  };

  Handler() : sock_(process_context(), zmq::socket_type::rep) {
    sock_.set(zmq::sockopt::linger, 0);
    try {
      sock_.bind("inproc://zeromq.zap.01");
    } catch (const zmq::error_t& e) {
      throw std::runtime_error(std::string("cannot start the ZAP handler for CURVE: ") + e.what());
    }
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) throw std::runtime_error("ZAP handler: eventfd failed");
    thread_ = std::thread([this] { run(); });
  }
  // Static destruction: every gateway is gone by now, and the context outlives this object
  // (it was constructed first), so closing the socket here lets the context terminate.
  ~Handler() {
    stop_.store(true);
    uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);
    if (thread_.joinable()) thread_.join();
    sock_.close();
    ::close(wake_fd_);
  }

  void run() {
    pthread_setname_np(pthread_self(), "specmesh-zap");
    std::vector<zmq::message_t> req;
    while (!stop_.load()) {
      zmq_pollitem_t items[2] = {{nullptr, wake_fd_, ZMQ_POLLIN, 0}, {sock_.handle(), 0, ZMQ_POLLIN, 0}};
      if (zmq_poll(items, 2, -1) < 0) {
        if (zmq_errno() == ETERM) return;
        continue;
      }
      if (!(items[1].revents & ZMQ_POLLIN)) continue;
      try {
        req.clear();
        for (bool more = true; more;) {
          zmq::message_t m;
          if (!sock_.recv(m, zmq::recv_flags::dontwait)) break;
          more = m.more();
          req.push_back(std::move(m));
        }
        if (req.empty()) continue;
        reply(req);
      } catch (const zmq::error_t& e) {
        if (e.num() == ETERM) return;
        spdlog::error("ZAP handler: {}", e.what());
      }
    }
  }

  // RFC 27: version, request id, domain, address, identity, mechanism, credentials...
  void reply(std::vector<zmq::message_t>& req) {
    std::string status = "400", text = "refused", user;
    const std::string domain = req.size() > 2 ? req[2].to_string() : "";
    const std::string address = req.size() > 3 ? req[3].to_string() : "";
    const std::string mechanism = req.size() > 5 ? req[5].to_string() : "";
    const std::string key = req.size() > 6 ? req[6].to_string() : "";
    std::string node = "?";
    std::shared_ptr<std::atomic<uint64_t>> denied;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (auto d = domains_.find(domain); d != domains_.end()) {
        node = d->second.node;
        denied = d->second.denied;
        if (req.size() >= 7 && req[0].to_string() == "1.0" && mechanism == "CURVE") {
          if (auto k = d->second.keys.find(key); k != d->second.keys.end()) {
            status = "200";
            text = "OK";
            user = k->second;
          }
        }
      }
    }
    if (status != "200") {
      const uint64_t n = denied ? denied->fetch_add(1) + 1 : 0;
      if (n <= 10 || n % 100 == 0)
        spdlog::warn("gateway '{}': refused a {} client from {}: public key {} is no configured peer's (#{})", node,
                     mechanism.empty() ? "ZAP" : mechanism, address.empty() ? "?" : address, z85_of(key), n);
    }
    // Whatever the request, a reply goes back: libzmq waits for it before the handshake ends.
    const std::string version = "1.0";
    (void)sock_.send(zmq::buffer(version), zmq::send_flags::sndmore);
    if (req.size() > 1) (void)sock_.send(req[1], zmq::send_flags::sndmore);
    else (void)sock_.send(zmq::str_buffer(""), zmq::send_flags::sndmore);
    (void)sock_.send(zmq::buffer(status), zmq::send_flags::sndmore);
    (void)sock_.send(zmq::buffer(text), zmq::send_flags::sndmore);
    (void)sock_.send(zmq::buffer(user), zmq::send_flags::sndmore);
    (void)sock_.send(zmq::str_buffer(""), zmq::send_flags::none);
  }

  zmq::socket_t sock_;
  int wake_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex mu_;
  std::map<std::string, Domain> domains_;
};

}  // namespace

ZapDomain::ZapDomain(const std::string& node, std::map<std::string, std::string> keys)
    : denied_(std::make_shared<std::atomic<uint64_t>>(0)) {
  static std::atomic<uint64_t> next{0};
  name_ = "specmesh/" + std::to_string(::getpid()) + "/" + std::to_string(next++) + "/" + node;
  if (name_.size() > 254) name_.resize(254);  // ZMQ_ZAP_DOMAIN holds at most 254 bytes; the counter keeps it unique
  Handler::instance().add(name_, node, std::move(keys), denied_);
}

ZapDomain::~ZapDomain() { Handler::instance().remove(name_); }

}  // namespace specmesh::gw
