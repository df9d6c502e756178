#include "specmesh/formats/gguf_writer.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "specmesh/kernels/quant.hpp"

namespace specmesh {

static_assert(std::endian::native == std::endian::little, "GGUF is little-endian; this writer copies memory as is");

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF"
constexpr uint32_t kVersion = 3;
constexpr size_t kMaxName = 63;          // GGML_MAX_NAME 64 including the NUL
constexpr size_t kDefaultAlignment = 32;
constexpr uint64_t kChunkBytes = 4u << 20;  // produced data is handed to the file in pieces of this size

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument("GgufWriter: " + what); }

uint64_t pad_to(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

bool is_int_type(GgufType t) {
  switch (t) {
    case GgufType::U8: case GgufType::I8: case GgufType::U16: case GgufType::I16:
    case GgufType::U32: case GgufType::I32: case GgufType::U64: case GgufType::I64:
    case GgufType::BOOL: return true;
    default: return false;
  }
}
bool is_float_type(GgufType t) { return t == GgufType::F32 || t == GgufType::F64; }
bool is_known_type(GgufType t) { return static_cast<uint32_t>(t) <= static_cast<uint32_t>(GgufType::F64); }

void check_int(std::string_view key, GgufType t, int64_t v) {
  int64_t lo = std::numeric_limits<int64_t>::min(), hi = std::numeric_limits<int64_t>::max();
  switch (t) {
    case GgufType::U8: lo = 0; hi = 0xff; break;
    case GgufType::I8: lo = -128; hi = 127; break;
    case GgufType::U16: lo = 0; hi = 0xffff; break;
    case GgufType::I16: lo = -32768; hi = 32767; break;
    case GgufType::U32: lo = 0; hi = 0xffffffffll; break;
    case GgufType::I32: lo = std::numeric_limits<int32_t>::min(); hi = std::numeric_limits<int32_t>::max(); break;
    case GgufType::BOOL: lo = 0; hi = 1; break;
    default: break;  // U64 (bit-cast) and I64 take any value
  }
  if (v < lo || v > hi)
    bad("metadata '" + std::string(key) + "': value " + std::to_string(v) + " does not fit " +
        std::string(gguf_type_name(t)));
}

void check_value(std::string_view key, const GgufValue& v) {
  if (key.empty()) bad("empty metadata key");
  if (!is_known_type(v.type)) bad("metadata '" + std::string(key) + "': unknown value type " + std::to_string(uint32_t(v.type)));
  if (v.type != GgufType::ARRAY) {
    if (is_int_type(v.type)) check_int(key, v.type, v.i);
    return;
  }
  const GgufType e = v.elem_type;
  if (e == GgufType::ARRAY) bad("metadata '" + std::string(key) + "': nested arrays are not allowed in GGUF");
  if (!is_known_type(e)) bad("metadata '" + std::string(key) + "': unknown array element type " + std::to_string(uint32_t(e)));
  const bool ok = e == GgufType::STRING ? v.ints.empty() && v.floats.empty()
                  : is_float_type(e)    ? v.ints.empty() && v.strings.empty()
                                        : v.floats.empty() && v.strings.empty();
  if (!ok) bad("metadata '" + std::string(key) + "': array values are not in the container for element type " +
               std::string(gguf_type_name(e)));
  if (is_int_type(e))
    for (int64_t x : v.ints) check_int(key, e, x);
}

// --- serialisation --------------------------------------------------------------------------

template <class T>
void put_raw(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
void put_str(std::string& out, std::string_view s) {
  put_raw<uint64_t>(out, s.size());
  out.append(s);
}
void put_int(std::string& out, GgufType t, int64_t v) {
  switch (t) {
    case GgufType::U8: case GgufType::BOOL: put_raw<uint8_t>(out, uint8_t(v)); break;
    case GgufType::I8: put_raw<int8_t>(out, int8_t(v)); break;
    case GgufType::U16: put_raw<uint16_t>(out, uint16_t(v)); break;
    case GgufType::I16: put_raw<int16_t>(out, int16_t(v)); break;
    case GgufType::U32: put_raw<uint32_t>(out, uint32_t(v)); break;
    case GgufType::I32: put_raw<int32_t>(out, int32_t(v)); break;
    case GgufType::U64: put_raw<uint64_t>(out, uint64_t(v)); break;
    case GgufType::I64: put_raw<int64_t>(out, v); break;
    default: break;
  }
}
void put_float(std::string& out, GgufType t, double v) {
  if (t == GgufType::F32) put_raw<float>(out, float(v));
  else put_raw<double>(out, v);
}
void put_value(std::string& out, const GgufValue& v) {
  put_raw<uint32_t>(out, uint32_t(v.type));
  if (v.type == GgufType::STRING) {
    put_str(out, v.s);
  } else if (v.type == GgufType::ARRAY) {
    put_raw<uint32_t>(out, uint32_t(v.elem_type));
    put_raw<uint64_t>(out, v.array_size());
    if (v.elem_type == GgufType::STRING)
      for (const auto& s : v.strings) put_str(out, s);
    else if (is_float_type(v.elem_type))
      for (double f : v.floats) put_float(out, v.elem_type, f);
    else
      for (int64_t i : v.ints) put_int(out, v.elem_type, i);
  } else if (is_float_type(v.type)) {
    put_float(out, v.type, v.f);
  } else {
    put_int(out, v.type, v.i);
  }
}

// --- file output ----------------------------------------------------------------------------

class OutFile {
 public:
  explicit OutFile(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw std::runtime_error(path_ + ": cannot create: " + std::strerror(errno));
  }
  ~OutFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(path_.c_str());
  }
  void write(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
      ssize_t k = ::write(fd_, c, std::min<size_t>(n, size_t(1) << 30));
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) throw std::runtime_error(path_ + ": write failed: " + std::strerror(k < 0 ? errno : EIO));
      c += k;
      n -= size_t(k);
    }
  }
  void zeros(size_t n) {
    static const char z[4096] = {};
    while (n > 0) {
      size_t k = std::min(n, sizeof z);
      write(z, k);
      n -= k;
    }
  }
  // Closes and renames onto the final path.
  void commit(const std::string& final_path) {
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) throw std::runtime_error(path_ + ": close failed: " + std::strerror(errno));
    if (::rename(path_.c_str(), final_path.c_str()) != 0)
      throw std::runtime_error(final_path + ": cannot rename from " + path_ + ": " + std::strerror(errno));
    committed_ = true;
  }

 private:
  std::string path_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace

