// The llama2.c loader (checkpoint plus tokenizer file), from bytes. Input layout: a u32
// (little-endian) length n, then n bytes of checkpoint, then the tokenizer file. Every input
// either loads or is refused with a FormatError; a loaded model's views lie inside the
// checkpoint and its tokenizer round-trips a short text.
#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>

#include "check.hpp"
#include "specmesh/formats/gguf.hpp"
#include "specmesh/model/model.hpp"
#include "specmesh/tokenizer/tokenizer.hpp"

using namespace specmesh;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  uint32_t n = 0;
  std::memcpy(&n, data, 4);
  data += 4, size -= 4;
  n = static_cast<uint32_t>(std::min<size_t>(n, size));
  MappedFile checkpoint = MappedFile::copy_of({data, n}, "fuzz.bin");
  const MappedFile tokenizer = MappedFile::copy_of({data + n, size - n}, "fuzz-tok.bin");
  if (is_gguf_file(checkpoint)) return 0;  // the gguf target's inputs
  try {
    auto m = Model::load(std::move(checkpoint), &tokenizer);
    const HParams& hp = m->hparams();
    const Tokenizer& tok = m->tokenizer();
    FUZZ_REQUIRE(tok.n_vocab() == hp.n_vocab);
    FUZZ_REQUIRE(int(m->layers.size()) == hp.n_layer);
    // The last weights of the file are inside the checkpoint (the sanitizer checks it).
    for (const WeightView* w : {&m->layers.back().w_up, &m->output}) {
      volatile float last = reinterpret_cast<const float*>(w->data)[w->rows * w->cols - 1];
      (void)last;
    }
    const std::vector<int32_t> ids = tok.encode("Once upon a time, naïve 42!", true);
    for (int32_t id : ids) FUZZ_REQUIRE(id >= 0 && id < tok.n_vocab());
    (void)tok.decode(ids);
  } catch (const FormatError&) {
  }
  return 0;
}
