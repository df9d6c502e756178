// The message codec: a header frame and tensor frames, decoded as a peer's gateway does.
// Input layout: a byte k (at most 8 tensor frames: k % 9), k u16 (little-endian) frame
// lengths, the frames' bytes, and the header frame as the rest. Every input either decodes
// or is refused with a DecodeError and a reason; what decodes encodes again, and that
// encoding decodes to the same envelope and re-encodes to the same bytes.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "check.hpp"
#include "specmesh/messages/protocol.hpp"

using namespace specmesh;

namespace {

bool frames_fit(const std::vector<Tensor>& ts) {
  for (const Tensor& t : ts)
    if (t.data.size() != t.expected_bytes()) return false;
  return true;
}

bool consistent(const Envelope& e) {
  return std::visit(
      [](const auto& m) {
        using M = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<M, Activations> || std::is_same_v<M, AttentionSync>) return frames_fit(m.tensors);
        else if constexpr (std::is_same_v<M, Logits>) return frames_fit({m.logits});
        else if constexpr (std::is_same_v<M, HiddenStates>) return frames_fit({m.states});
        else return true;
      },
      e.payload);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t k = data[0] % 9;
  size_t off = 1;
  std::vector<size_t> lens;
  for (size_t i = 0; i < k; ++i) {
    if (size - off < 2) return 0;
    lens.push_back(size_t(data[off]) | size_t(data[off + 1]) << 8);
    off += 2;
  }
  std::vector<Blob> blobs;
  for (size_t len : lens) {
    len = std::min(len, size - off);
    blobs.push_back(Blob::copy_of(data + off, len));  // a buffer of its own: overreads are caught
    off += len;
  }
  // The header in a buffer of exactly its size, too.
  const std::vector<std::byte> header(reinterpret_cast<const std::byte*>(data + off),
                                      reinterpret_cast<const std::byte*>(data + size));
  const DecodeResult r = decode(std::span<const std::byte>(header.data(), header.size()), blobs);
  if (!r.ok()) {
    FUZZ_REQUIRE(!r.detail.empty());
    FUZZ_REQUIRE(r.envelope == Envelope{});
    return 0;
  }
  FUZZ_REQUIRE(consistent(r.envelope));

  std::vector<char> h1, h2;
  std::vector<Blob> b1, b2;
  encode(r.envelope, h1, b1);
  const DecodeResult again = decode(std::string_view(h1.data(), h1.size()), b1);
  FUZZ_REQUIRE(again.ok());
  FUZZ_REQUIRE(again.envelope == r.envelope);
  encode(again.envelope, h2, b2);
  FUZZ_REQUIRE(h1 == h2);
  FUZZ_REQUIRE(b1 == b2);
  return 0;
}
