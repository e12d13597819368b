// shardsafe/storage/mmap.hpp - a read-only memory mapping of a file.
//
// read_into is a bounds-checked copy out of the mapping (with streaming stores for large
// reads: detail/copy.hpp); bytes() hands out the mapping itself (MappableStorage), and the
// loader (checkpoint/loader.hpp) copies each piece of tensor data straight out of it into
// the tensor: no read call, no staging buffer, and the gaps between merged pieces are never
// touched. A file that is truncated by someone else while mapped raises SIGBUS on access,
// as with any mapping. Move-only: the moved-from object holds no mapping.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <sys/mman.h>

#include "shardsafe/detail/copy.hpp"
#include "shardsafe/detail/posix.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/file.hpp"

namespace shardsafe {

/// How the kernel should expect the mapping to be read.
enum class access_advice { normal, sequential, random, will_need };

class mmap_storage {
 public:
  explicit mmap_storage(const std::filesystem::path& path, access_advice advice = access_advice::will_need)
      : path_(path.string()) {
    detail::unique_fd fd = detail::open_regular_file(path_);  // never a FIFO or a device
    size_ = detail::file_size_of(fd.get(), path_);
    if (size_ == 0) return;  // mmap of zero bytes is an error; an empty span serves
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (p == MAP_FAILED) fail_errno(errno, path_ + ": mmap of " + std::to_string(size_) + " bytes");
    data_ = static_cast<const std::byte*>(p);
    advise(advice);
  }
  mmap_storage(mmap_storage&& o) noexcept
      : path_(std::move(o.path_)), data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  mmap_storage& operator=(mmap_storage&& o) noexcept {
    if (this != &o) {
      unmap();
      path_ = std::move(o.path_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  mmap_storage(const mmap_storage&) = delete;
  mmap_storage& operator=(const mmap_storage&) = delete;
  ~mmap_storage() { unmap(); }

  std::uint64_t size() const noexcept { return size_; }
  std::string_view name() const noexcept { return path_; }
  std::span<const std::byte> bytes() const noexcept { return {data_, static_cast<std::size_t>(size_)}; }

  void read_into(std::uint64_t off, std::span<std::byte> dst) const {
    if (dst.empty()) return;
    detail::check_read_range(path_, off, dst.size(), size_);
    detail::stream_copy(dst.data(), data_ + off, dst.size());
  }

  /// Passes an access pattern to the kernel (madvise); failures are ignored, as advice is.
  void advise(access_advice a) const noexcept {
    if (!data_) return;
    int adv = MADV_NORMAL;
    switch (a) {
      case access_advice::normal: adv = MADV_NORMAL; break;
      case access_advice::sequential: adv = MADV_SEQUENTIAL; break;
      case access_advice::random: adv = MADV_RANDOM; break;
      case access_advice::will_need: adv = MADV_WILLNEED; break;
    }
    ::madvise(const_cast<std::byte*>(data_), size_, adv);
  }

 private:
  void unmap() noexcept {
    if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
    data_ = nullptr;
  }
  std::string path_;
  const std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
};

/// A folder whose files are read through mappings.
using mmap_directory = basic_file_directory<mmap_storage>;

static_assert(MappableStorage<mmap_storage>);
static_assert(WritableDirectory<mmap_directory>);

}  // namespace shardsafe
