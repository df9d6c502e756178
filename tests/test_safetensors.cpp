// safetensors reader: round trips through the writer (F32, F16, BF16, metadata), a file on disk,
// and malformed files, each refused with a FormatError naming the file and the defect.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "private_dir.hpp"
#include "specmesh/formats/safetensors.hpp"

using namespace specmesh;

namespace {

using Bytes = std::vector<uint8_t>;

// A file of a hand-written header and `data_len` data bytes (0, 1, 2, ...).
Bytes raw_file(const std::string& header, size_t data_len, uint64_t header_len = UINT64_MAX) {
  Bytes b(8);
  const uint64_t n = header_len == UINT64_MAX ? header.size() : header_len;
  std::memcpy(b.data(), &n, 8);
  for (char c : header) b.push_back(uint8_t(c));  // (insert: a GCC 12 -Wstringop-overread false positive)
  for (size_t i = 0; i < data_len; ++i) b.push_back(uint8_t(i));
  return b;
}

SafetensorsFile parse(const Bytes& b) { return SafetensorsFile(MappedFile::copy_of(b, "bad.safetensors")); }

// The error of parsing `b`; fails the test when it parses.
std::string error_of(const Bytes& b) {
  try {
    parse(b);
  } catch (const FormatError& e) {
    return e.what();
  }
  ADD_FAILURE() << "parsed without error";
  return {};
}

#define EXPECT_REFUSED(bytes, ...)                                              \
  do {                                                                          \
    const std::string err = error_of(bytes);                                    \
    EXPECT_NE(err.find("bad.safetensors: "), std::string::npos) << err;         \
    for (const char* part : {__VA_ARGS__}) EXPECT_NE(err.find(part), std::string::npos) << err; \
  } while (0)

}  // namespace

TEST(Safetensors, RoundTripsEveryDTypeAndMetadata) {
  const std::vector<float> a = {1.0f, -2.5f, 0.1f, 65504.0f, 3.0f, 1e-3f};
  const std::vector<float> b = {0.5f, -0.25f};
  const std::vector<float> c = {3.14159f, -1e20f, 7.0f};
  const Bytes bytes = safetensors_bytes({{"layers.0.w", {2, 3}, a, DType::F32},
                                         {"half", {2}, b, DType::F16},
                                         {"brain", {3, 1}, c, DType::BF16}},
                                        {{"format", "pt"}});
  SafetensorsFile f = parse(bytes);
  ASSERT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.data_offset() % 8, 0u);

  const SafetensorsTensor* t = f.tensor("layers.0.w");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->type, DType::F32);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t->n_elements(), 6);
  ASSERT_EQ(t->nbytes, 24u);
  for (size_t i = 0; i < a.size(); ++i) {
    float v;
    std::memcpy(&v, t->data + 4 * i, 4);
    EXPECT_EQ(v, a[i]);
  }
  t = f.tensor("half");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->type, DType::F16);
  for (size_t i = 0; i < b.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, t->data + 2 * i, 2);
    EXPECT_EQ(fp16_to_fp32(h), b[i]);  // exactly representable
  }
  t = f.tensor("brain");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->type, DType::BF16);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{3, 1}));
  for (size_t i = 0; i < c.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, t->data + 2 * i, 2);
    EXPECT_EQ(bf16_to_fp32(h), bf16_to_fp32(fp32_to_bf16(c[i])));
    EXPECT_NEAR(bf16_to_fp32(h), c[i], std::abs(c[i]) * 0.01f);
  }
  EXPECT_EQ(f.tensor("absent"), nullptr);
}

TEST(Safetensors, ReadsAFileOnDiskAndAnEmptyOne) {
  specmesh::test::ScopedTempDir dir("safetensors");
  const std::vector<float> v = {1, 2, 3, 4};
  write_safetensors(dir.path + "/m.safetensors", {{"w", {4}, v, DType::F16}});
  SafetensorsFile f(dir.path + "/m.safetensors");
  EXPECT_EQ(f.path(), dir.path + "/m.safetensors");
  ASSERT_NE(f.tensor("w"), nullptr);
  EXPECT_EQ(f.tensor("w")->nbytes, 8u);

  SafetensorsFile empty = parse(raw_file("{}", 0));
  EXPECT_TRUE(empty.tensors().empty());
  // Scalars (shape []) and zero-size tensors are legal.
  SafetensorsFile odd = parse(raw_file(R"({"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
                                       R"("z":{"dtype":"F16","shape":[0,5],"data_offsets":[4,4]}})", 4));
  EXPECT_EQ(odd.tensor("s")->n_elements(), 1);
  EXPECT_EQ(odd.tensor("z")->nbytes, 0u);
}

