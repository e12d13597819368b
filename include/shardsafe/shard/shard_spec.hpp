// shardsafe/shard/shard_spec.hpp - which elements of a full tensor one shard holds.
//
// Two forms, as in OLMo-core's metadata.json:
//   flat_spec   flattened offsets: ordered half-open [start, end) ranges of the row-major
//               flattened full tensor (FSDP flat parameters); ranges may be empty.
//   block_spec  an N-D block: local_shape at global_offset (tensor-parallel DTensors), any
//               number of dimensions.
// and shard_spec, which holds either.
//
// A shard's local data is its elements in increasing global order: a flat shard's ranges
// one after another, a block row-major. Both forms expose a *cursor* over their runs (maximal
// contiguous ranges of the flattened full tensor, in increasing order, each with the local
// offset of its first element) that can seek forward in O(log n) or O(ndim). Nothing is
// materialized: a [1,000,000 x 64] row block is one run; a column block yields its rows as
// the cursor moves.
//
// ShardSpec S, for `const S s`, `std::span<const std::uint64_t> full`:
//
// | expression            | type          | requirement                                            |
// |-----------------------|---------------|--------------------------------------------------------|
// | s.local_numel()       | std::uint64_t | number of elements the shard holds                     |
// | s.validate(full, ctx) | void          | throws errc::invalid_spec (message starts with ctx)    |
// |                       |               | unless s fits a tensor of shape full                   |
// | s.cursor(full)        | a SpecCursor  | runs of s in increasing global order (s validated)     |
//
// SpecCursor C, for `C c`, `std::uint64_t pos`:
// | c.done()   | bool       | no run left                                                      |
// | c.run()    | spec_run   | the current run: {begin, end, local}, begin < end (if !done())   |
// | c.next()   | void       | moves to the next run                                            |
// | c.seek(pos)| void       | moves forward to the first run with end > pos (never backward)   |
//
// The cursors of flat_spec, block_spec and shard_spec also count their work: c.steps() is the
// number of loop iterations next() and seek() have taken so far (a range looked at, a
// dimension carried or walked). It is not part of SpecCursor; tests read it to check that a
// cursor is lazy (seeking is O(log n) or O(ndim), a few runs cost a few steps) without timing.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "shardsafe/core/byte_range.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checked.hpp"

namespace shardsafe {

/// One run of a shard: global elements [begin, end), stored from local offset `local`.
struct spec_run {
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  std::uint64_t local = 0;
  friend constexpr bool operator==(const spec_run&, const spec_run&) = default;
};

template <class C>
concept SpecCursor = requires(C c, const C cc, std::uint64_t pos) {
  { cc.done() } -> std::convertible_to<bool>;
  { cc.run() } -> std::convertible_to<spec_run>;
  c.next();
  c.seek(pos);
};

template <class S>
concept ShardSpec = requires(const S& s, std::span<const std::uint64_t> full, std::string_view ctx) {
  { s.local_numel() } -> std::same_as<std::uint64_t>;
  s.validate(full, ctx);
  { s.cursor(full) } -> SpecCursor;
};

// ---------------------------------------------------------------------------------------
// flattened offsets

class flat_spec {
 public:
  flat_spec() = default;
  explicit flat_spec(std::vector<element_range> ranges) : ranges_(std::move(ranges)) { index(); }
  flat_spec(std::initializer_list<element_range> ranges) : ranges_(ranges) { index(); }

  /// The ranges as given (empty ones included).
  const std::vector<element_range>& ranges() const noexcept { return ranges_; }
  std::uint64_t local_numel() const noexcept { return local_at(count()); }

  /// Ranges must lie inside the flattened tensor, with begin <= end, and the non-empty ones
  /// must be in increasing order without overlap.
  void validate(std::span<const std::uint64_t> full, std::string_view ctx) const {
    auto n = detail::checked_numel(full);
    if (!n) fail(errc::invalid_spec, std::string(ctx) + ": full shape " + to_string(full) + " overflows 64 bits");
    std::uint64_t prev_end = 0;
    bool any = false;
    for (std::size_t i = 0; i < ranges_.size(); ++i) {
      const auto& r = ranges_[i];
      const std::string where = std::string(ctx) + ": flattened_offsets[" + std::to_string(i) + "] " + to_string(r);
      if (r.end < r.begin) fail(errc::invalid_spec, where + " ends before it begins");
      if (r.end > *n)
        fail(errc::invalid_spec,
             where + " is out of bounds for shape " + to_string(full) + " (" + std::to_string(*n) + " elements)");
      if (r.empty()) continue;
      if (any && r.begin < prev_end)
        fail(errc::invalid_spec, where + " is out of order with, or overlaps, the range before it (which ends at " +
                                     std::to_string(prev_end) + "); ranges must be sorted and disjoint");
      prev_end = r.end;
      any = true;
    }
  }

