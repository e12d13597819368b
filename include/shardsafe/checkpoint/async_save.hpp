// shardsafe/checkpoint/async_save.hpp - saves whose writing runs in the background: the
// calling (training) thread pays for the plan agreement and a copy of its tensors into
// staging memory, and goes on; the rank files, their fsync and the commit happen on a
// background thread.
//
//   async_saver<C> saver(checkpoint_comm);          // C: its own process group (see below)
//   async_save_handle h = saver.save(dir, views);   // returns once the views are copied
//   ... train: the views' memory may change from here on ...
//   save_stats st = h.wait().folders[0];            // durable; rethrows the save's error
//
// What runs where (each step a collective over the saver's comm, agreed by every rank as in
// checkpoint/saver.hpp, so an error anywhere is thrown everywhere):
//
// | step                                   | thread      | errors reach the caller through |
// |----------------------------------------|-------------|---------------------------------|
// | wait for the previous save of this saver| caller      | (the previous handle's wait)    |
// | 1. plan agreement (metadata of views)  | caller      | save() throws                   |
// | snapshot into staging                  | caller      | save() throws (agreed)          |
// | 2-4. prepare dir, rank files, commit   | background  | handle.wait() rethrows          |
//
// Staging memory belongs to the saver and is reused from save to save; it grows (never
// shrinks) to the largest state saved, is 2 MiB aligned with transparent huge pages advised,
// and its allocation can be replaced (pinned host memory for CUDA tensors: torch/async_checkpointer.hpp).
//
// Rules a caller relies on:
// - One save of a saver at a time: save() first waits for the one in flight (its errors are
//   left to its handle). Destroying a handle, or the saver, waits for its save.
// - The save's collectives run over the saver's own comm. With c10d, give it a process group
//   of its own (c10d_world::new_group()): its collectives then never interleave with the
//   training job's, as torch's async checkpointing uses a separate group.
// - A save that fails or is killed in the background never leaves a loadable checkpoint: the
//   commit mark (metadata.json) is written last, by rename, as in every save. The previous
//   checkpoint (another folder) is never touched; rotation (checkpoint/rotation.hpp) counts
//   only complete folders, so it keeps the newest complete one while a save is in flight.
#pragma once

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/detail/huge_pages.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// Host memory the snapshot of a save is copied into, kept from save to save.
class staging_buffer {
 public:
  /// Allocates n bytes (n > 0): returns the memory and what frees it. The default allocation
  /// is 2 MiB aligned anonymous memory with MADV_HUGEPAGE advised.
  using allocator = std::function<std::shared_ptr<std::byte>(std::uint64_t n)>;

  staging_buffer() = default;
  explicit staging_buffer(allocator alloc) : alloc_(std::move(alloc)) {}

  /// At least n bytes; reallocates (contents lost) only when n exceeds the capacity. New memory
  /// is touched once, in parallel on `threads` threads, so the snapshot copies into pages that
  /// are already there.
  std::byte* reserve(std::uint64_t n, unsigned threads = 0) {
    if (n <= capacity_) return mem_.get();
    mem_.reset();
    capacity_ = 0;
    const std::uint64_t cap = round_up(n, huge_page);
    mem_ = alloc_ ? alloc_(cap) : default_allocate(cap);
    if (!mem_) fail_errno(ENOMEM, "async save: cannot allocate " + std::to_string(cap) + " bytes of staging memory");
    capacity_ = cap;
    const std::uint64_t piece = std::uint64_t(16) << 20;
    const std::uint64_t pieces = (cap + piece - 1) / piece;
    std::byte* base = mem_.get();
    detail::shared_pool().parallel_for(static_cast<std::size_t>(pieces), threads, [&](std::size_t i) {
      const std::uint64_t off = i * piece;
      std::memset(base + off, 0, static_cast<std::size_t>(std::min(piece, cap - off)));
    });
    return mem_.get();
  }
  std::uint64_t capacity() const noexcept { return capacity_; }
  std::byte* data() const noexcept { return mem_.get(); }
  /// Gives the memory back (the next save allocates again).
  void release() noexcept {
    mem_.reset();
    capacity_ = 0;
  }

