// GGUF reader on the real stories260K file, writer round trips, synthetic models, and the
// reader's handling of corrupted files (always a FormatError naming the defect, never a crash).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <random>
#include <set>

#include "specmesh/formats/gguf.hpp"
#include "specmesh/formats/gguf_writer.hpp"
#include "specmesh/kernels/quant.hpp"
#include "specmesh/model/context.hpp"
#include "specmesh/model/model.hpp"
#include "specmesh/model/synthetic.hpp"
#include "refdata.hpp"
#include "specmesh/tokenizer/tokenizer.hpp"
#include "isa.hpp"
#include "memory_limit.hpp"

using namespace specmesh;
using specmesh::test::refdata;

namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;

Bytes read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), {});
}
void write_bytes(const std::string& path, const Bytes& b) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}

template <class T>
T get_at(const Bytes& b, size_t off) {
  T v;
  std::memcpy(&v, b.data() + off, sizeof(T));
  return v;
}
template <class T>
void put_at(Bytes& b, size_t off, T v) {
  std::memcpy(b.data() + off, &v, sizeof(T));
}

// Offset of the first occurrence of s in b (the tests search for distinctive key/tensor names).
size_t find_str(const Bytes& b, std::string_view s) {
  auto it = std::search(b.begin(), b.end(), s.begin(), s.end());
  if (it == b.end()) throw std::runtime_error("test setup: '" + std::string(s) + "' not in file");
  return size_t(it - b.begin());
}

std::string lower(std::string s) {
  for (auto& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// A directory of its own per test, removed afterwards.
class TmpDir : public ::testing::Test {
 protected:
  // Tests that write thousands of small files use tmpfs when there is one.
  explicit TmpDir(bool prefer_ram = false) : prefer_ram_(prefer_ram) {}
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::error_code ec;
    const fs::path base = prefer_ram_ && fs::is_directory("/dev/shm", ec) && ::access("/dev/shm", W_OK) == 0
                              ? fs::path("/dev/shm")
                              : fs::temp_directory_path();
    dir_ = base /
           ("specmesh_gguf_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
  bool prefer_ram_;
};

bool same_value(const GgufValue& a, const GgufValue& b) {
  if (a.type != b.type || a.i != b.i || a.s != b.s || a.ints != b.ints || a.strings != b.strings) return false;
  if (a.type == GgufType::ARRAY && a.elem_type != b.elem_type) return false;
  auto same_float = [](double x, double y) { return std::memcmp(&x, &y, sizeof x) == 0 || x == y; };
  if (!same_float(a.f, b.f) || a.floats.size() != b.floats.size()) return false;
  for (size_t k = 0; k < a.floats.size(); ++k)
    if (!same_float(a.floats[k], b.floats[k])) return false;
  return true;
}

const std::vector<DType> kAllTypes = {DType::F32, DType::F16, DType::BF16, DType::Q4_0,
                                      DType::Q8_0, DType::Q4_K, DType::Q6_K};

size_t block(DType t) { return traits(t).block_elems; }

}  // namespace

// ============================================================================ reader

TEST(GgufReader, Stories260KWorkedExample) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string path = refdata("gguf-models/stories260K.gguf");
  GgufFile f(path);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.file_size(), 1185376u);
  EXPECT_EQ(f.metadata().size(), 19u);
  EXPECT_EQ(f.tensors().size(), 48u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.data_offset(), 14176u);

  auto check = [&](const char* name, uint32_t n_dims, std::vector<int64_t> ne, uint64_t offset) {
    SCOPED_TRACE(name);
    const GgufTensorInfo* t = f.tensor(name);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->type, DType::F32);
    EXPECT_EQ(t->n_dims, n_dims);
    ne.resize(4, 1);
    for (int d = 0; d < 4; ++d) EXPECT_EQ(t->ne[d], ne[d]) << "dim " << d;
    EXPECT_EQ(t->offset, offset);
    EXPECT_EQ(t->nbytes, size_t(4 * t->n_elements()));
    EXPECT_EQ(t->data - f.tensors()[0].data, ptrdiff_t(offset));
  };
  check("token_embd.weight", 2, {64, 512}, 0);
  check("output_norm.weight", 1, {64}, 131072);
  check("output.weight", 2, {64, 512}, 131328);
  check("blk.0.attn_q.weight", 2, {64, 64}, 262400);
  check("blk.0.attn_k.weight", 2, {64, 32}, 262400 + 16384);
  check("blk.0.ffn_down.weight", 2, {172, 64}, f.tensor("blk.0.ffn_down.weight")->offset);
  check("blk.4.ffn_norm.weight", 1, {64}, 1170944);
  EXPECT_EQ(f.tensor("token_embd.weight")->nbytes, 131072u);
  EXPECT_EQ(f.tensors().back().name, "blk.4.ffn_norm.weight");
  EXPECT_EQ(f.tensor("no.such.tensor"), nullptr);

  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_int("llama.context_length"), 2048);
  EXPECT_EQ(f.get_int("llama.embedding_length"), 64);
  EXPECT_EQ(f.get_int("llama.feed_forward_length"), 172);
  EXPECT_EQ(f.get_int("llama.block_count"), 5);
  EXPECT_EQ(f.get_int("llama.attention.head_count"), 8);
  EXPECT_EQ(f.get_int("llama.attention.head_count_kv"), 4);
  EXPECT_EQ(f.get_int("llama.rope.dimension_count"), 8);
  EXPECT_NEAR(*f.get_float("llama.attention.layer_norm_rms_epsilon"), 1e-5, 1e-11);
  EXPECT_FALSE(f.get_float("llama.rope.freq_base").has_value());
  EXPECT_EQ(f.get_string("tokenizer.ggml.model"), "llama");
  EXPECT_EQ(f.get_int("tokenizer.ggml.unknown_token_id"), 0);
  EXPECT_EQ(f.get_int("tokenizer.ggml.bos_token_id"), 1);
  EXPECT_EQ(f.get_int("tokenizer.ggml.eos_token_id"), 2);
  EXPECT_EQ(f.get_int("tokenizer.ggml.seperator_token_id"), 4294967295ll);  // u32 "none"
  EXPECT_THROW(f.get_int("general.architecture"), FormatError);

  const GgufValue* tokens = f.find("tokenizer.ggml.tokens");
  ASSERT_NE(tokens, nullptr);
  ASSERT_TRUE(tokens->is_array());
  EXPECT_EQ(tokens->elem_type, GgufType::STRING);
  ASSERT_EQ(tokens->strings.size(), 512u);
  EXPECT_EQ(tokens->strings[1], "<s>");
  EXPECT_EQ(tokens->strings[3], "<0x00>");
  const GgufValue* types = f.find("tokenizer.ggml.token_type");
  ASSERT_NE(types, nullptr);
  ASSERT_EQ(types->ints.size(), 512u);
  std::map<int64_t, int> count;
  for (int64_t t : types->ints) ++count[t];
  EXPECT_EQ(count[2], 1);    // UNKNOWN
  EXPECT_EQ(count[3], 2);    // CONTROL
  EXPECT_EQ(count[6], 256);  // BYTE
  EXPECT_EQ(count[1], 253);  // NORMAL
  EXPECT_EQ(f.find("tokenizer.ggml.scores")->floats.size(), 512u);

  // Bit-identical to the llama2.c checkpoint: 7 x i32 header, then the embedding table,
  // rms_att (5 x 64), then wq (5 x 64 x 64).
  const Bytes bin = read_bytes(refdata("llama2c/stories260K.bin"));
  ASSERT_EQ(bin.size(), 1056540u);
  const GgufTensorInfo* emb = f.tensor("token_embd.weight");
  EXPECT_EQ(std::memcmp(emb->data, bin.data() + 28, emb->nbytes), 0);
  const GgufTensorInfo* wq1 = f.tensor("blk.1.attn_q.weight");
  EXPECT_EQ(std::memcmp(wq1->data, bin.data() + 28 + 4 * (512 * 64 + 5 * 64 + 64 * 64), wq1->nbytes), 0);
}

TEST(GgufReader, TypedLookupsOfMissingKeys) {
  SPECMESH_REQUIRE_REFDATA();
  GgufFile f(refdata("gguf-models/stories260K.gguf"));
  EXPECT_EQ(f.find("no.such.key"), nullptr);
  EXPECT_FALSE(f.get_int("no.such.key").has_value());
  EXPECT_FALSE(f.get_string("no.such.key").has_value());
  EXPECT_FALSE(f.get_bool("no.such.key").has_value());
}

