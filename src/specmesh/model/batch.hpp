// A batch of tokens for one forward pass: any positions, any sequences, optional token tree.
#pragma once

#include <cstdint>
#include <vector>

namespace specmesh {

// The sequences a token (or KV cell) belongs to, as a bit set: up to 64 sequences.
using SeqSet = uint64_t;
constexpr int kMaxSeqs = 64;
constexpr SeqSet seq_bit(int seq) { return SeqSet(1) << seq; }

struct Batch {
  std::vector<int32_t> tokens;
  std::vector<int32_t> pos;
  std::vector<SeqSet> seqs;
  std::vector<uint8_t> logits;  // 1: produce logits (or output hidden state) for this token
  // Optional token tree: parent[i] is the batch index of token i's parent, or -1 when its
  // parent is the cached context. Tokens then see only their ancestors within the batch.
  std::vector<int32_t> parent;

  size_t size() const { return tokens.size(); }
  bool is_tree() const { return !parent.empty(); }
  void add(int32_t token, int32_t p, SeqSet s, bool want_logits) {
    tokens.push_back(token);
    pos.push_back(p);
    seqs.push_back(s);
    logits.push_back(want_logits);
  }
  void clear() { *this = Batch{}; }
};

}  // namespace specmesh
