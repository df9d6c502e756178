// Quality of attention-level speculation against lambda (a small version of the ALSpec
// paper's Table 1): on the reference models, long prompts (most of a 512-token context) are
// decoded greedily through the two-device pair for each lambda, and compared with plain
// greedy decoding that uses the same attention layout (so lambda = 0 would match bit for bit).
//
// Reported per model, S and lambda: the hit rate over speculated attentions (all of them here,
// since every context exceeds 2S), the share of generated tokens equal to plain decoding at the
// same index, the share before the first difference, and the share of gated ops (before and
// after attention, both devices) that were skipped: 50% would mean every layer overlapped.
// The "plain" row compares plain decoding with the default attention layout against the one
// with S: what rounding alone changes.
//
// Usage: bench_alspec_quality [refdata_dir] (default: $SPECMESH_REFDATA, else ../shared/refdata)
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "specmesh/model/generate.hpp"
#include "specmesh/speculation/alspec_pair.hpp"

namespace {

using namespace specmesh;

constexpr int kCtx = 512;
constexpr int kPromptLen = 400;
constexpr int kGenerate = 96;
constexpr int kPrompts = 8;
constexpr float kLambdas[] = {0.05f, 0.10f, 0.15f, 0.20f, 0.25f};
constexpr size_t kSpecLens[] = {16, 32};

// In-distribution long prompts: the model's own sampled continuation of a story opening.
std::vector<int32_t> make_prompt(const Model& m, uint64_t seed) {
  Context ctx(m, {.n_ctx = kCtx});
  GenerateParams gp;
  gp.n_predict = kPromptLen - 8;
  gp.sampling.temperature = 0.8f;
  gp.sampling.seed = seed;
  gp.ignore_eos = true;
  std::vector<int32_t> prompt = m.tokenizer().encode("Once upon a time", true);
  generate(ctx, prompt, gp, [&](int32_t t) { prompt.push_back(t); return true; });
  return prompt;
}

struct Tally {
  long hits = 0, speculated = 0, same = 0, prefix = 0, tokens = 0, skipped = 0, gated = 0;
  void add_ids(const std::vector<int32_t>& got, const std::vector<int32_t>& want) {
    size_t p = 0;
    while (p < got.size() && got[p] == want[p]) ++p;
    for (size_t i = 0; i < got.size(); ++i) same += got[i] == want[i];
    prefix += long(p);
    tokens += long(got.size());
  }
};

double pct(long a, long b) { return b ? 100.0 * double(a) / double(b) : 0.0; }

std::vector<int32_t> pair_greedy(AlspecPair& pair, const std::vector<int32_t>& prompt, int n, Tally& t) {
  std::vector<int32_t> out = pair.greedy(prompt, n, [&](const AlspecToken& tok, int32_t, int32_t) {
    for (size_t il = 0; il < tok.hits.size(); ++il) {
      t.speculated += !tok.checks[il].exact;
      t.hits += tok.hits[il] && !tok.checks[il].exact;
    }
  });
  for (int d = 0; d < 2; ++d) {
    const AlspecWork& w = pair.work(d);
    t.skipped += w.pre_skipped + w.post_skipped;
    t.gated += w.pre_run + w.pre_skipped + w.post_run + w.post_skipped;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = argc > 1 ? argv[1] : "";
  if (dir.empty()) dir = std::getenv("SPECMESH_REFDATA") ? std::getenv("SPECMESH_REFDATA") : "../shared/refdata";
  const char* models[] = {"stories260K", "stories260K-draft-small", "stories260K-draft-tiny", "stories-target-1M"};

  std::printf("ALSpec quality vs lambda: %d prompts of %d tokens per model, %d greedy tokens each, context %d\n",
              kPrompts, kPromptLen, kGenerate, kCtx);
  std::printf("%-24s %3s %6s %8s %10s %11s %9s\n", "model", "S", "lambda", "hit %", "same ids %", "prefix %",
              "skipped %");
  for (const char* name : models) {
    auto m = Model::load(dir + "/gguf-models/" + name + ".gguf");
    std::vector<std::vector<int32_t>> prompts;
    for (int p = 0; p < kPrompts; ++p) prompts.push_back(make_prompt(*m, 100 + p));
    for (size_t S : kSpecLens) {
      const FlashLayout layout{S, S, 32};
      std::vector<std::vector<int32_t>> plain;
      Tally rounding;  // plain decoding with the default layout against this one: rounding only
      for (const auto& prompt : prompts) {
        Context ctx(*m, {.n_ctx = kCtx, .attention_layout = layout});
        plain.push_back(greedy_ids(ctx, prompt, kGenerate, true));
        Context def(*m, {.n_ctx = kCtx});
        rounding.add_ids(greedy_ids(def, prompt, kGenerate, true), plain.back());
      }
      std::printf("%-24s %3zu %6s %8s %10.1f %11.1f %9s\n", name, S, "plain", "-", pct(rounding.same, rounding.tokens),
                  pct(rounding.prefix, rounding.tokens), "-");
      for (float lambda : kLambdas) {
        Tally t;
        for (size_t p = 0; p < prompts.size(); ++p) {
          AlspecPair pair(*m, {.spec = {layout, lambda}, .n_ctx = kCtx});
          t.add_ids(pair_greedy(pair, prompts[p], kGenerate, t), plain[p]);
        }
        std::printf("%-24s %3zu %6.2f %8.1f %10.1f %11.1f %9.1f\n", name, S, lambda, pct(t.hits, t.speculated),
                    pct(t.same, t.tokens), pct(t.prefix, t.tokens), pct(t.skipped, t.gated));
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
