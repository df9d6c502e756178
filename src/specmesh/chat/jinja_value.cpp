// Python's semantics for the values of a chat template: truth, str(), repr(), ==, <, len(),
// iteration and json.dumps.
#include "specmesh/chat/jinja_value.hpp"

#include <charconv>
#include <cmath>
#include <cstdio>

namespace specmesh::jinja {

Error::Error(int line, int column, const std::string& message)
    : std::runtime_error("chat template line " + std::to_string(line) + ", column " + std::to_string(column) + ": " +
                         message),
      line_(line),
      column_(column) {}

Value Value::undefined(std::string why) {
  Value v;
  v.s = std::move(why);
  return v;
}
Value Value::none() {
  Value v;
  v.kind = Kind::None;
  return v;
}
Value Value::boolean(bool x) {
  Value v;
  v.kind = Kind::Bool;
  v.b = x;
  return v;
}
Value Value::integer(int64_t x) {
  Value v;
  v.kind = Kind::Int;
  v.i = x;
  return v;
}
Value Value::number(double x) {
  Value v;
  v.kind = Kind::Float;
  v.f = x;
  return v;
}
Value Value::string(std::string x) {
  Value v;
  v.kind = Kind::String;
  v.s = std::move(x);
  return v;
}
Value Value::make_list(List x) {
  Value v;
  v.kind = Kind::List;
  v.list = std::make_shared<const List>(std::move(x));
  return v;
}
Value Value::make_dict(Dict x) {
  Value v;
  v.kind = Kind::Dict;
  v.dict = std::make_shared<const Dict>(std::move(x));
  return v;
}
Value Value::make_namespace(Dict x) {
  Value v;
  v.kind = Kind::Namespace;
  v.ns = std::make_shared<Dict>(std::move(x));
  return v;
}
Value Value::function(Function f) {
  Value v;
  v.kind = Kind::Function;
  v.fn = std::make_shared<const Function>(std::move(f));
  return v;
}

const Value* Value::find(std::string_view key) const {
  const Dict* d = kind == Kind::Dict ? dict.get() : kind == Kind::Namespace ? ns.get() : nullptr;
  if (!d) return nullptr;
  for (const auto& [k, v] : *d)
    if (k == key) return &v;
  return nullptr;
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined:
    case Value::Kind::None: return false;
    case Value::Kind::Bool: return v.b;
    case Value::Kind::Int: return v.i != 0;
    case Value::Kind::Float: return v.f != 0;
    case Value::Kind::String: return !v.s.empty();
    case Value::Kind::List: return !v.list->empty();
    case Value::Kind::Dict: return !v.dict->empty();
    case Value::Kind::Namespace:
    case Value::Kind::Function: return true;
  }
  return false;
}

namespace {

// Python's repr(float): the shortest text that reads back, with ".0" on whole numbers and an
// exponent from 1e16 on.
std::string float_text(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, x);
  std::string s(buf, end);
  if (std::abs(x) < 1e16 && std::abs(x) >= 1e-4) {
    auto [e2, ec2] = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::fixed);
    s.assign(buf, e2);
  }
  if (s.find_first_of(".einf") == std::string::npos) s += ".0";
  return s;
}

std::string str_repr(const std::string& s) {
  const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    const auto u = uint8_t(c);
    if (c == q || c == '\\') out += '\\', out += c;
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (u < 0x20 || u == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", u);
      out += buf;
    } else out += c;
  }
  return out += q;
}

void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (char c : s) {
    const auto u = uint8_t(c);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (u < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", u);
          out += buf;
        } else out += c;
    }
  }
  out += '"';
}

void json_value(std::string& out, const Value& v, int indent, int depth) {
  if (depth > 256) throw ValueError("tojson: value nested too deeply");
  const auto newline = [&](int d) {
    out += '\n';
    out.append(size_t(indent) * size_t(d), ' ');
  };
  const char* item_sep = indent >= 0 ? "," : ", ";
  switch (v.kind) {
    case Value::Kind::None: out += "null"; return;
    case Value::Kind::Bool: out += v.b ? "true" : "false"; return;
    case Value::Kind::Int: out += std::to_string(v.i); return;
    case Value::Kind::Float:
      if (std::isnan(v.f)) out += "NaN";
      else if (std::isinf(v.f)) out += v.f > 0 ? "Infinity" : "-Infinity";
      else out += float_text(v.f);
      return;
    case Value::Kind::String: json_string(out, v.s); return;
    case Value::Kind::List: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += item_sep;
        if (indent >= 0) newline(depth + 1);
        json_value(out, (*v.list)[k], indent, depth + 1);
      }
      if (indent >= 0) newline(depth);
      out += ']';
      return;
    }
    case Value::Kind::Dict: {
      if (v.dict->empty()) {
        out += "{}";
        return;
      }
      out += '{';
      bool first = true;
      for (const auto& [k, x] : *v.dict) {
        if (!first) out += item_sep;
        first = false;
        if (indent >= 0) newline(depth + 1);
        json_string(out, k);
        out += ": ";
        json_value(out, x, indent, depth + 1);
      }
      if (indent >= 0) newline(depth);
      out += '}';
      return;
    }
    case Value::Kind::Undefined: throw ValueError("Object of type Undefined is not JSON serializable");
    case Value::Kind::Namespace: throw ValueError("Object of type Namespace is not JSON serializable");
    case Value::Kind::Function: throw ValueError("Object of type function is not JSON serializable");
  }
}

}  // namespace

