#include "specmesh/kernels/flash_decode.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "specmesh/kernels/aligned_buffer.hpp"
#include "specmesh/kernels/matmul.hpp"
#include "specmesh/kernels/thread_pool.hpp"

#if defined(__x86_64__) || defined(__i386__)
#define SPECMESH_HAVE_AVX2_TU 1
#endif

namespace specmesh {

namespace {

size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

// Portable path: a fixed summation order per head, the same for any head grouping.
float dot_scalar(const float* a, const float* b, int n) {
  float s[8] = {};
  for (int i = 0; i < n; ++i) s[i & 7] += a[i] * b[i];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// Reads every stored type: each key's and value's span of the row is widened in turn into a
// buffer of one row (F16 exactly, Q8_0 as d * q, as kv_load does), so the result is what the
// same sums over F32 rows of the widened values give, and no copy of the job's rows is made.
void partial_scalar(const detail::PartialJob& j) {
  const int D = j.head_dim;
  const size_t ld = round_up(j.count, 8);
  const size_t lo = j.span_lo, width = j.span_hi - j.span_lo;
  const auto* keys = static_cast<const uint8_t*>(j.kv->k);
  const auto* values = static_cast<const uint8_t*>(j.kv->v);
  const size_t row_bytes = j.kv->row_bytes();
  thread_local std::vector<float> row;
  row.resize(width);
  for (size_t t = 0; t < j.count; ++t) {
    kv_load(j.kv->type, keys + size_t(j.cells[t]) * row_bytes, j.kv_off + lo, width, row.data());
    for (int h = 0; h < j.n_q; ++h)
      j.scores[h * ld + t] = dot_scalar(j.q + size_t(h) * D, row.data() + (j.head_off[h] - lo), D) * j.scale;
  }
  for (int h = 0; h < j.n_q; ++h) {
    float* s = j.scores + h * ld;
    const float m = *std::max_element(s, s + j.count);
    float l = 0;
    for (size_t t = 0; t < j.count; ++t) {
      s[t] = std::exp(s[t] - m);
      l += s[t];
    }
    j.m[h] = m;
    j.l[h] = l;
  }
  std::fill(j.o, j.o + size_t(j.n_q) * D, 0.0f);
  for (size_t t = 0; t < j.count; ++t) {
    kv_load(j.kv->type, values + size_t(j.cells[t]) * row_bytes, j.kv_off + lo, width, row.data());
    for (int h = 0; h < j.n_q; ++h) {
      const float w = j.scores[h * ld + t];
      const float* v = row.data() + (j.head_off[h] - lo);
      float* o = j.o + size_t(h) * D;
      for (int d = 0; d < D; ++d) o[d] += w * v[d];
    }
  }
}

// A thread's scratch of at least n floats, 64-byte aligned so that whole-register loads never
// straddle cache lines.
float* scratch(AlignedBuffer& buf, size_t n) {
  if (buf.size() < n * sizeof(float)) buf = AlignedBuffer(n * sizeof(float), false);
  return reinterpret_cast<float*>(buf.data());
}

bool use_avx2() {
#ifdef SPECMESH_HAVE_AVX2_TU
  return matmul_isa_has_avx2();
#else
  return false;
#endif
}


// Multiply-adds below which waking the pool costs more than it saves.
constexpr size_t kSmallWork = size_t(1) << 16;

bool use_pool(ThreadPool* pool, size_t work) { return pool != nullptr && pool->size() > 1 && work >= kSmallWork; }

constexpr size_t kNoSlot = size_t(-1);

// Runs fn(i, then) for i in [0, count), over the pool or all here, where `then` is the index the
// same thread runs next (kNoSlot for its last), so that fn can ask for its data early. The
// threads take the items from a shared counter one at a time, each claiming its next before it
// computes its current one: a thread slowed down (a busy neighbour on a shared core) computes
// fewer items instead of keeping the other waiting at the end, as contiguous halves did (22
// layers of 16K keys on a loaded Xeon, both ways alternating: 0.84x the time per layer with an
// F16 cache, 0.92x with Q8_0; whole Q4_0 decode steps at 16K keys on a quieter one, three runs:
// 0.92-0.99x, and 0.99x at 4K and 512). Which thread computes an item does not change its
// result. (Matmul tiles taken the same way, in pieces of an eighth, were 2-4 % slower: a piece
// boundary stops the kernel asking for the next tile's rows early.)
template <class Fn>
void run_each(size_t count, bool threaded, ThreadPool* pool, const Fn& fn) {
  if (!threaded) {
    for (size_t i = 0; i < count; ++i) fn(i, i + 1 < count ? i + 1 : kNoSlot);
    return;
  }
  std::atomic<size_t> next{0};
  pool->run([&](int, int) {
    size_t i = next.fetch_add(1, std::memory_order_relaxed);
    while (i < count) {
      const size_t then = next.fetch_add(1, std::memory_order_relaxed);
      fn(i, then < count ? then : kNoSlot);
      i = then;
    }
  });
}

// Writes normalised o / l to out (zeros for an empty partial).
void normalise(const float* o, float l, int D, float* out) {
  if (l > 0) {
    for (int d = 0; d < D; ++d) out[d] = o[d] / l;
  } else {
    std::fill(out, out + D, 0.0f);
  }
}

// Heads [h0, h1) of slots [s0, s1) merged (flash_combine) into o[(h - h0) * D], m[h - h0] and
// l[h - h0]: the maximum over the slots first, then each slot scaled once by e^(m_s - m) and
// summed in slot order, every head on its own, so its bits do not depend on which heads share
// the call. The sums go slot by slot, each slot's heads in turn: a slot keeps its heads'
// outputs together (FlashPartials), so the heads' share of a slot is one run of bytes, where
// going head by head read 256 bytes 8 KiB apart (32 heads of 64). Merging 129 slots of 32
// heads (16K keys; about half of the slots written by the other core), both ways alternating
// call by call in one process (`bench_attention_memory --layers 40`, four runs of 30 rounds):
// 0.066-0.102 ms against 0.082-0.149 ms a call, 0.68-0.81x.
void combine_slots(const FlashPartials& p, size_t s0, size_t s1, int h0, int h1, float* o, float* m, float* l) {
  const int D = p.head_dim, H = h1 - h0;
  for (int i = 0; i < H; ++i) m[i] = -INFINITY, l[i] = -1;  // l < 0: no term yet
  for (size_t s = s0; s < s1; ++s)
    for (int i = 0; i < H; ++i) {
      const size_t a = p.at(s, h0 + i);
      if (p.l[a] > 0) m[i] = std::max(m[i], p.m[a]);
    }
  for (size_t s = s0; s < s1; ++s)
    for (int i = 0; i < H; ++i) {
      const size_t a = p.at(s, h0 + i);
      if (!(p.l[a] > 0)) continue;  // empty: m = -inf would make e^(m_s - m) NaN
      const float w = std::exp(p.m[a] - m[i]);
      const float* os = p.o_at(s, h0 + i);
      float* oi = o + size_t(i) * size_t(D);
      // The first term is assigned, not added to zero, so a lone partial passes through bit for bit.
      if (l[i] < 0) {
        for (int d = 0; d < D; ++d) oi[d] = w * os[d];
        l[i] = w * p.l[a];
      } else {
        for (int d = 0; d < D; ++d) oi[d] += w * os[d];
        l[i] += w * p.l[a];
      }
    }
  for (int i = 0; i < H; ++i)
    if (l[i] < 0) {
      std::fill(o + size_t(i) * size_t(D), o + size_t(i + 1) * size_t(D), 0.0f);
      l[i] = 0;
    }
}

// Heads [h0, h1) of `parts`: the speculative partial (slot 2) from the sink and the window, and
// its normalised output to spec[(h - h0) * D] when spec is given.
void merge_spec(FlashPartials& parts, int h0, int h1, float* spec) {
  const int D = parts.head_dim;
  const size_t a = parts.at(2, h0);  // slot 2's heads are consecutive, as every slot's
  combine_slots(parts, 0, 2, h0, h1, parts.o_at(2, h0), parts.m.data() + a, parts.l.data() + a);
  if (spec == nullptr) return;
  for (int h = h0; h < h1; ++h) normalise(parts.o_at(2, h), parts.l[parts.at(2, h)], D, spec + size_t(h - h0) * D);
}

// Every head's full output, slot 2 merged with the middle slots, to full[h * D]; split by heads
// over the pool when the merge is worth it by the same measure as the sweep (the workers are
// still spinning from that sweep, so handing them half costs no wake-up; a short context's
// three slots stay on this thread).
void merge_full(const FlashPartials& parts, size_t n_slots, float* full, ThreadPool* pool) {
  const int D = parts.head_dim;
  auto heads = [&](size_t h0, size_t h1) {
    thread_local std::vector<float> m, l;
    m.resize(h1 - h0);
    l.resize(h1 - h0);
    float* out = full + h0 * size_t(D);
    combine_slots(parts, 2, n_slots, int(h0), int(h1), out, m.data(), l.data());
    for (size_t i = 0; i < h1 - h0; ++i) normalise(out + i * size_t(D), l[i], D, out + i * size_t(D));
  };
  if (use_pool(pool, n_slots * size_t(parts.n_q) * size_t(D))) pool->parallel_for(size_t(parts.n_q), heads);
  else heads(0, size_t(parts.n_q));
}

// Flash decode of heads q[0..n_q): full output always, speculative output when spec != null.
void decode_heads(const float* q, int n_q, int group, const KvRows& kv, size_t kv_off, int D, float scale,
                  const int32_t* cells, size_t n, float* full, float* spec, const FlashLayout& layout,
                  ThreadPool* pool, const std::function<void()>& spec_ready = {}) {
  const FlashPlan plan = flash_plan(n, layout);
  // A named reference, so that pool workers use this thread's buffer and not their own.
  thread_local FlashPartials tls_parts;
  FlashPartials& parts = tls_parts;
  parts.reset(plan.n_slots(), n_q, D);
  const bool threaded = use_pool(pool, n * size_t(n_q) * size_t(D));
  const uint64_t queries = flash_queries_id();
  // Item i of a sweep computes slot slot_of(i); `then` is the item its thread computes next.
  auto compute = [&](auto slot_of, size_t i, size_t then) {
    size_t b, e, nb = 0, ne = 0;
    plan.slot_keys(slot_of(i), b, e);
    if (then != kNoSlot && layout.ask_ahead) plan.slot_keys(slot_of(then), nb, ne);
    flash_partial(q, n_q, group, n_q / group, kv, kv_off, scale, cells + b, e - b, parts, slot_of(i), 0, cells + nb,
                  ne - nb, queries);
  };

  // Slots 0 (sink) and 1 (window) make the speculative partial in slot 2; slots 3.. are the
  // middle. When someone waits for the speculative output it is finished first, on its own;
  // otherwise all slots go in one parallel sweep (one pool wake-up).
  const size_t middle = plan.n_slots() - 3;
  if (spec_ready) {
    run_each(2, threaded, pool, [&](size_t i, size_t then) { compute([](size_t x) { return x; }, i, then); });
    merge_spec(parts, 0, n_q, spec);
    spec_ready();
    run_each(middle, threaded && middle > 1, pool,
             [&](size_t i, size_t then) { compute([](size_t x) { return x + 3; }, i, then); });
  } else {
    const size_t computed = plan.n_slots() - 1;
    run_each(computed, threaded && computed > 1, pool,
             [&](size_t i, size_t then) { compute([](size_t x) { return x < 2 ? x : x + 1; }, i, then); });
    merge_spec(parts, 0, n_q, spec);
  }
  merge_full(parts, plan.n_slots(), full, pool);
}

void check_shape(const HeadShape& hs) {
  if (hs.n_head <= 0 || hs.n_head_kv <= 0 || hs.head_dim <= 0 || hs.n_head % hs.n_head_kv != 0)
    throw std::invalid_argument("flash_decode: n_head must be a positive multiple of n_head_kv");
}

}  // namespace

void FlashPlan::slot_keys(size_t slot, size_t& begin, size_t& end) const {
  if (slot == 0) {
    begin = 0, end = sink_end;
  } else if (slot == 1) {
    begin = window_begin, end = n;
  } else if (slot == 2) {
    begin = end = 0;
  } else {
    begin = sink_end + (slot - 3) * chunk;
    end = std::min(window_begin, begin + chunk);
  }
}

FlashPlan flash_plan(size_t n, const FlashLayout& layout) {
  if (layout.spec_len == 0 || layout.chunk == 0 || layout.tile == 0)
    throw std::invalid_argument("flash_plan: spec_len, chunk and tile must be positive");
  const size_t S = layout.spec_len;
  FlashPlan p;
  p.n = n;
  p.chunk = layout.chunk;
  p.exact = n < 2 * S;
  p.sink_end = std::min(n, S);
  // n >= 2S puts P - S at or after S, so sink and window never overlap.
  p.window_begin = p.exact ? p.sink_end : std::min(n, round_up(n, layout.tile) - S);
  return p;
}

void FlashPartials::reset(size_t slots, int nq, int dim) {
  n_q = nq;
  head_dim = dim;
  o.resize(slots * size_t(nq) * size_t(dim));
  m.resize(slots * size_t(nq));
  l.resize(slots * size_t(nq));
}

uint64_t flash_queries_id(size_t n) {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(n, std::memory_order_relaxed);
}

void flash_partial(const float* q, int n_q, int group, const KvRows& kv, size_t kv_off, float scale,
                   const int32_t* cells, size_t count, FlashPartials& out, size_t slot) {
  flash_partial(q, n_q, group, n_q / group, kv, kv_off, scale, cells, count, out, slot, 0);
}

void flash_partial(const float* q, int n_q, int group, int n_kv, const KvRows& kv, size_t kv_off, float scale,
                   const int32_t* cells, size_t count, FlashPartials& out, size_t slot, int head0,
                   const int32_t* next, size_t next_count, uint64_t queries) {
  const int D = out.head_dim;
  float* o = out.o_at(slot, head0);
  float* m = out.m.data() + out.at(slot, head0);
  float* l = out.l.data() + out.at(slot, head0);
  if (count == 0) {
    std::fill(o, o + size_t(n_q) * D, 0.0f);
    std::fill(m, m + n_q, -INFINITY);
    std::fill(l, l + n_q, 0.0f);
    return;
  }
  thread_local AlignedBuffer scores, key_block, row_off;
  thread_local std::vector<size_t> head_off;
  head_off.resize(size_t(n_q));
  for (int h = 0; h < n_q; ++h) head_off[size_t(h)] = size_t((h / group) % n_kv) * size_t(D);
  const auto [lo, hi] = std::minmax_element(head_off.begin(), head_off.end());
  const size_t span_lo = *lo, span_hi = *hi + size_t(D);
  // The key block holds 16 keys' span of the heads' rows.
  detail::PartialJob job{q, n_q, group, &kv, kv_off + kv.offset, head_off.data(), span_lo, span_hi, D, scale,
                         cells, count, o, m, l,
                         scratch(scores, size_t(n_q) * detail::score_stride(count)),
                         scratch(key_block, 16 * (span_hi - span_lo)), next, next_count};
#ifdef SPECMESH_HAVE_AVX2_TU
  // The SIMD kernels read F32 and F16 in place, and Q8_0 when each head's values start a block
  // (head offsets are multiples of D); the portable kernel reads everything else.
  // Both SIMD kernels score Q8_0 keys in 8 bits against the queries quantised alike.
  const bool q8_in_place = kv.type == DType::Q8_0 && job.kv_off % QK8_0 == 0 && D % QK8_0 == 0;
  const bool simd_reads = kv.type == DType::F32 || kv.type == DType::F16 || q8_in_place;
  const bool avx512 = simd_reads && D % 64 == 0 && matmul_isa_has_avx512();
  if (avx512 || (simd_reads && D % 8 == 0 && use_avx2())) {
    job.row_off = reinterpret_cast<size_t*>(scratch(row_off, 2 * detail::row_off_entries(count)));
    static const bool amd = __builtin_cpu_is("amd");
    job.asks_to_l1 = amd;
    if (avx512 && flash_bf16_products(kv.type, D)) {
      thread_local AlignedBuffer qh;
      job.qh = reinterpret_cast<uint16_t*>(scratch(qh, (size_t(n_q) * size_t(D) + 1) / 2));
    }
    const auto kernel = avx512 ? detail::flash_partial_avx512 : detail::flash_partial_avx2;
    if (!q8_in_place) return kernel(job);
    // The partials of one call share their queries (named by `queries`): a thread quantises
    // them for the first it computes and reuses them for the next ones. The scratch's size
    // depends only on the queries' count, so it holds them until a partial of another name.
    // (Both kernels quantise alike, so a switch of path between calls needs no new name.)
    thread_local AlignedBuffer q8;
    thread_local uint64_t q8_of = 0;  // the name of the queries q8 holds (0: none)
    detail::PartialJob q8_job = job;
    q8_job.q8 = scratch(q8, detail::q8_scratch_floats(n_q, D));
    q8_job.q8_ready = queries != 0 && queries == q8_of;
    q8_of = queries;
    return kernel(q8_job);
  }
#endif
  partial_scalar(job);
}

bool flash_bf16_products(DType type, int head_dim) {
  return type == DType::F16 && head_dim % 64 == 0 && matmul_bf16_dot();
}

void flash_combine(const FlashPartials& p, size_t s0, size_t s1, int h, float* o, float& m, float& l) {
  combine_slots(p, s0, s1, h, h + 1, o, &m, &l);
}

void flash_decode(const float* q, const HeadShape& hs, float scale, const KvRows& kv, const int32_t* cells,
                  size_t n, float* out, const FlashLayout& layout, ThreadPool* pool) {
  check_shape(hs);
  decode_heads(q, hs.n_head, hs.n_head / hs.n_head_kv, kv, 0, hs.head_dim, scale, cells, n, out, nullptr, layout,
               pool);
}

void flash_decode_rows(const float* q, const HeadShape& hs, float scale, const KvRows& kv,
                       const int32_t* const* cells, const size_t* n, size_t rows, float* out,
                       const FlashLayout& layout, ThreadPool* pool) {
  check_shape(hs);
  const int H = hs.n_head, D = hs.head_dim, group = hs.n_head / hs.n_head_kv;
  const size_t row_values = size_t(H) * size_t(D);
  for (size_t r0 = 0; r0 < rows;) {
    // The run of tokens whose plans match token r0's and whose cells agree before the window.
    const FlashPlan plan = flash_plan(n[r0], layout);
    size_t r1 = r0 + 1;
    for (; r1 < rows; ++r1) {
      const FlashPlan other = flash_plan(n[r1], layout);
      if (other.sink_end != plan.sink_end || other.window_begin != plan.window_begin ||
          std::memcmp(cells[r1], cells[r0], plan.window_begin * sizeof(int32_t)) != 0)
        break;
    }
    const int R = int(r1 - r0), n_q = R * H;
    thread_local FlashPartials tls_parts;
    FlashPartials& parts = tls_parts;
    parts.reset(plan.n_slots(), n_q, D);
    // Work items: the shared sink and middle slots over all R tokens' heads, then each token's
    // window.
    const size_t shared = plan.n_slots() - 2, items = shared + size_t(R);
    size_t work = 0;
    for (size_t r = r0; r < r1; ++r) work += n[r];
    const bool threaded = use_pool(pool, work * size_t(H) * size_t(D));
    const float* qg = q + r0 * row_values;
    const uint64_t queries = flash_queries_id(1 + size_t(R));  // the shared items', then each token's
    // Item i's cells: [b, e) of `c`.
    auto item_keys = [&](size_t i, const int32_t*& c, size_t& b, size_t& e) {
      if (i < shared) {
        c = cells[r0];
        plan.slot_keys(i == 0 ? 0 : i + 2, b, e);
      } else {
        c = cells[r0 + (i - shared)];
        flash_plan(n[r0 + (i - shared)], layout).slot_keys(1, b, e);
      }
    };
    run_each(items, threaded && items > 1, pool, [&](size_t i, size_t then) {
      const int32_t *c, *nc = nullptr;
      size_t b, e, nb = 0, ne = 0;
      item_keys(i, c, b, e);
      if (then != kNoSlot && layout.ask_ahead) item_keys(then, nc, nb, ne);
      if (i < shared) {
        flash_partial(qg, n_q, group, hs.n_head_kv, kv, 0, scale, c + b, e - b, parts, i == 0 ? 0 : i + 2, 0,
                      nc + nb, ne - nb, queries);
      } else {
        const size_t r = r0 + (i - shared);
        flash_partial(q + r * row_values, H, group, hs.n_head_kv, kv, 0, scale, c + b, e - b, parts, 1,
                      int(r - r0) * H, nc + nb, ne - nb, queries + 1 + (r - r0));
      }
    });
    merge_spec(parts, 0, n_q, nullptr);
    merge_full(parts, plan.n_slots(), out + r0 * row_values, pool);
    r0 = r1;
  }
}

bool spec_accept(float d2, float n2, float lambda) { return d2 < lambda * lambda * n2; }

SpecCheck speculative_flash_decode(const float* q, const HeadShape& hs, float scale, const KvRows& kv,
                                   const int32_t* cells, size_t n, float* full, float* spec, const SpecConfig& cfg,
                                   ThreadPool* pool, const std::function<void()>& spec_ready) {
  check_shape(hs);
  decode_heads(q, hs.n_head, hs.n_head / hs.n_head_kv, kv, 0, hs.head_dim, scale, cells, n, full, spec, cfg.layout,
               pool, spec_ready);
  SpecCheck c;
  const size_t total = size_t(hs.n_head) * size_t(hs.head_dim);
  for (size_t i = 0; i < total; ++i) {
    const float d = spec[i] - full[i];
    c.d2 += d * d;
    c.n2 += full[i] * full[i];
  }
  c.exact = flash_plan(n, cfg.layout).exact;
  c.accept = c.exact || spec_accept(c.d2, c.n2, cfg.lambda);
  return c;
}

}  // namespace specmesh
