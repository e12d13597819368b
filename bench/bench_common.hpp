// bench/bench_common.hpp - small helpers the I/O benchmarks share: repetition timing,
// /proc/self/status readings (RSS, peak RSS), page-cache residency and eviction, the plain
// read rate of files (a limit), a measured step in a child process (a fork, or a peer program),
// and a plain table.
// No LibTorch, no Google Benchmark: std::chrono::steady_clock and printf.
#pragma once

#include <fcntl.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

extern char** environ;

namespace bench {

using u64 = std::uint64_t;
inline constexpr u64 MiB = u64(1) << 20;
inline constexpr u64 GiB = u64(1) << 30;

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Seconds of each repetition, sorted; best() and median().
struct samples {
  std::vector<double> s;
  void add(double x) {
    s.push_back(x);
    std::sort(s.begin(), s.end());
  }
  bool empty() const { return s.empty(); }
  double best() const { return s.empty() ? 0 : s.front(); }
  double median() const {
    if (s.empty()) return 0;
    const std::size_t n = s.size();
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
  }
};

/// Runs setup() (untimed) then f() (timed), reps times.
inline samples time_reps(int reps, const std::function<void()>& f, const std::function<void()>& setup = {}) {
  samples out;
  for (int i = 0; i < reps; ++i) {
    if (setup) setup();
    const double t0 = now_s();
    f();
    out.add(now_s() - t0);
  }
  return out;
}

/// A field of /proc/self/status in KiB (VmRSS, VmHWM, RssAnon, RssFile), or -1.
inline long long proc_status_kib(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::size_t n = std::strlen(field);
  while (std::getline(f, line))
    if (line.compare(0, n, field) == 0 && line.size() > n && line[n] == ':') return std::atoll(line.c_str() + n + 1);
  return -1;
}
inline double rss_mib() { return double(proc_status_kib("VmRSS")) / 1024.0; }
inline double hwm_mib() { return double(proc_status_kib("VmHWM")) / 1024.0; }

/// Resets VmHWM to the current RSS (Linux >= 4.0: "5" to /proc/self/clear_refs). False if refused.
inline bool reset_peak_rss() {
  int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, "5", 1) == 1;
  ::close(fd);
  return ok;
}

/// Fraction of a file's pages in the page cache (mincore over a mapping), or -1.
inline double page_cache_resident(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  struct stat st;
  if (::fstat(fd, &st) != 0 || st.st_size == 0) {
    ::close(fd);
    return -1;
  }
  const std::size_t size = static_cast<std::size_t>(st.st_size);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return -1;
  const long page = ::sysconf(_SC_PAGESIZE);
  std::vector<unsigned char> vec((size + page - 1) / page);
  double r = -1;
  if (::mincore(p, size, vec.data()) == 0) {
    std::size_t in = 0;
    for (unsigned char c : vec) in += c & 1;
    r = double(in) / double(vec.size());
  }
  ::munmap(p, size);
  return r;
}

/// Drops the file's pages from the page cache (dirty ones are written first). Root is not
/// needed: POSIX_FADV_DONTNEED evicts the pages of one file, as drop_caches would (a page that
/// is mapped stays: unmap the file first).
inline void evict(const std::filesystem::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

/// Evicts every file (evict) and returns the largest fraction of one still resident after it
/// (page_cache_resident), 0 where none could be measured.
inline double evict_all(const std::vector<std::filesystem::path>& files) {
  for (const auto& f : files) evict(f);
  double worst = 0;
  for (const auto& f : files) worst = std::max(worst, page_cache_resident(f.string()));
  return worst;
}

/// n bytes of page-aligned host memory (what O_DIRECT reads need), written once: its pages are
/// faulted in before anything reads into it.
inline std::shared_ptr<std::byte> aligned_bytes(u64 n) {
  void* p = nullptr;
  if (::posix_memalign(&p, 4096, n) != 0) throw std::bad_alloc();
  std::memset(p, 0, n);
  return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [](std::byte* q) { std::free(q); });
}

