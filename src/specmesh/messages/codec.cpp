// msgpack codec for the envelope and payloads. Decoding walks msgpack objects by hand instead
// of using MSGPACK_DEFINE conversions so every arity, integer range and enum value is checked
// (msgpack's own conversions accept out-of-range enums and silently default missing fields).
#include "specmesh/messages/protocol.hpp"

#include <msgpack.hpp>

#include <cmath>
#include <limits>

namespace specmesh {

const char* to_string(MsgType t) {
  switch (t) {
    case MsgType::run_start: return "run_start";
    case MsgType::activations: return "activations";
    case MsgType::logits: return "logits";
    case MsgType::kv_cache_op: return "kv_cache_op";
    case MsgType::cancel: return "cancel";
    case MsgType::heartbeat: return "heartbeat";
    case MsgType::error: return "error";
    case MsgType::hidden_states: return "hidden_states";
    case MsgType::attention_sync: return "attention_sync";
    case MsgType::replan: return "replan";
  }
  return "unknown";
}

std::size_t dtype_size(WireDType t) {
  switch (t) {
    case WireDType::f32: return 4;
    case WireDType::f16: return 2;
    case WireDType::bf16: return 2;
    case WireDType::i32: return 4;
    case WireDType::i64: return 8;
    case WireDType::i8: return 1;
    case WireDType::u8: return 1;
  }
  return 0;
}

const char* to_string(WireDType t) {
  switch (t) {
    case WireDType::f32: return "f32";
    case WireDType::f16: return "f16";
    case WireDType::bf16: return "bf16";
    case WireDType::i32: return "i32";
    case WireDType::i64: return "i64";
    case WireDType::i8: return "i8";
    case WireDType::u8: return "u8";
  }
  return "unknown";
}

const char* to_string(ErrorCode c) {
  switch (c) {
    case ErrorCode::internal: return "internal";
    case ErrorCode::peer_down: return "peer_down";
    case ErrorCode::invalid_request: return "invalid_request";
    case ErrorCode::out_of_memory: return "out_of_memory";
    case ErrorCode::messages_lost: return "messages_lost";
  }
  return "unknown";
}

const char* to_string(DecodeError e) {
  switch (e) {
    case DecodeError::none: return "none";
    case DecodeError::truncated: return "truncated";
    case DecodeError::malformed: return "malformed";
    case DecodeError::too_deep: return "too_deep";
    case DecodeError::trailing_bytes: return "trailing_bytes";
    case DecodeError::wrong_version: return "wrong_version";
    case DecodeError::unknown_type: return "unknown_type";
    case DecodeError::bad_enum: return "bad_enum";
    case DecodeError::bad_tensor: return "bad_tensor";
  }
  return "unknown";
}

namespace {

// --- encoding -----------------------------------------------------------------------------

struct VecWriter {
  std::vector<char>* out;
  void write(const char* p, std::size_t n) { out->insert(out->end(), p, p + n); }
};
using Packer = msgpack::packer<VecWriter>;

struct Encoder {
  Packer& pk;
  std::vector<Blob>& blobs;

  void ints(const std::vector<int32_t>& v) {
    pk.pack_array(static_cast<uint32_t>(v.size()));
    for (auto x : v) pk.pack_int32(x);
  }
  void tensor(const Tensor& t) {
    if (t.data.size() != t.expected_bytes())
      throw std::invalid_argument("encode: tensor byte size does not match dtype and shape");
    pk.pack_array(3);
    pk.pack_uint8(static_cast<uint8_t>(t.dtype));
    pk.pack_array(static_cast<uint32_t>(t.shape.size()));
    for (auto d : t.shape) pk.pack_int64(d);
    pk.pack_uint64(t.data.size());
    blobs.push_back(t.data);
  }

