// Test folders that may hold ipc sockets: the gateway refuses a socket in a directory that
// group or others can use (transport/ipc_dir.hpp), so every level the tests create is 0700.
#pragma once

#include <unistd.h>

#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace specmesh::test {

// Creates `path` (and missing parents, each 0700) and returns it.
inline std::string private_dir(const std::filesystem::path& path) {
  std::filesystem::path p;
  for (const auto& part : path) {
    p /= part;
    if (std::filesystem::exists(p)) continue;
    std::filesystem::create_directory(p);
    std::filesystem::permissions(p, std::filesystem::perms::owner_all);
  }
  std::filesystem::permissions(path, std::filesystem::perms::owner_all);
  return path.string();
}

// The folders private_tmpdir made, removed with everything in them when the test process exits
// (not when a forked child does: it would take its parent's sockets and files away).
struct TmpdirsAtExit {
  const pid_t owner = ::getpid();
  std::vector<std::string> dirs;
  ~TmpdirsAtExit() {
    if (::getpid() != owner) return;
    std::error_code ec;
    for (const std::string& d : dirs) std::filesystem::remove_all(d, ec);
  }
};

// A private folder for this test process under the system's temporary directory, named
// PREFIX-PID, removed when the process exits.
inline std::string private_tmpdir(const std::string& prefix) {
  static TmpdirsAtExit made;
  static std::mutex mu;
  const std::string dir =
      private_dir(std::filesystem::temp_directory_path() / (prefix + "-" + std::to_string(::getpid())));
  std::lock_guard<std::mutex> lk(mu);
  if (std::find(made.dirs.begin(), made.dirs.end(), dir) == made.dirs.end()) made.dirs.push_back(dir);
  return dir;
}

// A fresh private folder (mkdtemp: 0700) named /tmp/specmesh-TAG-XXXXXX, removed with everything
// in it when the object goes.
struct ScopedTempDir {
  std::string path;
  explicit ScopedTempDir(const std::string& tag) {
    std::string tmpl = "/tmp/specmesh-" + tag + "-XXXXXX";
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed for " + tmpl);
    path = tmpl;
  }
  ~ScopedTempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;
};

}  // namespace specmesh::test
