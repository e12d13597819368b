// shardsafe/storage/concepts.hpp - what a storage backend must do.
//
// Algorithms (header parsing, loading, saving) are templates on these concepts; backends are
// plain types. There are no virtual functions: a loader over file_storage and one over
// memory_storage are different instantiations of the same code.
//
// ReadableStorage S, for `const S s`, `std::uint64_t off`, `std::span<std::byte> dst`:
//
// | expression         | type                     | requirement                                         |
// |--------------------|--------------------------|-----------------------------------------------------|
// | s.size()           | std::uint64_t            | the number of bytes stored; constant for s's life   |
// | s.read_into(off,dst)| void                    | copies bytes [off, off + dst.size()) into dst, all of|
// |                    |                          | them, or throws shardsafe::error (errc::truncated if |
// |                    |                          | the range passes size(), an io error otherwise);    |
// |                    |                          | an empty dst is a no-op. Safe to call from several  |
// |                    |                          | threads at once on the same s.                      |
// | s.name()           | std::string_view-able    | what messages call this storage (usually a path)    |
//
// MappableStorage S additionally, for `const S s`:
//
// | s.bytes()          | std::span<const std::byte>| all size() bytes, valid while s lives; read-only    |
//
// WritableStorage W, for `W w`, `std::span<const std::byte> src`:
//
// | expression         | type           | requirement                                                 |
// |--------------------|----------------|-------------------------------------------------------------|
// | w.write_at(off,src)| void           | stores src at [off, off + src.size()), growing the object;  |
// |                    |                | all of it or throws. Safe from several threads at once for  |
// |                    |                | disjoint ranges.                                            |
// | w.sync()           | void           | makes what was written durable (fsync for files)            |
// | w.commit()         | void           | publishes the object under its final name atomically: a     |
// |                    |                | reader sees the whole object or nothing. After commit no    |
// |                    |                | write is allowed. A writer destroyed without commit leaves  |
// |                    |                | no object under the final name.                             |
// | w.name()           | string_view-able| the final name, for messages                               |
//
// A WritableStorage may also write a whole object in blocks it produces itself (file_writer
// does, through O_DIRECT); the saver uses that when it is there:
//
// | expression         | type           | requirement                                                 |
// |--------------------|----------------|-------------------------------------------------------------|
// | w.write_blocks(    | void           | writes bytes [0, size) block by block: fill(off, dst), with |
// |   size, fill, o)   |                | dst a std::span<std::byte>, must put the object's bytes at  |
// |                    |                | off into all of dst (it is called from several threads at   |
// |                    |                | once); the object is then exactly size bytes. o: a          |
// |                    |                | block_write_options. Then sync() and commit() as usual.     |
//
// ReadableDirectory D (a place holding named objects: a folder, a memory map, later a bucket
// prefix or an HTTP server), for `const D d`, `std::string_view n`: the rows marked R.
// WritableDirectory D: all rows.
//
// |   | expression     | type                | requirement                                            |
// |---|----------------|---------------------|--------------------------------------------------------|
// | R | D::reader_type | a ReadableStorage   |                                                        |
// | R | d.open(n)      | D::reader_type      | opens object n for reading; errc::not_found if absent  |
// | R | d.exists(n)    | bool                |                                                        |
// | R | d.list()       | std::vector<std::string> | names of the objects directly inside, sorted      |
// | R | d.sub(n)       | D                   | the directory n inside d (not created yet)             |
// | R | d.name()       | string_view-able    | what messages call d                                   |
// |   | D::writer_type | a WritableStorage   |                                                        |
// |   | d.create(n)    | D::writer_type      | starts writing object n (visible only at commit)       |
// |   | d.remove(n)    | void                | removes object n (recursively for a sub-folder); absent is no error |
// |   | d.make()       | void                | creates d (and parents) if missing                     |
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/error.hpp"

namespace shardsafe {

template <class S>
concept ReadableStorage = requires(const S& s, std::uint64_t off, std::span<std::byte> dst) {
  { s.size() } -> std::convertible_to<std::uint64_t>;
  s.read_into(off, dst);
  { s.name() } -> std::convertible_to<std::string_view>;
};

template <class S>
concept MappableStorage = ReadableStorage<S> && requires(const S& s) {
  { s.bytes() } -> std::same_as<std::span<const std::byte>>;
};

template <class W>
concept WritableStorage = requires(W& w, std::uint64_t off, std::span<const std::byte> src) {
  w.write_at(off, src);
  w.sync();
  w.commit();
  { w.name() } -> std::convertible_to<std::string_view>;
};

/// How a storage with write_blocks writes (see above).
struct block_write_options {
  unsigned threads = 0;                                 ///< 0: detail::default_threads()
  bool direct = true;                                   ///< bypass the page cache (O_DIRECT) where possible
  std::uint64_t block_bytes = std::uint64_t(16) << 20;  ///< memory per writing thread
};

/// The readable half of a directory (see the table above): enough for loading, listing and
/// verifying, so a read-only backend (an HTTP server) needs no writers.
template <class D>
concept ReadableDirectory = requires(const D& d, std::string_view n) {
  typename D::reader_type;
  requires ReadableStorage<typename D::reader_type>;
  { d.open(n) } -> std::same_as<typename D::reader_type>;
  { d.exists(n) } -> std::convertible_to<bool>;
  { d.list() } -> std::same_as<std::vector<std::string>>;
  { d.sub(n) } -> std::same_as<D>;
  { d.name() } -> std::convertible_to<std::string_view>;
};

/// A directory that can also create, remove and make: what saving and rotation need.
template <class D>
concept WritableDirectory = ReadableDirectory<D> && requires(const D& d, std::string_view n) {
  typename D::writer_type;
  requires WritableStorage<typename D::writer_type>;
  { d.create(n) } -> std::same_as<typename D::writer_type>;
  d.remove(n);
  d.make();
};

namespace detail {
/// Throws errc::truncated, naming the storage, unless [off, off + n) lies within its size bytes.
inline void check_read_range(std::string_view name, std::uint64_t off, std::uint64_t n, std::uint64_t size) {
  if (off > size || n > size - off)
    throw error(errc::truncated, std::string(name) + ": read of " + std::to_string(n) + " bytes at offset " +
                                     std::to_string(off) + " passes the end (" + std::to_string(size) + " bytes)");
}
}  // namespace detail

/// Object names a Directory accepts: plain names, no separators, not "." or "..".
inline bool is_plain_name(std::string_view n) noexcept {
  if (n.empty() || n == "." || n == "..") return false;
  for (char c : n)
    if (c == '/' || c == '\\' || c == '\0') return false;
  return n.find("..") == std::string_view::npos;
}

}  // namespace shardsafe
