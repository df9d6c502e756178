// Rendering a parsed chat template: scopes, statements and expressions.
//
// Scopes follow jinja2: each for-loop iteration and each macro call gets its own, so a
// `set` inside them is not seen after them (namespace() objects exist for that); `if`
// blocks share the scope around them.
#include <cmath>
#include <map>

#include "specmesh/chat/jinja.hpp"
#include "specmesh/chat/jinja_ast.hpp"
#include "specmesh/chat/jinja_builtins.hpp"

namespace specmesh::jinja {

struct Template::Program {
  Body body;
};

Template::Template(std::string_view source) : program_(std::make_unique<Program>()) { program_->body = parse(source); }
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

namespace {

constexpr int64_t kMaxSteps = 1'000'000;
constexpr int kMaxMacroDepth = 64;
constexpr size_t kMaxOutput = size_t(64) << 20;

struct Scope {
  std::map<std::string, Value, std::less<>> vars;
  const Scope* parent = nullptr;
};

enum class Flow { Normal, Break, Continue };

class Renderer {
 public:
  explicit Renderer(const nlohmann::ordered_json& context) {
    if (!context.is_object()) throw Error(1, 1, "the render context must be a JSON object");
    for (const auto& [k, v] : context.items()) globals_.vars[k] = from_json(v);
  }

  std::string run(const Body& body) {
    Scope top;
    top.parent = &globals_;
    std::string out;
    if (exec(body, top, out) != Flow::Normal) throw Error(1, 1, "'break' or 'continue' outside a loop");
    return out;
  }

 private:
  Scope globals_;
  int64_t steps_ = 0;
  int macro_depth_ = 0;

  template <class N>
  void step(const N& at) {
    if (++steps_ > kMaxSteps) throw Error(at.line, at.column, "the template took more than 1000000 steps");
  }

  static const Value* lookup(const Scope& s, std::string_view name) {
    for (const Scope* sc = &s; sc; sc = sc->parent) {
      auto it = sc->vars.find(name);
      if (it != sc->vars.end()) return &it->second;
    }
    return nullptr;
  }

  Flow exec(const Body& body, Scope& scope, std::string& out) {
    for (const NodePtr& n : body) {
      const Flow f = exec(*n, scope, out);
      if (f != Flow::Normal) return f;
      if (out.size() > kMaxOutput) throw Error(n->line, n->column, "the rendered text is larger than 64 MiB");
    }
    return Flow::Normal;
  }

  Flow exec(const Node& n, Scope& scope, std::string& out) {
    step(n);
    switch (n.kind) {
      case Node::Kind::Text: out += n.text; return Flow::Normal;
      case Node::Kind::Output: out += to_str(eval(*n.expr, scope)); return Flow::Normal;
      case Node::Kind::If:
        for (const auto& [cond, body] : n.branches)
          if (!cond || truthy(eval(*cond, scope))) return exec(body, scope, out);
        return Flow::Normal;
      case Node::Kind::For: return exec_for(n, scope, out);
      case Node::Kind::Set: {
        Value v = eval(*n.expr, scope);
        if (!n.text.empty()) {
          const Value* target = lookup(scope, n.targets[0]);
          if (!target || !target->is(Value::Kind::Namespace))
            throw Error(n.line, n.column, "cannot assign attribute '" + n.text + "' of '" + n.targets[0] + "': not a namespace()");
          for (auto& kv : *target->ns)
            if (kv.first == n.text) {
              kv.second = std::move(v);
              return Flow::Normal;
            }
          target->ns->emplace_back(n.text, std::move(v));
          return Flow::Normal;
        }
        assign(n, scope, std::move(v));
        return Flow::Normal;
      }
      case Node::Kind::SetBlock: {
        std::string text;
        Scope inner;
        inner.parent = &scope;
        if (exec(n.body, inner, text) != Flow::Normal) throw Error(n.line, n.column, "'break' or 'continue' outside a loop");
        scope.vars[n.targets[0]] = Value::string(std::move(text));
        return Flow::Normal;
      }
      case Node::Kind::Macro: scope.vars[n.text] = make_macro(n, scope); return Flow::Normal;
      case Node::Kind::Break: return Flow::Break;
      case Node::Kind::Continue: return Flow::Continue;
      case Node::Kind::Scope: return exec(n.body, scope, out);
    }
    return Flow::Normal;
  }

