// What the SIMD flash-decode kernels (flash_decode_avx2.cpp, flash_decode_avx512.cpp) share:
// the requests for the rows a thread reads after its current partial (PartialJob::next), how
// they are spread between the partial's multiply-adds, and how heads group by KV head. Included
// by those translation units only. Everything here has internal linkage (an anonymous
// namespace), so each kernel file gets its own copy compiled with its own flags: a shared inline
// function would be merged at link time, and a copy built for AVX-512 could then serve the AVX2
// path.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "specmesh/kernels/flash_decode.hpp"

namespace specmesh::detail {
namespace {

// How many keys of the values pass go by between its asks for the next partial's rows.
constexpr size_t kAskEvery = 4;

// The rows the thread reads after this partial: the bytes [lo, hi) of each key row and of each
// value row, asked for a few cache lines per call: to L2, or to L1 where PartialJob::asks_to_l1
// says so (AMD CPUs). On the Zen 5 machine, whose Zen 4 and later cores take PREFETCHT1 to L2
// but are known to drop some of those requests, asking to L1 took 0.89-0.91x the attention's
// time from memory (bench_attention_memory, old and new builds alternating in both orders,
// 16K keys of an F16 cache; Q8_0 0.80-0.93x); Zen 3 and older take both hints to L1 anyway.
//
// Rows read whole (lo 0, hi the row) whose cells follow one another are one range of bytes: the
// usual case, a sequence's cells in order. Each ask takes the same line of both halves of the
// range, in the key rows and in the value rows: four streams of lines at once. The requests
// hold the core's line fill buffers (16 on the Xeon, about 165 ns each from memory) and are
// what the attention waits for at depth. One process alternating the ways over 22 layers of 16K
// keys (README, Benchmarks), against asking for the key rows and then the value rows a range at
// a time: keys and values together 0.91-0.93x the time, in halves as here 0.90x, in quarters
// 0.95x (and those ranges were 0.97-0.99x of finding each line's row and offset).
struct NextRows {
  const char* base[2];  // key rows, value rows
  const int32_t* cells;
  size_t count, row_bytes, lo, hi;
  size_t row = 0;             // the index into cells of the first row after the current range
  const char* at = nullptr;   // the next line of the range's first half, in the key rows
  const char* vat = nullptr;  // the same line in the value rows
  const char* end = nullptr;  // the end of the first half
  size_t half = 0;            // bytes from a line of the first half to its line in the second
  bool to_l1 = false;         // PREFETCHT0 instead of PREFETCHT1
  // Asks, each for up to four lines, that take every row (at most: fewer when a range joins rows
  // that do not end on a line).
  size_t total() const { return (count * ((hi - lo + 63) / 64) + 1) / 2; }
  void ask(size_t asks) {
    while (asks > 0) {
      if (at >= end && !next_range()) return;
      size_t n = size_t(end - at + 63) / 64;
      if (n > asks) n = asks;
      asks -= n;
      // (A range of an odd number of lines asks for the line after it too: a hint, which
      // never faults, and a test per line here cost 2-3 % of the partial.)
      if (to_l1) lines<true>(n);
      else lines<false>(n);
    }
  }

 private:
  // The next n lines of the range's two halves, in the key rows and in the value rows.
  template <bool ToL1>
  void lines(size_t n) {
    for (; n > 0; --n, at += 64, vat += 64) {
      _mm_prefetch(at, ToL1 ? _MM_HINT_T0 : _MM_HINT_T1);
      _mm_prefetch(vat, ToL1 ? _MM_HINT_T0 : _MM_HINT_T1);
      _mm_prefetch(at + half, ToL1 ? _MM_HINT_T0 : _MM_HINT_T1);
      _mm_prefetch(vat + half, ToL1 ? _MM_HINT_T0 : _MM_HINT_T1);
    }
  }

