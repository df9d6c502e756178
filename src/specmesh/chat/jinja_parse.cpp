// Template text to statements: Jinja's lexer (with its whitespace rules) and a recursive
// descent parser with Jinja's operator precedence.
//
// Whitespace, as jinja2's lexer with trim_blocks and lstrip_blocks (Hugging Face's settings):
// "{%-", "{{-", "{#-" strip all whitespace before the tag and "-%}", "-}}", "-#}" all after it;
// a block or comment tag ("{%", "{#", not "{{") alone on its line after spaces loses those
// spaces (unless "{%+"); the first newline after a block or comment tag is dropped (unless
// "+%}"); one trailing newline of the whole template is dropped.
#include <cctype>
#include <cstring>

#include "specmesh/chat/jinja_ast.hpp"

namespace specmesh::jinja {

namespace {

struct Token {
  enum class Type { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, End };
  Type type;
  std::string text;
  int line, column;
};

const char* describe(Token::Type t) {
  switch (t) {
    case Token::Type::Text: return "text";
    case Token::Type::VarBegin: return "'{{'";
    case Token::Type::VarEnd: return "'}}'";
    case Token::Type::BlockBegin: return "'{%'";
    case Token::Type::BlockEnd: return "'%}'";
    case Token::Type::Name: return "a name";
    case Token::Type::String: return "a string";
    case Token::Type::Int:
    case Token::Type::Float: return "a number";
    case Token::Type::Op: return "an operator";
    case Token::Type::End: return "the end of the template";
  }
  return "?";
}

std::string show(const Token& t) {
  switch (t.type) {
    case Token::Type::Name:
    case Token::Type::Op:
    case Token::Type::Int:
    case Token::Type::Float: return "'" + t.text + "'";
    case Token::Type::String: return "a string";
    default: return describe(t.type);
  }
}

class Lexer {
 public:
  explicit Lexer(std::string_view src) : src_(src) {
    if (!src_.empty() && src_.back() == '\n') src_.remove_suffix(1);  // keep_trailing_newline=False
  }

  std::vector<Token> run() {
    size_t pos = 0;
    while (pos < src_.size()) {
      const size_t open = find_open(pos);
      std::string text(src_.substr(pos, open - pos));
      const bool line_starting = pos == 0 || src_[pos - 1] == '\n';
      if (open == src_.size()) {
        emit_text(std::move(text), pos);
        break;
      }
      const char kind = src_[open + 1];  // '{', '%' or '#'
      const char control = open + 2 < src_.size() ? src_[open + 2] : '\0';
      if (control == '-') {
        size_t keep = text.size();
        while (keep > 0 && std::isspace(uint8_t(text[keep - 1]))) --keep;
        text.resize(keep);
      } else if (control != '+' && kind != '{') {  // lstrip_blocks
        const size_t line_start = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
        if ((line_start > 0 || line_starting) && line_start < text.size()) {
          bool blank = true;
          for (size_t k = line_start; k < text.size(); ++k) blank = blank && std::isspace(uint8_t(text[k]));
          if (blank) text.resize(line_start);
        }
      }
      emit_text(std::move(text), pos);
      size_t body = open + 2 + (control == '-' || (control == '+' && kind != '{') ? 1 : 0);
      if (kind == '#') pos = lex_comment(open, body);
      else pos = lex_tag(open, body, kind == '{');
    }
    tokens_.push_back({Token::Type::End, "", line_of(src_.size()), column_of(src_.size())});
    return std::move(tokens_);
  }

 private:
  std::string_view src_;
  std::vector<Token> tokens_;

  int line_of(size_t pos) const {
    int line = 1;
    for (size_t k = 0; k < pos && k < src_.size(); ++k) line += src_[k] == '\n';
    return line;
  }
  int column_of(size_t pos) const {
    const size_t nl = pos == 0 ? std::string_view::npos : src_.rfind('\n', pos - 1);
    return int(pos - (nl == std::string_view::npos ? 0 : nl + 1)) + 1;
  }
  [[noreturn]] void fail(size_t pos, const std::string& msg) const { throw Error(line_of(pos), column_of(pos), msg); }

