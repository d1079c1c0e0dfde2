// ByteReader: a bounds-checked little-endian cursor over untrusted bytes.
// Thread-compatible. Borrows its input: the bytes must outlive the reader.
#ifndef WEIGHTSTORE_CORE_FORMATS_BYTE_READER_H_
#define WEIGHTSTORE_CORE_FORMATS_BYTE_READER_H_

#include <cstdint>
#include <cstring>

#include "absl/strings/string_view.h"

namespace weightstore {

class ByteReader {
 public:
  explicit ByteReader(absl::string_view data) : data_(data) {}

  size_t position() const { return pos_; }
  size_t remaining() const { return data_.size() - pos_; }
  bool at_end() const { return pos_ == data_.size(); }

  // Each Read* returns false (and leaves the cursor unchanged) if too few bytes remain.
  bool ReadU8(uint8_t* out) { return ReadLE(out); }
  bool ReadU16(uint16_t* out) { return ReadLE(out); }
  bool ReadU32(uint32_t* out) { return ReadLE(out); }
  bool ReadU64(uint64_t* out) { return ReadLE(out); }
  bool ReadI32(int32_t* out) { return ReadLE(out); }
  bool ReadI64(int64_t* out) { return ReadLE(out); }
  bool ReadBytes(size_t n, absl::string_view* out) {
    if (n > remaining()) return false;
    *out = data_.substr(pos_, n);
    pos_ += n;
    return true;
  }
  bool Skip(size_t n) {
    if (n > remaining()) return false;
    pos_ += n;
    return true;
  }

 private:
  template <typename T>
  bool ReadLE(T* out) {
    if (sizeof(T) > remaining()) return false;
    T value = 0;
    for (size_t i = 0; i < sizeof(T); ++i) {
      value |= static_cast<T>(static_cast<uint8_t>(data_[pos_ + i])) << (8 * i);
    }
    *out = value;
    pos_ += sizeof(T);
    return true;
  }

  absl::string_view data_;
  size_t pos_ = 0;
};

// Little-endian loads from a position known to be in bounds.
inline uint16_t LoadU16(const char* p) {
  return static_cast<uint16_t>(static_cast<uint8_t>(p[0]) | static_cast<uint8_t>(p[1]) << 8);
}
inline uint32_t LoadU32(const char* p) {
  return static_cast<uint32_t>(LoadU16(p)) | static_cast<uint32_t>(LoadU16(p + 2)) << 16;
}
inline uint64_t LoadU64(const char* p) {
  return static_cast<uint64_t>(LoadU32(p)) | static_cast<uint64_t>(LoadU32(p + 4)) << 32;
}

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_FORMATS_BYTE_READER_H_
