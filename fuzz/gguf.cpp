// GGUF reader and the model loader on top of it, from bytes. Every input either loads or is
// refused with a FormatError; a loaded file's tensors lie inside it, and a loaded model's
// tokenizer turns a short text into ids of its vocabulary and back.
#include <cstddef>
#include <cstdint>
#include <span>

#include "check.hpp"
#include "specmesh/formats/gguf.hpp"
#include "specmesh/model/model.hpp"
#include "specmesh/tokenizer/tokenizer.hpp"

using namespace specmesh;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  try {
    GgufFile f(MappedFile::copy_of(bytes, "fuzz.gguf"));
    // The typed lookups of every key: a value of another type is a FormatError, never a crash.
    for (const GgufKV& kv : f.metadata()) {
      try { (void)f.get_int(kv.key); } catch (const FormatError&) {}
      try { (void)f.get_float(kv.key); } catch (const FormatError&) {}
      try { (void)f.get_bool(kv.key); } catch (const FormatError&) {}
      try { (void)f.get_string(kv.key); } catch (const FormatError&) {}
    }
    for (const GgufTensorInfo& t : f.tensors()) {
      FUZZ_REQUIRE(f.tensor(t.name) == &t);
      FUZZ_REQUIRE(f.data_offset() <= f.file_size() && t.offset <= f.file_size() - f.data_offset() &&
                   t.nbytes <= f.file_size() - f.data_offset() - t.offset);
      // The address sanitizer checks the first and last byte really are in the buffer.
      if (t.nbytes) {
        volatile uint8_t first = t.data[0], last = t.data[t.nbytes - 1];
        (void)first, (void)last;
      }
    }
  } catch (const FormatError&) {
    return 0;  // the loader would refuse it the same way
  }

  try {
    auto m = Model::load(MappedFile::copy_of(bytes, "fuzz.gguf"));
    const Tokenizer& tok = m->tokenizer();
    const int n = tok.n_vocab();
    FUZZ_REQUIRE(n > 0 && n <= m->hparams().n_vocab);
    for (bool special : {false, true}) {
      const std::vector<int32_t> ids = tok.encode("Once upon a time, <s> naïve 日本 \n\t 42!", special);
      for (int32_t id : ids) FUZZ_REQUIRE(id >= 0 && id < n);
      (void)tok.decode(ids);
    }
    FUZZ_REQUIRE(!tok.encode_prompt("").empty());
    StreamDecoder dec(tok);
    for (int32_t id = 0; id < n && id < 64; ++id) (void)dec.feed(id);
    (void)dec.flush();
    (void)m->weight_bytes_per_token();
  } catch (const FormatError&) {
  }
  return 0;
}
