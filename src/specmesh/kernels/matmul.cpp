#include "specmesh/kernels/matmul.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "specmesh/kernels/matmul_impl.hpp"
#include "specmesh/kernels/packed_weights.hpp"
#include "specmesh/kernels/quant.hpp"
#include "specmesh/kernels/thread_pool.hpp"

#if defined(__x86_64__) || defined(__i386__)
#define SPECMESH_HAVE_AVX2_TU 1
#include <cpuid.h>
#endif

namespace specmesh {

namespace mm {


namespace {

// --- portable scalar path ----------------------------------------------------------------
// One function per (row, token) dot product with a fixed summation order; blocking only
// changes which dot runs when.

// Eight interleaved partial sums, combined pairwise: a fixed order that also gives the
// compiler independent chains.
struct Lanes {
  float s[8] = {};
  float total() const { return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])); }
};

const float* f16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t h = 0; h < 65536; ++h) t[h] = fp16_to_fp32(uint16_t(h));
    return t;
  }();
  return table.data();
}

template <class Conv>
float dot_float(const void* row, const float* x, size_t n, Conv conv) {
  Lanes acc;
  for (size_t i = 0; i < n; ++i) acc.s[i & 7] += conv(row, i) * x[i];
  return acc.total();
}

float dot_q8_0(const block_q8_0* w, const ActQ8* x, size_t nb) {
  float sum = 0;
  for (size_t b = 0; b < nb; ++b) {
    int si = 0;
    for (int k = 0; k < QK8_0; ++k) si += int(w[b].qs[k]) * int(x[b].qs[k]);
    sum += float(si) * (fp16_to_fp32(w[b].d) * x[b].d);
  }
  return sum;
}

float dot_q4_0(const block_q4_0* w, const ActQ8* x, size_t nb) {
  float sum = 0;
  for (size_t b = 0; b < nb; ++b) {
    int si = 0;
    for (int k = 0; k < QK4_0 / 2; ++k) {
      si += ((w[b].qs[k] & 0x0F) - 8) * int(x[b].qs[k]);
      si += ((w[b].qs[k] >> 4) - 8) * int(x[b].qs[k + QK4_0 / 2]);
    }
    sum += float(si) * (fp16_to_fp32(w[b].d) * x[b].d);
  }
  return sum;
}

float dot_kquant(DType type, const uint8_t* row, const float* x, size_t cols) {
  const size_t bb = traits(type).block_bytes;
  float buf[QK_K];
  Lanes acc;
  for (size_t sb = 0; sb < cols / QK_K; ++sb) {
    dequantize_row(type, row + sb * bb, buf, QK_K);
    const float* xs = x + sb * QK_K;
    for (int i = 0; i < QK_K; ++i) acc.s[i & 7] += buf[i] * xs[i];
  }
  return acc.total();
}

float dot_scalar(const Problem& p, size_t r, size_t t) {
  const uint8_t* row = p.w + r * p.w_stride;
  const float* x = p.x + t * p.cols;
  switch (p.type) {
    case DType::F32:
      return dot_float(row, x, p.cols, [](const void* w, size_t i) { return static_cast<const float*>(w)[i]; });
    case DType::F16: {
      const float* tab = f16_table();
      return dot_float(row, x, p.cols, [tab](const void* w, size_t i) { return tab[static_cast<const uint16_t*>(w)[i]]; });
    }
    case DType::BF16:
      return dot_float(row, x, p.cols,
                       [](const void* w, size_t i) { return bf16_to_fp32(static_cast<const uint16_t*>(w)[i]); });
    case DType::Q8_0:
      return dot_q8_0(reinterpret_cast<const block_q8_0*>(row), p.xq + t * (p.cols / QK8_0), p.cols / QK8_0);
    case DType::Q4_0:
      return dot_q4_0(reinterpret_cast<const block_q4_0*>(row), p.xq + t * (p.cols / QK4_0), p.cols / QK4_0);
    case DType::Q4_K:
    case DType::Q6_K:
      return dot_kquant(p.type, row, x, p.cols);
  }
  return 0;
}

void gemm_rows_scalar(const Problem& p, size_t r0, size_t r1) {
  constexpr size_t kRowBlock = 16;  // these weight rows stay cached while all tokens pass
  for (size_t rb = r0; rb < r1; rb += kRowBlock) {
    const size_t re = std::min(r1, rb + kRowBlock);
    for (size_t t = 0; t < p.n_tokens; ++t)
      for (size_t r = rb; r < re; ++r) p.y[t * p.ldy + r] = dot_scalar(p, r, t);
  }
}

void quantize_act_scalar(const float* x, size_t cols, ActQ8* out) {
  for (size_t b = 0; b < cols / QK8_0; ++b, x += QK8_0) {
    float amax = 0;
    for (int k = 0; k < QK8_0; ++k) amax = std::max(amax, std::fabs(x[k]));
    const float d = amax / 127;
    const float id = d != 0 ? 1 / d : 0;
    out[b].d = d;
    for (int k = 0; k < QK8_0; ++k) {
      float v = x[k] * id;
      if (!(std::fabs(v) <= 127.0f)) v = v > 0 ? 127.0f : -127.0f;  // only NaN/inf inputs get here
      out[b].qs[k] = int8_t(std::nearbyint(v));  // nearest-even, like the AVX2 conversion
    }
  }
}