  size_t find_open(size_t pos) const {
    for (size_t k = pos; k + 1 < src_.size(); ++k)
      if (src_[k] == '{' && (src_[k + 1] == '{' || src_[k + 1] == '%' || src_[k + 1] == '#')) return k;
    return src_.size();
  }

  void emit_text(std::string text, size_t pos) {
    if (!text.empty()) tokens_.push_back({Token::Type::Text, std::move(text), line_of(pos), column_of(pos)});
  }

  // After a tag's end: "-" strips the whitespace that follows, a block or comment tag drops
  // one newline (trim_blocks).
  size_t after_close(size_t pos, char control, bool block) const {
    if (control == '-') {
      while (pos < src_.size() && std::isspace(uint8_t(src_[pos]))) ++pos;
    } else if (block && control != '+' && pos < src_.size() && src_[pos] == '\n') {
      ++pos;
    }
    return pos;
  }

  size_t lex_comment(size_t open, size_t body) {
    const size_t close = src_.find("#}", body);
    if (close == std::string_view::npos) fail(open, "comment '{#' is never closed with '#}'");
    const char control = close > body && (src_[close - 1] == '-' || src_[close - 1] == '+') ? src_[close - 1] : '\0';
    return after_close(close + 2, control, true);
  }

  size_t lex_tag(size_t open, size_t pos, bool var) {
    tokens_.push_back({var ? Token::Type::VarBegin : Token::Type::BlockBegin, "", line_of(open), column_of(open)});
    int depth = 0;  // brackets: "}}" inside {'a': {'b': 1}} does not end the tag
    for (;;) {
      while (pos < src_.size() && std::isspace(uint8_t(src_[pos]))) ++pos;
      if (pos >= src_.size()) fail(open, std::string("tag is never closed with '") + (var ? "}}" : "%}") + "'");
      const std::string_view rest = src_.substr(pos);
      if (depth == 0) {
        const char* close = var ? "}}" : "%}";
        for (char control : {'-', '+', '\0'}) {
          if (control == '+' && var) continue;
          const std::string want = control ? std::string(1, control) + close : std::string(close);
          if (rest.substr(0, want.size()) == want) {
            tokens_.push_back({var ? Token::Type::VarEnd : Token::Type::BlockEnd, "", line_of(pos), column_of(pos)});
            return after_close(pos + want.size(), control, !var);
          }
        }
        if (rest.substr(0, 2) == (var ? "%}" : "}}")) fail(pos, std::string("expected '") + (var ? "}}" : "%}") + "'");
      }
      const int line = line_of(pos), column = column_of(pos);
      const char c = src_[pos];
      if (std::isalpha(uint8_t(c)) || c == '_') {
        size_t end = pos;
        while (end < src_.size() && (std::isalnum(uint8_t(src_[end])) || src_[end] == '_')) ++end;
        tokens_.push_back({Token::Type::Name, std::string(src_.substr(pos, end - pos)), line, column});
        pos = end;
      } else if (std::isdigit(uint8_t(c))) {
        size_t end = pos;
        bool is_float = false;
        while (end < src_.size() && (std::isdigit(uint8_t(src_[end])) || src_[end] == '_')) ++end;
        if (end + 1 < src_.size() && src_[end] == '.' && std::isdigit(uint8_t(src_[end + 1]))) {
          is_float = true;
          ++end;
          while (end < src_.size() && std::isdigit(uint8_t(src_[end]))) ++end;
        }
        if (end < src_.size() && (src_[end] == 'e' || src_[end] == 'E')) {
          size_t e = end + 1;
          if (e < src_.size() && (src_[e] == '+' || src_[e] == '-')) ++e;
          if (e < src_.size() && std::isdigit(uint8_t(src_[e]))) {
            is_float = true;
            end = e;
            while (end < src_.size() && std::isdigit(uint8_t(src_[end]))) ++end;
          }
        }
        std::string digits;
        for (char d : src_.substr(pos, end - pos))
          if (d != '_') digits += d;
        tokens_.push_back({is_float ? Token::Type::Float : Token::Type::Int, digits, line, column});
        pos = end;
      } else if (c == '\'' || c == '"') {
        tokens_.push_back({Token::Type::String, read_string(pos), line, column});
      } else {
        static const char* const ops[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<",
                                          ">",  "=",  "(",  ")",  "[",  "]",  "{", "}", ",", ".", ":", "|"};
        const char* op = nullptr;
        for (const char* o : ops)
          if (rest.substr(0, std::strlen(o)) == o) {
            op = o;
            break;
          }
        if (!op) fail(pos, std::string("unexpected character '") + c + "'");
        if (*op == '(' || *op == '[' || *op == '{') ++depth;
        if ((*op == ')' || *op == ']' || *op == '}') && depth > 0) --depth;
        tokens_.push_back({Token::Type::Op, op, line, column});
        pos += std::strlen(op);
      }
    }
  }

