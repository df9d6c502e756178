// Codec tests: round trips of every message type, zero-copy tensors, and hostile inputs
// (truncated, malformed, wrong version, out-of-range enums, inconsistent tensors, huge
// length prefixes) that must be rejected with the right reason and without large allocations.
#include "specmesh/messages/protocol.hpp"

#include <gtest/gtest.h>
#include <msgpack.hpp>

#include <unistd.h>

#include <cmath>
#include <fstream>
#include <random>

#include "memory_limit.hpp"

namespace specmesh {
namespace {

struct Wire {
  std::vector<char> header;
  std::vector<Blob> blobs;
};

Wire encode_env(const Envelope& e) {
  Wire w;
  encode(e, w.header, w.blobs);
  return w;
}

DecodeResult decode_wire(const Wire& w) {
  return decode(std::string_view(w.header.data(), w.header.size()), w.blobs);
}

DecodeResult decode_bytes(const std::string& header, std::vector<Blob> blobs = {}) {
  return decode(std::string_view(header), blobs);
}

Tensor iota_tensor(std::vector<int64_t> shape) {
  std::size_t n = 1;
  for (auto d : shape) n *= d;
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = 0.5f * float(i);
  return Tensor::from(WireDType::f32, std::move(shape), std::move(v));
}

std::vector<Envelope> samples() {
  std::vector<Envelope> out;
  out.push_back(make_envelope(7, RunStart{"target", {1, 2, 3}, {0, 1, 2}, {1, 1, 2}, {1, 0, 1}, {-1, 0, 1}, true}));
  out.push_back(make_envelope(7, RunStart{"draft", {1, 2, -1}, {0, 1, 2}, {1, 1, 1}, {0, 1, 1}, {}, true, {9, 9, 0}, {3, 4, 0}}));
  out.push_back(make_envelope(8, Activations{"target", 12, {}, {iota_tensor({3, 16}), iota_tensor({3, 2})}}));
  out.push_back(make_envelope(9, Logits{"target", {0, 2}, iota_tensor({2, 32})}));
  out.push_back(make_envelope(10, KvCacheOp{"target", 2, {{KvOpKind::copy, 0, 3, 0, 17}, {KvOpKind::remove, 1, -1, 5, -1},
                                            {KvOpKind::keep, 2, -1, -1, -1},
                                            {KvOpKind::shift, 1, -1, 10, -1, -4}, retrieval_view_op(1, 40, 8, 16)}}));
  out.push_back(make_envelope(0, Cancel{{1, 2, UINT64_MAX}}));
  out.push_back(make_envelope(0, Heartbeat{123456789}));
  out.push_back(make_envelope(11, Error{ErrorCode::out_of_memory, "stage2", "KV cache full"}));
  out.push_back(make_envelope(12, Error{ErrorCode::messages_lost, "", ""}));
  out.push_back(make_envelope(13, HiddenStates{"target", 3, {0, 1, 2}, {17, 18, 18}, iota_tensor({3, 16})}));
  out.push_back(make_envelope(14, HiddenStates{"target", 0, {}, {}, iota_tensor({0, 16})}));
  out.push_back(make_envelope(15, AttentionSync{"receiver", SyncKind::priority, 3, 40, 2, {}, 0}));
  out.push_back(make_envelope(15, AttentionSync{"target", SyncKind::handoff, 3, 40, 1,
                                                {iota_tensor({16}), iota_tensor({4}), iota_tensor({4}), iota_tensor({16})}, 0}));
  out.push_back(make_envelope(15, AttentionSync{"target", SyncKind::report, 4, 40, 0,
                                                {Tensor::from(WireDType::u8, {4}, std::vector<uint8_t>{1, 0, 1, 1})}, 0.25}));
  out.push_back(make_envelope(0, Replan{"draft", 3, 5, "spare", "n3", "head", "n1", 2, false}));
  out.push_back(make_envelope(0, Replan{"target", 0, 2, "spare", "n3", "n1", "head", UINT64_MAX, true}));
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i].seq = 1000 + i;
    out[i].session = 0xfeedfacecafebeefull;
  }
  return out;
}

