#include "specmesh/topology.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include <toml++/toml.h>

#include "specmesh/kernels/kv_rows.hpp"
#include "specmesh/speculation/registry.hpp"
#include "specmesh/devices/tenstorrent.hpp"

namespace specmesh {

namespace {

namespace fs = std::filesystem;

// Builds "file:line: key: message" from a node's source position.
class Errors {
 public:
  explicit Errors(std::string file) : file_(std::move(file)) {}
  [[noreturn]] void fail(const toml::node* n, const std::string& key, const std::string& what) const {
    std::string where = file_;
    if (n && n->source().begin.line) where += ":" + std::to_string(n->source().begin.line);
    throw ConfigError(where + ": " + key + ": " + what);
  }

 private:
  std::string file_;
};

// An integer in [lo, hi]: a TOML integer, or a float that holds a whole number. Floats are
// checked here: toml++'s value<int64_t>() converts a float before it checks that it fits, which
// is undefined behaviour for 1e20.
int64_t integer(const Errors& e, const toml::node& n, const std::string& key, int64_t lo, int64_t hi,
                const std::string& expected = "expected an integer") {
  int64_t v = 0;
  if (const auto* i = n.as_integer()) {
    v = i->get();
  } else if (const auto* f = n.as_floating_point(); f && f->get() == std::floor(f->get()) && std::fabs(f->get()) < 0x1p63) {
    v = static_cast<int64_t>(f->get());
  } else {
    e.fail(&n, key, expected);
  }
  if (v < lo || v > hi)
    e.fail(&n, key, expected + " between " + std::to_string(lo) + " and " + std::to_string(hi) + ", not " + std::to_string(v));
  return v;
}

std::string number_text(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

template <class T>
T get(const Errors& e, const toml::table& t, const std::string& prefix, const std::string& key, T fallback) {
  const toml::node* n = t.get(key);
  if (!n) return fallback;
  if constexpr (std::is_same_v<T, std::string>) {
    if (auto v = n->value<std::string>()) return *v;
    e.fail(n, prefix + key, "expected a string");
  } else if constexpr (std::is_same_v<T, bool>) {
    if (auto v = n->value<bool>()) return *v;
    e.fail(n, prefix + key, "expected true or false");
  } else if constexpr (std::is_integral_v<T>) {
    constexpr int64_t hi = std::numeric_limits<T>::max() > uint64_t(INT64_MAX) ? INT64_MAX : int64_t(std::numeric_limits<T>::max());
    return static_cast<T>(integer(e, *n, prefix + key, std::numeric_limits<T>::min(), hi));
  } else {
    if (auto v = n->value<double>()) {
      if (std::isfinite(*v) && !(std::abs(*v) <= double(std::numeric_limits<T>::max())))
        e.fail(n, prefix + key, "must be a finite number, not " + number_text(*v));
      return static_cast<T>(*v);
    }
    e.fail(n, prefix + key, "expected a number");
  }
}

// A rate, duration or latency: finite and not negative (NaN passes every comparison, so the
// range is checked as "inside").
double non_negative(const Errors& e, const toml::table& t, const std::string& prefix, const std::string& key) {
  const double v = get<double>(e, t, prefix, key, 0);
  if (!std::isfinite(v)) e.fail(t.get(key), prefix + key, "must be a finite number, not " + number_text(v));
  if (!(v >= 0)) e.fail(t.get(key), prefix + key, "must not be negative, not " + number_text(v));
  return v;
}

void check_keys(const Errors& e, const toml::table& t, const std::string& prefix, std::set<std::string> allowed) {
  for (const auto& [k, v] : t)
    if (!allowed.count(std::string(k.str()))) e.fail(&v, prefix + std::string(k.str()), "unknown key");
}

// A [run.params] value: a number, true/false, or a list of integers (an array, or a string
// such as "1,1,3"); the strategy's schema checks it later.
ParamValue param_value(const Errors& e, const toml::node& v, const std::string& key) {
  if (auto b = v.value<bool>(); b && v.is_boolean()) return ParamValue(*b ? 1.0 : 0.0);
  if (auto d = v.value<double>()) return ParamValue(*d);
  const char* expected = "expected a number, true/false, or a list of integers";
  std::vector<int> list;
  if (const toml::array* a = v.as_array()) {
    for (const toml::node& x : *a) {
      const auto* i = x.as_integer();
      if (!i || i->get() < INT32_MIN || i->get() > INT32_MAX) e.fail(&x, key, "expected integers in the list");
      list.push_back(int(i->get()));
    }
    return ParamValue(std::move(list));
  }
  if (auto text = v.value<std::string>()) {
    auto parsed = parse_int_list(*text);
    if (!parsed) e.fail(&v, key, std::string(expected) + ", not \"" + *text + "\"");
    return ParamValue(std::move(*parsed));
  }
  e.fail(&v, key, expected);
}

const toml::table& table_at(const Errors& e, const toml::node& n, const std::string& key) {
  if (!n.is_table()) e.fail(&n, key, "expected a table");
  return *n.as_table();
}

std::string resolve_path(const std::string& base, const std::string& p) {
  if (p.empty() || fs::path(p).is_absolute()) return p;
  return (fs::path(base) / p).lexically_normal().string();
}

// A model given as a directory: a block drafter's (config.json + model.safetensors). A path the
// system cannot look at (too long, say) is not one; loading it says what is wrong.
bool is_drafter_dir(const ModelSpec& m) {
  std::error_code ec;
  return fs::is_directory(m.path, ec);
}

}  // namespace

Topology Topology::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError(path + ": cannot open the topology file");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), path, fs::absolute(path).parent_path().string());
}