  static constexpr std::uint64_t huge_page = detail::huge_page_region::page;

 private:
  static std::uint64_t round_up(std::uint64_t n, std::uint64_t a) { return (n + a - 1) / a * a; }
  static std::shared_ptr<std::byte> default_allocate(std::uint64_t n) {
    auto r = detail::huge_page_region::map(n, false, "async save: staging memory");
    return std::shared_ptr<std::byte>(r, r->data());  // shares the region's ownership
  }

  allocator alloc_;
  std::shared_ptr<std::byte> mem_;
  std::uint64_t capacity_ = 0;
};

/// What an asynchronous save did.
struct async_save_stats {
  std::vector<save_stats> folders;  ///< one per folder saved, in commit order
  double waited_seconds = 0;        ///< caller: waiting for the previous save of the saver
  double stall_seconds = 0;         ///< caller: all of save() (waiting, agreement, snapshot)
  double snapshot_seconds = 0;      ///< caller: the copy into staging
  double seconds = 0;               ///< from save() to the commit of the last folder
  std::uint64_t staged_bytes = 0;   ///< bytes copied into staging on this rank
};

namespace detail {

/// The shared state of one background save.
struct async_save_state {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  async_save_stats result;

  void finish(std::exception_ptr e) {
    {
      std::lock_guard lock(m);
      error = std::move(e);
      done = true;
    }
    cv.notify_all();
  }
  void wait_done() {
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return done; });
  }
};

/// The default snapshot copy: the bytes of the caller's view, from byte off.
struct copy_view_bytes {
  void operator()(std::size_t, const flat_view& src, std::uint64_t off, std::span<std::byte> dst) const {
    if (dst.empty()) return;
    if (!src.data) fail(errc::invalid_argument, "async save: tensor '" + src.key + "': no memory given");
    std::memcpy(dst.data(), src.data + off, dst.size());
  }
};

}  // namespace detail

/// The caller's side of one asynchronous save. Movable; destroying it waits for the save.
class async_save_handle {
 public:
  async_save_handle() = default;
  explicit async_save_handle(std::shared_ptr<detail::async_save_state> s) : s_(std::move(s)) {}
  async_save_handle(async_save_handle&&) noexcept = default;
  async_save_handle& operator=(async_save_handle&& o) noexcept {
    if (this != &o) {
      if (s_) s_->wait_done();
      s_ = std::move(o.s_);
    }
    return *this;
  }
  ~async_save_handle() {
    if (s_) s_->wait_done();
  }

  bool valid() const noexcept { return s_ != nullptr; }
  /// Whether the background part has finished (committed or failed).
  bool ready() const {
    if (!s_) return true;
    std::lock_guard lock(s_->m);
    return s_->done;
  }
  /// Waits for the background part; returns what it did, or rethrows its error (every call).
  const async_save_stats& wait() const {
    if (!s_) fail(errc::invalid_argument, "async save: wait() on a handle that holds no save");
    s_->wait_done();
    if (s_->error) std::rethrow_exception(s_->error);
    return s_->result;
  }

 private:
  std::shared_ptr<detail::async_save_state> s_;
};

/// Runs saves in the background over its own comm, one at a time, snapshotting into staging
/// memory it keeps. Not thread-safe: one thread (the training loop) calls save().
template <Comm C>
class async_saver {
 public:
  /// comm: the collectives of every save (give it a group of its own, see the header comment).
  /// threads: snapshot copy threads (0: default).
  explicit async_saver(C comm, unsigned threads = 0, staging_buffer staging = {})
      : comm_(std::move(comm)), threads_(threads), staging_(std::move(staging)) {}
  async_saver(const async_saver&) = delete;
  async_saver& operator=(const async_saver&) = delete;
  ~async_saver() { join(); }

