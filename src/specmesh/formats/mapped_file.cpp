#include "specmesh/formats/mapped_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <utility>

namespace specmesh {

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw FormatError(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw FormatError(path + ": not a regular file");
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      throw FormatError(path + ": mmap failed: " + std::strerror(e));
    }
    data_ = static_cast<const uint8_t*>(p);
    mapped_ = true;
  }
  ::close(fd);
}

namespace {
constexpr std::align_val_t kCopyAlignment{64};
}

MappedFile MappedFile::copy_of(std::span<const uint8_t> bytes, std::string name) {
  MappedFile f;
  f.path_ = std::move(name);
  if (!bytes.empty()) {
    auto* p = static_cast<uint8_t*>(::operator new[](bytes.size(), kCopyAlignment));
    std::memcpy(p, bytes.data(), bytes.size());
    f.data_ = p;
    f.size_ = bytes.size();
  }
  return f;
}

void MappedFile::release() noexcept {
  if (!data_) return;
  if (mapped_) ::munmap(const_cast<uint8_t*>(data_), size_);
  else ::operator delete[](const_cast<uint8_t*>(data_), kCopyAlignment);
}

MappedFile::~MappedFile() { release(); }

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    release();
    path_ = std::move(o.path_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    mapped_ = std::exchange(o.mapped_, false);
  }
  return *this;
}

}  // namespace specmesh
