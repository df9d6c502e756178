// Softmax attention of one query head over a list of KV cells.
//
// This is flash decode (flash_decode.hpp) for a single head: the same key layout and the same
// partial and combine routines, so a head computed here equals that head of the whole-layer
// (speculative) kernel bit for bit, and a rejected speculation reproduces plain decoding.
#pragma once

#include <cstddef>
#include <cstdint>

#include "specmesh/kernels/flash_decode.hpp"

namespace specmesh {

// out[head_dim] = softmax(scale * q . k_j) v_j over the cells cells[0..n), reading the head at
// offset kv_off of each KV row. Single-threaded: callers parallelise over (token, head).
void attention(const float* q, const KvRows& kv, size_t kv_off, int head_dim, float scale,
               const int32_t* cells, size_t n, float* out, const FlashLayout& layout = {});

}  // namespace specmesh