Topology Topology::parse(const std::string& text, const std::string& file, const std::string& base_dir) {
  Errors e(file);
  toml::table root;
  try {
    root = toml::parse(text, file);
  } catch (const toml::parse_error& err) {
    throw ConfigError(file + ":" + std::to_string(err.source().begin.line) + ": " + std::string(err.description()));
  }
  check_keys(e, root, "", {"run", "models", "nodes", "devices", "stages", "link", "security"});
  Topology t;
  t.path = file;

  if (const toml::node* n = root.get("models")) {
    for (const auto& [name, v] : table_at(e, *n, "models")) {
      const std::string pre = "models." + std::string(name.str()) + ".";
      const auto& m = table_at(e, v, pre);
      check_keys(e, m, pre, {"path", "tokenizer"});
      ModelSpec s{std::string(name.str()), resolve_path(base_dir, get<std::string>(e, m, pre, "path", "")),
                  resolve_path(base_dir, get<std::string>(e, m, pre, "tokenizer", ""))};
      if (s.path.empty()) e.fail(&v, pre + "path", "every model needs a path");
      t.models[s.name] = s;
    }
  }
  if (t.models.empty()) e.fail(nullptr, "models", "at least one model is needed");

  const toml::node* runn = root.get("run");
  if (!runn) e.fail(nullptr, "run", "missing [run] table");
  {
    const auto& r = table_at(e, *runn, "run");
    check_keys(e, r, "run.", {"model", "strategy", "draft", "roles", "n_predict", "n_ctx", "kv_type", "temperature", "top_k", "top_p",
                              "min_p", "seed", "params", "metrics_csv"});
    RunSpec& s = t.run;
    t.lines["run"] = runn->source().begin.line;
    auto line_of = [&](const toml::node* n, const std::string& key) {
      if (n) t.lines[key] = n->source().begin.line;
    };
    line_of(r.get("model"), "run.model");
    line_of(r.get("draft"), "run.draft");
    line_of(r.get("n_ctx"), "run.n_ctx");
    line_of(r.get("kv_type"), "run.kv_type");
    s.model = get<std::string>(e, r, "run.", "model", t.models.size() == 1 ? t.models.begin()->first : "");
    if (!t.models.count(s.model)) e.fail(r.get("model"), "run.model", "names no model in [models]: '" + s.model + "'");
    s.strategy = get<std::string>(e, r, "run.", "strategy", "");
    line_of(r.get("strategy"), "run.strategy");
    if (!s.strategy.empty() && !find_strategy(s.strategy))
      e.fail(r.get("strategy"), "run.strategy", "unknown strategy \"" + s.strategy + "\" (registered: " + strategy_names() + ")");
    s.draft = get<std::string>(e, r, "run.", "draft", "");
    if (!s.draft.empty() && !t.models.count(s.draft)) e.fail(r.get("draft"), "run.draft", "names no model in [models]: '" + s.draft + "'");
    if (const toml::node* rn = r.get("roles")) {
      for (const auto& [k, v] : table_at(e, *rn, "run.roles")) {
        const std::string key = "run.roles." + std::string(k.str());
        auto m = v.value<std::string>();
        if (!m) e.fail(&v, key, "expected a model name");
        if (k.str() == kTargetRole || k.str() == "draft")
          e.fail(&v, key, "set this role with run." + std::string(k.str() == kTargetRole ? "model" : "draft"));
        if (!t.models.count(*m)) e.fail(&v, key, "names no model in [models]: '" + *m + "'");
        s.roles[std::string(k.str())] = *m;
        line_of(&v, key);
      }
    }
    s.n_predict = get<int>(e, r, "run.", "n_predict", 128);
    s.n_ctx = get<int>(e, r, "run.", "n_ctx", 0);
    s.kv_type = get<std::string>(e, r, "run.", "kv_type", kv_type_name(kDefaultKvType));
    try {
      s.kv_type = kv_type_name(parse_kv_type(s.kv_type));
    } catch (const std::invalid_argument& x) {
      e.fail(r.get("kv_type"), "run.kv_type", x.what());
    }
    s.temperature = get<float>(e, r, "run.", "temperature", 0.0f);
    s.top_k = get<int>(e, r, "run.", "top_k", 0);
    s.top_p = get<float>(e, r, "run.", "top_p", 1.0f);
    s.min_p = get<float>(e, r, "run.", "min_p", 0.0f);
    s.seed = get<uint64_t>(e, r, "run.", "seed", 0);
    s.metrics_csv = resolve_path(base_dir, get<std::string>(e, r, "run.", "metrics_csv", ""));
    if (s.n_predict <= 0) e.fail(r.get("n_predict"), "run.n_predict", "must be positive");
    // NaN passes every comparison, so each range is checked as "inside", never as "not outside".
    if (!std::isfinite(s.temperature))
      e.fail(r.get("temperature"), "run.temperature", "must be a finite number, not " + number_text(s.temperature));
    if (!(s.temperature >= 0)) e.fail(r.get("temperature"), "run.temperature", "must not be negative");
    if (!(s.top_k >= 0)) e.fail(r.get("top_k"), "run.top_k", "must not be negative (0: off)");
    if (!(s.top_p >= 0 && s.top_p <= 1)) e.fail(r.get("top_p"), "run.top_p", "must be between 0 and 1, not " + number_text(s.top_p));
    if (!(s.min_p >= 0 && s.min_p <= 1)) e.fail(r.get("min_p"), "run.min_p", "must be between 0 and 1, not " + number_text(s.min_p));
    if (!(s.n_ctx >= 0)) e.fail(r.get("n_ctx"), "run.n_ctx", "must not be negative (0: the model's own)");
    if (const toml::node* p = r.get("params")) {
      line_of(p, "run.params");
      for (const auto& [k, v] : table_at(e, *p, "run.params")) {
        const std::string key = "run.params." + std::string(k.str());
        s.params[std::string(k.str())] = param_value(e, v, key);
        line_of(&v, key);
      }
    }
  }

  if (const toml::node* n = root.get("nodes")) {
    for (const auto& [name, v] : table_at(e, *n, "nodes")) {
      const std::string pre = "nodes." + std::string(name.str()) + ".";
      const auto& m = table_at(e, v, pre);
      check_keys(e, m, pre, {"endpoint", "head"});
      NodeSpec s{std::string(name.str()), get<std::string>(e, m, pre, "endpoint", ""), get<bool>(e, m, pre, "head", false)};
      if (s.endpoint.rfind("inproc://", 0) != 0 && s.endpoint.rfind("ipc://", 0) != 0 && s.endpoint.rfind("tcp://", 0) != 0)
        e.fail(m.get("endpoint") ? m.get("endpoint") : &v, pre + "endpoint", "must start with inproc://, ipc:// or tcp://");
      t.lines[pre + "endpoint"] = (m.get("endpoint") ? m.get("endpoint") : &v)->source().begin.line;
      if (s.head) {
        if (!t.head_node.empty()) e.fail(&v, pre + "head", "only one node can host the head (already: " + t.head_node + ")");
        t.head_node = s.name;
      }
      t.nodes[s.name] = s;
    }
  }
  if (t.nodes.empty()) {
    // No [nodes]: everything runs in this process.
    t.nodes["local"] = {"local", "inproc://specmesh-local", true};
    t.head_node = "local";
  }
  if (t.head_node.empty()) e.fail(root.get("nodes"), "nodes", "one node needs head = true");

  if (const toml::node* n = root.get("devices")) {
    for (const auto& [name, v] : table_at(e, *n, "devices")) {
      const std::string pre = "devices." + std::string(name.str()) + ".";
      const auto& m = table_at(e, v, pre);
      check_keys(e, m, pre, {"node", "threads", "profile", "standby", "virtual_context", "virtual_layers"});
      DeviceSpec s;
      s.name = std::string(name.str());
      s.node = get<std::string>(e, m, pre, "node", t.head_node);
      if (!t.nodes.count(s.node)) e.fail(m.get("node"), pre + "node", "names no node in [nodes]: '" + s.node + "'");
      s.threads = get<int>(e, m, pre, "threads", 1);
      if (s.threads < 1 || s.threads > 256) e.fail(m.get("threads"), pre + "threads", "must be between 1 and 256");
      s.standby = get<bool>(e, m, pre, "standby", false);
      if (const toml::node* p = m.get("profile")) {
        if (auto pname = p->value<std::string>()) {
          s.profile = device_profile(*pname);
          if (!s.profile) e.fail(p, pre + "profile", "unknown profile '" + *pname + "' (" + device_profile_names() + ")");
        } else {
          const auto& pt = table_at(e, *p, pre + "profile");
          check_keys(e, pt, pre + "profile.", {"flops_per_s", "bytes_per_s", "op_overhead_us", "layer_ms", "layer_token_ms"});
          DeviceProfile d;
          d.name = s.name;
          d.flops_per_s = non_negative(e, pt, pre + "profile.", "flops_per_s");
          d.bytes_per_s = non_negative(e, pt, pre + "profile.", "bytes_per_s");
          d.op_overhead_s = non_negative(e, pt, pre + "profile.", "op_overhead_us") * 1e-6;
          d.layer_s = non_negative(e, pt, pre + "profile.", "layer_ms") * 1e-3;
          d.layer_token_s = non_negative(e, pt, pre + "profile.", "layer_token_ms") * 1e-3;
          s.profile = d;
        }
      }
      if (const toml::node* vc = m.get("virtual_context")) {
        std::string accelerators;
        for (const std::string& a : accelerator_profile_names()) accelerators += (accelerators.empty() ? "" : ", ") + a;
        // The context a measured profile's curves are read at, whatever the real context is:
        // a long context's timing with a small model.
        if (!s.profile || (!s.profile->times && !s.profile->forward))
          e.fail(vc, pre + "virtual_context", "needs a profile with measured per-op timing (" + accelerators + ")");
        s.profile->virtual_context = integer(e, *vc, pre + "virtual_context", 1, int64_t(1) << 40,
                                             "expected a number of keys");
      }
      if (const toml::node* vl = m.get("virtual_layers")) {
        // A forward pass timed as this many layers (a small model standing in for a deep one).
        if (!s.profile) e.fail(vl, pre + "virtual_layers", "needs a profile to time the layers with");
        s.profile->virtual_layers =
            int(integer(e, *vl, pre + "virtual_layers", 1, 100000, "expected a number of layers"));
      }
      t.devices[s.name] = s;
    }
  }
  if (t.devices.empty()) t.devices["cpu"] = {"cpu", t.head_node, 1, std::nullopt};

  if (const toml::node* n = root.get("link")) {
    if (auto pname = n->value<std::string>()) {
      auto l = link_profile(*pname);
      if (!l) e.fail(n, "link", "unknown link profile '" + *pname + "' (" + link_profile_names() + ")");
      t.link = *l;
    } else {
      const auto& lt = table_at(e, *n, "link");
      check_keys(e, lt, "link.", {"latency_us", "gbps"});
      t.link.latency_s = non_negative(e, lt, "link.", "latency_us") * 1e-6;
      t.link.bytes_per_s = non_negative(e, lt, "link.", "gbps") * 1e9 / 8;
    }
  }

  if (const toml::node* n = root.get("security")) {
    const auto& st = table_at(e, *n, "security");
    check_keys(e, st, "security.", {"keys", "allow_remote"});
    t.lines["security"] = n->source().begin.line;
    t.security.keys = get<std::string>(e, st, "security.", "keys", "");
    if (const toml::node* k = st.get("keys")) {
      if (t.security.keys.empty()) e.fail(k, "security.keys", "must name a directory");
      t.lines["security.keys"] = k->source().begin.line;
    }
    t.security.keys = resolve_path(base_dir, t.security.keys);
    if (const toml::node* a = st.get("allow_remote")) {
      // Strictly a boolean: a security switch is not turned on by a stray 1.
      if (!a->is_boolean()) e.fail(a, "security.allow_remote", "expected true or false");
      t.security.allow_remote = a->as_boolean()->get();
      t.lines["security.allow_remote"] = a->source().begin.line;
    }
  }

  if (const toml::node* n = root.get("stages")) {
    const toml::array* arr = n->as_array();
    if (!arr) e.fail(n, "stages", "expected an array of tables ([[stages]])");
    for (size_t i = 0; i < arr->size(); ++i) {
      const std::string pre = "stages[" + std::to_string(i) + "].";
      const auto& m = table_at(e, *arr->get(i), pre);
      check_keys(e, m, pre, {"model", "role", "device", "layers", "fraction", "tensor_parallel"});
      StageSpec s;
      s.line = m.source().begin.line;
      s.role = get<std::string>(e, m, pre, "role", "");
      const std::map<std::string, std::string> roles = t.role_models();
      if (!s.role.empty() && !roles.count(s.role))
        e.fail(m.get("role"), pre + "role", "names no pipeline role of [run]: '" + s.role + "'");
      s.model = get<std::string>(e, m, pre, "model", s.role.empty() ? t.run.model : roles.at(s.role));
      if (!t.models.count(s.model)) e.fail(m.get("model"), pre + "model", "names no model in [models]: '" + s.model + "'");
      if (!s.role.empty() && s.model != roles.at(s.role))
        e.fail(m.get("model"), pre + "model", "role '" + s.role + "' runs model '" + roles.at(s.role) + "', not '" + s.model + "'");
      s.device = get<std::string>(e, m, pre, "device", t.devices.begin()->first);
      if (!t.devices.count(s.device)) e.fail(m.get("device"), pre + "device", "names no device in [devices]: '" + s.device + "'");
      if (t.devices.at(s.device).standby)
        e.fail(m.get("device"), pre + "device", "'" + s.device + "' is a standby device: it takes stages only on failover");
      if (const toml::node* tp = m.get("tensor_parallel")) {
        const toml::array* ta = tp->as_array();
        const std::string key = pre + "tensor_parallel";
        if (!ta || ta->empty()) e.fail(tp, key, "expected a list of the further devices' names");
        for (size_t k = 0; k < ta->size(); ++k) {
          const auto* name = ta->get(k)->as_string();
          if (!name) e.fail(ta->get(k), key, "expected device names (strings)");
          const std::string d = name->get();
          if (!t.devices.count(d)) e.fail(ta->get(k), key, "names no device in [devices]: '" + d + "'");
          if (t.devices.at(d).standby) e.fail(ta->get(k), key, "'" + d + "' is a standby device");
          if (t.devices.at(d).node != t.devices.at(s.device).node)
            e.fail(ta->get(k), key, "'" + d + "' is on node '" + t.devices.at(d).node + "', not on the stage's node '" +
                                        t.devices.at(s.device).node + "'");
          if (d == s.device || std::count(s.tensor_parallel.begin(), s.tensor_parallel.end(), d))
            e.fail(ta->get(k), key, "'" + d + "' is named twice in the stage");
          s.tensor_parallel.push_back(d);
        }
      }
      if (const toml::node* l = m.get("layers")) {
        const toml::array* la = l->as_array();
        const std::string expected = "expected [first, end) as two integers";
        if (!la || la->size() != 2) e.fail(l, pre + "layers", expected);
        s.layer_begin = int(integer(e, *la->get(0), pre + "layers", INT32_MIN, INT32_MAX, expected));
        s.layer_end = int(integer(e, *la->get(1), pre + "layers", INT32_MIN, INT32_MAX, expected));
        if (s.layer_begin < 0 || s.layer_end <= s.layer_begin) e.fail(l, pre + "layers", "must be [first, end) with first < end");
      } else {
        s.fraction = get<double>(e, m, pre, "fraction", 0);
        if (!(s.fraction > 0 && s.fraction <= 1)) e.fail(m.get("fraction") ? m.get("fraction") : arr->get(i), pre + "fraction",
                                                        "each stage needs layers = [a, b] or a fraction in (0, 1]");
      }
      // A split stage's ranks wait for each other inside a job, so a device that also ran
      // another stage's jobs could hold one rank while the other stage's rank waits behind it:
      // the devices of a split stage are its own.
      auto devices = [](const StageSpec& st) {
        std::vector<std::string> d{st.device};
        d.insert(d.end(), st.tensor_parallel.begin(), st.tensor_parallel.end());
        return d;
      };
      const std::vector<std::string> mine = devices(s);
      for (size_t k = 0; k < t.stages.size(); ++k) {
        const StageSpec& other = t.stages[k];
        if (s.tensor_parallel.empty() && other.tensor_parallel.empty()) continue;
        const std::vector<std::string> theirs = devices(other);
        for (const std::string& d : mine) {
          if (std::find(theirs.begin(), theirs.end(), d) == theirs.end()) continue;
          const std::string key = s.tensor_parallel.empty() ? "device" : "tensor_parallel";
          e.fail(m.get(key), pre + key, "device '" + d + "' also computes for stages[" + std::to_string(k) +
                                            "]; the devices of a tensor-parallel stage are its own");
        }
      }
      t.stages.push_back(s);
    }
  }
  t.check();
  return t;
}

