// Flash decode: attention of one decode token over a long KV list, computed as partials over
// fixed key ranges and merged once, plus the speculative variant used by ALSpec.
//
// A partial over a key range K is (O, m, l) per query head: m = max_{k in K} s_k,
// l = sum e^(s_k - m), O = sum e^(s_k - m) v_k (unnormalised), with s_k = scale * (q . k_k).
// The output is O / l of the merge of all partials.
//
// Layout. The keys are the entries 0..n-1 of a visible-cell list (for one sequence, positions
// 0..cur_pos, so n = cur_pos + 1). With S = spec_len and P = roundup(n, tile):
//   sink   = [0, S)                 first S keys
//   window = [P - S, P)             the tile-aligned last S; entries >= n are masked out, so
//                                   it holds between S - tile + 1 and S real keys
//   middle = [S, P - S)             in chunks of `chunk`, the last one shorter
// The speculative partial merges sink and window; the full output merges the speculative
// partial with the middle chunks, so the speculative work is part of the full result.
// When n < 2S the sink and the window would overlap: then sink = [0, min(n, S)),
// window = [S, n) and there is no middle, i.e. the speculative output is exact attention.
//
// Determinism. The key ranges depend only on n and the layout; each partial is computed by
// one thread with a fixed order; partials are merged in slot order by one routine. So the
// result does not depend on the thread count, nor on which heads go through one call (a head
// alone, a KV head's group, the whole layer, or the heads of several tokens), and plain
// flash_decode gives bit for bit the full output of speculative_flash_decode and what
// flash_decode_rows gives each of its tokens.
#pragma once

#include <cstddef>
#include <functional>
#include <cstdint>
#include <vector>

#include "specmesh/kernels/kv_rows.hpp"

