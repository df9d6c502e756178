// A topology that cannot work is refused when it is loaded, with the key and the reason,
// before any node starts: never a crash inside an actor, a hang or nonsense tokens later.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "private_dir.hpp"
#include "refdata.hpp"
#include "specmesh/model/synthetic.hpp"
#include "specmesh/runtime.hpp"
#include "specmesh/model/dflash_drafter.hpp"
#include "specmesh/model/kv_cache.hpp"
#include "specmesh/runtime/load_checks.hpp"

using namespace specmesh;
using specmesh::test::refdata;

namespace {

std::string tmpdir() {
  static const std::string dir = test::private_tmpdir("specmesh-load-checks");
  return dir;
}

std::string write(const std::string& name, const std::string& text) {
  const std::string path = tmpdir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

struct CliResult {
  int status;
  std::string out;
};

// The specmesh binary with stdout and stderr; a run that has not ended after a minute is
// killed and reported as status 124 (a hang is a failure here, never a stuck test).
CliResult cli(const std::string& args) {
  FILE* p = popen(("timeout -s KILL 60 " + std::string(SPECMESH_CLI_PATH) + " " + args + " 2>&1").c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), out};
}

std::string error_of(const std::string& topology_path) {
  try {
    Runtime rt(Topology::load(topology_path));
    return "no error";
  } catch (const ConfigError& e) {
    return e.what();
  }
}

}  // namespace

// n_ctx = 2e9 asked for terabytes of KV cache: std::bad_alloc inside a stage actor, then a
// head waiting forever for its logits.
TEST(LoadChecks, ContextThatDoesNotFitInMemoryIsRefusedWithTheKey) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string model = refdata("gguf-models/stories260K.gguf");
  const std::string topo = write("huge-ctx.toml", "[models.m]\npath = \"" + model + "\"\n[run]\nn_ctx = 2e9\n");
  auto r = cli("run " + topo + " -p hi -n 4");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find(topo + ":4: run.n_ctx: a context of 2000000000 tokens needs "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("GiB of KV cache"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("memory"), std::string::npos) << r.out;

  auto g = cli("generate -m " + model + " -c 2000000000 -p hi -n 4");
  EXPECT_EQ(g.status, 1) << g.out;
  EXPECT_NE(g.out.find("a context of 2000000000 tokens needs "), std::string::npos) << g.out;

  // Several stages of one node share its memory; spawned nodes are checked before they start.
  const std::string split = write("huge-ctx-split.toml",
                                  "[models.m]\npath = \"" + model + "\"\n[run]\nn_ctx = 400000000\n"
                                  "[nodes.head]\nendpoint = \"ipc://" + tmpdir() + "/head\"\nhead = true\n"
                                  "[nodes.n0]\nendpoint = \"ipc://" + tmpdir() + "/n0\"\n"
                                  "[devices.a]\nnode = \"n0\"\n[devices.b]\nnode = \"n0\"\n"
                                  "[[stages]]\ndevice = \"a\"\nlayers = [0, 3]\n[[stages]]\ndevice = \"b\"\nlayers = [3, 5]\n");
  auto s = cli("run " + split + " --spawn -p hi -n 4");
  EXPECT_EQ(s.status, 1) << s.out;
  EXPECT_NE(s.out.find(split + ":4: run.n_ctx: a context of 400000000 tokens needs "), std::string::npos) << s.out;
  EXPECT_NE(s.out.find("node 'n0'"), std::string::npos) << s.out;

  // Sizes that fit still run.
  auto ok = cli("run " + write("ctx-ok.toml", "[models.m]\npath = \"" + model + "\"\n[run]\nn_ctx = 4096\n") +
               " -p hi -n 4 --json");
  EXPECT_EQ(ok.status, 0) << ok.out;
}

