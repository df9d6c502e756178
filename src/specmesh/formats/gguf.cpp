#include "specmesh/formats/gguf.hpp"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <unordered_set>

namespace specmesh {

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
constexpr uint32_t kMaxDims = 4;
constexpr size_t kMaxName = 63;

// Bounds-checked little-endian cursor over the mapped file.
class Cursor {
 public:
  Cursor(const uint8_t* p, size_t n, const std::string& path) : p_(p), n_(n), path_(path) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw FormatError(path_ + ": " + what + " (at byte " + std::to_string(off_) + ")");
  }
  void need(size_t k, const char* what) const {
    if (k > n_ - off_) fail(std::string("truncated while reading ") + what);
  }
  template <class T>
  T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, p_ + off_, sizeof(T));
    off_ += sizeof(T);
    return v;
  }
  std::string str(const char* what) {
    uint64_t len = read<uint64_t>(what);
    if (len > n_ - off_) fail(std::string(what) + ": string length " + std::to_string(len) + " runs past the end of the file");
    std::string s(reinterpret_cast<const char*>(p_ + off_), len);
    off_ += len;
    return s;
  }
  size_t offset() const { return off_; }
  size_t remaining() const { return n_ - off_; }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t off_ = 0;
  const std::string& path_;
};

size_t scalar_size(GgufType t) {
  switch (t) {
    case GgufType::U8: case GgufType::I8: case GgufType::BOOL: return 1;
    case GgufType::U16: case GgufType::I16: return 2;
    case GgufType::U32: case GgufType::I32: case GgufType::F32: return 4;
    case GgufType::U64: case GgufType::I64: case GgufType::F64: return 8;
    default: return 0;
  }
}

bool is_integer(GgufType t) {
  return t != GgufType::F32 && t != GgufType::F64 && t != GgufType::STRING && t != GgufType::ARRAY;
}

void read_scalar(Cursor& c, GgufType t, int64_t& i, double& f, const std::string& key) {
  switch (t) {
    case GgufType::U8: i = c.read<uint8_t>(key.c_str()); break;
    case GgufType::I8: i = c.read<int8_t>(key.c_str()); break;
    case GgufType::U16: i = c.read<uint16_t>(key.c_str()); break;
    case GgufType::I16: i = c.read<int16_t>(key.c_str()); break;
    case GgufType::U32: i = c.read<uint32_t>(key.c_str()); break;
    case GgufType::I32: i = c.read<int32_t>(key.c_str()); break;
    case GgufType::U64: i = static_cast<int64_t>(c.read<uint64_t>(key.c_str())); break;
    case GgufType::I64: i = c.read<int64_t>(key.c_str()); break;
    case GgufType::BOOL: {
      uint8_t b = c.read<uint8_t>(key.c_str());
      if (b > 1) c.fail("metadata '" + key + "': bool value " + std::to_string(b) + " is not 0 or 1");
      i = b;
      break;
    }
    case GgufType::F32: f = c.read<float>(key.c_str()); break;
    case GgufType::F64: f = c.read<double>(key.c_str()); break;
    default: c.fail("metadata '" + key + "': not a scalar type");
  }
}

GgufType read_type(Cursor& c, const std::string& key) {
  uint32_t t = c.read<uint32_t>("value type");
  if (t > static_cast<uint32_t>(GgufType::F64)) c.fail("metadata '" + key + "': unknown value type " + std::to_string(t));
  return static_cast<GgufType>(t);
}

