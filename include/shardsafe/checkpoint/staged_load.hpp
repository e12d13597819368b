// shardsafe/checkpoint/staged_load.hpp - loads into memory the reader cannot write itself (a
// GPU's), through a small ring of host buffers.
//
// Reads land in one slot of the ring while a copy engine moves the slots filled before it to
// their destinations, asynchronously: the storage and the host-to-device link work at the
// same time, and host memory is the ring's (slots x slot_bytes) whatever the model's size.
// Each destination's local elements are cut, in order, into pieces that fill the slots; a
// piece is loaded as a flat view of its own (its elements' global ranges: any shard spec, any
// resharding, dtype conversion on the host as device_load_options says), so the reader plans and
// reads only what the pieces need, as for any other load.
//
// CopyEngine E, for `E e`, `typename E::target dst`, `std::uint64_t off, n`,
// `std::span<const std::byte> src`, `typename E::fence f`:
//
// | expression          | type                       | requirement                                  |
// |---------------------|----------------------------|----------------------------------------------|
// | e.allocate(n)       | std::shared_ptr<std::byte> | n bytes of host memory to copy from (pinned  |
// |                     |                            | for a GPU: the fastest to copy from)         |
// | e.copy(dst, off, src) | void                     | enqueues a copy of src to dst's bytes at off;|
// |                     |                            | src is read at any time until a fence        |
// |                     |                            | recorded after the copy has been waited for  |
// | e.record()          | E::fence                   | marks every copy enqueued so far             |
// | e.wait(f)           | void                       | returns once the copies before f are done    |
// | e.synchronize()     | void                       | returns once every copy enqueued is done     |
//
// Copies may run in any order relative to the caller, but those before a fence are done when
// wait returns: the ring refills a slot only after waiting for the fence recorded when it was
// last filled. host_copy_engine below is the stand-in used on machines without a device: a
// memcpy that runs no earlier than the latest point the contract allows (when a fence after
// it is waited for), so a ring that refilled a slot too early would copy the new bytes and
// fail its test. torch/device_copy.hpp has the engine for LibTorch devices (CUDA).
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <thread>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/loader.hpp"

