// For death-test children that check an input is refused before a huge allocation: caps the
// process's address space a little above what it uses now, so a regression fails with
// std::bad_alloc instead of eating the machine's memory.
#pragma once

#include <sys/resource.h>

#include <fstream>

namespace specmesh::test {

inline void cap_address_space(rlim_t headroom = rlim_t{256} << 20) {
  long pages = 0;
  std::ifstream("/proc/self/statm") >> pages;
  const rlim_t cap = rlim_t(pages) * 4096 + headroom;
  const rlimit lim{cap, cap};
  setrlimit(RLIMIT_AS, &lim);
}

}  // namespace specmesh::test
