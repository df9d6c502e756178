// The structure the design holds to, checked on the source tree itself: layers include only
// downward, no include cycles, a public face that pulls in nothing of the internals, and
// strategies named only in their own files and the registry.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "specmesh/speculation/registry.hpp"

namespace fs = std::filesystem;

namespace {

const fs::path kRoot = SPECMESH_SOURCE_DIR;

// Lowest first; a folder may include its own files and those of lower levels only.
const std::map<std::string, int> kLevel = {
    {"kernels", 0}, {"messages", 0}, {"log", 0}, {"formats", 1}, {"tokenizer", 2}, {"devices", 2}, {"model", 3},
    {"speculation", 4}, {"transport", 5}, {"actors", 6}, {"runtime", 7}, {"chat", 8}, {"serve", 9}, {"cli", 10}};

struct Source {
  std::string folder;                 // layer folder, or "api" for include/specmesh
  std::vector<std::string> includes;  // project includes, as written ("specmesh/model/model.hpp")
  std::vector<std::string> system;    // <...> includes
};

std::string text_of(const fs::path& p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Every project file, keyed by its include path ("specmesh/model/model.hpp").
std::map<std::string, Source> scan() {
  std::map<std::string, Source> out;
  static const std::regex inc(R"(^\s*#\s*include\s*([<"])([^>"]+)[>"])");
  auto add = [&](const fs::path& file, const std::string& key, const std::string& folder) {
    Source s{folder, {}, {}};
    std::ifstream in(file);
    for (std::string line; std::getline(in, line);) {
      std::smatch m;
      if (!std::regex_search(line, m, inc)) continue;
      (m[1] == "\"" ? s.includes : s.system).push_back(m[2]);
    }
    out[key] = std::move(s);
  };
  for (const auto& e : fs::recursive_directory_iterator(kRoot / "src" / "specmesh")) {
    if (!e.is_regular_file()) continue;
    const fs::path rel = fs::relative(e.path(), kRoot / "src");
    add(e.path(), rel.string(), rel.begin()->string() == "specmesh" ? std::next(rel.begin())->string() : "");
  }
  for (const auto& e : fs::directory_iterator(kRoot / "include" / "specmesh"))
    add(e.path(), "specmesh/" + e.path().filename().string(), "api");
  return out;
}

// The folder an include path points into: "specmesh/model/x.hpp" -> model, "specmesh/x.hpp" -> api.
std::string folder_of(const std::string& include) {
  const size_t a = include.find('/'), b = include.find('/', a + 1);
  return b == std::string::npos ? "api" : include.substr(a + 1, b - a - 1);
}

}  // namespace

TEST(Layers, EveryFolderIsALayer) {
  for (const auto& e : fs::directory_iterator(kRoot / "src" / "specmesh"))
    EXPECT_TRUE(kLevel.count(e.path().filename().string())) << e.path() << " is not in the layer list";
}

TEST(Layers, IncludesGoDownwardOnly) {
  const auto files = scan();
  ASSERT_GT(files.size(), 50u);
  for (const auto& [key, src] : files) {
    for (const std::string& inc : src.includes) {
      ASSERT_EQ(inc.rfind("specmesh/", 0), 0u) << key << " includes \"" << inc << "\" without the specmesh/ prefix";
      ASSERT_TRUE(files.count(inc) || inc.ends_with(".def")) << key << " includes \"" << inc << "\", which does not exist";
      const std::string to = folder_of(inc);
      if (src.folder == "api") {
        EXPECT_EQ(to, "api") << "public header " << key << " includes the internal \"" << inc << "\"";
        continue;
      }
      if (to == "api" || to == src.folder) continue;  // the public plain-data face is below everything
      EXPECT_LT(kLevel.at(to), kLevel.at(src.folder)) << key << " (" << src.folder << ") includes \"" << inc
                                                      << "\" from the same or a higher layer (" << to << ")";
    }
  }
}

TEST(Layers, PublicHeadersNeedNoThirdPartyHeaders) {
  for (const auto& [key, src] : scan()) {
    if (src.folder != "api") continue;
    for (const std::string& sys : src.system)
      EXPECT_EQ(sys.find_first_of("./"), std::string::npos) << key << " includes <" << sys << ">, not a standard header";
  }
}

TEST(Layers, NoIncludeCycles) {
  const auto files = scan();
  std::map<std::string, int> state;  // 0 new, 1 on the stack, 2 done
  std::vector<std::string> stack;
  std::function<void(const std::string&)> visit = [&](const std::string& f) {
    state[f] = 1;
    stack.push_back(f);
    for (const std::string& inc : files.at(f).includes) {
      if (!files.count(inc)) continue;
      if (state[inc] == 1) {
        std::string cycle;
        for (auto it = std::find(stack.begin(), stack.end(), inc); it != stack.end(); ++it) cycle += *it + " -> ";
        ADD_FAILURE() << "include cycle: " << cycle << inc;
      } else if (state[inc] == 0) {
        visit(inc);
      }
    }
    stack.pop_back();
    state[f] = 2;
  };
  for (const auto& [f, src] : files)
    if (state[f] == 0) visit(f);
}

// Adding a strategy is its own file plus one registry line: nothing else may name it.
TEST(Layers, StrategiesAreNamedOnlyInTheirFilesAndTheRegistry) {
  std::vector<fs::path> sources;
  for (const char* dir : {"src", "bench", "examples", "include"})
    for (const auto& e : fs::recursive_directory_iterator(kRoot / dir))
      if (e.is_regular_file() && (e.path().extension() == ".cpp" || e.path().extension() == ".hpp"))
        sources.push_back(e.path());
  ASSERT_FALSE(specmesh::strategies().empty());
  for (const specmesh::StrategyInfo& s : specmesh::strategies()) {
    const fs::path own = kRoot / "src/specmesh/speculation" / ("strategy_" + s.name + ".cpp");
    ASSERT_TRUE(fs::exists(own)) << s.name << " is not in its own file " << own;
    for (const fs::path& p : sources) {
      if (p == own || p.filename().string().rfind("registry.", 0) == 0) continue;
      EXPECT_EQ(text_of(p).find("\"" + s.name + "\""), std::string::npos) << p << " names the strategy \"" << s.name << "\"";
    }
  }
}