// --- dispatch ----------------------------------------------------------------------------

enum class Isa : int { Scalar = 0, Avx2 = 1, Avx512 = 2 };

constexpr const char* kIsaNames[] = {"scalar", "avx2", "avx512"};

bool cpu_has_avx2() {
#ifdef SPECMESH_HAVE_AVX2_TU
  // F16C through cpuid: clang's __builtin_cpu_supports does not know "f16c".
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#ifdef SPECMESH_HAVE_AVX2_TU
  // __builtin_cpu_supports also checks that the OS saves the zmm and mask registers.
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// vdpbf16ps, which the AVX-512 path uses for BF16 weights where the CPU has it. Asked once:
// cpuid traps to the hypervisor in a virtual machine.
bool cpu_has_avx512_bf16() {
#ifdef SPECMESH_HAVE_AVX2_TU
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

bool cpu_supports(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return true;
    case Isa::Avx2: return cpu_has_avx2();
    case Isa::Avx512: return cpu_has_avx512();
  }
  return false;
}

// The path a name selects; false for an unknown name.
bool parse_isa(const char* name, Isa& out) {
  for (int i = 0; i < 3; ++i) {
    if (std::strcmp(name, kIsaNames[i]) == 0) {
      out = Isa(i);
      return true;
    }
  }
  return false;
}

Isa best_isa() { return cpu_has_avx512() ? Isa::Avx512 : cpu_has_avx2() ? Isa::Avx2 : Isa::Scalar; }

// SPECMESH_ISA caps the path: "scalar", "avx2" or "avx512" (the best this CPU runs, never
// above the name). An unknown name is reported once and ignored.
Isa default_isa() {
  const char* env = std::getenv("SPECMESH_ISA");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) return best_isa();
  Isa want;
  if (!parse_isa(env, want)) {
    std::fprintf(stderr, "SPECMESH_ISA=%s: unknown kernel path (scalar, avx2, avx512 or auto); using auto\n", env);
    return best_isa();
  }
  while (!cpu_supports(want)) want = Isa(int(want) - 1);
  return want;
}

std::atomic<int> g_isa{-1};

Isa current_isa() {
  int v = g_isa.load(std::memory_order_relaxed);
  if (v < 0) {
    v = int(default_isa());
    g_isa.store(v, std::memory_order_relaxed);
  }
  return Isa(v);
}

// Which packed copies a path reads (PackedWeights): AVX-512 every packable type; AVX2 all but
// Q8_0, whose row-by-row kernels were compute-bound near the memory's speed or below it
// (matmul_packed_avx2.cpp). A Q8_0 panel stores w + 128, which maddubs would saturate.
bool reads_packed(Isa isa, DType type) {
  if (!PackedWeights::packable(type)) return false;
  return isa == Isa::Avx512 || (isa == Isa::Avx2 && type != DType::Q8_0);
}

// Below this many multiply-adds, waking the pool costs more than it saves.
constexpr size_t kSmallWork = size_t(64) << 10;
// Per-thread row ranges are multiples of this, so tiles never straddle threads needlessly.
constexpr size_t kRowChunk = 32;

}  // namespace
}  // namespace mm