TEST(GgufReader, MissingFileIsAFormatError) {
  try {
    GgufFile f("/nonexistent/dir/model.gguf");
    FAIL() << "no exception";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/model.gguf"), std::string::npos) << e.what();
  }
}

// Bytes in memory (MappedFile::copy_of) go through the same readers as the files they came from.
TEST(GgufReader, ModelsLoadFromBytesInMemory) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string gguf = refdata("gguf-models/stories260K.gguf");
  const Bytes bytes = read_bytes(gguf);
  GgufFile mapped(gguf), copied(MappedFile::copy_of(bytes, "copy.gguf"));
  EXPECT_EQ(copied.path(), "copy.gguf");
  ASSERT_EQ(copied.tensors().size(), mapped.tensors().size());
  EXPECT_EQ(copied.metadata().size(), mapped.metadata().size());
  for (size_t i = 0; i < mapped.tensors().size(); ++i) {
    const auto &a = mapped.tensors()[i], &b = copied.tensors()[i];
    EXPECT_EQ(a.name, b.name);
    ASSERT_EQ(a.nbytes, b.nbytes);
    EXPECT_EQ(std::memcmp(a.data, b.data, a.nbytes), 0) << a.name;
  }

  auto from_path = Model::load(gguf);
  auto from_bytes = Model::load(MappedFile::copy_of(bytes, "copy.gguf"));
  EXPECT_EQ(from_bytes->path(), "copy.gguf");
  EXPECT_EQ(from_bytes->hparams().n_layer, from_path->hparams().n_layer);
  EXPECT_EQ(from_bytes->tokenizer().encode("Once upon a time", true), from_path->tokenizer().encode("Once upon a time", true));

  // llama2.c: the tokenizer file's bytes too; without them the error is the one for a missing -z.
  const Bytes bin = read_bytes(refdata("llama2c/stories260K.bin"));
  const MappedFile tok = MappedFile::copy_of(read_bytes(refdata("llama2c/tok512.bin")), "tok.bin");
  auto c = Model::load(MappedFile::copy_of(bin, "m.bin"), &tok);
  EXPECT_EQ(c->format(), "llama2c");
  EXPECT_EQ(c->tokenizer().encode("Once upon a time", true), from_path->tokenizer().encode("Once upon a time", true));
  try {
    Model::load(MappedFile::copy_of(bin, "m.bin"));
    ADD_FAILURE() << "loaded a llama2.c checkpoint without its tokenizer";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("m.bin: a llama2.c checkpoint needs its tokenizer file"), std::string::npos)
        << e.what();
  }
  // Errors name the name given, and an empty buffer is a file too short to be anything.
  EXPECT_THROW(GgufFile(MappedFile::copy_of(Bytes(bytes.begin(), bytes.begin() + 100), "cut.gguf")), FormatError);
  EXPECT_THROW(Model::load(MappedFile::copy_of({}, "empty")), FormatError);
}

// ============================================================================ writer

using GgufWriterTest = TmpDir;

TEST_F(GgufWriterTest, RewritesStories260KByteForByte) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string src = refdata("gguf-models/stories260K.gguf");
  GgufFile f(src);
  GgufWriter w;
  for (const auto& kv : f.metadata()) w.set(kv.key, kv.value);
  for (const auto& t : f.tensors())
    w.add_tensor_view(t.name, t.type, std::vector<int64_t>(t.ne, t.ne + t.n_dims), t.data);
  EXPECT_EQ(w.data_offset(), f.data_offset());
  EXPECT_EQ(w.file_size(), f.file_size());
  w.write(path("copy.gguf"));
  EXPECT_TRUE(read_bytes(src) == read_bytes(path("copy.gguf")));
  EXPECT_FALSE(fs::exists(path("copy.gguf.tmp")));
}

TEST_F(GgufWriterTest, EveryValueTypeRoundTrips) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  GgufWriter w;
  w.set_u8("v.u8", 255);
  w.set_i8("v.i8", -128);
  w.set_u16("v.u16", 65535);
  w.set_i16("v.i16", -32768);
  w.set_u32("v.u32", 4294967295u);
  w.set_i32("v.i32", std::numeric_limits<int32_t>::min());
  w.set_u64("v.u64", std::numeric_limits<uint64_t>::max());
  w.set_i64("v.i64", std::numeric_limits<int64_t>::min());
  w.set_f32("v.f32", 1e-45f);  // a subnormal survives
  w.set_f32("v.f32.nan", nan);
  w.set_f32("v.f32.negzero", -0.0f);
  w.set_f64("v.f64", -1.2345678901234567e300);
  w.set_bool("v.true", true);
  w.set_bool("v.false", false);
  w.set_string("v.str", "h\xC3\xA9llo \xE2\x96\x81 w\xC3\xB6rld");
  w.set_string("v.str.empty", "");
  w.set_string("v.str.nul", std::string("a\0b", 3));
  w.set_array_ints("a.u8", GgufType::U8, std::vector<int64_t>{0, 1, 255});
  w.set_array_ints("a.i8", GgufType::I8, std::vector<int64_t>{-128, 0, 127});
  w.set_array_ints("a.u16", GgufType::U16, std::vector<int64_t>{0, 65535});
  w.set_array_ints("a.i16", GgufType::I16, std::vector<int64_t>{-32768, 32767});
  w.set_array_u32("a.u32", std::vector<uint32_t>{0, 7, 4294967295u});
  w.set_array_i32("a.i32", std::vector<int32_t>{std::numeric_limits<int32_t>::min(), -1, 5});
  w.set_array_ints("a.u64", GgufType::U64, std::vector<int64_t>{0, -1 /* = 2^64-1 */, 1ll << 62});
  w.set_array_ints("a.i64", GgufType::I64, std::vector<int64_t>{std::numeric_limits<int64_t>::min(), 3});
  w.set_array_ints("a.bool", GgufType::BOOL, std::vector<int64_t>{1, 0, 1, 1});
  w.set_array_f32("a.f32", std::vector<float>{1.5f, -2.25f, 3e38f, 1e-45f});
  w.set_array_floats("a.f64", GgufType::F64, std::vector<double>{1e-300, -0.1, 42});
  w.set_array_strings("a.str", std::vector<std::string>{"", "one", "\xE2\x96\x81two", std::string(300, 'x')});
  w.set_array_ints("a.empty.i32", GgufType::I32, {});
  w.set_array_floats("a.empty.f32", GgufType::F32, {});
  w.set_array_strings("a.empty.str", {});
  // Setting a key again replaces the value and keeps its place.
  w.set_u32("v.replaced", 1);
  w.set_string("v.replaced", "second");
  EXPECT_EQ(w.metadata().size(), 33u);

  w.write(path("kv.gguf"));
  GgufFile f(path("kv.gguf"));
  EXPECT_EQ(f.version(), 3u);
  EXPECT_TRUE(f.tensors().empty());
  ASSERT_EQ(f.metadata().size(), w.metadata().size());
  for (size_t k = 0; k < w.metadata().size(); ++k) {
    SCOPED_TRACE(w.metadata()[k].key);
    EXPECT_EQ(f.metadata()[k].key, w.metadata()[k].key);
    EXPECT_TRUE(same_value(f.metadata()[k].value, w.metadata()[k].value));
  }
  EXPECT_EQ(f.get_int("v.u64"), -1);  // u64 max, bit-cast
  EXPECT_EQ(f.get_string("v.replaced"), "second");
  EXPECT_EQ(f.metadata().back().key, "v.replaced");
  EXPECT_TRUE(std::isnan(*f.get_float("v.f32.nan")));
  EXPECT_TRUE(std::signbit(*f.get_float("v.f32.negzero")));
  EXPECT_EQ(f.get_string("v.str.nul")->size(), 3u);
  EXPECT_EQ(f.find("a.bool")->elem_type, GgufType::BOOL);

  // Values copied from the reader serialise to the same bytes.
  GgufWriter copy;
  for (const auto& kv : f.metadata()) copy.set(kv.key, kv.value);
  copy.write(path("kv2.gguf"));
  EXPECT_TRUE(read_bytes(path("kv.gguf")) == read_bytes(path("kv2.gguf")));
}

