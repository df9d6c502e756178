// Kernel tests run every SIMD path the CPU has: the portable one and, where present, AVX2
// and AVX-512.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "specmesh/kernels/matmul.hpp"

namespace specmesh::test {

// The kernel paths to test on this CPU, the portable one first.
inline std::vector<std::string> isas() {
  std::vector<std::string> v{"scalar"};
  for (const char* isa : {"avx2", "avx512"})
    if (matmul_set_isa(isa)) v.push_back(isa);
  matmul_set_isa(nullptr);
  return v;
}

// A fixture that switches the kernel path and restores the default whatever the test did.
class IsaTest : public ::testing::Test {
 protected:
  void TearDown() override { matmul_set_isa(nullptr); }
  void use(const std::string& isa) {
    ASSERT_TRUE(matmul_set_isa(isa.c_str()));
    ASSERT_EQ(std::string(matmul_isa()), isa);
  }
};

}  // namespace specmesh::test
