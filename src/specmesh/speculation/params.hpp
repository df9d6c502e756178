// Strategy parameters: each strategy declares a schema (name, type, range, default, help), and
// every way of setting a parameter (the topology's [run.params], `--param key=value`, the
// classic CLI flags) is parsed and checked against it in one place.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace specmesh {

enum class ParamType { Int, Float, Bool };
const char* to_string(ParamType t);

struct ParamSpec {
  std::string name;
  ParamType type = ParamType::Float;
  double min = 0, max = 0;          // inclusive range (Int and Float)
  double fallback = 0;              // the default (Bool: 0 or 1)
  std::string help;                 // one line
  std::vector<std::string> flags;   // CLI aliases ("--pa"); for a Bool, the flag sets !default
};

// Checked values of one strategy's parameters, defaults filled in.
class StrategyParams {
 public:
  StrategyParams() = default;
  explicit StrategyParams(std::map<std::string, double> values) : values_(std::move(values)) {}
  // Throws std::out_of_range naming the parameter when the schema has no such name.
  double number(const std::string& name) const;
  int integer(const std::string& name) const { return int(number(name)); }
  float real(const std::string& name) const { return float(number(name)); }
  bool flag(const std::string& name) const { return number(name) != 0; }
  const std::map<std::string, double>& values() const { return values_; }

 private:
  std::map<std::string, double> values_;
};

// Parses a parameter's text ("4", "0.3", "true") against its spec; nullopt and *why set when it
// is not a value of the parameter's type in its range (NaN and infinities never are).
std::optional<double> parse_param(const ParamSpec& spec, const std::string& text, std::string* why);
// The same check for a number that arrived typed (TOML); `integral` says it was written as one.
std::optional<double> check_param(const ParamSpec& spec, double value, bool integral, std::string* why);

// "n_draft (int, 1..64, default 4)": how errors and listings describe a parameter.
std::string describe(const ParamSpec& spec);
std::string format_value(const ParamSpec& spec, double value);

}  // namespace specmesh