TEST(Messages, RoundTripEveryType) {
  for (const auto& env : samples()) {
    SCOPED_TRACE(to_string(env.type()));
    auto w = encode_env(env);
    auto r = decode_wire(w);
    ASSERT_TRUE(r.ok()) << r.detail;
    EXPECT_EQ(r.envelope, env);
    EXPECT_EQ(r.envelope.type(), env.type());
  }
}

TEST(Messages, ControlTypesAreClassified) {
  EXPECT_TRUE(is_control(MsgType::cancel));
  EXPECT_TRUE(is_control(MsgType::heartbeat));
  EXPECT_TRUE(is_control(MsgType::error));
  EXPECT_FALSE(is_control(MsgType::activations));
  EXPECT_FALSE(is_control(MsgType::run_start));
  EXPECT_FALSE(is_control(MsgType::hidden_states)) << "hidden states are tensors: the data channel";
}

TEST(Messages, WireValuesAreAppendedNeverRenumbered) {
  EXPECT_EQ(uint8_t(MsgType::run_start), 1);
  EXPECT_EQ(uint8_t(MsgType::error), 7);
  EXPECT_EQ(uint8_t(MsgType::hidden_states), 8);
  EXPECT_EQ(uint8_t(MsgType::attention_sync), 9);
  EXPECT_EQ(uint8_t(MsgType::replan), 10);
  EXPECT_EQ(kMsgTypeMax, uint8_t(MsgType::replan));
  EXPECT_STREQ(to_string(MsgType::replan), "replan");
  EXPECT_STREQ(to_string(MsgType::attention_sync), "attention_sync");
  EXPECT_STREQ(to_string(MsgType::hidden_states), "hidden_states");
}

TEST(Messages, HiddenStatesTravelAsF32OrF16Frames) {
  std::vector<uint16_t> halves(2 * 8);
  for (std::size_t i = 0; i < halves.size(); ++i) halves[i] = uint16_t(0x3c00 + i);
  for (Tensor t : {iota_tensor({2, 8}), Tensor::from(WireDType::f16, {2, 8}, halves)}) {
    SCOPED_TRACE(to_string(t.dtype));
    auto env = make_envelope(21, HiddenStates{"draft", 5, {1, 3}, {40, 42}, t});
    auto w = encode_env(env);
    ASSERT_EQ(w.blobs.size(), 1u);
    EXPECT_EQ(w.blobs[0].data(), t.data.data()) << "encode must reference, not copy, the states";
    auto r = decode_wire(w);
    ASSERT_TRUE(r.ok()) << r.detail;
    EXPECT_EQ(r.envelope, env);
  }
}

TEST(Messages, TensorsTravelAsFramesWithoutCopy) {
  auto t = iota_tensor({256, 1024});  // 1 MiB
  auto env = make_envelope(1, Activations{"target", 3, {}, {t}});
  auto w = encode_env(env);
  ASSERT_EQ(w.blobs.size(), 1u);
  EXPECT_EQ(w.blobs[0].data(), t.data.data()) << "encode must reference, not copy, tensor bytes";
  EXPECT_LT(w.header.size(), 64u) << "tensor bytes must not be packed into the header";
  auto r = decode_wire(w);
  ASSERT_TRUE(r.ok()) << r.detail;
  const auto& got = std::get<Activations>(r.envelope.payload).tensors.at(0);
  EXPECT_EQ(got.data.data(), t.data.data()) << "decode must reference the received frame";
  EXPECT_EQ(got.shape, (std::vector<int64_t>{256, 1024}));
  EXPECT_EQ(got.data.view<float>()[5], 2.5f);
}

TEST(Messages, MisalignedBlobNeedsCopy) {
  std::vector<char> raw(4 * 4 + 1);
  float f = 1.25f;
  std::memcpy(raw.data() + 1, &f, 4);
  auto owner = std::make_shared<std::vector<char>>(raw);
  Blob b(owner, owner->data() + 1, 16);
  if (!b.aligned_for<float>()) {
    EXPECT_THROW(b.view<float>(), std::runtime_error);
  }
  EXPECT_EQ(b.to_vector<float>()[0], 1.25f);
}

