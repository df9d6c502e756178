// Filters, tests, string and dict methods and globals, with jinja2's and Python's behaviour.
#include "specmesh/chat/jinja_builtins.hpp"

#include <algorithm>
#include <cmath>
#include <ctime>

namespace specmesh::jinja {

namespace {

constexpr int64_t kMaxRange = 100000;

bool py_space(char32_t c) {
  return c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

std::string need_string(const Value& v, const char* what) {
  if (v.is(Value::Kind::String)) return v.s;
  throw ValueError(std::string(what) + " expects a string, got " + type_name(v));
}

int64_t need_int(const Value& v, const char* what) {
  if (v.is(Value::Kind::Int)) return v.i;
  if (v.is(Value::Kind::Bool)) return v.b;
  throw ValueError(std::string(what) + " expects an integer, got " + type_name(v));
}

// Python's str.strip/lstrip/rstrip: `chars` (None: whitespace) off either end.
std::string strip(const std::string& s, const Value* chars, bool left, bool right) {
  const std::u32string u = utf8_decode(s);
  std::u32string set;
  const bool ws = !chars || chars->is(Value::Kind::None) || chars->is(Value::Kind::Undefined);
  if (!ws) set = utf8_decode(need_string(*chars, "strip"));
  auto strip_it = [&](char32_t c) { return ws ? py_space(c) : set.find(c) != std::u32string::npos; };
  size_t b = 0, e = u.size();
  if (left)
    while (b < e && strip_it(u[b])) ++b;
  if (right)
    while (e > b && strip_it(u[e - 1])) --e;
  return utf8_encode(std::u32string_view(u).substr(b, e - b));
}

// Python's str.split(sep=None, maxsplit=-1) and rsplit.
List split(const std::string& s, const Value* sep, int64_t maxsplit, bool from_right) {
  List parts;
  if (!sep || sep->is(Value::Kind::None)) {
    const std::u32string u = utf8_decode(s);
    std::vector<std::u32string> words;
    std::vector<std::pair<size_t, size_t>> spans;
    for (size_t k = 0; k < u.size();) {
      while (k < u.size() && py_space(u[k])) ++k;
      if (k == u.size()) break;
      size_t e = k;
      while (e < u.size() && !py_space(u[e])) ++e;
      spans.emplace_back(k, e);
      k = e;
    }
    if (maxsplit >= 0 && int64_t(spans.size()) > maxsplit + 1) {
      if (from_right) {
        const size_t keep = spans.size() - size_t(maxsplit);
        spans[keep - 1].first = spans[0].first;
        spans.erase(spans.begin(), spans.begin() + long(keep - 1));
      } else {
        spans[size_t(maxsplit)].second = spans.back().second;
        spans.resize(size_t(maxsplit) + 1);
      }
    }
    for (auto [b, e] : spans) parts.push_back(Value::string(utf8_encode(std::u32string_view(u).substr(b, e - b))));
    return parts;
  }
  const std::string d = need_string(*sep, "split");
  if (d.empty()) throw ValueError("empty separator");
  std::vector<std::string> pieces;
  if (!from_right) {
    size_t pos = 0;
    for (int64_t n = 0; maxsplit < 0 || n < maxsplit; ++n) {
      const size_t hit = s.find(d, pos);
      if (hit == std::string::npos) break;
      pieces.push_back(s.substr(pos, hit - pos));
      pos = hit + d.size();
    }
    pieces.push_back(s.substr(pos));
  } else {
    size_t end = s.size();
    for (int64_t n = 0; maxsplit < 0 || n < maxsplit; ++n) {
      if (end < d.size()) break;
      const size_t hit = s.rfind(d, end - d.size());
      if (hit == std::string::npos) break;
      pieces.insert(pieces.begin(), s.substr(hit + d.size(), end - hit - d.size()));
      end = hit;
    }
    pieces.insert(pieces.begin(), s.substr(0, end));
  }
  for (auto& p : pieces) parts.push_back(Value::string(std::move(p)));
  return parts;
}

std::string replace_all(std::string s, const std::string& from, const std::string& to, int64_t count) {
  if (from.empty()) return s;
  std::string out;
  size_t pos = 0;
  for (int64_t n = 0; count < 0 || n < count; ++n) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos).append(to);
    pos = hit + from.size();
  }
  return out.append(s, pos, std::string::npos);
}

std::string title(const std::string& s) {  // Python's str.title on ASCII letters
  std::string out = s;
  bool prev_cased = false;
  for (char& c : out) {
    const bool alpha = std::isalpha(uint8_t(c));
    if (alpha) c = char(prev_cased ? std::tolower(uint8_t(c)) : std::toupper(uint8_t(c)));
    prev_cased = alpha;
  }
  return out;
}

std::string upper(std::string s) {
  for (char& c : s) c = char(std::toupper(uint8_t(c)));
  return s;
}
std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(uint8_t(c)));
  return s;
}
std::string capitalize(const std::string& s) {
  std::string out = lower(s);
  if (!out.empty()) out[0] = char(std::toupper(uint8_t(out[0])));
  return out;
}

