// What a chat template can call by name: filters, tests, the methods of strings and dicts,
// and the globals (raise_exception, namespace, range, dict, strftime_now). See jinja.hpp.
#pragma once

#include <optional>
#include <string_view>

#include "specmesh/chat/jinja_value.hpp"

namespace specmesh::jinja {

// `input | name(args)`; ValueError for unknown filters and bad arguments.
Value apply_filter(std::string_view name, const Value& input, Args& args);
// `v is name(args)`; ValueError for unknown tests.
bool apply_test(std::string_view name, const Value& v, Args& args);
// obj.name as a bound method of a string, dict or list; nullopt when there is none.
std::optional<Value> method(const Value& obj, std::string_view name);
// A global function; nullopt for other names.
std::optional<Value> global(std::string_view name);

// Argument `index` (positional) or `name` (keyword), if given.
const Value* argument(const Args& args, size_t index, std::string_view name);

}  // namespace specmesh::jinja
