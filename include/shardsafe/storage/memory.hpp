// shardsafe/storage/memory.hpp - bytes in memory as storage: for tests, staging, and
// checkpoints that never touch a disk.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/copy.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

using byte_buffer = std::vector<std::byte>;

/// Read-only bytes shared with whoever else holds them (cheap to copy).
class memory_storage {
 public:
  memory_storage(std::shared_ptr<const byte_buffer> bytes, std::string name)
      : bytes_(std::move(bytes)), name_(std::move(name)) {}
  explicit memory_storage(byte_buffer bytes, std::string name = "<memory>")
      : bytes_(std::make_shared<const byte_buffer>(std::move(bytes))), name_(std::move(name)) {}

  std::uint64_t size() const noexcept { return bytes_->size(); }
  std::string_view name() const noexcept { return name_; }
  std::span<const std::byte> bytes() const noexcept { return *bytes_; }

  void read_into(std::uint64_t off, std::span<std::byte> dst) const {
    if (dst.empty()) return;
    detail::check_read_range(name_, off, dst.size(), size());
    detail::stream_copy(dst.data(), bytes_->data() + off, dst.size());
  }

 private:
  std::shared_ptr<const byte_buffer> bytes_;
  std::string name_;
};

/// A map of names to byte buffers, shared by every memory_directory made from it, and the
/// folders make() created (so that an empty folder exists, as on a disk).
struct memory_store {
  std::mutex mutex;
  std::map<std::string, std::shared_ptr<const byte_buffer>> objects;  // full path -> bytes
  std::set<std::string> folders;                                      // full paths made
};

/// Accumulates bytes; commit() publishes them into a memory_store under the final name
/// (or, with no store, keeps them for take()); abort() drops them. Move-only.
class memory_writer {
 public:
  explicit memory_writer(std::string name, std::shared_ptr<memory_store> store = nullptr)
      : name_(std::move(name)),
        store_(std::move(store)),
        buf_(std::make_unique<byte_buffer>()),
        mutex_(std::make_unique<std::mutex>()) {}

  std::string_view name() const noexcept { return name_; }

  void write_at(std::uint64_t off, std::span<const std::byte> src) {
    std::lock_guard lock(*mutex_);
    require_open("write");
    if (src.empty()) return;
    if (off + src.size() > buf_->size()) buf_->resize(off + src.size());
    std::memcpy(buf_->data() + off, src.data(), src.size());
  }
  void sync() {}
  void commit() {
    std::lock_guard lock(*mutex_);
    if (state_ == state::committed) throw error(errc::invalid_argument, name_ + ": committed twice");
    require_open("commit");
    state_ = state::committed;
    if (store_) {
      std::lock_guard store_lock(store_->mutex);
      store_->objects[name_] = std::shared_ptr<const byte_buffer>(std::move(buf_));
    }
  }
  /// Drops what was written; nothing is published. A second abort does nothing.
  void abort() {
    std::lock_guard lock(*mutex_);
    if (state_ == state::committed) throw error(errc::invalid_argument, name_ + ": abort after commit");
    state_ = state::aborted;
    buf_.reset();
  }
  /// The bytes written (only for a writer without a store, after commit).
  byte_buffer take() { return buf_ ? std::move(*buf_) : byte_buffer{}; }

 private:
  enum class state { open, committed, aborted };
  void require_open(const char* what) const {
    if (state_ == state::committed) throw error(errc::invalid_argument, name_ + ": " + what + " after commit");
    if (state_ == state::aborted) throw error(errc::invalid_argument, name_ + ": " + what + " after abort");
  }
  std::string name_;
  std::shared_ptr<memory_store> store_;
  std::unique_ptr<byte_buffer> buf_;
  std::unique_ptr<std::mutex> mutex_;
  state state_ = state::open;
};

/// A Directory in memory: names are paths with '/' separators into a shared memory_store.
class memory_directory {
 public:
  using reader_type = memory_storage;
  using writer_type = memory_writer;

  explicit memory_directory(std::shared_ptr<memory_store> store = std::make_shared<memory_store>(),
                            std::string prefix = "mem:")
      : store_(std::move(store)), prefix_(std::move(prefix)) {}

  std::string_view name() const noexcept { return prefix_; }
  const std::shared_ptr<memory_store>& store() const noexcept { return store_; }

  reader_type open(std::string_view n) const {
    const std::string key = child(n);
    std::lock_guard lock(store_->mutex);
    auto it = store_->objects.find(key);
    if (it == store_->objects.end()) throw error(errc::not_found, key + ": no such object");
    return memory_storage(it->second, key);
  }
  writer_type create(std::string_view n) const { return memory_writer(child(n), store_); }
  bool exists(std::string_view n) const {
    const std::string key = child(n);
    std::lock_guard lock(store_->mutex);
    if (store_->objects.count(key) || store_->folders.count(key)) return true;
    auto it = store_->objects.lower_bound(key + "/");
    return it != store_->objects.end() && it->first.rfind(key + "/", 0) == 0;
  }
  std::vector<std::string> list() const {
    const std::string pre = prefix_ + "/";
    std::set<std::string> heads;
    std::lock_guard lock(store_->mutex);
    for (auto it = store_->objects.lower_bound(pre); it != store_->objects.end(); ++it) {
      if (it->first.rfind(pre, 0) != 0) break;
      std::string rest = it->first.substr(pre.size());
      heads.insert(rest.substr(0, rest.find('/')));
    }
    for (auto it = store_->folders.lower_bound(pre); it != store_->folders.end(); ++it) {
      if (it->rfind(pre, 0) != 0) break;
      std::string rest = it->substr(pre.size());
      heads.insert(rest.substr(0, rest.find('/')));
    }
    return {heads.begin(), heads.end()};
  }
  void remove(std::string_view n) const {
    const std::string key = child(n);
    std::lock_guard lock(store_->mutex);
    store_->objects.erase(key);
    for (auto it = store_->objects.lower_bound(key + "/");
         it != store_->objects.end() && it->first.rfind(key + "/", 0) == 0;)
      it = store_->objects.erase(it);
    store_->folders.erase(key);
    for (auto it = store_->folders.lower_bound(key + "/"); it != store_->folders.end() && it->rfind(key + "/", 0) == 0;)
      it = store_->folders.erase(it);
  }
  memory_directory sub(std::string_view n) const { return memory_directory(store_, child(n)); }
  /// Records this folder and its parents below the root, so that they exist and are listed
  /// while empty, as folders on a disk are.
  void make() const {
    std::lock_guard lock(store_->mutex);
    for (std::size_t at = prefix_.find('/'); at != std::string::npos; at = prefix_.find('/', at + 1))
      if (at + 1 < prefix_.size()) store_->folders.insert(prefix_.substr(0, prefix_.find('/', at + 1)));
  }

 private:
  std::string child(std::string_view n) const {
    if (!is_plain_name(n))
      throw error(errc::invalid_argument, prefix_ + ": '" + std::string(n) + "' is not a plain object name");
    return prefix_ + "/" + std::string(n);
  }
  std::shared_ptr<memory_store> store_;
  std::string prefix_;
};

static_assert(MappableStorage<memory_storage>);
static_assert(RandomAccessWritableStorage<memory_writer>);
static_assert(WritableDirectory<memory_directory>);

}  // namespace shardsafe
