// A compute device as an actor: it owns a thread pool and runs the forward work of the
// stages placed on it, one job at a time and in arrival order (so KV-cache operations and
// runs stay ordered). With a timing profile it stretches each job to the modelled duration.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <caf/actor.hpp>
#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/atom.hpp>

#include "specmesh/profiles.hpp"
#include "specmesh/kernels/thread_pool.hpp"

namespace caf {
class actor_system;
}

namespace specmesh {

class Device {
 public:
  Device(std::string name, int threads, std::optional<DeviceProfile> profile)
      : name_(std::move(name)), pool_(threads), profile_(std::move(profile)) {}

  const std::string& name() const { return name_; }
  ThreadPool& pool() { return pool_; }
  const std::optional<DeviceProfile>& profile() const { return profile_; }

  // Runs one job now (on the calling thread, using the pool) and then waits out the rest of
  // the modelled duration of the cost it reports.
  void execute(const std::function<WorkCost(ThreadPool&)>& job);

  // For jobs that pace themselves (a forward pass paces layer by layer, so a cancel can land
  // between layers and results leave only when the modelled hardware would have them):
  // the modelled duration of `cost` (0 without a profile), and a sleep until start + seconds.
  double modelled_seconds(const WorkCost& cost) const { return profile_ ? profile_->seconds(cost) : 0.0; }
  void pace(std::chrono::steady_clock::time_point start, double seconds);

  // Counters for tests and metrics.
  std::atomic<uint64_t> jobs{0};
  std::atomic<uint64_t> busy_ns{0};      // real compute
  std::atomic<uint64_t> modelled_ns{0};  // what the profile added on top

 private:
  std::string name_;
  ThreadPool pool_;
  std::optional<DeviceProfile> profile_;
};

// A job handed to a device actor: runs with the device's pool and reports its cost.
struct DeviceJob {
  std::function<WorkCost(ThreadPool&)> run;
};
using DeviceJobPtr = std::shared_ptr<DeviceJob>;
using compute_atom = caf::atom_constant<caf::atom("compute")>;

// Spawns the actor that serialises jobs onto `device` (detached: jobs block their thread).
// Messages: (compute_atom, DeviceJobPtr), fire and forget; the job itself sends its results.
caf::actor spawn_device_actor(caf::actor_system& sys, std::shared_ptr<Device> device);

}  // namespace specmesh

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(specmesh::DeviceJobPtr)