// --- metadata -------------------------------------------------------------------------------

void GgufWriter::put(std::string_view key, GgufValue v) {
  check_value(key, v);
  if (key == "general.alignment") {
    if (v.type != GgufType::U32) bad("general.alignment must be a u32 (llama.cpp rejects other types)");
    if (v.i == 0 || (v.i & (v.i - 1)) != 0) bad("general.alignment " + std::to_string(v.i) + " is not a power of two");
    // Readers map tensors in place; llama.cpp asserts 32-byte aligned data pointers.
    if (v.i < int64_t(kDefaultAlignment)) bad("general.alignment " + std::to_string(v.i) + " is below 32");
  }
  for (auto& kv : kv_)
    if (kv.key == key) {
      kv.value = std::move(v);
      return;
    }
  kv_.push_back({std::string(key), std::move(v)});
}

namespace {
GgufValue scalar_int(GgufType t, int64_t i) {
  GgufValue v;
  v.type = t;
  v.i = i;
  return v;
}
GgufValue scalar_float(GgufType t, double f) {
  GgufValue v;
  v.type = t;
  v.f = f;
  return v;
}
}  // namespace

void GgufWriter::set_u8(std::string_view k, uint8_t v) { put(k, scalar_int(GgufType::U8, v)); }
void GgufWriter::set_i8(std::string_view k, int8_t v) { put(k, scalar_int(GgufType::I8, v)); }
void GgufWriter::set_u16(std::string_view k, uint16_t v) { put(k, scalar_int(GgufType::U16, v)); }
void GgufWriter::set_i16(std::string_view k, int16_t v) { put(k, scalar_int(GgufType::I16, v)); }
void GgufWriter::set_u32(std::string_view k, uint32_t v) { put(k, scalar_int(GgufType::U32, v)); }
void GgufWriter::set_i32(std::string_view k, int32_t v) { put(k, scalar_int(GgufType::I32, v)); }
void GgufWriter::set_u64(std::string_view k, uint64_t v) { put(k, scalar_int(GgufType::U64, static_cast<int64_t>(v))); }
void GgufWriter::set_i64(std::string_view k, int64_t v) { put(k, scalar_int(GgufType::I64, v)); }
void GgufWriter::set_f32(std::string_view k, float v) { put(k, scalar_float(GgufType::F32, v)); }
void GgufWriter::set_f64(std::string_view k, double v) { put(k, scalar_float(GgufType::F64, v)); }
void GgufWriter::set_bool(std::string_view k, bool v) { put(k, scalar_int(GgufType::BOOL, v ? 1 : 0)); }
void GgufWriter::set_string(std::string_view k, std::string_view s) {
  GgufValue v;
  v.type = GgufType::STRING;
  v.s = std::string(s);
  put(k, std::move(v));
}

