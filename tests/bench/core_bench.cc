// core_bench: inspect, convert and read throughput of weightstore's core, with
// baselines measured in the same run (dd conv=fsync, torch.load).
//
// Usage: core_bench [--dir DIR] [--large-gb N] [--selection-only] [--cast-only] [--rewrite-only]
// Writes its checkpoints under DIR (default: a folder in /tmp), removed at exit.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/checkpoint.h"
#include "core/formats/burnpack.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "core/select/dtype_cast.h"
#include "core/select/selection.h"
#include "core/select/snapshot.h"

namespace weightstore {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(const std::function<void()>& fn) {
  auto start = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double MedianOf(int repeats, const std::function<void()>& fn) {
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) t.push_back(Seconds(fn));
  return Median(t);
}

void Check(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "core_bench: %s: %s\n", what, std::string(status.message()).c_str());
    std::exit(1);
  }
}

std::string Run(const std::string& command) {
  FILE* pipe = ::popen(command.c_str(), "r");
  std::string out;
  char buf[256];
  while (pipe && std::fgets(buf, sizeof buf, pipe)) out += buf;
  if (pipe == nullptr || ::pclose(pipe) != 0) {
    std::fprintf(stderr, "core_bench: command failed: %s\n", command.c_str());
    std::exit(1);
  }
  return out;
}

// Every checkpoint has kTensors F32 tensors, so inspect cost compares across sizes.
constexpr uint64_t kTensors = 64;

// Writes a SafeTensors file of `megabytes` in kTensors equal F32 tensors.
void WriteSafeTensors(const std::string& path, uint64_t megabytes) {
  const uint64_t tensor_bytes = (megabytes << 20) / kTensors;
  const uint64_t count = kTensors;
  std::vector<std::byte> block(tensor_bytes);
  std::mt19937 rng(1);
  for (auto& b : block) b = static_cast<std::byte>(rng());
  SharedBytes bytes = SharedBytes::FromVector(std::move(block));
  auto writer = CheckpointWriter::Create(path, kSafeTensorsFormat, {.overwrite = true});
  Check(writer.status(), "create writer");
  for (uint64_t i = 0; i < count; ++i) {
    TensorSpec spec{absl::StrCat("layers.", i, ".weight"), DType::kF32, {tensor_bytes / 4}};
    Check((*writer)->Add(spec, [bytes] { return absl::StatusOr<SharedBytes>(bytes); }), "add");
  }
  Check((*writer)->Finish(), "write safetensors");
}

double InspectSeconds(const std::string& path) {
  return MedianOf(9, [&] {
    auto c = Checkpoint::Open(path);
    Check(c.status(), "open");
  });
}

// Every tensor copied into memory the caller owns (ReadCopy: huge-page buffers).
double ReadAllCopySeconds(const std::string& path) {
  return MedianOf(3, [&] {
    auto c = Checkpoint::Open(path);
    Check(c.status(), "open");
    std::vector<SharedTensor> owned;
    for (const CheckpointEntry& e : (*c)->entries()) {
      auto t = (*c)->ReadCopy(e);
      Check(t.status(), "read");
      owned.push_back(*std::move(t));
    }
  });
}

// Every tensor as a zero-copy view, with every page touched so the bytes are
// really in memory, not just mapped.
double ReadAllViewSeconds(const std::string& path) {
  return MedianOf(3, [&] {
    auto c = Checkpoint::Open(path);
    Check(c.status(), "open");
    volatile uint8_t sink = 0;
    for (const CheckpointEntry& e : (*c)->entries()) {
      auto t = (*c)->Read(e);
      Check(t.status(), "read");
      for (size_t i = 0; i < t->bytes.size(); i += 4096) sink = sink + static_cast<uint8_t>(t->bytes.data()[i]);
    }
  });
}

double ConvertSeconds(const std::string& in, const std::string& out, const FormatSpec& format) {
  return MedianOf(3, [&] {
    auto c = Checkpoint::Open(in);
    Check(c.status(), "open");
    Check(WriteCheckpoint(**c, out, format, (*c)->metadata(), {.overwrite = true}), "convert");
  });
}

