#include "core/formats/zip_reader.h"

#include <zlib.h>

#include <algorithm>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/formats/byte_reader.h"

namespace weightstore {
namespace {

constexpr uint32_t kLocalHeaderSig = 0x04034b50;
constexpr uint32_t kCentralHeaderSig = 0x02014b50;
constexpr uint32_t kEocdSig = 0x06054b50;
constexpr uint32_t kZip64EocdSig = 0x06064b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr size_t kEocdSize = 22;
constexpr size_t kZip64LocatorSize = 20;
constexpr size_t kZip64EocdSize = 56;
constexpr size_t kCentralHeaderSize = 46;
constexpr size_t kLocalHeaderSize = 30;
constexpr uint64_t kMaxDeflateRatio = 1032;

class Faults {
 public:
  explicit Faults(absl::string_view path) : path_(path) {}
  absl::Status Bad(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("'", path_, "' is not a valid zip archive: ", what));
  }

 private:
  absl::string_view path_;
};

absl::Status CheckName(absl::string_view name, const Faults& faults) {
  if (name.empty()) return faults.Bad("an entry has an empty name");
  if (name.find('\0') != absl::string_view::npos || name.find('\\') != absl::string_view::npos) {
    return faults.Bad(absl::StrCat("entry name '", absl::CHexEscape(name), "' contains a NUL or a backslash"));
  }
  if (name.front() == '/') return faults.Bad(absl::StrCat("entry name '", name, "' is absolute"));
  for (absl::string_view part : absl::StrSplit(name, '/')) {
    if (part == "..") {
      return faults.Bad(absl::StrCat("entry name '", name, "' escapes the archive with '..'"));
    }
  }
  return absl::OkStatus();
}

// Reads the ZIP64 extended-information extra field: each value is present only
// when its 32-bit counterpart in the fixed header is 0xFFFFFFFF.
absl::Status ApplyZip64Extra(absl::string_view extra, bool need_usize, bool need_csize, bool need_offset,
                             uint64_t* usize, uint64_t* csize, uint64_t* offset, absl::string_view name,
                             const Faults& faults) {
  ByteReader reader(extra);
  while (reader.remaining() >= 4) {
    uint16_t id = 0, size = 0;
    reader.ReadU16(&id);
    reader.ReadU16(&size);
    absl::string_view body;
    if (!reader.ReadBytes(size, &body)) {
      return faults.Bad(absl::StrCat("extra field of '", name, "' overruns its header"));
    }
    if (id != 0x0001) continue;
    ByteReader field(body);
    if ((need_usize && !field.ReadU64(usize)) || (need_csize && !field.ReadU64(csize)) ||
        (need_offset && !field.ReadU64(offset))) {
      return faults.Bad(absl::StrCat("ZIP64 extra field of '", name, "' is too short"));
    }
    return absl::OkStatus();
  }
  if (need_usize || need_csize || need_offset) {
    return faults.Bad(absl::StrCat("'", name, "' needs a ZIP64 extra field and has none"));
  }
  return absl::OkStatus();
}

}  // namespace

uint32_t Crc32(absl::string_view data) {
  uLong crc = crc32(0L, Z_NULL, 0);
  while (!data.empty()) {
    uInt chunk = static_cast<uInt>(std::min<size_t>(data.size(), 1u << 30));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(data.data()), chunk);
    data.remove_prefix(chunk);
  }
  return static_cast<uint32_t>(crc);
}

