// shardsafe/checkpoint/configured.hpp - a loader configured at compile time.
//
// configured_loader<Dir, C, Policy> fixes, in its type, the three things a job decides once:
//
// | argument | what it is                                   | requirement (checked by static_assert) |
// |----------|----------------------------------------------|----------------------------------------|
// | Dir      | the storage backend: a directory type        | ReadableDirectory (storage/concepts.hpp)|
// |          | (file_directory, mmap_directory, memory_...,  |                                        |
// |          | http_directory, s3_directory)                |                                        |
// | C        | the communicator (single_process, c10d_comm,  | Comm (dist/concepts.hpp)               |
// |          | any Comm)                                    |                                        |
// | Policy   | a load_policy value: what every tensor load  | a consistent combination (below)       |
// |          | does (strict or lenient, NaN validation,     |                                        |
// |          | dtype conversion, the views' dtype)          |                                        |
//
// Everything is resolved when the type is instantiated: the calls go straight to
// checkpoint_reader<Dir> (checkpoint/loader.hpp) and every_rank_step<C> (dist/agree.hpp), with
// no virtual function, no type erasure and no branch on a backend or a communicator at run
// time; the policy's choices are constants (`if constexpr` where they change the code path).
// A wrong combination is a compile error whose message says what is wrong:
//
//   - Dir not a ReadableDirectory, C not a Comm;
//   - validate_nan with views of a dtype that has no NaN (`.views = only(dtype::I32)`);
//   - convert_dtypes with views of a dtype it cannot convert into (only F16, BF16, F32, F64).
//
// load(l, views) is a collective over C: every rank calls it with its own views; the checkpoint is
// opened on first use, and a failure on any rank (a missing tensor under a strict policy, a
// view of the wrong dtype, a NaN left after the load) is thrown on every rank alike.
//
//   using loader = configured_loader<file_directory, c10d_comm,
//                                    load_policy{.validate_nan = true, .views = only(dtype::F32)}>;
//   loader l(file_directory(dir), comm);
//   load_stats st = load(l, views);
#pragma once

#include <chrono>
#include <cstdint>
#include <concepts>
#include <optional>
#include <type_traits>
#include <span>
#include <string>
#include <utility>

#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/core/convert.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// The dtype every view of a configured load must have, or any (a structural type, so that it
/// can sit in a load_policy template argument).
struct view_dtype {
  bool fixed = false;
  dtype type = dtype::F32;
  friend constexpr bool operator==(const view_dtype&, const view_dtype&) = default;
};
/// Views of dtype t only.
constexpr view_dtype only(dtype t) noexcept { return {true, t}; }
/// Views of any dtype.
inline constexpr view_dtype any_dtype{};

/// What every tensor load of a configured loader does; a template argument (structural).
struct load_policy {
  bool strict = true;            ///< a view the checkpoint lacks is an error (else listed as missing)
  bool validate_nan = false;     ///< views filled with NaN first; a NaN left afterwards is an error
  bool convert_dtypes = false;   ///< stored F16/BF16/F32/F64 converted into views of another of them
  view_dtype views = any_dtype;  ///< the dtype the views must have (checked before a byte moves)
  friend constexpr bool operator==(const load_policy&, const load_policy&) = default;
};

/// Common policies.
inline constexpr load_policy strict_policy{};
inline constexpr load_policy lenient_policy{.strict = false};

/// Whether P is a consistent combination (what configured_loader's static_asserts check).
constexpr bool is_consistent(const load_policy& p) noexcept {
  if (!p.views.fixed) return true;
  if (p.validate_nan && !has_nan(p.views.type)) return false;
  if (p.convert_dtypes && !is_convertible_float(p.views.type)) return false;
  return true;
}

namespace detail {
/// checkpoint_reader<D>, named only when D is a ReadableDirectory (so that a wrong Dir gives
/// configured_loader's static_assert message and not a constraint failure inside it).
template <class D, bool = ReadableDirectory<D>>
struct reader_for {
  using type = int;
};
template <class D>
struct reader_for<D, true> {
  using type = checkpoint_reader<D>;
};
}  // namespace detail

/// What a configured loader's loads may set besides its policy: the load_options fields that
/// load_policy does not fix and a load of flat views honours, each meaning what it means there
/// (checkpoint/load_options.hpp; staging and convert_on_device concern loads into device
/// memory, which a configured loader does not make).
struct configured_load_settings {
  unsigned threads = 0;
  read_settings reads{};
  bool list_unexpected = true;
  bool verify_checksums = false;
};