void GgufWriter::set_array_ints(std::string_view k, GgufType elem, std::span<const int64_t> a) {
  if (!is_int_type(elem)) bad("metadata '" + std::string(k) + "': set_array_ints needs an integer or bool element type");
  GgufValue v;
  v.type = GgufType::ARRAY;
  v.elem_type = elem;
  v.ints.assign(a.begin(), a.end());
  put(k, std::move(v));
}
void GgufWriter::set_array_floats(std::string_view k, GgufType elem, std::span<const double> a) {
  if (!is_float_type(elem)) bad("metadata '" + std::string(k) + "': set_array_floats needs F32 or F64");
  GgufValue v;
  v.type = GgufType::ARRAY;
  v.elem_type = elem;
  v.floats.assign(a.begin(), a.end());
  put(k, std::move(v));
}
void GgufWriter::set_array_i32(std::string_view k, std::span<const int32_t> a) {
  std::vector<int64_t> v(a.begin(), a.end());
  set_array_ints(k, GgufType::I32, v);
}
void GgufWriter::set_array_u32(std::string_view k, std::span<const uint32_t> a) {
  std::vector<int64_t> v(a.begin(), a.end());
  set_array_ints(k, GgufType::U32, v);
}
void GgufWriter::set_array_f32(std::string_view k, std::span<const float> a) {
  std::vector<double> v(a.begin(), a.end());
  set_array_floats(k, GgufType::F32, v);
}
void GgufWriter::set_array_strings(std::string_view k, std::span<const std::string> a) {
  GgufValue v;
  v.type = GgufType::ARRAY;
  v.elem_type = GgufType::STRING;
  v.strings.assign(a.begin(), a.end());
  put(k, std::move(v));
}

void GgufWriter::set(std::string_view key, const GgufValue& v) { put(key, v); }

const GgufValue* GgufWriter::find(std::string_view key) const {
  for (const auto& kv : kv_)
    if (kv.key == key) return &kv.value;
  return nullptr;
}

bool GgufWriter::remove(std::string_view key) {
  auto it = std::find_if(kv_.begin(), kv_.end(), [&](const GgufKV& kv) { return kv.key == key; });
  if (it == kv_.end()) return false;
  kv_.erase(it);
  return true;
}

void GgufWriter::set_alignment(uint32_t a) { set_u32("general.alignment", a); }

size_t GgufWriter::alignment() const {
  const GgufValue* v = find("general.alignment");
  return v ? static_cast<size_t>(v->i) : kDefaultAlignment;
}

// --- tensors --------------------------------------------------------------------------------

GgufWriter::Tensor& GgufWriter::new_tensor(std::string_view name, DType type, const std::vector<int64_t>& ne) {
  const std::string n(name);
  if (n.empty()) bad("empty tensor name");
  if (n.size() > kMaxName) bad("tensor name '" + n + "' is longer than 63 bytes");
  for (const auto& t : tensors_)
    if (t.name == n) bad("duplicate tensor name '" + n + "'");
  const DTypeTraits* tr = dtype_traits(static_cast<uint32_t>(type));
  if (!tr) bad("tensor '" + n + "': unsupported type " + std::to_string(uint32_t(type)));
  if (ne.empty() || ne.size() > 4) bad("tensor '" + n + "': " + std::to_string(ne.size()) + " dimensions (1 to 4 allowed)");
  Tensor t;
  t.name = n;
  t.type = type;
  t.n_dims = static_cast<uint32_t>(ne.size());
  for (int d = 0; d < 4; ++d) t.ne[d] = d < int(ne.size()) ? ne[d] : 1;
  unsigned __int128 elems = 1;
  for (int d = 0; d < 4; ++d) {
    if (t.ne[d] < 1) bad("tensor '" + n + "': dimension " + std::to_string(d) + " is " + std::to_string(t.ne[d]));
    elems *= static_cast<uint64_t>(t.ne[d]);
    if (elems > uint64_t(std::numeric_limits<int64_t>::max())) bad("tensor '" + n + "': too many elements");
  }
  if (t.ne[0] % int64_t(tr->block_elems) != 0)
    bad("tensor '" + n + "': row length " + std::to_string(t.ne[0]) + " is not a multiple of the " +
        std::string(tr->name) + " block size " + std::to_string(tr->block_elems));
  t.row_bytes = row_bytes(type, size_t(t.ne[0]));
  t.n_rows = t.ne[1] * t.ne[2] * t.ne[3];
  t.nbytes = t.row_bytes * uint64_t(t.n_rows);
  tensors_.push_back(std::move(t));
  return tensors_.back();
}