absl::StatusOr<ZipArchive> ZipArchive::Open(SharedBytes archive, absl::string_view path, const ZipLimits& limits) {
  Faults faults(path);
  absl::string_view data = archive.view();
  const uint64_t file_size = data.size();
  if (file_size < kEocdSize) return faults.Bad("too short for an end-of-central-directory record");

  // The end-of-central-directory record is the last 22 bytes plus a comment of up
  // to 65535 bytes; take the last signature whose comment ends exactly at EOF.
  int64_t eocd = -1;
  const int64_t lowest = std::max<int64_t>(0, static_cast<int64_t>(file_size - kEocdSize) - 65535);
  for (int64_t pos = static_cast<int64_t>(file_size - kEocdSize); pos >= lowest; --pos) {
    if (LoadU32(data.data() + pos) == kEocdSig && pos + kEocdSize + LoadU16(data.data() + pos + 20) == file_size) {
      eocd = pos;
      break;
    }
  }
  if (eocd < 0) return faults.Bad("no end-of-central-directory record");

  const char* e = data.data() + eocd;
  uint64_t disk = LoadU16(e + 4), cd_disk = LoadU16(e + 6);
  uint64_t entries_on_disk = LoadU16(e + 8), total_entries = LoadU16(e + 10);
  uint64_t cd_size = LoadU32(e + 12), cd_offset = LoadU32(e + 16);
  uint64_t cd_limit = static_cast<uint64_t>(eocd);  // where the directory must end

  bool zip64 = eocd >= static_cast<int64_t>(kZip64LocatorSize) && LoadU32(e - kZip64LocatorSize) == kZip64LocatorSig;
  if (zip64) {
    const char* loc = e - kZip64LocatorSize;
    uint64_t z64_offset = LoadU64(loc + 8);
    if (LoadU32(loc + 4) != 0 || LoadU32(loc + 16) > 1) return faults.Bad("multi-volume archive");
    if (z64_offset > static_cast<uint64_t>(eocd) - kZip64LocatorSize ||
        static_cast<uint64_t>(eocd) - kZip64LocatorSize - z64_offset < kZip64EocdSize) {
      return faults.Bad("ZIP64 end-of-central-directory offset out of range");
    }
    const char* z = data.data() + z64_offset;
    if (LoadU32(z) != kZip64EocdSig) return faults.Bad("bad ZIP64 end-of-central-directory signature");
    disk = LoadU32(z + 16);
    cd_disk = LoadU32(z + 20);
    entries_on_disk = LoadU64(z + 24);
    total_entries = LoadU64(z + 32);
    cd_size = LoadU64(z + 40);
    cd_offset = LoadU64(z + 48);
    cd_limit = z64_offset;
  } else if (cd_size == 0xFFFFFFFF || cd_offset == 0xFFFFFFFF || total_entries == 0xFFFF) {
    return faults.Bad("ZIP64 sizes without a ZIP64 locator");
  }
  if (disk != 0 || cd_disk != 0 || entries_on_disk != total_entries) {
    return faults.Bad("multi-volume archive");
  }
  if (total_entries > limits.max_entries) {
    return faults.Bad(absl::StrCat(total_entries, " entries exceed the limit of ", limits.max_entries));
  }
  if (cd_offset > cd_limit || cd_limit - cd_offset != cd_size) {
    return faults.Bad("central directory does not end at the end-of-central-directory record");
  }
  if (total_entries > cd_size / kCentralHeaderSize) {
    return faults.Bad("central directory is too small for its entry count");
  }

  ZipArchive zip;
  zip.archive_ = std::move(archive);
  zip.path_ = std::string(path);
  zip.limits_ = limits;
  zip.entries_.reserve(total_entries);
  struct Span {
    uint64_t begin, end;
    size_t entry;
  };
  std::vector<Span> spans;
  spans.reserve(total_entries);

  ByteReader cd(data.substr(cd_offset, cd_size));
  for (uint64_t i = 0; i < total_entries; ++i) {
    absl::string_view fixed;
    if (!cd.ReadBytes(kCentralHeaderSize, &fixed) || LoadU32(fixed.data()) != kCentralHeaderSig) {
      return faults.Bad(absl::StrCat("central directory entry ", i, " is malformed"));
    }
    const char* h = fixed.data();
    uint16_t flags = LoadU16(h + 8);
    ZipEntry entry;
    entry.method = LoadU16(h + 10);
    entry.crc32 = LoadU32(h + 16);
    entry.compressed_size = LoadU32(h + 20);
    entry.uncompressed_size = LoadU32(h + 24);
    uint16_t name_len = LoadU16(h + 28), extra_len = LoadU16(h + 30), comment_len = LoadU16(h + 32);
    uint64_t local_offset = LoadU32(h + 42);
    absl::string_view name, extra, comment;
    if (!cd.ReadBytes(name_len, &name) || !cd.ReadBytes(extra_len, &extra) || !cd.ReadBytes(comment_len, &comment)) {
      return faults.Bad(absl::StrCat("central directory entry ", i, " overruns the directory"));
    }
    entry.name = std::string(name);
    absl::Status status = CheckName(entry.name, faults);
    if (!status.ok()) return status;
    status = ApplyZip64Extra(extra, entry.uncompressed_size == 0xFFFFFFFF, entry.compressed_size == 0xFFFFFFFF,
                             local_offset == 0xFFFFFFFF, &entry.uncompressed_size, &entry.compressed_size,
                             &local_offset, entry.name, faults);
    if (!status.ok()) return status;
    if (flags & 0x1) return faults.Bad(absl::StrCat("'", entry.name, "' is encrypted"));
    if (entry.method != 0 && entry.method != 8) {
      return faults.Bad(absl::StrCat("'", entry.name, "' uses compression method ", entry.method,
                                     " (only stored and deflate are supported)"));
    }
    if (entry.method == 0 && entry.compressed_size != entry.uncompressed_size) {
      return faults.Bad(absl::StrCat("stored entry '", entry.name, "' has different sizes"));
    }

    // The local header gives the data offset; its name and method must agree.
    if (local_offset > cd_offset || cd_offset - local_offset < kLocalHeaderSize) {
      return faults.Bad(absl::StrCat("local header of '", entry.name, "' is out of range"));
    }
    const char* l = data.data() + local_offset;
    if (LoadU32(l) != kLocalHeaderSig) {
      return faults.Bad(absl::StrCat("bad local header signature for '", entry.name, "'"));
    }
    uint64_t local_name_len = LoadU16(l + 26), local_extra_len = LoadU16(l + 28);
    if (LoadU16(l + 8) != entry.method) {
      return faults.Bad(absl::StrCat("local and central headers of '", entry.name, "' disagree on the method"));
    }
    uint64_t header_end = local_offset + kLocalHeaderSize + local_name_len + local_extra_len;
    if (header_end > cd_offset || data.substr(local_offset + kLocalHeaderSize, local_name_len) != entry.name) {
      return faults.Bad(absl::StrCat("local and central headers of '", entry.name, "' disagree on the name"));
    }
    entry.data_offset = header_end;
    if (entry.compressed_size > cd_offset - header_end) {
      return faults.Bad(absl::StrCat("data of '", entry.name, "' runs past the central directory"));
    }
    uint64_t span_end = header_end + entry.compressed_size;
    if (flags & 0x8) {
      // A data descriptor follows: CRC and two sizes, optionally signed. Count its
      // unsigned length without reading it, so opening touches no page past each
      // local header.
      const uint64_t len = (entry.compressed_size >= 0xFFFFFFFF || entry.uncompressed_size >= 0xFFFFFFFF) ? 20 : 12;
      if (len > cd_offset - span_end) {
        return faults.Bad(absl::StrCat("data descriptor of '", entry.name, "' is out of range"));
      }
      span_end += len;
    }
    if (zip.by_name_.contains(entry.name)) {
      return faults.Bad(absl::StrCat("duplicate entry name '", entry.name, "'"));
    }
    zip.by_name_.emplace(entry.name, zip.entries_.size());
    spans.push_back({local_offset, span_end, zip.entries_.size()});
    zip.entries_.push_back(std::move(entry));
  }
  if (!cd.at_end()) return faults.Bad("trailing bytes in the central directory");

  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].begin < spans[i - 1].end) {
      return faults.Bad(absl::StrCat("entries '", zip.entries_[spans[i - 1].entry].name, "' and '",
                                     zip.entries_[spans[i].entry].name, "' overlap"));
    }
  }
  return zip;
}