GgufValue read_value(Cursor& c, const std::string& key) {
  GgufValue v;
  v.type = read_type(c, key);
  if (v.type == GgufType::STRING) {
    v.s = c.str(key.c_str());
  } else if (v.type == GgufType::ARRAY) {
    v.elem_type = read_type(c, key);
    uint64_t n = c.read<uint64_t>("array length");
    if (v.elem_type == GgufType::ARRAY) c.fail("metadata '" + key + "': nested arrays are not supported");
    // Every element takes at least one byte (a string at least 8): reject counts the file cannot hold.
    size_t min_elem = v.elem_type == GgufType::STRING ? 8 : scalar_size(v.elem_type);
    if (n > c.remaining() / min_elem) c.fail("metadata '" + key + "': array of " + std::to_string(n) + " elements runs past the end of the file");
    if (v.elem_type == GgufType::STRING) {
      v.strings.reserve(n);
      for (uint64_t k = 0; k < n; ++k) v.strings.push_back(c.str(key.c_str()));
    } else if (is_integer(v.elem_type)) {
      v.ints.resize(n);
      double unused;
      for (uint64_t k = 0; k < n; ++k) read_scalar(c, v.elem_type, v.ints[k], unused, key);
    } else {
      v.floats.resize(n);
      int64_t unused;
      for (uint64_t k = 0; k < n; ++k) read_scalar(c, v.elem_type, unused, v.floats[k], key);
    }
  } else {
    read_scalar(c, v.type, v.i, v.f, key);
  }
  return v;
}

}  // namespace

bool is_gguf_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char m[4] = {};
  return f.read(m, 4) && std::memcmp(m, "GGUF", 4) == 0;
}

bool is_gguf_file(const MappedFile& file) {
  return file.size() >= 4 && std::memcmp(file.data(), "GGUF", 4) == 0;
}

std::string_view gguf_type_name(GgufType t) {
  static constexpr std::string_view names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32",
                                                "bool", "string", "array", "u64", "i64", "f64"};
  auto i = static_cast<uint32_t>(t);
  return i < std::size(names) ? names[i] : "unknown";
}

GgufFile::GgufFile(const std::string& path) : GgufFile(MappedFile(path)) {}

