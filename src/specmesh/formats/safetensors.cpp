#include "specmesh/formats/safetensors.hpp"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace specmesh {

namespace {

using nlohmann::json;

// The reference implementation's bound on the header; larger ones are refused before parsing.
constexpr uint64_t kMaxHeader = 100'000'000;

struct DTypeName {
  std::string_view name;
  DType type;
  size_t bytes;
};
constexpr DTypeName kDTypes[] = {{"F32", DType::F32, 4}, {"F16", DType::F16, 2}, {"BF16", DType::BF16, 2}};
// Valid safetensors dtypes this reader does not load (named as such in the error).
constexpr std::string_view kOtherDTypes[] = {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64",
                                             "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3",
                                             "F6_E3M2", "C64"};

std::string in_quotes(std::string_view s) {
  std::string q(1, '\'');
  q.append(s);
  q.push_back('\'');
  return q;
}

std::string range(uint64_t b, uint64_t e) { return "[" + std::to_string(b) + ", " + std::to_string(e) + ")"; }

// A non-negative integer of the header, else a FormatError naming `what`.
uint64_t header_uint(const json& v, const std::string& path, const std::string& what) {
  if (!v.is_number_integer() || (v.is_number_integer() && !v.is_number_unsigned() && v.get<int64_t>() < 0))
    throw FormatError(path + ": " + what + " must be a non-negative integer, is " + v.dump());
  return v.get<uint64_t>();
}

}  // namespace

int64_t SafetensorsTensor::n_elements() const {
  // A zero dimension makes the product 0 whatever the others are (which need not fit together).
  for (int64_t d : shape)
    if (d == 0) return 0;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // bounded by the data buffer when the file was read
  return n;
}

std::string_view safetensors_dtype_name(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.name;
  return "unsupported";
}

SafetensorsFile::SafetensorsFile(const std::string& path) : SafetensorsFile(MappedFile(path)) {}

SafetensorsFile::SafetensorsFile(MappedFile file) : map_(std::move(file)) {
  const std::string& p = map_.path();
  if (map_.size() < 8)
    throw FormatError(p + ": truncated: " + std::to_string(map_.size()) + " bytes, shorter than the 8-byte header length");
  uint64_t n = 0;
  std::memcpy(&n, map_.data(), 8);
  if (n > kMaxHeader)
    throw FormatError(p + ": header length " + std::to_string(n) + " exceeds the limit of " + std::to_string(kMaxHeader) +
                      " bytes (not a safetensors file?)");
  if (n > map_.size() - 8)
    throw FormatError(p + ": header length " + std::to_string(n) + " runs past the end of the file (" +
                      std::to_string(map_.size()) + " bytes)");
  if (n < 2 || map_.data()[8] != '{')
    throw FormatError(p + ": header does not start with '{' (not a safetensors file?)");
  data_offset_ = 8 + size_t(n);
  const size_t buffer = map_.size() - data_offset_;

  // Top-level keys are collected as they are parsed: JSON objects keep only the last of
  // repeated keys, and a repeated tensor name is a defect, not a choice.
  std::set<std::string> seen;
  std::string duplicate;
  json header;
  try {
    header = json::parse(reinterpret_cast<const char*>(map_.data()) + 8, reinterpret_cast<const char*>(map_.data()) + 8 + n,
                         [&](int depth, json::parse_event_t event, json& parsed) {
                           if (depth == 1 && event == json::parse_event_t::key && !seen.insert(parsed.get<std::string>()).second &&
                               duplicate.empty())
                             duplicate = parsed.get<std::string>();
                           return true;
                         });
  } catch (const json::exception& e) {
    throw FormatError(p + ": header is not valid JSON: " + e.what());
  }
  if (!header.is_object()) throw FormatError(p + ": header is not a JSON object");
  if (!duplicate.empty()) throw FormatError(p + ": tensor " + in_quotes(duplicate) + " appears twice in the header");

  struct Span {
    uint64_t begin, end;
    size_t index;
  };
  std::vector<Span> spans;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      if (!info.is_object()) throw FormatError(p + ": __metadata__ is not an object of strings");
      for (const auto& [k, v] : info.items()) {
        if (!v.is_string()) throw FormatError(p + ": __metadata__ " + in_quotes(k) + " is not a string");
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string what = "tensor " + in_quotes(name);
    if (!info.is_object()) throw FormatError(p + ": " + what + " is not an object");
    for (const char* field : {"dtype", "shape", "data_offsets"})
      if (!info.contains(field)) throw FormatError(p + ": " + what + " has no \"" + field + "\"");

    SafetensorsTensor t;
    t.name = name;
    const json& dtype = info["dtype"];
    if (!dtype.is_string()) throw FormatError(p + ": " + what + ": dtype is not a string");
    const std::string dname = dtype.get<std::string>();
    const DTypeName* dt = nullptr;
    for (const auto& d : kDTypes)
      if (d.name == dname) dt = &d;
    if (!dt) {
      const bool known = std::find(std::begin(kOtherDTypes), std::end(kOtherDTypes), dname) != std::end(kOtherDTypes);
      throw FormatError(p + ": " + what + " has " + (known ? "unsupported" : "unknown") + " dtype " + in_quotes(dname) +
                        " (F32, F16 and BF16 are read)");
    }
    t.type = dt->type;

    const json& offs = info["data_offsets"];
    if (!offs.is_array() || offs.size() != 2) throw FormatError(p + ": " + what + ": data_offsets is not a pair [begin, end]");
    const uint64_t b = header_uint(offs[0], p, what + " data_offsets[0]");
    const uint64_t e = header_uint(offs[1], p, what + " data_offsets[1]");
    if (e < b) throw FormatError(p + ": " + what + ": data_offsets " + range(b, e) + " end before they begin");
    if (e > buffer)
      throw FormatError(p + ": " + what + " data (bytes " + range(b, e) + ") lies outside the data buffer (" +
                        std::to_string(buffer) + " bytes)");

    const json& shape = info["shape"];
    if (!shape.is_array()) throw FormatError(p + ": " + what + ": shape is not an array");
    // The product stops growing once it passes the tensor's bytes, so it never overflows.
    unsigned __int128 nbytes = dt->bytes;
    bool zero = false, capped = false;
    for (const json& d : shape) {
      const uint64_t v = header_uint(d, p, what + " shape dimension");
      if (v == 0) zero = true;
      t.shape.push_back(int64_t(std::min<uint64_t>(v, uint64_t(std::numeric_limits<int64_t>::max()))));
      if (nbytes <= e - b) nbytes *= v;
      else capped |= v > 1;
    }
    if (zero) nbytes = 0;
    if (nbytes != e - b)
      throw FormatError(p + ": " + what + " holds " + std::to_string(e - b) + " bytes but its " + dname + " shape " +
                        shape.dump() + " needs " +
                        (capped || nbytes > std::numeric_limits<uint64_t>::max()
                             ? "more than the data buffer (" + std::to_string(buffer) + " bytes)"
                             : std::to_string(uint64_t(nbytes))));
    t.data = map_.data() + data_offset_ + b;
    t.nbytes = size_t(nbytes);  // == e - b
    spans.push_back({b, e, tensors_.size()});
    tensors_.push_back(std::move(t));
  }

  // The tensors tile the buffer: sorted by offset, each starts where the previous one ends.
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  uint64_t at = 0;
  const SafetensorsTensor* prev = nullptr;
  for (const Span& s : spans) {
    const SafetensorsTensor& t = tensors_[s.index];
    if (s.begin < at)
      throw FormatError(p + ": tensor " + in_quotes(t.name) + " (bytes " + range(s.begin, s.end) + ") overlaps tensor " +
                        in_quotes(prev->name) + " (ending at byte " + std::to_string(at) + ")");
    if (s.begin > at)
      throw FormatError(p + ": bytes " + range(at, s.begin) + " of the data buffer belong to no tensor (before " +
                        in_quotes(t.name) + ")");
    at = s.end;
    prev = &t;
  }
  if (at != buffer)
    throw FormatError(p + ": bytes " + range(at, buffer) + " at the end of the data buffer belong to no tensor");
  std::vector<SafetensorsTensor> sorted;
  sorted.reserve(spans.size());
  for (const Span& s : spans) sorted.push_back(std::move(tensors_[s.index]));
  tensors_ = std::move(sorted);
}