  void operator()(const RunStart& m) {
    pk.pack_array(9);
    pk.pack(m.pipeline);
    ints(m.tokens);
    ints(m.positions);
    pk.pack_array(static_cast<uint32_t>(m.seq_masks.size()));
    for (auto x : m.seq_masks) pk.pack_uint64(x);
    pk.pack_array(static_cast<uint32_t>(m.logits.size()));
    for (auto x : m.logits) pk.pack_uint8(x);
    ints(m.parents);
    if (m.speculative) pk.pack_true(); else pk.pack_false();
    pk.pack_array(static_cast<uint32_t>(m.inputs.size()));
    for (auto x : m.inputs) pk.pack_uint64(x);
    ints(m.input_rows);
  }
  void operator()(const Activations& m) {
    pk.pack_array(4);
    pk.pack(m.pipeline);
    pk.pack_int32(m.layer);
    (*this)(m.batch);
    pk.pack_array(static_cast<uint32_t>(m.tensors.size()));
    for (const auto& t : m.tensors) tensor(t);
  }
  void operator()(const Logits& m) {
    pk.pack_array(3);
    pk.pack(m.pipeline);
    ints(m.rows);
    tensor(m.logits);
  }
  void operator()(const KvCacheOp& m) {
    pk.pack_array(3);
    pk.pack(m.pipeline);
    pk.pack_int32(m.layer);
    pk.pack_array(static_cast<uint32_t>(m.ops.size()));
    for (const auto& op : m.ops) {
      pk.pack_array(6);
      pk.pack_uint8(static_cast<uint8_t>(op.kind));
      pk.pack_int32(op.seq);
      pk.pack_int32(op.dst_seq);
      pk.pack_int32(op.pos_begin);
      pk.pack_int32(op.pos_end);
      pk.pack_int32(op.delta);
    }
  }
  void operator()(const Cancel& m) {
    pk.pack_array(1);
    pk.pack_array(static_cast<uint32_t>(m.run_ids.size()));
    for (auto r : m.run_ids) pk.pack_uint64(r);
  }
  void operator()(const Heartbeat& m) {
    pk.pack_array(1);
    pk.pack_uint64(m.sent_ns);
  }
  void operator()(const Error& m) {
    pk.pack_array(3);
    pk.pack_uint8(static_cast<uint8_t>(m.code));
    pk.pack(m.peer);
    pk.pack(m.message);
  }
  void operator()(const HiddenStates& m) {
    pk.pack_array(5);
    pk.pack(m.pipeline);
    pk.pack_int32(m.layer);
    ints(m.rows);
    ints(m.positions);
    tensor(m.states);
  }
  void operator()(const AttentionSync& m) {
    pk.pack_array(7);
    pk.pack(m.pipeline);
    pk.pack_uint8(static_cast<uint8_t>(m.kind));
    pk.pack_int32(m.layer);
    pk.pack_int32(m.position);
    pk.pack_int32(m.priority);
    pk.pack_array(static_cast<uint32_t>(m.tensors.size()));
    for (const auto& t : m.tensors) tensor(t);
    pk.pack_double(m.saved_ms);
  }
  void operator()(const Replan& m) {
    pk.pack_array(9);
    pk.pack(m.pipeline);
    pk.pack_int32(m.layer_begin);
    pk.pack_int32(m.layer_end);
    pk.pack(m.device);
    pk.pack(m.node);
    pk.pack(m.next_node);
    pk.pack(m.upstream);
    pk.pack_uint64(m.epoch);
    if (m.done) pk.pack_true(); else pk.pack_false();
  }
};

// --- decoding -----------------------------------------------------------------------------

struct Reject {
  DecodeError code;
  std::string detail;
};

[[noreturn]] void fail(DecodeError code, std::string detail) { throw Reject{code, std::move(detail)}; }

const msgpack::object_array& array(const msgpack::object& o, uint32_t n, const char* what) {
  if (o.type != msgpack::type::ARRAY) fail(DecodeError::malformed, std::string(what) + ": not an array");
  if (n != UINT32_MAX && o.via.array.size != n)
    fail(DecodeError::malformed, std::string(what) + ": expected " + std::to_string(n) +
                                     " fields, got " + std::to_string(o.via.array.size));
  return o.via.array;
}

uint64_t u64(const msgpack::object& o, const char* what) {
  if (o.type != msgpack::type::POSITIVE_INTEGER)
    fail(DecodeError::malformed, std::string(what) + ": not an unsigned integer");
  return o.via.u64;
}

int64_t i64(const msgpack::object& o, int64_t lo, int64_t hi, const char* what) {
  int64_t v;
  if (o.type == msgpack::type::POSITIVE_INTEGER) {
    if (o.via.u64 > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail(DecodeError::malformed, std::string(what) + ": integer out of range");
    v = static_cast<int64_t>(o.via.u64);
  } else if (o.type == msgpack::type::NEGATIVE_INTEGER) {
    v = o.via.i64;
  } else {
    fail(DecodeError::malformed, std::string(what) + ": not an integer");
  }
  if (v < lo || v > hi) fail(DecodeError::malformed, std::string(what) + ": integer out of range");
  return v;
}

int32_t i32(const msgpack::object& o, const char* what) {
  return static_cast<int32_t>(i64(o, std::numeric_limits<int32_t>::min(),
                                  std::numeric_limits<int32_t>::max(), what));
}

uint8_t enum_value(const msgpack::object& o, uint8_t max, const char* what) {
  uint64_t v = u64(o, what);
  if (v > max) fail(DecodeError::bad_enum, std::string(what) + " out of range: " + std::to_string(v));
  return static_cast<uint8_t>(v);
}

std::string str(const msgpack::object& o, const char* what) {
  if (o.type != msgpack::type::STR) fail(DecodeError::malformed, std::string(what) + ": not a string");
  return std::string(o.via.str.ptr, o.via.str.size);
}

bool boolean(const msgpack::object& o, const char* what) {
  if (o.type != msgpack::type::BOOLEAN) fail(DecodeError::malformed, std::string(what) + ": not a bool");
  return o.via.boolean;
}

std::vector<int32_t> ints(const msgpack::object& o, const char* what) {
  const auto& a = array(o, UINT32_MAX, what);
  std::vector<int32_t> v;
  v.reserve(a.size);  // bounded: the unpack limit caps a.size by the header length
  for (uint32_t i = 0; i < a.size; ++i) v.push_back(i32(a.ptr[i], what));
  return v;
}

struct Decoder {
  std::span<const Blob> blobs;
  std::size_t next_blob = 0;

  Tensor tensor(const msgpack::object& o) {
    const auto& a = array(o, 3, "tensor");
    Tensor t;
    t.dtype = static_cast<WireDType>(enum_value(a.ptr[0], kWireDTypeMax, "dtype"));
    const auto& dims = array(a.ptr[1], UINT32_MAX, "tensor shape");
    if (dims.size > 8) fail(DecodeError::bad_tensor, "tensor rank " + std::to_string(dims.size) + " > 8");
    // Overflow-checked so a hostile shape cannot wrap around to match a small frame.
    uint64_t numel = 1;
    for (uint32_t i = 0; i < dims.size; ++i) {
      int64_t d = i64(dims.ptr[i], 0, std::numeric_limits<int64_t>::max(), "tensor dim");
      t.shape.push_back(d);
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel))
        fail(DecodeError::bad_tensor, "tensor element count overflows");
    }
    uint64_t nbytes = u64(a.ptr[2], "tensor byte size");
    uint64_t expected = 0;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(t.dtype)), &expected) ||
        expected != nbytes)
      fail(DecodeError::bad_tensor, "tensor byte size " + std::to_string(nbytes) +
                                        " does not match shape and dtype");
    if (next_blob >= blobs.size())
      fail(DecodeError::bad_tensor, "missing tensor frame " + std::to_string(next_blob + 1));
    const Blob& b = blobs[next_blob++];
    if (b.size() != nbytes)
      fail(DecodeError::bad_tensor, "tensor frame has " + std::to_string(b.size()) + " bytes, header says " +
                                        std::to_string(nbytes));
    t.data = b;
    return t;
  }

  RunStart run_start(const msgpack::object& o) {
    const auto& a = array(o, 9, "run_start");
    RunStart m;
    m.pipeline = str(a.ptr[0], "pipeline");
    m.tokens = ints(a.ptr[1], "tokens");
    m.positions = ints(a.ptr[2], "positions");
    const auto& masks = array(a.ptr[3], UINT32_MAX, "seq_masks");
    m.seq_masks.reserve(masks.size);
    for (uint32_t i = 0; i < masks.size; ++i) m.seq_masks.push_back(u64(masks.ptr[i], "seq mask"));
    const auto& logits = array(a.ptr[4], UINT32_MAX, "logits flags");
    m.logits.reserve(logits.size);
    for (uint32_t i = 0; i < logits.size; ++i) m.logits.push_back(uint8_t(u64(logits.ptr[i], "logits flag") != 0));
    m.parents = ints(a.ptr[5], "parents");
    m.speculative = boolean(a.ptr[6], "speculative");
    const auto& inputs = array(a.ptr[7], UINT32_MAX, "inputs");
    m.inputs.reserve(inputs.size);
    for (uint32_t i = 0; i < inputs.size; ++i) m.inputs.push_back(u64(inputs.ptr[i], "input run"));
    m.input_rows = ints(a.ptr[8], "input rows");
    const size_t n = m.tokens.size();
    if (m.positions.size() != n || m.seq_masks.size() != n || (!m.logits.empty() && m.logits.size() != n) ||
        (!m.parents.empty() && m.parents.size() != n) || m.inputs.size() != m.input_rows.size() ||
        (!m.inputs.empty() && m.inputs.size() != n))
      fail(DecodeError::malformed, "run_start: tokens, positions, seq_masks, logits, parents, inputs and input rows differ in "
                                   "length");
    return m;
  }

  // Receivers index the batch with rows and read rows x n_embd floats, so everything that
  // would send them out of bounds is rejected here rather than trusted.
  HiddenStates hidden_states(const msgpack::object& o) {
    const auto& a = array(o, 5, "hidden_states");
    HiddenStates m;
    m.pipeline = str(a.ptr[0], "pipeline");
    m.layer = int32_t(i64(a.ptr[1], 0, std::numeric_limits<int32_t>::max(), "layer"));
    m.rows = ints(a.ptr[2], "rows");
    for (int32_t r : m.rows)
      if (r < 0) fail(DecodeError::malformed, "hidden_states: negative row " + std::to_string(r));
    m.positions = ints(a.ptr[3], "positions");
    if (m.positions.size() != m.rows.size())
      fail(DecodeError::malformed, "hidden_states: rows and positions differ in length");
    m.states = tensor(a.ptr[4]);
    if (m.states.dtype != WireDType::f32 && m.states.dtype != WireDType::f16)
      fail(DecodeError::bad_tensor, std::string("hidden_states: dtype ") + to_string(m.states.dtype) +
                                        ", expected f32 or f16");
    if (m.states.shape.size() != 2 || m.states.shape[0] != int64_t(m.rows.size()))
      fail(DecodeError::bad_tensor, "hidden_states: tensor is not rows x n_embd");
    return m;
  }

  // A pair stage reads the hand-off's vectors straight into a forward pass: their count,
  // dtype and rank are checked here, their lengths against the model by the stage.
  AttentionSync attention_sync(const msgpack::object& o) {
    const auto& a = array(o, 7, "attention_sync");
    AttentionSync m;
    m.pipeline = str(a.ptr[0], "pipeline");
    m.kind = static_cast<SyncKind>(enum_value(a.ptr[1], kSyncKindMax, "sync kind"));
    m.layer = int32_t(i64(a.ptr[2], 0, std::numeric_limits<int32_t>::max(), "layer"));
    m.position = int32_t(i64(a.ptr[3], 0, std::numeric_limits<int32_t>::max(), "position"));
    m.priority = int32_t(i64(a.ptr[4], 0, 2, "priority"));
    const auto& ts = array(a.ptr[5], UINT32_MAX, "attention_sync tensors");
    for (uint32_t i = 0; i < ts.size; ++i) m.tensors.push_back(tensor(ts.ptr[i]));
    // msgpack writes a whole-valued double as an integer. A time saved is finite and never
    // negative, whichever way it is written (NaN would also poison the summed metrics).
    const msgpack::object& saved = a.ptr[6];
    if (saved.type == msgpack::type::FLOAT64 || saved.type == msgpack::type::FLOAT32) {
      m.saved_ms = saved.via.f64;
      if (!std::isfinite(m.saved_ms) || !(m.saved_ms >= 0))
        fail(DecodeError::malformed, "saved_ms: " + std::to_string(m.saved_ms) + " is not a finite, non-negative number");
    } else {
      m.saved_ms = double(i64(saved, 0, std::numeric_limits<int64_t>::max(), "saved_ms"));
    }
    const size_t want = m.kind == SyncKind::handoff ? 4 : m.kind == SyncKind::report ? 1 : 0;
    if (m.tensors.size() != want)
      fail(DecodeError::bad_tensor, "attention_sync: " + std::to_string(m.tensors.size()) + " tensors, expected " +
                                        std::to_string(want));
    const WireDType dtype = m.kind == SyncKind::report ? WireDType::u8 : WireDType::f32;
    for (const Tensor& t : m.tensors)
      if (t.dtype != dtype || t.shape.size() != 1)
        fail(DecodeError::bad_tensor, std::string("attention_sync: expected 1-D ") + to_string(dtype) + " vectors");
    return m;
  }

  Payload payload(MsgType type, const msgpack::object& o) {
    switch (type) {
      case MsgType::run_start: return run_start(o);
      case MsgType::activations: {
        const auto& a = array(o, 4, "activations");
        Activations m;
        m.pipeline = str(a.ptr[0], "pipeline");
        m.layer = i32(a.ptr[1], "layer");
        m.batch = run_start(a.ptr[2]);
        const auto& ts = array(a.ptr[3], UINT32_MAX, "activations tensors");
        for (uint32_t i = 0; i < ts.size; ++i) m.tensors.push_back(tensor(ts.ptr[i]));
        return m;
      }
      case MsgType::logits: {
        const auto& a = array(o, 3, "logits");
        Logits m;
        m.pipeline = str(a.ptr[0], "pipeline");
        m.rows = ints(a.ptr[1], "rows");
        m.logits = tensor(a.ptr[2]);
        return m;
      }
      case MsgType::kv_cache_op: {
        const auto& a = array(o, 3, "kv_cache_op");
        KvCacheOp m;
        m.pipeline = str(a.ptr[0], "pipeline");
        m.layer = i32(a.ptr[1], "layer");
        const auto& ops = array(a.ptr[2], UINT32_MAX, "kv ops");
        m.ops.reserve(ops.size);
        for (uint32_t i = 0; i < ops.size; ++i) {
          const auto& f = array(ops.ptr[i], 6, "kv op");
          KvOp op;
          op.kind = static_cast<KvOpKind>(enum_value(f.ptr[0], kKvOpKindMax, "kv op kind"));
          op.seq = i32(f.ptr[1], "kv seq");
          op.dst_seq = i32(f.ptr[2], "kv dst_seq");
          op.pos_begin = i32(f.ptr[3], "kv pos_begin");
          op.pos_end = i32(f.ptr[4], "kv pos_end");
          op.delta = i32(f.ptr[5], "kv delta");
          m.ops.push_back(op);
        }
        return m;
      }
      case MsgType::cancel: {
        const auto& a = array(o, 1, "cancel");
        const auto& ids = array(a.ptr[0], UINT32_MAX, "run_ids");
        Cancel m;
        m.run_ids.reserve(ids.size);
        for (uint32_t i = 0; i < ids.size; ++i) m.run_ids.push_back(u64(ids.ptr[i], "run id"));
        return m;
      }
      case MsgType::heartbeat: {
        const auto& a = array(o, 1, "heartbeat");
        return Heartbeat{u64(a.ptr[0], "sent_ns")};
      }
      case MsgType::error: {
        const auto& a = array(o, 3, "error");
        Error m;
        m.code = static_cast<ErrorCode>(enum_value(a.ptr[0], kErrorCodeMax, "error code"));
        m.peer = str(a.ptr[1], "error peer");
        m.message = str(a.ptr[2], "error message");
        return m;
      }
      case MsgType::hidden_states: return hidden_states(o);
      case MsgType::attention_sync: return attention_sync(o);
      case MsgType::replan: {
        const auto& a = array(o, 9, "replan");
        Replan m;
        m.pipeline = str(a.ptr[0], "pipeline");
        m.layer_begin = int32_t(i64(a.ptr[1], 0, std::numeric_limits<int32_t>::max(), "layer_begin"));
        m.layer_end = int32_t(i64(a.ptr[2], 0, std::numeric_limits<int32_t>::max(), "layer_end"));
        if (m.layer_end <= m.layer_begin) fail(DecodeError::malformed, "replan: empty layer range");
        m.device = str(a.ptr[3], "device");
        m.node = str(a.ptr[4], "node");
        m.next_node = str(a.ptr[5], "next_node");
        m.upstream = str(a.ptr[6], "upstream");
        m.epoch = u64(a.ptr[7], "epoch");
        m.done = boolean(a.ptr[8], "done");
        return m;
      }
    }
    fail(DecodeError::unknown_type, "unknown message type");
  }
};

}  // namespace