void GgufWriter::add_tensor(std::string_view name, DType type, const std::vector<int64_t>& ne,
                            std::vector<uint8_t> bytes) {
  Tensor& t = new_tensor(name, type, ne);
  if (bytes.size() != t.nbytes) {
    std::string msg = "tensor '" + t.name + "': " + std::to_string(bytes.size()) + " bytes given, " +
                      std::to_string(t.nbytes) + " expected";
    tensors_.pop_back();
    bad(msg);
  }
  t.owned = std::move(bytes);
}

void GgufWriter::add_tensor_view(std::string_view name, DType type, const std::vector<int64_t>& ne, const void* data) {
  if (!data) bad("tensor '" + std::string(name) + "': null data");
  new_tensor(name, type, ne).view = static_cast<const uint8_t*>(data);
}

void GgufWriter::add_tensor_f32(std::string_view name, DType type, const std::vector<int64_t>& ne,
                                std::vector<float> values) {
  Tensor& t = new_tensor(name, type, ne);
  const uint64_t n = uint64_t(t.ne[0]) * uint64_t(t.n_rows);
  if (values.size() != n) {
    std::string msg = "tensor '" + t.name + "': " + std::to_string(values.size()) + " values given, " +
                      std::to_string(n) + " expected";
    tensors_.pop_back();
    bad(msg);
  }
  t.f32 = std::move(values);
}

void GgufWriter::add_tensor_rows(std::string_view name, DType type, const std::vector<int64_t>& ne, RowBytesFn fn) {
  if (!fn) bad("tensor '" + std::string(name) + "': empty callback");
  new_tensor(name, type, ne).rows = std::move(fn);
}

void GgufWriter::add_tensor_rows_f32(std::string_view name, DType type, const std::vector<int64_t>& ne, RowF32Fn fn) {
  if (!fn) bad("tensor '" + std::string(name) + "': empty callback");
  new_tensor(name, type, ne).rows_f32 = std::move(fn);
}

// --- layout ---------------------------------------------------------------------------------

std::string GgufWriter::header() const {
  const uint64_t align = alignment();
  std::string out;
  put_raw<uint32_t>(out, kMagic);
  put_raw<uint32_t>(out, kVersion);
  put_raw<uint64_t>(out, tensors_.size());
  put_raw<uint64_t>(out, kv_.size());
  for (const auto& kv : kv_) {
    put_str(out, kv.key);
    put_value(out, kv.value);
  }
  uint64_t offset = 0;  // packed in info order, each tensor starting on an aligned offset
  for (const auto& t : tensors_) {
    put_str(out, t.name);
    put_raw<uint32_t>(out, t.n_dims);
    for (uint32_t d = 0; d < t.n_dims; ++d) put_raw<int64_t>(out, t.ne[d]);
    put_raw<uint32_t>(out, uint32_t(t.type));
    put_raw<uint64_t>(out, offset);
    offset += pad_to(t.nbytes, align);
  }
  out.resize(pad_to(out.size(), align), '\0');
  return out;
}

uint64_t GgufWriter::data_offset() const { return header().size(); }

uint64_t GgufWriter::file_size() const {
  uint64_t n = data_offset();
  for (const auto& t : tensors_) n += pad_to(t.nbytes, alignment());
  return n;
}

// --- writing --------------------------------------------------------------------------------

