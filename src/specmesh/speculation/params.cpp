#include "specmesh/speculation/params.hpp"

#include <charconv>
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
    case ParamType::IntList: return "int list";
  }
  return "?";
}

ParamValue ParamSpec::default_value() const {
  if (type == ParamType::IntList) return ParamValue(fallback_list);
  return ParamValue(fallback);
}

const ParamValue& StrategyParams::at(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) throw std::out_of_range("strategy parameter '" + name + "' is not set");
  return it->second;
}

double StrategyParams::number(const std::string& name) const { return at(name).number; }
const std::vector<int>& StrategyParams::list(const std::string& name) const { return at(name).list; }

namespace {
std::string format_number(ParamType t, double v) {
  if (t == ParamType::Bool) return v != 0 ? "true" : "false";
  // Whole numbers as integers; one no int64_t holds (a checked value out of range, 1e308) as
  // the double it is.
  if ((t == ParamType::Int || t == ParamType::IntList) && std::fabs(v) < 9.2e18) return std::to_string(int64_t(v));
  // The shortest text that reads back as the same double ("0.1", not "0.10000000000000001"),
  // so a value passed on to another process's command line arrives unchanged.
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}
}  // namespace

std::string format_value(const ParamSpec& spec, const ParamValue& v) {
  if (spec.type != ParamType::IntList) return format_number(spec.type, v.number);
  return v.list.empty() ? "none" : format_int_list(v.list);
}

std::string format_int_list(const std::vector<int>& list) {
  std::string out;
  for (int x : list) {
    if (!out.empty()) out += ',';
    out += std::to_string(x);
  }
  return out;
}

std::string describe(const ParamSpec& spec) {
  std::string d = spec.name + " (" + to_string(spec.type);
  if (spec.type != ParamType::Bool) d += ", " + format_number(spec.type, spec.min) + ".." + format_number(spec.type, spec.max);
  if (spec.type == ParamType::IntList) d += " each, at most " + std::to_string(spec.max_len);
  return d + ", default " + format_value(spec, spec.default_value()) + ")";
}

std::optional<ParamValue> check_param(const ParamSpec& spec, const ParamValue& value, bool integral, std::string* why) {
  auto fail = [&](const std::string& w) -> std::optional<ParamValue> {
    if (why) *why = w;
    return std::nullopt;
  };
  auto in_range = [&](double v) -> std::optional<std::string> {
    if (v < spec.min || v > spec.max)
      return "must be between " + format_number(spec.type, spec.min) + " and " + format_number(spec.type, spec.max) +
             ", not " + format_number(spec.type, v);
    return std::nullopt;
  };
  if (spec.type == ParamType::IntList) {
    if (!value.is_list) return fail("expected a list of integers such as 1,1,3");
    if (value.list.empty()) return fail("must not be empty");
    if (value.list.size() > spec.max_len)
      return fail("has " + std::to_string(value.list.size()) + " entries, at most " + std::to_string(spec.max_len) + " are allowed");
    for (size_t i = 0; i < value.list.size(); ++i)
      if (auto bad = in_range(value.list[i])) return fail("entry " + std::to_string(i + 1) + " " + *bad);
    return value;
  }
  if (value.is_list) return fail("expected a single value, not a list");
  const double v = value.number;
  if (!std::isfinite(v)) return fail("must be a finite number");
  switch (spec.type) {
    case ParamType::Bool:
      if (v != 0 && v != 1) return fail("expected true or false");
      return value;
    case ParamType::Int:
      if (!integral && v != std::floor(v)) return fail("expected an integer");
      break;
    case ParamType::Float:
    case ParamType::IntList: break;
  }
  if (auto bad = in_range(v)) return fail(*bad);
  return value;
}

std::optional<std::vector<int>> parse_int_list(const std::string& text) {
  std::vector<int> list;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    const char* b = item.c_str();
    char* e = nullptr;
    const double v = std::strtod(b, &e);
    if (item.empty() || e != b + item.size() || v != std::floor(v) || std::fabs(v) > 1e9) return std::nullopt;
    list.push_back(int(v));
    at = comma + 1;
  }
  return list;
}

std::optional<ParamValue> parse_param(const ParamSpec& spec, const std::string& text, std::string* why) {
  auto number = [&](const std::string& t, const char* expected) -> std::optional<double> {
    const char* b = t.c_str();
    char* e = nullptr;
    const double v = std::strtod(b, &e);
    if (t.empty() || e != b + t.size()) {
      if (why) *why = std::string("expected ") + expected + ", not '" + text + "'";
      return std::nullopt;
    }
    return v;
  };
  switch (spec.type) {
    case ParamType::Bool:
      if (text == "true" || text == "1" || text == "on" || text == "yes") return ParamValue(1.0);
      if (text == "false" || text == "0" || text == "off" || text == "no") return ParamValue(0.0);
      if (why) *why = "expected true or false, not '" + text + "'";
      return std::nullopt;
    case ParamType::IntList: {
      auto list = parse_int_list(text);
      if (!list) {
        if (why) *why = "expected integers separated by commas, such as 1,1,3, not '" + text + "'";
        return std::nullopt;
      }
      return check_param(spec, ParamValue(std::move(*list)), true, why);
    }
    case ParamType::Int:
    case ParamType::Float: break;
  }
  auto v = number(text, spec.type == ParamType::Int ? "an integer" : "a number");
  if (!v) return std::nullopt;
  return check_param(spec, ParamValue(*v), false, why);
}

}  // namespace specmesh