const SafetensorsTensor* SafetensorsFile::tensor(std::string_view name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

std::vector<uint8_t> safetensors_bytes(const std::vector<SafetensorsEntry>& entries,
                                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<uint8_t> data;
  for (const SafetensorsEntry& e : entries) {
    if (header.contains(e.name)) throw std::invalid_argument("safetensors: tensor '" + e.name + "' given twice");
    int64_t n = 1;
    for (int64_t d : e.shape) n *= d;
    if (n != int64_t(e.values.size()))
      throw std::invalid_argument("safetensors: tensor '" + e.name + "' has " + std::to_string(e.values.size()) +
                                  " values for " + std::to_string(n) + " elements");
    const size_t begin = data.size();
    for (float v : e.values) {
      switch (e.type) {
        case DType::F32: {
          const uint32_t b = fp32_to_bits(v);
          for (int k = 0; k < 4; ++k) data.push_back(uint8_t(b >> (8 * k)));
          break;
        }
        case DType::F16:
        case DType::BF16: {
          const uint16_t h = e.type == DType::F16 ? fp32_to_fp16(v) : fp32_to_bf16(v);
          data.push_back(uint8_t(h));
          data.push_back(uint8_t(h >> 8));
          break;
        }
        default:
          throw std::invalid_argument("safetensors: tensor '" + e.name + "': only F32, F16 and BF16 are written");
      }
    }
    header[e.name] = {{"dtype", safetensors_dtype_name(e.type)}, {"shape", e.shape}, {"data_offsets", {begin, data.size()}}};
  }
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');  // keeps the data 8-byte aligned, as writers do
  std::vector<uint8_t> out;
  out.reserve(8 + text.size() + data.size());
  for (int k = 0; k < 8; ++k) out.push_back(uint8_t(uint64_t(text.size()) >> (8 * k)));  // little-endian length
  out.insert(out.end(), text.begin(), text.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata) {
  const std::vector<uint8_t> bytes = safetensors_bytes(entries, metadata);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size())) || !f.flush())
    throw FormatError(path + ": cannot write");
}

}  // namespace specmesh
