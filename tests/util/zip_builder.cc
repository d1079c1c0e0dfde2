#include "tests/util/zip_builder.h"

#include <zlib.h>

#include <cstdint>

#include "core/formats/zip_reader.h"

namespace weightstore::testing {
namespace {

void Put(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

}  // namespace

std::string Deflate(const std::string& plain) {
  std::string packed(compressBound(plain.size()), '\0');
  z_stream z{};
  deflateInit2(&z, 9, Z_DEFLATED, -MAX_WBITS, 8, Z_DEFAULT_STRATEGY);
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(plain.data()));
  z.avail_in = static_cast<uInt>(plain.size());
  z.next_out = reinterpret_cast<Bytef*>(packed.data());
  z.avail_out = static_cast<uInt>(packed.size());
  deflate(&z, Z_FINISH);
  packed.resize(z.total_out);
  deflateEnd(&z);
  return packed;
}

std::string BuildZip(const std::vector<ZipBuildEntry>& entries, const ZipBuildOptions& options) {
  std::string out, central;
  std::vector<uint64_t> offsets;
  for (size_t i = 0; i < entries.size(); ++i) {
    ZipBuildEntry e = entries[i];
    uint32_t crc = Crc32(e.data);
    if (static_cast<int>(i) == options.bad_crc_entry) crc ^= 0xDEADBEEF;
    uint64_t usize = options.declared_size != 0 ? options.declared_size : e.data.size();
    int method = options.method;
    if (e.deflate) {
      usize = e.data.size();
      e.data = Deflate(e.data);
      method = 8;
    }
    const uint64_t size32 = options.zip64 ? 0xFFFFFFFF : e.data.size();
    const uint64_t usize32 = options.zip64 ? 0xFFFFFFFF : usize;
    std::string extra;
    if (options.zip64) {
      Put(&extra, 0x0001, 2);
      Put(&extra, 16, 2);
      Put(&extra, usize, 8);
      Put(&extra, e.data.size(), 8);
    }
    offsets.push_back(out.size());
    Put(&out, 0x04034b50, 4);
    Put(&out, 45, 2);
    Put(&out, 0, 2);
    Put(&out, method, 2);
    Put(&out, 0, 4);  // time, date
    Put(&out, crc, 4);
    Put(&out, size32, 4);
    Put(&out, usize32, 4);
    Put(&out, e.name.size(), 2);
    Put(&out, extra.size(), 2);
    out += e.name;
    out += extra;
    out += e.data;

    uint64_t local = offsets.back();
    if (static_cast<int>(i) == options.overlap_entry && i >= 1) local = offsets[i - 1];
    std::string cextra;
    if (options.zip64) {
      Put(&cextra, 0x0001, 2);
      Put(&cextra, 24, 2);
      Put(&cextra, usize, 8);
      Put(&cextra, e.data.size(), 8);
      Put(&cextra, local, 8);
    }
    Put(&central, 0x02014b50, 4);
    Put(&central, 45, 2);
    Put(&central, 45, 2);
    Put(&central, 0, 2);
    Put(&central, method, 2);
    Put(&central, 0, 4);
    Put(&central, crc, 4);
    Put(&central, size32, 4);
    Put(&central, usize32, 4);
    Put(&central, e.name.size(), 2);
    Put(&central, cextra.size(), 2);
    Put(&central, 0, 2);  // comment
    Put(&central, 0, 2);  // disk
    Put(&central, 0, 2);  // internal attrs
    Put(&central, 0, 4);  // external attrs
    Put(&central, options.zip64 ? 0xFFFFFFFF : local, 4);
    central += e.name;
    central += cextra;
  }
  const uint64_t cd_offset = out.size();
  out += central;
  if (options.zip64) {
    const uint64_t z64 = out.size();
    Put(&out, 0x06064b50, 4);
    Put(&out, 44, 8);
    Put(&out, 45, 2);
    Put(&out, 45, 2);
    Put(&out, 0, 4);
    Put(&out, 0, 4);
    Put(&out, entries.size(), 8);
    Put(&out, entries.size(), 8);
    Put(&out, central.size(), 8);
    Put(&out, cd_offset, 8);
    Put(&out, 0x07064b50, 4);
    Put(&out, 0, 4);
    Put(&out, z64, 8);
    Put(&out, 1, 4);
  }
  Put(&out, 0x06054b50, 4);
  Put(&out, 0, 2);
  Put(&out, 0, 2);
  Put(&out, options.zip64 ? 0xFFFF : entries.size(), 2);
  Put(&out, options.zip64 ? 0xFFFF : entries.size(), 2);
  Put(&out, options.zip64 ? 0xFFFFFFFF : central.size(), 4);
  Put(&out, options.zip64 ? 0xFFFFFFFF : cd_offset, 4);
  Put(&out, 0, 2);
  return out;
}

}  // namespace weightstore::testing
