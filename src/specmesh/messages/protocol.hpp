// The wire protocol between specmesh processes: plain structs plus a msgpack codec.
//
// Wire format of one message (a multipart ZeroMQ message after the routing frames):
//   frame 0     msgpack header: [version, type, run_id, seq, session, payload]
//   frame 1..n  raw tensor bytes, one frame per Tensor in the order the payload lists them
// Tensors never go through msgpack element by element (that costs ~1.7 ms/MiB); the header
// carries only their dtype, shape and byte length, and the bytes travel as their own frames
// so both sides can hand them to ZeroMQ without copying.
//
// Versioning: the first header element is the protocol version and is checked before anything
// else is interpreted; a peer speaking another version is rejected, never half-decoded.
#pragma once

#include <caf/allowed_unsafe_message_type.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace specmesh {

inline constexpr uint16_t kProtocolVersion = 2;

// Wire values are part of the protocol: append, never renumber.
enum class MsgType : uint8_t {
  run_start = 1,
  activations = 2,
  logits = 3,
  kv_cache_op = 4,
  cancel = 5,
  heartbeat = 6,
  error = 7,
  hidden_states = 8,
  attention_sync = 9,
  replan = 10,
};
inline constexpr uint8_t kMsgTypeMin = 1;
inline constexpr uint8_t kMsgTypeMax = 10;

// Control messages travel on their own socket so they overtake queued tensors.
constexpr bool is_control(MsgType t) {
  return t == MsgType::cancel || t == MsgType::heartbeat || t == MsgType::error;
}
const char* to_string(MsgType t);

enum class WireDType : uint8_t { f32 = 0, f16 = 1, bf16 = 2, i32 = 3, i64 = 4, i8 = 5, u8 = 6 };
inline constexpr uint8_t kWireDTypeMax = 6;
std::size_t dtype_size(WireDType t);
const char* to_string(WireDType t);

// An immutable byte range kept alive by a shared owner (a vector, a received ZeroMQ frame, ...).
// Copying a Blob shares the bytes. Received frames are not necessarily aligned for their
// element type: use view<T>() only when aligned_for<T>(), otherwise to_vector<T>().
class Blob {
 public:
  Blob() = default;
  Blob(std::shared_ptr<const void> owner, const void* data, std::size_t size)
      : owner_(std::move(owner)), data_(static_cast<const std::byte*>(data)), size_(size) {}

  static Blob copy_of(const void* data, std::size_t size) {
    auto buf = std::make_shared<std::vector<std::byte>>(size);
    if (size) std::memcpy(buf->data(), data, size);
    return Blob(buf, buf->data(), size);
  }
  // Takes ownership of the vector without copying its elements.
  template <class T>
  static Blob adopt(std::vector<T> v) {
    static_assert(std::is_trivially_copyable_v<T>);
    auto p = std::make_shared<std::vector<T>>(std::move(v));
    return Blob(p, p->data(), p->size() * sizeof(T));
  }

  const std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  std::span<const std::byte> bytes() const noexcept { return {data_, size_}; }
  const std::shared_ptr<const void>& owner() const noexcept { return owner_; }

  template <class T>
  bool aligned_for() const noexcept {
    return reinterpret_cast<std::uintptr_t>(data_) % alignof(T) == 0;
  }
  // Zero-copy typed view; throws if misaligned or not a whole number of elements.
  template <class T>
  std::span<const T> view() const {
    static_assert(std::is_trivially_copyable_v<T>);
    if (size_ % sizeof(T) != 0) throw std::runtime_error("Blob::view: size not a multiple");
    if (!aligned_for<T>()) throw std::runtime_error("Blob::view: misaligned, use to_vector");
    return {reinterpret_cast<const T*>(data_), size_ / sizeof(T)};
  }
  // Copies into a typed vector; works at any alignment.
  template <class T>
  std::vector<T> to_vector() const {
    static_assert(std::is_trivially_copyable_v<T>);
    if (size_ % sizeof(T) != 0) throw std::runtime_error("Blob::to_vector: size not a multiple");
    std::vector<T> out(size_ / sizeof(T));
    if (size_) std::memcpy(out.data(), data_, size_);
    return out;
  }

  // Compares contents, not owners.
  friend bool operator==(const Blob& a, const Blob& b) {
    return a.size_ == b.size_ && (a.size_ == 0 || std::memcmp(a.data_, b.data_, a.size_) == 0);
  }

