#include "specmesh/model/retrieval_cache.hpp"

#include <algorithm>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

namespace specmesh {

std::shared_ptr<const RetrievalView> build_retrieval_view(const Context& ctx, int32_t fresh_from, int32_t chunk,
                                                          int32_t budget) {
  if (chunk < 1 || budget < 1)
    throw std::invalid_argument("retrieval cache: chunk " + std::to_string(chunk) + " and budget " +
                                std::to_string(budget) + " must be positive");
  if (fresh_from < 1 || ctx.last_query_pos() != fresh_from - 1)
    throw std::invalid_argument("retrieval cache over " + std::to_string(fresh_from) +
                                " positions needs the query of position " + std::to_string(fresh_from - 1) +
                                ", but the last forward pass ended at " + std::to_string(ctx.last_query_pos()));
  // Views select cells per KV head of the whole model; a tensor-parallel rank holds a few.
  if (ctx.tp().size > 1) throw std::invalid_argument("retrieval cache: not built for a tensor-parallel rank");
  const HParams& hp = ctx.model().hparams();
  const KvCache& kv = ctx.kv();
  const int D = hp.head_dim, H = hp.n_head_kv, group = hp.n_head / hp.n_head_kv;

  // Sequence 0's cell of each prompt position (-1: none).
  std::vector<int32_t> cell_of(static_cast<size_t>(fresh_from), -1);
  for (int c = 0; c < kv.n_cells(); ++c) {
    const KvCell& cell = kv.cell(c);
    if ((cell.seqs & seq_bit(0)) && cell.pos >= 0 && cell.pos < fresh_from) cell_of[size_t(cell.pos)] = c;
  }
  if (cell_of.back() < 0)
    throw std::invalid_argument("retrieval cache: sequence 0 has no cell at position " + std::to_string(fresh_from - 1));

  const int32_t n_chunks = (fresh_from + chunk - 1) / chunk;
  std::vector<std::vector<int32_t>> ranks;
  ranks.reserve(size_t(ctx.layer_end() - ctx.layer_begin()) * H);
  std::vector<double> mean(static_cast<size_t>(D)), score(static_cast<size_t>(n_chunks));
  std::vector<float> key(static_cast<size_t>(D));
  std::vector<int32_t> order(static_cast<size_t>(n_chunks));
  for (int il = ctx.layer_begin(); il < ctx.layer_end(); ++il) {
    const KvRows keys = kv.rows(il);
    const std::vector<float>& q = ctx.last_query(il);
    for (int h = 0; h < H; ++h) {
      for (int32_t c = 0; c < n_chunks; ++c) {
        std::fill(mean.begin(), mean.end(), 0.0);
        int n = 0;
        for (int32_t p = c * chunk; p < std::min(fresh_from, (c + 1) * chunk); ++p) {
          if (cell_of[size_t(p)] < 0) continue;  // a position the sequence does not hold
          kv_load(keys.type, keys.k_row(cell_of[size_t(p)]), size_t(h) * D, size_t(D), key.data());
          const float* k = key.data();
          for (int d = 0; d < D; ++d) mean[size_t(d)] += k[d];
          ++n;
        }
        double s = 0;
        for (int g = 0; g < group; ++g) {
          const float* qg = q.data() + size_t(h * group + g) * D;
          for (int d = 0; d < D; ++d) s += double(qg[d]) * mean[size_t(d)];
        }
        score[size_t(c)] = n > 0 ? s / n : -std::numeric_limits<double>::infinity();
      }
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin() + 1, order.end(), [&](int32_t a, int32_t b) { return score[size_t(a)] > score[size_t(b)]; });
      std::vector<int32_t> rank(static_cast<size_t>(fresh_from));
      int32_t next = 0;
      for (int32_t c : order)
        for (int32_t p = c * chunk; p < std::min(fresh_from, (c + 1) * chunk); ++p) rank[size_t(p)] = next++;
      ranks.push_back(std::move(rank));
    }
  }
  return std::make_shared<RetrievalView>(ctx.layer_begin(), H, budget, std::min(chunk, fresh_from), fresh_from,
                                         std::move(ranks));
}

}  // namespace specmesh
