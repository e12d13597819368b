// shardsafe/torch/tensor_memory.hpp - memory for tensors the loader allocates itself.
//
// A load into tensors allocated for it pays for the first touch of every page: the kernel
// faults each 4 KiB page in and zeroes it, which costs more than reading the bytes from the
// page cache (bench/README.md: 290 of 331 ms of a 1 GiB load). tensor_arena removes most of
// that: all the tensors of a load live in one region, 2 MiB aligned, with transparent huge
// pages advised (512 times fewer faults), populated by a thread of its own ahead of the reads
// where the kernel can (MADV_POPULATE_WRITE, Linux 5.14+), and switched to small pages where
// huge ones turn out dearer (memory a hypervisor took back: populate_ahead). The tensors are
// views of the region; it is freed when the last of them goes (so one tensor kept alive keeps
// all).
//
// | tensor_memory      | what unshard_state allocates                                   |
// |--------------------|----------------------------------------------------------------|
// | separate (default) | one at::empty per tensor (freed one by one)                    |
// | arena              | one huge-page region for all, populated ahead of the reads     |
// |                    | (small pages from where huge ones cost more)                   |
// | hugetlb_arena      | the same from the machine's reserved huge pages where they fit |
#pragma once

#include <sys/mman.h>
#include <time.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/huge_pages.hpp"
#include "shardsafe/torch/tensor_view.hpp"

namespace shardsafe {

enum class tensor_memory { separate, arena, hugetlb_arena };

/// n bytes of page-locked host memory (LibTorch's pinned allocator: CUDA must be available),
/// which device copies read and write at the link's full speed, freed when the last owner goes.
inline std::shared_ptr<std::byte> pinned_host_bytes(std::uint64_t n) {
  auto holder = std::make_shared<at::Tensor>(
      at::empty({static_cast<std::int64_t>(n)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true)));
  return std::shared_ptr<std::byte>(holder, static_cast<std::byte*>(holder->data_ptr()));
}

/// How tensor_arena::populate_ahead chooses between huge and small pages.
struct arena_populate_options {
  /// Faulting backed huge pages costs 0.03-0.10 s per GiB on the machines measured; a step
  /// above this is memory the host has to find first.
  double backed_huge_seconds_per_gib = 0.25;
  /// Small pages are chosen when they cost less than the slow steps times this (tests: a huge
  /// number forces the switch).
  double small_pages_if_cheaper_by = 1.0;
};

/// One region holding many tensors (see the header comment). populate_ahead() starts a thread
/// that faults the region in, front to back, while the caller reads into it from the front.
class tensor_arena {
 public:
  static constexpr std::uint64_t huge_page = detail::huge_page_region::page;
  static constexpr std::uint64_t align = 64;  ///< each tensor's start

  /// Space for tensors of these byte sizes, each 64-byte aligned. With from_hugetlb_pool, the
  /// region comes from the huge pages the machine keeps reserved (vm.nr_hugepages, 2 MiB) when
  /// that pool has room for it (else as without): those pages stay the guest's while free, so
  /// faulting them in never waits for a host, and the trials of populate_ahead are skipped.
  /// A caller's choice: the pool is the machine's, and a process that forks after the load
  /// shares these pages copy-on-write from the same pool (a child that writes to them when the
  /// pool is empty is killed by SIGBUS).
  explicit tensor_arena(std::span<const std::uint64_t> sizes, bool from_hugetlb_pool = false) {
    for (std::uint64_t n : sizes) {
      offsets_.push_back(bytes_);
      bytes_ += (n + align - 1) / align * align;
    }
    region_ = detail::huge_page_region::map(bytes_, from_hugetlb_pool, "tensor_arena");
  }
  tensor_arena(const tensor_arena&) = delete;
  tensor_arena& operator=(const tensor_arena&) = delete;
  ~tensor_arena() { stop_populating(); }

  std::uint64_t bytes() const noexcept { return bytes_; }
  /// Whether the region came from the reserved huge pages (see the constructor).
  bool from_hugetlb_pool() const noexcept { return region_->from_hugetlb_pool(); }
  /// Free pages of the machine's reserved huge page pool now (HugePages_Free of /proc/meminfo,
  /// 2 MiB each on x86-64); 0 where there is none or it cannot be read.
  static long hugetlb_pages_free() {
    std::FILE* f = std::fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    long n = 0;
    while (std::fgets(line, sizeof line, f))
      if (std::sscanf(line, "HugePages_Free: %ld", &n) == 1) break;
    std::fclose(f);
    return n;
  }
  std::byte* data(std::size_t i) const noexcept { return region_->data() + offsets_[i]; }

  /// Tensor i as an at::Tensor of these sizes and dtype; it holds the region alive.
  at::Tensor tensor(std::size_t i, at::IntArrayRef sizes, at::ScalarType type) const {
    auto keep = region_;
    return at::from_blob(data(i), sizes, [keep](void*) mutable { keep.reset(); }, at::TensorOptions().dtype(type));
  }