bool starts_or_ends(const std::string& s, const Value& what, bool start) {
  auto one = [&](const Value& p) {
    const std::string x = need_string(p, start ? "startswith" : "endswith");
    return s.size() >= x.size() && (start ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0);
  };
  if (what.is(Value::Kind::List)) {
    for (const Value& p : *what.list)
      if (one(p)) return true;
    return false;
  }
  return one(what);
}

// jinja2's attribute lookup for map/selectattr: "a.b" walks dicts, missing gives undefined.
Value attribute_of(const Value& v, const std::string& path) {
  Value cur = v;
  size_t pos = 0;
  while (pos <= path.size()) {
    const size_t dot = path.find('.', pos);
    const std::string part = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    const Value* x = cur.find(part);
    if (!x) return Value::undefined("'" + type_name(cur) + " object' has no attribute '" + part + "'");
    cur = *x;
    if (dot == std::string::npos) break;
    pos = dot + 1;
  }
  return cur;
}

Value keyword_or(const Args& args, size_t index, std::string_view name, Value fallback) {
  const Value* v = argument(args, index, name);
  return v ? *v : std::move(fallback);
}

Value bound(Function f) { return Value::function(std::move(f)); }

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// select/reject/selectattr/rejectattr: keep the items whose (attribute's) test is `keep`.
Value select_items(const Value& input, Args& args, bool by_attribute, bool keep) {
  List out;
  size_t first_test_arg = by_attribute ? 1 : 0;
  std::string attr;
  if (by_attribute) {
    const Value* a = argument(args, 0, "attribute");
    if (!a) throw ValueError("selectattr/rejectattr need an attribute name");
    attr = need_string(*a, "selectattr");
  }
  const Value* test = args.positional.size() > first_test_arg ? &args.positional[first_test_arg] : nullptr;
  Args test_args;
  for (size_t k = first_test_arg + 1; k < args.positional.size(); ++k) test_args.positional.push_back(args.positional[k]);
  for (const Value& item : iterate(input)) {
    const Value subject = by_attribute ? attribute_of(item, attr) : item;
    Args ta = test_args;
    const bool pass = test ? apply_test(need_string(*test, "select"), subject, ta) : truthy(subject);
    if (pass == keep) out.push_back(item);
  }
  return Value::make_list(std::move(out));
}

}  // namespace

const Value* argument(const Args& args, size_t index, std::string_view name) {
  for (const auto& [k, v] : args.keywords)
    if (k == name) return &v;
  return index < args.positional.size() ? &args.positional[index] : nullptr;
}

