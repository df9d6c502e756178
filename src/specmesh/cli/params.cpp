#include "specmesh/cli/params.hpp"

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "specmesh/kernels/kv_rows.hpp"
#include "specmesh/speculation/registry.hpp"

namespace specmesh {

CLI::Validator finite_in(double lo, double hi) {
  auto check = [lo, hi](std::string& text) -> std::string {
    double v = 0;
    if (!CLI::detail::lexical_cast(text, v)) return "expected a number, not " + text;
    if (!std::isfinite(v)) return "must be a finite number, not " + text;
    if (!(v >= lo && v <= hi)) {
      std::ostringstream o;
      o << "must be between " << lo << " and " << hi << ", not " << text;
      return o.str();
    }
    return {};
  };
  std::ostringstream d;
  d << "FINITE in [" << lo << " - " << hi << "]";
  return CLI::Validator(check, d.str());
}


namespace {
const ParamSpec& spec_of(const std::string& name) {
  static const std::vector<ParamSpec> all = all_params();
  for (const ParamSpec& p : all)
    if (p.name == name) return p;
  std::string known;
  for (const ParamSpec& p : all) known += (known.empty() ? "" : ", ") + p.name;
  throw std::invalid_argument("--param " + name + ": no strategy has this parameter (" + known + ")");
}
}  // namespace

void ParamOptions::add_to(CLI::App& cmd) {
  cmd.add_option("--param", pairs_, "strategy parameter KEY=VALUE (repeatable; `specmesh strategies` lists them)");
  for (const ParamSpec& p : all_params()) {
    if (p.flags.empty()) continue;
    std::string names;
    for (const auto& f : p.flags) names += (names.empty() ? "" : ",") + f;
    first_flag_[p.name] = p.flags.front();
    if (p.type == ParamType::Bool) {
      auto seen = std::make_shared<bool>(false);
      switched_[p.name] = seen;
      cmd.add_flag(names, *seen, p.help + " (sets " + p.name + " = " + format_value(p, ParamValue(p.fallback != 0 ? 0.0 : 1.0)) + ")");
    } else {
      auto v = std::make_shared<std::string>();
      aliased_[p.name] = v;
      cmd.add_option(names, *v, p.help + " (parameter " + describe(p) + ")");
    }
  }
}

std::map<std::string, ParamValue> ParamOptions::values(const CLI::App& cmd) const {
  std::map<std::string, ParamValue> out;
  auto put = [&](const std::string& key, const std::string& text, const std::string& where) {
    const ParamSpec& spec = spec_of(key);
    std::string why;
    auto v = parse_param(spec, text, &why);
    if (!v) throw std::invalid_argument(where + ": " + describe(spec) + ": " + why);
    out[key] = *v;
  };
  for (const auto& [name, v] : aliased_)
    if (cmd.count(first_flag_.at(name)) > 0) put(name, *v, first_flag_.at(name));
  for (const auto& [name, seen] : switched_)
    if (*seen) out[name] = spec_of(name).fallback != 0 ? 0.0 : 1.0;
  for (const std::string& kv : pairs_) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) throw std::invalid_argument("--param " + kv + ": expected KEY=VALUE");
    put(kv.substr(0, eq), kv.substr(eq + 1), "--param " + kv);
  }
  return out;
}

void add_kv_type_option(CLI::App& cmd, std::string& kv_type, const std::string& default_text) {
  cmd.add_option("--kv-type", kv_type,
                 "how the KV cache stores keys and values (default: " + default_text +
                     "): f16 (half of f32's memory and bandwidth), q8_0 (about a quarter; needs rows of a multiple "
                     "of 32 values) or f32")
      ->transform(CLI::Validator(
          [](std::string& v) {
            try {
              v = kv_type_name(parse_kv_type(v));
              return std::string();
            } catch (const std::invalid_argument& e) {
              return std::string(e.what());
            }
          },
          "f16|q8_0|f32"));
}

void override_run(Topology& topo, const std::string& strategy, const std::map<std::string, ParamValue>& params) {
  if (!strategy.empty() && strategy != topo.run.strategy) {
    topo.run.strategy = strategy;
    topo.run.params.clear();
  }
  for (const auto& [k, v] : params) topo.run.params[k] = v;
}

void override_cache(Topology& topo, int n_ctx, const std::string& kv_type) {
  if (n_ctx >= 0) topo.run.n_ctx = n_ctx;
  if (!kv_type.empty()) topo.run.kv_type = kv_type;
}

}  // namespace specmesh
