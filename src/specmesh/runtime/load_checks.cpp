#include "specmesh/runtime/load_checks.hpp"

#include <algorithm>

#include "specmesh/model/context.hpp"
#include "specmesh/model/kv_cache.hpp"
#include "specmesh/speculation/registry.hpp"

namespace specmesh {

namespace {

// Token text for messages: quoted, control bytes escaped.
std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    if (c < 0x20 || c == '"' || c == '\\') {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    } else {
      out += char(c);
    }
  }
  return out + "\"";
}

}  // namespace

void check_vocabularies(const Topology& topo, ModelCache& models) {
  const ModelSpec& target_spec = topo.models.at(topo.run.model);
  const auto target = models.get(target_spec);
  const std::vector<std::string>& want = target->tokenizer().vocab().tokens;
  for (const auto& [role, name] : topo.role_models()) {
    const ModelSpec& spec = topo.models.at(name);
    std::shared_ptr<const DFlashDrafter> drafter;
    try {
      drafter = role_drafter(topo, models, role);
      if (drafter) drafter->check_target(*target);  // it borrows the target's vocabulary
    } catch (const std::exception& e) {
      topo.fail(Topology::role_key(role), e.what());
    }
    if (drafter) continue;
    const auto model = models.get(spec);
    if (model == target) continue;
    const std::string both = "model '" + name + "' (" + spec.path + ") and the target's model '" + topo.run.model + "' (" +
                             target_spec.path + ") have different vocabularies: ";
    const int n = model->hparams().n_vocab, n_target = target->hparams().n_vocab;
    if (n != n_target) topo.fail(Topology::role_key(role), both + std::to_string(n) + " tokens and " + std::to_string(n_target));
    const std::vector<std::string>& have = model->tokenizer().vocab().tokens;
    // Every token: the first few hundred of SPM vocabularies are the same specials and byte
    // tokens in all of them, so a prefix would not tell two vocabularies apart.
    for (size_t i = 0; i < std::max(have.size(), want.size()); ++i) {
      const std::string* a = i < have.size() ? &have[i] : nullptr;
      const std::string* b = i < want.size() ? &want[i] : nullptr;
      if (a && b && *a == *b) continue;
      topo.fail(Topology::role_key(role), both + "token " + std::to_string(i) + " is " + (a ? quoted(*a) : "missing") +
                                              " in '" + name + "' and " + (b ? quoted(*b) : "missing") + " in '" +
                                              topo.run.model + "'");
    }
  }
}

void check_kv_memory(const Topology& topo, ModelCache& models, const std::vector<std::string>& nodes,
                     uint64_t memory_bytes) {
  if (memory_bytes == 0) memory_bytes = physical_memory_bytes();
  for (const std::string& node : nodes) {
    uint64_t bytes = 0;
    int n_ctx = 0;
    for (const auto& [role, name] : topo.role_models()) {
      const auto drafter = role_drafter(topo, models, role);
      const auto model = role_model(topo, models, role);
      const int cells = context_size(*model, topo.run.n_ctx);
      n_ctx = std::max(n_ctx, cells);
      for (const StageSpec* s : topo.stages_of(role)) {
        if (topo.node_of_device(s->device).name != node) continue;
        if (!drafter) {
          bytes += KvCache::bytes_needed(cells, s->layer_end - s->layer_begin, model->hparams().kv_dim(),
                                         parse_kv_type(topo.run.kv_type));
          continue;
        }
        // The draft cache: K and V of the context rows its window keeps, per drafter layer.
        const StrategyInfo& info = strategy(topo.run.strategy);
        const int window = info.param("window") ? info.resolve(topo.run.params).integer("window") : 0;
        const int rows = window > 0 ? std::min(cells, window + int(DFlashState::kCropSlack)) : cells;
        bytes += KvCache::bytes_needed(rows, drafter->config().n_layer, drafter->config().kv_dim(), DType::F32);
      }
    }
    if (bytes > memory_bytes)
      topo.fail("run.n_ctx", "a context of " + std::to_string(n_ctx) + " tokens needs " + bytes_text(bytes) +
                                 " of KV cache on node '" + node + "', more than this machine's " + bytes_text(memory_bytes) +
                                 " of memory");
  }
}

}  // namespace specmesh