/// A plain read of files: `threads` threads each reading `chunk`-byte pieces into a buffer of
/// its own; `direct`: through O_DIRECT (whole 4 KiB blocks into an aligned buffer), past the
/// page cache.
struct read_config {
  unsigned threads;
  u64 chunk;
  bool direct;
  /// Each piece into its place in one buffer the size of the files (made and touched before the
  /// clock), as a load lands its bytes: the memory's write bandwidth counts, as it does for a load
  /// (a small reused buffer stays in the CPU's cache and reads from the page cache look faster).
  bool in_place = false;
  std::string name() const {
    return std::string(direct ? "O_DIRECT" : "pread") + " " + std::to_string(chunk / MiB) + " MiB x" +
           std::to_string(threads) + (in_place ? " in place" : "");
  }
};

/// One buffer an in-place read lands in, kept from call to call (grown where too small) and
/// touched when made: a benchmark that reads a 1.2 GiB layout hundreds of times would otherwise
/// fault in fresh memory for each read outside the clock (bench_layouts: minutes of system time
/// a run). Mapped apart and kept out of forked children (MADV_DONTFORK), whose own memory is the
/// load measured there.
class place_buffer {
 public:
  place_buffer() = default;
  place_buffer(const place_buffer&) = delete;
  place_buffer& operator=(const place_buffer&) = delete;
  ~place_buffer() { release(); }
  std::shared_ptr<std::byte> get(u64 n) {
    if (n > size_) {
      release();
      void* m = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) throw std::bad_alloc();
      ::madvise(m, n, MADV_DONTFORK);
      std::memset(m, 0, n);
      p_ = static_cast<std::byte*>(m);
      size_ = n;
    }
    return std::shared_ptr<std::byte>(p_, [](std::byte*) {});
  }

 private:
  void release() {
    if (p_) ::munmap(p_, size_);
    p_ = nullptr;
    size_ = 0;
  }
  std::byte* p_ = nullptr;
  u64 size_ = 0;
};

/// Rate (bytes/s) of reading every byte of the files as c says, the buffers made before the
/// clock starts (by `buffer` for buffered reads: e.g. pinned memory, what a device copies
/// from; aligned_bytes for O_DIRECT ones; an in-place read's in `place` where given, else
/// made afresh); 0 where a file cannot be opened so (O_DIRECT refused) or a read fails.
inline double read_rate(const std::vector<std::filesystem::path>& files, const read_config& c,
                        const std::function<std::shared_ptr<std::byte>(u64)>& buffer = aligned_bytes,
                        place_buffer* place = nullptr) {
  struct piece {
    int fd;
    u64 off, len;
  };
  std::vector<piece> pieces;
  std::vector<int> fds;
  u64 total = 0;
  bool opened = true;
  for (const auto& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC | (c.direct ? O_DIRECT : 0));
    if (!(opened = fd >= 0)) break;
    fds.push_back(fd);
    const u64 size = std::filesystem::file_size(f);
    for (u64 o = 0; o < size; o += c.chunk) pieces.push_back({fd, o, std::min(c.chunk, size - o)});
    total += size;
  }
  std::vector<std::shared_ptr<std::byte>> bufs;
  std::vector<u64> at;  // in_place: where each piece lands in the one buffer
  if (c.in_place && opened) {
    u64 o = 0;
    for (const piece& p : pieces) at.push_back(std::exchange(o, o + (p.len + 4095) / 4096 * 4096));
    bufs.push_back(place ? place->get(o) : aligned_bytes(o));  // written once: touched
  }
  for (unsigned t = 0; opened && !c.in_place && t < c.threads; ++t)
    bufs.push_back(c.direct ? aligned_bytes(c.chunk) : buffer(c.chunk));
  std::atomic<std::size_t> next{0};
  std::atomic<u64> got{0};
  const double t0 = now_s();
  std::vector<std::thread> ts;
  for (unsigned t = 0; opened && t < c.threads; ++t)
    ts.emplace_back([&, own = c.in_place ? nullptr : bufs[t].get()] {
      for (std::size_t i; (i = next.fetch_add(1)) < pieces.size();) {
        const piece& p = pieces[i];
        std::byte* const b = own ? own : bufs.front().get() + at[i];
        const u64 want = c.direct ? (p.len + 4095) / 4096 * 4096 : p.len;  // at a file's end: a short read
        u64 done = 0;
        for (ssize_t r; done < p.len && (r = ::pread(p.fd, b + done, want - done, off_t(p.off + done))) > 0;)
          done += u64(r);
        got += std::min(done, p.len);
      }
    });
  for (auto& t : ts) t.join();
  const double dt = now_s() - t0;
  for (int fd : fds) ::close(fd);
  return opened && got == total ? double(total) / dt : 0;
}

