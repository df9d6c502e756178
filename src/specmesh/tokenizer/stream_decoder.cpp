// Incremental detokenisation that only ever hands out whole UTF-8 characters.
#include "specmesh/tokenizer/tokenizer.hpp"

namespace specmesh {

namespace {

const char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

// Length of the well-formed UTF-8 sequence at s[i] (Unicode Table 3-7), 0 when the bytes seen
// so far are a valid but unfinished prefix, -1 when s[i..] can never become valid (then
// `bad` is the length of the maximal invalid subpart, replaced by one U+FFFD).
int sequence_at(const std::string& s, size_t i, size_t& bad) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[i + k]); };
  const size_t avail = s.size() - i;
  const uint8_t c = b(0);
  if (c < 0x80) return 1;
  int need;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) need = 2;
  else if (c == 0xE0) need = 3, lo = 0xA0;
  else if (c == 0xED) need = 3, hi = 0x9F;
  else if (c >= 0xE1 && c <= 0xEF) need = 3;
  else if (c == 0xF0) need = 4, lo = 0x90;
  else if (c == 0xF4) need = 4, hi = 0x8F;
  else if (c >= 0xF1 && c <= 0xF3) need = 4;
  else {
    bad = 1;
    return -1;
  }
  for (int k = 1; k < need; ++k) {
    if (size_t(k) >= avail) return 0;
    const uint8_t x = b(k);
    const bool ok = k == 1 ? (x >= lo && x <= hi) : (x >= 0x80 && x <= 0xBF);
    if (!ok) {
      bad = size_t(k);
      return -1;
    }
  }
  return need;
}

// Moves every complete character (and every invalid byte run, as U+FFFD) from `pending` to
// the result; an unfinished character stays in `pending` unless `final`.
std::string take_complete(std::string& pending, bool final) {
  std::string out;
  size_t i = 0;
  while (i < pending.size()) {
    size_t bad = 0;
    const int n = sequence_at(pending, i, bad);
    if (n > 0) {
      out.append(pending, i, size_t(n));
      i += size_t(n);
    } else if (n < 0) {
      out += kReplacement;
      i += bad;
    } else if (final) {
      out += kReplacement;
      i = pending.size();
    } else {
      break;
    }
  }
  pending.erase(0, i);
  return out;
}

}  // namespace

std::string StreamDecoder::feed(int32_t id) {
  std::string p = tok_.piece(id);
  const Vocab& v = tok_.vocab();
  // run.c: the piece after BOS (and the first piece of the stream) loses the space that
  // SentencePiece's space prefix put there.
  if (v.kind == VocabKind::Spm && v.add_space_prefix) {
    if (id == v.bos) {
      first_ = true;
      return take_complete(pending_, false);
    }
    if (!p.empty()) {
      if (first_ && p[0] == ' ') p.erase(0, 1);
      first_ = false;
    }
  }
  pending_ += p;
  return take_complete(pending_, false);
}

std::string StreamDecoder::flush() { return take_complete(pending_, true); }

}  // namespace specmesh
