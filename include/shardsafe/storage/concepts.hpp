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
// The loader copies straight out of bytes() when a storage has it (no read call, no staging).
//
// BatchReadableStorage S additionally, for `const S s`, `std::span<const read_request> rs`:
//
// | expression         | type           | requirement                                                 |
// |--------------------|----------------|-------------------------------------------------------------|
// | s.read_batch(rs)   | void           | reads bytes [rs[i].offset, rs[i].offset + rs[i].dst.size()) |
// |                    |                | into rs[i].dst for every i, in any order and as             |
// |                    |                | concurrently as the backend likes (one scatter request,     |
// |                    |                | pipelined range GETs); returns when all have landed, or     |
// |                    |                | throws as read_into would for a failed one (the other dst   |
// |                    |                | then hold unspecified bytes). The dst spans do not overlap. |
// |                    |                | Safe from several threads at once. The loader hands it one  |
// |                    |                | batch per file and falls back to read_into without it.      |
//
// HintedStorage S (any storage may be one) suggests how reads of it are best merged and
// issued, for `const S s`:
//
// | s.read_defaults()  | read_settings  | the backend's gap, largest read and requests in flight;     |
// |                    |                | fields left empty take the library's defaults               |
//
// read_defaults_of(s) is that hint, or an empty one for a storage without it. The loader
// takes each setting from load_options when set there, else from the hint, else its own
// default (checkpoint/loader.hpp).
//
// Writers. WritableStorage W (every writer), for `W w`:
//
// | expression         | type           | requirement                                                 |
// |--------------------|----------------|-------------------------------------------------------------|
// | w.sync()           | void           | makes what was written durable (fsync for files)            |
// | w.commit()         | void           | publishes the object under its final name atomically: a     |
// |                    |                | reader sees the whole object or nothing. After commit no    |
// |                    |                | write is allowed.                                           |
// | w.abort()          | void           | discards what was written (removes a temporary file, aborts |
// |                    |                | a multipart upload); throws if that fails, which a          |
// |                    |                | destructor could not report. Afterwards no write or commit  |
// |                    |                | is allowed; a second abort is a no-op; abort after commit   |
// |                    |                | throws errc::invalid_argument. A writer destroyed without   |
// |                    |                | commit or abort discards quietly (best effort). Either way  |
// |                    |                | nothing appears under the final name.                       |
// | w.name()           | string_view-able| the final name, for messages                               |
//
// A writer has one of two shapes (or both); the saver dispatches on them, preferring blocks.
// RandomAccessWritableStorage W additionally, for `std::uint64_t off`, `std::span<const std::byte> src`:
//
// | w.write_at(off,src)| void           | stores src at [off, off + src.size()), growing the object;  |
// |                    |                | all of it or throws. Safe from several threads at once for  |
// |                    |                | disjoint ranges, in any order. (file_writer, memory_writer) |
//
// BlockWritableStorage W additionally, for `std::uint64_t size`, `fill` a callable
// `void(std::uint64_t off, std::span<std::byte> dst)`, `block_write_options o`:
//
// | w.write_blocks(    | void           | writes bytes [0, size) as blocks of the writer's choosing:  |
// |   size, fill, o)   |                | fill(off, dst) must put the object's bytes at off into all  |
// |                    |                | of dst; it is called once per block, in any order, from     |
// |                    |                | several threads at once, and each block is written whole    |
// |                    |                | (an S3 multipart upload: block i is part i). The object is  |
// |                    |                | then exactly size bytes. An exception from fill is          |
// |                    |                | rethrown. Then sync() and commit() (or abort()) as usual.   |
// |                    |                | (file_writer, through O_DIRECT)                             |
//
// A backend states the shapes it has with static_assert next to its definition, so a
// misspelt member fails to compile there instead of quietly taking the slower shape.
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
// |   | D::writer_type | a WritableStorage   | random-access, block-writing, or both                  |
// |   | d.create(n)    | D::writer_type      | starts writing object n (visible only at commit)       |
// |   | d.remove(n)    | void                | removes object n (recursively for a sub-folder); absent is no error |
// |   | d.make()       | void                | creates d (and parents) if missing; afterwards         |
// |   |                |                     | parent.exists(n) is true and parent.list() names n for |
// |   |                |                     | d = parent.sub(n), even while d holds nothing (S3: a   |
// |   |                |                     | "n/" marker object), until parent.remove(n)            |
//
// Copy and move (pinned down by tests/storage/test_storage.cpp):
// - Directories are cheap to copy; a copy names the same place (file: the same folder,
//   memory: the same memory_store), so what one writes the other sees.
// - memory_storage is copyable; copies share the same immutable bytes. file_storage and
//   mmap_storage are move-only (they own a descriptor or a mapping).
// - Writers are move-only; the moved-to writer carries on (commit, abort), the moved-from
//   one may only be destroyed, which then does nothing.
// - A moved-from storage may only be destroyed or assigned to.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/core/read_settings.hpp"

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