double DdSeconds(const std::string& in, const std::string& out) {
  std::string cmd = absl::StrCat("dd if='", in, "' of='", out, "' bs=8M conv=fsync status=none");
  return MedianOf(3, [&] { Run(cmd); });
}

// 10 include patterns and 5 rename rules over 100,000 tensor names.
void SelectionBench() {
  auto storage = LazyStorage::Ready(SharedBytes());
  std::vector<CheckpointEntry> entries;
  const char* parts[] = {"attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.up",
                         "mlp.down",    "mlp.gate",    "input_norm",  "post_norm",   "rotary"};
  for (int i = 0; entries.size() < 100000; ++i) {
    for (const char* p : parts) {
      CheckpointEntry e;
      e.spec = {absl::StrCat("model.layers.", i, ".", p, ".weight"), DType::kF32, {0}};
      e.layout.storage = storage;
      entries.push_back(std::move(e));
    }
  }
  auto checkpoint = Checkpoint::Create(kSafeTensorsFormat, "synthetic", {}, std::move(entries));
  Check(checkpoint.status(), "synthetic checkpoint");
  SelectionOptions options;
  for (int i = 0; i < 10; ++i) options.include.push_back(absl::StrCat(R"(^layers\.)", i, R"(\d*\.(attn|mlp)\.)"));
  options.renames = {{R"(^model\.)", ""},
                     {R"(\.q_proj\.)", ".query."},
                     {R"(\.k_proj\.)", ".key."},
                     {R"(\.v_proj\.)", ".value."},
                     {R"(^layers\.(\d+)\.)", "layers.$1."}};
  auto selection = Selection::Compile(options);
  Check(selection.status(), "compile");
  size_t kept = 0;
  double seconds = MedianOf(5, [&] {
    auto snapshot = Snapshot::Select(*checkpoint, **selection);
    Check(snapshot.status(), "select");
    kept = (*snapshot)->size();
  });
  std::printf("\n%-44s %9s %10s\n", "selection (10 includes, 5 renames)", "ms", "names/s");
  std::printf("  %-42s %9.1f %10.2fM   (%zu of 100,000 kept; target < 100 ms)\n", "100,000 names", seconds * 1e3,
              1e5 / seconds / 1e6, kept);
}

uint64_t FileSize(const std::string& path) { return std::filesystem::file_size(path); }

double GBps(uint64_t bytes, double seconds) { return static_cast<double>(bytes) / seconds / 1e9; }

// The transpose `--adapter pytorch-to-burn` serves for a Linear weight: a
// [11008, 4096] matrix (LLaMA-7B's MLP), against memcpy of the same bytes in
// the same run, in GB/s of output.
void TransposeBench() {
  constexpr size_t kRows = 11008, kCols = 4096, kCount = kRows * kCols;
  std::vector<float> f32(kCount);
  for (size_t i = 0; i < kCount; ++i) f32[i] = static_cast<float>(i % 9973) * 0.37f - 1000.0f;
  std::vector<uint16_t> bf16(kCount), out16(kCount);
  std::vector<float> out32(kCount);
  CastElements(DType::kF32, reinterpret_cast<const std::byte*>(f32.data()), DType::kBF16,
               reinterpret_cast<std::byte*>(bf16.data()), kCount);
  std::printf("\n%-36s %12s %14s %8s\n", "transpose [11008, 4096]", "GB/s out", "memcpy GB/s", "ratio");
  struct Case {
    const char* name;
    DType from, to;
    const void* src;
    void* dst;
  };
  for (const Case& c : {Case{"BF16", DType::kBF16, DType::kBF16, bf16.data(), out16.data()},
                        Case{"F32", DType::kF32, DType::kF32, f32.data(), out32.data()},
                        Case{"F32 -> BF16", DType::kF32, DType::kBF16, f32.data(), out16.data()},
                        Case{"BF16 -> F32", DType::kBF16, DType::kF32, bf16.data(), out32.data()}}) {
    const size_t out_bytes = kCount * DTypeSize(c.to);
    const auto* src = static_cast<const std::byte*>(c.src);
    auto* dst = static_cast<std::byte*>(c.dst);
    const double copy = MedianOf(3, [&] { std::memcpy(dst, src, out_bytes); });
    const double t = MedianOf(3, [&] { TransposeCast(c.from, src, c.to, dst, kRows, kCols); });
    std::printf("  %-34s %12.2f %14.2f %7.2fx\n", c.name, GBps(out_bytes, t), GBps(out_bytes, copy), copy / t);
  }
}

