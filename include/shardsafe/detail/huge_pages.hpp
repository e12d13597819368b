// shardsafe/detail/huge_pages.hpp - anonymous memory in 2 MiB huge pages: the one way the
// library maps a large region it fills itself (the async save's staging buffer, the arena a
// load's tensors live in).
#pragma once

#include <sys/mman.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "shardsafe/core/error.hpp"

namespace shardsafe::detail {

/// An anonymous private mapping of whole 2 MiB pages, 2 MiB aligned, with transparent huge
/// pages advised (MADV_HUGEPAGE); unmapped when destroyed. With from_hugetlb_pool it comes from
/// the huge pages the machine keeps reserved (vm.nr_hugepages) where that pool has room for it,
/// else as without (from_hugetlb_pool() tells which).
class huge_page_region {
 public:
  static constexpr std::uint64_t page = std::uint64_t(2) << 20;

  /// At least n bytes (rounded up to whole huge pages, at least one); throws errc::io_error with
  /// the errno when the mapping fails.
  static std::shared_ptr<huge_page_region> map(std::uint64_t n, bool from_hugetlb_pool = false,
                                               const char* what = "huge page region") {
    const std::uint64_t size = n <= page ? page : (n - 1) / page * page + page;
#ifdef MAP_HUGETLB
    if (from_hugetlb_pool) {  // private hugetlb mappings reserve their pages here, or fail (ENOMEM)
      void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
      if (p != MAP_FAILED) {
        auto* b = static_cast<std::byte*>(p);
        return std::shared_ptr<huge_page_region>(new huge_page_region(b, size, b, size, true));
      }
    }
#else
    (void)from_hugetlb_pool;
#endif
    // mmap aligns to 4 KiB only: map one huge page more and start at the first 2 MiB boundary inside
    void* p = ::mmap(nullptr, size + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) fail_errno(errno, std::string(what) + ": cannot map " + std::to_string(size) + " bytes");
    auto* base = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(p) + page - 1) / page * page);
#ifdef MADV_HUGEPAGE
    ::madvise(base, size, MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
    return std::shared_ptr<huge_page_region>(
        new huge_page_region(static_cast<std::byte*>(p), size + page, base, size, false));
  }

  huge_page_region(const huge_page_region&) = delete;
  huge_page_region& operator=(const huge_page_region&) = delete;
  ~huge_page_region() { ::munmap(mapped_, mapped_size_); }

  std::byte* data() const noexcept { return base_; }
  /// Usable bytes from data(): whole huge pages.
  std::uint64_t size() const noexcept { return size_; }
  bool from_hugetlb_pool() const noexcept { return hugetlb_; }

 private:
  huge_page_region(std::byte* mapped, std::uint64_t mapped_size, std::byte* base, std::uint64_t size, bool hugetlb)
      : mapped_(mapped), mapped_size_(mapped_size), base_(base), size_(size), hugetlb_(hugetlb) {}
  std::byte* mapped_;
  std::uint64_t mapped_size_;
  std::byte* base_;
  std::uint64_t size_;
  bool hugetlb_;
};

}  // namespace shardsafe::detail