/// A loader whose storage backend, communicator and per-tensor policy are fixed at compile
/// time (see the top of this header).
template <class Dir, class C, load_policy Policy = strict_policy>
class configured_loader {
  static_assert(ReadableDirectory<Dir>,
                "configured_loader<Dir, C, Policy>: Dir must model shardsafe::ReadableDirectory "
                "(storage/concepts.hpp): a directory type such as file_directory, mmap_directory, "
                "memory_directory, http_directory or s3_directory");
  static_assert(Comm<C>,
                "configured_loader<Dir, C, Policy>: C must model shardsafe::Comm (dist/concepts.hpp): "
                "single_process, c10d_comm, or a type with rank(), world_size(), barrier(), "
                "all_gather_bytes() and broadcast_bytes()");
  static_assert(!(Policy.validate_nan && Policy.views.fixed && !has_nan(Policy.views.type)),
                "configured_loader: load_policy asks for validate_nan, but its views' dtype "
                "(load_policy::views) has no NaN: NaN validation needs floating views");
  static_assert(!(Policy.convert_dtypes && Policy.views.fixed && !is_convertible_float(Policy.views.type)),
                "configured_loader: load_policy asks for convert_dtypes, but its views' dtype "
                "(load_policy::views) is not F16, BF16, F32 or F64, the only dtypes a load converts into");

 public:
  using directory_type = Dir;
  using comm_type = C;
  static constexpr load_policy policy = Policy;

  /// A loader of the checkpoint in dir over comm (kept by reference), with `settings` for every
  /// load (the load_options fields Policy does not fix: threads, reads, checksums, ...).
  configured_loader(Dir dir, C& comm, configured_load_settings settings = {}) : dir_(std::move(dir)), comm_(&comm) {
    opt_.threads = settings.threads;
    opt_.reads = settings.reads;
    opt_.list_unexpected = settings.list_unexpected;
    opt_.verify_checksums = settings.verify_checksums;
    opt_.strict = Policy.strict;
    opt_.validate_nan = Policy.validate_nan;
    opt_.convert_dtypes = Policy.convert_dtypes;
    if constexpr (Policy.views.fixed) opt_.view_dtype = Policy.views.type;
  }
  /// A whole load_options is refused at compile time: its strict, validate_nan, convert_dtypes
  /// and view_dtype are the policy's, and were dropped here before.
  template <class O>
    requires std::same_as<std::remove_cvref_t<O>, load_options>
  configured_loader(Dir, C&, O&&) {
    static_assert(!std::is_same_v<O, O>,
                  "configured_loader: pass configured_load_settings, not load_options: load_options' strict, "
                  "validate_nan, convert_dtypes and view_dtype are the load_policy's (a template argument)");
  }

  /// The load_options every load runs with.
  const load_options& options() const noexcept { return opt_; }
  const Dir& directory() const noexcept { return dir_; }

  /// (now shardsafe::load(loader, views))
  [[deprecated("configured_loader::load(views) is shardsafe::load(loader, views) (CHANGELOG)")]]
  load_stats load(std::span<const flat_view> views) {
    return detail::load_keeping_reader(dir_, reader_, views, *comm_, opt_);
  }

  template <class D2, class C2, load_policy P2>
  friend load_stats load(configured_loader<D2, C2, P2>& l, std::span<const flat_view> views);

 private:
  Dir dir_;
  C* comm_;
  load_options opt_;
  std::optional<typename detail::reader_for<Dir>::type> reader_;
};

/// Loads this rank's views through a configured loader: the collective load
/// (checkpoint/load.hpp) with l.options(), the reader opened on first use and kept. Throws on
/// every rank the first failure of any rank, with its code.
template <class Dir, class C, load_policy Policy>
load_stats load(configured_loader<Dir, C, Policy>& l, std::span<const flat_view> views) {
  return detail::load_keeping_reader(l.dir_, l.reader_, views, *l.comm_, l.opt_);
}

/// (a loader made for one load: load(make_configured_loader(dir, comm), views))
template <class Dir, class C, load_policy Policy>
load_stats load(configured_loader<Dir, C, Policy>&& l, std::span<const flat_view> views) {
  return load(l, views);
}

/// A configured loader with Dir and C deduced: make_configured_loader<policy>(dir, comm).
template <load_policy Policy = strict_policy, class Dir, class C>
configured_loader<Dir, C, Policy> make_configured_loader(Dir dir, C& comm, configured_load_settings settings = {}) {
  return configured_loader<Dir, C, Policy>(std::move(dir), comm, settings);
}
/// (a whole load_options: refused at compile time, as by the constructor)
template <load_policy Policy = strict_policy, class Dir, class C, class O>
  requires std::same_as<std::remove_cvref_t<O>, load_options>
configured_loader<Dir, C, Policy> make_configured_loader(Dir dir, C& comm, O&& o) {
  return configured_loader<Dir, C, Policy>(std::move(dir), comm, std::forward<O>(o));
}

}  // namespace shardsafe