Value apply_filter(std::string_view name, const Value& in, Args& args) {
  if (name == "trim") return Value::string(strip(to_str(in), argument(args, 0, "chars"), true, true));
  if (name == "tojson") {
    const Value* indent = argument(args, 0, "indent");
    return Value::string(to_json_text(in, indent && !indent->is(Value::Kind::None) ? int(need_int(*indent, "tojson")) : -1));
  }
  if (name == "length" || name == "count") return Value::integer(length(in));
  if (name == "upper") return Value::string(upper(to_str(in)));
  if (name == "lower") return Value::string(lower(to_str(in)));
  if (name == "title") return Value::string(title(to_str(in)));
  if (name == "capitalize") return Value::string(capitalize(to_str(in)));
  if (name == "string") return Value::string(to_str(in));
  if (name == "safe") return in;
  if (name == "escape" || name == "e") return Value::string(html_escape(to_str(in)));
  if (name == "first" || name == "last") {
    const List items = iterate(in);
    if (items.empty()) return Value::undefined("no first item, sequence was empty");
    return name == "first" ? items.front() : items.back();
  }
  if (name == "list") return Value::make_list(iterate(in));
  if (name == "reverse") {
    if (in.is(Value::Kind::String)) {
      std::u32string u = utf8_decode(in.s);
      std::reverse(u.begin(), u.end());
      return Value::string(utf8_encode(u));
    }
    List items = iterate(in);
    std::reverse(items.begin(), items.end());
    return Value::make_list(std::move(items));
  }
  if (name == "join") {
    const Value sep = keyword_or(args, 0, "d", Value::string(""));
    const Value* attr = argument(args, 1, "attribute");
    std::string out;
    bool first = true;
    for (const Value& item : iterate(in)) {
      if (!first) out += to_str(sep);
      first = false;
      out += to_str(attr ? attribute_of(item, to_str(*attr)) : item);
    }
    return Value::string(out);
  }
  if (name == "default" || name == "d") {
    const Value fallback = keyword_or(args, 0, "default_value", Value::string(""));
    const Value* boolean = argument(args, 1, "boolean");
    const bool use = in.is(Value::Kind::Undefined) || (boolean && truthy(*boolean) && !truthy(in));
    return use ? fallback : in;
  }
  if (name == "int") {
    if (in.is(Value::Kind::Int)) return in;
    if (in.is(Value::Kind::Float)) return Value::integer(int64_t(in.f));
    if (in.is(Value::Kind::Bool)) return Value::integer(in.b);
    try {
      return Value::integer(std::stoll(strip(to_str(in), nullptr, true, true)));
    } catch (const std::exception&) {
      return keyword_or(args, 0, "default", Value::integer(0));
    }
  }
  if (name == "float") {
    if (in.is_number()) return Value::number(in.as_double());
    try {
      return Value::number(std::stod(strip(to_str(in), nullptr, true, true)));
    } catch (const std::exception&) {
      return keyword_or(args, 0, "default", Value::number(0));
    }
  }
  if (name == "abs") {
    if (in.is(Value::Kind::Int)) return Value::integer(in.i < 0 ? -in.i : in.i);
    if (in.is(Value::Kind::Float)) return Value::number(std::fabs(in.f));
    throw ValueError("bad operand type for abs(): '" + type_name(in) + "'");
  }
  if (name == "replace") {
    const Value* from = argument(args, 0, "old");
    const Value* to = argument(args, 1, "new");
    const Value* count = argument(args, 2, "count");
    if (!from || !to) throw ValueError("replace needs the old and the new text");
    return Value::string(replace_all(to_str(in), to_str(*from), to_str(*to), count && !count->is(Value::Kind::None) ? need_int(*count, "replace") : -1));
  }
  if (name == "items") {
    if (in.is(Value::Kind::Undefined)) return Value::make_list({});
    if (!in.is(Value::Kind::Dict)) throw ValueError("items filter expects a mapping, got " + type_name(in));
    List out;
    for (const auto& [k, v] : *in.dict) out.push_back(Value::make_list({Value::string(k), v}));
    return Value::make_list(std::move(out));
  }
  if (name == "map") {
    List out;
    const Value* attr = argument(args, 99, "attribute");
    if (attr) {
      const Value* fallback = argument(args, 99, "default");
      for (const Value& item : iterate(in)) {
        Value v = attribute_of(item, to_str(*attr));
        out.push_back(v.is(Value::Kind::Undefined) && fallback ? *fallback : v);
      }
      return Value::make_list(std::move(out));
    }
    if (args.positional.empty()) throw ValueError("map needs a filter name or attribute=");
    const std::string filter = need_string(args.positional[0], "map");
    for (const Value& item : iterate(in)) {
      Args rest;
      rest.positional.assign(args.positional.begin() + 1, args.positional.end());
      rest.keywords = args.keywords;
      out.push_back(apply_filter(filter, item, rest));
    }
    return Value::make_list(std::move(out));
  }
  if (name == "select") return select_items(in, args, false, true);
  if (name == "reject") return select_items(in, args, false, false);
  if (name == "selectattr") return select_items(in, args, true, true);
  if (name == "rejectattr") return select_items(in, args, true, false);
  if (name == "unique") {
    List out;
    for (const Value& item : iterate(in))
      if (std::none_of(out.begin(), out.end(), [&](const Value& o) { return equals(o, item); })) out.push_back(item);
    return Value::make_list(std::move(out));
  }
  if (name == "sort") {
    List items = iterate(in);
    const Value* rev = argument(args, 0, "reverse");
    const Value* attr = argument(args, 2, "attribute");
    auto key = [&](const Value& v) { return attr ? attribute_of(v, to_str(*attr)) : v; };
    std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) { return less(key(a), key(b)); });
    if (rev && truthy(*rev)) std::reverse(items.begin(), items.end());
    return Value::make_list(std::move(items));
  }
  if (name == "sum") {
    Value total = keyword_or(args, 1, "start", Value::integer(0));
    const Value* attr = argument(args, 0, "attribute");
    for (const Value& item : iterate(in)) {
      const Value v = attr ? attribute_of(item, to_str(*attr)) : item;
      if (!v.is_number() || !total.is_number()) throw ValueError("sum: unsupported operand type " + type_name(v));
      if (v.is(Value::Kind::Float) || total.is(Value::Kind::Float)) total = Value::number(total.as_double() + v.as_double());
      else total = Value::integer(int64_t(total.as_double()) + (v.is(Value::Kind::Bool) ? v.b : v.i));
    }
    return total;
  }
  if (name == "min" || name == "max") {
    const List items = iterate(in);
    if (items.empty()) return Value::undefined("no " + std::string(name) + " item, sequence was empty");
    Value best = items[0];
    for (const Value& v : items)
      if (name == "min" ? less(v, best) : less(best, v)) best = v;
    return best;
  }
  if (name == "indent") {
    const Value* width = argument(args, 0, "width");
    const Value* first = argument(args, 1, "first");
    const Value* blank = argument(args, 2, "blank");
    const std::string pad = width && width->is(Value::Kind::String) ? width->s
                                                                     : std::string(size_t(width ? need_int(*width, "indent") : 4), ' ');
    const std::string s = to_str(in);
    std::string out;
    size_t pos = 0;
    bool first_line = true;
    while (pos <= s.size()) {
      const size_t nl = s.find('\n', pos);
      const std::string line = s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
      const bool indent_it = first_line ? (first && truthy(*first)) : (!line.empty() || (blank && truthy(*blank)));
      if (indent_it) out += pad;
      out += line;
      if (nl == std::string::npos) break;
      out += '\n';
      pos = nl + 1;
      first_line = false;
    }
    return Value::string(out);
  }
  if (name == "wordcount") return Value::integer(int64_t(split(to_str(in), nullptr, -1, false).size()));
  throw ValueError("no filter named '" + std::string(name) + "'");
}