// Decoding the narrow floats of quantized checkpoints (issue 27): F8_E4M3
// weights to BF16, F8_E8M0 (MX) scales to F32, packed F4 to BF16, 64 MiB out
// each from random codes, against a memcpy of the same 64 MiB of output in
// the same run (the target: at least half its speed).
void NarrowCastBench() {
  constexpr size_t kOutBytes = 64 << 20;
  std::vector<std::byte> src(kOutBytes), dst(kOutBytes), copy_src(kOutBytes);
  uint64_t x = 88172645463325252ull;
  for (std::byte& b : src) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;  // xorshift: every code, no pattern
    b = static_cast<std::byte>(x);
  }
  std::printf("\n%-36s %12s %14s %8s\n", "decode (64 MiB out)", "GB/s out", "memcpy GB/s", "ratio");
  const double copy = MedianOf(5, [&] { std::memcpy(dst.data(), copy_src.data(), kOutBytes); });
  for (auto [from, to] : {std::pair{DType::kF8E4M3, DType::kBF16}, std::pair{DType::kF8E8M0, DType::kF32},
                          std::pair{DType::kF4, DType::kBF16}}) {
    const size_t count = kOutBytes / DTypeSize(to);
    const double t = MedianOf(5, [&] { CastElements(from, src.data(), to, dst.data(), count); });
    std::printf("  %-34s %12.2f %14.2f %7.2fx\n", absl::StrCat(DTypeName(from), " -> ", DTypeName(to)).c_str(),
                GBps(kOutBytes, t), GBps(kOutBytes, copy), copy / t);
  }
}

// Casts of 64 MiB of F32 (and back) with the fast paths and with the
// element-at-a-time reference, in GB/s of input: what every cast that is
// served (gRPC chunks, socket segments) runs.
void CastBench() {
  constexpr size_t kCount = 16 << 20;
  std::vector<float> f32(kCount);
  for (size_t i = 0; i < kCount; ++i) f32[i] = static_cast<float>(i % 9973) * 0.37f - 1000.0f;
  std::vector<uint16_t> half(kCount);
  std::vector<float> back(kCount);
  std::printf("\n%-36s %12s %14s %8s\n", "cast (64 MiB of F32)", "fast GB/s", "reference GB/s", "speedup");
  for (DType to : {DType::kF16, DType::kBF16}) {
    const auto* src = reinterpret_cast<const std::byte*>(f32.data());
    auto* dst = reinterpret_cast<std::byte*>(half.data());
    const double fast = MedianOf(3, [&] { CastElements(DType::kF32, src, to, dst, kCount); });
    const double ref = MedianOf(1, [&] { CastElementsReference(DType::kF32, src, to, dst, kCount); });
    std::printf("  %-34s %12.2f %14.2f %7.1fx\n", absl::StrCat("F32 -> ", DTypeName(to)).c_str(),
                GBps(4 * kCount, fast), GBps(4 * kCount, ref), ref / fast);
    const double up =
        MedianOf(3, [&] { CastElements(to, dst, DType::kF32, reinterpret_cast<std::byte*>(back.data()), kCount); });
    const double up_ref = MedianOf(
        1, [&] { CastElementsReference(to, dst, DType::kF32, reinterpret_cast<std::byte*>(back.data()), kCount); });
    std::printf("  %-34s %12.2f %14.2f %7.1fx\n", absl::StrCat(DTypeName(to), " -> F32").c_str(), GBps(2 * kCount, up),
                GBps(2 * kCount, up_ref), up_ref / up);
  }
  NarrowCastBench();
  TransposeBench();
}

