// Two network namespaces joined by a veth pair, for tests that run nodes on "different hosts".
// Needs root and iproute2's `ip`; when either is missing, or the kernel refuses namespaces
// here, `unavailable` says why and nothing is left behind. Names carry the pid and a counter so
// parallel test programs never share one; everything is removed in the destructor, which runs
// on test failures too (processes a test starts inside must be ended by the test, by pid).
#pragma once

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

namespace specmesh::test {

class NetnsPair {
 public:
  std::string a, b;            // namespace names
  std::string addr_a, addr_b;  // their addresses on the veth pair (10.77.X.1 and 10.77.X.2, /24)
  std::string unavailable;     // why the pair could not be made; empty when it is there

  NetnsPair() {
    static std::atomic<int> n{0};
    const std::string tag = std::to_string(::getpid()) + "-" + std::to_string(n++);
    a = "specmesh-a-" + tag;
    b = "specmesh-b-" + tag;
    // Interface names have at most 15 characters.
    const std::string short_tag = std::to_string(::getpid() % 100000) + std::to_string(n.load() % 10);
    veth_a_ = "smva" + short_tag;
    veth_b_ = "smvb" + short_tag;
    const std::string net = "10.77." + std::to_string(::getpid() % 250) + ".";
    addr_a = net + "1";
    addr_b = net + "2";
    unavailable = missing_prerequisite();
    if (!unavailable.empty()) return;
    const std::vector<std::vector<std::string>> steps = {
        {"ip", "netns", "add", a},
        {"ip", "netns", "add", b},
        {"ip", "link", "add", veth_a_, "type", "veth", "peer", "name", veth_b_},
        {"ip", "link", "set", veth_a_, "netns", a},
        {"ip", "link", "set", veth_b_, "netns", b},
        {"ip", "-n", a, "addr", "add", addr_a + "/24", "dev", veth_a_},
        {"ip", "-n", b, "addr", "add", addr_b + "/24", "dev", veth_b_},
        {"ip", "-n", a, "link", "set", "lo", "up"},
        {"ip", "-n", b, "link", "set", "lo", "up"},
        {"ip", "-n", a, "link", "set", veth_a_, "up"},
        {"ip", "-n", b, "link", "set", veth_b_, "up"},
    };
    made_any_ = true;
    unavailable = run_steps(steps);
    if (!unavailable.empty()) cleanup();
  }
  ~NetnsPair() { cleanup(); }
  NetnsPair(const NetnsPair&) = delete;
  NetnsPair& operator=(const NetnsPair&) = delete;

  // argv prefix that runs a command inside namespace `ns`.
  static std::vector<std::string> in(const std::string& ns) { return {"ip", "netns", "exec", ns}; }

  // Why namespaces cannot be made here (not root, no `ip`), or empty.
  static std::string missing_prerequisite() {
    if (::geteuid() != 0) return "not running as root (network namespaces need CAP_SYS_ADMIN)";
    if (!run({"ip", "-V"})) return "iproute2's `ip` is not installed";
    return {};
  }

  // Runs the commands in order; empty when all succeed, else which one failed.
  static std::string run_steps(const std::vector<std::vector<std::string>>& steps) {
    for (const auto& s : steps)
      if (!run(s)) {
        std::string cmd;
        for (const auto& w : s) cmd += (cmd.empty() ? "" : " ") + w;
        return "`" + cmd + "` failed (no permission for network namespaces here?)";
      }
    return {};
  }

  // Runs argv (found on PATH) quietly; true when it exits 0.
  static bool run(const std::vector<std::string>& argv) {
    std::vector<std::string> copy = argv;
    std::vector<char*> args;
    for (auto& s : copy) args.push_back(s.data());
    args.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) return false;
    if (pid == 0) {
      const int devnull = ::open("/dev/null", O_WRONLY);
      ::dup2(devnull, 1);
      ::dup2(devnull, 2);
      ::execvp(args[0], args.data());
      ::_exit(127);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }


 private:
  void cleanup() {
    // Deleting a namespace deletes the veth end in it, and with it the pair.
    if (made_any_) {
      run({"ip", "netns", "del", a});
      run({"ip", "netns", "del", b});
      run({"ip", "link", "del", veth_a_});
    }
    made_any_ = false;
  }

  std::string veth_a_, veth_b_;
  bool made_any_ = false;
};

// One namespace joined to this process's own by a veth pair: a "remote host" whose link the
// test can cut (link_down) and mend (link_up) while the processes on both sides keep running.
class NetnsHost {
 public:
  std::string ns;
  std::string addr_here, addr_there;  // 10.78.X.1 (this namespace) and 10.78.X.2 (ns), /24
  std::string unavailable;

  NetnsHost() {
    static std::atomic<int> n{0};
    const int k = n++;
    ns = "specmesh-h-" + std::to_string(::getpid()) + "-" + std::to_string(k);
    const std::string tag = std::to_string(::getpid() % 100000) + std::to_string(k % 10);
    veth_here_ = "smhh" + tag;
    veth_there_ = "smht" + tag;
    const std::string net = "10.78." + std::to_string((::getpid() + k) % 250) + ".";
    addr_here = net + "1";
    addr_there = net + "2";
    unavailable = NetnsPair::missing_prerequisite();
    if (!unavailable.empty()) return;
    const std::vector<std::vector<std::string>> steps = {
        {"ip", "netns", "add", ns},
        {"ip", "link", "add", veth_here_, "type", "veth", "peer", "name", veth_there_},
        {"ip", "link", "set", veth_there_, "netns", ns},
        {"ip", "addr", "add", addr_here + "/24", "dev", veth_here_},
        {"ip", "-n", ns, "addr", "add", addr_there + "/24", "dev", veth_there_},
        {"ip", "-n", ns, "link", "set", "lo", "up"},
        {"ip", "link", "set", veth_here_, "up"},
        {"ip", "-n", ns, "link", "set", veth_there_, "up"},
    };
    made_ = true;
    unavailable = NetnsPair::run_steps(steps);
    if (!unavailable.empty()) cleanup();
  }
  ~NetnsHost() { cleanup(); }
  NetnsHost(const NetnsHost&) = delete;
  NetnsHost& operator=(const NetnsHost&) = delete;

  bool link_down() { return NetnsPair::run({"ip", "link", "set", veth_here_, "down"}); }
  bool link_up() { return NetnsPair::run({"ip", "link", "set", veth_here_, "up"}); }

 private:
  void cleanup() {
    if (made_) {
      NetnsPair::run({"ip", "netns", "del", ns});
      NetnsPair::run({"ip", "link", "del", veth_here_});
    }
    made_ = false;
  }
  std::string veth_here_, veth_there_;
  bool made_ = false;
};

}  // namespace specmesh::test