/// One read of a batch: bytes [offset, offset + dst.size()) into dst.
struct read_request {
  std::uint64_t offset = 0;
  std::span<std::byte> dst;
};

template <class S>
concept BatchReadableStorage =
    ReadableStorage<S> && requires(const S& s, std::span<const read_request> rs) { s.read_batch(rs); };

// A backend's suggestion for how reads of it are merged and issued (see the table above) is a
// read_settings (core/read_settings.hpp); an empty field takes the library's default.

template <class S>
concept HintedStorage = requires(const S& s) {
  { s.read_defaults() } -> std::convertible_to<read_settings>;
};

/// The backend's read hint (HintedStorage), or an empty one.
template <ReadableStorage S>
read_settings read_defaults_of(const S& s) {
  if constexpr (HintedStorage<S>)
    return s.read_defaults();
  else
    return {};
}

template <class W>
concept WritableStorage = requires(W& w) {
  w.sync();
  w.commit();
  w.abort();
  { w.name() } -> std::convertible_to<std::string_view>;
};

template <class W>
concept RandomAccessWritableStorage =
    WritableStorage<W> && requires(W& w, std::uint64_t off, std::span<const std::byte> src) { w.write_at(off, src); };

/// How a storage with write_blocks writes (see above).
struct block_write_options {
  unsigned threads = 0;                                 ///< 0: detail::default_threads()
  bool direct = true;                                   ///< bypass the page cache (O_DIRECT) where possible
  std::uint64_t block_bytes = std::uint64_t(16) << 20;  ///< memory per writing thread
};

namespace detail {
/// A fill callback that writes nothing: what BlockWritableStorage probes write_blocks with.
struct block_fill_archetype {
  void operator()(std::uint64_t, std::span<std::byte>) const noexcept {}
};
}  // namespace detail

template <class W>
concept BlockWritableStorage = WritableStorage<W> && requires(W& w, std::uint64_t size, const block_write_options& o) {
  w.write_blocks(size, detail::block_fill_archetype{}, o);
};

namespace detail {
/// Runs f(); if it throws, aborts w and rethrows the exception. Should abort fail too, the
/// error thrown keeps the first one's code (when it has one) and tells both messages.
template <WritableStorage W, class F>
void abort_on_failure(W& w, F&& f) {
  try {
    f();
  } catch (...) {
    std::exception_ptr first = std::current_exception();
    try {
      w.abort();
    } catch (const std::exception& a) {
      try {
        std::rethrow_exception(first);
      } catch (const std::system_error& e) {
        throw error(e.code(), std::string(e.what()) + "; then aborting the write failed: " + a.what());
      } catch (const std::exception& e) {
        throw error(errc::io_error, std::string(e.what()) + "; then aborting the write failed: " + a.what());
      } catch (...) {
        throw error(errc::io_error, std::string(w.name()) + ": a write failed; then aborting it failed: " + a.what());
      }
    }
    std::rethrow_exception(first);
  }
}
}  // namespace detail

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
  requires RandomAccessWritableStorage<typename D::writer_type> || BlockWritableStorage<typename D::writer_type>;
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