TEST_F(GgufWriterTest, EveryTensorTypeAndAlignmentRoundTrips) {
  std::mt19937 rng(7);
  for (uint32_t align : {0u /* default 32 */, 32u, 64u, 4096u}) {
    SCOPED_TRACE("alignment " + std::to_string(align));
    const size_t A = align ? align : 32;
    // Bytes of every tensor; add_tensor_view needs them alive until write().
    std::vector<std::pair<std::string, Bytes>> expect;
    std::vector<std::vector<int64_t>> shapes;
    GgufWriter w2;
    w2.set_string("general.architecture", "test");
    if (align) w2.set_alignment(align);
    EXPECT_EQ(w2.alignment(), A);
    for (DType t : kAllTypes) {
      const int64_t B = int64_t(block(t));
      for (std::vector<int64_t> ne : {std::vector<int64_t>{3 * B}, {2 * B, 5}, {B, 3, 2}, {B, 2, 1, 3}}) {
        uint64_t n = row_bytes(t, size_t(ne[0]));
        for (size_t d = 1; d < ne.size(); ++d) n *= uint64_t(ne[d]);
        Bytes b(n);
        for (auto& x : b) x = uint8_t(rng());
        expect.emplace_back(std::string(dtype_name(t)) + ".d" + std::to_string(ne.size()), std::move(b));
        shapes.push_back(ne);
      }
    }
    for (size_t k = 0; k < expect.size(); ++k) {
      const DType t = kAllTypes[k / 4];
      if (k % 2) w2.add_tensor(expect[k].first, t, shapes[k], expect[k].second);
      else w2.add_tensor_view(expect[k].first, t, shapes[k], expect[k].second.data());
    }
    const std::string p = path("types" + std::to_string(align) + ".gguf");
    w2.write(p);
    const Bytes file = read_bytes(p);
    EXPECT_EQ(file.size(), w2.file_size());
    GgufFile f(p);
    EXPECT_EQ(f.alignment(), A);
    EXPECT_EQ(f.data_offset(), w2.data_offset());
    EXPECT_EQ(f.data_offset() % A, 0u);
    ASSERT_EQ(f.tensors().size(), expect.size());
    uint64_t next = 0;
    for (size_t k = 0; k < expect.size(); ++k) {
      const GgufTensorInfo& t = f.tensors()[k];
      SCOPED_TRACE(t.name);
      EXPECT_EQ(t.name, expect[k].first);
      EXPECT_EQ(t.type, kAllTypes[k / 4]);
      EXPECT_EQ(t.n_dims, uint32_t(k % 4 + 1));
      EXPECT_EQ(t.offset, next);
      EXPECT_EQ(t.offset % A, 0u);
      ASSERT_EQ(t.nbytes, expect[k].second.size());
      EXPECT_EQ(std::memcmp(t.data, expect[k].second.data(), t.nbytes), 0);
      next = t.offset + (t.nbytes + A - 1) / A * A;
      for (uint64_t z = t.offset + t.nbytes; z < next; ++z) ASSERT_EQ(file[f.data_offset() + z], 0) << "padding";
    }
    EXPECT_EQ(f.data_offset() + next, file.size());
  }
}

TEST_F(GgufWriterTest, F32SourcesAreEncodedWithQuantizeRow) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (DType t : kAllTypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const int64_t n0 = 512, rows = 6;
    std::vector<float> x(size_t(n0 * rows));
    for (auto& v : x) v = nd(rng);
    GgufWriter w;
    w.add_tensor_f32("from_vector", t, {n0, rows}, x);
    w.add_tensor_rows_f32("from_rows", t, {n0, 2, 3}, [&](int64_t r, float* dst) {
      std::memcpy(dst, x.data() + r * n0, n0 * sizeof(float));
    });
    const std::string p = path("q.gguf");
    w.write(p);
    GgufFile f(p);
    const size_t rb = row_bytes(t, n0);
    Bytes expect(rb * rows);
    for (int64_t r = 0; r < rows; ++r) quantize_row(t, x.data() + r * n0, expect.data() + r * rb, n0);
    for (const char* name : {"from_vector", "from_rows"}) {
      const GgufTensorInfo* ti = f.tensor(name);
      ASSERT_NE(ti, nullptr);
      ASSERT_EQ(ti->nbytes, expect.size());
      EXPECT_EQ(std::memcmp(ti->data, expect.data(), expect.size()), 0) << name;
    }
    // And the encoding is faithful: relative RMS error small for the type's precision.
    std::vector<float> y(x.size());
    for (int64_t r = 0; r < rows; ++r) dequantize_row(t, f.tensor("from_rows")->data + r * rb, y.data() + r * n0, n0);
    double err = 0, ref = 0;
    for (size_t k = 0; k < x.size(); ++k) {
      err += (x[k] - y[k]) * (x[k] - y[k]);
      ref += x[k] * x[k];
    }
    const double rel = std::sqrt(err / ref);
    const double tol = t == DType::F32 ? 0 : t == DType::F16 ? 1e-3 : t == DType::BF16 ? 5e-3
                       : t == DType::Q8_0 ? 0.01 : t == DType::Q6_K ? 0.03 : 0.15;
    EXPECT_LE(rel, tol);
  }
}

TEST_F(GgufWriterTest, StreamedTensorsAreIndependentOfThreadCount) {
  // 20 MB of F32 rows (several chunks) plus a quantized and a byte-callback tensor.
  const int64_t n0 = 1024, rows = 5000;
  auto fill = [](int64_t r, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = float((r * 7919 + i * 104729) % 2003) * 1e-3f - 1.0f;
  };
  std::vector<Bytes> files;
  for (int threads : {1, 2, 4}) {
    GgufWriter w;
    w.set_threads(threads);
    w.set_u32("general.alignment", 64);
    w.add_tensor_rows_f32("f32", DType::F32, {n0, rows}, [&](int64_t r, float* d) { fill(r, d, n0); });
    w.add_tensor_rows_f32("q8", DType::Q8_0, {n0, rows}, [&](int64_t r, float* d) { fill(r, d, n0); });
    w.add_tensor_rows("raw", DType::F16, {96, 3, 7}, [](int64_t r0, int64_t r1, uint8_t* dst) {
      for (int64_t r = r0; r < r1; ++r)
        for (int k = 0; k < 192; ++k) dst[(r - r0) * 192 + k] = uint8_t(r * 31 + k);
    });
    const std::string p = path("stream" + std::to_string(threads) + ".gguf");
    w.write(p);
    files.push_back(read_bytes(p));
    GgufFile f(p);
    const GgufTensorInfo* t = f.tensor("f32");
    ASSERT_NE(t, nullptr);
    std::vector<float> row(n0);
    for (int64_t r : {int64_t(0), int64_t(1), int64_t(2047), rows - 1}) {
      fill(r, row.data(), n0);
      EXPECT_EQ(std::memcmp(t->data + r * n0 * 4, row.data(), n0 * 4), 0) << "row " << r;
    }
    const GgufTensorInfo* raw = f.tensor("raw");
    ASSERT_NE(raw, nullptr);
    EXPECT_EQ(raw->data[20 * 192 + 5], uint8_t(20 * 31 + 5));
  }
  EXPECT_TRUE(files[0] == files[1]);
  EXPECT_TRUE(files[0] == files[2]);
}

TEST_F(GgufWriterTest, CallbackErrorLeavesNoFile) {
  for (int threads : {1, 3}) {
    GgufWriter w;
    w.set_threads(threads);
    w.add_tensor_rows_f32("ok", DType::F32, {1024, 4000}, [](int64_t, float* d) { std::fill(d, d + 1024, 1.0f); });
    w.add_tensor_rows_f32("bad", DType::F16, {1024, 4000}, [](int64_t r, float* d) {
      if (r == 3000) throw std::runtime_error("generator failed at row 3000");
      std::fill(d, d + 1024, 2.0f);
    });
    try {
      w.write(path("fail.gguf"));
      FAIL() << "no exception";
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "generator failed at row 3000");
    }
    EXPECT_FALSE(fs::exists(path("fail.gguf")));
    EXPECT_FALSE(fs::exists(path("fail.gguf.tmp")));
  }
  EXPECT_THROW(GgufWriter().write(path("no/such/dir/x.gguf")), std::runtime_error);
}

