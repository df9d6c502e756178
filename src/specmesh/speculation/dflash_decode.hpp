// DFlash decoding in one process: the drafter proposes a block from the target's hidden states,
// the target verifies it in one cached forward pass, and acceptance is by equality with the
// target's own samples (z-lab's dflash_generate):
//
//   prefill the prompt (positions 0..P-1), capturing the tapped layers; t0 = sample(last logits)
//   start = P, anchor = t0, new context = the prompt's taps
//   loop:  block = [anchor, mask x (B-1)] at positions start .. start+B-1
//          the drafter appends the new context rows and runs the block: proposals p_1..p_{B-1}
//          are the argmax of the target's classifier over its output rows 1..B-1
//          the target runs [anchor, p_1 .. p_{B-1}] (one pass, logits and taps of every row)
//          y_i = sample(logits row i) for i = 0, 1, ..., while p_{i+1} == y_i: a accepted
//          emit y_0 .. y_a (the accepted drafts, then the target's own token), start += a + 1
//          the target's cache is cropped to start; the new context is the taps of rows 0..a
//
// Every emitted token is the target's sample given the tokens before it, so the output is the
// target's for any drafter: token for token at temperature 0, in distribution otherwise. The
// draft cache holds context rows only and grows by a + 1 rows a step.
#pragma once

#include <cstdint>
#include <vector>

#include "specmesh/model/context.hpp"
#include "specmesh/model/dflash_drafter.hpp"
#include "specmesh/model/generate.hpp"

namespace specmesh {

class ThreadPool;

struct DFlashParams {
  GenerateParams gen;  // n_predict, sampling, ignore_eos, n_batch
  int block = 0;       // block size; 0: the drafter's block_size
};

struct DFlashStats {
  GenerateStats gen;
  int64_t steps = 0;             // draft-verify steps
  int64_t drafted = 0;           // proposals that reached a verification
  int64_t accepted = 0;          // proposals the target accepted
  std::vector<int64_t> tau_hist;  // tau_hist[t]: steps that emitted t tokens (t = a + 1, 1..block)
  // Mean tokens a step emits (the mean accepted length plus one).
  double tau() const;
};

// The context parameters a DFlash target needs: `base` with the drafter's tapped layers captured.
ContextParams dflash_target_params(const DFlashDrafter& drafter, ContextParams base);

// Feeds the prompt into sequence 0 of an empty target context (made with dflash_target_params
// and holding the whole target) and generates. The drafter must fit the target
// (DFlashDrafter::check_target). Throws std::invalid_argument for a context that cannot hold
// prompt + n_predict + block tokens or lacks the taps.
DFlashStats dflash_generate(Context& target, const DFlashDrafter& drafter, ThreadPool& draft_pool,
                            const std::vector<int32_t>& prompt, const DFlashParams& params, const TokenCallback& on_token);

}  // namespace specmesh
