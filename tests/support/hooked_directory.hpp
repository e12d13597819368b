// tests/support/hooked_directory.hpp - a file_directory whose writers are made through a hook, for
// tests that hold a save at a gate (test_async_save.cpp) or give its writers a quota
// (test_disk_full.cpp) without writing a directory type of their own.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "shardsafe/storage/file.hpp"

namespace testing {

/// A folder that is d in everything but create(name), which returns hook(name, make): make()
/// creates d's file_writer for name, and the hook may wait before it, wrap what it returns, or
/// both. sub() folders carry a copy of the hook.
template <class Hook>
class hooked_directory {
  struct maker {
    const shardsafe::file_directory* d;
    std::string_view name;
    shardsafe::file_writer operator()() const { return d->create(name); }
  };

 public:
  using reader_type = shardsafe::file_storage;
  using writer_type = std::invoke_result_t<const Hook&, std::string_view, maker>;

  hooked_directory(shardsafe::file_directory d, Hook hook) : d_(std::move(d)), hook_(std::move(hook)) {}
  std::string_view name() const noexcept { return d_.name(); }
  reader_type open(std::string_view n) const { return d_.open(n); }
  writer_type create(std::string_view n) const { return hook_(n, maker{&d_, n}); }
  bool exists(std::string_view n) const { return d_.exists(n); }
  std::vector<std::string> list() const { return d_.list(); }
  void remove(std::string_view n) const { d_.remove(n); }
  hooked_directory sub(std::string_view n) const { return hooked_directory(d_.sub(n), hook_); }
  void make() const { d_.make(); }

 private:
  shardsafe::file_directory d_;
  Hook hook_;
};

}  // namespace testing
