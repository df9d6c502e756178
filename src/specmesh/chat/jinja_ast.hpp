// A parsed chat template: statements and expressions, each with its line and column.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "specmesh/chat/jinja_value.hpp"

namespace specmesh::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    Literal,   // value
    Name,      // name
    List,      // args: the elements
    Tuple,     // args: the elements (a list at run time)
    Dict,      // args: key, value, key, value...
    Attr,      // args[0].name
    Item,      // args[0][args[1]]
    Slice,     // args[0][args[1]:args[2]:args[3]], absent parts null
    Call,      // args[0](args[1...], kwargs)
    Filter,    // args[0] | name(args[1...], kwargs)
    Test,      // args[0] is [not] name(args[1...])
    Unary,     // name ("-", "+", "not") args[0]
    Binary,    // args[0] name args[1]: + - * / // % ** ~ and or
    Compare,   // args[0] ops[0] args[1] ops[1] args[2]...: == != < <= > >= in "not in"
    Cond,      // args[1] if args[0] else args[2] (args[2] null: undefined)
  };
  Kind kind;
  int line = 0, column = 0;
  Value value;
  std::string name;
  bool negated = false;  // is not
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
};

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

struct Node {
  enum class Kind {
    Text,      // text
    Output,    // {{ expr }}
    If,        // branches: (condition, body)...; a null condition is the else
    For,       // for targets in expr [if filter]: body [else else_body]
    Set,       // set targets = expr, or set targets[0].attr = expr (attr not empty)
    SetBlock,  // set targets[0] %}body{% endset
    Macro,     // macro name(params): body
    Break,
    Continue,
    Scope,     // a block that only renders its body ({% generation %})
  };
  Kind kind;
  int line = 0, column = 0;
  std::string text;  // Text; Macro's name; Set's attribute
  ExprPtr expr;
  ExprPtr filter;
  std::vector<std::string> targets;
  std::vector<std::pair<ExprPtr, Body>> branches;
  std::vector<std::pair<std::string, ExprPtr>> params;  // Macro: name, default (may be null)
  Body body, else_body;
};

// Reads a template as Hugging Face's environment does: trim_blocks and lstrip_blocks on, one
// trailing newline of the source dropped. Throws Error naming the line, the column and what
// was expected there.
Body parse(std::string_view source);

}  // namespace specmesh::jinja
