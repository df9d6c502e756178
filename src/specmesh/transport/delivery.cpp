#include "specmesh/transport/delivery.hpp"

#include <caf/abstract_actor.hpp>
#include <caf/actor_cast.hpp>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/atom.hpp>
#include <caf/execution_unit.hpp>
#include <caf/resumable.hpp>
#include <caf/scheduler/abstract_coordinator.hpp>

#include <algorithm>

#include <spdlog/spdlog.h>

#include <stdexcept>

namespace specmesh {

void configure_low_latency_scheduler(caf::actor_system_config& cfg, std::size_t max_threads) {
  cfg.set("scheduler.policy", caf::atom("sharing"));
  cfg.set("scheduler.max-threads", max_threads);
}

namespace gw {

// Runs an actor on the calling (I/O) thread when a delivery wakes it up, instead of waking a
// CAF worker. CAF calls exec_later() from inside enqueue() exactly when the enqueue unblocked
// the actor, so at most one thread ever resumes it, as with a scheduler worker. Anything else
// scheduled through this unit (actors the inline actor messages or spawns) goes to the
// regular scheduler: only the subscriber itself runs inline.
class InlineUnit : public caf::execution_unit {
 public:
  explicit InlineUnit(caf::actor_system* sys) : caf::execution_unit(sys) {}

  void exec_later(caf::resumable* job) override {
    if (capturing_ && captured_ == nullptr) {
      captured_ = job;
      return;
    }
    system().scheduler().enqueue(job);
  }

  void deliver(caf::abstract_actor* dest, caf::mailbox_element_ptr elem) {
    capturing_ = true;
    dest->enqueue(std::move(elem), this);
    capturing_ = false;
    auto* job = std::exchange(captured_, nullptr);
    if (job == nullptr) return;
    // One message per inline run; a longer backlog is left to the scheduler, mirroring what
    // a worker does with resume_later.
    switch (job->resume(this, 1)) {
      case caf::resumable::resume_later:
        system().scheduler().enqueue(job);  // hands over our reference
        break;
      case caf::resumable::done:
      case caf::resumable::awaiting_message:
      case caf::resumable::shutdown_execution_unit:
        caf::intrusive_ptr_release(job);
        break;
    }
  }

 private:
  bool capturing_ = false;
  caf::resumable* captured_ = nullptr;
};

namespace {

caf::message_id message_id_for(MsgType t) {
  return caf::make_message_id(is_control(t) ? caf::message_priority::high : caf::message_priority::normal);
}

}  // namespace

Subscriptions::Subscriptions(std::string node) : node_(std::move(node)) {}
Subscriptions::~Subscriptions() = default;

void Subscriptions::subscribe(const std::vector<MsgType>& types, caf::actor who, Delivery how) {
  if (!who) throw std::invalid_argument("Gateway::subscribe: invalid actor handle");
  std::lock_guard<std::mutex> g(mu_);
  // The I/O thread waits on mu_ meanwhile, so nothing newer overtakes the held messages.
  auto wanted = [&](MsgType t) { return std::find(types.begin(), types.end(), t) != types.end(); };
  std::erase_if(held_, [&](Held& h) {
    if (!wanted(h.env.type())) return false;
    n_delivered_.fetch_add(1, std::memory_order_relaxed);
    const auto id = message_id_for(h.env.type());
    caf::actor_cast<caf::abstract_actor*>(who)->enqueue(caf::make_mailbox_element(nullptr, id, {}, h.from, std::move(h.env)),
                                                        nullptr);
    return true;
  });
  for (MsgType t : types) subs_[static_cast<std::size_t>(t)].push_back({who, how});
}

void Subscriptions::unsubscribe(const caf::actor& who) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& v : subs_) std::erase_if(v, [&](const Subscriber& s) { return s.actor == who; });
}

uint64_t Subscriptions::held() const {
  std::lock_guard<std::mutex> g(mu_);
  return held_.size();
}

bool Subscriptions::has_subscriber(MsgType type) const {
  std::lock_guard<std::mutex> g(mu_);
  return !subs_[static_cast<std::size_t>(type)].empty();
}

void Subscriptions::deliver(const std::string& from, Envelope&& env) {
  const auto id = message_id_for(env.type());
  {
    // A copy, so handlers running inline may (un)subscribe without deadlocking.
    std::lock_guard<std::mutex> g(mu_);
    targets_ = subs_[static_cast<std::size_t>(env.type())];
    if (targets_.empty()) {
      if (held_.size() >= kMaxHeld) {
        spdlog::debug("gateway '{}': no subscriber for {} from '{}'", node_, to_string(held_.front().env.type()),
                      held_.front().from);
        held_.pop_front();
        n_unrouted_.fetch_add(1, std::memory_order_relaxed);
      }
      held_.push_back({from, std::move(env)});
      return;
    }
  }
  n_delivered_.fetch_add(targets_.size(), std::memory_order_relaxed);
  if (targets_.size() == 1) {
    push(targets_[0], caf::make_mailbox_element(nullptr, id, {}, from, std::move(env)));
  } else {
    // One shared (copy-on-write) message for all subscribers.
    auto msg = caf::make_message(from, std::move(env));
    for (auto& t : targets_) push(t, caf::make_mailbox_element(nullptr, id, {}, msg));
  }
  targets_.clear();
}

void Subscriptions::push(const Subscriber& t, caf::mailbox_element_ptr elem) {
  auto* dest = caf::actor_cast<caf::abstract_actor*>(t.actor);
  if (dest == nullptr) return;
  if (t.how == Delivery::inline_io) {
    if (!inline_unit_) inline_unit_ = std::make_unique<InlineUnit>(&dest->home_system());
    if (&inline_unit_->system() == &dest->home_system()) {
      inline_unit_->deliver(dest, std::move(elem));
      return;
    }
  }
  dest->enqueue(std::move(elem), nullptr);
}

}  // namespace gw
}  // namespace specmesh