TEST(Messages, EncodeRejectsInconsistentTensor) {
  Tensor t = iota_tensor({4, 4});
  t.shape = {4, 5};
  auto env = make_envelope(1, Logits{"target", {0}, t});
  std::vector<char> h;
  std::vector<Blob> b;
  EXPECT_THROW(encode(env, h, b), std::invalid_argument);
  EXPECT_THROW(Tensor::from(WireDType::f16, {3}, std::vector<uint16_t>(4)), std::invalid_argument);
}

TEST(Messages, EveryTruncationIsRejected) {
  for (const auto& env : samples()) {
    auto w = encode_env(env);
    for (std::size_t n = 0; n < w.header.size(); ++n) {
      auto r = decode(std::string_view(w.header.data(), n), w.blobs);
      ASSERT_FALSE(r.ok()) << to_string(env.type()) << " prefix " << n;
      EXPECT_EQ(r.error, DecodeError::truncated) << to_string(env.type()) << " prefix " << n << ": " << r.detail;
    }
  }
}

TEST(Messages, TrailingBytesAreRejected) {
  auto w = encode_env(samples()[0]);
  w.header.push_back('\0');
  auto r = decode_wire(w);
  EXPECT_EQ(r.error, DecodeError::trailing_bytes) << r.detail;
}

TEST(Messages, WrongVersionIsRejectedBeforeLayout) {
  auto env = samples()[4];
  env.version = kProtocolVersion + 1;
  auto r = decode_wire(encode_env(env));
  EXPECT_EQ(r.error, DecodeError::wrong_version) << r.detail;
  // A future version with a different layout is still judged by its version.
  msgpack::sbuffer sb;
  msgpack::packer<msgpack::sbuffer> pk(sb);
  pk.pack_array(2);
  pk.pack(kProtocolVersion + 1);
  pk.pack("something else");
  r = decode_bytes(std::string(sb.data(), sb.size()));
  EXPECT_EQ(r.error, DecodeError::wrong_version) << r.detail;
  EXPECT_NE(r.detail.find("version"), std::string::npos);
}

// Builds [version, type, run, seq, session, payload] with an arbitrary payload packer.
template <class F>
std::string header_with(uint64_t type, F&& payload) {
  msgpack::sbuffer sb;
  msgpack::packer<msgpack::sbuffer> pk(sb);
  pk.pack_array(6);
  pk.pack(kProtocolVersion);
  pk.pack(type);
  pk.pack(1);
  pk.pack(0);
  pk.pack(42);
  payload(pk);
  return std::string(sb.data(), sb.size());
}

TEST(Messages, UnknownTypeAndEnumsAreRangeChecked) {
  auto nil = [](auto& pk) { pk.pack_nil(); };
  EXPECT_EQ(decode_bytes(header_with(0, nil)).error, DecodeError::unknown_type);
  EXPECT_EQ(decode_bytes(header_with(kMsgTypeMax + 1, nil)).error, DecodeError::unknown_type);
  EXPECT_EQ(decode_bytes(header_with(255, nil)).error, DecodeError::unknown_type);

  auto bad_error_code = header_with(uint64_t(MsgType::error), [](auto& pk) {
    pk.pack_array(3);
    pk.pack(200);
    pk.pack("p");
    pk.pack("m");
  });
  EXPECT_EQ(decode_bytes(bad_error_code).error, DecodeError::bad_enum);

  auto bad_kv = header_with(uint64_t(MsgType::kv_cache_op), [](auto& pk) {
    pk.pack_array(3);
    pk.pack(std::string("target"));
    pk.pack(0);
    pk.pack_array(1);
    pk.pack_array(6);
    pk.pack(7);  // one past unview
    pk.pack(0);
    pk.pack(0);
    pk.pack(0);
    pk.pack(0);
    pk.pack(0);
  });
  EXPECT_EQ(decode_bytes(bad_kv).error, DecodeError::bad_enum);

  auto bad_dtype = header_with(uint64_t(MsgType::logits), [](auto& pk) {
    pk.pack_array(3);
    pk.pack(std::string("target"));
    pk.pack_array(0);
    pk.pack_array(3);
    pk.pack(kWireDTypeMax + 1);
    pk.pack_array(1);
    pk.pack(4);
    pk.pack(16);
  });
  EXPECT_EQ(decode_bytes(bad_dtype, {Blob::copy_of("0123456789abcdef", 16)}).error, DecodeError::bad_enum);
}