  // A string literal with Python's escapes (jinja2 decodes them with unicode-escape).
  std::string read_string(size_t& pos) {
    const size_t start = pos;
    const char quote = src_[pos++];
    std::u32string out;
    std::string raw;
    auto flush_raw = [&] {
      out += utf8_decode(raw);
      raw.clear();
    };
    while (pos < src_.size() && src_[pos] != quote) {
      if (src_[pos] != '\\') {
        raw += src_[pos++];
        continue;
      }
      flush_raw();
      if (++pos >= src_.size()) break;
      const char e = src_[pos++];
      auto hex = [&](int n) {
        char32_t v = 0;
        for (int k = 0; k < n; ++k, ++pos) {
          if (pos >= src_.size() || !std::isxdigit(uint8_t(src_[pos]))) fail(start, "bad escape in string");
          const char h = src_[pos];
          v = v * 16 + char32_t(std::isdigit(uint8_t(h)) ? h - '0' : std::tolower(h) - 'a' + 10);
        }
        return v;
      };
      switch (e) {
        case 'n': out += U'\n'; break;
        case 't': out += U'\t'; break;
        case 'r': out += U'\r'; break;
        case 'b': out += U'\b'; break;
        case 'f': out += U'\f'; break;
        case 'v': out += U'\v'; break;
        case 'a': out += U'\a'; break;
        case '0': out += U'\0'; break;
        case '\\': out += U'\\'; break;
        case '\'': out += U'\''; break;
        case '"': out += U'"'; break;
        case '\n': break;  // a line continuation
        case 'x': out += hex(2); break;
        case 'u': out += hex(4); break;
        case 'U': out += hex(8); break;
        default:  // Python keeps unknown escapes as written
          out += U'\\';
          raw += e;
      }
    }
    if (pos >= src_.size()) fail(start, "string is never closed");
    ++pos;
    flush_raw();
    return utf8_encode(out);
  }
};

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  Body parse_template() {
    std::string end_tag;
    Body body = parse_body({}, end_tag);
    return body;
  }

 private:
  std::vector<Token> t_;
  size_t p_ = 0;