void GgufWriter::write(const std::string& path) const {
  const uint64_t align = alignment();
  const std::string hdr = header();
  OutFile out(path + ".tmp");
  out.write(hdr.data(), hdr.size());

  // Work list: byte-backed tensors go straight from their memory to the file; everything
  // else is cut into chunks that worker threads fill while this thread writes in order.
  struct Job {
    const Tensor* t;
    int64_t r0, r1;
    bool last;  // last chunk of its tensor: padding follows
  };
  std::vector<Job> jobs;
  size_t n_produced = 0;
  uint64_t max_chunk = 0;
  for (const auto& t : tensors_) {
    const bool direct = t.view || !t.owned.empty() || t.nbytes == 0;
    const int64_t step = direct ? t.n_rows : std::max<int64_t>(1, int64_t(kChunkBytes / t.row_bytes));
    for (int64_t r = 0; r < t.n_rows; r += step) {
      const int64_t r1 = std::min(t.n_rows, r + step);
      jobs.push_back({&t, r, r1, r1 == t.n_rows});
      if (!direct) {
        ++n_produced;
        max_chunk = std::max(max_chunk, uint64_t(r1 - r) * t.row_bytes);
      }
    }
  }

  auto produce = [](const Job& j, uint8_t* dst, std::vector<float>& scratch) {
    const Tensor& t = *j.t;
    const size_t ne0 = size_t(t.ne[0]);
    if (t.rows) {
      t.rows(j.r0, j.r1, dst);
      return;
    }
    for (int64_t r = j.r0; r < j.r1; ++r) {
      uint8_t* row = dst + uint64_t(r - j.r0) * t.row_bytes;
      const float* src;
      if (t.rows_f32) {
        if (t.type == DType::F32) {  // chunk buffers are 64-byte aligned, so rows are float-aligned
          t.rows_f32(r, reinterpret_cast<float*>(row));
          continue;
        }
        scratch.resize(ne0);
        t.rows_f32(r, scratch.data());
        src = scratch.data();
      } else {
        src = t.f32.data() + uint64_t(r) * ne0;
      }
      if (t.type == DType::F32) std::memcpy(row, src, ne0 * sizeof(float));
      else quantize_row(t.type, src, row, ne0);
    }
  };

  int n_threads = threads_ > 0 ? threads_ : int(std::max(1u, std::thread::hardware_concurrency()));
  n_threads = int(std::min<size_t>(size_t(n_threads), std::max<size_t>(1, n_produced)));
  const size_t n_slots = size_t(2 * n_threads);

  struct AlignedBuf {
    std::unique_ptr<uint8_t[]> mem;
    uint8_t* p = nullptr;
  };
  std::vector<AlignedBuf> slots(n_produced ? n_slots : 0);
  for (auto& s : slots) {
    s.mem.reset(new uint8_t[max_chunk + 64]);
    s.p = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(s.mem.get()) + 63) & ~uintptr_t(63));
  }

  std::mutex mu;
  std::condition_variable cv;
  size_t next = 0;      // next job a worker claims
  size_t written = 0;   // jobs already in the file
  std::vector<size_t> done(n_slots, SIZE_MAX);  // job index whose data is ready in each slot
  bool abort = false;
  std::exception_ptr err;

  auto is_direct = [&](size_t i) {
    const Tensor& t = *jobs[i].t;
    return t.view || !t.owned.empty() || t.nbytes == 0;
  };
  auto worker = [&] {
    std::vector<float> scratch;
    for (;;) {
      size_t i;
      {
        std::unique_lock lk(mu);
        for (;;) {
          while (next < jobs.size() && is_direct(next)) ++next;  // nothing to produce
          if (abort || next >= jobs.size()) return;
          if (next < written + n_slots) break;  // its slot has been written out
          cv.wait(lk);
        }
        i = next++;
      }
      try {
        produce(jobs[i], slots[i % n_slots].p, scratch);
      } catch (...) {
        std::lock_guard lk(mu);
        if (!err) err = std::current_exception();
        abort = true;
        cv.notify_all();
        return;
      }
      {
        std::lock_guard lk(mu);
        done[i % n_slots] = i;
      }
      cv.notify_all();
    }
  };

  std::vector<std::thread> workers;
  auto stop = [&] {
    {
      std::lock_guard lk(mu);
      abort = true;
    }
    cv.notify_all();
    for (auto& w : workers) w.join();
    workers.clear();
  };
  if (n_produced) {
    workers.reserve(size_t(n_threads));
    for (int k = 0; k < n_threads; ++k) workers.emplace_back(worker);
  }

  try {
    for (size_t i = 0; i < jobs.size(); ++i) {
      const Job& j = jobs[i];
      const Tensor& t = *j.t;
      const uint64_t nbytes = uint64_t(j.r1 - j.r0) * t.row_bytes;
      if (is_direct(i)) {
        const uint8_t* p = t.view ? t.view : t.owned.data();
        out.write(p + uint64_t(j.r0) * t.row_bytes, nbytes);
      } else {
        {
          std::unique_lock lk(mu);
          cv.wait(lk, [&] { return abort || done[i % n_slots] == i; });
          if (abort) break;
        }
        out.write(slots[i % n_slots].p, nbytes);
      }
      if (j.last) out.zeros(pad_to(t.nbytes, align) - t.nbytes);
      {
        std::lock_guard lk(mu);
        written = i + 1;
      }
      cv.notify_all();
    }
  } catch (...) {
    stop();
    throw;
  }
  stop();
  if (err) std::rethrow_exception(err);
  out.commit(path);
}

}  // namespace specmesh
