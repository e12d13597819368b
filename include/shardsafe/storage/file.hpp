// shardsafe/storage/file.hpp - the file backend: pread for reading, a temporary file plus
// fsync and rename for writing (whole files optionally through O_DIRECT), and a folder as a
// Directory.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include <sys/resource.h>
#include <sys/stat.h>

#include "shardsafe/detail/posix.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/detail/fd_cache.hpp"

namespace shardsafe {

/// A file read with pread. Reads from several threads at once are safe. Move-only. Only a regular
/// file opens: a FIFO, a device or a socket is errc::invalid_argument at once (never a blocked open).
/// Its descriptor is shared with every other file_storage of the same file and may be closed for
/// room and opened again (detail::fd_cache): a process reads any number of files under its limit.
class file_storage {
 public:
  explicit file_storage(const std::filesystem::path& path) : path_(path.string()) {
    detail::unique_fd fd = detail::open_regular_file(path_);
    size_ = detail::file_size_of(fd.get(), path_);
    who_ = detail::fd_cache::instance().adopt(std::move(fd), path_);
    owns_ = true;
  }
  file_storage(file_storage&& o) noexcept
      : path_(std::move(o.path_)), size_(o.size_), who_(o.who_), owns_(std::exchange(o.owns_, false)) {}
  file_storage& operator=(file_storage&& o) noexcept {
    if (this != &o) {
      if (owns_) detail::fd_cache::instance().release(who_);
      path_ = std::move(o.path_);
      size_ = o.size_;
      who_ = o.who_;
      owns_ = std::exchange(o.owns_, false);
    }
    return *this;
  }
  file_storage(const file_storage&) = delete;
  file_storage& operator=(const file_storage&) = delete;
  ~file_storage() {
    if (owns_) detail::fd_cache::instance().release(who_);
  }

  std::uint64_t size() const noexcept { return size_; }
  std::string_view name() const noexcept { return path_; }

  void read_into(std::uint64_t off, std::span<std::byte> dst) const {
    if (dst.empty()) return;
    detail::check_read_range(path_, off, dst.size(), size_);
    const auto held = detail::fd_cache::instance().acquire(who_);
    detail::pread_full(held->fd(), off, dst, path_);
  }

  /// Reads in flight: the host's threads, at least 8 and at most 16. A cold read of a local
  /// disk waits on the device, not the CPU, and wants requests queued (bench_layouts on a
  /// 2-core VM: whole loads 1.1-1.9x faster cold at 8 than at 2, warm unchanged); 16 is where
  /// reads from the page cache stopped gaining on a 16-core host (bench_device).
  read_settings read_defaults() const {
    read_settings h;
    h.requests_in_flight = std::clamp(std::thread::hardware_concurrency(), 8u, 16u);
    return h;
  }

