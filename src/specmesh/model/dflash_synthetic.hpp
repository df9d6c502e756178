// Random-weight DFlash drafters in the published layout, shaped for a given target: for tests
// and benchmarks of the decode loop (they propose poorly, which exercises rejection).
#pragma once

#include <cstdint>
#include <string>

#include "specmesh/model/dflash_config.hpp"
#include "specmesh/model/model.hpp"

namespace specmesh {

// A drafter config for `target`: its hidden size, layer count and vocabulary, z-lab's default
// taps for n_taps, and the mask id (the last vocabulary row: the random targets have no spare
// one, so the drafter borrows a real token's embedding, which DFlash allows).
DFlashConfig dflash_config_for(const Model& target, int n_layer, int n_taps, int block_size);

// Writes DIR/config.json and DIR/model.safetensors (F16) with weights drawn from `seed`.
// Throws FormatError when the files cannot be written.
void write_random_dflash_drafter(const DFlashConfig& c, const std::string& dir, uint64_t seed);

}  // namespace specmesh