  class cursor_type {
   public:
    cursor_type(const flat_spec& s) : s_(&s) {}
    bool done() const noexcept { return i_ >= s_->count(); }
    spec_run run() const noexcept {
      const auto& r = s_->nth(i_);
      return {r.begin, r.end, s_->local_at(i_)};
    }
    void next() noexcept {
      ++i_;
      ++steps_;
    }
    void seek(std::uint64_t pos) noexcept {
      ++steps_;
      if (done() || s_->nth(i_).end > pos) return;
      // first non-empty range with end > pos, at or after i_ (ends increase strictly)
      std::size_t lo = i_, hi = s_->count();
      while (lo < hi) {
        const std::size_t mid = lo + (hi - lo) / 2;
        ++steps_;
        if (pos < s_->nth(mid).end)
          hi = mid;
        else
          lo = mid + 1;
      }
      i_ = lo;
    }
    /// Loop iterations of next() and seek() so far (ranges compared by the binary search).
    std::uint64_t steps() const noexcept { return steps_; }

   private:
    const flat_spec* s_;
    std::size_t i_ = 0;
    std::uint64_t steps_ = 0;
  };
  cursor_type cursor(std::span<const std::uint64_t> /*full*/) const noexcept { return cursor_type(*this); }

  friend bool operator==(const flat_spec& a, const flat_spec& b) { return a.ranges_ == b.ranges_; }

 private:
  // What the cursor needs beyond the ranges, kept only where the ranges do not say it: a spec of
  // one non-empty range (one rank's piece, the common case) stores nothing more, so a
  // metadata.json of a million of them costs no more than its ranges.
  void index() {
    nonempty_.clear();
    local_.clear();
    std::size_t n = 0;
    for (const auto& r : ranges_) n += r.end > r.begin;
    dense_ = n == ranges_.size();
    if (!dense_)
      for (std::uint32_t i = 0; i < ranges_.size(); ++i)
        if (ranges_[i].end > ranges_[i].begin) nonempty_.push_back(i);
    if (n > 1) {
      local_.reserve(n + 1);
      local_.push_back(0);
      for (std::size_t i = 0; i < n; ++i) local_.push_back(local_.back() + nth(i).size());
    }
  }
  // The non-empty ranges: how many, the i-th, and the local offset of the i-th (i == count(): the total).
  std::size_t count() const noexcept { return dense_ ? ranges_.size() : nonempty_.size(); }
  const element_range& nth(std::size_t i) const noexcept { return ranges_[dense_ ? i : nonempty_[i]]; }
  std::uint64_t local_at(std::size_t i) const noexcept {
    if (!local_.empty()) return local_[i];
    return i == 0 || count() == 0 ? 0 : nth(0).size();  // no range, or one
  }
  std::vector<element_range> ranges_;
  std::vector<std::uint32_t> nonempty_;  // indices of the non-empty ranges, when some are empty
  std::vector<std::uint64_t> local_;     // local offset of each non-empty range, plus the total, when more than one
  bool dense_ = true;                    // every range is non-empty (nonempty_ unused)
};

// ---------------------------------------------------------------------------------------
// N-D blocks

class block_spec {
 public:
  block_spec() = default;
  block_spec(shape_t local_shape, shape_t global_offset)
      : local_shape_(std::move(local_shape)), global_offset_(std::move(global_offset)) {}

  const shape_t& local_shape() const noexcept { return local_shape_; }
  const shape_t& global_offset() const noexcept { return global_offset_; }
  std::uint64_t local_numel() const noexcept { return numel(local_shape_); }

  /// The whole tensor as one block.
  static block_spec whole(std::span<const std::uint64_t> full) {
    return block_spec(shape_t(full.begin(), full.end()), shape_t(full.size(), 0));
  }

