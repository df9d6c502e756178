#include "specmesh/actors/run_ids.hpp"

#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace specmesh {

uint64_t RunIds::next() {
  for (;;) {
    if (left_ == 0) {
      auto* p = reinterpret_cast<unsigned char*>(pool_.data());
      std::size_t need = sizeof pool_, got = 0;
      while (got < need) {
        const ssize_t n = ::getrandom(p + got, need - got, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) throw std::runtime_error(std::string("run ids: getrandom failed: ") + std::strerror(errno));
        got += std::size_t(n);
      }
      left_ = pool_.size();
    }
    const uint64_t id = pool_[--left_];
    if (id != 0) return id;
  }
}

}  // namespace specmesh