  // The next range: from `row` on, the rows of consecutive cells when rows are read whole, else
  // one row's [lo, hi). False when every row has been asked for.
  bool next_range() {
    if (row >= count) return false;
    const size_t first = row++;
    if (lo == 0 && hi == row_bytes)
      while (row < count && cells[row] == cells[row - 1] + 1) ++row;
    at = base[0] + size_t(cells[first]) * row_bytes + lo;
    vat = base[1] + size_t(cells[first]) * row_bytes + lo;
    const size_t bytes = size_t(cells[row - 1] - cells[first]) * row_bytes + (hi - lo);
    half = (bytes + 127) / 128 * 64;
    end = at + half;
    return true;
  }
};

// The byte offsets of the job's rows (row_bytes each) into PartialJob::row_off, computed once
// per partial for every pass that reads them: a cell load and a multiply less per key and pass,
// and fewer registers in the loops (the AVX-512 values pass spilled its pointers before).
inline void fill_row_off(const PartialJob& j, size_t row_bytes) {
  for (size_t t = 0; t < j.count; ++t) j.row_off[t] = size_t(j.cells[t]) * row_bytes;
  for (size_t t = j.count; t < row_off_entries(j.count); ++t) j.row_off[t] = j.row_off[j.count - 1];
}

// How many heads from h on read one KV head (the same rows), taken together by the values pass
// (and by the AVX-512 kernel's 8-bit scores): 8, 4, 2 or 1.
inline int kv_run(const PartialJob& j, int h) {
  int run = 1;
  while (h + run < j.n_q && run < 8 && j.head_off[h + run] == j.head_off[h]) ++run;
  return run >= 8 ? 8 : run >= 4 ? 4 : run >= 2 ? 2 : 1;
}

// The runs of heads of one KV head in job j (kv_run): the head steps of the 8-bit scores.
inline size_t kv_runs(const PartialJob& j) {
  size_t n = 0;
  for (int h = 0; h < j.n_q; h += kv_run(j, h)) ++n;
  return n;
}

// Calls f.template operator()<H>(h) for each run of H heads from h on that read one KV head.
template <class F>
[[gnu::always_inline]] inline void for_kv_runs(const PartialJob& j, F&& f) {
  for (int h = 0; h < j.n_q;) {
    const int H = kv_run(j, h);
    if (H == 8) f.template operator()<8>(h);
    else if (H == 4) f.template operator()<4>(h);
    else if (H == 2) f.template operator()<2>(h);
    else f.template operator()<1>(h);
    h += H;
  }
}

// The rows the thread reads after job j, stored as E (the kernel's row type).
template <class E>
NextRows next_rows(const PartialJob& j) {
  NextRows next{{static_cast<const char*>(j.kv->k), static_cast<const char*>(j.kv->v)},
                j.next_cells,
                j.next_count,
                E::bytes(j.kv->row_stride),
                E::bytes(j.span_lo + j.kv_off),
                E::bytes(j.span_hi + j.kv_off)};
  next.to_l1 = j.asks_to_l1;
  return next;
}

// How many of the next partial's asks (NextRows::total) each call takes: half of them spread
// over the `early` calls (the scores' head steps and the softmax's heads), half over the values
// passes, which call every kAskEvery keys. passes(H): the values passes a run of H heads of one
// KV head takes.
struct AskShares {
  size_t early, late;
};
template <class Passes>
AskShares ask_shares(const PartialJob& j, const NextRows& next, size_t early, Passes passes) {
  size_t late = 0;
  for (int h = 0, H; h < j.n_q; h += H) {
    H = kv_run(j, h);
    late += size_t(passes(H)) * ((j.count + kAskEvery - 1) / kAskEvery);
  }
  const size_t half = next.total() / 2;
  return {(half + early - 1) / early, (next.total() - half + late - 1) / late};
}

// key(t) for t = 0, Step, 2 Step .. < count in order (Step 2: a key and the next one at a time),
// taking `per` of the next partial's asks (NextRows) before every kAskEvery keys: one ask and
// one loop test for all of them. Testing per key whether an ask was due (and reloading what the
// test needs) made the values pass a quarter slower on a Zen 3 (136 against 180 TSC ticks per
// key for 32 heads over one 128-key partial) and the AVX-512 one 15-25 % slower on an Intel
// Xeon (README, Benchmarks).
template <size_t Step = 1, class Key>
[[gnu::always_inline]] inline void for_keys_asking(size_t count, NextRows& next, size_t per, Key&& key) {
  static_assert(kAskEvery % Step == 0);
  size_t t = 0;
  for (; t + kAskEvery <= count; t += kAskEvery) {
    next.ask(per);
    for (size_t u = 0; u < kAskEvery; u += Step) key(t + u);
  }
  if (t < count) next.ask(per);
  for (; t < count; t += Step) key(t);
}

}  // namespace
}  // namespace specmesh::detail
