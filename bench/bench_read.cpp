// bench_read - reading every tensor of a 1 GiB safetensors file from a warm page cache into
// preallocated memory, through each storage backend, beside the physical limits (no LibTorch).
//
//   meson setup build-bench -Dbench=true -Dbuildtype=release -Dtests=false -Dexamples=false
//   meson compile -C build-bench bench_read && ./build-bench/bench/bench_read [--quick] [--dir /tmp] [--reps 7]
//
// The file: 64 tensors of 16 MiB (F32), written by shardsafe's safetensors writer to --dir,
// then read once whole (the warm-up: every page is then in the page cache; the table says
// how much was resident, measured with mincore). --quick: 16 tensors of 4 MiB.
//
// The destination is one buffer of the data's size, written to before anything is timed,
// so no case pays first-touch page faults on it (they would otherwise dominate: ~262,000
// faults for 1 GiB). The cases run round-robin, --reps rounds (default 9); before each timed
// run the destination is cleared (untimed); the last round is checked byte for byte.
//
// Rows:
//   memcpy                  one memcpy of the data, from a copy of the file in memory (the limit)
//   memcpy per tensor       one memcpy per tensor: glibc uses ordinary (cached) stores below
//                           its non-temporal threshold (3/4 of a thread's L3 share), the
//                           kind of copy the kernel's pread does too
//   pread loop N MiB        plain pread(2) of the data region in N-MiB chunks (what the kernel gives)
//   file_storage            open + header + read_tensor (= read_into) per tensor
//   mmap_storage (reused)   read_into (memcpy out of the mapping) on a mapping made, and faulted
//                           in, before the timing
//   mmap_storage (fresh)    open + mmap + header + read_into per tensor + munmap, each repetition:
//                           the page-table cost of a new mapping included, as a loader pays it
//   memory_storage          read_into per tensor out of the in-memory copy
//   ... x2 threads          the same with the tensors split over 2 threads (detail::parallel_for,
//                           as the checkpoint loader runs its reads); memcpy x2 splits the buffer
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <thread>

#include "bench_common.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/format/safetensors_writer.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/memory.hpp"
#include "shardsafe/storage/mmap.hpp"
#include "shardsafe/storage/text.hpp"

using namespace shardsafe;
using bench::MiB;
using bench::u64;

namespace {

struct row {
  std::string name;
  unsigned threads;
  bench::samples t;
  double peak_mib;  // VmHWM during the case minus VmRSS before it
  bool ok;
};

// Reads every tensor of the file in storage s into dst (dst[0] = first byte of the data buffer).
template <ReadableStorage S>
void read_all(const S& s, std::byte* dst, unsigned threads) {
  safetensors_header h = read_safetensors_header(s);
  const auto& ts = h.tensors;
  detail::parallel_for(ts.size(), threads, [&](std::size_t i) {
    read_tensor(s, h, ts[i], {dst + ts[i].begin, static_cast<std::size_t>(ts[i].nbytes())});
  });
}

void pread_loop(int fd, u64 off, std::byte* dst, u64 n, u64 chunk) {
  for (u64 done = 0; done < n;) {
    const u64 want = std::min(chunk, n - done);
    const ssize_t r = ::pread(fd, dst + done, want, static_cast<off_t>(off + done));
    if (r <= 0) {
      if (r < 0 && errno == EINTR) continue;
      std::perror("pread");
      std::exit(2);
    }
    done += static_cast<u64>(r);
  }
}

// Splits [0, n) in `threads` parts and runs f(begin, end) on each, on its own thread.
template <class F>
void split(u64 n, unsigned threads, F&& f) {
  if (threads <= 1) return f(u64(0), n);
  std::vector<std::thread> ts;
  const u64 per = (n / threads + 4095) / 4096 * 4096;
  for (unsigned k = 1; k < threads; ++k) {
    const u64 b = std::min(n, per * k), e = std::min(n, per * (k + 1));
    ts.emplace_back([&f, b, e] { f(b, e); });
  }
  f(u64(0), std::min(n, per));
  for (auto& t : ts) t.join();
}

/// O_DIRECT reads of [off, off + n) (off and n multiples of 4096) through an aligned staging
/// block of `chunk` bytes, copied into dst: what a loader bypassing the page cache would do.
void direct_loop(const std::filesystem::path& p, u64 off, std::byte* dst, u64 n, u64 chunk) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  if (fd < 0) {
    std::perror("open O_DIRECT");
    std::exit(2);
  }
  auto* stage = static_cast<std::byte*>(std::aligned_alloc(4096, chunk + 8192));  // + the alignment at both ends
  for (u64 done = 0; done < n;) {
    const u64 want = std::min(chunk, n - done);
    const u64 at = off + done, start = at / 4096 * 4096, len = (at - start + want + 4095) / 4096 * 4096;
    const ssize_t r = ::pread(fd, stage, len, static_cast<off_t>(start));
    if (r < static_cast<ssize_t>(at - start + want)) {
      if (r < 0 && errno == EINTR) continue;
      std::perror("pread O_DIRECT");
      std::exit(2);
    }
    std::memcpy(dst + done, stage + (at - start), want);
    done += want;
  }
  std::free(stage);
  ::close(fd);
}

}  // namespace

