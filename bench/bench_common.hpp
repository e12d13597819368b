// bench/bench_common.hpp - small helpers the I/O benchmarks share: repetition timing,
// /proc/self/status readings (RSS, peak RSS), page-cache residency, and a plain table.
// No LibTorch, no Google Benchmark: std::chrono::steady_clock and printf.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

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
