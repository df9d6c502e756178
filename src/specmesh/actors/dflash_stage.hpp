// The DFlash drafter's stage: a block drafter (model/dflash_drafter.hpp) on a device of its
// own, conditioned on hidden states the target's stages tap and send it.
//
// It takes, from the head, a draft run whose batch is
//   context rows  positions n .. s-1, each naming the target run and the row of its batch that
//                 computed that position (inputs, input_rows: those taps are the row's input;
//                 the token is not read)
//   block rows    positions s .. s+B-1 with inputs[i] = 0: the anchor token, then B-1 mask
//                 rows (their tokens are not read: the drafter's mask embedding stands in)
// where n is what its draft cache holds for that sequence; it appends the context rows to the
// cache, runs the block and sends the logits of the rows that ask for them (through the
// target's classifier, which the drafter borrows). From the target's stages it takes
// HiddenStates (one per tapped layer and run) and keeps them until a draft run uses them.
//
// Work is handled in arrival order: a draft run whose taps have not all arrived (they come
// from other nodes, on other links than the head's) holds the runs and cache operations after
// it until they do, or until it is cancelled. Cache operations: `remove` from a position to
// the end of a sequence (a crop; the block rows are never cached, so cropping at the block's
// start is a no-op), `remove` of everything, and a context shift (context_shift_ops); others
// are refused with an Error.
#pragma once

#include <memory>
#include <string>

#include <caf/actor.hpp>

#include "specmesh/actors/stage.hpp"
#include "specmesh/model/dflash_drafter.hpp"

namespace specmesh {

struct DFlashStageConfig {
  // The draft role's only stage: pipeline, nodes, device and router; `model` is the target's
  // (embedding table and classifier), `context.n_ctx` the most positions a sequence holds.
  StageConfig stage;
  std::shared_ptr<const DFlashDrafter> drafter;
  std::string tap_pipeline;  // the pipeline whose taps it takes (the target's)
  size_t window = 0;         // context rows a block attends to, the latest ones (0: all)
  // Target runs whose taps are kept while no draft run has used them; older ones are dropped.
  size_t max_tapped_runs = 64;
};

// Throws std::invalid_argument when the drafter does not fit the model (check_target's error).
caf::actor spawn_dflash_stage(caf::actor_system& sys, DFlashStageConfig cfg, std::shared_ptr<StageStats> stats);

}  // namespace specmesh