GgufFile::GgufFile(MappedFile file) : map_(std::move(file)) {
  Cursor c(map_.data(), map_.size(), map_.path());
  uint32_t magic = c.read<uint32_t>("magic");
  if (magic != kMagic) c.fail("not a GGUF file (bad magic)");
  version_ = c.read<uint32_t>("version");
  if (version_ == 1) c.fail("GGUF version 1 is not supported (v2 and v3 are)");
  if (version_ != 2 && version_ != 3) c.fail("unsupported GGUF version " + std::to_string(version_));
  int64_t n_tensors = c.read<int64_t>("tensor count");
  int64_t n_kv = c.read<int64_t>("metadata count");
  // A KV pair needs at least 8+4+1 bytes and a tensor info 8+4+8+4+8: reject impossible counts early.
  if (n_kv < 0 || uint64_t(n_kv) > c.remaining() / 13) c.fail("metadata count " + std::to_string(n_kv) + " is impossible for this file size");
  if (n_tensors < 0 || uint64_t(n_tensors) > c.remaining() / 32) c.fail("tensor count " + std::to_string(n_tensors) + " is impossible for this file size");

  std::unordered_set<std::string> keys;
  kv_.reserve(n_kv);
  for (int64_t k = 0; k < n_kv; ++k) {
    std::string key = c.str("metadata key");
    if (key.empty()) c.fail("metadata key " + std::to_string(k) + " is empty");
    if (!keys.insert(key).second) c.fail("duplicate metadata key '" + key + "'");
    GgufValue v = read_value(c, key);
    kv_.push_back({std::move(key), std::move(v)});
  }

  if (auto a = find("general.alignment")) {
    if (a->type != GgufType::U32)
      c.fail("general.alignment must be of type u32, is " + std::string(gguf_type_name(a->type)));
    if (a->i <= 0 || (a->i & (a->i - 1)) != 0) c.fail("general.alignment must be a power of two");
    alignment_ = static_cast<size_t>(a->i);
  }

  std::unordered_set<std::string> names;
  tensors_.reserve(n_tensors);
  for (int64_t k = 0; k < n_tensors; ++k) {
    GgufTensorInfo t;
    t.name = c.str("tensor name");
    if (t.name.size() > kMaxName) c.fail("tensor name '" + t.name + "' is longer than 63 bytes");
    if (!names.insert(t.name).second) c.fail("duplicate tensor name '" + t.name + "'");
    t.n_dims = c.read<uint32_t>("tensor dims");
    if (t.n_dims == 0 || t.n_dims > kMaxDims) c.fail("tensor '" + t.name + "' has " + std::to_string(t.n_dims) + " dimensions (1 to 4 allowed)");
    for (uint32_t d = 0; d < t.n_dims; ++d) {
      t.ne[d] = c.read<int64_t>("tensor shape");
      if (t.ne[d] <= 0 || t.ne[d] > (int64_t(1) << 40)) c.fail("tensor '" + t.name + "' has invalid dimension " + std::to_string(t.ne[d]));
    }
    uint32_t type = c.read<uint32_t>("tensor type");
    const DTypeTraits* tr = dtype_traits(type);
    if (!tr) c.fail("tensor '" + t.name + "' has unsupported type " + std::to_string(type));
    t.type = static_cast<DType>(type);
    if (t.ne[0] % int64_t(tr->block_elems) != 0)
      c.fail("tensor '" + t.name + "': row length " + std::to_string(t.ne[0]) + " is not a multiple of the " +
             std::string(tr->name) + " block size " + std::to_string(tr->block_elems));
    int64_t elems = 1;
    for (int d = 0; d < 4; ++d) {
      if (t.ne[d] > INT64_MAX / elems)
        c.fail("tensor '" + t.name + "' has too many elements (its shape overflows int64)");
      elems *= t.ne[d];
    }
    unsigned __int128 bytes = (unsigned __int128)(t.ne[0] / tr->block_elems) * tr->block_bytes * t.ne[1] * t.ne[2] * t.ne[3];
    if (bytes > map_.size()) c.fail("tensor '" + t.name + "' is larger than the file");
    t.nbytes = static_cast<size_t>(bytes);
    t.offset = c.read<uint64_t>("tensor offset");
    if (t.offset % alignment_ != 0) c.fail("tensor '" + t.name + "' offset " + std::to_string(t.offset) + " is not aligned to " + std::to_string(alignment_));
    tensors_.push_back(std::move(t));
  }

  data_offset_ = (c.offset() + alignment_ - 1) / alignment_ * alignment_;
  const size_t avail = map_.size() > data_offset_ ? map_.size() - data_offset_ : 0;
  uint64_t expected = 0;  // llama.cpp requires tensors packed in info order
  for (auto& t : tensors_) {
    if (t.offset != expected)
      throw FormatError(map_.path() + ": tensor '" + t.name + "' offset " + std::to_string(t.offset) +
                        " is not where the previous tensor ends (expected " + std::to_string(expected) + ")");
    if (t.offset > avail || t.nbytes > avail - t.offset)
      throw FormatError(map_.path() + ": tensor '" + t.name + "' data (offset " + std::to_string(t.offset) + ", " +
                        std::to_string(t.nbytes) + " bytes) lies outside the file");
    t.data = map_.data() + data_offset_ + t.offset;
    expected = t.offset + (t.nbytes + alignment_ - 1) / alignment_ * alignment_;
  }
}

const GgufValue* GgufFile::find(std::string_view key) const {
  for (const auto& kv : kv_)
    if (kv.key == key) return &kv.value;
  return nullptr;
}

std::optional<int64_t> GgufFile::get_int(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (!is_integer(v->type)) throw FormatError(path() + ": metadata '" + std::string(key) + "' should be an integer, is " + std::string(gguf_type_name(v->type)));
  return v->i;
}

std::optional<double> GgufFile::get_float(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (v->type == GgufType::F32 || v->type == GgufType::F64) return v->f;
  if (is_integer(v->type) && v->type != GgufType::BOOL) return double(v->i);
  throw FormatError(path() + ": metadata '" + std::string(key) + "' should be a number, is " + std::string(gguf_type_name(v->type)));
}

std::optional<bool> GgufFile::get_bool(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != GgufType::BOOL) throw FormatError(path() + ": metadata '" + std::string(key) + "' should be a bool, is " + std::string(gguf_type_name(v->type)));
  return v->i != 0;
}

std::optional<std::string> GgufFile::get_string(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != GgufType::STRING) throw FormatError(path() + ": metadata '" + std::string(key) + "' should be a string, is " + std::string(gguf_type_name(v->type)));
  return v->s;
}

const GgufTensorInfo* GgufFile::tensor(std::string_view name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

}  // namespace specmesh
