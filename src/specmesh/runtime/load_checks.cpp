#include "specmesh/runtime/load_checks.hpp"

#include <algorithm>

#include "specmesh/model/context.hpp"
#include "specmesh/model/kv_cache.hpp"

namespace specmesh {

void check_kv_memory(const Topology& topo, ModelCache& models, const std::vector<std::string>& nodes,
                     uint64_t memory_bytes) {
  if (memory_bytes == 0) memory_bytes = physical_memory_bytes();
  for (const std::string& node : nodes) {
    uint64_t bytes = 0;
    int n_ctx = 0;
    for (const auto& [role, name] : topo.role_models()) {
      const auto model = models.get(topo.models.at(name));
      const int cells = context_size(*model, topo.run.n_ctx);
      n_ctx = std::max(n_ctx, cells);
      for (const StageSpec* s : topo.stages_of(role))
        if (topo.node_of_device(s->device).name == node)
          bytes += KvCache::bytes_needed(cells, s->layer_end - s->layer_begin, model->hparams().kv_dim());
    }
    if (bytes > memory_bytes)
      topo.fail("run.n_ctx", "a context of " + std::to_string(n_ctx) + " tokens needs " + bytes_text(bytes) +
                                 " of KV cache on node '" + node + "', more than this machine's " + bytes_text(memory_bytes) +
                                 " of memory");
  }
}

}  // namespace specmesh