TEST(Messages, WrongShapesAndTypesAreMalformed) {
  // Not an array at all.
  EXPECT_EQ(decode_bytes(std::string("\x01", 1)).error, DecodeError::malformed);
  // Reserved msgpack byte.
  EXPECT_EQ(decode_bytes(std::string("\xc1", 1)).error, DecodeError::malformed);
  // Envelope with a missing field.
  {
    msgpack::sbuffer sb;
    msgpack::packer<msgpack::sbuffer> pk(sb);
    pk.pack_array(5);
    pk.pack(kProtocolVersion);
    pk.pack(uint64_t(MsgType::heartbeat));
    pk.pack(1);
    pk.pack(0);
    pk.pack(0);
    EXPECT_EQ(decode_bytes(std::string(sb.data(), sb.size())).error, DecodeError::malformed);
  }
  // String where an integer belongs; integer out of int32 range; negative sequence number.
  auto hb_str = header_with(uint64_t(MsgType::heartbeat), [](auto& pk) {
    pk.pack_array(1);
    pk.pack("soon");
  });
  EXPECT_EQ(decode_bytes(hb_str).error, DecodeError::malformed);
  auto big_token = header_with(uint64_t(MsgType::run_start), [](auto& pk) {
    pk.pack_array(4);
    pk.pack_array(1);
    pk.pack(int64_t{1} << 40);
    pk.pack_array(1);
    pk.pack(0);
    pk.pack_array(1);
    pk.pack(0);
    pk.pack(false);
  });
  EXPECT_EQ(decode_bytes(big_token).error, DecodeError::malformed);
  auto ragged = header_with(uint64_t(MsgType::run_start), [](auto& pk) {
    pk.pack_array(4);
    pk.pack_array(2);
    pk.pack(1);
    pk.pack(2);
    pk.pack_array(1);
    pk.pack(0);
    pk.pack_array(2);
    pk.pack(0);
    pk.pack(0);
    pk.pack(false);
  });
  EXPECT_EQ(decode_bytes(ragged).error, DecodeError::malformed);
}

TEST(Messages, InconsistentTensorFramesAreRejected) {
  auto env = make_envelope(1, Logits{"target", {0}, iota_tensor({2, 8})});
  auto w = encode_env(env);
  // Missing frame.
  EXPECT_EQ(decode(std::string_view(w.header.data(), w.header.size()), {}).error, DecodeError::bad_tensor);
  // Extra frame.
  auto extra = w.blobs;
  extra.push_back(Blob::copy_of("x", 1));
  EXPECT_EQ(decode(std::string_view(w.header.data(), w.header.size()), extra).error, DecodeError::bad_tensor);
  // Frame of the wrong size.
  std::vector<Blob> shorter{Blob(w.blobs[0].owner(), w.blobs[0].data(), w.blobs[0].size() - 4)};
  EXPECT_EQ(decode(std::string_view(w.header.data(), w.header.size()), shorter).error, DecodeError::bad_tensor);
  // Shape whose element count overflows 64 bits but would wrap to a small byte size.
  auto overflow = header_with(uint64_t(MsgType::logits), [](auto& pk) {
    pk.pack_array(3);
    pk.pack(std::string("target"));
    pk.pack_array(0);
    pk.pack_array(3);
    pk.pack(uint8_t(WireDType::u8));
    pk.pack_array(2);
    pk.pack(int64_t{1} << 32);
    pk.pack(int64_t{1} << 32);
    pk.pack(0);
  });
  EXPECT_EQ(decode_bytes(overflow, {Blob()}).error, DecodeError::bad_tensor);
}