void encode(const Envelope& env, std::vector<char>& header, std::vector<Blob>& blobs) {
  header.clear();
  blobs.clear();
  VecWriter w{&header};
  Packer pk(w);
  pk.pack_array(6);
  pk.pack_uint16(env.version);
  pk.pack_uint8(static_cast<uint8_t>(env.type()));
  pk.pack_uint64(env.run_id);
  pk.pack_uint64(env.seq);
  pk.pack_uint64(env.session);
  std::visit(Encoder{pk, blobs}, env.payload);
}

DecodeResult decode(std::span<const std::byte> header, std::span<const Blob> blobs) {
  DecodeResult r;
  const std::size_t len = header.size();
  try {
    if (len == 0) fail(DecodeError::truncated, "empty header");
    // Every array element and string byte needs at least one input byte, so the input length
    // bounds all counts; unpack throws before allocating for a larger declared size.
    msgpack::unpack_limit limit(len, len / 2, len, len, len, 16);
    std::size_t off = 0;
    msgpack::object_handle oh =
        msgpack::unpack(reinterpret_cast<const char*>(header.data()), len, off, nullptr, nullptr, limit);
    if (off != len)
      fail(DecodeError::trailing_bytes, std::to_string(len - off) + " bytes after the header");
    const msgpack::object& root = oh.get();
    if (root.type != msgpack::type::ARRAY || root.via.array.size == 0)
      fail(DecodeError::malformed, "header is not a non-empty array");
    const auto& a = root.via.array;
    // The version is judged before the layout: another version may use another layout.
    uint64_t version = u64(a.ptr[0], "version");
    if (version != kProtocolVersion)
      fail(DecodeError::wrong_version, "protocol version " + std::to_string(version) + ", expected " +
                                           std::to_string(kProtocolVersion));
    array(root, 6, "envelope");
    uint64_t type = u64(a.ptr[1], "message type");
    if (type < kMsgTypeMin || type > kMsgTypeMax)
      fail(DecodeError::unknown_type, "message type " + std::to_string(type));
    Envelope& env = r.envelope;
    env.version = static_cast<uint16_t>(version);
    env.run_id = u64(a.ptr[2], "run_id");
    env.seq = u64(a.ptr[3], "seq");
    env.session = u64(a.ptr[4], "session");
    Decoder d{blobs};
    env.payload = d.payload(static_cast<MsgType>(type), a.ptr[5]);
    if (d.next_blob != blobs.size())
      fail(DecodeError::bad_tensor, std::to_string(blobs.size() - d.next_blob) + " unreferenced tensor frames");
  } catch (const Reject& e) {
    r.error = e.code;
    r.detail = e.detail;
  } catch (const msgpack::insufficient_bytes& e) {
    r.error = DecodeError::truncated;
    r.detail = std::string("msgpack: ") + e.what();
  } catch (const msgpack::depth_size_overflow& e) {
    r.error = DecodeError::too_deep;
    r.detail = std::string("msgpack: ") + e.what();
  } catch (const msgpack::size_overflow& e) {
    // Limits equal the input length, so a larger declared length means the input is cut short.
    r.error = DecodeError::truncated;
    r.detail = std::string("declared length exceeds the input (msgpack: ") + e.what() + ")";
  } catch (const std::exception& e) {
    r.error = DecodeError::malformed;
    r.detail = std::string("msgpack: ") + e.what();
  }
  if (!r.ok()) r.envelope = Envelope{};
  return r;
}

}  // namespace specmesh