TEST(GgufWriterMisuse, IsRejectedBeforeAnythingIsWritten) {
  GgufWriter w;
  w.add_tensor("t", DType::F32, {4}, Bytes(16));
  EXPECT_THROW(w.add_tensor("t", DType::F32, {4}, Bytes(16)), std::invalid_argument);  // duplicate
  EXPECT_NO_THROW(w.add_tensor(std::string(63, 'n'), DType::F32, {1}, Bytes(4)));
  EXPECT_THROW(w.add_tensor(std::string(64, 'n'), DType::F32, {1}, Bytes(4)), std::invalid_argument);
  EXPECT_THROW(w.add_tensor("", DType::F32, {1}, Bytes(4)), std::invalid_argument);
  EXPECT_THROW(w.add_tensor("q", DType::Q8_0, {33, 1}, Bytes(34)), std::invalid_argument);  // not whole blocks
  EXPECT_THROW(w.add_tensor("k", DType::Q4_K, {32}, Bytes(18)), std::invalid_argument);
  EXPECT_THROW(w.add_tensor("d5", DType::F32, {1, 1, 1, 1, 1}, Bytes(4)), std::invalid_argument);
  EXPECT_THROW(w.add_tensor("d0", DType::F32, {}, Bytes(4)), std::invalid_argument);
  EXPECT_THROW(w.add_tensor("z", DType::F32, {4, 0}, Bytes()), std::invalid_argument);
  EXPECT_THROW(w.add_tensor("size", DType::F32, {4}, Bytes(15)), std::invalid_argument);
  EXPECT_THROW(w.add_tensor_f32("vals", DType::F32, {4}, std::vector<float>(3)), std::invalid_argument);
  EXPECT_THROW(w.add_tensor("ty", static_cast<DType>(5), {32}, Bytes(20)), std::invalid_argument);
  EXPECT_THROW(w.add_tensor("huge", DType::F32, {1ll << 32, 1ll << 32}, Bytes()), std::invalid_argument);
  EXPECT_EQ(w.n_tensors(), 2u);  // failed additions leave nothing behind

  EXPECT_THROW(w.set_u32("", 1), std::invalid_argument);
  EXPECT_THROW(w.set_alignment(48), std::invalid_argument);
  EXPECT_THROW(w.set_alignment(0), std::invalid_argument);
  EXPECT_THROW(w.set_alignment(16), std::invalid_argument);  // llama.cpp needs 32-byte aligned data
  EXPECT_THROW(w.set_u64("general.alignment", 64), std::invalid_argument);  // llama.cpp wants u32
  EXPECT_THROW(w.set_array_ints("x", GgufType::F32, std::vector<int64_t>{1}), std::invalid_argument);
  EXPECT_THROW(w.set_array_ints("x", GgufType::U8, std::vector<int64_t>{256}), std::invalid_argument);
  EXPECT_THROW(w.set_array_ints("x", GgufType::BOOL, std::vector<int64_t>{2}), std::invalid_argument);
  GgufValue nested;
  nested.type = GgufType::ARRAY;
  nested.elem_type = GgufType::ARRAY;
  EXPECT_THROW(w.set("x", nested), std::invalid_argument);
  GgufValue mismatch;
  mismatch.type = GgufType::ARRAY;
  mismatch.elem_type = GgufType::STRING;
  mismatch.ints = {1};
  EXPECT_THROW(w.set("x", mismatch), std::invalid_argument);
  GgufValue unknown;
  unknown.type = static_cast<GgufType>(13);
  EXPECT_THROW(w.set("x", unknown), std::invalid_argument);
  GgufValue u16;
  u16.type = GgufType::U16;
  u16.i = -1;
  EXPECT_THROW(w.set("x", u16), std::invalid_argument);
  EXPECT_EQ(w.metadata().size(), 0u);
  w.set_u32("general.alignment", 64);
  EXPECT_EQ(w.alignment(), 64u);
  EXPECT_TRUE(w.remove("general.alignment"));
  EXPECT_FALSE(w.remove("general.alignment"));
  EXPECT_EQ(w.alignment(), 32u);
}

// ============================================================================ synthetic models

namespace {

SyntheticSpec small_spec(const std::string& arch) {
  SyntheticSpec s;
  s.arch = arch;
  s.n_vocab = 300;
  s.n_embd = 64;
  s.n_layer = 2;
  s.n_head = 4;
  s.n_head_kv = 2;
  s.head_dim = arch == "qwen3" ? 32 : 16;  // qwen3: n_head * head_dim != n_embd
  s.n_ff = 96;
  s.n_ctx = 256;
  s.rope_theta = arch == "llama" ? 10000.f : 1e6f;
  s.rms_eps = arch == "llama" ? 1e-5f : 1e-6f;
  s.tied_output = arch != "llama";
  s.seed = 42;
  return s;
}

// Expected tensor names and shapes of a spec.
std::map<std::string, std::vector<int64_t>> expected_tensors(const SyntheticSpec& s, int64_t V) {
  const int64_t E = s.n_embd, F = s.n_ff, D = s.head_dim, Q = s.n_head * D, KV = s.n_head_kv * D;
  std::map<std::string, std::vector<int64_t>> m{{"token_embd.weight", {E, V}}, {"output_norm.weight", {E}}};
  if (!s.tied_output) m["output.weight"] = {E, V};
  for (int l = 0; l < s.n_layer; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    m[p + "attn_norm.weight"] = {E};
    m[p + "attn_q.weight"] = {E, Q};
    m[p + "attn_k.weight"] = {E, KV};
    m[p + "attn_v.weight"] = {E, KV};
    m[p + "attn_output.weight"] = {Q, E};
    m[p + "ffn_norm.weight"] = {E};
    m[p + "ffn_gate.weight"] = {E, F};
    m[p + "ffn_up.weight"] = {E, F};
    m[p + "ffn_down.weight"] = {F, E};
    if (s.arch == "qwen2") {
      m[p + "attn_q.bias"] = {Q};
      m[p + "attn_k.bias"] = {KV};
      m[p + "attn_v.bias"] = {KV};
    }
    if (s.arch == "qwen3") {
      m[p + "attn_q_norm.weight"] = {D};
      m[p + "attn_k_norm.weight"] = {D};
    }
  }
  return m;
}

std::vector<float> dequant(const GgufTensorInfo& t) {
  std::vector<float> y(size_t(t.n_elements()));
  const size_t rb = row_bytes(t.type, size_t(t.ne[0]));
  for (int64_t r = 0; r < t.n_elements() / t.ne[0]; ++r)
    dequantize_row(t.type, t.data + r * rb, y.data() + r * t.ne[0], size_t(t.ne[0]));
  return y;
}

std::pair<double, double> mean_std(const std::vector<float>& x) {
  double m = 0, v = 0;
  for (float a : x) m += a;
  m /= double(x.size());
  for (float a : x) v += (a - m) * (a - m);
  return {m, std::sqrt(v / double(x.size()))};
}

}  // namespace

using SyntheticModel = TmpDir;

TEST_F(SyntheticModel, EachArchHasTheRightTensorsAndKeys) {
  for (const char* arch : {"llama", "qwen2", "qwen3"}) {
    SCOPED_TRACE(arch);
    const SyntheticSpec s = small_spec(arch);
    const std::string p = path(std::string(arch) + ".gguf");
    write_synthetic_model(s, p);
    GgufFile f(p);
    const auto want = expected_tensors(s, s.n_vocab);
    ASSERT_EQ(f.tensors().size(), want.size());
    for (const auto& t : f.tensors()) {
      SCOPED_TRACE(t.name);
      auto it = want.find(t.name);
      ASSERT_NE(it, want.end()) << "unexpected tensor";
      ASSERT_EQ(t.n_dims, it->second.size());
      for (size_t d = 0; d < it->second.size(); ++d) EXPECT_EQ(t.ne[d], it->second[d]);
      EXPECT_EQ(t.type, DType::F32);
    }
    const std::string a = arch;
    EXPECT_EQ(f.get_string("general.architecture"), a);
    EXPECT_EQ(f.get_int("general.file_type"), 0);
    EXPECT_EQ(f.get_int("general.quantization_version"), 2);
    EXPECT_EQ(f.get_int(a + ".context_length"), s.n_ctx);
    EXPECT_EQ(f.get_int(a + ".embedding_length"), s.n_embd);
    EXPECT_EQ(f.get_int(a + ".block_count"), s.n_layer);
    EXPECT_EQ(f.get_int(a + ".feed_forward_length"), s.n_ff);
    EXPECT_EQ(f.get_int(a + ".attention.head_count"), s.n_head);
    EXPECT_EQ(f.get_int(a + ".attention.head_count_kv"), s.n_head_kv);
    EXPECT_EQ(f.get_int(a + ".attention.key_length"), s.head_dim);
    EXPECT_EQ(f.get_int(a + ".attention.value_length"), s.head_dim);
    EXPECT_EQ(f.get_int(a + ".rope.dimension_count"), s.head_dim);
    EXPECT_EQ(f.find(a + ".rope.freq_base")->type, GgufType::F32);
    EXPECT_FLOAT_EQ(float(*f.get_float(a + ".rope.freq_base")), s.rope_theta);
    EXPECT_FLOAT_EQ(float(*f.get_float(a + ".attention.layer_norm_rms_epsilon")), s.rms_eps);
    EXPECT_EQ(f.get_int(a + ".vocab_size"), s.n_vocab);
    EXPECT_EQ(f.get_string("tokenizer.ggml.model"), "llama");
    EXPECT_EQ(f.find("tokenizer.ggml.tokens")->strings.size(), size_t(s.n_vocab));
    EXPECT_EQ(f.find("tokenizer.ggml.scores")->floats.size(), size_t(s.n_vocab));
    EXPECT_EQ(f.find("tokenizer.ggml.token_type")->ints.size(), size_t(s.n_vocab));
    EXPECT_EQ(f.get_int("tokenizer.ggml.bos_token_id"), 1);
    EXPECT_EQ(f.get_int("tokenizer.ggml.eos_token_id"), 2);
    const auto& tokens = f.find("tokenizer.ggml.tokens")->strings;
    EXPECT_EQ(std::set<std::string>(tokens.begin(), tokens.end()).size(), tokens.size()) << "pieces are unique";
  }
}