 private:
  std::shared_ptr<const void> owner_;
  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

// A dense row-major tensor. data.size() must equal numel() * dtype_size(dtype).
struct Tensor {
  WireDType dtype = WireDType::f32;
  std::vector<int64_t> shape;
  Blob data;

  std::size_t numel() const {
    std::size_t n = 1;
    for (auto d : shape) n *= static_cast<std::size_t>(d);
    return n;
  }
  std::size_t expected_bytes() const { return numel() * dtype_size(dtype); }

  // Builds a tensor that owns `values` (no copy); throws if the count does not match the shape.
  template <class T>
  static Tensor from(WireDType dtype, std::vector<int64_t> shape, std::vector<T> values) {
    Tensor t{dtype, std::move(shape), {}};
    if (values.size() * sizeof(T) != t.expected_bytes())
      throw std::invalid_argument("Tensor::from: value count does not match shape and dtype");
    t.data = Blob::adopt(std::move(values));
    return t;
  }
  friend bool operator==(const Tensor&, const Tensor&) = default;
};

// --- Payloads -----------------------------------------------------------------------------

// Starts a run: a batch of tokens at any positions in any sequences (parallel arrays).
// seq_masks[i] is the set of KV-cache sequences token i belongs to (bit s = sequence s);
// logits[i] != 0 asks for that token's logits (empty: all); parents, when not empty, makes
// the batch a token tree (parents[i] = batch index of i's parent, -1 = the cached context).
// inputs, when not empty, names per token the run whose tapped hidden states (HiddenStates,
// StageConfig::tap_layers) are its input (0: none), and input_rows the row of that run's batch:
// a drafter conditioned on another pipeline's layers takes them for its context rows (by row,
// not position: a context shift moves positions, not rows).
struct RunStart {
  std::string pipeline;  // which model's pipeline the run is for
  std::vector<int32_t> tokens;
  std::vector<int32_t> positions;
  std::vector<uint64_t> seq_masks;
  std::vector<uint8_t> logits;
  std::vector<int32_t> parents;
  bool speculative = false;
  std::vector<uint64_t> inputs;
  std::vector<int32_t> input_rows;
  friend bool operator==(const RunStart&, const RunStart&) = default;
};

// Hidden states handed from one pipeline stage to the next. `layer` is the first layer the
// receiver computes. tensors[0] is the hidden state; further tensors carry partial attention
// results (e.g. output, running max, running sum) when attention is split across nodes.
struct Activations {
  std::string pipeline;
  int32_t layer = 0;
  RunStart batch;  // the run's batch travels with its hidden states
  std::vector<Tensor> tensors;
  friend bool operator==(const Activations&, const Activations&) = default;
};

// Output logits; row i of `logits` belongs to batch index rows[i].
struct Logits {
  std::string pipeline;
  std::vector<int32_t> rows;
  Tensor logits;
  friend bool operator==(const Logits&, const Logits&) = default;
};

// Residual-stream hidden states after one layer, for actors that consume a model's internal
// states rather than its logits (a block drafter conditioned on target layers, devices that
// exchange attention outputs). Row i of `states` is batch index rows[i], the token at
// positions[i]: positions alone are ambiguous in trees and multi-sequence batches, rows alone
// mean nothing to a receiver that did not see the batch. `states` is rows x n_embd, f32 or f16.
struct HiddenStates {
  std::string pipeline;
  int32_t layer = 0;  // absolute index of the layer the states are taken after
  std::vector<int32_t> rows;
  std::vector<int32_t> positions;
  Tensor states;
  friend bool operator==(const HiddenStates&, const HiddenStates&) = default;
};

// The per-layer exchange between the two devices of an attention-level speculation pair
// (ALSpec), and the pair's per-token report to the head. Per decode token and layer each
// device sends its priority (the all-gather); the sender then hands the receiver its state
// and the speculative attention output; after the last layer (layer == n_layer) one more
// priority exchange names the device that sends the logits, with a report before them.
enum class SyncKind : uint8_t { priority = 0, handoff = 1, report = 2 };
inline constexpr uint8_t kSyncKindMax = 2;
struct AttentionSync {
  std::string pipeline;  // role of the stage it is for; report: the run's role
  SyncKind kind = SyncKind::priority;
  int32_t layer = 0;     // the attention's layer; n_layer for the final all-gather
  int32_t position = 0;  // the decode token's position
  int32_t priority = 0;  // priority: 0, 1 or 2 (see speculation/alspec_gating.hpp)
  // handoff: f32 vectors residual (n_embd), K and V rows (kv_dim), speculative output (q_dim);
  // report: u8 per layer, 1 where the speculation was accepted; priority: none.
  std::vector<Tensor> tensors;
  double saved_ms = 0;   // report: modelled time the accepted speculations saved
  friend bool operator==(const AttentionSync&, const AttentionSync&) = default;
};

// KV-cache edits with llama.cpp semantics over position ranges [pos_begin, pos_end);
// a negative bound means open-ended. dst_seq is copy's destination. shift adds `delta` to the
// positions of the sequence's cells in the range (llama.cpp's seq_add) and rotates their
// cached keys by it, so they read as if computed at the new positions (llama.cpp's K-shift);
// a shift's dst_seq >= seq makes it the last of a range of sequences seq..dst_seq whose cells
// move once each, however many of them a cell is in (one shift per sequence would move a
// shared cell several times). remove, shift and unview take seq -1 for every sequence.
//
// The view kinds set which cells attention of sequence `seq` reads (model/kv_view.hpp); the
// cells themselves stay as they are:
//   window:   StreamingLLM, the first pos_begin positions and the pos_end up to the query's.
//   retrieve: a retrieval cache (TriForce) built on the stage from sequence 0's keys at
//             positions [0, pos_begin) and the query of position pos_begin - 1, which must be
//             the last token of the stage's last run: chunks of dst_seq positions, a budget of
//             pos_end entries (see retrieval_view_op).
//   unview:   seq reads every visible cell again (seq -1: every sequence).
// Removing every position of a sequence (seq -1: of every sequence) drops its view as well.
enum class KvOpKind : uint8_t { copy = 0, remove = 1, keep = 2, shift = 3, window = 4, retrieve = 5, unview = 6 };
inline constexpr uint8_t kKvOpKindMax = 6;
struct KvOp {
  KvOpKind kind = KvOpKind::remove;
  int32_t seq = 0;
  int32_t dst_seq = -1;
  int32_t pos_begin = -1;
  int32_t pos_end = -1;
  int32_t delta = 0;  // shift only
  friend bool operator==(const KvOp&, const KvOp&) = default;
};
inline KvOp window_view_op(int32_t seq, int32_t sink, int32_t recent) {
  return {KvOpKind::window, seq, -1, sink, recent};
}
// Built right after a run whose last token sits at position fresh_from - 1 (its query scores
// the chunks); positions from fresh_from on are the tokens generated since.
inline KvOp retrieval_view_op(int32_t seq, int32_t fresh_from, int32_t chunk, int32_t budget) {
  return {KvOpKind::retrieve, seq, chunk, fresh_from, budget};
}
inline KvOp unview_op(int32_t seq) { return {KvOpKind::unview, seq, -1, -1, -1}; }
// llama.cpp's context shift on every sequence: positions [n_keep, n_keep + n_discard) go, and
// the later ones move down by n_discard.
inline std::vector<KvOp> context_shift_ops(int32_t n_keep, int32_t n_discard) {
  return {{KvOpKind::remove, -1, -1, n_keep, n_keep + n_discard}, {KvOpKind::shift, -1, -1, n_keep + n_discard, -1, -n_discard}};
}
// Where position p (an end, or a next free position) is after that shift: the same up to
// n_keep, n_discard lower past the discarded range, n_keep inside it.
inline int64_t shifted_position(int64_t p, int64_t n_keep, int64_t n_discard) {
  return p <= n_keep ? p : std::max(n_keep, p - n_discard);
}
// When ops[i] and ops[i + 1] are a context shift as context_shift_ops builds it (for any
// sequence), its n_keep and n_discard.
inline std::optional<std::pair<int32_t, int32_t>> context_shift_at(const std::vector<KvOp>& ops, size_t i) {
  if (i + 1 >= ops.size()) return std::nullopt;
  const KvOp &rm = ops[i], &sh = ops[i + 1];
  if (rm.kind != KvOpKind::remove || sh.kind != KvOpKind::shift || rm.pos_begin < 0 || rm.pos_end <= rm.pos_begin ||
      sh.seq != rm.seq || sh.pos_begin != rm.pos_end || sh.pos_end >= 0 || sh.delta != rm.pos_begin - rm.pos_end)
    return std::nullopt;
  return std::pair{rm.pos_begin, rm.pos_end - rm.pos_begin};
}

struct KvCacheOp {
  std::string pipeline;
  int32_t layer = 0;      // first layer of the stage it is addressed to
  std::vector<KvOp> ops;  // applied in order
  friend bool operator==(const KvCacheOp&, const KvCacheOp&) = default;
};

struct Cancel {
  std::vector<uint64_t> run_ids;
  friend bool operator==(const Cancel&, const Cancel&) = default;
};

struct Heartbeat {
  uint64_t sent_ns = 0;  // sender's steady clock, for round-trip estimates only
  friend bool operator==(const Heartbeat&, const Heartbeat&) = default;
};

enum class ErrorCode : uint8_t {
  internal = 0,
  peer_down = 1,         // raised locally by the gateway when a peer stops answering
  invalid_request = 2,
  out_of_memory = 3,
  messages_lost = 4,     // raised locally by the gateway on a sequence gap from a peer
};
inline constexpr uint8_t kErrorCodeMax = 4;
const char* to_string(ErrorCode c);
struct Error {
  ErrorCode code = ErrorCode::internal;
  std::string peer;  // the node the error is about (or comes from)
  std::string message;
  friend bool operator==(const Error&, const Error&) = default;
};

// Failover: the head moves the stage of `pipeline` over layers [layer_begin, layer_end) onto
// a standby device after the stage's node stopped answering. Every live node applies it: the
// node of `device` starts the stage (sending its output to `next_node`, taking work only
// from `upstream`), the stage before it sends its output to `node` from now on, the stage
// after it takes work from `node`. Each node then answers the head with the same message and
// done = true; `epoch` tells one failover's answers from another's.
struct Replan {
  std::string pipeline;
  int32_t layer_begin = 0;
  int32_t layer_end = 0;
  std::string device;
  std::string node;
  std::string next_node;
  std::string upstream;
  uint64_t epoch = 0;
  bool done = false;
  friend bool operator==(const Replan&, const Replan&) = default;
};

// Alternative index + 1 == MsgType wire value.
using Payload = std::variant<RunStart, Activations, Logits, KvCacheOp, Cancel, Heartbeat, Error, HiddenStates,
                             AttentionSync, Replan>;
static_assert(std::variant_size_v<Payload> == kMsgTypeMax);

struct Envelope {
  uint16_t version = kProtocolVersion;
  uint64_t run_id = 0;
  uint64_t seq = 0;      // per link and channel; assigned by the sending gateway
  uint64_t session = 0;  // sender incarnation (random per gateway); a restart resets seq
  Payload payload;