std::map<std::string, std::string> Topology::role_models() const {
  std::map<std::string, std::string> out = run.roles;
  out[kTargetRole] = run.model;
  if (!run.draft.empty()) out["draft"] = run.draft;
  return out;
}

std::set<std::string> Topology::roles() const {
  std::set<std::string> out;
  for (const auto& [role, model] : role_models()) out.insert(role);
  return out;
}

void Topology::fail(const std::string& key, const std::string& what) const {
  auto it = lines.find(key);
  if (it == lines.end()) it = lines.find(key.substr(0, key.rfind('.')));
  throw ConfigError(path + (it != lines.end() ? ":" + std::to_string(it->second) : "") + ": " + key + ": " + what);
}

std::string Topology::role_key(const std::string& role) {
  return role == kTargetRole ? "run.model" : role == kDraftRole ? "run.draft" : "run.roles." + role;
}

void Topology::check() {
  if (run.model.empty() || !models.count(run.model)) fail("run.model", "names no model in [models]: '" + run.model + "'");
  std::map<std::string, std::string> roles = role_models();
  for (const auto& [role, model] : roles)
    if (!models.count(model)) fail(role_key(role), "names no model in [models]: '" + model + "'");
  std::set<std::string> present, drafters;
  for (const auto& [role, model] : roles) {
    present.insert(role);
    if (role != kTargetRole && is_drafter_dir(models.at(model))) drafters.insert(role);
  }
  const StrategyInfo* info = run.strategy.empty() ? &default_strategy(present, drafters) : find_strategy(run.strategy);
  if (!info) fail("run.strategy", "unknown strategy \"" + run.strategy + "\" (registered: " + strategy_names() + ")");
  run.strategy = info->name;
  // A block drafter's directory is a role's model only for a strategy that drafts with it in that
  // role: under any other (`--strategy ar` on a dflash setup) the role is not built at all.
  std::map<std::string, std::string> unbuilt;
  for (const std::string& role : drafters)
    if (role != info->drafter_role) unbuilt[role] = roles.at(role);
  for (const auto& [role, model] : unbuilt) {
    const std::vector<const StageSpec*> of_role = stages_of(role);
    std::erase_if(stages, [&](const StageSpec& s) { return std::ranges::find(of_role, &s) != of_role.end(); });
    if (role == kDraftRole) run.draft.clear();
    else run.roles.erase(role);
    roles.erase(role);
    present.erase(role);
  }
  // An attention-level speculation partner without a model of its own runs the target's.
  if (!info->pair_role.empty() && !roles.count(info->pair_role)) {
    run.roles[info->pair_role] = run.model;
    roles = role_models();
    present.insert(info->pair_role);
  }
  for (const auto& [k, v] : run.params) {
    try {
      info->resolve({{k, v}});
    } catch (const std::invalid_argument& err) {
      fail("run.params." + k, err.what());
    }
  }
  const StrategyParams params = info->resolve(run.params);
  for (const std::string& role : info->needed_roles(params)) {
    if (unbuilt.count(role))
      fail("run.strategy", "\"" + info->name + "\" needs a model for role \"" + role + "\", and " + role_key(role) +
                               " is a block drafter's directory (" + models.at(unbuilt.at(role)).path +
                               "), the draft of a block-drafting strategy only");
    if (!roles.count(role)) fail("run.strategy", "\"" + info->name + "\" needs a pipeline for role \"" + role + "\"");
  }
  if (info->check) {
    try {
      info->check(params, {run.n_ctx, present});
    } catch (const ParamConflict& c) {
      fail("run.params." + c.key, c.what());
    }
  }
  if (!nodes.count(head_node)) fail("nodes", "one node needs head = true");
  if (devices.empty()) fail("devices", "at least one device is needed");
  // A role without stages: one stage with all its layers on the first device of the head node.
  for (const auto& [role, model] : roles) {
    if (!stages_of(role).empty()) continue;
    std::string dev;
    for (const auto& [dn, d] : devices)
      if (d.node == head_node && !d.standby) { dev = dn; break; }
    if (dev.empty())
      for (const auto& [dn, d] : devices)
        if (!d.standby) { dev = dn; break; }
    if (dev.empty()) fail("devices", "every device is a standby: role '" + role + "' has nowhere to run");
    stages.push_back({model, role, dev, {}, -1, -1, 1.0, 0});
  }
}