// A node's stages share its memory: each cache may fit while all of them together do not.
TEST(LoadChecks, StagesOfOneNodeShareItsMemory) {
  SPECMESH_REQUIRE_REFDATA();
  Topology t = Topology::parse("[models.m]\npath = \"" + refdata("gguf-models/stories260K.gguf") +
                                   "\"\n[run]\nn_ctx = 1000\n[nodes.head]\nendpoint = \"inproc://h\"\nhead = true\n"
                                   "[nodes.n0]\nendpoint = \"ipc:///tmp/n0\"\n[devices.a]\nnode = \"n0\"\n[devices.b]\nnode = \"n0\"\n"
                                   "[[stages]]\ndevice = \"a\"\nlayers = [0, 3]\n[[stages]]\ndevice = \"b\"\nlayers = [3, 5]\n",
                               "t.toml", "/");
  ModelCache models;
  resolve_layers(t, models);
  // stories260K: 32 key and 32 value F16 values per cell and layer, 128 bytes; 5 layers of 1000 cells.
  const uint64_t all = 5 * 1000 * 128;
  EXPECT_NO_THROW(check_kv_memory(t, models, {"head", "n0"}, all));
  try {
    check_kv_memory(t, models, {"head", "n0"}, all - 1);
    FAIL() << "expected an error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("t.toml:4: run.n_ctx: a context of 1000 tokens needs 625.0 KiB of KV cache on node 'n0', "
                                         "more than this machine's 625.0 KiB of memory"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(check_kv_memory(t, models, {"head"}, 1));  // no stages there
  // An F32 cache needs twice as much, a Q8_0 one 34 bytes per 32 values.
  t.run.kv_type = "f32";
  EXPECT_NO_THROW(check_kv_memory(t, models, {"head", "n0"}, 2 * all));
  EXPECT_THROW(check_kv_memory(t, models, {"head", "n0"}, 2 * all - 1), ConfigError);
  t.run.kv_type = "q8_0";
  EXPECT_NO_THROW(check_kv_memory(t, models, {"head", "n0"}, all / 64 * 34));
  EXPECT_THROW(check_kv_memory(t, models, {"head", "n0"}, all / 64 * 34 - 1), ConfigError);
}

// A DFlash drafter's cache counts on its node: K and V of every context row its window keeps,
// per drafter layer.
TEST(LoadChecks, ADraftersCacheCountsOnItsNode) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string drafter = std::string(SPECMESH_SOURCE_DIR) + "/models/dflash-stories-target-1M";
  for (const int window : {0, 100}) {
    SCOPED_TRACE("window " + std::to_string(window));
    Topology t = Topology::parse("[models.m]\npath = \"" + refdata("gguf-models/stories-target-1M.gguf") +
                                     "\"\n[models.d]\npath = \"" + drafter +
                                     "\"\n[run]\nmodel = \"m\"\ndraft = \"d\"\nstrategy = \"dflash\"\nn_ctx = 1000\n"
                                     "[run.params]\nwindow = " + std::to_string(window) +
                                     "\n[nodes.head]\nendpoint = \"inproc://h\"\nhead = true\n[devices.a]\nnode = \"head\"\n[devices.b]\nnode = \"head\"\n"
                                     "[[stages]]\nmodel = \"m\"\ndevice = \"a\"\nfraction = 1.0\n"
                                     "[[stages]]\nmodel = \"d\"\ndevice = \"b\"\nfraction = 1.0\n",
                                 "t.toml", "/");
    ModelCache models;
    resolve_layers(t, models);
    const HParams& hp = Model::load(refdata("gguf-models/stories-target-1M.gguf"))->hparams();
    const uint64_t target = KvCache::bytes_needed(1000, hp.n_layer, hp.kv_dim());
    // The drafter: its layers (from its config.json), each K and V of its KV heads, in F32 (its
    // own cache); the window keeps 64 rows more for crops.
    const DFlashConfig dc = DFlashDrafter::load(drafter)->config();
    ASSERT_EQ(dc.kv_dim(), 64);  // 4 KV heads of 16
    const uint64_t draft = KvCache::bytes_needed(window ? window + 64 : 1000, dc.n_layer, dc.kv_dim(), DType::F32);
    ASSERT_GT(draft, 0u);
    EXPECT_NO_THROW(check_kv_memory(t, models, {"head"}, target + draft));
    EXPECT_THROW(check_kv_memory(t, models, {"head"}, target + draft - 1), ConfigError);
  }
}

// A draft with another vocabulary proposes ids that mean other text to the target: its
// size alone can agree (512 and 512 here) while the tokens differ.
TEST(LoadChecks, DraftWithAnotherVocabularyIsRefusedNamingBothModels) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string target = refdata("gguf-models/stories260K.gguf");
  SyntheticSpec s;  // a synthetic vocabulary of the same size
  s.n_vocab = 512;
  const std::string other = tmpdir() + "/synthetic-vocab.gguf";
  write_synthetic_model(s, other);
  const std::string head = "[models.t]\npath = \"" + target + "\"\n[models.d]\npath = \"";
  const std::string run = "\"\n[run]\nmodel = \"t\"\ndraft = \"d\"\n";
  const std::string texts = error_of(write("other-texts.toml", head + other + run));
  EXPECT_NE(texts.find("other-texts.toml:7: run.draft: model 'd' (" + other + ") and the target's model 't' (" + target +
                       ") have different vocabularies: token "),
            std::string::npos)
      << texts;

  s.n_vocab = 600;
  const std::string bigger = tmpdir() + "/synthetic-vocab-600.gguf";
  write_synthetic_model(s, bigger);
  const std::string size = error_of(write("other-size.toml", head + bigger + run));
  EXPECT_NE(size.find("other-size.toml:7: run.draft: model 'd' (" + bigger + ") and the target's model 't' (" + target +
                      ") have different vocabularies: 600 tokens and 512"),
            std::string::npos)
      << size;

  // Another file with the same vocabulary is fine.
  EXPECT_EQ(error_of(write("same-vocab.toml", head + refdata("gguf-models/stories260K-draft-tiny.gguf") + run)), "no error");
}
