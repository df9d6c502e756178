// What the SIMD flash-decode kernels (flash_decode_avx2.cpp, flash_decode_avx512.cpp) share:
// the requests for the rows a thread reads after its current partial (PartialJob::next), spread
// between the partial's multiply-adds, and how heads group by KV head. Included by those
// translation units only. Everything here has internal linkage (an anonymous namespace), so each
// kernel file gets its own copy compiled with its own flags: a shared inline function would be
// merged at link time, and a copy built for AVX-512 could then serve the AVX2 path.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "specmesh/kernels/flash_decode.hpp"

namespace specmesh::detail {
namespace {

// How many keys of the values pass go by between its asks for the next partial's rows.
constexpr size_t kAskEvery = 4;

// The rows the thread reads after this partial: the bytes [lo, hi) of each key row, then of
// each value row, asked for to L2 a few cache lines per call.
struct NextRows {
  const char* base[2];  // key rows, value rows
  const int32_t* cells;
  size_t count, row_bytes, lo, hi;
  int which = 0;     // 0: key rows, 1: value rows, 2: done
  size_t row = 0;    // the next row's index into cells
  size_t at = 0;     // the next line's byte offset within it
  size_t total() const { return 2 * count * ((hi - lo + 63) / 64); }
  void ask(size_t lines) {
    if (count == 0) return;
    for (; lines > 0 && which < 2; --lines) {
      _mm_prefetch(base[which] + size_t(cells[row]) * row_bytes + lo + at, _MM_HINT_T1);
      if ((at += 64) < hi - lo) continue;
      at = 0;
      if (++row == count) row = 0, ++which;
    }
  }
};

// How many heads from h on read one KV head (the same rows), taken together by the values pass
// (and by the AVX-512 kernel's 8-bit scores): 8, 4, 2 or 1.
inline int kv_run(const PartialJob& j, int h) {
  int run = 1;
  while (h + run < j.n_q && run < 8 && j.head_off[h + run] == j.head_off[h]) ++run;
  return run >= 8 ? 8 : run >= 4 ? 4 : run >= 2 ? 2 : 1;
}

}  // namespace
}  // namespace specmesh::detail