  MsgType type() const { return static_cast<MsgType>(payload.index() + 1); }
  friend bool operator==(const Envelope&, const Envelope&) = default;
};

inline Envelope make_envelope(uint64_t run_id, Payload payload) {
  Envelope e;
  e.run_id = run_id;
  e.payload = std::move(payload);
  return e;
}

// --- Codec --------------------------------------------------------------------------------

// Appends the msgpack header of `env` to `header` (cleared first) and the tensor frames, in
// wire order, to `blobs` (cleared first). Throws std::invalid_argument if a tensor's byte
// size does not match its dtype and shape.
void encode(const Envelope& env, std::vector<char>& header, std::vector<Blob>& blobs);

enum class DecodeError : uint8_t {
  none = 0,
  truncated,       // header ends before a value or a declared length (hostile length prefix)
  malformed,       // not msgpack, or a field has the wrong msgpack type or arity
  too_deep,        // msgpack nesting deeper than the protocol ever uses
  trailing_bytes,  // bytes left after the header value
  wrong_version,
  unknown_type,    // message type outside the known range
  bad_enum,        // dtype / kv op / error code outside its range
  bad_tensor,      // shape, dtype, byte size or frame count inconsistent
};
inline constexpr uint8_t kDecodeErrorMax = 8;
const char* to_string(DecodeError e);

struct DecodeResult {
  DecodeError error = DecodeError::none;
  std::string detail;  // human-readable reason when error != none
  Envelope envelope;
  bool ok() const { return error == DecodeError::none; }
};

// Decodes a header frame plus its tensor frames. Never throws; unpacking is bounded by the
// header length, so a hostile length prefix cannot trigger a large allocation.
DecodeResult decode(std::span<const std::byte> header, std::span<const Blob> blobs);

// Convenience for tests and tools: decode a header given as a char range.
inline DecodeResult decode(std::string_view header, std::span<const Blob> blobs) {
  return decode(std::as_bytes(std::span<const char>(header.data(), header.size())), blobs);
}

}  // namespace specmesh

// Envelopes are handed to local CAF actors as message content (never serialized by CAF).
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(specmesh::Envelope)