  /// Saves views into dir as one checkpoint (what shardsafe::save does), the writing in the
  /// background. A collective over the saver's comm. The views' memory is read only before
  /// save() returns.
  template <WritableDirectory D, class Copy = detail::copy_view_bytes>
  async_save_handle save(const D& dir, std::span<const flat_view> views, const save_options& opt = {}, Copy copy = {}) {
    return start(std::vector<D>{dir}, std::vector<std::span<const flat_view>>{views}, opt, [](C&) {}, std::move(copy));
  }

  /// The save of a folder set, asynchronously (shardsafe::save with folders, checkpoint/saver.hpp): several folders under
  /// parent, committed in the given order (the last one's commit mark is that of them all,
  /// e.g. model_and_optim_folders: optim, then model), the parent prepared first, in the
  /// background. copy as for save(), with the views numbered across folders, in order.
  template <WritableDirectory D, class Copy = detail::copy_view_bytes>
  async_save_handle save(const D& parent, std::span<const folder_views> folders, const save_options& opt = {},
                         Copy copy = {}) {
    if (folders.empty())
      fail(errc::invalid_argument, std::string(parent.name()) + ": a folder set to save has no folder");
    std::vector<D> dirs;
    std::vector<std::span<const flat_view>> views;
    for (const folder_views& f : folders) {
      dirs.push_back(parent.sub(f.name));
      views.push_back(f.views);
    }
    save_options each = opt;
    each.overwrite = false;  // (the parent is prepared as a whole)
    return start(
        std::move(dirs), std::move(views), each,
        [parent, last = folders.back().name, overwrite = opt.overwrite](C& comm) {
          detail::prepare_folder_set(parent, last, overwrite, comm);
        },
        std::move(copy));
  }

  /// (the name before issue 52)
  template <WritableDirectory D, class Copy = detail::copy_view_bytes>
  [[deprecated("async_saver::save_folder_set is async_saver::save with a span of folder_views (CHANGELOG)")]]
  async_save_handle save_folder_set(const D& parent, std::span<const folder_views> folders,
                                    const save_options& opt = {}, Copy copy = {}) {
    return save(parent, folders, opt, std::move(copy));
  }

  /// Waits for the save in flight, if any; rethrows its error.
  void wait() {
    auto s = in_flight_;
    join();
    if (s && s->error) std::rethrow_exception(s->error);
  }
  /// Whether a save is in flight (its background part not finished).
  bool busy() const {
    if (!in_flight_) return false;
    std::lock_guard lock(in_flight_->m);
    return !in_flight_->done;
  }
  C& comm() noexcept { return comm_; }
  const staging_buffer& staging() const noexcept { return staging_; }
  /// Gives the staging memory back (waits for the save in flight first).
  void release_staging() {
    join();
    staging_.release();
  }

