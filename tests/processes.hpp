// Helpers for tests that run nodes as child processes of the test binary.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "specmesh/runtime.hpp"

namespace specmesh::test {

// Runtime options that spawn the out-of-process nodes from the built `specmesh` binary when
// `spawn` is set (the nodes of an inproc-only topology live in the test process anyway).
inline RuntimeOptions node_options(bool spawn) {
  RuntimeOptions o;
  o.spawn_nodes = spawn;
  o.specmesh_binary = SPECMESH_CLI_PATH;
  return o;
}

// The processes whose parent is this one (the spawned nodes), by pid, read from /proc.
inline std::vector<pid_t> child_processes() {
  std::vector<pid_t> kids;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream st(e.path() / "stat");
    std::string line;
    std::getline(st, line);
    // pid (comm) state ppid ...: comm may hold spaces and parentheses, so parse after the last ')'.
    const auto rp = line.rfind(')');
    if (rp == std::string::npos || rp + 2 > line.size()) continue;
    std::istringstream rest(line.substr(rp + 2));
    char state;
    pid_t ppid;
    rest >> state >> ppid;
    if (ppid == ::getpid()) kids.push_back(std::stoi(name));
  }
  return kids;
}

}  // namespace specmesh::test