  void assign(const Node& n, Scope& scope, Value v) {
    if (n.targets.size() == 1) {
      scope.vars[n.targets[0]] = std::move(v);
      return;
    }
    const List items = iterate(v);
    if (items.size() != n.targets.size())
      throw Error(n.line, n.column, "cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(n.targets.size()) + " names");
    for (size_t k = 0; k < items.size(); ++k) scope.vars[n.targets[k]] = items[k];
  }

  Flow exec_for(const Node& n, Scope& scope, std::string& out) {
    const Value seq = eval(*n.expr, scope);
    List items;
    try {
      items = iterate(seq);
    } catch (const ValueError& e) {
      throw Error(n.expr->line, n.expr->column, e.what());
    }
    if (n.filter) {  // for x in y if cond: the loop sees only the items that pass
      List kept;
      for (const Value& item : items) {
        Scope probe;
        probe.parent = &scope;
        bind_targets(n, probe, item);
        if (truthy(eval(*n.filter, probe))) kept.push_back(item);
      }
      items.swap(kept);
    }
    const int64_t len = int64_t(items.size());
    bool any = false;
    for (int64_t k = 0; k < len; ++k) {
      step(n);
      any = true;
      Scope inner;
      inner.parent = &scope;
      bind_targets(n, inner, items[size_t(k)]);
      Dict loop{{"index", Value::integer(k + 1)},
                {"index0", Value::integer(k)},
                {"revindex", Value::integer(len - k)},
                {"revindex0", Value::integer(len - k - 1)},
                {"first", Value::boolean(k == 0)},
                {"last", Value::boolean(k == len - 1)},
                {"length", Value::integer(len)},
                {"depth", Value::integer(1)},
                {"depth0", Value::integer(0)},
                {"previtem", k > 0 ? items[size_t(k - 1)] : Value::undefined("there is no previous item")},
                {"nextitem", k + 1 < len ? items[size_t(k + 1)] : Value::undefined("there is no next item")}};
        loop.emplace_back("cycle", Value::function([k](Args& a) {
          if (a.positional.empty()) throw ValueError("no items for cycling given");
          return a.positional[size_t(k) % a.positional.size()];
        }));
      inner.vars["loop"] = Value::make_dict(std::move(loop));
      const Flow f = exec(n.body, inner, out);
      if (f == Flow::Break) break;
    }
    if (!any) return exec(n.else_body, scope, out);
    return Flow::Normal;
  }

  void bind_targets(const Node& n, Scope& s, const Value& item) {
    if (n.targets.size() == 1) {
      s.vars[n.targets[0]] = item;
      return;
    }
    List parts;
    try {
      parts = iterate(item);
    } catch (const ValueError& e) {
      throw Error(n.line, n.column, e.what());
    }
    if (parts.size() != n.targets.size())
      throw Error(n.line, n.column, "cannot unpack " + std::to_string(parts.size()) + " values into " + std::to_string(n.targets.size()) + " loop variables");
    for (size_t k = 0; k < parts.size(); ++k) s.vars[n.targets[k]] = parts[k];
  }

  Value make_macro(const Node& n, const Scope& defined_in) {
    const Node* node = &n;
    const Scope* outer = &defined_in;
    return Value::function([this, node, outer](Args& a) {
      if (macro_depth_ >= kMaxMacroDepth)
        throw Error(node->line, node->column, "macro '" + node->text + "' nests deeper than 64 calls");
      Scope s;
      s.parent = outer;
      if (a.positional.size() > node->params.size())
        throw ValueError("macro '" + node->text + "' takes " + std::to_string(node->params.size()) + " arguments, got " + std::to_string(a.positional.size()));
      for (size_t k = 0; k < node->params.size(); ++k) {
        const auto& [pname, def] = node->params[k];
        const Value* given = argument(a, k, pname);
        s.vars[pname] = given ? *given : def ? eval(*def, s) : Value::undefined("'" + pname + "' is undefined");
      }
      for (const auto& [k, v] : a.keywords) {
        bool known = false;
        for (const auto& p : node->params) known = known || p.first == k;
        if (!known) throw ValueError("macro '" + node->text + "' takes no keyword argument '" + k + "'");
      }
      std::string text;
      ++macro_depth_;
      try {
        exec(node->body, s, text);
      } catch (...) {
        --macro_depth_;
        throw;
      }
      --macro_depth_;
      return Value::string(std::move(text));
    });
  }

  Value eval(const Expr& e, const Scope& scope) {
    try {
      return eval_unchecked(e, scope);
    } catch (const ValueError& err) {
      throw Error(e.line, e.column, err.what());
    }
  }

  static void require_defined(const Value& v) {
    if (v.is(Value::Kind::Undefined)) throw ValueError(v.s.empty() ? "value is undefined" : v.s);
  }

  Args eval_args(const Expr& e, size_t first, const Scope& scope) {
    Args a;
    for (size_t k = first; k < e.args.size(); ++k) a.positional.push_back(eval(*e.args[k], scope));
    for (const auto& [name, x] : e.kwargs) a.keywords.emplace_back(name, eval(*x, scope));
    return a;
  }

  Value get_attr(const Value& obj, const std::string& name) {
    require_defined(obj);
    if (const Value* v = obj.find(name)) return *v;
    if (std::optional<Value> m = method(obj, name)) return *m;
    return Value::undefined("'" + type_name(obj) + " object' has no attribute '" + name + "'");
  }

  Value get_item(const Value& obj, const Value& key) {
    require_defined(obj);
    if (obj.is(Value::Kind::List) || obj.is(Value::Kind::String)) {
      if (key.is(Value::Kind::Int) || key.is(Value::Kind::Bool)) {
        const int64_t n = obj.is(Value::Kind::List) ? int64_t(obj.list->size()) : length(obj);
        int64_t k = key.is(Value::Kind::Bool) ? key.b : key.i;
        if (k < 0) k += n;
        if (k < 0 || k >= n) return Value::undefined("'" + type_name(obj) + " object' has no item " + to_str(key));
        if (obj.is(Value::Kind::List)) return (*obj.list)[size_t(k)];
        return Value::string(utf8_encode(std::u32string(1, utf8_decode(obj.s)[size_t(k)])));
      }
      if (key.is(Value::Kind::String)) return get_attr(obj, key.s);
      throw ValueError(type_name(obj) + " indices must be integers, not " + type_name(key));
    }
    if (key.is(Value::Kind::String)) {
      if (const Value* v = obj.find(key.s)) return *v;
      if (std::optional<Value> m = method(obj, key.s)) return *m;
    }
    return Value::undefined("'" + type_name(obj) + " object' has no attribute " + repr(key));
  }

  Value slice(const Value& obj, const Value* a, const Value* b, const Value* c) {
    require_defined(obj);
    auto opt = [](const Value* v) -> std::optional<int64_t> {
      if (!v || v->is(Value::Kind::None)) return std::nullopt;
      if (!v->is(Value::Kind::Int)) throw ValueError("slice indices must be integers or None");
      return v->i;
    };
    const std::optional<int64_t> start = opt(a), stop = opt(b), stepv = opt(c);
    const int64_t st = stepv.value_or(1);
    if (st == 0) throw ValueError("slice step cannot be zero");
    const bool is_str = obj.is(Value::Kind::String);
    if (!is_str && !obj.is(Value::Kind::List)) throw ValueError("'" + type_name(obj) + "' object is not subscriptable");
    const std::u32string chars = is_str ? utf8_decode(obj.s) : std::u32string();
    const int64_t n = is_str ? int64_t(chars.size()) : int64_t(obj.list->size());
    auto clamp = [&](std::optional<int64_t> v, int64_t def) {
      if (!v) return def;
      int64_t x = *v < 0 ? *v + n : *v;
      if (st > 0) return std::clamp<int64_t>(x, 0, n);
      return std::clamp<int64_t>(x, -1, n - 1);
    };
    const int64_t lo = clamp(start, st > 0 ? 0 : n - 1), hi = clamp(stop, st > 0 ? n : -1);
    List items;
    std::u32string text;
    for (int64_t k = lo; st > 0 ? k < hi : k > hi; k += st) {
      if (is_str) text += chars[size_t(k)];
      else items.push_back((*obj.list)[size_t(k)]);
    }
    return is_str ? Value::string(utf8_encode(text)) : Value::make_list(std::move(items));
  }

  Value arithmetic(const std::string& op, const Value& l, const Value& r) {
    using K = Value::Kind;
    if (op == "~") return Value::string(to_str(l) + to_str(r));
    require_defined(l);
    require_defined(r);
    const auto unsupported = [&]() -> Value {
      throw ValueError("unsupported operand type(s) for " + op + ": '" + type_name(l) + "' and '" + type_name(r) + "'");
    };
    if (op == "+") {
      if (l.is(K::String) && r.is(K::String)) return Value::string(l.s + r.s);
      if (l.is(K::List) && r.is(K::List)) {
        List out = *l.list;
        out.insert(out.end(), r.list->begin(), r.list->end());
        return Value::make_list(std::move(out));
      }
    }
    if (op == "*" && l.is(K::Int) && (r.is(K::String) || r.is(K::List))) return arithmetic(op, r, l);
    if (op == "*" && ((l.is(K::String) || l.is(K::List)) && r.is(K::Int))) {
      if (r.i * (l.is(K::String) ? int64_t(l.s.size()) : int64_t(l.list->size())) > int64_t(kMaxOutput))
        throw ValueError("repetition result too large");
      if (l.is(K::String)) {
        std::string out;
        for (int64_t k = 0; k < r.i; ++k) out += l.s;
        return Value::string(out);
      }
      List out;
      for (int64_t k = 0; k < r.i; ++k) out.insert(out.end(), l.list->begin(), l.list->end());
      return Value::make_list(std::move(out));
    }
    if (!l.is_number() || !r.is_number()) return unsupported();
    const bool ints = l.kind != K::Float && r.kind != K::Float;
    const int64_t li = l.is(K::Bool) ? l.b : l.i, ri = r.is(K::Bool) ? r.b : r.i;
    const double lf = l.as_double(), rf = r.as_double();
    if (op == "+") return ints ? Value::integer(li + ri) : Value::number(lf + rf);
    if (op == "-") return ints ? Value::integer(li - ri) : Value::number(lf - rf);
    if (op == "*") return ints ? Value::integer(li * ri) : Value::number(lf * rf);
    if (op == "/") {
      if (rf == 0) throw ValueError("division by zero");
      return Value::number(lf / rf);
    }
    if (op == "//" || op == "%") {
      if (rf == 0) throw ValueError("integer division or modulo by zero");
      if (ints) {
        int64_t q = li / ri, m = li % ri;
        if (m != 0 && ((m < 0) != (ri < 0))) --q, m += ri;  // Python floors
        return Value::integer(op == "//" ? q : m);
      }
      const double q = std::floor(lf / rf);
      return Value::number(op == "//" ? q : lf - q * rf);
    }
    if (op == "**") {
      if (ints && ri >= 0) {
        int64_t x = 1;
        for (int64_t k = 0; k < ri && k < 64; ++k) x *= li;
        return Value::integer(x);
      }
      return Value::number(std::pow(lf, rf));
    }
    return unsupported();
  }

  bool contains(const Value& container, const Value& item) {
    using K = Value::Kind;
    if (container.is(K::String)) {
      if (!item.is(K::String)) throw ValueError("'in <string>' requires string as left operand, not " + type_name(item));
      return container.s.find(item.s) != std::string::npos;
    }
    if (container.is(K::Dict) || container.is(K::Namespace)) return item.is(K::String) && container.find(item.s);
    if (container.is(K::Undefined)) return false;
    for (const Value& x : iterate(container))
      if (equals(x, item)) return true;
    return false;
  }

  Value eval_unchecked(const Expr& e, const Scope& scope) {
    using K = Expr::Kind;
    switch (e.kind) {
      case K::Literal: return e.value;
      case K::Name: {
        if (const Value* v = lookup(scope, e.name)) return *v;
        if (std::optional<Value> g = global(e.name)) return *g;
        return Value::undefined("'" + e.name + "' is undefined");
      }
      case K::List:
      case K::Tuple: {
        List items;
        for (const ExprPtr& x : e.args) items.push_back(eval(*x, scope));
        return Value::make_list(std::move(items));
      }
      case K::Dict: {
        Dict d;
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
          const Value key = eval(*e.args[k], scope);
          if (!key.is(Value::Kind::String)) throw ValueError("dict keys must be strings here, not " + type_name(key));
          Value v = eval(*e.args[k + 1], scope);
          bool replaced = false;
          for (auto& kv : d)
            if (kv.first == key.s) kv.second = v, replaced = true;
          if (!replaced) d.emplace_back(key.s, std::move(v));
        }
        return Value::make_dict(std::move(d));
      }
      case K::Attr: return get_attr(eval(*e.args[0], scope), e.name);
      case K::Item: return get_item(eval(*e.args[0], scope), eval(*e.args[1], scope));
      case K::Slice: {
        const Value obj = eval(*e.args[0], scope);
        std::optional<Value> parts[3];
        for (int k = 0; k < 3; ++k)
          if (e.args[size_t(k) + 1]) parts[k] = eval(*e.args[size_t(k) + 1], scope);
        return slice(obj, parts[0] ? &*parts[0] : nullptr, parts[1] ? &*parts[1] : nullptr, parts[2] ? &*parts[2] : nullptr);
      }
      case K::Call: {
        const Value callee = eval(*e.args[0], scope);
        if (!callee.is(Value::Kind::Function)) {
          require_defined(callee);
          throw ValueError("'" + type_name(callee) + "' object is not callable");
        }
        Args a = eval_args(e, 1, scope);
        return (*callee.fn)(a);
      }
      case K::Filter: {
        const Value input = eval(*e.args[0], scope);
        Args a = eval_args(e, 1, scope);
        return apply_filter(e.name, input, a);
      }
      case K::Test: {
        const Value v = eval(*e.args[0], scope);
        Args a = eval_args(e, 1, scope);
        return Value::boolean(apply_test(e.name, v, a) != e.negated);
      }
      case K::Unary: {
        const Value v = eval(*e.args[0], scope);
        if (e.name == "not") return Value::boolean(!truthy(v));
        require_defined(v);
        if (!v.is_number()) throw ValueError("bad operand type for unary " + e.name + ": '" + type_name(v) + "'");
        if (e.name == "+") return v;
        return v.is(Value::Kind::Float) ? Value::number(-v.f) : Value::integer(-(v.is(Value::Kind::Bool) ? v.b : v.i));
      }
      case K::Binary: {
        if (e.name == "and" || e.name == "or") {  // Python: the deciding operand itself
          Value l = eval(*e.args[0], scope);
          if (truthy(l) == (e.name == "or")) return l;
          return eval(*e.args[1], scope);
        }
        const Value l = eval(*e.args[0], scope);
        const Value r = eval(*e.args[1], scope);
        return arithmetic(e.name, l, r);
      }
      case K::Compare: {
        Value left = eval(*e.args[0], scope);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = eval(*e.args[k + 1], scope);
          const std::string& op = e.ops[k];
          bool ok;
          if (op == "==") ok = equals(left, right);
          else if (op == "!=") ok = !equals(left, right);
          else if (op == "in") ok = contains(right, left);
          else if (op == "not in") ok = !contains(right, left);
          else {
            require_defined(left);
            require_defined(right);
            if (op == "<") ok = less(left, right);
            else if (op == "<=") ok = !less(right, left);
            else if (op == ">") ok = less(right, left);
            else ok = !less(left, right);
          }
          if (!ok) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case K::Cond:
        if (truthy(eval(*e.args[0], scope))) return eval(*e.args[1], scope);
        return e.args[2] ? eval(*e.args[2], scope) : Value::undefined("the conditional expression had no else");
    }
    return Value::undefined("");
  }
};

}  // namespace

std::string Template::render(const nlohmann::ordered_json& context) const { return Renderer(context).run(program_->body); }

}  // namespace specmesh::jinja
