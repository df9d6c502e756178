// Random-weight models of the synthetic presets, for tests that need a real model of a given
// shape but no particular weights.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "specmesh/model/model.hpp"
#include "specmesh/model/synthetic.hpp"

namespace specmesh::test {

// Preset `preset` with weights from `seed`, written and loaded once per test program (the file
// is removed once mapped).
inline std::shared_ptr<const Model> synthetic_model(const std::string& preset, uint64_t seed) {
  static std::mutex mu;
  static std::map<std::pair<std::string, uint64_t>, std::shared_ptr<const Model>> models;
  std::lock_guard<std::mutex> lk(mu);
  std::shared_ptr<const Model>& m = models[{preset, seed}];
  if (!m) {
    SyntheticSpec s = *synthetic_preset(preset);
    s.seed = seed;
    s.n_threads = 1;
    const std::string path = (std::filesystem::temp_directory_path() /
                              ("specmesh-" + preset + "-" + std::to_string(seed) + "-" + std::to_string(::getpid()) + ".gguf"))
                                 .string();
    write_synthetic_model(s, path);
    m = Model::load(path);
    std::filesystem::remove(path);
  }
  return m;
}

}  // namespace specmesh::test
