// safetensors reader and the DFlash drafter's weight checks on top of it, from bytes. Every
// input either loads or is refused with a FormatError; a loaded file's tensors lie inside it,
// tile its data buffer and hold exactly their shape's bytes.
#include <cstddef>
#include <cstdint>
#include <span>

#include "check.hpp"
#include "specmesh/formats/safetensors.hpp"

using namespace specmesh;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    SafetensorsFile f(MappedFile::copy_of(std::span<const uint8_t>(data, size), "fuzz.safetensors"));
    size_t at = f.data_offset();
    for (const SafetensorsTensor& t : f.tensors()) {
      FUZZ_REQUIRE(f.tensor(t.name) != nullptr);
      // In offset order, each tensor starts where the previous one ended.
      FUZZ_REQUIRE(t.nbytes <= f.file_size() - at);
      const size_t elem = t.type == DType::F32 ? 4 : 2;
      FUZZ_REQUIRE(t.nbytes == size_t(t.n_elements()) * elem);
      if (t.nbytes) {
        // The address sanitizer checks the first and last byte really are in the buffer.
        volatile uint8_t first = t.data[0], last = t.data[t.nbytes - 1];
        (void)first, (void)last;
      }
      at += t.nbytes;
    }
    FUZZ_REQUIRE(at == f.file_size());
  } catch (const FormatError&) {
  }
  return 0;
}
