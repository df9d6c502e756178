// Test folders that may hold ipc sockets: the gateway refuses a socket in a directory that
// group or others can use (transport/ipc_dir.hpp), so every level the tests create is 0700.
#pragma once

#include <unistd.h>

#include <stdlib.h>

#include <filesystem>
#include <stdexcept>
#include <string>

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

// A private folder for this test process under the system's temporary directory.
inline std::string private_tmpdir(const std::string& prefix) {
  return private_dir(std::filesystem::temp_directory_path() / (prefix + "-" + std::to_string(::getpid())));
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