  /// Faults the region in on a thread of its own, in 32 MiB steps from the front (the reads
  /// start there too), so the reading threads mostly find their pages present. Returns false
  /// where the kernel lacks MADV_POPULATE_WRITE (then the reads fault the pages themselves).
  ///
  /// Huge pages are faster to fault than small ones only where the memory behind them is at
  /// hand: under a hypervisor that takes freed guest memory back (free page reporting), a huge
  /// page fault can cost 10-20 times more than a backed one, and more than 512 small ones do
  /// on some machines though not on others (bench/README.md, "Fresh memory on a VM"). So the
  /// first 4 MiB are faulted as huge pages and the next 4 MiB as small ones before the reads
  /// start, and if the huge ones were slow (opt) and the small ones cheaper per byte, the rest
  /// of the region is advised MADV_NOHUGEPAGE. The thread then watches its steps' cost (its
  /// own CPU time, not the wall clock, which counts the time the reads hold the cores) and
  /// makes the same trial after a slow step, twice at most.
  bool populate_ahead(arena_populate_options opt = {}) {
#ifdef MADV_POPULATE_WRITE
    stop_populating();
    small_pages_from_ = 0;
    trials_ = 0;
    std::uint64_t start = std::min(trial_bytes, region_->size());
    const double t0 = thread_cpu_seconds();
    if (::madvise(region_->data(), start, MADV_POPULATE_WRITE) != 0) return false;  // (an old kernel)
    if (!region_->from_hugetlb_pool()) try_small_pages(start, (thread_cpu_seconds() - t0) / double(start), opt);
    stop_ = false;
    populator_ = std::thread([this, start, opt] { populate(start, opt); });
    return true;
#else
    (void)opt;
    return false;
#endif
  }
  /// Where the populating thread gave up on huge pages (0: it did not); read after
  /// stop_populating().
  std::uint64_t small_pages_from() const noexcept { return small_pages_from_; }
  /// Stops the populating thread (it is also stopped by the destructor).
  void stop_populating() {
    stop_ = true;
    if (populator_.joinable()) populator_.join();
  }

 private:
  static constexpr std::uint64_t trial_bytes = std::uint64_t(4) << 20;

  /// Seconds (this thread's CPU time) per byte of faulting [off, off + n) in.
  double fault(std::uint64_t off, std::uint64_t n) {
#ifdef MADV_POPULATE_WRITE
    const double t0 = thread_cpu_seconds();
    ::madvise(region_->data() + off, n, MADV_POPULATE_WRITE);
    return (thread_cpu_seconds() - t0) / double(n);
#else
    (void)off, (void)n;
    return 0;
#endif
  }

  /// After huge pages cost `huge` per byte: unless that is the cost of backed ones, faults
  /// the trial_bytes at `off` as small pages and, if they cost less, advises every page after
  /// them small. Moves `off` past what it faulted; true when it switched.
  bool try_small_pages(std::uint64_t& off, double huge, const arena_populate_options& opt) {
#ifdef MADV_NOHUGEPAGE
    if (huge <= opt.backed_huge_seconds_per_gib / double(1 << 30) || off + trial_bytes >= region_->size()) return false;
    ++trials_;
    ::madvise(region_->data() + off, trial_bytes, MADV_NOHUGEPAGE);
    const double small = fault(off, trial_bytes);
    off += trial_bytes;
    if (!(small < huge * opt.small_pages_if_cheaper_by)) return false;
    ::madvise(region_->data() + off, region_->size() - off, MADV_NOHUGEPAGE);
    small_pages_from_ = off;
    return true;
#else
    (void)off, (void)huge, (void)opt;
    return false;
#endif
  }

  /// The populating thread's work: [start, end of the tensors) in 32 MiB steps.
  void populate(std::uint64_t start, arena_populate_options opt) {
    constexpr std::uint64_t step = std::uint64_t(32) << 20;
    const std::uint64_t end = std::min(region_->size(), (bytes_ + huge_page - 1) / huge_page * huge_page);
    bool small = small_pages_from_ != 0 || region_->from_hugetlb_pool();  // (reserved huge pages: nothing to choose)
    for (std::uint64_t off = start; off < end && !stop_.load(std::memory_order_relaxed);) {
      const std::uint64_t n = std::min(step, end - off);
      const double cost = fault(off, n);
      off += n;
      if (!small && trials_ < 3) small = try_small_pages(off, cost, opt);
    }
  }

  static double thread_cpu_seconds() noexcept {
    timespec ts{};
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
  }

  std::vector<std::uint64_t> offsets_;
  std::uint64_t bytes_ = 0;
  std::shared_ptr<detail::huge_page_region> region_;
  std::thread populator_;
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> small_pages_from_{0};
  int trials_ = 0;  ///< small-page trials made (the first before the thread starts)
};

}  // namespace shardsafe
