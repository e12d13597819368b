// bench/bench_torch_common.hpp - what bench_checkpoint and bench_train_state share: fresh
// child processes per measurement (so peak RSS readings never mix), a peak-memory sampler,
// deterministic tensor contents, and fsync helpers for the torch::save peers.
#pragma once

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/posix.hpp"
#include "shardsafe/detail/thread_pool.hpp"

namespace bench {

/// One tensor of the benchmark model.
struct tensor_def {
  std::string name;
  shardsafe::shape_t shape;
};

/// Transformer shapes: an embedding, `layers` blocks (attention qkv and o, MLP up and down,
/// two norms) and a final norm; d = 2048 (256 with quick), ffn = 4d, vocab 32000 (4000).
/// Names are joined with `sep` ('.' as in a state dict; '_' where torch::nn::Module forbids dots).
inline std::vector<tensor_def> transformer_defs(bool quick, int layers, char sep) {
  const u64 d = quick ? 256 : 2048, ffn = 4 * d, vocab = quick ? 4000 : 32000;
  const std::string s(1, sep);
  std::vector<tensor_def> v{{"embed" + s + "weight", {vocab, d}}};
  for (int i = 0; i < layers; ++i) {
    const std::string p = "layers" + s + std::to_string(i) + s;
    v.push_back({p + "attn" + s + "qkv" + s + "weight", {3 * d, d}});
    v.push_back({p + "attn" + s + "o" + s + "weight", {d, d}});
    v.push_back({p + "mlp" + s + "up" + s + "weight", {ffn, d}});
    v.push_back({p + "mlp" + s + "down" + s + "weight", {d, ffn}});
    v.push_back({p + "norm1" + s + "weight", {d}});
    v.push_back({p + "norm2" + s + "weight", {d}});
  }
  v.push_back({"norm" + s + "weight", {d}});
  return v;
}

/// Bytes of the tensors at `item` bytes per element.
inline u64 defs_bytes(const std::vector<tensor_def>& defs, u64 item) {
  u64 n = 0;
  for (const auto& t : defs) n += shardsafe::numel(t.shape) * item;
  return n;
}

/// Results a child prints as "RESULT key value" lines.
using result = std::map<std::string, double>;

inline void emit(const std::string& key, double v) {
  std::printf("RESULT %s %.9g\n", key.c_str(), v);
  std::fflush(stdout);
}

inline std::string self_exe() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

/// Runs this executable again with `args` (a fresh process: fresh heap, fresh peak RSS) and
/// collects its RESULT lines; other output is passed through. Exits on failure. Calls sync()
/// first, so that writeback or discards left by the previous measurement do not land in this one.
inline result run_child(const std::vector<std::string>& args) {
  ::sync();  // the file system settles first (this ext4 discards freed blocks at journal commits)
  std::string cmd = shell_quote(self_exe());
  for (const auto& a : args) cmd += " " + shell_quote(a);
  std::FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) {
    std::perror("popen");
    std::exit(2);
  }
  result r;
  char line[4096];
  while (std::fgets(line, sizeof line, p)) {
    char key[1024];
    double v;
    if (std::sscanf(line, "RESULT %1023s %lf", key, &v) == 2)
      r[key] = v;
    else
      std::fputs(line, stderr);
  }
  const int st = ::pclose(p);
  if (st != 0) {
    std::fprintf(stderr, "child failed (status %d): %s\n", st, cmd.c_str());
    std::exit(2);
  }
  return r;
}

/// Samples RssAnon and RssFile every `period` on a thread; VmHWM gives the exact total peak,
/// this splits it (approximately) into anonymous memory and mapped file pages.
class rss_sampler {
 public:
  explicit rss_sampler(std::chrono::milliseconds period = std::chrono::milliseconds(2)) {
    t_ = std::thread([this, period] {
      while (!stop_.load()) {
        sample();
        std::this_thread::sleep_for(period);
      }
      sample();
    });
  }
  ~rss_sampler() { stop(); }
  void stop() {
    if (t_.joinable()) {
      stop_ = true;
      t_.join();
    }
  }
  double peak_anon_mib() const { return double(anon_) / 1024.0; }
  double peak_file_mib() const { return double(file_) / 1024.0; }