bool apply_test(std::string_view name, const Value& v, Args& args) {
  using K = Value::Kind;
  const Value* arg = argument(args, 0, "value");
  auto need_arg = [&]() -> const Value& {
    if (!arg) throw ValueError("test '" + std::string(name) + "' needs an argument");
    return *arg;
  };
  if (name == "defined") return !v.is(K::Undefined);
  if (name == "undefined") return v.is(K::Undefined);
  if (name == "none") return v.is(K::None);
  if (name == "string") return v.is(K::String);
  if (name == "number") return v.is(K::Int) || v.is(K::Float);
  if (name == "integer") return v.is(K::Int);
  if (name == "float") return v.is(K::Float);
  if (name == "boolean") return v.is(K::Bool);
  if (name == "true") return v.is(K::Bool) && v.b;
  if (name == "false") return v.is(K::Bool) && !v.b;
  if (name == "mapping") return v.is(K::Dict);
  if (name == "iterable") return v.is(K::List) || v.is(K::Dict) || v.is(K::String);
  if (name == "sequence") return v.is(K::List) || v.is(K::Dict) || v.is(K::String);
  if (name == "callable") return v.is(K::Function);
  if (name == "even" || name == "odd") {
    const int64_t x = need_int(v, "even/odd");
    return (x % 2 == 0) == (name == "even");
  }
  if (name == "divisibleby") {
    const int64_t d = need_int(need_arg(), "divisibleby");
    if (d == 0) throw ValueError("integer division or modulo by zero");
    return need_int(v, "divisibleby") % d == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return equals(v, need_arg());
  if (name == "ne" || name == "!=") return !equals(v, need_arg());
  if (name == "lt" || name == "lessthan" || name == "<") return less(v, need_arg());
  if (name == "le" || name == "<=") return !less(need_arg(), v);
  if (name == "gt" || name == "greaterthan" || name == ">") return less(need_arg(), v);
  if (name == "ge" || name == ">=") return !less(v, need_arg());
  if (name == "sameas") {
    const Value& o = need_arg();
    if (v.kind != o.kind) return false;
    if (v.is(K::None) || v.is(K::Undefined)) return true;
    if (v.is(K::Bool)) return v.b == o.b;
    return equals(v, o);
  }
  if (name == "in") {
    const Value& seq = need_arg();
    if (seq.is(K::String)) return v.is(K::String) && seq.s.find(v.s) != std::string::npos;
    if (seq.is(K::Dict)) return v.is(K::String) && seq.find(v.s);
    for (const Value& x : iterate(seq))
      if (equals(x, v)) return true;
    return false;
  }
  if (name == "lower") return v.is(K::String) && lower(v.s) == v.s;
  if (name == "upper") return v.is(K::String) && upper(v.s) == v.s;
  throw ValueError("no test named '" + std::string(name) + "'");
}

std::optional<Value> method(const Value& obj, std::string_view name) {
  using K = Value::Kind;
  if (obj.is(K::String)) {
    const std::string s = obj.s;
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      const bool l = name != "rstrip", r = name != "lstrip";
      return bound([s, l, r](Args& a) { return Value::string(strip(s, argument(a, 0, "chars"), l, r)); });
    }
    if (name == "startswith" || name == "endswith") {
      const bool start = name == "startswith";
      return bound([s, start](Args& a) {
        const Value* p = argument(a, 0, "prefix");
        if (!p) throw ValueError("startswith/endswith need an argument");
        return Value::boolean(starts_or_ends(s, *p, start));
      });
    }
    if (name == "split" || name == "rsplit") {
      const bool right = name == "rsplit";
      return bound([s, right](Args& a) {
        const Value* m = argument(a, 1, "maxsplit");
        return Value::make_list(split(s, argument(a, 0, "sep"), m ? need_int(*m, "split") : -1, right));
      });
    }
    if (name == "upper") return bound([s](Args&) { return Value::string(upper(s)); });
    if (name == "lower") return bound([s](Args&) { return Value::string(lower(s)); });
    if (name == "title") return bound([s](Args&) { return Value::string(title(s)); });
    if (name == "capitalize") return bound([s](Args&) { return Value::string(capitalize(s)); });
    if (name == "replace")
      return bound([s](Args& a) {
        const Value* from = argument(a, 0, "old");
        const Value* to = argument(a, 1, "new");
        const Value* count = argument(a, 2, "count");
        if (!from || !to) throw ValueError("replace needs the old and the new text");
        return Value::string(replace_all(s, need_string(*from, "replace"), need_string(*to, "replace"), count ? need_int(*count, "replace") : -1));
      });
    if (name == "find" || name == "rfind" || name == "count") {
      const std::string which(name);
      return bound([s, which](Args& a) {
        const Value* sub = argument(a, 0, "sub");
        if (!sub) throw ValueError(which + " needs an argument");
        const std::string x = need_string(*sub, which.c_str());
        if (which == "count") {
          if (x.empty()) return Value::integer(int64_t(utf8_decode(s).size()) + 1);
          int64_t n = 0;
          for (size_t pos = s.find(x); pos != std::string::npos; pos = s.find(x, pos + x.size())) ++n;
          return Value::integer(n);
        }
        const size_t pos = which == "find" ? s.find(x) : s.rfind(x);
        return Value::integer(pos == std::string::npos ? -1 : int64_t(utf8_decode(s.substr(0, pos)).size()));
      });
    }
    if (name == "join")
      return bound([s](Args& a) {
        if (a.positional.empty()) throw ValueError("join needs an argument");
        std::string out;
        bool first = true;
        for (const Value& x : iterate(a.positional[0])) {
          if (!first) out += s;
          first = false;
          out += need_string(x, "join");
        }
        return Value::string(out);
      });
    if (name == "splitlines")
      return bound([s](Args&) {
        List lines;
        size_t pos = 0;
        while (pos < s.size()) {
          size_t nl = s.find('\n', pos);
          if (nl == std::string::npos) nl = s.size();
          std::string line = s.substr(pos, nl - pos);
          if (!line.empty() && line.back() == '\r') line.pop_back();
          lines.push_back(Value::string(line));
          pos = nl + 1;
        }
        return Value::make_list(std::move(lines));
      });
    if (name == "isdigit" || name == "isalpha" || name == "isspace") {
      const std::string which(name);
      return bound([s, which](Args&) {
        if (s.empty()) return Value::boolean(false);
        for (char c : s) {
          const auto u = uint8_t(c);
          const bool ok = which == "isdigit" ? std::isdigit(u) : which == "isalpha" ? std::isalpha(u) : std::isspace(u);
          if (!ok) return Value::boolean(false);
        }
        return Value::boolean(true);
      });
    }
    return std::nullopt;
  }
  if (obj.is(K::Dict)) {
    const auto d = obj.dict;
    if (name == "items")
      return bound([d](Args&) {
        List out;
        for (const auto& [k, v] : *d) out.push_back(Value::make_list({Value::string(k), v}));
        return Value::make_list(std::move(out));
      });
    if (name == "keys")
      return bound([d](Args&) {
        List out;
        for (const auto& kv : *d) out.push_back(Value::string(kv.first));
        return Value::make_list(std::move(out));
      });
    if (name == "values")
      return bound([d](Args&) {
        List out;
        for (const auto& kv : *d) out.push_back(kv.second);
        return Value::make_list(std::move(out));
      });
    if (name == "get")
      return bound([obj](Args& a) {
        const Value* key = argument(a, 0, "key");
        if (!key) throw ValueError("get needs a key");
        const Value* v = key->is(K::String) ? obj.find(key->s) : nullptr;
        return v ? *v : keyword_or(a, 1, "default", Value::none());
      });
    return std::nullopt;
  }
  if (obj.is(K::List)) {
    if (name == "append" || name == "extend" || name == "pop" || name == "insert" || name == "remove" ||
        name == "clear" || name == "sort" || name == "reverse")
      throw ValueError("access to attribute '" + std::string(name) + "' of 'list' object is unsafe (lists are immutable)");
    if (name == "index" || name == "count") {
      const std::string which(name);
      const auto l = obj.list;
      return bound([l, which](Args& a) {
        if (a.positional.empty()) throw ValueError(which + " needs an argument");
        int64_t n = 0;
        for (size_t k = 0; k < l->size(); ++k)
          if (equals((*l)[k], a.positional[0])) {
            if (which == "index") return Value::integer(int64_t(k));
            ++n;
          }
        if (which == "index") throw ValueError("value is not in list");
        return Value::integer(n);
      });
    }
  }
  return std::nullopt;
}

