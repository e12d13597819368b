// shardsafe/detail/posix.hpp - file descriptors that close themselves, and full-length
// pread/pwrite loops that retry on EINTR and continue after short transfers.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shardsafe/core/error.hpp"

namespace shardsafe::detail {

class unique_fd {
 public:
  unique_fd() noexcept = default;
  explicit unique_fd(int fd) noexcept : fd_(fd) {}
  unique_fd(unique_fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  unique_fd& operator=(unique_fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  unique_fd(const unique_fd&) = delete;
  unique_fd& operator=(const unique_fd&) = delete;
  ~unique_fd() { reset(); }

  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  /// Closes and reports a failed close (which can mean lost writes on some file systems).
  void close_checked(const std::string& what) {
    int fd = std::exchange(fd_, -1);
    if (fd >= 0 && ::close(fd) != 0 && errno != EINTR) fail_errno(errno, what + ": close");
  }

 private:
  int fd_ = -1;
};

/// Opens with O_CLOEXEC; throws naming the path.
inline unique_fd open_fd(const std::string& path, int flags, mode_t mode = 0644) {
  int fd;
  do fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    if (errno == ENOENT) throw error(errc::not_found, path + ": no such file");
    fail_errno(errno, path + ": open");
  }
  return unique_fd(fd);
}

/// What a file that is not a regular one is, for messages.
inline const char* file_type_name(mode_t m) noexcept {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISLNK(m)) return "a symbolic link";
  return "not a regular file";
}

/// Opens a regular file for reading without ever blocking in open(): O_NONBLOCK, so that a FIFO
/// (or a device) named where a checkpoint file should be returns at once; fstat; anything but a
/// regular file is errc::invalid_argument naming the path and what it is; then O_NONBLOCK is
/// cleared. Links are followed (the directory checks them before, storage/file.hpp).
inline unique_fd open_regular_file(const std::string& path) {
  unique_fd fd = open_fd(path, O_RDONLY | O_NONBLOCK);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) fail_errno(errno, path + ": fstat");
  if (!S_ISREG(st.st_mode))
    throw error(errc::invalid_argument,
                path + ": is " + std::string(file_type_name(st.st_mode)) + ", not a regular file; refusing to read it");
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) fail_errno(errno, path + ": fcntl");
  return fd;
}

inline std::uint64_t file_size_of(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) fail_errno(errno, path + ": fstat");
  if (S_ISDIR(st.st_mode)) throw error(errc::invalid_argument, path + ": is a directory, not a file");
  return static_cast<std::uint64_t>(st.st_size);
}

/// Reads exactly dst.size() bytes at off; errc::truncated if the file ends first.
inline void pread_full(int fd, std::uint64_t off, std::span<std::byte> dst, const std::string& path) {
  std::size_t done = 0;
  while (done < dst.size()) {
    // Linux transfers at most 0x7ffff000 bytes per call; ask for no more than 1 GiB.
    std::size_t want = std::min<std::size_t>(dst.size() - done, std::size_t(1) << 30);
    ssize_t r = ::pread(fd, dst.data() + done, want, static_cast<off_t>(off + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      fail_errno(errno, path + ": read of " + std::to_string(dst.size()) + " bytes at offset " + std::to_string(off));
    }
    if (r == 0)
      throw error(errc::truncated, path + ": file ends at " + std::to_string(off + done) + " while reading " +
                                       std::to_string(dst.size()) + " bytes at offset " + std::to_string(off));
    done += static_cast<std::size_t>(r);
  }
}

/// Writes exactly src.size() bytes at off.
inline void pwrite_full(int fd, std::uint64_t off, std::span<const std::byte> src, const std::string& path) {
  std::size_t done = 0;
  while (done < src.size()) {
    std::size_t want = std::min<std::size_t>(src.size() - done, std::size_t(1) << 30);
    ssize_t r = ::pwrite(fd, src.data() + done, want, static_cast<off_t>(off + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      fail_errno(errno, path + ": write of " + std::to_string(src.size()) + " bytes at offset " + std::to_string(off));
    }
    done += static_cast<std::size_t>(r);
  }
}

/// fsync of a directory, so a rename inside it is durable.
inline void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // best effort: some file systems refuse to open directories
  ::fsync(fd);
  ::close(fd);
}

/// argv or envp for exec and posix_spawn: each string's characters, then a null pointer.
/// The strings must outlive the result and not be resized while it is in use.
inline std::vector<char*> c_string_array(std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

}  // namespace shardsafe::detail