// Builds a hidden_states header; each argument can be bent into something hostile.
std::string hidden_states_header(int64_t layer, std::vector<int64_t> rows, std::vector<int64_t> positions,
                                 WireDType dtype, std::vector<int64_t> shape, uint64_t nbytes) {
  return header_with(uint64_t(MsgType::hidden_states), [&](auto& pk) {
    pk.pack_array(5);
    pk.pack(std::string("target"));
    pk.pack(layer);
    pk.pack(rows);
    pk.pack(positions);
    pk.pack_array(3);
    pk.pack(uint8_t(dtype));
    pk.pack(shape);
    pk.pack(nbytes);
  });
}

TEST(Messages, InconsistentHiddenStatesAreRejected) {
  auto frame = [](std::size_t n) { return std::vector<Blob>{Blob::adopt(std::vector<char>(n))}; };
  auto check = [&](const std::string& h, std::size_t bytes, DecodeError want, const char* what) {
    auto r = decode_bytes(h, frame(bytes));
    EXPECT_EQ(r.error, want) << what << ": " << r.detail;
  };
  check(hidden_states_header(2, {0, 1}, {5, 6}, WireDType::f32, {2, 4}, 32), 32, DecodeError::none, "valid");
  check(hidden_states_header(-1, {0, 1}, {5, 6}, WireDType::f32, {2, 4}, 32), 32, DecodeError::malformed,
        "negative layer");
  check(hidden_states_header(int64_t{1} << 31, {0}, {5}, WireDType::f32, {1, 4}, 16), 16, DecodeError::malformed,
        "layer beyond int32");
  check(hidden_states_header(2, {0, -1}, {5, 6}, WireDType::f32, {2, 4}, 32), 32, DecodeError::malformed,
        "negative row");
  check(hidden_states_header(2, {0, 1}, {5}, WireDType::f32, {2, 4}, 32), 32, DecodeError::malformed,
        "rows and positions differ");
  check(hidden_states_header(2, {0, 1}, {5, 6}, WireDType::f32, {3, 4}, 48), 48, DecodeError::bad_tensor,
        "more tensor rows than rows");
  check(hidden_states_header(2, {0, 1}, {5, 6}, WireDType::f32, {8}, 32), 32, DecodeError::bad_tensor, "rank 1");
  check(hidden_states_header(2, {0, 1}, {5, 6}, WireDType::f32, {2, 2, 2}, 32), 32, DecodeError::bad_tensor,
        "rank 3");
  check(hidden_states_header(2, {0, 1}, {5, 6}, WireDType::i32, {2, 4}, 32), 32, DecodeError::bad_tensor,
        "integer states");
  check(hidden_states_header(2, {0, 1}, {5, 6}, WireDType::f32, {2, 4}, 32), 31, DecodeError::bad_tensor,
        "short frame");
  check(hidden_states_header(2, {0, 1}, {5, 6}, WireDType::f16, {2, int64_t{1} << 62}, 0), 0, DecodeError::bad_tensor,
        "byte count wraps around");
}

// Builds an attention_sync header with `n` f32 (or u8) vectors of 4 elements.
std::string attention_sync_header(uint64_t kind, int64_t layer, int64_t priority, int n, WireDType dtype,
                                  std::vector<int64_t> shape) {
  return header_with(uint64_t(MsgType::attention_sync), [&](auto& pk) {
    pk.pack_array(7);
    pk.pack(std::string("receiver"));
    pk.pack(kind);
    pk.pack(layer);
    pk.pack(int64_t{9});
    pk.pack(priority);
    pk.pack_array(n);
    for (int i = 0; i < n; ++i) {
      pk.pack_array(3);
      pk.pack(uint8_t(dtype));
      pk.pack(shape);
      pk.pack(uint64_t(4 * dtype_size(dtype)));
    }
    pk.pack(0.0);
  });
}