 private:
  std::string path_;
  std::uint64_t size_ = 0;
  detail::fd_cache::id who_{};
  bool owns_ = false;
};

namespace detail {
inline std::string temp_name_for(const std::string& final_path) {
  static std::atomic<std::uint64_t> counter{0};
  auto t = std::chrono::steady_clock::now().time_since_epoch().count();
  return final_path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(t) + "." +
         std::to_string(counter.fetch_add(1));
}

/// The alignment O_DIRECT transfers use here (memory address, file offset and length): the
/// common logical block size of disks and page size of file systems.
inline constexpr std::uint64_t direct_io_alignment = 4096;

/// pwrite on an O_DIRECT descriptor; returns the bytes written, fewer than src.size() (maybe 0)
/// when the kernel refuses the transfer (EINVAL: alignment or O_DIRECT not supported) or
/// stops at a length it cannot continue from. Other errors throw naming `path`.
inline std::size_t pwrite_direct(int fd, std::uint64_t off, std::span<const std::byte> src, const std::string& path) {
  std::size_t done = 0;
  while (done < src.size()) {
    const std::size_t want = std::min<std::size_t>(src.size() - done, std::size_t(1) << 30);
    const ssize_t r = ::pwrite(fd, src.data() + done, want, static_cast<off_t>(off + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EINVAL) return done;
      fail_errno(errno, path + ": O_DIRECT write of " + std::to_string(src.size()) + " bytes at offset " +
                            std::to_string(off));
    }
    done += static_cast<std::size_t>(r);
    if (r == 0 || done % direct_io_alignment != 0) return done;
  }
  return done;
}

/// A staging block aligned for O_DIRECT (free()d by its deleter).
struct aligned_free {
  void operator()(std::byte* p) const noexcept { std::free(p); }
};
using aligned_block = std::unique_ptr<std::byte, aligned_free>;
inline aligned_block allocate_aligned_block(std::size_t size) {
  auto* p = static_cast<std::byte*>(std::aligned_alloc(direct_io_alignment, size));
  if (!p) throw std::bad_alloc();
  return aligned_block(p);
}
}  // namespace detail

/// Writes a file under a temporary name beside its final one; commit() fsyncs, renames it
/// into place and fsyncs the folder; abort() removes the temporary and reports a failure to.
/// Destroyed without either, it removes the temporary quietly. Move-only.
class file_writer {
 public:
  explicit file_writer(const std::filesystem::path& final_path)
      : final_(final_path.string()),
        temp_(detail::temp_name_for(final_)),
        fd_(detail::open_fd(temp_, O_WRONLY | O_CREAT | O_EXCL | O_TRUNC, 0644)) {}
  file_writer(file_writer&& o) noexcept
      : final_(std::move(o.final_)),
        temp_(std::move(o.temp_)),
        fd_(std::move(o.fd_)),
        done_(o.done_),
        committed_(o.committed_) {
    o.done_ = true;  // the moved-from writer owns no temporary
  }
  file_writer& operator=(file_writer&&) = delete;
  file_writer(const file_writer&) = delete;
  ~file_writer() {
    if (!done_) {
      fd_.reset();
      ::unlink(temp_.c_str());
    }
  }

  std::string_view name() const noexcept { return final_; }
  /// The temporary name it writes under until commit() (file_part_writer opens it by that).
  const std::string& temp_path() const noexcept { return temp_; }

  /// Sets the final size up front (lets the file system allocate in one go).
  void reserve(std::uint64_t size) {
    if (::ftruncate(fd_.get(), static_cast<off_t>(size)) != 0) fail_errno(errno, final_ + ": ftruncate");
  }
  void write_at(std::uint64_t off, std::span<const std::byte> src) {
    require_open();
    detail::pwrite_full(fd_.get(), off, src, final_);
  }