TEST_F(SyntheticModel, WeightScales) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    SyntheticSpec s = small_spec("qwen2");
    s.n_embd = 256;
    s.n_ff = 512;
    s.head_dim = 64;
    s.tied_output = tied;
    write_synthetic_model(s, path("m.gguf"));
    GgufFile f(path("m.gguf"));
    const double resid = 1.0 / std::sqrt(2.0 * s.n_layer);
    struct Case { const char* name; double mean, std; };
    std::vector<Case> cases = {{"token_embd.weight", 0, 1.0}, {"blk.0.attn_q.weight", 0, 1 / 16.0},
                               {"blk.1.ffn_up.weight", 0, 1 / 16.0},
                               {"blk.0.attn_output.weight", 0, resid / std::sqrt(256.0)},
                               {"blk.1.ffn_down.weight", 0, resid / std::sqrt(512.0)},
                               {"blk.0.attn_norm.weight", 1, 0.02}, {"blk.0.attn_k.bias", 0, 0.1}};
    // Logits of std ~4: through output.weight, or through output_norm when tied.
    if (tied) cases.push_back({"output_norm.weight", 4 / 16.0, 0.02 * 4 / 16.0});
    else cases.insert(cases.end(), {{"output_norm.weight", 1, 0.02}, {"output.weight", 0, 4 / 16.0}});
    for (const Case& c : cases) {
      SCOPED_TRACE(c.name);
      ASSERT_NE(f.tensor(c.name), nullptr);
      auto [m, sd] = mean_std(dequant(*f.tensor(c.name)));
      EXPECT_NEAR(m, c.mean, 4 * c.std / std::sqrt(double(f.tensor(c.name)->n_elements())) + 1e-6);
      EXPECT_NEAR(sd, c.std, 0.1 * c.std);
    }
    // Rows differ from each other (every row has its own random stream).
    const GgufTensorInfo* q = f.tensor("blk.0.attn_q.weight");
    EXPECT_NE(std::memcmp(q->data, q->data + 256 * 4, 256 * 4), 0);
  }
}

TEST_F(SyntheticModel, ActivationsStayBoundedOver22Layers) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    SyntheticSpec s = small_spec("llama");
    s.n_embd = 128;
    s.n_ff = 352;
    s.head_dim = 32;
    s.n_layer = 22;
    s.tied_output = tied;
    write_synthetic_model(s, path("deep.gguf"));
    auto m = Model::load(path("deep.gguf"));
    ContextParams cp;
    cp.n_ctx = 64;
    cp.capture_layers = {0, 10, 21};
    Context ctx(*m, cp);
    Batch b;
    const int n = 12;
    for (int i = 0; i < n; ++i) b.add(int32_t(3 + (i * 37) % 290), i, seq_bit(0), true);
    ForwardOutput out = ctx.forward(b);
    for (size_t c = 0; c < out.captured.size(); ++c) {
      const auto [mean, rms_dev] = mean_std(out.captured[c]);
      const double rms = std::sqrt(mean * mean + rms_dev * rms_dev);
      EXPECT_GT(rms, 0.3) << "after layer " << cp.capture_layers[c];
      EXPECT_LT(rms, 10.0) << "after layer " << cp.capture_layers[c];
    }
    ASSERT_EQ(out.logits.size(), size_t(n) * s.n_vocab);
    for (int i = 0; i < n; ++i) {
      const std::vector<float> row(out.logits_row(i, s.n_vocab), out.logits_row(i, s.n_vocab) + s.n_vocab);
      for (float x : row) ASSERT_TRUE(std::isfinite(x));
      const auto [mean, sd] = mean_std(row);
      EXPECT_GT(sd, 1.0) << "token " << i;
      EXPECT_LT(sd, 20.0) << "token " << i;
    }
  }
}

TEST_F(SyntheticModel, QuantizedTypesWithF16Fallback) {
  for (DType t : {DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    SyntheticSpec s = small_spec("llama");
    s.n_ff = 100;  // ffn_down rows of 100: no block type fits
    s.weight_type = t;
    s.embd_type = t;
    write_synthetic_model(s, path("q.gguf"));
    GgufFile f(path("q.gguf"));
    EXPECT_EQ(f.get_int("general.file_type"), int64_t(llama_file_type(t)));
    for (const auto& ti : f.tensors()) {
      SCOPED_TRACE(ti.name);
      if (ti.n_dims == 1) {
        EXPECT_EQ(ti.type, DType::F32);
      } else if (ti.ne[0] % int64_t(block(t)) == 0) {
        EXPECT_EQ(ti.type, t);
      } else {
        EXPECT_EQ(ti.type, DType::F16);
      }
    }
    const bool k_quant = block(t) == 256;  // E = 64: every K-quant matrix falls back
    EXPECT_EQ(f.tensor("blk.0.attn_q.weight")->type, k_quant ? DType::F16 : t);
    EXPECT_EQ(f.tensor("blk.0.ffn_down.weight")->type, block(t) == 1 ? t : DType::F16);
  }
  SyntheticSpec s = small_spec("qwen3");
  s.n_embd = 256;
  s.n_ff = 512;
  s.head_dim = 64;
  s.weight_type = DType::Q4_K;
  s.embd_type = DType::Q6_K;
  write_synthetic_model(s, path("k.gguf"));
  GgufFile f(path("k.gguf"));
  EXPECT_EQ(f.tensor("token_embd.weight")->type, DType::Q6_K);
  EXPECT_EQ(f.tensor("blk.1.ffn_down.weight")->type, DType::Q4_K);
  EXPECT_EQ(f.tensor("blk.1.attn_q_norm.weight")->type, DType::F32);
  // Quantized weights still have the intended scale.
  auto [m, sd] = mean_std(dequant(*f.tensor("blk.0.attn_q.weight")));
  EXPECT_NEAR(sd, 1 / 16.0, 0.15 / 16.0);
}

// A loaded Q8_0 / Q4_0 / Q4_K / Q6_K model gives the AVX-512 path its matrices packed
// (PackedWeights), and the AVX2 path all but its Q8_0 ones; and on every path a batch of prompt tokens yields the same logits bit for
// bit as one token at a time: prefill and decode read the weights the same way.
TEST_F(SyntheticModel, QuantizedModelsBatchEqualsSingleStepsOnEveryPath) {
  for (const auto& isa : test::isas()) {
    ASSERT_TRUE(matmul_set_isa(isa.c_str()));
    for (DType t : {DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K}) {
      SCOPED_TRACE(isa + " " + std::string(dtype_name(t)));
      SyntheticSpec s = small_spec("llama");
      s.n_ff = 128;
      if (t == DType::Q4_K || t == DType::Q6_K) {  // rows of whole 256-blocks
        s.n_embd = 256;
        s.head_dim = 64;
        s.n_ff = 512;
      }
      s.weight_type = t;
      write_synthetic_model(s, path("p.gguf"));
      auto m = Model::load(path("p.gguf"));
      ASSERT_EQ(m->layers[0].w_down.type, t);
      ASSERT_EQ(m->layers[1].wq.type, t);
      const bool packed = isa == "avx512" || (isa == "avx2" && t != DType::Q8_0);
      EXPECT_EQ(m->layers[0].w_down.packed != nullptr, packed);
      EXPECT_EQ(m->layers[1].wq.packed != nullptr, packed);
      const std::vector<int32_t> seq = {1, 40, 41, 26, 37, 43, 38, 28, 26, 37, 29, 31, 42, 7, 9, 11, 13, 5, 3};
      Context single(*m, {.n_threads = 2}), batched(*m, {.n_threads = 2});
      std::vector<float> a;
      for (size_t p = 0; p < seq.size(); ++p) {
        Batch one;
        one.add(seq[p], int32_t(p), seq_bit(0), true);
        const auto o = single.forward(one);
        a.insert(a.end(), o.logits.begin(), o.logits.end());
      }
      Batch all;
      for (size_t p = 0; p < seq.size(); ++p) all.add(seq[p], int32_t(p), seq_bit(0), true);
      const std::vector<float> b = batched.forward(all).logits;
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0);
    }
  }
  matmul_set_isa(nullptr);
}

