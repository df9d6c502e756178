// The values a chat template computes with, and Python's rules for them: what is true, how a
// value prints ({{ x }} is Python's str(x)), equality and order, and JSON in and out.
//
// Values are JSON-like (the context comes from JSON) plus Jinja's undefined, namespace()
// objects and callables (macros, methods, globals). Lists and dicts are immutable once made,
// as in Hugging Face's ImmutableSandboxedEnvironment; only a namespace's attributes change.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace specmesh::jinja {

// A template that cannot be read or rendered; what() names the template line and column.
class Error : public std::runtime_error {
 public:
  Error(int line, int column, const std::string& message);
  int line() const { return line_; }
  int column() const { return column_; }

 private:
  int line_, column_;
};

// The template called raise_exception(message); what() is the message, verbatim.
class Raised : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An operation Python would refuse (a TypeError, an undefined value used); the renderer adds
// the line and column and rethrows it as Error.
class ValueError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // in insertion order, as Python's dict

struct Args {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keywords;
};
using Function = std::function<Value(Args&)>;

struct Value {
  enum class Kind { Undefined, None, Bool, Int, Float, String, List, Dict, Namespace, Function };

  Kind kind = Kind::Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // String; for Undefined, why it is undefined ("'x' is undefined")
  std::shared_ptr<const List> list;
  std::shared_ptr<const Dict> dict;
  std::shared_ptr<Dict> ns;  // Namespace: shared, its attributes may be set
  std::shared_ptr<const Function> fn;

  static Value undefined(std::string why);
  static Value none();
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value number(double v);
  static Value string(std::string v);
  static Value make_list(List v);
  static Value make_dict(Dict v);
  static Value make_namespace(Dict v);
  static Value function(Function f);

  bool is(Kind k) const { return kind == k; }
  bool is_number() const { return kind == Kind::Int || kind == Kind::Float || kind == Kind::Bool; }
  double as_double() const { return kind == Kind::Float ? f : kind == Kind::Bool ? double(b) : double(i); }
  // A dict's or namespace's entry; nullptr when there is none.
  const Value* find(std::string_view key) const;
};

// Python's truth: empty strings, lists and dicts, zero, None and undefined are false.
bool truthy(const Value& v);
// Python's str(): what {{ v }} prints. Undefined prints nothing.
std::string to_str(const Value& v);
// Python's repr() (strings quoted, as inside a printed list).
std::string repr(const Value& v);
// Python's type names, for error messages ("str", "list", "NoneType").
std::string type_name(const Value& v);
// Python's ==, and < for numbers, strings and lists (ValueError for others).
bool equals(const Value& a, const Value& b);
bool less(const Value& a, const Value& b);
// Python's len(); ValueError for values without one.
int64_t length(const Value& v);
// The items a for loop visits: a list's elements, a dict's keys, a string's characters.
List iterate(const Value& v);

Value from_json(const nlohmann::ordered_json& j);
// json.dumps(v, ensure_ascii=False, indent=indent, sort_keys=False), as Hugging Face's tojson
// filter writes it; indent < 0 is None. ValueError for what JSON cannot hold.
std::string to_json_text(const Value& v, int indent);

// UTF-8 helpers: code points of a string and back.
std::u32string utf8_decode(std::string_view s);
std::string utf8_encode(std::u32string_view s);

}  // namespace specmesh::jinja