  const Token& peek(size_t ahead = 0) const { return t_[std::min(p_ + ahead, t_.size() - 1)]; }
  const Token& next() { return t_[std::min(p_++, t_.size() - 1)]; }
  [[noreturn]] void fail(const Token& at, const std::string& msg) const { throw Error(at.line, at.column, msg); }
  bool is_op(const char* op, size_t ahead = 0) const {
    return peek(ahead).type == Token::Type::Op && peek(ahead).text == op;
  }
  bool is_name(const char* name, size_t ahead = 0) const {
    return peek(ahead).type == Token::Type::Name && peek(ahead).text == name;
  }
  bool accept_op(const char* op) {
    if (!is_op(op)) return false;
    ++p_;
    return true;
  }
  bool accept_name(const char* name) {
    if (!is_name(name)) return false;
    ++p_;
    return true;
  }
  void expect_op(const char* op) {
    if (!accept_op(op)) fail(peek(), std::string("expected '") + op + "', found " + show(peek()));
  }
  void expect_name(const char* name) {
    if (!accept_name(name)) fail(peek(), std::string("expected '") + name + "', found " + show(peek()));
  }
  std::string expect_identifier() {
    if (peek().type != Token::Type::Name) fail(peek(), "expected a name, found " + show(peek()));
    return next().text;
  }
  void expect_block_end() {
    if (peek().type != Token::Type::BlockEnd) fail(peek(), "expected '%}', found " + show(peek()));
    ++p_;
  }

  template <class T>
  static std::unique_ptr<T> make(typename T::Kind kind, const Token& at) {
    auto n = std::make_unique<T>();
    n->kind = kind;
    n->line = at.line;
    n->column = at.column;
    return n;
  }

  // Statements up to one of `ends` (a block tag's name, left unconsumed after it is read into
  // `end_tag`); with no ends, up to the end of the template.
  Body parse_body(const std::vector<std::string>& ends, std::string& end_tag) {
    Body body;
    for (;;) {
      const Token& tok = peek();
      switch (tok.type) {
        case Token::Type::End:
          if (!ends.empty()) {
            std::string want;
            for (const auto& e : ends) want += (want.empty() ? "'" : " or '") + e + "'";
            fail(tok, "expected " + want + ", found the end of the template");
          }
          return body;
        case Token::Type::Text: {
          auto n = make<Node>(Node::Kind::Text, tok);
          n->text = next().text;
          body.push_back(std::move(n));
          break;
        }
        case Token::Type::VarBegin: {
          auto n = make<Node>(Node::Kind::Output, next());
          n->expr = parse_expression();
          if (peek().type != Token::Type::VarEnd) fail(peek(), "expected '}}', found " + show(peek()));
          ++p_;
          body.push_back(std::move(n));
          break;
        }
        case Token::Type::BlockBegin: {
          const Token& name = peek(1);
          if (name.type != Token::Type::Name) fail(name, "expected a statement name, found " + show(name));
          for (const auto& e : ends)
            if (name.text == e) {
              p_ += 2;
              end_tag = e;
              return body;
            }
          const bool closes = name.text == "elif" || name.text == "else" || name.text.rfind("end", 0) == 0;
          if (closes && !ends.empty()) {
            std::string want;
            for (const auto& e : ends) want += (want.empty() ? "'" : " or '") + e + "'";
            fail(name, "expected " + want + ", found '" + name.text + "'");
          }
          ++p_;
          body.push_back(parse_statement());
          break;
        }
        default: fail(tok, "unexpected " + show(tok));
      }
    }
  }