namespace shardsafe {

template <class E>
concept CopyEngine =
    requires(E& e, typename E::target dst, std::uint64_t n, std::span<const std::byte> src, typename E::fence& f) {
      { e.allocate(n) } -> std::same_as<std::shared_ptr<std::byte>>;
      e.copy(dst, n, src);
      { e.record() } -> std::same_as<typename E::fence>;
      e.wait(f);
      e.synchronize();
    };

/// A tensor to load through the ring: its description (key, dtype, full shape, spec, nbytes;
/// view.data is not used) and where its local bytes go.
template <class Target>
struct staged_view {
  flat_view view;
  Target target;
};

/// load_stats, and what the ring did.
struct staged_load_stats : load_stats {
  std::uint64_t host_bytes = 0;  ///< host memory the ring allocated (slots x slot_bytes, or less)
  std::uint64_t fills = 0;       ///< slots filled (one load each)
  std::uint64_t copies = 0;      ///< copies handed to the engine
};

namespace detail {

/// One slot's worth of pieces: the flat views the reader fills and the copies that follow.
template <class Target>
struct slot_batch {
  struct copy_out {
    Target target;
    std::uint64_t target_offset, slot_offset, bytes;
  };
  std::vector<flat_view> pieces;
  std::vector<copy_out> copies;
  std::uint64_t used = 0;
  void clear() {
    pieces.clear();
    copies.clear();
    used = 0;
  }
};

/// Where the next piece may start in a slot: aligned for any element type.
inline std::uint64_t piece_start(std::uint64_t used) {
  constexpr std::uint64_t a = 16;
  return (used + a - 1) / a * a;
}

/// The global element ranges of local elements [a, b) of a shard, the cursor at the run
/// holding a (moved to the run holding b).
template <SpecCursor C>
std::vector<element_range> ranges_of_local(C& cur, std::uint64_t a, std::uint64_t b) {
  std::vector<element_range> out;
  while (a < b) {
    const spec_run r = cur.run();
    const std::uint64_t in = a - r.local, len = r.end - r.begin, n = std::min(len - in, b - a);
    out.push_back({r.begin + in, r.begin + in + n});
    a += n;
    if (in + n == len) cur.next();
  }
  return out;
}

}  // namespace detail

/// The reads in flight of a staged load whose load_options::threads is 0 and whose storage
/// gives no hint of its own (a file's; an HTTP or S3 storage says its requests_in_flight): the
/// hardware's threads, at most 16. The library's default elsewhere stops at 8
/// (detail::default_threads()) because other loads and saves may hold a buffer per thread; here
/// the reads land in the ring's slots and nothing else. On a 16-core H200 host, 9.9 GiB from
/// the page cache into CUDA tensors went at 22.3 GB/s with 8 threads and 37.3 GB/s with 16
/// (bench_device --threads, bench/HISTORY.md).
inline unsigned staged_default_threads() noexcept { return std::clamp(std::thread::hardware_concurrency(), 1u, 16u); }

/// Loads `views` through a ring of opt.staging.slots host buffers of opt.staging.slot_bytes
/// each: every check a load makes is made first (reader.plan over the whole views: nothing is
/// read or copied when one fails); then the slots are filled in turn, each by one load
/// of the pieces it holds, and handed to the engine, which copies them out while the next
/// slot is read. Returns once every copy is done (also when it throws: no copy outlives the
/// ring). Missing keys (strict = false) are skipped and listed; unexpected keys are the
/// checkpoint's tensors no view names.
template <ReadableDirectory D, CopyEngine E>
staged_load_stats load(checkpoint_reader<D>& reader, std::span<const staged_view<typename E::target>> views, E& engine,
                       const device_load_options& opt = {}) {
  using target = typename E::target;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string ctx(reader.directory().name());
  if (opt.staging.slots == 0 || opt.staging.slot_bytes < 16)
    fail(errc::invalid_argument, ctx + ": a staging ring of " + std::to_string(opt.staging.slots) + " slots of " +
                                     std::to_string(opt.staging.slot_bytes) + " bytes (at least 1 slot of 16 bytes)");
  staged_load_stats st;
  read_settings hint;  // the storage's (an HTTP or S3 one has its own reads in flight and sizes)
  {
    // the whole views are described, their memory is the ring's (each piece's, later)
    std::vector<flat_view> whole;
    whole.reserve(views.size());
    for (const auto& sv : views) whole.push_back(sv.view);
    const load_schedule s = reader.plan(std::span<const flat_view>(whole), opt, /*memory_later=*/true);
    st.tensors = s.stats.tensors;
    st.missing_keys = s.stats.missing_keys;
    st.unexpected_keys = s.stats.unexpected_keys;
    hint = s.hint;
  }
  // pieces are loaded by key; the checks above are done and missing keys already listed
  load_options piece_opt = opt;
  piece_opt.strict = false;
  piece_opt.list_unexpected = false;  // the whole plan above listed them
  // reads in flight: the caller's, else the storage's hint, else the staged default
  if (!piece_opt.threads)
    piece_opt.threads = hint.requests_in_flight.value_or(0) ? *hint.requests_in_flight : staged_default_threads();
  if (!piece_opt.reads.max_read_bytes && !hint.max_read_bytes)  // a slot's reads spread over the threads
    piece_opt.reads.max_read_bytes =
        std::max<std::uint64_t>(std::uint64_t(1) << 20, opt.staging.slot_bytes / std::max(1u, piece_opt.threads));

  const std::uint64_t slot_bytes = opt.staging.slot_bytes / 16 * 16;
  std::vector<std::shared_ptr<std::byte>> slots;
  std::vector<std::optional<typename E::fence>> fences(opt.staging.slots);
  std::size_t next = 0;  // the slot the batch fills
  detail::slot_batch<target> batch;

  auto flush = [&] {
    if (batch.pieces.empty()) return;
    if (slots.size() <= next) {  // allocated as first needed: a small load takes what it uses
      slots.push_back(engine.allocate(slot_bytes));
      st.host_bytes += slot_bytes;
    }
    if (fences[next]) {
      engine.wait(*fences[next]);
      fences[next].reset();
    }
    std::byte* base = slots[next].get();
    for (std::size_t i = 0; i < batch.pieces.size(); ++i) batch.pieces[i].data = base + batch.copies[i].slot_offset;
    const load_stats s = load(reader, std::span<const flat_view>(batch.pieces), piece_opt);
    st.add_reads(s);
    for (const auto& c : batch.copies)
      engine.copy(c.target, c.target_offset,
                  std::span<const std::byte>(base + c.slot_offset, static_cast<std::size_t>(c.bytes)));
    st.copies += batch.copies.size();
    fences[next] = engine.record();
    ++st.fills;
    next = (next + 1) % fences.size();
    batch.clear();
  };

  try {
    for (const auto& sv : views) {
      const flat_view& v = sv.view;
      if (!reader.find(v.key)) continue;  // missing (strict = false): listed above
      const std::uint64_t item = item_size(v.type), total = v.local_numel();
      if (item > slot_bytes) fail(errc::invalid_argument, ctx + ": staging slots smaller than one element");
      const shard_spec spec = v.effective_spec();
      auto cur = spec.cursor(v.full_shape);
      for (std::uint64_t local = 0; local < total;) {
        std::uint64_t at = detail::piece_start(batch.used);
        if (at + item > slot_bytes) {
          flush();
          at = 0;
        }
        const std::uint64_t n = std::min(total - local, (slot_bytes - at) / item);
        flat_view p;
        p.key = v.key;
        p.type = v.type;
        p.full_shape = v.full_shape;
        p.spec = flat_spec(detail::ranges_of_local(cur, local, local + n));
        // p.data is set at flush, in the slot the batch lands in
        p.nbytes = n * item;
        batch.pieces.push_back(std::move(p));
        batch.copies.push_back({sv.target, local * item, at, n * item});
        batch.used = at + n * item;
        local += n;
      }
    }
    flush();
    engine.synchronize();
  } catch (...) {
    try {
      engine.synchronize();  // the slots are freed below: nothing may still read them
    } catch (...) {
    }
    throw;
  }
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

/// The stand-in CopyEngine of machines without a device: destinations are host memory, and
/// each copy runs as late as the contract allows (when a fence recorded after it is waited
/// for, or at synchronize), so a slot refilled before its fence was waited for shows up as
/// wrong bytes. It counts what a test checks: host bytes allocated, copies, and the most
/// fences outstanding at once (the ring's depth in use).
class host_copy_engine {
 public:
  using target = std::byte*;
  using fence = std::uint64_t;

  std::shared_ptr<std::byte> allocate(std::uint64_t n) {
    allocated_ += n;
    return std::shared_ptr<std::byte>(new std::byte[static_cast<std::size_t>(n)], std::default_delete<std::byte[]>());
  }
  void copy(std::byte* dst, std::uint64_t off, std::span<const std::byte> src) {
    queue_.push_back({dst + off, src, recorded_ + 1});
    ++copies_;
    bytes_ += src.size();
  }
  fence record() {
    ++outstanding_;
    max_outstanding_ = std::max(max_outstanding_, outstanding_);
    return ++recorded_;
  }
  void wait(fence f) {
    run_until(f);
    if (outstanding_) --outstanding_;
  }
  void synchronize() {
    run_until(~fence{0});
    outstanding_ = 0;
  }

  std::uint64_t allocated() const noexcept { return allocated_; }
  std::uint64_t copies() const noexcept { return copies_; }
  std::uint64_t bytes() const noexcept { return bytes_; }
  std::uint64_t max_outstanding() const noexcept { return max_outstanding_; }
  std::size_t pending() const noexcept { return queue_.size(); }

 private:
  struct queued {
    std::byte* dst;
    std::span<const std::byte> src;
    fence before;  // the first fence recorded after this copy
  };
  void run_until(fence f) {
    while (!queue_.empty() && queue_.front().before <= f) {
      const queued& q = queue_.front();
      if (!q.src.empty()) std::memcpy(q.dst, q.src.data(), q.src.size());
      queue_.pop_front();
    }
  }
  std::deque<queued> queue_;
  fence recorded_ = 0;
  std::uint64_t allocated_ = 0, copies_ = 0, bytes_ = 0, outstanding_ = 0, max_outstanding_ = 0;
};
static_assert(CopyEngine<host_copy_engine>);

/// (the staged load's name before issue 52)
template <ReadableDirectory D, CopyEngine E>
[[deprecated("load_staged is shardsafe::load(reader, staged views, engine, device_load_options) (CHANGELOG)")]]
staged_load_stats load_staged(checkpoint_reader<D>& reader, std::span<const staged_view<typename E::target>> views,
                              E& engine, const device_load_options& opt = {}) {
  return load(reader, views, engine, opt);
}

}  // namespace shardsafe
