// Run ids: unpredictable, non-zero 64-bit values from the kernel's random source.
//
// A run id names a run on every stage it passes, and a cancel names the runs it drops. Ids
// that count from 1 let any peer cancel runs it has never seen (one forged Cancel for ids
// 1..4096 broke every later run); random ids make a guessed cancel miss with probability
// 1 - n/2^64 for n runs in flight. Id 0 is reserved for messages that belong to no run.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace specmesh {

class RunIds {
 public:
  // The next id; throws std::runtime_error if the kernel refuses random bytes.
  uint64_t next();

 private:
  // getrandom(2) per refill, not per id: one system call serves this many runs.
  std::array<uint64_t, 64> pool_{};
  std::size_t left_ = 0;
};

}  // namespace specmesh