void matmul_rows(const WeightView& w, size_t row_begin, size_t row_end, const float* x, size_t n_tokens,
                 float* y, ThreadPool& pool) {
  using namespace mm;
  const DTypeTraits* tr = dtype_traits(static_cast<uint32_t>(w.type));
  if (tr == nullptr) throw std::invalid_argument("matmul: unsupported weight type");
  if (w.cols % tr->block_elems != 0)
    throw std::invalid_argument("matmul: " + std::string(tr->name) + " row length " + std::to_string(w.cols) +
                                " is not a multiple of the block size");
  if (row_begin > row_end || row_end > w.rows) throw std::out_of_range("matmul: row range outside the matrix");
  const size_t rows = row_end - row_begin;
  if (rows == 0 || n_tokens == 0) return;

  const Isa isa = current_isa();
  Problem p{};
  p.type = w.type;
  p.w_stride = row_bytes(w.type, w.cols);
  p.w = static_cast<const uint8_t*>(w.data) + row_begin * p.w_stride;
  p.cols = w.cols;
  p.x = x;
  p.n_tokens = n_tokens;
  p.y = y;
  p.ldy = rows;

  // Integer-dot types, and every packed matrix: quantise each token's activations once,
  // shared by all rows and threads.
  thread_local std::vector<ActQ8> act;
  const bool packed = w.packed != nullptr && reads_packed(isa, w.type);
  const size_t nb = w.cols / QK8_0;
#ifdef SPECMESH_HAVE_AVX2_TU
  // Q4_K rows read in place by matmul_avx2.cpp's integer tiles take the same blocks.
  const bool q4_K_rows = !packed && isa != Isa::Scalar && w.type == DType::Q4_K;
  if (packed || q4_K_rows) {
    // Quantised straight into the integer kernels' blocks, with each block's integer sum
    // starting at -offset * sum(q) and a min's term d * sum(q).
    const int32_t offset = w.type == DType::Q8_0 ? 128 : w.type == DType::Q4_0 ? 8 : 0;
    thread_local std::vector<ActBlk> blocks;
    blocks.resize(n_tokens * nb);
    for (size_t t = 0; t < n_tokens; ++t) quantize_act_blocks_avx2(x + t * w.cols, w.cols, offset, &blocks[t * nb]);
    p.xb = blocks.data();
    if (packed) {
      p.wp = static_cast<const uint8_t*>(w.packed);
      p.row0 = row_begin;
      p.panel_bytes = PackedWeights::panel_bytes(w.type, w.cols);
    }
  } else
#endif
  if (w.type == DType::Q8_0 || w.type == DType::Q4_0) {
    act.resize(n_tokens * nb);
    for (size_t t = 0; t < n_tokens; ++t) {
#ifdef SPECMESH_HAVE_AVX2_TU
      if (isa != Isa::Scalar) {
        quantize_act_avx2(x + t * w.cols, w.cols, act.data() + t * nb);
        continue;
      }
#endif
      quantize_act_scalar(x + t * w.cols, w.cols, act.data() + t * nb);
    }
    p.xq = act.data();
#ifdef SPECMESH_HAVE_AVX2_TU
    if (isa == Isa::Avx512) {
      // 64-byte aligned, for the kernels' whole-register loads.
      thread_local std::vector<uint8_t> packed_act;
      const size_t per_token = packed_act_bytes(w.cols);
      packed_act.resize(n_tokens * per_token + 64);
      uint8_t* base = packed_act.data() + (64 - reinterpret_cast<uintptr_t>(packed_act.data()) % 64) % 64;
      for (size_t t = 0; t < n_tokens; ++t) pack_act_avx512(w.type, act.data() + t * nb, w.cols, base + t * per_token);
      p.xp = base;
    }
#endif
  }

#ifdef SPECMESH_HAVE_AVX2_TU
  if (w.type == DType::BF16 && isa == Isa::Avx512 && cpu_has_avx512_bf16()) {  // see matmul_bf16_dot
    thread_local std::vector<uint16_t> act_bf16;
    const size_t per_token = bf16_act_elems(w.cols);
    act_bf16.resize(n_tokens * per_token);
    for (size_t t = 0; t < n_tokens; ++t) bf16_act_avx512(x + t * w.cols, w.cols, act_bf16.data() + t * per_token);
    p.xh = act_bf16.data();
  }
#endif

  auto run = [&](size_t r0, size_t r1) {
#ifdef SPECMESH_HAVE_AVX2_TU
    if (p.wp != nullptr) return isa == Isa::Avx512 ? gemm_packed_avx512(p, r0, r1) : gemm_packed_avx2(p, r0, r1);
    if (isa == Isa::Avx512) return gemm_rows_avx512(p, r0, r1);
    if (isa == Isa::Avx2) return gemm_rows_avx2(p, r0, r1);
#endif
    gemm_rows_scalar(p, r0, r1);
  };

  const size_t chunks = (rows + kRowChunk - 1) / kRowChunk;
  if (pool.size() <= 1 || chunks <= 1 || rows * w.cols * n_tokens < kSmallWork) {
    run(0, rows);
    return;
  }
  pool.run([&](int ith, int nth) {
    const size_t c0 = chunks * size_t(ith) / size_t(nth);
    const size_t c1 = chunks * size_t(ith + 1) / size_t(nth);
    const size_t r0 = c0 * kRowChunk, r1 = std::min(rows, c1 * kRowChunk);
    if (r0 < r1) run(r0, r1);
  });
}

void matmul(const WeightView& w, const float* x, size_t n_tokens, float* y, ThreadPool& pool) {
  matmul_rows(w, 0, w.rows, x, n_tokens, y, pool);
}

const char* matmul_isa() { return mm::kIsaNames[int(mm::current_isa())]; }

bool matmul_isa_has_avx2() { return mm::current_isa() != mm::Isa::Scalar; }

bool matmul_isa_has_avx512() { return mm::current_isa() == mm::Isa::Avx512; }

bool matmul_reads_packed(DType type) { return mm::reads_packed(mm::current_isa(), type); }

bool matmul_bf16_dot() { return matmul_isa_has_avx512() && mm::cpu_has_avx512_bf16(); }

bool matmul_set_isa(const char* isa) {
  using namespace mm;
  Isa v;
  if (isa == nullptr || *isa == '\0' || std::strcmp(isa, "auto") == 0) {
    v = default_isa();
  } else if (!parse_isa(isa, v) || !cpu_supports(v)) {
    return false;
  }
  g_isa.store(int(v), std::memory_order_relaxed);
  return true;
}

}  // namespace specmesh