TEST_F(SyntheticModel, SameSeedSameBytesWhateverTheThreads) {
  SyntheticSpec s = small_spec("qwen3");
  s.weight_type = DType::Q8_0;
  s.n_threads = 1;
  write_synthetic_model(s, path("a.gguf"));
  s.n_threads = 3;
  write_synthetic_model(s, path("b.gguf"));
  s.seed = 43;
  write_synthetic_model(s, path("c.gguf"));
  const Bytes a = read_bytes(path("a.gguf")), b = read_bytes(path("b.gguf")), c = read_bytes(path("c.gguf"));
  EXPECT_TRUE(a == b);
  ASSERT_EQ(a.size(), c.size());
  EXPECT_FALSE(a == c);
}

TEST_F(SyntheticModel, ImpossibleSpecsAreRejected) {
  auto rejects = [&](auto change) {
    SyntheticSpec s = small_spec("llama");
    change(s);
    EXPECT_THROW(write_synthetic_model(s, path("x.gguf")), std::invalid_argument);
    EXPECT_FALSE(fs::exists(path("x.gguf")));
  };
  rejects([](SyntheticSpec& s) { s.arch = "gpt2"; });
  rejects([](SyntheticSpec& s) { s.n_vocab = 258; });
  rejects([](SyntheticSpec& s) { s.n_head_kv = 3; });
  rejects([](SyntheticSpec& s) { s.n_layer = 0; });
  rejects([](SyntheticSpec& s) { s.head_dim = 0, s.n_head = 5; });
  rejects([](SyntheticSpec& s) { s.head_dim = 15; });
  rejects([](SyntheticSpec& s) { s.weight_type = static_cast<DType>(3); });
}

TEST_F(SyntheticModel, PresetsDescribeTheNamedShapes) {
  for (const auto& name : synthetic_preset_names()) EXPECT_TRUE(synthetic_preset(name).has_value()) << name;
  EXPECT_FALSE(synthetic_preset("nope").has_value());
  const SyntheticSpec t = *synthetic_preset("tinyllama-1.1b");
  EXPECT_EQ(t.arch, "llama");
  EXPECT_EQ(t.n_vocab, 32000);
  EXPECT_EQ(t.n_embd, 2048);
  EXPECT_EQ(t.n_layer, 22);
  EXPECT_EQ(t.n_head, 32);
  EXPECT_EQ(t.n_head_kv, 4);
  EXPECT_EQ(t.n_ff, 5632);
  // Tiny presets are cheap to write; check one end to end.
  SyntheticSpec q = *synthetic_preset("tiny-qwen3");
  q.weight_type = DType::Q4_K;
  write_synthetic_model(q, path("tq3.gguf"));
  GgufFile f(path("tq3.gguf"));
  EXPECT_EQ(f.tensor("blk.0.attn_q.weight")->ne[1], int64_t(q.n_head) * q.head_dim);
  EXPECT_EQ(f.tensor("blk.0.attn_q.weight")->type, DType::Q4_K);
  EXPECT_EQ(f.tensor("output.weight"), nullptr);
}

TEST_F(SyntheticModel, VocabularyCopiedFromGguf) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string src = refdata("gguf-models/stories260K.gguf");
  SyntheticSpec s = small_spec("qwen2");
  s.n_vocab = 32000;  // ignored: the copied vocabulary decides
  s.vocab_from = src;
  write_synthetic_model(s, path("v.gguf"));
  GgufFile f(path("v.gguf")), ref(src);
  EXPECT_EQ(f.tensor("token_embd.weight")->ne[1], 512);
  EXPECT_EQ(f.get_int("qwen2.vocab_size"), 512);
  size_t n = 0;
  for (const auto& kv : ref.metadata()) {
    if (!kv.key.starts_with("tokenizer.")) continue;
    ++n;
    const GgufValue* v = f.find(kv.key);
    ASSERT_NE(v, nullptr) << kv.key;
    EXPECT_TRUE(same_value(*v, kv.value)) << kv.key;
  }
  EXPECT_GE(n, 8u);
}

TEST_F(SyntheticModel, VocabularyCopiedFromLlama2cTokenizer) {
  SPECMESH_REQUIRE_REFDATA();
  SyntheticSpec s = small_spec("llama");
  s.vocab_from = refdata("llama2c/tok512.bin");
  write_synthetic_model(s, path("v.gguf"));
  GgufFile f(path("v.gguf")), ref(refdata("gguf-models/stories260K.gguf"));
  EXPECT_EQ(f.tensor("token_embd.weight")->ne[1], 512);
  EXPECT_EQ(f.get_string("tokenizer.ggml.model"), "llama");
  const auto& got = f.find("tokenizer.ggml.tokens")->strings;
  const auto& want = ref.find("tokenizer.ggml.tokens")->strings;
  ASSERT_EQ(got.size(), 512u);
  for (size_t i = 3; i < 512; ++i) EXPECT_EQ(got[i], want[i]) << "token " << i;  // BOS/EOS spelling may differ
  EXPECT_EQ(f.find("tokenizer.ggml.token_type")->ints, ref.find("tokenizer.ggml.token_type")->ints);
  EXPECT_EQ(f.find("tokenizer.ggml.scores")->floats, ref.find("tokenizer.ggml.scores")->floats);
  EXPECT_EQ(f.get_int("tokenizer.ggml.bos_token_id"), 1);
  EXPECT_EQ(f.get_int("tokenizer.ggml.eos_token_id"), 2);
}

TEST_F(SyntheticModel, SyntheticVocabularyTokenizesAnyText) {
  SyntheticSpec s = small_spec("llama");
  s.n_vocab = 1200;
  write_synthetic_model(s, path("v.gguf"));
  GgufFile f(path("v.gguf"));
  Tokenizer tok(vocab_from_gguf(f));
  EXPECT_EQ(tok.n_vocab(), 1200);
  for (const std::string text : {"hello world", "the quick brown fox", "Caf\xC3\xA9 \xE2\x9C\x93 \t\n42!", ""}) {
    SCOPED_TRACE(text);
    const auto ids = tok.encode(text, true);
    ASSERT_FALSE(ids.empty());
    EXPECT_EQ(ids[0], 1);  // BOS
    for (int32_t id : ids) EXPECT_LT(id, 1200);
    EXPECT_EQ(tok.decode(std::vector<int32_t>(ids.begin() + 1, ids.end())), text);
  }
  // Lower-case words use the filler pieces rather than one byte token per character.
  EXPECT_LT(tok.encode("hello world", false).size(), 11u);
}

TEST_F(SyntheticModel, LoadsAsAModel) {
  for (const char* arch : {"llama", "qwen2", "qwen3"}) {
    SCOPED_TRACE(arch);
    SyntheticSpec s = small_spec(arch);
    s.weight_type = DType::Q8_0;
    write_synthetic_model(s, path("m.gguf"));
    auto m = Model::load(path("m.gguf"));
    const HParams& hp = m->hparams();
    EXPECT_STREQ(arch_name(hp.arch), arch);
    EXPECT_EQ(hp.n_vocab, s.n_vocab);
    EXPECT_EQ(hp.n_embd, s.n_embd);
    EXPECT_EQ(hp.n_layer, s.n_layer);
    EXPECT_EQ(hp.n_head, s.n_head);
    EXPECT_EQ(hp.n_head_kv, s.n_head_kv);
    EXPECT_EQ(hp.head_dim, s.head_dim);
    EXPECT_EQ(hp.n_ff, s.n_ff);
    EXPECT_EQ(hp.n_ctx_train, s.n_ctx);
    EXPECT_FLOAT_EQ(hp.rope_theta, s.rope_theta);
    EXPECT_FLOAT_EQ(hp.rms_eps, s.rms_eps);
    EXPECT_EQ(hp.rope, std::string(arch) == "llama" ? RopeStyle::Interleaved : RopeStyle::Neox);
  }
}

