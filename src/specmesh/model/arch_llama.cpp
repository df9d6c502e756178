// Llama (and llama2.c checkpoints): no attention extras; RoPE rotates interleaved pairs.
#include "specmesh/model/arch.hpp"
#include "specmesh/model/model.hpp"

namespace specmesh {

const ArchSpec kLlamaArch{
    Arch::Llama, "llama", RopeStyle::Interleaved,
    [](const VectorLoader&, const std::string&, const HParams&, LayerWeights&) {},
    [](const HParams&, const LayerWeights&, int, int, float*, float*, float*) {},
};

}  // namespace specmesh
