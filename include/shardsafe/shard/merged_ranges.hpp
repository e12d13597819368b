// shardsafe/shard/merged_ranges.hpp - the flattened ranges of a shard spec with adjacent runs
// joined: lazily (merged_ranges_view, an input range) or materialized (for tests and small
// specs).
#pragma once

#include <cstdint>
#include <iterator>
#include <optional>
#include <vector>

#include "shardsafe/shard/shard_spec.hpp"

namespace shardsafe {

/// An input range over the merged flattened ranges of a spec: runs with adjacent neighbours
/// joined, empty ones dropped, produced one at a time as the iterator advances.
template <ShardSpec S>
class merged_ranges_view {
 public:
  using cursor_t = decltype(std::declval<const S&>().cursor(std::span<const std::uint64_t>{}));
  merged_ranges_view(const S& s, std::span<const std::uint64_t> full) : spec_(&s), full_(full.begin(), full.end()) {}

  class iterator {
   public:
    using value_type = element_range;
    using difference_type = std::ptrdiff_t;
    iterator() = default;
    explicit iterator(cursor_t c) : c_(std::move(c)) { fill(); }
    element_range operator*() const noexcept { return cur_; }
    iterator& operator++() {
      fill();
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const iterator& it, std::default_sentinel_t) noexcept { return it.end_; }
    /// The work done so far by the spec's cursor (its steps(), when it counts them; else 0).
    std::uint64_t steps() const noexcept {
      if constexpr (requires(const cursor_t& c) {
                      { c.steps() } -> std::convertible_to<std::uint64_t>;
                    })
        return c_ ? c_->steps() : 0;
      else
        return 0;
    }

   private:
    void fill() {
      if (!c_ || c_->done()) {
        end_ = true;
        return;
      }
      spec_run r = c_->run();
      c_->next();
      while (!c_->done() && c_->run().begin == r.end) {
        r.end = c_->run().end;
        c_->next();
      }
      cur_ = {r.begin, r.end};
    }
    std::optional<cursor_t> c_;
    element_range cur_{};
    bool end_ = false;
  };

  iterator begin() const { return iterator(spec_->cursor(full_)); }
  std::default_sentinel_t end() const noexcept { return {}; }

 private:
  const S* spec_;
  shape_t full_;
};

/// The merged flattened ranges of s (validated against full), lazily.
template <ShardSpec S>
merged_ranges_view<S> merged_ranges(const S& s, std::span<const std::uint64_t> full) {
  return merged_ranges_view<S>(s, full);
}

/// The same ranges, materialized (for tests and small specs).
template <ShardSpec S>
std::vector<element_range> merged_ranges_vector(const S& s, std::span<const std::uint64_t> full) {
  std::vector<element_range> out;
  for (auto r : merged_ranges(s, full)) out.push_back(r);
  return out;
}

}  // namespace shardsafe
