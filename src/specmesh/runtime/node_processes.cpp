#include "specmesh/runtime/node_processes.hpp"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <exception>
#include <filesystem>
#include <future>
#include <stdexcept>

namespace specmesh {

namespace {

// The child's side of fork(): async-signal-safe calls only, then exec.
[[noreturn]] void exec_node(char* const* argv, pid_t parent, pid_t group) {
  ::setpgid(0, group);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(1);  // the parent died before the line above
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);  // not the forking thread's blocked signals
  ::execv(argv[0], argv);
  ::_exit(127);
}

}  // namespace

void NodeProcesses::start(const Topology& topo, const std::string& binary, int port_base,
                          const std::vector<std::string>& extra_args) {
  if (!std::filesystem::is_regular_file(topo.path))
    throw std::runtime_error("starting node processes needs the configuration as a topology file (nodes run `specmesh "
                             "node --config FILE`); this one was built in code: " + topo.path);
  std::string bin = binary;
  if (bin.empty()) {
    char buf[4096];
    ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
    if (n <= 0) throw std::runtime_error("cannot find the specmesh binary to start nodes with");
    bin.assign(buf, n);
  }
  // Everything the children need is built before fork: after it, only async-signal-safe calls.
  std::vector<std::string> names;
  std::vector<std::vector<std::string>> args;
  for (const auto& [name, node] : topo.nodes) {
    if (name == topo.head_node || node.endpoint.rfind("inproc://", 0) == 0) continue;
    names.push_back(name);
    args.push_back({bin, "node", "--config", topo.path, "--name", name});
    if (port_base > 0) args.back().insert(args.back().end(), {"--port-base", std::to_string(port_base)});
    args.back().insert(args.back().end(), extra_args.begin(), extra_args.end());
  }
  if (names.empty()) return;
  std::vector<std::vector<char*>> argvs;
  for (auto& a : args) {
    argvs.emplace_back();
    for (std::string& s : a) argvs.back().push_back(s.data());
    argvs.back().push_back(nullptr);
  }
  std::promise<void> started;
  auto done = started.get_future();
  forker_ = std::thread([this, &names, &argvs, &started] {
    try {
      const pid_t parent = ::getpid();
      for (size_t i = 0; i < argvs.size(); ++i) {
        const pid_t pid = ::fork();
        if (pid < 0) throw std::runtime_error("fork failed while starting node '" + names[i] + "'");
        if (pid == 0) exec_node(argvs[i].data(), parent, group_);
        if (group_ == 0) group_ = pid;
        ::setpgid(pid, group_);  // also here: whichever of parent and child runs first
        pids_.push_back(pid);
      }
      started.set_value();
    } catch (...) {
      started.set_exception(std::current_exception());
    }
    // The children's parent-death signal is tied to this thread: it ends only in stop().
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [this] { return release_; });
  });
  done.get();
}

void NodeProcesses::stop(std::chrono::milliseconds grace) {
  if (!pids_.empty()) {
    ::kill(-group_, SIGTERM);
    ::kill(-group_, SIGCONT);
    std::vector<pid_t> left = pids_;
    const auto deadline = std::chrono::steady_clock::now() + grace;
    while (!left.empty()) {
      std::erase_if(left, [](pid_t p) { return ::waitpid(p, nullptr, WNOHANG) != 0; });  // ended, or not ours
      if (left.empty()) break;
      if (std::chrono::steady_clock::now() > deadline) {
        for (pid_t p : left) ::kill(p, SIGKILL);
        for (pid_t p : left) ::waitpid(p, nullptr, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    pids_.clear();
  }
  if (forker_.joinable()) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      release_ = true;
    }
    cv_.notify_all();
    forker_.join();
  }
}

}  // namespace specmesh