namespace specmesh {

class ThreadPool;

struct HeadShape {
  int n_head;     // query heads
  int n_head_kv;  // KV heads; n_head is a multiple of it (GQA)
  int head_dim;
};

struct FlashLayout {
  size_t spec_len = 128;  // S: sink length and window length
  // Length of a middle chunk. Each is one partial: fewer, longer ones spend less on what every
  // partial costs (the queries rounded or quantised, the row offsets, a slot to merge, a claim
  // on the pool). 16K keys of an F16 cache on the Zen 5 machine, 256 against 128, old and new
  // builds alternating (bench_attention_memory): from memory 0.59-0.69 against 0.69-0.78 ms a
  // layer, in cache 0.49-0.56 against 0.57-0.67; Q8_0 0.61 / 0.67 against 0.66 / 0.75; the
  // AVX2 path 1.32 / 1.46 against 1.58 / 1.46. 512 was no faster from memory. Fewer partials
  // leave the threads less to even out at short contexts: at 1K, 2K and 4K keys 256 was as fast
  // as 128 on two threads (22 layers, three alternations each), and 128 again for a middle below
  // 64 chunks was no faster at 2K.
  size_t chunk = 256;
  size_t tile = 32;       // the window ends at n rounded up to this
  // Each thread asks for the rows of its next partial while it computes one (off only to
  // measure what the asks give and cost: bench_attention_memory).
  bool ask_ahead = true;
};

// Key ranges of one decode step, as indices into the cell list.
struct FlashPlan {
  size_t n = 0;
  size_t chunk = 0;
  bool exact = false;       // n < 2S: the speculative region is every key
  size_t sink_end = 0;      // sink keys [0, sink_end)
  size_t window_begin = 0;  // real window keys [window_begin, n)
  // Middle keys [sink_end, window_begin) in chunks.
  size_t n_middle() const { return (window_begin - sink_end + chunk - 1) / chunk; }
  // Partial slots: 0 sink, 1 window, 2 speculative (merge of 0 and 1), 3.. middle chunks.
  size_t n_slots() const { return 3 + n_middle(); }
  // Key range [begin, end) computed into `slot` (empty for slot 2).
  void slot_keys(size_t slot, size_t& begin, size_t& end) const;
};

// Throws std::invalid_argument for a zero spec_len, chunk or tile.
FlashPlan flash_plan(size_t n, const FlashLayout& layout);

// Partials of n_q query heads over a number of slots. Slot s, head h: O at o[(s*n_q + h)*D],
// m and l at [s*n_q + h]. An empty partial has m = -inf, l = 0, O = 0.
struct FlashPartials {
  int n_q = 0;
  int head_dim = 0;
  std::vector<float> o, m, l;
  void reset(size_t slots, int n_q, int head_dim);
  float* o_at(size_t slot, int h) { return o.data() + (slot * n_q + h) * size_t(head_dim); }
  const float* o_at(size_t slot, int h) const { return o.data() + (slot * n_q + h) * size_t(head_dim); }
  size_t at(size_t slot, int h) const { return slot * n_q + h; }
};

// Writes the partials of query heads q[0..n_q) (head h at q + h*head_dim, reading KV head
// h / group at offset kv_off + (h / group) * head_dim of each row) over the cells
// cells[0..count) into `slot` of `out` (which must have n_q heads). Uses the SIMD path that
// matmul uses (see matmul_isa()).
void flash_partial(const float* q, int n_q, int group, const KvRows& kv, size_t kv_off, float scale,
                   const int32_t* cells, size_t count, FlashPartials& out, size_t slot);
// The same for query heads that span several tokens: head h reads KV head (h / group) % n_kv
// and is written to head head0 + h of `out`. `next` and `next_count` name the cells the calling
// thread reads after this partial, whose rows may be asked for while it computes (a hint: the
// result is the same without it). `queries` names the values at q for the caller
// (flash_queries_id): a thread's partials in a row with the same nonzero name share work that
// depends only on them (a Q8_0 cache's quantised queries); 0 shares nothing.
void flash_partial(const float* q, int n_q, int group, int n_kv, const KvRows& kv, size_t kv_off, float scale,
                   const int32_t* cells, size_t count, FlashPartials& out, size_t slot, int head0,
                   const int32_t* next = nullptr, size_t next_count = 0, uint64_t queries = 0);
// `n` names for queries that no other call has named, the first of them returned.
uint64_t flash_queries_id(size_t n = 1);

// Whether attention over rows of `type` with heads of head_dim values multiplies in bf16 on the
// current path: F16 rows on the AVX-512 path of a CPU with AVX-512 BF16 (matmul_bf16_dot), head
// sizes a multiple of 64. Each product's two factors are then rounded to bf16 (nearest even): a
// query value and a key value in the scores, a softmax weight and a value in the outputs, with
// every sum in f32. That is the precision of a BF16 KV cache (the usual one of GPU serving,
// e.g. vLLM's default for bf16 models), at half the instructions of widening to f32, which
// decode at depth was bound by (README, Benchmarks). Deterministic and batch invariant
// as every path; the bound the rounding keeps to is tested (test_flash_decode).
bool flash_bf16_products(DType type, int head_dim);

// Merges slots [s0, s1) of head h into (o[head_dim], m, l): the maximum over all slots first,
// then each slot scaled once by e^(m_s - m) and summed in slot order. Empty slots add nothing.
void flash_combine(const FlashPartials& p, size_t s0, size_t s1, int h, float* o, float& m, float& l);

// Full attention of one decode token, every head of one layer: q holds n_head * head_dim
// values, out the same. Partials are split across `pool` (nullptr: this thread only). For a
// subset of heads, point q, out and the KV rows at them and pass their shape: each head's
// result is the same as in the whole layer.
void flash_decode(const float* q, const HeadShape& hs, float scale, const KvRows& kv, const int32_t* cells,
                  size_t n, float* out, const FlashLayout& layout = {}, ThreadPool* pool = nullptr);

// Full attention of `rows` tokens of one layer, token r over its own cells[r][0..n[r]) (q and
// out hold n_head * head_dim values per token, token after token): for every token bit for bit
// what flash_decode gives it alone. Consecutive tokens whose sink and middle key ranges hold
// the same cells compute those partials together, reading each key and value once for all.
void flash_decode_rows(const float* q, const HeadShape& hs, float scale, const KvRows& kv,
                       const int32_t* const* cells, const size_t* n, size_t rows, float* out,
                       const FlashLayout& layout = {}, ThreadPool* pool = nullptr);

struct SpecConfig {
  FlashLayout layout;
  float lambda = 0.1f;
};

// The check of one (token, layer), over the whole layer output (all heads together):
// d2 = ||spec - full||^2, n2 = ||full||^2, both summed in fp32 in head-major order.
struct SpecCheck {
  float d2 = 0;
  float n2 = 0;
  bool exact = false;   // n < 2S: spec is the full output, bit for bit
  bool accept = false;  // exact, or spec_accept(d2, n2, lambda)
};

// ||spec - full|| < lambda ||full||, decided as d2 < lambda^2 n2 in fp32. Strict, so
// lambda = 0 accepts nothing. Under tensor parallelism, sum d2 and n2 over the group first.
bool spec_accept(float d2, float n2, float lambda);

// Speculative flash decode: full output and speculative output (sink + window) of every head
// in one pass, and the fused check. An exact step (n < 2S) counts as accepted whatever lambda
// is, since taking the speculative output then changes nothing. The sink and window partials
// are computed first; `spec_ready`, when given, is called with `spec` complete before the
// middle chunks are, so a caller can ship the speculative output while the full one is still
// being computed (the numbers are the same either way).
SpecCheck speculative_flash_decode(const float* q, const HeadShape& hs, float scale, const KvRows& kv,
                                   const int32_t* cells, size_t n, float* full, float* spec,
                                   const SpecConfig& cfg = {}, ThreadPool* pool = nullptr,
                                   const std::function<void()>& spec_ready = {});

namespace detail {

// One partial computation; shared by the portable and the SIMD translation units. Every kernel
// reads the rows in place: the SIMD ones F32, F16 and Q8_0 (block-aligned heads), the portable
// one any type, which serves the rest (flash_decode.cpp).
struct PartialJob {
  const float* q;
  int n_q;
  int group;
  const KvRows* kv;
  size_t kv_off;  // values into each row, kv->offset included
  const size_t* head_off;  // per query head: kv_off-relative offset of its KV head in a row
  size_t span_lo, span_hi;  // the values of a row the heads read: [span_lo, span_hi) after kv_off
  int head_dim;
  float scale;
  const int32_t* cells;
  size_t count;    // >= 1
  float* o;        // n_q * head_dim, head-major
  float* m;        // n_q
  float* l;        // n_q
  float* scores;   // scratch: n_q * score_stride(count) floats (the portable kernel packs tighter)
  float* key_block;  // scratch: 16 keys of the row span the heads read (SIMD kernels)
  // The cells this thread reads next (a prefetch hint; none when next_count is 0).
  const int32_t* next_cells;
  size_t next_count;
  // Ask for them to L1 rather than L2 (flash_simd_shared.hpp, NextRows).
  bool asks_to_l1 = false;
  // Scratch for the queries quantised to 8 bits: q8_scratch_floats(n_q, head_dim) floats, set
  // when a SIMD kernel reads Q8_0 rows (their scores are 8-bit dot products).
  float* q8 = nullptr;
  // q8 already holds these queries quantised (the thread's previous partial had the same ones).
  bool q8_ready = false;
  // Scratch for row_off_entries(count) byte offsets of the cells' rows (the SIMD kernels).
  size_t* row_off = nullptr;
  // Set for F16 rows where the products are bf16 (flash_bf16_products): scratch for the
  // queries rounded to bf16, n_q * head_dim values. Null otherwise.
  uint16_t* qh = nullptr;
};

// Entries of PartialJob::row_off: one per key and, repeated, the last for kRowOffPad keys past
// it, so a kernel reads that far ahead without a test: a block of 8 or 16 keys that the last
// key ends early fills its spare lanes from the last row (the softmax masks their scores),
// and the values pass asks for rows kAhead keys ahead.
constexpr size_t kRowOffPad = 16;
constexpr size_t row_off_entries(size_t count) { return count + kRowOffPad; }

constexpr size_t q8_scratch_floats(int n_q, int head_dim) {
  return size_t(n_q) * size_t(head_dim) / 4 + 2 * size_t(n_q) * size_t(head_dim) / 32;
}

// The stride of PartialJob::scores: kScoreRows for up to that many keys (the default chunk, so
// that the kernels see one constant stride), else count rounded up to 16.
constexpr size_t kScoreRows = 256;
constexpr size_t score_stride(size_t count) { return count <= kScoreRows ? kScoreRows : (count + 15) / 16 * 16; }

void flash_partial_avx2(const PartialJob& job);    // head_dim a multiple of 8; Q8_0 block-aligned, with q8 set
void flash_partial_avx512(const PartialJob& job);  // head_dim a multiple of 64; Q8_0 block-aligned, with q8 set

}  // namespace detail

}  // namespace specmesh
