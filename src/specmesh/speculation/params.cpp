#include "specmesh/speculation/params.hpp"

#include <cmath>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

namespace specmesh {

const char* to_string(ParamType t) {
  switch (t) {
    case ParamType::Int: return "int";
    case ParamType::Float: return "float";
    case ParamType::Bool: return "bool";
  }
  return "?";
}

double StrategyParams::number(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) throw std::out_of_range("strategy parameter '" + name + "' is not set");
  return it->second;
}

std::string format_value(const ParamSpec& spec, double v) {
  if (spec.type == ParamType::Bool) return v != 0 ? "true" : "false";
  if (spec.type == ParamType::Int) return std::to_string(int64_t(v));
  std::ostringstream s;
  s << v;
  return s.str();
}

std::string describe(const ParamSpec& spec) {
  std::string d = spec.name + " (" + to_string(spec.type);
  if (spec.type != ParamType::Bool) d += ", " + format_value(spec, spec.min) + ".." + format_value(spec, spec.max);
  return d + ", default " + format_value(spec, spec.fallback) + ")";
}

std::optional<double> check_param(const ParamSpec& spec, double v, bool integral, std::string* why) {
  auto fail = [&](const std::string& w) -> std::optional<double> {
    if (why) *why = w;
    return std::nullopt;
  };
  if (!std::isfinite(v)) return fail("must be a finite number");
  switch (spec.type) {
    case ParamType::Bool:
      if (v != 0 && v != 1) return fail("expected true or false");
      return v;
    case ParamType::Int:
      if (!integral && v != std::floor(v)) return fail("expected an integer");
      break;
    case ParamType::Float: break;
  }
  if (v < spec.min || v > spec.max)
    return fail("must be between " + format_value(spec, spec.min) + " and " + format_value(spec, spec.max) + ", not " +
                format_value(spec, v));
  return v;
}

std::optional<double> parse_param(const ParamSpec& spec, const std::string& text, std::string* why) {
  if (spec.type == ParamType::Bool) {
    if (text == "true" || text == "1" || text == "on" || text == "yes") return 1.0;
    if (text == "false" || text == "0" || text == "off" || text == "no") return 0.0;
    if (why) *why = "expected true or false, not '" + text + "'";
    return std::nullopt;
  }
  const char* b = text.c_str();
  char* e = nullptr;
  const double v = std::strtod(b, &e);
  if (text.empty() || e != b + text.size()) {
    if (why) *why = std::string("expected ") + (spec.type == ParamType::Int ? "an integer" : "a number") + ", not '" + text + "'";
    return std::nullopt;
  }
  return check_param(spec, v, false, why);
}

}  // namespace specmesh