/// Load averages from /proc/loadavg ("0.12 0.30 0.25").
inline std::string loadavg() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

/// One line of a benchmark's target list: what, the measured value with its unit, met or MISSED.
inline void print_target(int width, const char* what, double value, const char* unit, bool met) {
  std::printf("  %-*s %8.2f%s  %s\n", width, what, value, unit, met ? "met" : "MISSED");
}

inline std::string fmt(const char* f, double x) {
  char b[64];
  std::snprintf(b, sizeof b, f, x);
  return b;
}

/// What a step run in a child process measured: its seconds and a value it returned (a checksum,
/// a count of wrong bytes), its peak RSS (wait4's ru_maxrss), and for a peer program its output.
struct outcome {
  double seconds = 0, peak = 0, sum = 0;
  bool ok = true;
  std::string why;  ///< why not ok
  std::string out;  ///< a peer's standard output
  /// The number after "name=" in a peer's output; -1 where it says none.
  double field(const char* name) const {
    const auto at = out.find(std::string(name) + "=");
    return at == std::string::npos ? -1.0 : std::atof(out.c_str() + at + std::strlen(name) + 1);
  }
};

/// f() in a forked child: its seconds and value (through a pipe) and its peak RSS.
template <class F>
outcome in_child(F&& f) {
  int fd[2];
  if (::pipe(fd) != 0) std::abort();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fd[0]);
    double r[2];
    const double t0 = now_s();
    r[1] = f();
    r[0] = now_s() - t0;
    if (::write(fd[1], r, sizeof r) != sizeof r) ::_exit(2);
    ::_exit(0);
  }
  ::close(fd[1]);
  double r[2] = {0, 0};
  const bool got = ::read(fd[0], r, sizeof r) == sizeof r;
  ::close(fd[0]);
  int status = 0;
  struct rusage ru{};
  ::wait4(pid, &status, 0, &ru);
  outcome o{r[0], double(ru.ru_maxrss) / 1024.0, r[1], true, {}, {}};
  if (!got || !WIFEXITED(status) || WEXITSTATUS(status) != 0) o = {0, 0, 0, false, "failed in its child", {}};
  return o;
}

/// A peer program (argv[0] a path) as a child: the seconds= and checksum= it prints, its output
/// and its peak RSS. Exit 77 is a skip ("skipped: " and its output in why).
inline outcome run_peer(const std::vector<std::string>& argv) {
  int fd[2];
  if (::pipe(fd) != 0) std::abort();
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fd[1], 1);
  posix_spawn_file_actions_addclose(&fa, fd[0]);
  std::vector<char*> a;
  for (const auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
  a.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, a[0], &fa, nullptr, a.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(fd[1]);
  if (spawned != 0) {
    ::close(fd[0]);
    return {0, 0, 0, false, "cannot start " + argv[0], {}};
  }
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fd[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<std::size_t>(n));
  ::close(fd[0]);
  int status = 0;
  struct rusage ru{};
  ::wait4(pid, &status, 0, &ru);
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 255;
  if (rc != 0) return {0, 0, 0, false, (rc == 77 ? "skipped: " : "failed: ") + out, out};
  outcome o{0, double(ru.ru_maxrss) / 1024.0, 0, true, {}, out};
  o.seconds = o.field("seconds");
  o.sum = o.field("checksum");
  return o;
}

