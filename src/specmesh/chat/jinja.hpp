// A Jinja interpreter for chat templates (a GGUF's tokenizer.chat_template), rendering them
// as Hugging Face transformers does: jinja2's ImmutableSandboxedEnvironment with
// trim_blocks=True, lstrip_blocks=True and the loopcontrols extension, its tojson filter
// (json.dumps, ensure_ascii=False, keys unsorted) and the raise_exception and strftime_now
// globals.
//
// Why our own: Debian bookworm keeps no C++ Jinja library that covers chat templates (inja,
// the one packaged C++ engine of that kind, is JSON-oriented: no macros, no namespace(), no
// loop.* or Python string methods, different whitespace rules), and llama.cpp's engine is not
// packaged. What is covered is what the templates of Llama 2/3, Qwen 2/2.5/3, ChatML,
// Mistral, Phi-3 and Gemma use, and more of the same kind:
//   statements  if/elif/else, for (with else, "if" filter, tuple targets, loop.*), set (names,
//               tuples, namespace attributes, {% set %}...{% endset %}), macro, break,
//               continue, {% generation %}
//   expressions literals, lists, dicts, tuples, . and [] access, slices, calls with keyword
//               arguments, + - * / // % ** ~, comparisons, in, not in, and, or, not,
//               conditional expressions, filters and "is" tests
//   filters     trim, tojson, length/count, upper, lower, title, capitalize, first, last,
//               join, default/d, list, string, int, float, abs, replace, reverse, items,
//               map, select/reject, selectattr/rejectattr, unique, sort, sum, min, max,
//               indent, safe, escape/e, wordcount
//   tests       defined, undefined, none, string, number, integer, float, boolean, true,
//               false, mapping, iterable, sequence, callable, even, odd, divisibleby, in,
//               eq/equalto/==, ne/!=, lt/<, le/<=, gt/>, ge/>=, sameas, lower, upper
//   methods     str: strip lstrip rstrip startswith endswith split rsplit upper lower title
//               capitalize replace find rfind count join splitlines isdigit isalpha isspace;
//               dict: items keys values get; list: index count (lists are immutable: append
//               is refused, as in the sandbox; so is Python's % string formatting)
//   globals     raise_exception, namespace, range, dict, strftime_now
// Undefined values behave as jinja2's default Undefined: they print as nothing, are false
// and empty, and fail when used in arithmetic or when their attributes are read.
//
// Nothing hangs: a render takes at most a fixed number of steps (loop iterations and
// statements: 1000000), macros nest at most 64 deep, range() yields at most 100000 numbers and the
// output is at most 64 MiB.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "specmesh/chat/jinja_value.hpp"

namespace specmesh::jinja {

struct Node;

class Template {
 public:
  // Parses `source`; throws Error (line, column and what was expected) on a syntax error.
  explicit Template(std::string_view source);
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  // Renders with the context's keys as variables. Throws Raised with the message of the
  // template's raise_exception(), Error for anything else that goes wrong.
  std::string render(const nlohmann::ordered_json& context) const;

 private:
  struct Program;
  std::unique_ptr<Program> program_;
};

}  // namespace specmesh::jinja
