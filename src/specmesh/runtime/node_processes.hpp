// The node processes a runtime starts (`specmesh node --config FILE --name NODE`), and their end.
//
// They never outlive it: they form one process group of their own (so a terminal's Ctrl-C
// reaches the runtime's process, which then stops them in order), each is killed by the kernel
// if the runtime's process dies first (PR_SET_PDEATHSIG; the signal follows the thread that
// forked, so they are forked by a thread that lives as long as this object), and stop() ends
// even frozen ones: SIGTERM and SIGCONT, then SIGKILL after a grace period.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "specmesh/topology.hpp"

namespace specmesh {

class NodeProcesses {
 public:
  NodeProcesses() = default;
  ~NodeProcesses() { stop(); }
  NodeProcesses(const NodeProcesses&) = delete;
  NodeProcesses& operator=(const NodeProcesses&) = delete;

  // Starts every node of `topo` that is neither its head node nor inproc://, from `binary`
  // (default: this executable), passing `port_base` on when it is positive. The topology must
  // come from a file. Throws std::runtime_error; nodes started before a failure keep running
  // until stop(). `extra_args` go to every node (--keys DIR, --allow-remote).
  void start(const Topology& topo, const std::string& binary, int port_base,
             const std::vector<std::string>& extra_args = {});

  // Ends every started node: SIGTERM (and SIGCONT, so a stopped one can act on it), SIGKILL
  // to those still there after `grace`, and reaps them. Idempotent.
  void stop(std::chrono::milliseconds grace = std::chrono::milliseconds(3000));

  const std::vector<pid_t>& pids() const { return pids_; }

 private:
  std::vector<pid_t> pids_;
  pid_t group_ = 0;
  std::thread forker_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool release_ = false;
};

}  // namespace specmesh