  /// Writes the whole file, bytes [0, size), in blocks that fill(offset, dst) produces
  /// (fill must write all of dst; it is called once per block, from several threads at once);
  /// afterwards the file is exactly `size` bytes. With o.direct the blocks go out through an
  /// O_DIRECT descriptor: nothing is copied into the page cache, so a large durable write runs
  /// at the device's speed rather than at the speed of filling page-cache pages (bench_checkpoint
  /// measures both), and the file is not cached afterwards. Where the file system refuses
  /// O_DIRECT (at open or at a write) the blocks are written with ordinary pwrite. Memory:
  /// one block per thread. sync() and commit() as after write_at.
  template <class Fill>
  void write_blocks(std::uint64_t size, Fill&& fill, const block_write_options& o = {}) {
    require_open();
    constexpr std::uint64_t align = detail::direct_io_alignment;
    const std::uint64_t block = std::max(align, (o.block_bytes + align - 1) / align * align);
    detail::unique_fd dfd;
#ifdef O_DIRECT
    if (o.direct) {
      int fd;
      do fd = ::open(temp_.c_str(), O_WRONLY | O_CLOEXEC | O_DIRECT);
      while (fd < 0 && errno == EINTR);
      if (fd >= 0) dfd = detail::unique_fd(fd);  // else: refused here, write through the page cache
    }
#endif
    std::atomic<bool> direct{static_cast<bool>(dfd)};
    detail::spare_pool<detail::aligned_block> pool;  // at most one block per thread that writes at once
    const std::uint64_t blocks = (size + block - 1) / block;
    detail::parallel_for(static_cast<std::size_t>(blocks), o.threads, [&](std::size_t i) {
      detail::aligned_block buf = pool.take();
      if (!buf) buf = detail::allocate_aligned_block(static_cast<std::size_t>(block));
      const std::uint64_t off = i * block, len = std::min(block, size - off);
      const std::span<std::byte> dst(buf.get(), static_cast<std::size_t>(len));
      fill(off, dst);
      std::size_t done = 0;
      if (direct.load(std::memory_order_relaxed)) {
        const std::uint64_t padded = (len + align - 1) / align * align;  // the last block: zeros past the end
        std::memset(buf.get() + len, 0, static_cast<std::size_t>(padded - len));
        done = detail::pwrite_direct(dfd.get(), off, {buf.get(), static_cast<std::size_t>(padded)}, final_);
        if (done < padded) direct = false;  // refused: ordinary writes from now on
      }
      if (done < len) detail::pwrite_full(fd_.get(), off + done, dst.subspan(done), final_);
      pool.give(std::move(buf));
    });
    dfd.reset();
    if (::ftruncate(fd_.get(), static_cast<off_t>(size)) != 0) fail_errno(errno, final_ + ": ftruncate");
  }
  void sync() {
    require_open();
    if (::fdatasync(fd_.get()) != 0) fail_errno(errno, final_ + ": fdatasync");
  }
  void commit() {
    require_open();
    fd_.close_checked(final_);
    if (::rename(temp_.c_str(), final_.c_str()) != 0) fail_errno(errno, final_ + ": rename from " + temp_);
    done_ = committed_ = true;
    detail::fsync_dir(std::filesystem::path(final_).parent_path().string());
  }
  /// Closes and removes the temporary file; the final name is untouched. Throws (naming the
  /// temporary) if it cannot be removed. A second abort does nothing.
  void abort() {
    if (committed_) throw error(errc::invalid_argument, final_ + ": abort after commit");
    if (done_) return;
    done_ = true;
    fd_.reset();
    if (::unlink(temp_.c_str()) != 0 && errno != ENOENT)
      fail_errno(errno, final_ + ": abort: removing the temporary " + temp_);
  }

 private:
  void require_open() const {
    if (committed_) throw error(errc::invalid_argument, final_ + ": write after commit");
    if (done_ || !fd_) throw error(errc::invalid_argument, final_ + ": write after abort");
  }
  std::string final_;
  std::string temp_;
  detail::unique_fd fd_;
  bool done_ = false;  ///< committed or aborted: no temporary left to remove
  bool committed_ = false;
};

/// Positional writes into a file that a file_writer of another process (or thread) created and
/// will commit: the ranks of one job filling one file on a shared file system, each its own
/// byte ranges, open it by the creator's temp_path(). It never renames or removes the file;
/// finish() makes its writes durable (fdatasync) and closes. Move-only.
class file_part_writer {
 public:
  /// temp_path: the creator's file_writer::temp_path(); name: the final name, for messages.
  file_part_writer(std::string temp_path, std::string name)
      : name_(std::move(name)), fd_(detail::open_fd(temp_path, O_WRONLY)) {}

  std::string_view name() const noexcept { return name_; }
  void write_at(std::uint64_t off, std::span<const std::byte> src) {
    if (!fd_) throw error(errc::invalid_argument, name_ + ": write after finish");
    detail::pwrite_full(fd_.get(), off, src, name_);
  }
  void finish() {
    if (!fd_) return;
    if (::fdatasync(fd_.get()) != 0) fail_errno(errno, name_ + ": fdatasync");
    fd_.close_checked(name_);
  }

 private:
  std::string name_;
  detail::unique_fd fd_;
};

/// What a folder-backed Directory does with a symbolic link it is asked to open (a rank file,
/// an HF shard or index, metadata.json, a sub-folder of a checkpoint pair).
enum class link_policy {
  /// The default. A link whose target, fully resolved, lies inside the folder (for sub(): the
  /// folder it was made from) is followed; one that leaves it is refused with
  /// errc::unsafe_link, so a checkpoint cannot make a reader open files elsewhere on the
  /// machine. One layout is allowed besides: the Hugging Face hub cache, where the files of
  /// `.../snapshots/REV/` are links into `.../blobs/`.
  inside,
  /// Every link is followed (a folder the caller trusts; the tool's --follow-links).
  follow,
};

/// A folder of files as a Directory; Reader is file_storage or mmap_storage. Links are
/// followed as its link_policy says (checked when an object is opened).
template <ReadableStorage Reader>
class basic_file_directory {
 public:
  using reader_type = Reader;
  using writer_type = file_writer;