std::optional<Value> global(std::string_view name) {
  if (name == "raise_exception")
    return bound([](Args& a) -> Value { throw Raised(a.positional.empty() ? std::string() : to_str(a.positional[0])); });
  if (name == "namespace")
    return bound([](Args& a) {
      Dict attrs;
      for (const Value& p : a.positional) {
        if (!p.is(Value::Kind::Dict)) throw ValueError("namespace() takes keyword arguments or a dict");
        for (const auto& kv : *p.dict) attrs.push_back(kv);
      }
      for (const auto& kv : a.keywords) attrs.push_back(kv);
      return Value::make_namespace(std::move(attrs));
    });
  if (name == "dict")
    return bound([](Args& a) {
      Dict d;
      for (const auto& kv : a.keywords) d.push_back(kv);
      return Value::make_dict(std::move(d));
    });
  if (name == "range")
    return bound([](Args& a) {
      int64_t start = 0, stop = 0, step = 1;
      if (a.positional.size() == 1) stop = need_int(a.positional[0], "range");
      else if (a.positional.size() >= 2) {
        start = need_int(a.positional[0], "range");
        stop = need_int(a.positional[1], "range");
        if (a.positional.size() >= 3) step = need_int(a.positional[2], "range");
      } else throw ValueError("range expected at least 1 argument");
      if (step == 0) throw ValueError("range() arg 3 must not be zero");
      List out;
      for (int64_t x = start; step > 0 ? x < stop : x > stop; x += step) {
        if (int64_t(out.size()) >= kMaxRange) throw ValueError("range() of more than 100000 numbers");
        out.push_back(Value::integer(x));
      }
      return Value::make_list(std::move(out));
    });
  if (name == "strftime_now")
    return bound([](Args& a) {
      const Value* fmt = argument(a, 0, "format");
      if (!fmt) throw ValueError("strftime_now needs a format");
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof buf, need_string(*fmt, "strftime_now").c_str(), &tm);
      return Value::string(std::string(buf, n));
    });
  return std::nullopt;
}

}  // namespace specmesh::jinja
