#include "specmesh/devices/device.hpp"

#include <chrono>
#include <thread>

#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/spawn_options.hpp>
#include <spdlog/spdlog.h>

namespace specmesh {

void Device::execute(const std::function<WorkCost(ThreadPool&)>& job) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  WorkCost cost = job(pool_);
  busy_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
  ++jobs;
  pace(t0, modelled_seconds(cost));
}

void Device::pace(std::chrono::steady_clock::time_point start, double seconds) {
  if (seconds <= 0) return;
  const auto until = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
  const auto now = std::chrono::steady_clock::now();
  if (until <= now) return;
#ifdef __linux__
  // The default 50 us timer slack would stretch every wait; modelled ops are often shorter.
  thread_local const bool tight = prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0) == 0;
  (void)tight;
#endif
  modelled_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(until - now).count();
  std::this_thread::sleep_until(until);
}

caf::actor spawn_device_actor(caf::actor_system& sys, std::shared_ptr<Device> device) {
  return sys.spawn<caf::detached>([device](caf::event_based_actor* self) -> caf::behavior {
    (void)self;
    return {
        [device](compute_atom, const DeviceJobPtr& job) {
          try {
            device->execute(job->run);
          } catch (const std::exception& e) {
            // A job reports its own failures; this only guards the actor.
            spdlog::error("device {}: job failed: {}", device->name(), e.what());
          }
        },
    };
  });
}

}  // namespace specmesh