  void validate(std::span<const std::uint64_t> full, std::string_view ctx) const {
    const std::string c(ctx);
    if (!detail::checked_numel(full))
      fail(errc::invalid_spec, c + ": full shape " + to_string(full) + " overflows 64 bits");
    if (local_shape_.size() != full.size() || global_offset_.size() != full.size())
      fail(errc::invalid_spec, c + ": local_shape " + to_string(local_shape_) + " and global_offset " +
                                   to_string(global_offset_) + " must both have the " + std::to_string(full.size()) +
                                   " dimensions of shape " + to_string(full));
    for (std::size_t d = 0; d < full.size(); ++d) {
      auto e = detail::checked_add(global_offset_[d], local_shape_[d]);
      if (!e || *e > full[d])
        fail(errc::invalid_spec, c + ": block " + to_string(local_shape_) + " at " + to_string(global_offset_) +
                                     " passes the end of dimension " + std::to_string(d) + " of shape " +
                                     to_string(full));
    }
  }

  class cursor_type {
   public:
    cursor_type(const block_spec& s, std::span<const std::uint64_t> full) {
      const std::size_t nd = full.size();
      if (s.local_numel() == 0) {
        nruns_ = 0;
        return;
      }
      // stride[d]: elements between neighbours along dimension d of the full tensor
      std::vector<std::uint64_t> stride(nd, 1);
      for (std::size_t d = nd; d-- > 1;) stride[d - 1] = stride[d] * full[d];
      // split: the last dimension where the block is narrower than the tensor; the block's
      // rows along it and everything inside are contiguous.
      std::size_t split = 0;
      bool narrower = false;
      for (std::size_t d = nd; d-- > 0;)
        if (s.local_shape_[d] != full[d]) {
          split = d;
          narrower = true;
          break;
        }
      if (!narrower) {  // the whole tensor
        nruns_ = 1;
        run_len_ = numel(full);
        start_ = 0;
        return;
      }
      outer_ = split;
      run_len_ = s.local_shape_[split] * stride[split];
      base_ = 0;
      for (std::size_t d = 0; d < nd; ++d) base_ += s.global_offset_[d] * stride[d];
      ext_.assign(s.local_shape_.begin(), s.local_shape_.begin() + static_cast<std::ptrdiff_t>(split));
      off_.assign(s.global_offset_.begin(), s.global_offset_.begin() + static_cast<std::ptrdiff_t>(split));
      stride_.assign(stride.begin(), stride.begin() + static_cast<std::ptrdiff_t>(split));
      row_begin_ = s.global_offset_[split] * stride[split];
      // runs below each outer dimension: below_[d] = prod ext_[d+1..]
      below_.assign(split, 1);
      for (std::size_t d = split; d-- > 1;) below_[d - 1] = below_[d] * ext_[d];
      nruns_ = split == 0 ? 1 : below_[0] * ext_[0];
      j_.assign(split, 0);
      start_ = base_;
    }
    bool done() const noexcept { return r_ >= nruns_; }
    spec_run run() const noexcept { return {start_, start_ + run_len_, r_ * run_len_}; }
    void next() noexcept {
      ++r_;
      ++steps_;
      for (std::size_t d = outer_; d-- > 0;) {
        ++steps_;
        start_ += stride_[d];
        if (++j_[d] < ext_[d]) return;
        start_ -= ext_[d] * stride_[d];
        j_[d] = 0;
      }
    }
    void seek(std::uint64_t pos) noexcept {
      ++steps_;
      if (done() || start_ + run_len_ > pos) return;
      std::uint64_t r = runs_ending_at_or_before(pos);
      if (r <= r_) return;
      set_run(r);
    }
    /// Loop iterations of next() and seek() so far (dimensions carried, walked or set).
    std::uint64_t steps() const noexcept { return steps_; }