int main(int argc, char** argv) {
  bench::args a(argc, argv);
  bench::accept_only(
      a,
      "Reads a 1 GiB safetensors file through each storage backend beside the physical limits, from a warm\n"
      "and from a cold page cache (bench/README.md).",
      {{"--quick", nullptr, "a 64 MiB file, three rounds (a smoke run)"},
       {"--reps", "N", "rounds of every case (default 9)"},
       {"--dir", "DIR", "where the file is written (default /tmp)"}});
  const bool quick = a.has("--quick");
  const u64 ntensors = quick ? 16 : 64;
  const u64 tensor_bytes = (quick ? 4 : 16) * MiB;
  const u64 data_bytes = ntensors * tensor_bytes;
  const int reps = static_cast<int>(a.get_int("--reps", quick ? 3 : 9));
  const std::filesystem::path dir = a.get("--dir", "/tmp");
  const std::filesystem::path path = dir / ("shardsafe-bench-read-" + std::to_string(::getpid()) + ".safetensors");
  const std::string load_before = bench::loadavg();

  // ---- the file --------------------------------------------------------------------------
  {
    // streamed tensor by tensor from one buffer: nothing the size of the file is held
    std::vector<tensor_entry> entries;
    for (u64 i = 0; i < ntensors; ++i)
      entries.push_back({"layers." + std::to_string(i / 4) + ".w" + std::to_string(i % 4), dtype::F32,
                         shape_t{tensor_bytes / 4 / 1024, 1024}, 0, 0});
    file_writer w(path);
    const safetensors_layout layout = plan_safetensors(entries, {}, w.name());
    safetensors_writer<file_writer> sw(w, layout);
    std::vector<float> v(tensor_bytes / 4);
    for (u64 i = 0; i < ntensors; ++i) {
      for (std::size_t k = 0; k < v.size(); ++k) v[k] = float(i * 1000003 + k);
      sw.write(entries[i].name, std::as_bytes(std::span(v)));
    }
    sw.finish();
  }
  struct cleanup {
    std::filesystem::path p;
    ~cleanup() { std::filesystem::remove(p); }
  } rm{path};

  // the warm-up read: the whole file into memory (this copy is also memcpy's and memory_storage's source)
  auto filebytes = std::make_shared<byte_buffer>(std::filesystem::file_size(path));
  {
    file_storage f(path);
    f.read_into(0, *filebytes);
  }
  const safetensors_header hdr = parse_safetensors(*filebytes, path.string());
  const u64 data_start = hdr.data_start();
  if (hdr.data_size != data_bytes) {
    std::fprintf(stderr, "unexpected data size\n");
    return 2;
  }
  const std::byte* src = filebytes->data() + data_start;
  const double resident = bench::page_cache_resident(path.string());

  // the destination, touched now so that no case pays its page faults
  std::byte* dst = static_cast<std::byte*>(std::aligned_alloc(4096, data_bytes));
  std::memset(dst, 0xab, data_bytes);
  const bool can_reset_peak = bench::reset_peak_rss();

  // The cases run round-robin (every case once per round, `reps` rounds), so that a burst of
  // load from elsewhere on the machine lands on all of them alike. Before each timed run the
  // destination is cleared (untimed); the last round's result is checked byte for byte.
  struct bench_case {
    std::string name;
    unsigned threads;
    std::function<void()> f;
  };
  std::vector<bench_case> cases;
  const memory_storage mem(std::shared_ptr<const byte_buffer>(filebytes), path.string());
  std::optional<mmap_storage> mapping(std::in_place, path);  // the reused mapping (unmapped before the cold runs)
  const mmap_storage& mapped = *mapping;
  read_all(mapped, dst, 1);  // faults it in, untimed
  for (unsigned th : {1u, 2u}) {
    const std::string x = th == 1 ? "" : " x2 threads";
    cases.push_back({"memcpy (physical limit)" + x, th,
                     [&, th] { split(data_bytes, th, [&](u64 b, u64 e) { std::memcpy(dst + b, src + b, e - b); }); }});
    cases.push_back({"memcpy per tensor (" + std::to_string(tensor_bytes / MiB) + " MiB pieces)" + x, th, [&, th] {
                       detail::parallel_for(ntensors, th, [&](std::size_t i) {
                         std::memcpy(dst + i * tensor_bytes, src + i * tensor_bytes, tensor_bytes);
                       });
                     }});
    for (u64 chunk : {u64(1), u64(4), u64(16)}) {
      if (th == 2 && chunk != 16) continue;
      cases.push_back({"pread loop " + std::to_string(chunk) + " MiB chunks" + x, th, [&, th, chunk] {
                         const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
                         split(data_bytes, th,
                               [&](u64 b, u64 e) { pread_loop(fd, data_start + b, dst + b, e - b, chunk * MiB); });
                         ::close(fd);
                       }});
    }
    cases.push_back({"file_storage read_into" + x, th, [&, th] { read_all(file_storage(path), dst, th); }});
    cases.push_back({"mmap_storage read_into (reused mapping)" + x, th, [&, th] { read_all(mapped, dst, th); }});
    cases.push_back(
        {"mmap_storage read_into (fresh mapping)" + x, th, [&, th] { read_all(mmap_storage(path), dst, th); }});
    cases.push_back({"memory_storage read_into" + x, th, [&, th] { read_all(mem, dst, th); }});
  }
  std::vector<row> rows;
  for (const auto& c : cases) rows.push_back({c.name, c.threads, {}, 0, true});
  for (int rep = 0; rep < reps; ++rep)
    for (std::size_t i = 0; i < cases.size(); ++i) {
      std::memset(dst, 0, data_bytes);
      const double rss0 = bench::rss_mib();
      bench::reset_peak_rss();
      const double t0 = bench::now_s();
      cases[i].f();
      rows[i].t.add(bench::now_s() - t0);
      rows[i].peak_mib = can_reset_peak ? std::max(rows[i].peak_mib, bench::hwm_mib() - rss0) : -1;
      if (rep == reps - 1 && std::memcmp(dst, src, data_bytes) != 0) {
        rows[i].ok = false;
        std::fprintf(stderr, "%s: destination differs from the file\n", cases[i].name.c_str());
      }
    }
  const double resident_after = bench::page_cache_resident(path.string());

  // ---- cold page cache -------------------------------------------------------------------
  // The same bytes read after the file is evicted from the page cache before each run
  // (posix_fadvise DONTNEED; residency checked by mincore): the disk's limit by plain reads,
  // and the checkpoint loader (the file as rank_0.safetensors of a one-rank checkpoint, every
  // tensor whole) with its defaults and with other read sizes and thread counts.
  const std::filesystem::path ckdir = dir / ("shardsafe-bench-read-ckpt-" + std::to_string(::getpid()));
  std::filesystem::create_directories(ckdir);
  struct cleanup_dir {
    std::filesystem::path p;
    ~cleanup_dir() { std::filesystem::remove_all(p); }
  } rm_ck{ckdir};
  std::filesystem::create_hard_link(path, ckdir / "rank_0.safetensors");
  {
    checkpoint_metadata md;
    for (const auto& t : hdr.tensors) {
      tensor_metadata tm;
      tm.shape = t.shape;
      tm.type = t.type;
      tm.files.emplace_back("rank_0.safetensors", flat_spec{{0, t.numel()}});
      md.tensors.emplace_back(t.name, std::move(tm));
    }
    write_text(file_directory(ckdir), metadata_file_name, write_checkpoint_metadata(md));
  }
  std::vector<flat_view> views;
  for (const auto& t : hdr.tensors) views.push_back({t.name, t.type, t.shape, std::nullopt, dst + t.begin, t.nbytes()});
  mapping.reset();  // a mapped page cannot be evicted
  std::vector<bench_case> cold;
  cold.push_back({"cold: pread loop 1 MiB chunks (dd-like: the cold limit)", 1, [&] {
                    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
                    pread_loop(fd, data_start, dst, data_bytes, MiB);
                    ::close(fd);
                  }});
  for (unsigned th : {2u, 4u})
    cold.push_back({"cold: pread loop 1 MiB chunks x" + std::to_string(th) + " threads", th, [&, th] {
                      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
                      split(data_bytes, th, [&](u64 b, u64 e) { pread_loop(fd, data_start + b, dst + b, e - b, MiB); });
                      ::close(fd);
                    }});
  cold.push_back({"cold: pread loop 16 MiB chunks x2 threads", 2, [&] {
                    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
                    split(data_bytes, 2,
                          [&](u64 b, u64 e) { pread_loop(fd, data_start + b, dst + b, e - b, 16 * MiB); });
                    ::close(fd);
                  }});
  for (unsigned th : {1u, 4u})
    cold.push_back({"cold: O_DIRECT pread 4 MiB chunks" + std::string(th == 1 ? "" : " x4 threads"), th, [&, th] {
                      split(data_bytes, th,
                            [&](u64 b, u64 e) { direct_loop(path, data_start + b, dst + b, e - b, 4 * MiB); });
                    }});
  struct loader_case {
    const char* name;
    unsigned threads;
    u64 max_read;
  };
  for (const loader_case lc : {loader_case{"cold: checkpoint load (defaults: 64 MiB reads, 8-16 in flight)", 0, 0},
                               loader_case{"cold: checkpoint load, 4 MiB reads, 4 threads", 4, 4 * MiB},
                               loader_case{"cold: checkpoint load, 1 MiB reads, 4 threads", 4, MiB},
                               loader_case{"cold: checkpoint load, 16 MiB reads, 4 threads", 4, 16 * MiB}})
    cold.push_back({lc.name, lc.threads, [&, lc] {
                      load_options o;
                      o.threads = lc.threads;
                      if (lc.max_read) o.reads.max_read_bytes = lc.max_read;
                      load(file_directory(ckdir), std::span<const flat_view>(views), o);
                    }});
  std::vector<row> cold_rows;
  double worst_resident = 0;
  for (const auto& c : cold) cold_rows.push_back({c.name, c.threads, {}, 0, true});
  const int cold_reps = quick ? 1 : std::max(3, reps / 3);
  for (int rep = 0; rep < cold_reps; ++rep)
    for (std::size_t i = 0; i < cold.size(); ++i) {
      std::memset(dst, 0, data_bytes);
      bench::evict(path);
      worst_resident = std::max(worst_resident, bench::page_cache_resident(path.string()));
      const double t0 = bench::now_s();
      cold[i].f();
      cold_rows[i].t.add(bench::now_s() - t0);
      if (rep == cold_reps - 1 && std::memcmp(dst, src, data_bytes) != 0) {
        cold_rows[i].ok = false;
        std::fprintf(stderr, "%s: destination differs from the file\n", cold[i].name.c_str());
      }
    }

  // ---- the table -------------------------------------------------------------------------
  double memcpy_best[3] = {0, 0, 0}, memcpy_med[3] = {0, 0, 0};
  for (const auto& r : rows)
    if (r.name.rfind("memcpy (physical limit)", 0) == 0) {
      memcpy_best[r.threads] = r.t.best();
      memcpy_med[r.threads] = r.t.median();
    }
  std::printf("bench_read: %llu tensors x %llu MiB = %.2f GiB of data, file %s\n", (unsigned long long)ntensors,
              (unsigned long long)(tensor_bytes / MiB), double(data_bytes) / double(bench::GiB), path.c_str());
  std::printf("page cache: warm (file written, then read once whole); resident before %.1f%%, after %.1f%% (mincore)\n",
              resident * 100, resident_after * 100);
  std::printf("destination: one %.2f GiB buffer, written before timing (no first-touch faults timed)\n",
              double(data_bytes) / double(bench::GiB));
  std::printf(
      "repetitions: %d per case, round-robin; GB/s = 1e9 bytes/s; x memcpy = throughput / memcpy's with the same "
      "threads\n",
      reps);
  std::printf("load average before: %s, after: %s; %u hardware threads\n\n", load_before.c_str(),
              bench::loadavg().c_str(), std::thread::hardware_concurrency());
  bench::table tab({"case", "thr", "best ms", "median ms", "best GB/s", "median GB/s", "x memcpy best",
                    "x memcpy median", "peak RSS +MiB", "check"});
  unsigned last_threads = 1;
  for (const auto& r : rows) {
    if (r.threads != last_threads) tab.separator();
    last_threads = r.threads;
    const double gb = double(data_bytes) / 1e9;
    tab.add({r.name, std::to_string(r.threads), bench::fmt("%.1f", r.t.best() * 1e3),
             bench::fmt("%.1f", r.t.median() * 1e3), bench::fmt("%.2f", gb / r.t.best()),
             bench::fmt("%.2f", gb / r.t.median()), bench::fmt("%.2f", memcpy_best[r.threads] / r.t.best()),
             bench::fmt("%.2f", memcpy_med[r.threads] / r.t.median()),
             r.peak_mib < 0 ? "n/a" : bench::fmt("%.0f", r.peak_mib), r.ok ? "ok" : "WRONG"});
  }
  tab.print();
  std::printf(
      "\ncold page cache: the file evicted before every run (posix_fadvise DONTNEED; at most %.1f%% resident\n"
      "when a run started, by mincore); %d repetition(s) per case, round-robin; x limit = throughput / the\n"
      "1-thread 1 MiB pread loop's (dd-like) median\n",
      worst_resident * 100, cold_reps);
  bench::table ctab({"case", "thr", "best ms", "median ms", "best GB/s", "median GB/s", "x limit (median)", "check"});
  const double cold_limit = cold_rows.front().t.median();
  for (const auto& r : cold_rows) {
    const double gb = double(data_bytes) / 1e9;
    ctab.add({r.name, r.threads ? std::to_string(r.threads) : "def", bench::fmt("%.1f", r.t.best() * 1e3),
              bench::fmt("%.1f", r.t.median() * 1e3), bench::fmt("%.2f", gb / r.t.best()),
              bench::fmt("%.2f", gb / r.t.median()), bench::fmt("%.2f", cold_limit / r.t.median()),
              r.ok ? "ok" : "WRONG"});
  }
  ctab.print();
  std::printf(
      "\npeak RSS +MiB: VmHWM during the case minus VmRSS before it (reset through /proc/self/clear_refs%s);\n"
      "a mapping's pages count as RSS (file-backed, shared with the page cache), a copy's do not.\n",
      can_reset_peak ? "" : ": refused here, so n/a");
  std::printf(
      "process peak RSS (VmHWM since the last reset) %.0f MiB; the file copy, the destination and the reused\n"
      "mapping are %.0f MiB each\n",
      bench::hwm_mib(), double(data_bytes) / double(MiB));

  // targets
  auto find = [&](const std::string& n) -> const row* {
    for (const auto& r : rows)
      if (r.name == n) return &r;
    return nullptr;
  };
  std::printf("\ntargets (warm page cache, >= 0.8 x memcpy, median):\n");
  for (const char* n :
       {"file_storage read_into", "mmap_storage read_into (fresh mapping)", "mmap_storage read_into (reused mapping)",
        "file_storage read_into x2 threads", "mmap_storage read_into (fresh mapping) x2 threads"}) {
    const row* r = find(n);
    if (!r) continue;
    const double x = memcpy_med[r->threads] / r->t.median();
    bench::print_target(50, n, x, " x memcpy", x >= 0.8);
  }
  {
    const row* def = nullptr;
    for (const auto& r : cold_rows)
      if (r.name.rfind("cold: checkpoint load (defaults", 0) == 0) def = &r;
    const double x = cold_limit / def->t.median();
    bench::print_target(50, "cold checkpoint load (defaults) >= 0.8 x the cold limit", x, " x", x >= 0.8);
  }
  std::free(dst);
  for (const auto& r : rows)
    if (!r.ok) return 1;
  for (const auto& r : cold_rows)
    if (!r.ok) return 1;
  return 0;
}
