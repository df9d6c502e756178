#include "specmesh/model/kv_cache.hpp"

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <new>
#include <stdexcept>

namespace specmesh {

namespace {
bool in_range(int32_t pos, int32_t p0, int32_t p1) { return pos >= std::max(p0, 0) && (p1 < 0 || pos < p1); }
}  // namespace

uint64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? uint64_t(pages) * uint64_t(page) : UINT64_MAX;
}

std::string bytes_text(uint64_t bytes) {
  const char* unit = "GiB";
  double v = double(bytes) / double(1 << 30);
  if (bytes < (uint64_t(1) << 20)) unit = "KiB", v = double(bytes) / 1024;
  else if (bytes < (uint64_t(1) << 30)) unit = "MiB", v = double(bytes) / double(1 << 20);
  char text[64];
  std::snprintf(text, sizeof text, "%.1f %s", v, unit);
  return text;
}

KvCache::KvCache(int n_cells, int layer_begin, int layer_end, int kv_dim, DType type)
    : layer_begin_(layer_begin), layer_end_(layer_end), kv_dim_(kv_dim), type_(type) {
  if (!kv_type_supported(type))
    throw std::invalid_argument("a KV cache cannot be stored as " + std::string(dtype_name(type)) +
                                " (expected f16, q8_0 or f32)");
  if (type == DType::Q8_0 && kv_dim % QK8_0 != 0)
    throw std::invalid_argument("a q8_0 KV cache needs rows of a multiple of 32 values; this model's have " +
                                std::to_string(kv_dim) + " (use f16)");
  row_bytes_ = kv_row_bytes(type, size_t(kv_dim));
  const uint64_t bytes = bytes_needed(n_cells, layer_end - layer_begin, kv_dim, type), memory = physical_memory_bytes();
  const auto what = [&] {
    return "a KV cache of " + std::to_string(n_cells) + " cells for layers [" + std::to_string(layer_begin) + ", " +
           std::to_string(layer_end) + ") needs " + bytes_text(bytes);
  };
  if (bytes > memory) throw std::runtime_error(what() + ", more than this machine's " + bytes_text(memory) + " of memory");
  try {
    cells_.resize(n_cells);
    for (int l = layer_begin; l < layer_end; ++l) {
      k_.emplace_back(size_t(n_cells) * row_bytes_);
      v_.emplace_back(size_t(n_cells) * row_bytes_);
    }
  } catch (const std::bad_alloc&) {
    throw std::runtime_error(what() + ", which cannot be allocated (out of memory)");
  }
}

size_t KvCache::layer_index(int layer) const {
  if (layer < layer_begin_ || layer >= layer_end_)
    throw std::out_of_range("layer " + std::to_string(layer) + " is outside the KV cache's [" +
                            std::to_string(layer_begin_) + ", " + std::to_string(layer_end_) + ")");
  return size_t(layer - layer_begin_);
}

size_t KvCache::row_offset(int32_t cell) const {
  if (cell < 0 || cell >= n_cells())
    throw std::out_of_range("cell " + std::to_string(cell) + " is outside the KV cache's " + std::to_string(n_cells()));
  return size_t(cell) * row_bytes_;
}

KvRows KvCache::rows(int layer) const {
  const size_t l = layer_index(layer);
  return KvRows{k_[l].data(), v_[l].data(), size_t(kv_dim_), type_, 0};
}

void KvCache::write(int layer, int32_t cell, const float* k, const float* v) {
  const size_t l = layer_index(layer), off = row_offset(cell);
  if (k) kv_store(type_, k, size_t(kv_dim_), k_[l].data() + off);
  if (v) kv_store(type_, v, size_t(kv_dim_), v_[l].data() + off);
}

void KvCache::read(int layer, int32_t cell, float* k, float* v) const {
  const size_t l = layer_index(layer), off = row_offset(cell);
  if (k) kv_load(type_, k_[l].data() + off, 0, size_t(kv_dim_), k);
  if (v) kv_load(type_, v_[l].data() + off, 0, size_t(kv_dim_), v);
}

int KvCache::used() const {
  int n = 0;
  for (const auto& c : cells_) n += !c.empty();
  return n;
}

std::vector<int32_t> KvCache::place(const Batch& batch) {
  std::vector<int32_t> slots;
  slots.reserve(batch.size());
  int next = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    while (next < n_cells() && !cells_[next].empty()) ++next;
    if (next == n_cells())
      throw std::runtime_error("KV cache full: " + std::to_string(n_cells()) + " cells, batch needs " +
                               std::to_string(batch.size()));
    if (batch.seqs[i] == 0) throw std::runtime_error("batch token without a sequence");
    slots.push_back(next++);
  }
  for (size_t i = 0; i < batch.size(); ++i) cells_[slots[i]] = {batch.pos[i], batch.seqs[i]};
  return slots;
}

void KvCache::seq_rm(int seq, int32_t p0, int32_t p1) {
  for (auto& c : cells_) {
    if (c.empty() || !in_range(c.pos, p0, p1)) continue;
    if (seq < 0) c.seqs = 0;
    else c.seqs &= ~seq_bit(seq);
    if (c.empty()) c.pos = -1;
  }
}

void KvCache::seq_cp(int src, int dst, int32_t p0, int32_t p1) {
  if (src == dst) return;
  for (auto& c : cells_)
    if ((c.seqs & seq_bit(src)) && in_range(c.pos, p0, p1)) c.seqs |= seq_bit(dst);
}

void KvCache::seq_keep(int seq) {
  for (auto& c : cells_) {
    c.seqs &= seq_bit(seq);
    if (c.empty()) c.pos = -1;
  }
}

std::vector<int32_t> KvCache::seq_add(int seq, int32_t p0, int32_t p1, int32_t delta, int seq_last) {
  std::vector<int32_t> moved;
  if (delta == 0) return moved;
  SeqSet which = 0;
  for (int s = std::max(seq, 0); s <= std::max(seq, seq_last) && s < kMaxSeqs; ++s) which |= seq_bit(s);
  for (int i = 0; i < n_cells(); ++i) {
    KvCell& c = cells_[size_t(i)];
    if (c.empty() || !in_range(c.pos, p0, p1) || (seq >= 0 && !(c.seqs & which))) continue;
    c.pos += delta;
    if (c.pos < 0) {
      c = {};
      continue;
    }
    moved.push_back(i);
  }
  return moved;
}

void KvCache::clear() {
  for (auto& c : cells_) c = {};
}

int32_t KvCache::seq_pos_max(int seq) const {
  int32_t m = -1;
  for (const auto& c : cells_)
    if (c.seqs & seq_bit(seq)) m = std::max(m, c.pos);
  return m;
}

void KvCache::visible_cells(int32_t pos, SeqSet seqs, std::vector<int32_t>& out) const {
  out.clear();
  for (int i = 0; i < n_cells(); ++i)
    if ((cells_[i].seqs & seqs) && cells_[i].pos <= pos) out.push_back(i);
}

}  // namespace specmesh