// A new version of a `megabytes` SafeTensors file with one of its tensors
// changed, as a push or a node's step writes it: whole, or as a copy of the
// old file (CheckpointWriter::SetCloneSource: shared extents on XFS and
// btrfs, a copy in the kernel elsewhere) with the changed tensor written over.
void RewriteBench(const std::string& dir, uint64_t megabytes) {
  const std::string base_path = absl::StrCat(dir, "/rewrite-base.safetensors");
  WriteSafeTensors(base_path, megabytes);
  auto base = Checkpoint::Open(base_path);
  Check(base.status(), "open the base");
  const std::shared_ptr<const MappedFile> file = (*base)->files()[0];
  std::vector<std::byte> changed((*base)->entries()[0].spec.byte_size(), std::byte{7});
  SharedBytes changed_bytes = SharedBytes::FromVector(std::move(changed));
  AtomicFile::CloneResult how = AtomicFile::CloneResult::kUnsupported;
  auto write = [&](bool clone) {
    const std::string out = absl::StrCat(dir, "/rewrite-", clone ? "clone" : "whole", ".safetensors");
    auto writer = CheckpointWriter::Create(out, kSafeTensorsFormat, {.overwrite = true, .keep_order = true});
    Check(writer.status(), "create writer");
    if (clone) (*writer)->SetCloneSource(file);
    for (size_t i = 0; i < (*base)->size(); ++i) {
      const CheckpointEntry& e = (*base)->entries()[i];
      if (i == 0) {
        Check((*writer)->Add(e.spec, [changed_bytes] { return absl::StatusOr<SharedBytes>(changed_bytes); }), "add");
        continue;
      }
      auto read = (*base)->Read(e);
      Check(read.status(), "read");
      SharedBytes bytes = read->bytes;
      if (clone) {
        Check((*writer)->AddUnchanged(e.spec, std::move(bytes)), "add");
      } else {
        Check((*writer)->Add(e.spec, [bytes] { return absl::StatusOr<SharedBytes>(bytes); }), "add");
      }
    }
    Check((*writer)->Finish(), "write");
    if (clone) how = (*writer)->clone_result();
  };
  std::vector<double> whole, cloned;
  for (int i = 0; i < 5; ++i) {  // taking turns, so both see the same machine
    whole.push_back(Seconds([&] { write(false); }));
    cloned.push_back(Seconds([&] { write(true); }));
  }
  const double w = Median(whole), c = Median(cloned);
  const uint64_t bytes = FileSize(base_path);
  const char* by = how == AtomicFile::CloneResult::kCloned   ? "shared extents"
                   : how == AtomicFile::CloneResult::kCopied ? "copy in the kernel"
                                                             : "not used";
  std::printf("\n%-44s %9s %8s %8s\n",
              absl::StrCat("new version of ", megabytes, " MB, 1 of ", (*base)->size(), " tensors changed").c_str(),
              "seconds", "GB/s", "speedup");
  std::printf("  %-42s %9.3f %8.2f %7.2fx\n", "written whole (fsynced)", w, GBps(bytes, w), 1.0);
  std::printf("  %-42s %9.3f %8.2f %7.2fx\n", absl::StrCat("base copied (", by, "), 1 written over").c_str(), c,
              GBps(bytes, c), w / c);
  for (const char* name : {"rewrite-base", "rewrite-whole", "rewrite-clone"}) {
    std::filesystem::remove(absl::StrCat(dir, "/", name, ".safetensors"));
  }
}

}  // namespace
}  // namespace weightstore