  NodePtr parse_statement() {
    const Token& tag = next();
    const std::string& name = tag.text;
    std::string end_tag;
    if (name == "if") {
      auto n = make<Node>(Node::Kind::If, tag);
      ExprPtr cond = parse_expression();
      expect_block_end();
      for (;;) {
        Body body = parse_body({"elif", "else", "endif"}, end_tag);
        n->branches.emplace_back(std::move(cond), std::move(body));
        if (end_tag == "endif") break;
        if (end_tag == "else") {
          expect_block_end();
          n->branches.emplace_back(nullptr, parse_body({"endif"}, end_tag));
          break;
        }
        cond = parse_expression();
        expect_block_end();
      }
      expect_block_end();
      return n;
    }
    if (name == "for") {
      auto n = make<Node>(Node::Kind::For, tag);
      do n->targets.push_back(expect_identifier());
      while (accept_op(","));
      expect_name("in");
      n->expr = parse_tuple(false);
      if (accept_name("if")) n->filter = parse_expression();
      if (is_name("recursive")) fail(peek(), "recursive loops are not supported");
      expect_block_end();
      n->body = parse_body({"else", "endfor"}, end_tag);
      if (end_tag == "else") {
        expect_block_end();
        n->else_body = parse_body({"endfor"}, end_tag);
      }
      expect_block_end();
      return n;
    }
    if (name == "set") {
      auto n = make<Node>(Node::Kind::Set, tag);
      n->targets.push_back(expect_identifier());
      if (accept_op(".")) n->text = expect_identifier();
      else
        while (accept_op(",")) n->targets.push_back(expect_identifier());
      if (peek().type == Token::Type::BlockEnd && n->text.empty() && n->targets.size() == 1) {
        ++p_;
        n->kind = Node::Kind::SetBlock;
        n->body = parse_body({"endset"}, end_tag);
        expect_block_end();
        return n;
      }
      expect_op("=");
      n->expr = parse_tuple(true);
      expect_block_end();
      return n;
    }
    if (name == "macro") {
      auto n = make<Node>(Node::Kind::Macro, tag);
      n->text = expect_identifier();
      expect_op("(");
      while (!is_op(")")) {
        std::string param = expect_identifier();
        ExprPtr def;
        if (accept_op("=")) def = parse_expression();
        n->params.emplace_back(std::move(param), std::move(def));
        if (!accept_op(",")) break;
      }
      expect_op(")");
      expect_block_end();
      n->body = parse_body({"endmacro"}, end_tag);
      expect_block_end();
      return n;
    }
    if (name == "break" || name == "continue") {
      auto n = make<Node>(name == "break" ? Node::Kind::Break : Node::Kind::Continue, tag);
      expect_block_end();
      return n;
    }
    if (name == "generation") {  // Hugging Face's AssistantTracker block: renders its body
      auto n = make<Node>(Node::Kind::Scope, tag);
      expect_block_end();
      n->body = parse_body({"endgeneration"}, end_tag);
      expect_block_end();
      return n;
    }
    if (name == "elif" || name == "else" || name.rfind("end", 0) == 0)
      fail(tag, "unexpected '" + name + "' with no open block it could close");
    fail(tag, "unknown statement '" + name + "' (supported: if, for, set, macro, break, continue, generation)");
  }

  // Expressions, loosest first, as jinja2's parser: conditional, or, and, not, comparisons,
  // + -, ~, * / // %, **, unary - +, then primaries with postfixes, filters and tests.
  ExprPtr parse_tuple(bool with_condexpr) {
    const Token& at = peek();
    ExprPtr first = with_condexpr ? parse_expression() : parse_or();
    if (!is_op(",")) return first;
    auto t = make<Expr>(Expr::Kind::Tuple, at);
    t->args.push_back(std::move(first));
    while (accept_op(",")) {
      if (peek().type == Token::Type::BlockEnd || peek().type == Token::Type::VarEnd) break;
      t->args.push_back(with_condexpr ? parse_expression() : parse_or());
    }
    return t;
  }