TEST(Safetensors, RefusesAMissingFile) {
  try {
    SafetensorsFile f("/nonexistent/x.safetensors");
    FAIL();
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/x.safetensors: cannot open"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, RefusesTruncatedFilesAndBadHeaderLengths) {
  const Bytes good = safetensors_bytes({{"w", {4}, std::vector<float>{1, 2, 3, 4}, DType::F32}});
  EXPECT_REFUSED(Bytes(good.begin(), good.begin() + 5), "truncated", "8-byte header length");
  // Cut inside the header, then inside the data.
  EXPECT_REFUSED(Bytes(good.begin(), good.begin() + 20), "header length", "runs past the end of the file");
  EXPECT_REFUSED(Bytes(good.begin(), good.end() - 3), "tensor 'w'", "lies outside the data buffer");
  // A header length of 2^40, one beyond the file, and one that ends inside the JSON.
  EXPECT_REFUSED(raw_file("{}", 0, uint64_t(1) << 40), "exceeds the limit");
  EXPECT_REFUSED(raw_file("{}", 0, 3), "runs past the end of the file");
  EXPECT_REFUSED(raw_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4, 10), "not valid JSON");
  EXPECT_REFUSED(raw_file("[1,2]", 0), "does not start with '{'");
  EXPECT_REFUSED(raw_file("{\"a\":", 0), "not valid JSON");
  EXPECT_REFUSED(raw_file("{}", 4), "bytes [0, 4) at the end of the data buffer belong to no tensor");
}

TEST(Safetensors, RefusesOffsetsOutOfRangeAndWrongSizes) {
  EXPECT_REFUSED(raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4), "tensor 'w'",
                 "lies outside the data buffer (4 bytes)");
  EXPECT_REFUSED(raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "end before they begin");
  EXPECT_REFUSED(raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4), "holds 4 bytes",
                 "needs 8");
  EXPECT_REFUSED(raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-1,7]}})", 8), "non-negative integer");
  EXPECT_REFUSED(raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8), "pair");
  EXPECT_REFUSED(raw_file(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
                 "needs more than the data buffer (8 bytes)");
  EXPECT_REFUSED(raw_file(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "holds 8 bytes", "needs 12");
  EXPECT_REFUSED(raw_file(R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8), "shape dimension");
  EXPECT_REFUSED(raw_file(R"({"w":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", 8), "shape is not an array");
  EXPECT_REFUSED(raw_file(R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", 8), "tensor 'w' has no \"shape\"");
  EXPECT_REFUSED(raw_file(R"({"w":[1,2]})", 0), "tensor 'w' is not an object");
  EXPECT_REFUSED(raw_file(R"({"__metadata__":{"a":1}})", 0), "__metadata__ 'a' is not a string");
}

TEST(Safetensors, RefusesUnknownAndUnsupportedDTypes) {
  EXPECT_REFUSED(raw_file(R"({"w":{"dtype":"Q4","shape":[2],"data_offsets":[0,2]}})", 2), "tensor 'w'",
                 "unknown dtype 'Q4'");
  EXPECT_REFUSED(raw_file(R"({"w":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", 8), "unsupported dtype 'I64'");
  EXPECT_REFUSED(raw_file(R"({"w":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})", 4), "dtype is not a string");
}

TEST(Safetensors, RefusesOverlapsGapsAndRepeatedNames) {
  EXPECT_REFUSED(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                          R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
                 "tensor 'b' (bytes [4, 12)) overlaps tensor 'a'");
  EXPECT_REFUSED(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                          R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", 12),
                 "bytes [4, 8) of the data buffer belong to no tensor (before 'b')");
  EXPECT_REFUSED(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
                 "bytes [0, 4) of the data buffer belong to no tensor (before 'a')");
  EXPECT_REFUSED(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                          R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
                 "tensor 'a' appears twice");
}

TEST(Safetensors, WriterRefusesMismatchedShapes) {
  const std::vector<float> v = {1, 2, 3};
  EXPECT_THROW(safetensors_bytes({{"w", {2, 2}, v, DType::F32}}), std::invalid_argument);
  EXPECT_THROW(safetensors_bytes({{"w", {3}, v, DType::F32}, {"w", {3}, v, DType::F32}}), std::invalid_argument);
}