Topology Topology::single_process(const ModelSpec& target, const std::map<std::string, ModelSpec>& roles, int threads) {
  Topology t;
  t.path = "(in-process configuration)";
  t.head_node = "local";
  // One inproc name per configuration, so several runtimes can live in one process.
  static std::atomic<int> instance{0};
  t.nodes["local"] = {"local", "inproc://specmesh-local-" + std::to_string(::getpid()) + "-" + std::to_string(instance++), true};
  t.models[kTargetRole] = target;
  t.models[kTargetRole].name = kTargetRole;
  t.run.model = kTargetRole;
  t.devices[kTargetRole] = {kTargetRole, "local", std::max(1, threads), std::nullopt};
  t.stages.push_back({kTargetRole, kTargetRole, kTargetRole, {}, -1, -1, 1.0, 0});
  for (const auto& [role, spec] : roles) {
    t.models[role] = spec;
    t.models[role].name = role;
    if (role == "draft") t.run.draft = role;
    else t.run.roles[role] = role;
    t.devices[role] = {role, "local", 1, std::nullopt};
    t.stages.push_back({role, role, role, {}, -1, -1, 1.0, 0});
  }
  return t;
}

std::vector<const StageSpec*> Topology::stages_of(const std::string& role) const {
  const auto roles = role_models();
  auto it = roles.find(role);
  std::vector<const StageSpec*> out;
  if (it == roles.end()) return out;
  // Stages tagged with the role, or else the untagged stages of its model.
  for (const auto& s : stages)
    if (s.role == role) out.push_back(&s);
  if (!out.empty()) return out;
  for (const auto& s : stages)
    if (s.role.empty() && s.model == it->second) out.push_back(&s);
  return out;
}