  ExprPtr parse_expression() {
    ExprPtr e = parse_or();
    while (is_name("if")) {
      auto c = make<Expr>(Expr::Kind::Cond, next());
      c->args.push_back(parse_or());
      c->args.push_back(std::move(e));
      c->args.push_back(accept_name("else") ? parse_expression() : nullptr);
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary(const Token& at, const std::string& op, ExprPtr l, ExprPtr r) {
    auto b = make<Expr>(Expr::Kind::Binary, at);
    b->name = op;
    b->args.push_back(std::move(l));
    b->args.push_back(std::move(r));
    return b;
  }

  // One level of left-associative operators: sub (op sub)*, an op being one of `ops`
  // (keywords when `words`, else operator tokens).
  ExprPtr left_assoc(ExprPtr (Parser::*sub)(), std::initializer_list<const char*> ops, bool words) {
    ExprPtr e = (this->*sub)();
    for (;;) {
      const char* hit = nullptr;
      for (const char* op : ops)
        if (words ? is_name(op) : is_op(op)) {
          hit = op;
          break;
        }
      if (!hit) return e;
      const Token& at = next();
      e = binary(at, hit, std::move(e), (this->*sub)());
    }
  }
  ExprPtr parse_or() { return left_assoc(&Parser::parse_and, {"or"}, true); }
  ExprPtr parse_and() { return left_assoc(&Parser::parse_not, {"and"}, true); }
  ExprPtr parse_not() {
    if (is_name("not")) {
      auto u = make<Expr>(Expr::Kind::Unary, next());
      u->name = "not";
      u->args.push_back(parse_not());
      return u;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    const Token& at = peek();
    ExprPtr first = parse_math1();
    ExprPtr cmp;
    for (;;) {
      std::string op;
      if (peek().type == Token::Type::Op &&
          (is_op("==") || is_op("!=") || is_op("<") || is_op("<=") || is_op(">") || is_op(">="))) {
        op = next().text;
      } else if (is_name("in")) {
        ++p_;
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        p_ += 2;
        op = "not in";
      } else {
        break;
      }
      if (!cmp) {
        cmp = make<Expr>(Expr::Kind::Compare, at);
        cmp->args.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }
  ExprPtr parse_math1() { return left_assoc(&Parser::parse_concat, {"+", "-"}, false); }
  ExprPtr parse_concat() { return left_assoc(&Parser::parse_math2, {"~"}, false); }
  ExprPtr parse_math2() { return left_assoc(&Parser::parse_pow, {"*", "/", "//", "%"}, false); }
  ExprPtr parse_pow() {
    ExprPtr e = parse_unary(true);
    while (is_op("**")) {
      const Token& at = next();
      e = binary(at, "**", std::move(e), parse_unary(true));
    }
    return e;
  }
  ExprPtr parse_unary(bool with_filter) {
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      e = make<Expr>(Expr::Kind::Unary, peek());
      e->name = next().text;
      e->args.push_back(parse_unary(false));
    } else {
      e = parse_postfix(parse_primary());
    }
    return with_filter ? parse_filters(std::move(e)) : std::move(e);
  }

  ExprPtr parse_primary() {
    const Token& tok = peek();
    switch (tok.type) {
      case Token::Type::Name: {
        ++p_;
        auto e = make<Expr>(Expr::Kind::Literal, tok);
        if (tok.text == "true" || tok.text == "True") e->value = Value::boolean(true);
        else if (tok.text == "false" || tok.text == "False") e->value = Value::boolean(false);
        else if (tok.text == "none" || tok.text == "None") e->value = Value::none();
        else {
          e->kind = Expr::Kind::Name;
          e->name = tok.text;
        }
        return e;
      }
      case Token::Type::String: {
        auto e = make<Expr>(Expr::Kind::Literal, tok);
        std::string s;
        while (peek().type == Token::Type::String) s += next().text;  // adjacent strings join
        e->value = Value::string(std::move(s));
        return e;
      }
      case Token::Type::Int:
      case Token::Type::Float: {
        ++p_;
        auto e = make<Expr>(Expr::Kind::Literal, tok);
        try {
          e->value = tok.type == Token::Type::Int ? Value::integer(std::stoll(tok.text)) : Value::number(std::stod(tok.text));
        } catch (const std::exception&) {
          fail(tok, "number out of range: " + tok.text);
        }
        return e;
      }
      case Token::Type::Op:
        if (tok.text == "(") {
          ++p_;
          if (accept_op(")")) return make<Expr>(Expr::Kind::Tuple, tok);
          ExprPtr inner = parse_tuple(true);
          expect_op(")");
          return inner;
        }
        if (tok.text == "[") {
          ++p_;
          auto e = make<Expr>(Expr::Kind::List, tok);
          while (!is_op("]")) {
            e->args.push_back(parse_expression());
            if (!accept_op(",")) break;
          }
          expect_op("]");
          return e;
        }
        if (tok.text == "{") {
          ++p_;
          auto e = make<Expr>(Expr::Kind::Dict, tok);
          while (!is_op("}")) {
            e->args.push_back(parse_expression());
            expect_op(":");
            e->args.push_back(parse_expression());
            if (!accept_op(",")) break;
          }
          expect_op("}");
          return e;
        }
        [[fallthrough]];
      default: fail(tok, "expected an expression, found " + show(tok));
    }
  }

  void parse_call_args(Expr& call) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().type == Token::Type::Name && is_op("=", 1)) {
        std::string key = next().text;
        ++p_;
        call.kwargs.emplace_back(std::move(key), parse_expression());
      } else {
        if (!call.kwargs.empty()) fail(peek(), "positional argument after a keyword argument");
        call.args.push_back(parse_expression());
      }
      if (!accept_op(",")) break;
    }
    expect_op(")");
  }

  ExprPtr parse_postfix(ExprPtr e) {
    for (;;) {
      if (is_op(".")) {
        const Token& at = next();
        if (peek().type == Token::Type::Int) {  // x.0 is x[0]
          auto item = make<Expr>(Expr::Kind::Item, at);
          auto idx = make<Expr>(Expr::Kind::Literal, peek());
          idx->value = Value::integer(std::stoll(next().text));
          item->args.push_back(std::move(e));
          item->args.push_back(std::move(idx));
          e = std::move(item);
          continue;
        }
        auto a = make<Expr>(Expr::Kind::Attr, at);
        a->name = expect_identifier();
        a->args.push_back(std::move(e));
        e = std::move(a);
      } else if (is_op("[")) {
        const Token& at = next();
        ExprPtr parts[3];
        bool slice = false;
        for (int k = 0; k < 3; ++k) {
          if (!is_op(":") && !is_op("]")) parts[k] = parse_expression();
          if (k < 2 && accept_op(":")) slice = true;
          else break;
        }
        expect_op("]");
        auto s = make<Expr>(slice ? Expr::Kind::Slice : Expr::Kind::Item, at);
        s->args.push_back(std::move(e));
        if (!slice && !parts[0]) fail(at, "expected an index between '[' and ']'");
        for (int k = 0; k < (slice ? 3 : 1); ++k) s->args.push_back(std::move(parts[k]));
        e = std::move(s);
      } else if (is_op("(")) {
        auto c = make<Expr>(Expr::Kind::Call, peek());
        c->args.push_back(std::move(e));
        parse_call_args(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_filters(ExprPtr e) {
    for (;;) {
      if (is_op("|")) {
        const Token& at = next();
        auto f = make<Expr>(Expr::Kind::Filter, at);
        f->name = expect_identifier();
        while (accept_op(".")) f->name += "." + expect_identifier();
        f->args.push_back(std::move(e));
        if (is_op("(")) parse_call_args(*f);
        e = std::move(f);
      } else if (is_name("is")) {
        const Token& at = next();
        auto t = make<Expr>(Expr::Kind::Test, at);
        t->negated = accept_name("not");
        t->name = expect_identifier();
        t->args.push_back(std::move(e));
        if (is_op("(")) {
          parse_call_args(*t);
        } else {
          const Token& a = peek();
          const bool starts_arg =
              a.type == Token::Type::String || a.type == Token::Type::Int || a.type == Token::Type::Float ||
              (a.type == Token::Type::Name && a.text != "else" && a.text != "or" && a.text != "and" &&
               a.text != "if" && a.text != "in" && a.text != "not" && a.text != "is") ||
              (a.type == Token::Type::Op && (a.text == "[" || a.text == "{"));
          if (starts_arg) t->args.push_back(parse_postfix(parse_primary()));
        }
        e = std::move(t);
      } else if (is_op("(")) {
        auto c = make<Expr>(Expr::Kind::Call, peek());
        c->args.push_back(std::move(e));
        parse_call_args(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }
};

}  // namespace

Body parse(std::string_view source) { return Parser(Lexer(source).run()).parse_template(); }

}  // namespace specmesh::jinja