 private:
  void sample() {
    anon_ = std::max(anon_.load(), proc_status_kib("RssAnon"));
    file_ = std::max(file_.load(), proc_status_kib("RssFile"));
  }
  std::atomic<bool> stop_{false};
  std::atomic<long long> anon_{0}, file_{0};
  std::thread t_;
};

/// fsync of a file (and, for durability of its name, its folder): what torch::save lacks.
inline void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    std::perror(("fsync " + path).c_str());
    std::exit(2);
  }
  ::close(fd);
  const std::string dir = std::filesystem::path(path).parent_path().string();
  fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

/// Reads every file under `path` (a file or a folder, recursively) once, so that the page cache
/// holds it: files saved with O_DIRECT are not cached, and the loads compared are warm.
inline void warm_files(const std::string& path) {
  std::vector<std::byte> buf(16 * MiB);
  auto warm_one = [&](const std::filesystem::path& f) {
    int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    while (::read(fd, buf.data(), buf.size()) > 0) {
    }
    ::close(fd);
  };
  if (std::filesystem::is_regular_file(path)) return warm_one(path);
  for (const auto& e : std::filesystem::recursive_directory_iterator(path))
    if (e.is_regular_file()) warm_one(e.path());
}

/// The value of global element g of tensor number k (cheap to compute, never constant).
inline float value_of(std::uint64_t k, std::uint64_t g) {
  return float(((g * 2654435761ull + k * 40503ull) >> 7) & 0xffff) * (1.0f / 4096.0f) - 8.0f;
}

/// Fills local element i with value_of(k, global(i)), where global() walks the runs of a
/// shard cursor; `runs` yields {begin, end, local} triples.
template <class Runs>
void fill_runs(const at::Tensor& t, std::uint64_t k, Runs&& runs) {
  if (t.scalar_type() == at::kFloat) {
    float* p = t.data_ptr<float>();
    runs([&](std::uint64_t b, std::uint64_t e, std::uint64_t local) {
      for (std::uint64_t g = b; g < e; ++g) p[local + (g - b)] = value_of(k, g);
    });
  } else if (t.scalar_type() == at::kBFloat16) {
    auto* p = t.data_ptr<at::BFloat16>();
    runs([&](std::uint64_t b, std::uint64_t e, std::uint64_t local) {
      for (std::uint64_t g = b; g < e; ++g) p[local + (g - b)] = at::BFloat16(value_of(k, g));
    });
  } else {
    std::fprintf(stderr, "fill_runs: unsupported dtype\n");
    std::exit(2);
  }
}

inline bool same_value(const at::Tensor& t, std::uint64_t local, std::uint64_t k, std::uint64_t g) {
  if (t.scalar_type() == at::kFloat) return t.data_ptr<float>()[local] == value_of(k, g);
  return float(t.data_ptr<at::BFloat16>()[local]) == float(at::BFloat16(value_of(k, g)));
}

}  // namespace bench

// ---- the limits of moving the same bytes ------------------------------------------------

