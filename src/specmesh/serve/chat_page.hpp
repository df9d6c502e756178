// The chat page served at "/": chat_page.html (HTML, CSS and JavaScript in one file, no build
// step), embedded in the binary at configure time.
#pragma once

#include <string_view>

namespace specmesh::serve {

std::string_view chat_page();

}  // namespace specmesh::serve
