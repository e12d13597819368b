// shardsafe/torch/tensor_memory.hpp - memory for tensors the loader allocates itself.
//
// A load into tensors allocated for it pays for the first touch of every page: the kernel
// faults each 4 KiB page in and zeroes it, which costs more than reading the bytes from the
// page cache (bench/README.md: 290 of 331 ms of a 1 GiB load). tensor_arena removes most of
// that: all the tensors of a load live in one region, 2 MiB aligned, with transparent huge
// pages advised (512 times fewer faults), populated by a thread of its own ahead of the reads
// where the kernel can (MADV_POPULATE_WRITE, Linux 5.14+). The tensors are views of the
// region; it is freed when the last of them goes (so one tensor kept alive keeps all).
//
// | tensor_memory      | what unshard_state allocates                                   |
// |--------------------|----------------------------------------------------------------|
// | separate (default) | one at::empty per tensor (freed one by one)                    |
// | arena              | one huge-page region for all, populated ahead of the reads     |
#pragma once

#include <sys/mman.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/torch/tensor_view.hpp"

namespace shardsafe {

enum class tensor_memory { separate, arena };

/// One region holding many tensors (see the header comment). populate_ahead() starts a thread
/// that faults the region in, front to back, while the caller reads into it from the front.
class tensor_arena {
 public:
  static constexpr std::uint64_t huge_page = std::uint64_t(2) << 20;
  static constexpr std::uint64_t align = 64;  ///< each tensor's start

  /// Space for tensors of these byte sizes, each 64-byte aligned.
  explicit tensor_arena(std::span<const std::uint64_t> sizes) {
    for (std::uint64_t n : sizes) {
      offsets_.push_back(bytes_);
      bytes_ += (n + align - 1) / align * align;
    }
    const std::uint64_t cap = std::max<std::uint64_t>((bytes_ + huge_page - 1) / huge_page * huge_page, huge_page);
    void* p = ::mmap(nullptr, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) fail_errno(errno, "tensor_arena: cannot map " + std::to_string(cap) + " bytes");
    // mmap aligns to 4 KiB only; huge pages need 2 MiB alignment of the range that uses them,
    // which the kernel finds inside the region (the head and tail stay small pages)
#ifdef MADV_HUGEPAGE
    ::madvise(p, cap, MADV_HUGEPAGE);
#endif
    region_ = std::shared_ptr<region>(new region{static_cast<std::byte*>(p), cap});
  }
  tensor_arena(const tensor_arena&) = delete;
  tensor_arena& operator=(const tensor_arena&) = delete;
  ~tensor_arena() { stop_populating(); }

  std::uint64_t bytes() const noexcept { return bytes_; }
  std::byte* data(std::size_t i) const noexcept { return region_->base + offsets_[i]; }

  /// Tensor i as an at::Tensor of these sizes and dtype; it holds the region alive.
  at::Tensor tensor(std::size_t i, at::IntArrayRef sizes, at::ScalarType type) const {
    auto keep = region_;
    return at::from_blob(
        data(i), sizes, [keep](void*) mutable { keep.reset(); }, at::TensorOptions().dtype(type));
  }

  /// Faults the region in on a thread of its own, in 32 MiB steps from the front (the reads
  /// start there too), so the reading threads mostly find their pages present. Returns false
  /// where the kernel lacks MADV_POPULATE_WRITE (then the reads fault the pages themselves).
  bool populate_ahead() {
#ifdef MADV_POPULATE_WRITE
    const std::uint64_t probe = std::min<std::uint64_t>(4096, region_->size);
    if (::madvise(region_->base, probe, MADV_POPULATE_WRITE) != 0) return false;
    stop_ = false;
    populator_ = std::thread([this] {
      const std::uint64_t step = std::uint64_t(32) << 20;
      for (std::uint64_t off = 0; off < bytes_ && !stop_.load(std::memory_order_relaxed); off += step)
        ::madvise(region_->base + off, std::min(step, region_->size - off), MADV_POPULATE_WRITE);
    });
    return true;
#else
    return false;
#endif
  }
  /// Stops the populating thread (it is also stopped by the destructor).
  void stop_populating() {
    stop_ = true;
    if (populator_.joinable()) populator_.join();
  }

 private:
  struct region {
    std::byte* base;
    std::uint64_t size;
    ~region() { ::munmap(base, size); }
  };
  std::vector<std::uint64_t> offsets_;
  std::uint64_t bytes_ = 0;
  std::shared_ptr<region> region_;
  std::thread populator_;
  std::atomic<bool> stop_{false};
};

}  // namespace shardsafe
