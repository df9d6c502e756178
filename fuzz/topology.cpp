// The topology file: TOML text parsed and checked as `specmesh run` does. Every input either
// gives a topology or is refused with a ConfigError; a topology's every role has stages on
// devices of known nodes, and resolving its layers either fails with a ConfigError or gives
// ranges that tile the model's layers in order.
#include <cstddef>
#include <cstdint>
#include <string>

#include "check.hpp"
#include "specmesh/topology.hpp"

using namespace specmesh;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  Topology t;
  try {
    t = Topology::parse(text, "fuzz.toml", "/fuzz");
  } catch (const ConfigError& e) {
    FUZZ_REQUIRE(std::string(e.what()).starts_with("fuzz.toml"));
    return 0;
  }
  FUZZ_REQUIRE(t.nodes.count(t.head_node) == 1 && t.nodes.at(t.head_node).head);
  FUZZ_REQUIRE(!t.run.strategy.empty());
  for (const auto& [role, model] : t.role_models()) {
    FUZZ_REQUIRE(t.models.count(model) == 1);
    const auto stages = t.stages_of(role);
    FUZZ_REQUIRE(!stages.empty());
    for (const StageSpec* s : stages) {
      FUZZ_REQUIRE(t.devices.count(s->device) == 1);
      (void)t.node_of_device(s->device);
    }
    for (int n_layer : {1, 3, 32}) {
      Topology u = t;
      try {
        u.resolve_layers(role, n_layer);
      } catch (const ConfigError&) {
        continue;
      }
      int next = 0;
      for (const StageSpec* s : u.stages_of(role)) {
        FUZZ_REQUIRE(s->layer_begin == next && s->layer_end > s->layer_begin);
        next = s->layer_end;
      }
      FUZZ_REQUIRE(next == n_layer);
    }
  }
  return 0;
}