/// A table of strings with a header row, printed with right-aligned columns (the first left).
class table {
 public:
  explicit table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void add(std::vector<std::string> r) {
    r.resize(rows_.front().size());
    rows_.push_back(std::move(r));
  }
  void separator() { rows_.push_back({}); }
  void print(std::FILE* out = stdout) const {
    std::vector<std::size_t> w(rows_.front().size(), 0);
    for (const auto& r : rows_)
      for (std::size_t i = 0; i < r.size(); ++i) w[i] = std::max(w[i], r[i].size());
    std::size_t total = 0;
    for (auto x : w) total += x + 2;
    for (std::size_t k = 0; k < rows_.size(); ++k) {
      const auto& r = rows_[k];
      if (r.empty()) {
        std::fprintf(out, "%s\n", std::string(total, '-').c_str());
        continue;
      }
      for (std::size_t i = 0; i < r.size(); ++i) {
        if (i == 0)
          std::fprintf(out, "%-*s", int(w[i]) + 2, r[i].c_str());
        else
          std::fprintf(out, "%*s", int(w[i]) + 2, r[i].c_str());
      }
      std::fprintf(out, "\n");
      if (k == 0) std::fprintf(out, "%s\n", std::string(total, '-').c_str());
    }
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

/// Command-line flags: --name VALUE or --flag.
/// The items of "a,b,c" (none of "").
inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  for (std::size_t p = 0, e; p < s.size(); p = e + 1) {
    if ((e = s.find(',', p)) == std::string::npos) e = s.size();
    out.push_back(s.substr(p, e - p));
  }
  return out;
}

struct args {
  std::string program;  ///< the name it was run by, without its folder
  std::vector<std::string> v;
  args(int argc, char** argv)
      : program(argc > 0 ? std::string(argv[0]).substr(std::string(argv[0]).find_last_of('/') + 1) : "bench"),
        v(argv + 1, argv + argc) {}
  bool has(const std::string& f) const { return std::find(v.begin(), v.end(), f) != v.end(); }
  std::string get(const std::string& f, const std::string& def) const {
    auto it = std::find(v.begin(), v.end(), f);
    return it != v.end() && it + 1 != v.end() ? *(it + 1) : def;
  }
  long get_int(const std::string& f, long def) const { return std::atol(get(f, std::to_string(def)).c_str()); }
};

/// A flag a benchmark takes. Internal ones (what a benchmark passes to the processes it starts)
/// are accepted but not listed.
struct flag {
  const char* name;
  const char* value;  ///< its value's placeholder ("N", "DIR"); nullptr for a switch
  const char* help;
  bool internal = false;
};

/// Checks the command line before anything runs: --help or -h prints the usage and the flags
/// and exits 0; a word that is no flag of this benchmark, or a flag without its value, is
/// refused with the usage (exit 2). (A mistyped flag would otherwise start a full run.)
inline void accept_only(const args& a, const char* what, const std::vector<flag>& flags) {
  auto usage = [&](std::FILE* out) {
    std::fprintf(out, "usage: %s [flags]\n%s\n", a.program.c_str(), what);
    for (const flag& f : flags)
      if (!f.internal) {
        const std::string left = std::string("  ") + f.name + (f.value ? std::string(" ") + f.value : "");
        std::fprintf(out, "%-24s %s\n", left.c_str(), f.help);
      }
    std::fprintf(out, "%-24s %s\n", "  --help, -h", "this text");
  };
  for (std::size_t i = 0; i < a.v.size(); ++i) {
    const std::string& w = a.v[i];
    if (w == "--help" || w == "-h") {
      usage(stdout);
      std::exit(0);
    }
    auto it = std::find_if(flags.begin(), flags.end(), [&](const flag& f) { return w == f.name; });
    if (it == flags.end() || (it->value && i + 1 == a.v.size())) {
      std::fprintf(stderr, it == flags.end() ? "%s: unknown argument '%s'\n" : "%s: %s needs a value\n",
                   a.program.c_str(), w.c_str());
      usage(stderr);
      std::exit(2);
    }
    if (it->value) ++i;
  }
}

}  // namespace bench