   private:
    // Number of runs whose end is <= pos: walk the outer dimensions from the left.
    std::uint64_t runs_ending_at_or_before(std::uint64_t pos) noexcept {
      std::uint64_t count = 0;
      std::uint64_t rem = pos;  // position inside the current outer prefix
      for (std::size_t d = 0; d < outer_; ++d) {
        ++steps_;
        const std::uint64_t c = rem / stride_[d];
        rem %= stride_[d];
        if (c < off_[d]) return count;                                   // before the block here
        if (c >= off_[d] + ext_[d]) return count + ext_[d] * below_[d];  // past it
        count += (c - off_[d]) * below_[d];
      }
      // inside the row of run `count`: it ends at row_begin_ + run_len_
      return rem >= row_begin_ + run_len_ ? count + 1 : count;
    }
    void set_run(std::uint64_t r) noexcept {
      r_ = r;
      if (done()) return;
      start_ = base_;
      for (std::size_t d = 0; d < outer_; ++d) {
        ++steps_;
        j_[d] = (r / below_[d]) % ext_[d];
        start_ += j_[d] * stride_[d];
      }
    }
    std::size_t outer_ = 0;
    std::uint64_t nruns_ = 0, r_ = 0, run_len_ = 0, start_ = 0, base_ = 0, row_begin_ = 0, steps_ = 0;
    std::vector<std::uint64_t> ext_, off_, stride_, below_, j_;
  };
  cursor_type cursor(std::span<const std::uint64_t> full) const { return cursor_type(*this, full); }

  friend bool operator==(const block_spec&, const block_spec&) = default;

 private:
  shape_t local_shape_;
  shape_t global_offset_;
};

// ---------------------------------------------------------------------------------------
// either form

class shard_spec {
 public:
  using variant_type = std::variant<flat_spec, block_spec>;
  shard_spec() = default;
  shard_spec(flat_spec s) : v_(std::move(s)) {}
  shard_spec(block_spec s) : v_(std::move(s)) {}

  bool is_flat() const noexcept { return std::holds_alternative<flat_spec>(v_); }
  bool is_block() const noexcept { return std::holds_alternative<block_spec>(v_); }
  const flat_spec& flat() const { return std::get<flat_spec>(v_); }
  const block_spec& block() const { return std::get<block_spec>(v_); }
  const variant_type& variant() const noexcept { return v_; }

  std::uint64_t local_numel() const noexcept {
    return std::visit([](const auto& s) { return s.local_numel(); }, v_);
  }
  void validate(std::span<const std::uint64_t> full, std::string_view ctx) const {
    std::visit([&](const auto& s) { s.validate(full, ctx); }, v_);
  }

  class cursor_type {
   public:
    using inner = std::variant<flat_spec::cursor_type, block_spec::cursor_type>;
    explicit cursor_type(inner c) : c_(std::move(c)) {}
    bool done() const noexcept {
      return std::visit([](const auto& c) { return c.done(); }, c_);
    }
    spec_run run() const noexcept {
      return std::visit([](const auto& c) { return c.run(); }, c_);
    }
    void next() noexcept {
      std::visit([](auto& c) { c.next(); }, c_);
    }
    void seek(std::uint64_t pos) noexcept {
      std::visit([&](auto& c) { c.seek(pos); }, c_);
    }
    /// The steps() of the cursor inside.
    std::uint64_t steps() const noexcept {
      return std::visit([](const auto& c) { return c.steps(); }, c_);
    }

   private:
    inner c_;
  };
  cursor_type cursor(std::span<const std::uint64_t> full) const {
    return std::visit([&](const auto& s) { return cursor_type(typename cursor_type::inner(s.cursor(full))); }, v_);
  }

  friend bool operator==(const shard_spec&, const shard_spec&) = default;

 private:
  variant_type v_;
};

static_assert(ShardSpec<flat_spec>);
static_assert(ShardSpec<block_spec>);
static_assert(ShardSpec<shard_spec>);

/// "flattened_offsets [[0, 4), [8, 12)]" or "block [8,8] at [0,0]", for messages.
inline std::string to_string(const flat_spec& s) {
  std::string r = "flattened_offsets [";
  for (std::size_t i = 0; i < s.ranges().size(); ++i) r += (i ? ", " : "") + to_string(s.ranges()[i]);
  return r + "]";
}
inline std::string to_string(const block_spec& s) {
  return "block " + to_string(s.local_shape()) + " at " + to_string(s.global_offset());
}
inline std::string to_string(const shard_spec& s) {
  return std::visit([](const auto& x) { return to_string(x); }, s.variant());
}

}  // namespace shardsafe