// ============================================================================ defective models

namespace {

// A copy of the GGUF at src with edit() applied to its metadata; the tensors are unchanged.
void rewrite_gguf(const std::string& src, const std::string& dst, const std::function<void(GgufWriter&)>& edit) {
  GgufFile f(src);
  GgufWriter w;
  for (const auto& kv : f.metadata()) w.set(kv.key, kv.value);
  for (const auto& t : f.tensors())
    w.add_tensor_view(t.name, t.type, std::vector<int64_t>(t.ne, t.ne + t.n_dims), t.data);
  edit(w);
  w.write(dst);
}

// Model::load must refuse the file with a FormatError naming the file and every given word.
void expect_model_rejected(const std::string& path, std::initializer_list<const char*> words) {
  try {
    Model::load(path);
    ADD_FAILURE() << "loaded " << path;
  } catch (const FormatError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << "does not name the file: " << msg;
    for (const char* w : words) EXPECT_NE(msg.find(w), std::string::npos) << "does not say '" << w << "': " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a FormatError: " << e.what();
  }
}

}  // namespace

// Found by fuzzing (fuzz/gguf.cpp): a merge without a space escaped as the tokenizer's
// std::invalid_argument, which names neither the file nor the key.
TEST_F(SyntheticModel, MergeWithoutASpaceIsAFormatError) {
  write_synthetic_model(small_spec("llama"), path("spm.gguf"));
  for (const char* merge : {"i$c", " ab", ""}) {
    SCOPED_TRACE(merge);
    rewrite_gguf(path("spm.gguf"), path("bpe.gguf"), [&](GgufWriter& w) {
      w.set_string("tokenizer.ggml.model", "gpt2");
      w.set_string("tokenizer.ggml.pre", "gpt-2");
      w.set_array_strings("tokenizer.ggml.merges", std::vector<std::string>{"a b", merge});
    });
    expect_model_rejected(path("bpe.gguf"), {"tokenizer.ggml.merges", "merge 1"});
  }
  // The same file with a well-formed merge loads.
  rewrite_gguf(path("spm.gguf"), path("bpe.gguf"), [&](GgufWriter& w) {
    w.set_string("tokenizer.ggml.model", "gpt2");
    w.set_string("tokenizer.ggml.pre", "gpt-2");
    w.set_array_strings("tokenizer.ggml.merges", std::vector<std::string>{"a b", "i $c"});
  });
  EXPECT_EQ(Model::load(path("bpe.gguf"))->tokenizer().vocab().merges.size(), 2u);
}

// Found reading the loader while fuzzing it (fuzz/gguf.cpp runs this file clean now): head
// count and key length are each at most 2^24, but their product overflowed HParams::q_dim()'s
// int (undefined behaviour) before any tensor shape was compared.
TEST_F(SyntheticModel, HeadCountTimesKeyLengthMustFit) {
  SyntheticSpec s = small_spec("llama");
  write_synthetic_model(s, path("m.gguf"));
  rewrite_gguf(path("m.gguf"), path("big.gguf"), [&](GgufWriter& w) {
    w.set_u32("llama.attention.head_count", 65536);
    w.set_u32("llama.attention.head_count_kv", 65536);
    w.set_u32("llama.attention.key_length", 65536);
    w.set_u32("llama.rope.dimension_count", 2);
  });
  expect_model_rejected(path("big.gguf"), {"attention.head_count x attention.key_length = 4294967296"});
  // At the limit the product is fine, and the tensors' shapes decide.
  rewrite_gguf(path("m.gguf"), path("big.gguf"), [&](GgufWriter& w) {
    w.set_u32("llama.attention.head_count", 4096);
    w.set_u32("llama.attention.head_count_kv", 4096);
    w.set_u32("llama.attention.key_length", 4096);
    w.set_u32("llama.rope.dimension_count", 2);
  });
  expect_model_rejected(path("big.gguf"), {"attn_q.weight"});
}

// Found by fuzzing (fuzz/gguf.cpp): a 40 KB file with block_count 2^24 - 1 made the loader
// allocate 4.7 GB of layers before it looked for their tensors. Checked in a child process
// under an address-space limit, so a regression fails instead of eating the machine's memory.
TEST_F(SyntheticModel, BlockCountWithoutTensorsIsRefusedBeforeAllocating) {
  write_synthetic_model(small_spec("llama"), path("m.gguf"));
  rewrite_gguf(path("m.gguf"), path("deep.gguf"), [](GgufWriter& w) { w.set_u32("llama.block_count", (1 << 24) - 1); });
  const std::string deep = path("deep.gguf");
  auto refused_within_limit = [&] {
    test::cap_address_space();
    try {
      Model::load(deep);
    } catch (const FormatError& e) {
      return std::string(e.what()).find("missing tensor 'blk.2.attn_norm.weight'") != std::string::npos ? 0 : 2;
    } catch (...) {
      return 3;  // std::bad_alloc: it tried
    }
    return 1;
  };
  // _exit: the forked child must not run static destructors.
  EXPECT_EXIT(::_exit(refused_within_limit()), ::testing::ExitedWithCode(0), "");
}

// ============================================================================ corrupted files