int main(int argc, char** argv) {
  using namespace weightstore;
  std::string dir;
  int large_gb = 2;
  bool rewrite_only = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--dir") && i + 1 < argc) dir = argv[++i];
    if (!std::strcmp(argv[i], "--large-gb") && i + 1 < argc) large_gb = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--selection-only")) {
      SelectionBench();
      return 0;
    }
    if (!std::strcmp(argv[i], "--cast-only")) {
      CastBench();
      return 0;
    }
    if (!std::strcmp(argv[i], "--rewrite-only")) rewrite_only = true;
  }
  bool own_dir = dir.empty();
  if (own_dir) {
    char tmpl[] = "/tmp/weightstore-bench-XXXXXX";
    dir = ::mkdtemp(tmpl);
  }
  const std::string python = WEIGHTSTORE_TORCH_PYTHON, helper = WEIGHTSTORE_BENCH_HELPER;
  std::printf("weightstore core_bench (files in %s)\n\n", dir.c_str());
  if (rewrite_only) {
    RewriteBench(dir, static_cast<uint64_t>(large_gb) << 10);
    if (own_dir) std::filesystem::remove_all(dir);
    return 0;
  }

  // 1. Inspect time must stay flat as the checkpoint grows.
  std::printf("%-32s %12s %14s\n", "inspect (open, headers only)", "file size", "median time");
  const std::vector<std::pair<std::string, uint64_t>> sizes = {
      {"1 MB", 1}, {"256 MB", 256}, {absl::StrCat(large_gb, " GB"), static_cast<uint64_t>(large_gb) << 10}};
  for (const auto& [label, mb] : sizes) {
    std::string st = absl::StrCat(dir, "/m", mb, ".safetensors"), pt = absl::StrCat(dir, "/m", mb, ".pt");
    WriteSafeTensors(st, mb);
    Run(absl::StrCat(python, " ", helper, " write ", pt, " ", mb, " 2>/dev/null"));
    std::printf("  %-30s %12s %11.3f ms\n", absl::StrCat("safetensors ", label).c_str(),
                absl::StrCat(FileSize(st) >> 20, " MiB").c_str(), InspectSeconds(st) * 1e3);
    std::printf("  %-30s %12s %11.3f ms\n", absl::StrCat("pytorch .pt ", label).c_str(),
                absl::StrCat(FileSize(pt) >> 20, " MiB").c_str(), InspectSeconds(pt) * 1e3);
    if (mb > 256) {  // keep the disk footprint small
      std::filesystem::remove(st);
      std::filesystem::remove(pt);
    }
  }

  // 2. Convert throughput beside copying the same file with dd conv=fsync.
  const std::string pt = dir + "/m256.pt", st = dir + "/m256.safetensors";
  const uint64_t pt_bytes = FileSize(pt), st_bytes = FileSize(st);
  double dd_pt = DdSeconds(pt, dir + "/dd.out");
  double dd_st = DdSeconds(st, dir + "/dd.out");
  double pt_to_st = ConvertSeconds(pt, dir + "/conv.safetensors", kSafeTensorsFormat);
  double st_to_bpk = ConvertSeconds(st, dir + "/conv.bpk", kBurnpackFormat);
  std::printf("\n%-40s %10s %10s %8s\n", "convert (256 MB, page cache warm)", "GB/s", "dd GB/s", "ratio");
  std::printf("  %-38s %10.2f %10.2f %7.0f%%\n", ".pt -> SafeTensors", GBps(pt_bytes, pt_to_st), GBps(pt_bytes, dd_pt),
              100 * dd_pt / pt_to_st);
  std::printf("  %-38s %10.2f %10.2f %7.0f%%\n", "SafeTensors -> Burnpack", GBps(st_bytes, st_to_bpk),
              GBps(st_bytes, dd_st), 100 * dd_st / st_to_bpk);

  // 3. Reading every tensor of a 256 MB .pt into memory, beside torch.load.
  double copy = ReadAllCopySeconds(pt);
  double view = ReadAllViewSeconds(pt);
  double torch_load = std::stod(Run(absl::StrCat(python, " ", helper, " load ", pt, " 3 2>/dev/null")));
  std::printf("\n%-44s %9s %8s %9s\n", "read all tensors of 256 MB .pt (warm)", "seconds", "GB/s", "vs torch");
  std::printf("  %-42s %9.4f %8.2f %8.1fx\n", "torch.load (baseline)", torch_load, GBps(pt_bytes, torch_load), 1.0);
  std::printf("  %-42s %9.4f %8.2f %8.1fx\n", "weightstore ReadCopy (owned memory)", copy, GBps(pt_bytes, copy),
              torch_load / copy);
  std::printf("  %-42s %9.4f %8.2f %8.1fx\n", "weightstore Read (zero-copy, pages touched)", view, GBps(pt_bytes, view),
              torch_load / view);

  SelectionBench();
  CastBench();
  RewriteBench(dir, 1024);

  struct rusage usage;
  ::getrusage(RUSAGE_SELF, &usage);
  std::printf("\npeak RSS of core_bench: %.1f MiB\n", static_cast<double>(usage.ru_maxrss) / 1024);
  if (own_dir) std::filesystem::remove_all(dir);
  return 0;
}
