// Locates ../shared/refdata (or $SPECMESH_REFDATA) for tests that need real models.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace specmesh::test {

inline std::string refdata_dir() {
  namespace fs = std::filesystem;
  if (const char* env = std::getenv("SPECMESH_REFDATA"); env && fs::is_directory(env)) return env;
  fs::path p = fs::path(SPECMESH_SOURCE_DIR) / ".." / "shared" / "refdata";
  return fs::is_directory(p) ? fs::canonical(p).string() : std::string();
}

inline std::string refdata(const std::string& rel) { return refdata_dir() + "/" + rel; }

}  // namespace specmesh::test

// Skips the test, loudly, when the reference data is not on this machine.
#define SPECMESH_REQUIRE_REFDATA()                                                              \
  do {                                                                                          \
    if (::specmesh::test::refdata_dir().empty())                                                \
      GTEST_SKIP() << "\n\n*** REFERENCE DATA MISSING: ../shared/refdata not found and "        \
                      "SPECMESH_REFDATA not set; this test did NOT run ***\n";                 \
  } while (0)
