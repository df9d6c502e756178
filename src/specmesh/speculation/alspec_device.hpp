// One device of an ALSpec pair, driven through a decode token op by op. The two devices may
// sit in one process (alspec_pair) or in two actors that talk over the network (actors/
// alspec_stage); both drive the same calls here, in this order per layer:
//   pre(il)                      ops before attention, skipped while gated
//   gather(other priority)       the all-gather; then sender() says who sends
//   sender:   attend(il) -> hand-off (residual, K/V rows, speculative output), sent at once,
//             settle(il, hit)    verdict: post-attention with the full output on a miss
//   receiver: receive(il, hand-off)  sync the state and run post-attention speculatively
// and after the last layer one more gather() names the holder, which calls output().
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <optional>
#include <vector>

#include "specmesh/kernels/flash_decode.hpp"
#include "specmesh/model/forward_pass.hpp"
#include "specmesh/speculation/alspec_gating.hpp"

namespace specmesh {

// What one device did, counted per op over all decode tokens so far.
struct AlspecWork {
  int pre_run = 0, pre_skipped = 0;    // ops before attention (norm, QKV, RoPE, KV write)
  int post_run = 0, post_skipped = 0;  // ops after attention (output projection, FFN)
  int sent = 0;                        // attentions as sender (speculative + full + check)
  int received = 0;                    // attentions as receiver (waits for the hand-off)
  int heads = 0;                       // classifier runs
  size_t sync_bytes = 0;               // residual, K/V rows and hand-offs received
};

// How a pair speculates: the kernel's layout and lambda, and whether every speculation is
// rejected whatever its check says (the pair then decodes as plain attention; a baseline).
struct AlspecSettings {
  SpecConfig spec;
  bool force_miss = false;
  // Not 0: the verdicts follow emulated_hit() at this rate instead of the check, to reproduce a
  // hit rate's timing on a small model. The receiver then goes on with speculations the check
  // may have rejected, so the output is no longer plain decoding's.
  double emulate_hit_rate = 0;
};

// What the sender gives the receiver at one attention: its residual stream (n_embd), the
// token's K and V rows of that layer (kv_dim each) and the speculative output (q_dim). Under
// tensor parallelism rank r of the sender's group gives rank r of the receiver's: the whole
// residual, and the K/V rows and speculative output of its heads (Context::kv_dim, q_dim).
// Views into the sender's state, valid until its settle(); a receiver in another process gets
// them over the wire and views the message.
struct AlspecHandoff {
  std::span<const float> residual, k, v, spec;
  size_t bytes() const { return (residual.size() + k.size() + v.size() + spec.size()) * sizeof(float); }
};

class AlspecDevice {
 public:
  // Device `self` (0 or 1) of a pair; the gate keeps its priorities across tokens.
  AlspecDevice(Context& ctx, int self, SpecConfig spec);

  // Starts a decode token: a batch of one token (a new forward pass; the embedding is a row
  // lookup, so both devices do it). Throws std::invalid_argument for a larger batch.
  void begin(const Batch& batch);
  void pre(int il);
  // Takes the other device's priority (see AlspecGate::all_gather).
  void gather(int other_priority) { gate_.all_gather(other_priority); }
  bool is_sender() const { return gate_.role() == AlspecRole::Sender; }

  // Sender: this layer's attention; returns the hand-off for the receiver. A tensor-parallel
  // rank sums the check's squares over its group (every rank of a group calls it at once).
  // `ship`, when given, gets the hand-off as soon as the speculative output is ready, while the
  // middle of the full attention is still to be computed: sending it there is what lets the
  // receiver overlap.
  AlspecHandoff attend(int il, const std::function<void(const AlspecHandoff&)>& ship = {});
  const SpecCheck& check() const { return check_; }
  // Sender, after attend(): records the verdict and runs post-attention on a miss.
  void settle(int il, bool hit);
  // Receiver: replaces its residual and K/V rows with the sender's and goes on with the
  // speculative output.
  void receive(int il, const AlspecHandoff& h);
  // The holder after the final gather: the logits of the token. Ends the pass.
  std::vector<float> output();
  // Drops the pass of an unfinished token.
  void abort() { pass_.reset(); }
  // Back to the initial priorities (a new session's empty caches).
  void reset() { gate_ = AlspecGate(gate_.self()); }

  const AlspecGate& gate() const { return gate_; }
  const AlspecWork& work() const { return work_; }
  Context& context() { return ctx_; }

 private:
  Context& ctx_;
  SpecConfig spec_;
  AlspecGate gate_;
  AlspecWork work_;
  std::unique_ptr<ForwardPass> pass_;
  std::vector<float> full_, spec_out_, k_, v_;  // this layer's outputs and K/V rows, reused
  SpecCheck check_;
};

}  // namespace specmesh
