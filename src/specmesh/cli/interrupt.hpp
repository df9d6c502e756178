// SIGINT (Ctrl-C) and SIGTERM while a command (or specmesh-chat) runs a topology. The first
// one cancels the generation being watched, whose tokens so far are then printed as usual and
// whose node processes are stopped in order; before a generation is watched it ends the
// process at once, as does a second signal. Node processes never outlive this one either way (see
// runtime/node_processes.hpp).
#pragma once

#include <signal.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "specmesh/runtime.hpp"

namespace specmesh {

class Interrupts {
 public:
  // Blocks SIGINT and SIGTERM in the calling thread, and so in every thread it starts later,
  // and watches for them on a thread of its own. Create it before the runtime.
  Interrupts();
  // Stops watching and restores the signal mask.
  ~Interrupts();
  Interrupts(const Interrupts&) = delete;
  Interrupts& operator=(const Interrupts&) = delete;

  // The generation the next signal cancels (received() starts again from 0); nullptr: a signal
  // ends the process. A program may watch one generation after another (specmesh-chat).
  void watch(Generation* generation);
  // The signal that cancelled the generation, or 0.
  int received() const { return received_.load(); }

 private:
  void loop();

  sigset_t set_{}, old_{};
  std::mutex mu_;
  Generation* generation_ = nullptr;
  std::atomic<int> received_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace specmesh
