#include "specmesh/speculation/registry.hpp"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace specmesh {

#define SPECMESH_STRATEGY(name) StrategyInfo strategy_info_##name();
#include "specmesh/speculation/strategies.def"
#undef SPECMESH_STRATEGY

const std::vector<StrategyInfo>& strategies() {
  static const std::vector<StrategyInfo> all = {
#define SPECMESH_STRATEGY(name) strategy_info_##name(),
#include "specmesh/speculation/strategies.def"
#undef SPECMESH_STRATEGY
  };
  return all;
}

const ParamSpec* StrategyInfo::param(const std::string& key) const {
  for (const ParamSpec& p : params)
    if (p.name == key) return &p;
  return nullptr;
}

std::vector<std::string> StrategyInfo::needed_roles(const StrategyParams& params) const {
  return roles_needed ? roles_needed(params) : roles;
}

StrategyParams StrategyInfo::resolve(const std::map<std::string, ParamValue>& given) const {
  std::map<std::string, ParamValue> values;
  for (const ParamSpec& p : params) values[p.name] = p.default_value();
  for (const auto& [k, v] : given) {
    const ParamSpec* p = param(k);
    if (!p) {
      std::string known;
      for (const ParamSpec& q : params) known += (known.empty() ? "" : ", ") + q.name;
      throw std::invalid_argument("strategy \"" + name + "\" has no parameter '" + k + "'" +
                                  (known.empty() ? " (it takes none)" : " (it takes " + known + ")"));
    }
    std::string why;
    auto checked = check_param(*p, v, false, &why);
    if (!checked) throw std::invalid_argument("parameter " + describe(*p) + ": " + why);
    values[k] = *checked;
  }
  return StrategyParams(std::move(values));
}

int StrategyInfo::sequences_for(const StrategyParams& params, const std::set<std::string>& roles) const {
  return sequences ? std::clamp(sequences(params, roles), 1, kMaxSeqs) : kMaxSeqs;
}

int StrategyInfo::spare_cells_for(const StrategyParams& params, const std::set<std::string>& roles) const {
  return spare_cells ? std::max(0, spare_cells(params, roles)) : 0;
}

StrategyParams StrategyInfo::resolve_text(std::map<std::string, ParamValue> base,
                                          const std::vector<std::pair<std::string, std::string>>& text) const {
  for (const auto& [key, value] : text) {
    const ParamSpec* p = param(key);
    if (!p) {
      base[key] = ParamValue();  // resolve() names the unknown key and the known ones
      continue;
    }
    std::string why;
    auto parsed = parse_param(*p, value, &why);
    if (!parsed) throw std::invalid_argument("parameter " + describe(*p) + ": " + why);
    base[key] = *parsed;
  }
  return resolve(base);
}

const StrategyInfo* find_strategy(const std::string& name) {
  for (const StrategyInfo& s : strategies())
    if (s.name == name) return &s;
  return nullptr;
}

std::string strategy_names() {
  std::string out;
  for (const StrategyInfo& s : strategies()) out += (out.empty() ? "" : ", ") + s.name;
  return out;
}

const StrategyInfo& strategy(const std::string& name) {
  if (const StrategyInfo* s = find_strategy(name)) return *s;
  throw std::invalid_argument("unknown strategy \"" + name + "\" (registered: " + strategy_names() + ")");
}

const StrategyInfo& default_strategy(const std::set<std::string>& roles, const std::set<std::string>& drafter_roles) {
  // The default that uses the most of the roles present.
  const StrategyInfo* best = nullptr;
  for (const StrategyInfo& s : strategies()) {
    if (!s.default_for_roles) continue;
    const bool fits = std::all_of(s.roles.begin(), s.roles.end(), [&](const std::string& r) {
      return roles.count(r) && (r == s.drafter_role) == (drafter_roles.count(r) != 0);
    });
    if (fits && (!best || s.roles.size() > best->roles.size())) best = &s;
  }
  if (!best) throw std::logic_error("no registered default strategy fits these roles");
  return *best;
}

// One parameter under one name: the same meaning (help) or the same command-line flags.
bool same_param(const ParamSpec& a, const ParamSpec& b) {
  return a.name == b.name && (a.help == b.help || (!a.flags.empty() && a.flags == b.flags));
}

std::vector<ParamSpec> all_params() {
  std::vector<ParamSpec> out;
  for (const StrategyInfo& s : strategies())
    for (const ParamSpec& p : s.params)
      if (std::none_of(out.begin(), out.end(), [&](const ParamSpec& q) { return same_param(q, p); })) out.push_back(p);
  return out;
}

namespace {
std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}
}  // namespace

std::string strategies_markdown() {
  std::ostringstream o;
  o << "| strategy | roles | what the head does |\n|---|---|---|\n";
  for (const StrategyInfo& s : strategies()) o << "| `" << s.name << "` | " << join(s.roles, ", ") << " | " << s.summary << " |\n";
  o << "\n| parameter | strategies | type | range | default | flags | meaning |\n|---|---|---|---|---|---|---|\n";
  for (const ParamSpec& p : all_params()) {
    std::vector<std::string> users, flags;
    for (const StrategyInfo& s : strategies())
      if (s.param(p.name) && same_param(*s.param(p.name), p)) users.push_back(s.name);
    for (const auto& f : p.flags) flags.push_back("`" + f + "`");
    std::string range;
    if (p.type == ParamType::IntList)
      range = std::to_string(int(p.min)) + " – " + std::to_string(int(p.max)) + " each, at most " + std::to_string(p.max_len);
    else if (p.type != ParamType::Bool)
      range = format_value(p, ParamValue(p.min)) + " – " + format_value(p, ParamValue(p.max));
    o << "| `" << p.name << "` | " << join(users, ", ") << " | " << to_string(p.type) << " | " << range << " | "
      << format_value(p, p.default_value()) << " | " << join(flags, " ") << " | " << p.help << " |\n";
  }
  return o.str();
}

std::string strategies_text() {
  std::ostringstream o;
  for (const StrategyInfo& s : strategies()) {
    o << s.name << "  (roles: " << join(s.roles, ", ") << ")\n  " << s.summary << "\n";
    for (const ParamSpec& p : s.params) o << "    " << describe(p) << ": " << p.help << "\n";
  }
  return o.str();
}

}  // namespace specmesh
