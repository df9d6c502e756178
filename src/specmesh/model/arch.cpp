#include "specmesh/model/arch.hpp"

namespace specmesh {

namespace {
const ArchSpec* const kArchs[] = {&kLlamaArch, &kQwen2Arch, &kQwen3Arch};
}  // namespace

const ArchSpec& arch_spec(Arch a) {
  for (const ArchSpec* s : kArchs)
    if (s->arch == a) return *s;
  return kLlamaArch;  // unreachable: every enumerator has a spec
}

const ArchSpec* find_arch(std::string_view name) {
  for (const ArchSpec* s : kArchs)
    if (name == s->name) return s;
  return nullptr;
}

const char* arch_name(Arch a) { return arch_spec(a).name; }

std::string arch_names() {
  std::string out;
  for (const ArchSpec* s : kArchs) out += (out.empty() ? "" : ", ") + std::string(s->name);
  return out;
}

}  // namespace specmesh