const NodeSpec& Topology::node_of_device(const std::string& device) const {
  return nodes.at(devices.at(device).node);
}

void Topology::resolve_layers(const std::string& role, int n_layer) {
  std::vector<StageSpec*> ss;
  for (const StageSpec* c : stages_of(role)) ss.push_back(const_cast<StageSpec*>(c));
  // Roles of one model share its untagged stages: say so, it is the likely cause.
  std::string shared;
  const auto roles = role_models();
  if (!ss.empty() && ss.front()->role.empty())
    for (const auto& [other, model] : roles)
      if (other != role && model == roles.at(role) && stages_of(other) == stages_of(role))
        shared = " (roles '" + role + "' and '" + other + "' both run model '" + model +
                 "' and so share its untagged stages; give one stages of its own with role = \"" +
                 (role == kTargetRole ? other : role) + "\")";
  auto fail = [&](const StageSpec* s, const std::string& what) {
    throw ConfigError(path + (s && s->line ? ":" + std::to_string(s->line) : "") + ": stages of role '" + role + "': " + what +
                      shared);
  };
  int next = 0;
  for (size_t i = 0; i < ss.size(); ++i) {
    StageSpec* s = ss[i];
    if (s->fraction > 0) {
      s->layer_begin = next;
      s->layer_end = i + 1 == ss.size() ? n_layer : std::min(n_layer, next + std::max(1, int(std::lround(s->fraction * n_layer))));
    }
    if (s->layer_begin != next)
      fail(s, "layers must follow on from the previous stage: expected a range starting at " + std::to_string(next) +
                  ", got [" + std::to_string(s->layer_begin) + ", " + std::to_string(s->layer_end) + ")");
    if (s->layer_end > n_layer || s->layer_end <= s->layer_begin)
      fail(s, "range [" + std::to_string(s->layer_begin) + ", " + std::to_string(s->layer_end) + ") does not fit the model's " +
                  std::to_string(n_layer) + " layers");
    next = s->layer_end;
  }
  if (next != n_layer) fail(ss.empty() ? nullptr : ss.back(), "stages cover layers [0, " + std::to_string(next) + ") of " + std::to_string(n_layer));
}

}  // namespace specmesh
