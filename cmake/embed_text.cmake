# embed_text(INPUT OUTPUT NAMESPACE FUNCTION): writes OUTPUT, a C++ file defining
# `std::string_view NAMESPACE::FUNCTION()` that returns INPUT's bytes. Runs at configure time;
# INPUT is a configure dependency, so editing it re-runs CMake and rebuilds the file.
function(embed_text input output namespace function)
  file(READ "${input}" content HEX)
  string(LENGTH "${content}" hex_length)
  # Bytes as a character array: no raw-string delimiter to collide with, no size limit of
  # string literals.
  string(REGEX REPLACE "([0-9a-f][0-9a-f])" "'\\\\x\\1'," bytes "${content}")
  string(REGEX REPLACE "(('\\\\x[0-9a-f][0-9a-f]',){16})" "\\1\n" bytes "${bytes}")
  math(EXPR length "${hex_length} / 2")
  file(WRITE "${output}.tmp"
       "// Generated from ${input} by cmake/embed_text.cmake; do not edit.\n"
       "#include <string_view>\n\nnamespace ${namespace} {\n\n"
       "namespace {\nconstexpr char kText[] = {\n${bytes}'\\0'};\n}  // namespace\n\n"
       "std::string_view ${function}() { return {kText, ${length}}; }\n\n}  // namespace ${namespace}\n")
  file(COPY_FILE "${output}.tmp" "${output}" ONLY_IF_DIFFERENT)
  file(REMOVE "${output}.tmp")
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${input}")
endfunction()
