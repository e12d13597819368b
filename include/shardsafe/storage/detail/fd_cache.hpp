// shardsafe/storage/detail/fd_cache.hpp - the descriptor cache behind the file backend
// (storage/file.hpp): one descriptor per file however many storages name it, at most a share of
// the process's limit open at once, reopened by path when read again, carried over fork().
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>

#include <sys/resource.h>
#include <sys/stat.h>

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/fork_guard.hpp"
#include "shardsafe/detail/posix.hpp"

namespace shardsafe {

namespace detail {

/// The descriptors of the files file_storage objects read: one per file (device and inode),
/// however many storages name it, and at most capacity() open at once. Past it the least
/// recently used one that no read holds is closed, and opened again (by its path) when read
/// again. So a checkpoint of more files than the process may open (a 1,100-rank folder under
/// `ulimit -n 1024`), or a DCP data file whose chunks the reader names as many files, costs at
/// most capacity() descriptors. Capacity: half the soft RLIMIT_NOFILE, between 16 and 1024. A
/// file replaced at its path while its descriptor was closed is errc::io_error ("changed since
/// it was opened"). Thread-safe; the lock is not held while reading. A child made by fork()
/// reads through it as the parent did.
class fd_cache {
 public:
  struct id {
    dev_t dev = 0;
    ino_t ino = 0;
    friend bool operator<(const id& a, const id& b) { return a.dev != b.dev ? a.dev < b.dev : a.ino < b.ino; }
  };

 private:
  struct entry {
    id who;
    std::string path;
    unique_fd fd;
    std::size_t users = 0, pins = 0;
    bool in_lru = false;
    std::list<entry*>::iterator lru_at;
  };

 public:
  static fd_cache& instance() {
    static fd_cache c;
    return c;
  }

  /// Takes over fd, the file at path, for a new storage; returns the file's identity.
  id adopt(unique_fd fd, const std::string& path) {
    struct stat st;
    if (::fstat(fd.get(), &st) != 0) fail_errno(errno, path + ": fstat");
    const id who{st.st_dev, st.st_ino};
    std::lock_guard lock(m_);
    auto& slot = entries_[who];
    if (!slot) slot = std::make_unique<entry>();
    entry& e = *slot;
    e.who = who;
    e.path = path;
    ++e.users;
    if (!e.fd) {
      e.fd = std::move(fd);
      ++open_;
      touch(e);
      trim();
    }
    return who;
  }
  /// A storage of `who` is gone.
  void release(const id& who) noexcept {
    std::lock_guard lock(m_);
    auto it = entries_.find(who);
    if (it == entries_.end()) return;
    if (--it->second->users == 0 && it->second->pins == 0) erase(*it->second);
  }

  /// A descriptor of a file, held open while the lease lives.
  class lease {
   public:
    lease(fd_cache& c, entry& e) : c_(&c), e_(&e) {}
    lease(const lease&) = delete;
    lease& operator=(const lease&) = delete;
    ~lease() { c_->unpin(*e_); }
    int fd() const noexcept { return e_->fd.get(); }

   private:
    fd_cache* c_;
    entry* e_;
  };

  std::unique_ptr<lease> acquire(const id& who) {
    std::unique_lock lock(m_);
    entry& e = *entries_.at(who);
    ++e.pins;
    if (e.in_lru) {
      lru_.erase(e.lru_at);
      e.in_lru = false;
    }
    if (!e.fd) {  // closed for room: open it again by its path, and check that it is the same file
      const std::string path = e.path;
      lock.unlock();
      unique_fd fd;
      bool same = false;
      try {
        fd = open_regular_file(path);
        struct stat st;
        same = ::fstat(fd.get(), &st) == 0 && st.st_dev == who.dev && st.st_ino == who.ino;
      } catch (...) {
        lock.lock();
        unpin_locked(e);
        throw;
      }
      lock.lock();
      if (!same) {
        unpin_locked(e);
        throw error(errc::io_error, path + ": changed since it was opened (another file is at its path now)");
      }
      if (!e.fd) {
        e.fd = std::move(fd);
        ++open_;
      }
      trim();
    }
    return std::make_unique<lease>(*this, e);
  }

  /// Descriptors open now, and the most kept open.
  std::size_t open_descriptors() const {
    std::lock_guard lock(m_);
    return open_;
  }
  std::size_t capacity() const noexcept { return capacity_; }

 private:
  fd_cache() {
    struct rlimit rl;
    std::uint64_t soft = 1024;
    if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) soft = rl.rlim_cur;
    capacity_ = static_cast<std::size_t>(std::clamp<std::uint64_t>(soft / 2, 16, 1024));
    // fork (detail/fork_guard.hpp): the lock is held across it and let go in parent and child, so
    // a child never inherits it held by a thread it lacks; its descriptors are the parent's, valid
    fork_guard::instance().add({this, [](void* p) noexcept { static_cast<fd_cache*>(p)->m_.lock(); },
                                [](void* p) noexcept { static_cast<fd_cache*>(p)->m_.unlock(); },
                                [](void* p) noexcept { static_cast<fd_cache*>(p)->m_.unlock(); }});
  }
  ~fd_cache() { fork_guard::instance().remove(this); }  // at exit: a later fork no longer locks it
  void touch(entry& e) {                                // e open and unpinned: the most recently used
    if (e.in_lru) lru_.erase(e.lru_at);
    lru_.push_front(&e);
    e.lru_at = lru_.begin();
    e.in_lru = true;
  }
  void trim() {  // closes the least recently used unpinned descriptors past capacity
    while (open_ > capacity_ && !lru_.empty()) {
      entry* victim = lru_.back();
      lru_.pop_back();
      victim->in_lru = false;
      victim->fd = unique_fd();
      --open_;
    }
  }
  void erase(entry& e) noexcept {
    if (e.in_lru) lru_.erase(e.lru_at);
    if (e.fd) --open_;
    entries_.erase(e.who);
  }
  void unpin_locked(entry& e) noexcept {
    if (--e.pins > 0) return;
    if (e.users == 0) {
      erase(e);
      return;
    }
    if (e.fd) {
      touch(e);
      trim();
    }
  }
  void unpin(entry& e) noexcept {
    std::lock_guard lock(m_);
    unpin_locked(e);
  }

  mutable std::mutex m_;
  std::map<id, std::unique_ptr<entry>> entries_;
  std::list<entry*> lru_;
  std::size_t open_ = 0, capacity_ = 512;
};

}  // namespace detail

}  // namespace shardsafe