TEST(Messages, InconsistentAttentionSyncsAreRejected) {
  auto check = [](const std::string& h, int frames, std::size_t bytes, DecodeError want, const char* what) {
    std::vector<Blob> blobs;
    for (int i = 0; i < frames; ++i) blobs.push_back(Blob::adopt(std::vector<char>(bytes)));
    auto r = decode_bytes(h, blobs);
    EXPECT_EQ(r.error, want) << what << ": " << r.detail;
  };
  const auto f32 = WireDType::f32;
  check(attention_sync_header(0, 2, 1, 0, f32, {4}), 0, 0, DecodeError::none, "priority");
  check(attention_sync_header(1, 2, 2, 4, f32, {4}), 4, 16, DecodeError::none, "hand-off");
  check(attention_sync_header(2, 2, 0, 1, WireDType::u8, {4}), 1, 4, DecodeError::none, "report");
  check(attention_sync_header(3, 2, 1, 0, f32, {4}), 0, 0, DecodeError::bad_enum, "unknown kind");
  check(attention_sync_header(0, -1, 1, 0, f32, {4}), 0, 0, DecodeError::malformed, "negative layer");
  check(attention_sync_header(0, 2, 3, 0, f32, {4}), 0, 0, DecodeError::malformed, "priority above 2");
  check(attention_sync_header(0, 2, -1, 0, f32, {4}), 0, 0, DecodeError::malformed, "negative priority");
  check(attention_sync_header(1, 2, 2, 3, f32, {4}), 3, 16, DecodeError::bad_tensor, "hand-off without the output");
  check(attention_sync_header(0, 2, 1, 1, f32, {4}), 1, 16, DecodeError::bad_tensor, "priority with a tensor");
  check(attention_sync_header(1, 2, 2, 4, WireDType::f16, {4}), 4, 8, DecodeError::bad_tensor, "f16 hand-off");
  check(attention_sync_header(1, 2, 2, 4, f32, {2, 2}), 4, 16, DecodeError::bad_tensor, "matrix hand-off");
  check(attention_sync_header(2, 2, 0, 1, f32, {4}), 1, 16, DecodeError::bad_tensor, "f32 report");
}

// Found by fuzzing (fuzz/messages.cpp): a report's saved time came through as NaN (which then
// broke the decode-encode round trip and would poison the summed metrics), infinite or
// negative, while a negative whole number was already refused.
TEST(Messages, SavedTimeIsAFiniteNonNegativeNumber) {
  auto report = [](double saved) {
    return encode_env(make_envelope(15, AttentionSync{"target", SyncKind::report, 4, 40, 0,
                                                      {Tensor::from(WireDType::u8, {2}, std::vector<uint8_t>{1, 0})},
                                                      saved}));
  };
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  for (double bad : {nan, -nan, inf, -inf, -0.5, -1.0, -1e300}) {
    const DecodeResult r = decode_wire(report(bad));
    EXPECT_EQ(r.error, DecodeError::malformed) << bad << ": " << r.detail;
    EXPECT_NE(r.detail.find("saved_ms"), std::string::npos) << r.detail;
  }
  for (double good : {0.0, -0.0, 0.25, 3.0, 1e300}) {
    const DecodeResult r = decode_wire(report(good));
    ASSERT_TRUE(r.ok()) << good << ": " << r.detail;
    EXPECT_EQ(std::get<AttentionSync>(r.envelope.payload).saved_ms, good);
  }
  // The input the fuzzer found: a report whose saved time is the float64 0xffffd00000000000
  // (its version byte now the current protocol's).
  const std::string found("\x96\x02\x09\x13\xcd\xed\xfa\xce\xca\xfe\xbe\xef\x97\xa6target\x02\x04\x28\x00"
                          "\x91\x93\x06\x91\x04\x04\xcb\xff\xff\xd0\x00\x00\x00\x00\x00",
                          39);
  const std::vector<Blob> frame{Blob::copy_of("\x00\x07\x0e\x15", 4)};
  EXPECT_EQ(decode_bytes(found, frame).error, DecodeError::malformed) << decode_bytes(found, frame).detail;
}

