// The chat-template test data: the families' templates, the cases and jinja2's renders of them
// (tests/data/chat-templates, made by its make_expected.py).
#pragma once

#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

namespace specmesh::test {

inline const std::filesystem::path kTemplateData =
    std::filesystem::path(SPECMESH_SOURCE_DIR) / "tests" / "data" / "chat-templates";

// A file's bytes; throws naming the file when it cannot be read.
inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + p.string());
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace specmesh::test
