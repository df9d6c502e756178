// Strategy parameters: each strategy declares a schema (name, type, range, default, help), and
// every way of setting a parameter (the topology's [run.params], `--param key=value`, the
// classic CLI flags) is parsed and checked against it in one place.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "specmesh/topology.hpp"

namespace specmesh {

// IntList: integers each in [min, max], at most max_len of them, at least one ("1,1,3").
enum class ParamType { Int, Float, Bool, IntList };
const char* to_string(ParamType t);

struct ParamSpec {
  std::string name;
  ParamType type = ParamType::Float;
  double min = 0, max = 0;          // inclusive range (Int and Float; each IntList element)
  double fallback = 0;              // the default (Bool: 0 or 1)
  std::string help;                 // one line
  std::vector<std::string> flags;   // CLI aliases ("--pa"); for a Bool, the flag sets !default
  std::vector<int> fallback_list{};  // IntList: the default (empty: not set)
  size_t max_len = 0;               // IntList: most elements

  ParamValue default_value() const;
};

// Checked values of one strategy's parameters, defaults filled in.
class StrategyParams {
 public:
  StrategyParams() = default;
  explicit StrategyParams(std::map<std::string, ParamValue> values) : values_(std::move(values)) {}
  // Throws std::out_of_range naming the parameter when the schema has no such name.
  double number(const std::string& name) const;
  int integer(const std::string& name) const { return int(number(name)); }
  float real(const std::string& name) const { return float(number(name)); }
  bool flag(const std::string& name) const { return number(name) != 0; }
  const std::vector<int>& list(const std::string& name) const;
  const std::map<std::string, ParamValue>& values() const { return values_; }

 private:
  const ParamValue& at(const std::string& name) const;
  std::map<std::string, ParamValue> values_;
};

// Integers separated by commas ("1,1,3"), each written as a plain number; nullopt otherwise.
std::optional<std::vector<int>> parse_int_list(const std::string& text);
// The text parse_int_list reads back: "1,1,3" (empty for an empty list).
std::string format_int_list(const std::vector<int>& list);

// Parses a parameter's text ("4", "0.3", "true", "1,1,3") against its spec; nullopt and *why
// set when it is not a value of the parameter's type in its range (NaN and infinities never are).
std::optional<ParamValue> parse_param(const ParamSpec& spec, const std::string& text, std::string* why);
// The same check for a value that arrived typed (TOML, code); `integral` says a number was
// written as an integer.
std::optional<ParamValue> check_param(const ParamSpec& spec, const ParamValue& value, bool integral, std::string* why);

// "n_draft (int, 1..64, default 4)": how errors and listings describe a parameter.
std::string describe(const ParamSpec& spec);
std::string format_value(const ParamSpec& spec, const ParamValue& value);

}  // namespace specmesh
