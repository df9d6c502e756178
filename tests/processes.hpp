// Helpers for tests that run nodes, or the specmesh binary, as child processes of the test binary.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

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

// A live process as /proc shows it.
struct ProcessInfo {
  pid_t pid = 0;
  pid_t ppid = 0;
  char state = '?';         // R, S, T (stopped), Z (zombie), ...
  std::string cmdline;      // arguments joined by spaces
};

// Every process on the machine that `keep` selects, read from /proc.
inline std::vector<ProcessInfo> processes_where(const std::function<bool(const ProcessInfo&)>& keep) {
  std::vector<ProcessInfo> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream st(e.path() / "stat");
    std::string line;
    std::getline(st, line);
    // pid (comm) state ppid ...: comm may hold spaces and parentheses, so parse after the last ')'.
    const auto rp = line.rfind(')');
    if (rp == std::string::npos || rp + 2 > line.size()) continue;
    ProcessInfo p;
    p.pid = std::stoi(name);
    std::istringstream rest(line.substr(rp + 2));
    rest >> p.state >> p.ppid;
    std::ifstream cl(e.path() / "cmdline");
    std::string arg;
    while (std::getline(cl, arg, '\0')) p.cmdline += (p.cmdline.empty() ? "" : " ") + arg;
    if (keep(p)) out.push_back(p);
  }
  return out;
}

// The processes whose parent is this one (the spawned nodes), by pid.
inline std::vector<pid_t> child_processes() {
  std::vector<pid_t> kids;
  for (const ProcessInfo& p : processes_where([](const ProcessInfo& p) { return p.ppid == ::getpid(); })) kids.push_back(p.pid);
  return kids;
}

// Live (not zombie) processes whose command line contains `text`, wherever their parent is.
inline std::vector<ProcessInfo> processes_running(const std::string& text) {
  return processes_where([&](const ProcessInfo& p) {
    return p.state != 'Z' && p.pid != ::getpid() && p.cmdline.find(text) != std::string::npos;
  });
}

// Polls `done` every 20 ms until it holds or `timeout` passes; returns whether it held.
inline bool wait_until(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// Environment variables set for a started process only (name, value).
using EnvVars = std::vector<std::pair<std::string, std::string>>;

// `argv` (found on PATH) started with its stdout and stderr going to `output`, and `env` added
// to its environment.
inline pid_t start_process(const std::vector<std::string>& argv, const std::string& output, const EnvVars& env = {}) {
  std::vector<std::string> copy = argv;
  std::vector<char*> args;
  for (std::string& a : copy) args.push_back(a.data());
  args.push_back(nullptr);
  // The child's environment, built here: between fork and exec a child of this multithreaded
  // process may only call async-signal-safe functions, which setenv is not.
  std::vector<std::string> vars;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string var = *e;
    bool replaced = false;
    for (const auto& [name, value] : env) replaced = replaced || var.rfind(name + "=", 0) == 0;
    if (!replaced) vars.push_back(var);
  }
  for (const auto& [name, value] : env) vars.push_back(name + "=" + value);
  std::vector<char*> envp;
  for (std::string& v : vars) envp.push_back(v.data());
  envp.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(output.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::execvpe(args[0], args.data(), envp.data());
    ::_exit(127);
  }
  return pid;
}

// The specmesh binary started with `args`, its stdout and stderr going to `output`.
inline pid_t start_cli(const std::vector<std::string>& args, const std::string& output, const EnvVars& env = {}) {
  std::vector<std::string> all = {SPECMESH_CLI_PATH};
  all.insert(all.end(), args.begin(), args.end());
  return start_process(all, output, env);
}

// The exit status of child `pid` (128 + the signal when one ended it), or nothing when it is
// still running after `timeout`.
inline std::optional<int> wait_exit(pid_t pid, std::chrono::milliseconds timeout) {
  int status = 0;
  const bool ended = wait_until([&] { return ::waitpid(pid, &status, WNOHANG) == pid; }, timeout);
  if (!ended) return std::nullopt;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// The JSON object a --json run printed: its last line that is one (null when none is).
inline nlohmann::json last_json(const std::string& out) {
  std::istringstream in(out);
  std::string line, json;
  while (std::getline(in, line))
    if (!line.empty() && line[0] == '{') json = line;
  return nlohmann::json::parse(json.empty() ? "null" : json);
}

// A shell command's exit status and standard output (stderr too where the command redirects it).
struct ShellRun {
  int status;
  std::string out;
};
inline ShellRun shell(const std::string& cmd) {
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = ::pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace specmesh::test