// Runs in a death-test child: caps the address space 256 MiB above the current size, then
// returns how many inputs were not rejected as truncated (an allocation failure would show up
// as malformed instead).
int count_misjudged_under_memory_limit(const std::vector<std::string>& hostile) {
  test::cap_address_space();
  int bad = 0;
  for (const auto& h : hostile)
    if (decode_bytes(h).error != DecodeError::truncated) ++bad;
  return bad;
}

// The classic attack: a 5-byte input announcing a 4-billion-element container. Checked in a
// child process with a small address-space limit so a regression fails instead of swapping.
TEST(Messages, HostileLengthPrefixesDoNotAllocate) {
  const std::vector<std::string> hostile = {
      std::string("\xdd\xff\xff\xff\xff", 5),  // array32
      std::string("\xdf\xff\xff\xff\xff", 5),  // map32
      std::string("\xdb\xff\xff\xff\xff", 5),  // str32
      std::string("\xc6\xff\xff\xff\xff", 5),  // bin32
      std::string("\xc9\xff\xff\xff\xff", 5),  // ext32
      // Valid envelope prefix whose payload announces a huge token array.
      std::string("\x96\x01\x01\x01\x00\x00\x94\xdd\xff\xff\xff\xff", 12),
      // Hidden states whose rows announce 4 billion entries.
      std::string("\x96\x01\x08\x01\x00\x00\x95\xa0\x00\xdd\xff\xff\xff\xff", 14),
  };
  // _exit: the forked child must not run static destructors (e.g. a ZeroMQ context whose
  // threads were not forked).
  EXPECT_EXIT(::_exit(count_misjudged_under_memory_limit(hostile)), ::testing::ExitedWithCode(0), "");
  for (const auto& h : hostile) EXPECT_EQ(decode_bytes(h).error, DecodeError::truncated) << decode_bytes(h).detail;
}

TEST(Messages, DeepNestingIsRejected) {
  std::string deep(64, '\x91');  // 64 nested one-element arrays
  deep += '\x00';
  auto r = decode_bytes(deep);
  EXPECT_EQ(r.error, DecodeError::too_deep) << r.detail;
}

// Random bytes and random mutations of valid headers: never crash, never accept garbage
// that is not a consistent envelope.
TEST(Messages, FuzzedInputsNeverCrash) {
  std::mt19937_64 rng(1234);
  auto base = samples();
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string h;
    std::vector<Blob> blobs;
    if (i % 2 == 0) {
      h.resize(rng() % 64);
      for (auto& c : h) c = char(rng());
    } else {
      auto w = encode_env(base[rng() % base.size()]);
      h.assign(w.header.begin(), w.header.end());
      blobs = w.blobs;
      for (int k = 0, n = 1 + int(rng() % 3); k < n && !h.empty(); ++k) h[rng() % h.size()] = char(rng());
    }
    auto r = decode_bytes(h, blobs);
    if (r.ok()) {
      ++accepted;
      // Whatever is accepted must re-encode to an equivalent envelope.
      auto again = decode_wire(encode_env(r.envelope));
      ASSERT_TRUE(again.ok()) << again.detail;
      EXPECT_EQ(again.envelope, r.envelope);
    } else {
      EXPECT_FALSE(r.detail.empty());
    }
  }
  EXPECT_LT(accepted, 20000);
}

TEST(Messages, LargeRunStartUsesCompactIntegers) {
  RunStart rs;
  for (int i = 0; i < 4096; ++i) {
    rs.tokens.push_back(i * 7);
    rs.positions.push_back(i);
    rs.seq_masks.push_back(1);
  }
  auto w = encode_env(make_envelope(5, rs));
  EXPECT_LT(w.header.size(), 4096u * 3 * 5);
  auto r = decode_wire(w);
  ASSERT_TRUE(r.ok()) << r.detail;
  EXPECT_EQ(std::get<RunStart>(r.envelope.payload), rs);
}

}  // namespace
}  // namespace specmesh
