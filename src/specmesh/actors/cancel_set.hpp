// The run ids a stage was told to cancel, which its actor (writer, on the priority path) and its
// device jobs (readers, between layers) share.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>

namespace specmesh {

// Bounded: the newest kKeep ids (ids are random and never reused, and a cancel older than that
// many others is long moot). Every byte is allocated up front, so a server that cancels runs all
// day holds the same memory as one that never did: an open-addressing table (linear probing,
// backward-shift deletion) of twice the ids, and a ring of them in arrival order for eviction.
// (std::unordered_set allocated a node per id and freed the oldest's: allocator churn on every
// cancel, and memory that grew until it was full.)
class CancelSet {
 public:
  static constexpr size_t kKeep = 4096;

  void add(uint64_t run);  // run 0 (no run) is never held
  bool contains(uint64_t run) const;

 private:
  static constexpr size_t kSlots = 2 * kKeep;  // a power of two, at most half full
  static size_t home(uint64_t run) { return size_t((run * 0x9E3779B97F4A7C15ull) >> 32) & (kSlots - 1); }
  size_t find(uint64_t run) const;  // its slot, or kSlots
  void erase(uint64_t run);

  mutable std::mutex mu_;
  struct Tables {
    std::array<uint64_t, kSlots> slots{};  // 0: empty
    std::array<uint64_t, kKeep> ring{};    // ids in arrival order from ring[next] when full
  };
  std::unique_ptr<Tables> t_ = std::make_unique<Tables>();
  size_t next_ = 0, size_ = 0;
};

}  // namespace specmesh