std::string to_str(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return "";
    case Value::Kind::None: return "None";
    case Value::Kind::Bool: return v.b ? "True" : "False";
    case Value::Kind::Int: return std::to_string(v.i);
    case Value::Kind::Float: return float_text(v.f);
    case Value::Kind::String: return v.s;
    case Value::Kind::List: {
      std::string out = "[";
      for (size_t k = 0; k < v.list->size(); ++k) out += (k ? ", " : "") + repr((*v.list)[k]);
      return out + "]";
    }
    case Value::Kind::Dict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, x] : *v.dict) {
        out += (first ? "" : ", ") + str_repr(k) + ": " + repr(x);
        first = false;
      }
      return out + "}";
    }
    case Value::Kind::Namespace: return "<Namespace>";
    case Value::Kind::Function: return "<function>";
  }
  return "";
}

std::string repr(const Value& v) { return v.is(Value::Kind::String) ? str_repr(v.s) : to_str(v); }

std::string type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return "Undefined";
    case Value::Kind::None: return "NoneType";
    case Value::Kind::Bool: return "bool";
    case Value::Kind::Int: return "int";
    case Value::Kind::Float: return "float";
    case Value::Kind::String: return "str";
    case Value::Kind::List: return "list";
    case Value::Kind::Dict: return "dict";
    case Value::Kind::Namespace: return "Namespace";
    case Value::Kind::Function: return "function";
  }
  return "object";
}

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind != Value::Kind::Float && b.kind != Value::Kind::Float)
      return (a.is(Value::Kind::Bool) ? a.b : a.i) == (b.is(Value::Kind::Bool) ? b.b : b.i);
    return a.as_double() == b.as_double();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::Undefined:
    case Value::Kind::None: return true;
    case Value::Kind::String: return a.s == b.s;
    case Value::Kind::List:
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equals((*a.list)[k], (*b.list)[k])) return false;
      return true;
    case Value::Kind::Dict:
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [k, x] : *a.dict) {
        const Value* y = b.find(k);
        if (!y || !equals(x, *y)) return false;
      }
      return true;
    case Value::Kind::Namespace: return a.ns == b.ns;
    case Value::Kind::Function: return a.fn == b.fn;
    default: return false;
  }
}

bool less(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return a.as_double() < b.as_double();
  if (a.is(Value::Kind::String) && b.is(Value::Kind::String)) return a.s < b.s;  // UTF-8 order is code point order
  if (a.is(Value::Kind::List) && b.is(Value::Kind::List)) {
    for (size_t k = 0; k < a.list->size() && k < b.list->size(); ++k) {
      if (less((*a.list)[k], (*b.list)[k])) return true;
      if (less((*b.list)[k], (*a.list)[k])) return false;
    }
    return a.list->size() < b.list->size();
  }
  throw ValueError("'<' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
}

int64_t length(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return 0;
    case Value::Kind::String: return int64_t(utf8_decode(v.s).size());
    case Value::Kind::List: return int64_t(v.list->size());
    case Value::Kind::Dict: return int64_t(v.dict->size());
    default: throw ValueError("object of type '" + type_name(v) + "' has no len()");
  }
}

List iterate(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return {};
    case Value::Kind::List: return *v.list;
    case Value::Kind::Dict: {
      List keys;
      for (const auto& kv : *v.dict) keys.push_back(Value::string(kv.first));
      return keys;
    }
    case Value::Kind::String: {
      List chars;
      for (char32_t c : utf8_decode(v.s)) chars.push_back(Value::string(utf8_encode(std::u32string(1, c))));
      return chars;
    }
    default: throw ValueError("'" + type_name(v) + "' object is not iterable");
  }
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: return Value::integer(int64_t(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float: return Value::number(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List l;
      for (const auto& x : j) l.push_back(from_json(x));
      return Value::make_list(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      for (const auto& [k, x] : j.items()) d.emplace_back(k, from_json(x));
      return Value::make_dict(std::move(d));
    }
    default: return Value::none();
  }
}

std::string to_json_text(const Value& v, int indent) {
  std::string out;
  json_value(out, v, indent, 0);
  return out;
}

std::u32string utf8_decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t k = 0; k < s.size();) {
    const auto c = uint8_t(s[k]);
    const int n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || k + size_t(n) > s.size()) {  // invalid: the byte stands for itself
      out += char32_t(c);
      ++k;
      continue;
    }
    char32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (int m = 1; m < n; ++m) cp = (cp << 6) | (uint8_t(s[k + size_t(m)]) & 0x3F);
    out += cp;
    k += size_t(n);
  }
  return out;
}

std::string utf8_encode(std::u32string_view s) {
  std::string out;
  for (char32_t c : s) {
    if (c < 0x80) out += char(c);
    else if (c < 0x800) out += char(0xC0 | (c >> 6)), out += char(0x80 | (c & 0x3F));
    else if (c < 0x10000)
      out += char(0xE0 | (c >> 12)), out += char(0x80 | ((c >> 6) & 0x3F)), out += char(0x80 | (c & 0x3F));
    else
      out += char(0xF0 | (c >> 18)), out += char(0x80 | ((c >> 12) & 0x3F)), out += char(0x80 | ((c >> 6) & 0x3F)),
          out += char(0x80 | (c & 0x3F));
  }
  return out;
}

}  // namespace specmesh::jinja
