// Attention-level speculation (ALSpec) on two in-process devices: two contexts of one model,
// each with its own KV cache and thread pool, driven through a decode token layer by layer by
// the priority gating of alspec_gating.hpp.
//
// At each layer's attention the sender (higher priority) syncs the residual stream and the
// token's K/V rows of that layer to the receiver, computes the speculative output (first S
// keys and the tile-aligned last S) and hands a copy of it to the receiver, which runs the
// ops after attention and the next layer's ops before attention with it. The sender computes
// the full output in the same kernel pass and checks ||spec - full|| < lambda ||full||: on a
// hit it skips those ops (the receiver's state is the right one and the roles swap), on a
// miss it runs them with the full output and stays the sender; the receiver's speculative
// state is replaced at the next attention's sync. Lambda = 0 never accepts a speculation over
// 2S keys or more (below that the speculative output is exact), so the pair then decodes bit
// for bit as one context with the same attention layout.
//
// Each device may be a tensor-parallel group of `tp` ranks (the paper's SP + TPn): rank r of the
// sender's group hands rank r of the receiver's its heads' K/V rows and speculative output, the
// groups sum the check over their ranks, and the ranks of a group run at once (TpGroup).
//
// Sequential here (both devices step through alspec_device.hpp in turn): the work counters
// say what each device ran and skipped, which is what the overlap on real hardware would save.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "specmesh/kernels/flash_decode.hpp"
#include "specmesh/model/context.hpp"
#include "specmesh/model/tp_group.hpp"
#include "specmesh/speculation/alspec_device.hpp"

namespace specmesh {

struct AlspecParams {
  SpecConfig spec;    // sink/window length S, middle chunk, tile, lambda
  int n_ctx = 0;      // KV cells per device (0: the model's default)
  int n_threads = 1;  // per device (per rank of a group)
  int tp = 1;         // tensor-parallel ranks per device group
};

// One decode token's result.
struct AlspecToken {
  std::vector<float> logits;
  std::vector<uint8_t> hits;      // per layer: the speculation was accepted
  std::vector<SpecCheck> checks;  // per layer: the sender's check
  int holder = 0;                 // the device whose state produced the logits
};

// Overrides the sender's verdict (tests force misses); gets the kernel's check.
using AlspecVerdict = std::function<bool(int layer, const SpecCheck& check)>;

class AlspecPair {
 public:
  AlspecPair(const Model& model, AlspecParams params);

  // Runs the prompt at positions [0, n) of sequence 0 on both devices, plainly; returns the
  // logits of the last token.
  std::vector<float> prefill(const std::vector<int32_t>& tokens, int n_batch = 256);

  // One decode token at `pos` of sequence 0.
  AlspecToken decode(int32_t token, int32_t pos);

  // Greedy decoding: prefill, then n tokens (stop tokens ignored); each decode step's result,
  // input token and position go to `each`.
  using Step = std::function<void(const AlspecToken& result, int32_t token, int32_t pos)>;
  std::vector<int32_t> greedy(const std::vector<int32_t>& prompt, int n, const Step& each = {});

  void set_verdict(AlspecVerdict verdict) { verdict_ = std::move(verdict); }

  const AlspecParams& params() const { return params_; }
  // Group k's rank `rank` (the whole device without tensor parallelism).
  Context& device(int k, int rank = 0) { return group_[k]->rank(rank); }
  const AlspecGate& gate(int k) const { return dev_[k][0]->gate(); }
  const AlspecWork& work(int k, int rank = 0) const { return dev_[k][size_t(rank)]->work(); }

 private:
  const Model& model_;
  AlspecParams params_;
  std::unique_ptr<TpGroup> group_[2];
  std::vector<std::unique_ptr<AlspecDevice>> dev_[2];  // per rank
  AlspecVerdict verdict_;
};

}  // namespace specmesh