  explicit basic_file_directory(std::filesystem::path root, link_policy links = link_policy::inside)
      : root_(std::move(root)), name_(root_.string()), boundary_(root_), links_(links) {}

  const std::filesystem::path& path() const noexcept { return root_; }
  std::string_view name() const noexcept { return name_; }
  link_policy links() const noexcept { return links_; }

  reader_type open(std::string_view n) const {
    auto p = child(n);
    check_link(p);
    return reader_type(p);
  }
  writer_type create(std::string_view n) const { return writer_type(child(n)); }
  bool exists(std::string_view n) const {
    std::error_code ec;
    return std::filesystem::exists(child(n), ec);
  }
  std::vector<std::string> list() const {
    std::vector<std::string> out;
    std::error_code ec;
    for (std::filesystem::directory_iterator it(root_, ec), end; !ec && it != end; it.increment(ec))
      out.push_back(it->path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
  void remove(std::string_view n) const {
    std::error_code ec;
    std::filesystem::remove_all(child(n), ec);
    if (ec) throw error(ec, (root_ / std::string(n)).string() + ": remove: " + ec.message());
  }
  /// The folder n inside this one; a link there must stay inside this folder's boundary too.
  basic_file_directory sub(std::string_view n) const {
    auto p = child(n);
    check_link(p);
    basic_file_directory d(p, links_);
    d.boundary_ = boundary_;
    return d;
  }
  void make() const {
    std::error_code ec;
    std::filesystem::create_directories(root_, ec);
    if (ec) throw error(ec, name_ + ": create directory: " + ec.message());
  }

 private:
  std::filesystem::path child(std::string_view n) const {
    if (!is_plain_name(n))
      throw error(errc::invalid_argument, name_ + ": '" + std::string(n) + "' is not a plain file name");
    return root_ / std::string(n);
  }
  static bool within(const std::filesystem::path& p, const std::filesystem::path& folder) {
    const auto rel = p.lexically_relative(folder);
    return !rel.empty() && *rel.begin() != "..";
  }
  // Refuses (link_policy::inside) a link at p whose target leaves the boundary. A missing or
  // dangling p is left to the open, which reports it as not found.
  void check_link(const std::filesystem::path& p) const {
    if (links_ == link_policy::follow) return;
    std::error_code ec;
    if (!std::filesystem::is_symlink(std::filesystem::symlink_status(p, ec)) || ec) return;
    const auto target = std::filesystem::canonical(p, ec);
    if (ec) return;
    const auto bound = std::filesystem::canonical(boundary_, ec);
    if (ec || within(target, bound)) return;
    // the Hugging Face hub cache: snapshots/REV/NAME -> ../../blobs/HASH
    const auto here = std::filesystem::canonical(root_, ec);
    if (!ec && here.parent_path().filename() == "snapshots" &&
        within(target, here.parent_path().parent_path() / "blobs"))
      return;
    throw error(errc::unsafe_link,
                p.string() + ": a symbolic link to " + target.string() + ", outside the folder " + boundary_.string() +
                    "; refused (a checkpoint's links must stay inside its folder; to trust this "
                    "one, open the folder with link_policy::follow, or pass --follow-links to the tool)");
  }
  std::filesystem::path root_;
  std::string name_;
  std::filesystem::path boundary_;  ///< links must resolve inside it (link_policy::inside)
  link_policy links_ = link_policy::inside;
};

using file_directory = basic_file_directory<file_storage>;

static_assert(ReadableStorage<file_storage>);
static_assert(RandomAccessWritableStorage<file_writer> && BlockWritableStorage<file_writer>,
              "file_writer writes at random offsets and in whole blocks (O_DIRECT)");
static_assert(WritableDirectory<file_directory>);

}  // namespace shardsafe