namespace {

// Minimal raw GGUF assembly for structures the writer refuses to produce.
struct Raw {
  Bytes b;
  template <class T>
  Raw& put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
    return *this;
  }
  Raw& str(std::string_view s) {
    put<uint64_t>(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  Raw& header(uint64_t n_tensors, uint64_t n_kv) { return put<uint32_t>(0x46554747).put<uint32_t>(3).put(n_tensors).put(n_kv); }
  Raw& tensor(std::string_view name, std::vector<int64_t> ne, uint32_t type, uint64_t offset) {
    str(name).put<uint32_t>(uint32_t(ne.size()));
    for (int64_t x : ne) put(x);
    return put(type).put(offset);
  }
  Raw& pad(size_t a = 32) {
    b.resize((b.size() + a - 1) / a * a, 0);
    return *this;
  }
};

class GgufCorrupt : public TmpDir {
 protected:
  GgufCorrupt() : TmpDir(true) {}
  void SetUp() override {
    TmpDir::SetUp();
    GgufWriter w;
    w.set_string("general.architecture", "llama");
    w.set_u32("test.k1", 7);
    w.set_u32("test.k2", 8);
    w.set_array_i32("test.arr", std::vector<int32_t>{1, 2, 3});
    w.set_array_strings("test.strs", std::vector<std::string>{"a", "bc"});
    w.add_tensor("tensor.aaaa", DType::F32, {8, 2}, Bytes(64, 1));
    w.add_tensor("tensor.bbbb", DType::Q8_0, {32, 2}, Bytes(68, 2));
    w.add_tensor("tensor.gamma", DType::F16, {16}, Bytes(32, 3));
    base_path_ = path("base.gguf");
    w.write(base_path_);
    base_ = read_bytes(base_path_);
    data_offset_ = w.data_offset();
    GgufFile ok(base_path_);  // the unmodified file is valid
    ASSERT_EQ(ok.tensors().size(), 3u);
  }

  // Offsets inside the tensor info of `name`.
  size_t info(std::string_view name) const { return find_str(base_, name) + name.size(); }  // -> n_dims
  size_t type_at(std::string_view name) const { return info(name) + 4 + 8 * get_at<uint32_t>(base_, info(name)); }
  size_t offset_at(std::string_view name) const { return type_at(name) + 4; }
  // Offset of the value type of metadata `key`.
  size_t kv_type_at(std::string_view key) const { return find_str(base_, key) + key.size(); }

  // The file must be rejected with a FormatError naming the file and one of the given words.
  void expect_rejected(const Bytes& b, std::initializer_list<const char*> any_of, const std::string& what) {
    SCOPED_TRACE(what);
    const std::string p = path("bad.gguf");
    write_bytes(p, b);
    try {
      GgufFile f(p);
      ADD_FAILURE() << "accepted a file with: " << what;
    } catch (const FormatError& e) {
      const std::string msg = lower(e.what());
      EXPECT_NE(msg.find(lower(p)), std::string::npos) << "message does not name the file: " << e.what();
      bool named = any_of.size() == 0;
      for (const char* w : any_of) named = named || msg.find(lower(w)) != std::string::npos;
      EXPECT_TRUE(named) << "message does not name the defect (" << what << "): " << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a FormatError (" << what << "): " << e.what();
    }
  }

  std::string base_path_;
  Bytes base_;
  size_t data_offset_ = 0;
};

}  // namespace

TEST_F(GgufCorrupt, TruncatedAnywhereBeforeTheEndOfData) {
  for (size_t n = 0; n < data_offset_; ++n)
    expect_rejected(Bytes(base_.begin(), base_.begin() + n), {}, "truncated to " + std::to_string(n) + " bytes");
  // Into the data: the last tensor no longer fits.
  for (size_t n : {data_offset_, data_offset_ + 1, base_.size() - 1})
    expect_rejected(Bytes(base_.begin(), base_.begin() + n), {"outside", "bounds", "past", "truncat", "beyond"},
                    "data truncated to " + std::to_string(n) + " bytes");
}

TEST_F(GgufCorrupt, HeaderDefects) {
  Bytes b = base_;
  std::memcpy(b.data(), "GGUX", 4);
  expect_rejected(b, {"magic"}, "wrong magic");
  for (uint32_t v : {0u, 1u, 4u, 0x03000000u}) {
    b = base_;
    put_at<uint32_t>(b, 4, v);
    expect_rejected(b, {"version"}, "version " + std::to_string(v));
  }
  for (uint64_t n : {uint64_t(1) << 62, ~uint64_t(0), uint64_t(1000)}) {
    b = base_;
    put_at<uint64_t>(b, 8, n);
    expect_rejected(b, {"tensor"}, "n_tensors " + std::to_string(n));
    b = base_;
    put_at<uint64_t>(b, 16, n);
    expect_rejected(b, {"metadata", "kv", "key", "count", "truncat"}, "n_kv " + std::to_string(n));
  }
}

TEST_F(GgufCorrupt, MetadataDefects) {
  Bytes b = base_;
  const size_t k2 = find_str(base_, "test.k2");
  put_at<uint64_t>(b, k2 - 8, uint64_t(1) << 40);
  expect_rejected(b, {"length", "past", "truncat"}, "key length past the end");

  b = base_;
  const size_t arch_value = kv_type_at("general.architecture") + 4;  // u64 length of "llama"
  ASSERT_EQ(get_at<uint64_t>(b, arch_value), 5u);
  put_at<uint64_t>(b, arch_value, b.size());
  expect_rejected(b, {"length", "past", "truncat"}, "string value past the end");

  b = base_;
  const size_t arr = kv_type_at("test.arr");
  ASSERT_EQ(get_at<uint32_t>(b, arr), 9u);
  put_at<uint32_t>(b, arr + 4, 9);
  expect_rejected(b, {"nested"}, "array of arrays");

  b = base_;
  put_at<uint64_t>(b, arr + 8, uint64_t(1) << 60);
  expect_rejected(b, {"array", "past", "truncat"}, "array count past the end");

  b = base_;
  const size_t strs = kv_type_at("test.strs");
  put_at<uint64_t>(b, strs + 8 + 8, uint64_t(1) << 33);  // length of element 0
  expect_rejected(b, {"length", "past", "truncat"}, "array string past the end");

  b = base_;
  put_at<uint32_t>(b, kv_type_at("test.k1"), 13);
  expect_rejected(b, {"13"}, "unknown value type 13");
  b = base_;
  put_at<uint32_t>(b, arr + 4, 0xdeadbeef);
  expect_rejected(b, {"type"}, "unknown array element type");

  b = base_;
  std::memcpy(b.data() + k2, "test.k1", 7);
  expect_rejected(b, {"duplicate"}, "duplicate key");

  Raw r;
  r.header(1, 1).str("general.alignment").put<uint32_t>(4).put<uint32_t>(48);
  r.tensor("t", {8}, 0, 0).pad(48);
  r.b.resize(r.b.size() + 48);
  expect_rejected(r.b, {"alignment"}, "alignment 48");
}

TEST_F(GgufCorrupt, TensorInfoDefects) {
  Bytes b = base_;
  std::memcpy(b.data() + find_str(base_, "tensor.bbbb"), "tensor.aaaa", 11);
  expect_rejected(b, {"duplicate"}, "duplicate tensor name");

  b = base_;
  put_at<uint32_t>(b, type_at("tensor.bbbb"), 99);
  expect_rejected(b, {"99"}, "unknown tensor type 99");
  b = base_;
  put_at<uint32_t>(b, type_at("tensor.bbbb"), 4);  // Q4_2: removed from ggml
  expect_rejected(b, {"type"}, "removed tensor type 4");

  b = base_;
  put_at<uint64_t>(b, offset_at("tensor.bbbb"), get_at<uint64_t>(base_, offset_at("tensor.bbbb")) + 1);
  expect_rejected(b, {"align"}, "misaligned offset");
  b = base_;
  put_at<uint64_t>(b, offset_at("tensor.bbbb"), get_at<uint64_t>(base_, offset_at("tensor.bbbb")) + 32);
  expect_rejected(b, {"offset", "expected", "pack"}, "gap between tensors");
  b = base_;
  put_at<uint64_t>(b, offset_at("tensor.gamma"), 0);
  expect_rejected(b, {"offset", "expected", "pack", "overlap"}, "overlapping tensors");

  b = base_;
  put_at<int64_t>(b, info("tensor.aaaa") + 4 + 8, int64_t(1) << 30);  // ne[1]: far more data than the file has
  expect_rejected(b, {"outside", "larger", "bounds", "past"}, "tensor data out of bounds");

  auto raw_one = [&](std::string_view name, std::vector<int64_t> ne, uint32_t type, const std::string& what,
                     std::initializer_list<const char*> words) {
    Raw r;
    r.header(1, 0).tensor(name, ne, type, 0).pad();
    r.b.resize(r.b.size() + 4096);
    expect_rejected(r.b, words, what);
  };
  raw_one(std::string(64, 'x'), {4}, 0, "64-byte tensor name", {"63", "long"});
  raw_one("t", {1, 1, 1, 1, 1}, 0, "5 dimensions", {"dimension"});
  raw_one("t", {4, -1}, 0, "negative dimension", {"dimension"});
  raw_one("t", {4, 0}, 0, "zero dimension", {"dimension", "element"});
  raw_one("t", {33}, 8, "Q8_0 row of 33", {"block", "multiple"});
  raw_one("t", {100}, 12, "Q4_K row of 100", {"block", "multiple"});
  // The byte size 2^40 * 4 * 2^40 * 2^40 * 2^8 wraps to 0 in 128-bit arithmetic; the element
  // count does not fit int64 either. llama.cpp rejects any shape whose element count reaches
  // INT64_MAX.
  raw_one("t", {int64_t(1) << 40, int64_t(1) << 40, int64_t(1) << 40, int64_t(1) << 8}, 0,
          "element count overflowing int64", {"element", "large", "overflow", "dimension", "outside"});
  raw_one("t", {int64_t(1) << 32, int64_t(1) << 32}, 0, "element count 2^64", {"element", "large", "overflow", "dimension", "outside"});
}

TEST_F(GgufCorrupt, RandomByteFlipsNeverCrash) {
  std::mt19937 rng(1234);
  const std::string p = path("fuzz.gguf");
  int accepted = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    Bytes b = base_;
    const int flips = 1 + int(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      const size_t at = rng() % data_offset_;  // the header is where parsing decisions happen
      b[at] = (rng() % 3 == 0) ? uint8_t(0xff) : uint8_t(rng());
    }
    write_bytes(p, b);
    try {
      GgufFile f(p);
      ++accepted;
      for (const auto& t : f.tensors()) {
        ASSERT_NE(t.data, nullptr);
        ASSERT_LE(f.data_offset() + t.offset + t.nbytes, f.file_size()) << t.name;
        ASSERT_EQ(t.nbytes, row_bytes(t.type, size_t(t.ne[0])) * size_t(t.ne[1] * t.ne[2] * t.ne[3])) << t.name;
      }
    } catch (const FormatError&) {
    } catch (const std::exception& e) {
      FAIL() << "iteration " << iter << ": not a FormatError: " << e.what();
    }
  }
  EXPECT_GT(accepted, 0);  // some flips only touch values, which is fine
}
