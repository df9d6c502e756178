#include "specmesh/kernels/aligned_buffer.hpp"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>

namespace specmesh {

AlignedBuffer::AlignedBuffer(size_t bytes, bool zero) : bytes_(bytes) {
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t align = bytes >= kHuge ? kHuge : 64;
  const size_t total = (bytes + align - 1) / align * align;  // aligned_alloc wants a multiple
  data_.reset(static_cast<uint8_t*>(std::aligned_alloc(align, total > 0 ? total : align)));
  if (!data_) throw std::bad_alloc();
  if (align == kHuge) madvise(data_.get(), total, MADV_HUGEPAGE);  // a hint; fine to fail
  std::memset(data_.get() + (zero ? 0 : bytes), 0, total - (zero ? 0 : bytes));
}

void AlignedBuffer::Free::operator()(uint8_t* p) const { std::free(p); }

}  // namespace specmesh
