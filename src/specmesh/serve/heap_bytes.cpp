#include "specmesh/serve/heap_bytes.hpp"

#include <dlfcn.h>
#include <malloc.h>

#include <cstddef>

namespace specmesh::serve {

std::optional<uint64_t> heap_allocated_bytes() {
  // Looked up at run time: the library leaves the choice of allocator to the application that
  // embeds it, and links none.
  using Mallctl = int (*)(const char*, void*, std::size_t*, void*, std::size_t);
  static const auto mallctl = reinterpret_cast<Mallctl>(dlsym(RTLD_DEFAULT, "mallctl"));
  if (mallctl != nullptr) {
    // jemalloc's statistics are a snapshot taken when the epoch advances.
    uint64_t epoch = 1;
    std::size_t size = sizeof epoch;
    std::size_t allocated = 0;
    std::size_t asize = sizeof allocated;
    if (mallctl("epoch", &epoch, &size, &epoch, sizeof epoch) == 0 &&
        mallctl("stats.allocated", &allocated, &asize, nullptr, 0) == 0)
      return allocated;
    return std::nullopt;  // built without statistics
  }
  const struct mallinfo2 info = mallinfo2();
  return uint64_t(info.uordblks) + uint64_t(info.hblkhd);
}

}  // namespace specmesh::serve