const ZipEntry* ZipArchive::Find(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

absl::StatusOr<SharedBytes> ZipArchive::Read(const ZipEntry& entry, bool verify_crc) const {
  SharedBytes raw = archive_.Subspan(entry.data_offset, entry.compressed_size);
  if (entry.method == 0) {
    if (verify_crc && Crc32(raw.view()) != entry.crc32) {
      return absl::DataLossError(absl::StrCat("CRC-32 mismatch in '", entry.name, "' of '", path_, "'"));
    }
    return raw;
  }
  if (entry.uncompressed_size > limits_.max_inflated_size) {
    return absl::ResourceExhaustedError(absl::StrCat("'", entry.name, "' of '", path_, "' inflates to ",
                                                     entry.uncompressed_size, " bytes, over the limit"));
  }
  // Deflate expands at most 1032:1; a larger claim is a bomb, refused before
  // any memory is spent on it.
  if (entry.uncompressed_size / kMaxDeflateRatio > entry.compressed_size + 1) {
    return absl::DataLossError(absl::StrCat("'", entry.name, "' of '", path_, "' claims ", entry.uncompressed_size,
                                            " bytes from ", entry.compressed_size,
                                            " compressed ones, more than deflate can expand"));
  }
  // The output grows as data really inflates, so memory follows the bytes
  // produced, not the size the header declares.
  std::vector<std::byte> out(
      std::min<uint64_t>(entry.uncompressed_size, std::max<uint64_t>(64 << 10, entry.compressed_size * 4)));
  z_stream stream{};
  if (inflateInit2(&stream, -MAX_WBITS) != Z_OK) return absl::InternalError("inflateInit2 failed");
  const uint64_t kStep = std::numeric_limits<uInt>::max();
  uint64_t in_done = 0, out_done = 0;
  int rc = Z_OK;
  while (rc == Z_OK) {
    if (out_done == out.size() && out.size() < entry.uncompressed_size) {
      out.resize(std::min<uint64_t>(entry.uncompressed_size, out.size() * 2));
    }
    uint64_t in_left = entry.compressed_size - in_done, out_left = out.size() - out_done;
    stream.next_in = reinterpret_cast<Bytef*>(const_cast<std::byte*>(raw.data() + in_done));
    stream.avail_in = static_cast<uInt>(std::min(in_left, kStep));
    stream.next_out = reinterpret_cast<Bytef*>(out.data() + out_done);
    stream.avail_out = static_cast<uInt>(std::min(out_left, kStep));
    uInt in_before = stream.avail_in, out_before = stream.avail_out;
    rc = inflate(&stream, Z_NO_FLUSH);
    in_done += in_before - stream.avail_in;
    out_done += out_before - stream.avail_out;
    if (rc == Z_BUF_ERROR) {
      // No progress was possible: input exhausted, output full, or a stuck stream.
      if (in_before == stream.avail_in && out_before == stream.avail_out) break;
      rc = Z_OK;
    }
  }
  inflateEnd(&stream);
  if (rc != Z_STREAM_END || out_done != entry.uncompressed_size) {
    return absl::DataLossError(absl::StrCat("deflate data of '", entry.name, "' in '", path_,
                                            "' is corrupt or does not match its declared size"));
  }
  SharedBytes inflated = SharedBytes::FromVector(std::move(out));
  if (Crc32(inflated.view()) != entry.crc32) {
    return absl::DataLossError(absl::StrCat("CRC-32 mismatch in '", entry.name, "' of '", path_, "'"));
  }
  return inflated;
}

}  // namespace weightstore