 private:
  /// Saves views[i] into dirs[i], committed in order, before(comm) first in the background (a
  /// collective). copy(i, src, off, dst) copies bytes [off, off + dst.size()) of view i
  /// (numbered across folders, in order) into dst, its staging; it runs on the caller's thread
  /// and the pool's, for the views this rank writes: views with memory (src.data) in pieces of
  /// 16 MiB, views without it whole (off 0), their bytes supplied by copy (e.g. from a CUDA tensor).
  template <WritableDirectory D, class Before, class Copy>
  async_save_handle start(std::vector<D> dirs, std::vector<std::span<const flat_view>> folders, const save_options& opt,
                          Before before, Copy copy) {
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    // the layout opt.format names, by its writer (checkpoint/layouts/writers.hpp): what this rank
    // writes, and steps 2-4 in the background
    (void)layout_written_by(opt.format);  // refused here, on the caller's thread, when none
    join();
    const auto t_waited = clock::now();

    // the staging layout: every view, 64-byte aligned, one after another
    std::vector<std::uint64_t> offset;
    std::uint64_t total = 0;
    for (const auto& f : folders)
      for (const auto& v : f) {
        offset.push_back(total);
        total = (total + v.nbytes + 63) / 64 * 64;
      }
    std::byte* base = nullptr;
    every_rank_step(comm_, [&] {  // a rank without the memory fails the save everywhere
      if (total > 0) base = staging_.reserve(total, threads_);
    });
    // staged views: the caller's, pointing into staging
    std::vector<std::vector<flat_view>> staged(folders.size());
    std::vector<const flat_view*> source;
    std::size_t k = 0;
    for (std::size_t i = 0; i < folders.size(); ++i)
      for (const auto& v : folders[i]) {
        flat_view s = v;
        s.data = base + offset[k++];
        staged[i].push_back(std::move(s));
        source.push_back(&v);
      }

    // 1. the plan, on this thread
    std::vector<detail::agreed_description> mds;
    for (std::size_t i = 0; i < folders.size(); ++i)
      with_writer(opt.format, dirs[i].name(), [&]<class W>() {
        mds.push_back(W::agree(std::span<const flat_view>(staged[i]), comm_, std::string(dirs[i].name()), opt));
      });

    // the snapshot of what this rank writes, in pieces of at most 16 MiB, agreed
    const auto t_snap = clock::now();
    struct piece {
      std::size_t view;
      std::uint64_t off, len;
    };
    std::vector<piece> pieces;
    std::vector<flat_view*> all;
    for (auto& vs : staged)
      for (auto& v : vs) all.push_back(&v);
    std::uint64_t staged_bytes = 0;
    {
      std::size_t g = 0;
      for (std::size_t i = 0; i < folders.size(); ++i) {
        std::vector<const flat_view*> mine;
        with_writer(opt.format, dirs[i].name(), [&]<class W>() {
          mine = W::views_to_write(std::span<const flat_view>(staged[i]), mds[i], comm_.rank());
        });
        std::vector<bool> writes(staged[i].size(), false);
        for (const flat_view* m : mine) writes[static_cast<std::size_t>(m - staged[i].data())] = true;
        for (std::size_t j = 0; j < staged[i].size(); ++j, ++g) {
          if (!writes[j]) continue;
          const std::uint64_t n = staged[i][j].nbytes;
          staged_bytes += n;
          // views with memory in pieces of 16 MiB; the others whole (copy() supplies their bytes)
          const std::uint64_t step = source[g]->data ? std::uint64_t(16) << 20 : std::max<std::uint64_t>(n, 1);
          if (n == 0) pieces.push_back({g, 0, 0});
          for (std::uint64_t o = 0; o < n; o += step) pieces.push_back({g, o, std::min(step, n - o)});
        }
      }
    }
    every_rank_step(comm_, [&] {
      detail::shared_pool().parallel_for(pieces.size(), threads_, [&](std::size_t p) {
        const piece& pc = pieces[p];
        copy(pc.view, *source[pc.view], pc.off, all[pc.view]->bytes().subspan(pc.off, pc.len));
      });
    });
    const auto t_done = clock::now();

    // 2-4 in the background
    auto state = std::make_shared<detail::async_save_state>();
    state->result.waited_seconds = std::chrono::duration<double>(t_waited - t0).count();
    state->result.snapshot_seconds = std::chrono::duration<double>(t_done - t_snap).count();
    state->result.stall_seconds = std::chrono::duration<double>(t_done - t0).count();
    state->result.staged_bytes = staged_bytes;
    in_flight_ = state;
    worker_ = std::thread([this, state, dirs = std::move(dirs), staged = std::move(staged), mds = std::move(mds), opt,
                           before = std::move(before), t0]() mutable {
      std::exception_ptr err;
      try {
        before(comm_);
        for (std::size_t i = 0; i < dirs.size(); ++i)
          with_writer(opt.format, dirs[i].name(), [&]<class W>() {
            state->result.folders.push_back(
                W::write(dirs[i], std::span<const flat_view>(staged[i]), std::move(mds[i]), comm_, opt, t0));
          });
        state->result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      } catch (...) {
        err = std::current_exception();
      }
      state->finish(std::move(err));
    });
    return async_save_handle(state);
  }

  void join() {
    if (worker_.joinable()) worker_.join();
    in_flight_.reset();
  }

  C comm_;
  unsigned threads_;
  staging_buffer staging_;
  std::shared_ptr<detail::async_save_state> in_flight_;
  std::thread worker_;
};

}  // namespace shardsafe