namespace bench {

/// One tensor's bytes: where they are, where a copy of them goes.
struct byte_piece {
  const std::byte* src;
  std::byte* dst;
  u64 len;
};

/// Measures, on `pieces` (their concatenation is "the file"), and prints RESULT lines:
///   memcpy_1t, memcpy_2t        src -> dst (dst touched before), 1 and 2 threads
///   write_buffered              pwrite of the file (64 MiB calls, 1 thread) + fdatasync
///   write_direct                O_DIRECT pwrite (2 threads, each staging 32 MiB aligned blocks
///                               with memcpy, as a direct writer must) + fdatasync; -1 if refused
///   read_1t, read_2t            pread of the buffered file back into dst (warm page cache)
inline void measure_limits(const std::vector<byte_piece>& pieces, const std::string& scratch) {
  namespace sd = shardsafe::detail;
  constexpr u64 chunk = 64 * MiB;
  struct part {
    u64 piece, off, len, file_off;
  };
  std::vector<part> parts;
  u64 total = 0;
  for (u64 i = 0; i < pieces.size(); ++i) {
    for (u64 o = 0; o < pieces[i].len; o += chunk)
      parts.push_back({i, o, std::min(chunk, pieces[i].len - o), total + o});
    total += pieces[i].len;
  }
  auto copy_all = [&](unsigned threads) {
    sd::parallel_for(parts.size(), threads, [&](std::size_t k) {
      const part& p = parts[k];
      std::memcpy(pieces[p.piece].dst + p.off, pieces[p.piece].src + p.off, p.len);
    });
  };
  for (const auto& p : pieces) std::memset(p.dst, 0, p.len);
  double t0 = now_s();
  copy_all(1);
  emit("memcpy_1t", now_s() - t0);
  t0 = now_s();
  copy_all(2);
  emit("memcpy_2t", now_s() - t0);

  const std::string fb = scratch + ".buffered", fdio = scratch + ".direct";
  int fd = ::open(fb.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  t0 = now_s();
  for (const auto& p : parts) sd::pwrite_full(fd, p.file_off, {pieces[p.piece].src + p.off, p.len}, fb);
  ::fdatasync(fd);
  ::close(fd);
  emit("write_buffered", now_s() - t0);

  fd = ::open(fb.c_str(), O_RDONLY | O_CLOEXEC);
  for (unsigned threads : {1u, 2u}) {
    for (const auto& p : pieces) std::memset(p.dst, 0, p.len);
    t0 = now_s();
    sd::parallel_for(parts.size(), threads, [&](std::size_t k) {
      const part& p = parts[k];
      sd::pread_full(fd, p.file_off, {pieces[p.piece].dst + p.off, p.len}, fb);
    });
    emit(threads == 1 ? "read_1t" : "read_2t", now_s() - t0);
  }
  ::close(fd);
  std::filesystem::remove(fb);

  fd = ::open(fdio.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
  if (fd < 0) {
    emit("write_direct", -1);
  } else {
    constexpr u64 block = 32 * MiB;
    const u64 blocks = (total + block - 1) / block;
    t0 = now_s();
    sd::parallel_for(blocks, 2, [&](std::size_t b) {
      thread_local std::unique_ptr<std::byte, decltype(&std::free)> stage(
          static_cast<std::byte*>(std::aligned_alloc(4096, block)), &std::free);
      const u64 begin = b * block, end = std::min(total, begin + block);
      // gather [begin, end) of the concatenation into the staging block
      u64 at = 0;
      for (const auto& p : pieces) {
        const u64 lo = std::max(begin, at), hi = std::min(end, at + p.len);
        if (lo < hi) std::memcpy(stage.get() + (lo - begin), p.src + (lo - at), hi - lo);
        at += p.len;
      }
      const u64 len = (end - begin + 4095) / 4096 * 4096;  // the tail padded to the block size
      std::memset(stage.get() + (end - begin), 0, len - (end - begin));
      sd::pwrite_full(fd, begin, {stage.get(), len}, fdio);
    });
    if (::ftruncate(fd, static_cast<off_t>(total)) != 0) std::perror("ftruncate");
    ::fdatasync(fd);
    ::close(fd);
    emit("write_direct", now_s() - t0);
    std::filesystem::remove(fdio);
  }
}

/// Writes (memset) every tensor, each freshly allocated and never touched, in 64 MiB parts on
/// 2 threads: the page faults any load into newly allocated tensors pays. Run it first thing in
/// a fresh process (in a VM the cost of fresh memory depends on its history). Returns seconds.
inline double first_touch(const std::vector<at::Tensor>& fresh) {
  constexpr u64 chunk = 64 * MiB;
  std::vector<std::pair<std::byte*, u64>> parts;
  for (const auto& t : fresh)
    for (u64 o = 0; o < t.nbytes(); o += chunk)
      parts.emplace_back(static_cast<std::byte*>(t.data_ptr()) + o, std::min(chunk, u64(t.nbytes()) - o));
  const double t0 = now_s();
  shardsafe::detail::parallel_for(parts.size(), 2,
                                  [&](std::size_t k) { std::memset(parts[k].first, 1, parts[k].second); });
  return now_s() - t0;
}

}  // namespace bench
