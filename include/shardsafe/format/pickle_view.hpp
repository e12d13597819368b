// shardsafe/format/pickle_view.hpp - the values a pickle reader makes, and a view of them.
//
// A reader (format/pickle_reader.hpp) makes each value in an arena it owns: a
// detail::pickle_node of 32 bytes (strings read in place from the input), a container's items
// in runs of a slot_pool. build_pickle_value copies a node into a pickle_value, checked (no
// cycle, bounded depth and values; shared containers stay shared); pickle_view looks at a node
// in place, asking what a pickle_value answers without copying, while its reader lives.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/format/pickle_value.hpp"

namespace shardsafe {

namespace detail {

/// One value a pickle reader made, in its arena: a scalar, or a container whose items (a dict's
/// keys and values alternating) are in a vector the arena owns. 32 bytes.
struct pickle_node {
  struct text {
    const char* data;
    std::size_t size;
  };
  pickle_value::kind k = pickle_value::kind::none;
  bool visiting : 1 = false;   // on the path being counted: reaching it again is a cycle
  bool alt : 1 = false;        // a bytes that is a bytearray; a set that is a frozenset
  std::uint16_t height = 0;    // nesting levels below it (as counted in epoch `stamp`)
  std::uint32_t stamp = 0;     // the reader's epoch when expanded and height were counted
  std::uint64_t expanded = 0;  // values it becomes as a tree (as counted in epoch `stamp`)
  struct slots {               // a container's items, in the reader's slot_pool
    pickle_node** data;
    std::uint32_t size;
    std::uint32_t capacity;
  };
  union {
    bool b;
    std::int64_t i;
    double d;
    text s;
    slots seq;
  } u{};
  bool container() const noexcept {
    return k == pickle_value::kind::list || k == pickle_value::kind::tuple || k == pickle_value::kind::dict ||
           k == pickle_value::kind::set;
  }
  std::string_view str() const noexcept { return {u.s.data, u.s.size}; }
  std::span<pickle_node* const> items() const noexcept { return {u.seq.data, u.seq.size}; }
};

// Where containers' items live: small runs bumped out of 16K-slot blocks, large ones on their
// own (freed when their container moves to a larger run). A container that grows moves to a
// run twice as large, so runs left behind cost at most what the items cost.
class slot_pool {
 public:
  // Makes room for `extra` more items in s (at most 2^32 - 1 in all: false when more).
  bool reserve(pickle_node::slots& s, std::size_t extra) {
    const std::uint64_t need = std::uint64_t(s.size) + extra;
    if (need <= s.capacity) return true;
    if (need > UINT32_MAX) return false;
    const std::uint64_t cap = std::min<std::uint64_t>(
        UINT32_MAX, std::max<std::uint64_t>(need, s.capacity ? 2 * std::uint64_t(s.capacity) : need));
    pickle_node** run = take(static_cast<std::size_t>(cap));
    if (s.size) std::copy(s.data, s.data + s.size, run);
    if (s.capacity > small_) own_.erase(s.data);
    s.data = run;
    s.capacity = static_cast<std::uint32_t>(cap);
    return true;
  }

 private:
  static constexpr std::size_t block_ = std::size_t(1) << 14;
  static constexpr std::size_t small_ = block_ / 16;
  pickle_node** take(std::size_t n) {
    if (n > small_) {
      auto run = std::make_unique_for_overwrite<pickle_node*[]>(n);
      pickle_node** p = run.get();
      own_.emplace(p, std::move(run));
      return p;
    }
    if (n > left_) {
      blocks_.push_back(std::make_unique_for_overwrite<pickle_node*[]>(block_));
      next_ = blocks_.back().get();
      left_ = block_;
    }
    pickle_node** p = next_;
    next_ += n;
    left_ -= n;
    return p;
  }
  std::vector<std::unique_ptr<pickle_node*[]>> blocks_;
  pickle_node** next_ = nullptr;
  std::size_t left_ = 0;
  std::unordered_map<pickle_node**, std::unique_ptr<pickle_node*[]>> own_;
};

/// What a str of `bytes` bytes counts as against a pickle's bound on values: 1, and 1 more per 8
/// of its bytes (a pickle_value is 40 bytes; a copied string about its length).
constexpr std::uint64_t pickle_string_cost(std::uint64_t bytes) noexcept { return 1 + bytes / 8; }

/// Why a pickle whose tree passes `limit` values is refused.
inline std::string pickle_expansion_problem(std::uint64_t limit) {
  return "expands to more than " + std::to_string(limit) + " values (strings count 1 per 8 bytes)";
}

// What each level of build_pickle_value passes down, in one place.
template <class Bad>
struct pickle_build {
  std::size_t max_depth, limit;
  std::size_t& budget;
  std::unordered_map<const pickle_node*, pickle_value>& built;
  const Bad& bad;
  pickle_hash_ids* ids;  // the numbering of the set being built, if any
};

template <class Bad>
pickle_value build_pickle_node(const pickle_node* n, std::size_t depth, pickle_build<Bad>& b);

// A container's items built (the three kinds apart, each with its own locals, so that one level
// of nesting costs the call stack little: about 0.2 KiB at -O1).
template <class Bad>
[[gnu::noinline]] pickle_value build_pickle_dict(const pickle_node* n, std::size_t depth, pickle_build<Bad>& b) {
  const auto items = n->items();
  std::vector<std::pair<pickle_value, pickle_value>> entries;
  entries.reserve(items.size() / 2);
  for (std::size_t i = 0; i + 1 < items.size(); i += 2) {
    pickle_value key = build_pickle_node(items[i], depth + 1, b);
    entries.emplace_back(std::move(key), build_pickle_node(items[i + 1], depth + 1, b));
  }
  return pickle_value::dict(std::move(entries));
}
template <class Bad>
[[gnu::noinline]] pickle_value build_pickle_sequence(const pickle_node* n, std::size_t depth, pickle_build<Bad>& b) {
  std::vector<pickle_value> xs;
  xs.reserve(n->items().size());
  for (const auto* c : n->items()) xs.push_back(build_pickle_node(c, depth + 1, b));
  return n->k == pickle_value::kind::list ? pickle_value::list(std::move(xs)) : pickle_value::tuple(std::move(xs));
}
// Python's set: an item equal to one before it is left out; an item it cannot hash (a list,
// dict, set or bytearray) makes torch.load fail. The sets inside share this one's numbering.
template <class Bad>
[[gnu::noinline]] pickle_value build_pickle_set(const pickle_node* n, std::size_t depth, pickle_build<Bad>& b) {
  std::vector<pickle_value> xs;
  std::unordered_map<std::uint64_t, bool> seen;
  std::optional<pickle_hash_ids> own;
  pickle_hash_ids* const outer = b.ids;
  if (!b.ids) b.ids = &own.emplace();
  for (const auto* c : n->items()) {
    pickle_value x = build_pickle_node(c, depth + 1, b);
    const std::optional<std::uint64_t> key = b.ids->id(x);
    if (!key)
      b.bad(std::string(n->alt ? "frozenset" : "set") + " holds a " +
            (x.type() == pickle_value::kind::bytes ? std::string("bytearray")
                                                   : std::string(pickle_value::kind_name(x.type()))) +
            ", which Python cannot hash (torch.load refuses it)");
    if (seen.emplace(*key, true).second) xs.push_back(std::move(x));
  }
  b.ids = outer;
  return pickle_value::set_of(std::move(xs), n->alt);
}

template <class Bad>
pickle_value build_pickle_node(const pickle_node* n, std::size_t depth, pickle_build<Bad>& b) {
  using k = pickle_value::kind;
  if (depth > b.max_depth) b.bad("nests deeper than " + std::to_string(b.max_depth) + " (or refers to itself)");
  switch (n->k) {
    case k::none: return pickle_value::none();
    case k::boolean: return pickle_value::boolean(n->u.b);
    case k::integer: return pickle_value::integer(n->u.i);
    case k::real: return pickle_value::real(n->u.d);
    case k::string:
    case k::bytes: {
      const std::uint64_t extra = pickle_string_cost(n->u.s.size) - 1;  // its 1 is in its container's items
      if (b.budget < extra) b.bad(pickle_expansion_problem(b.limit));
      b.budget -= static_cast<std::size_t>(extra);
      return n->k == k::string ? pickle_value::string(std::string(n->str()))
                               : pickle_value::byte_string(std::string(n->str()), n->alt);
    }
    default: break;
  }
  if (auto it = b.built.find(n); it != b.built.end()) return it->second;
  if (b.budget < 1 + n->items().size()) b.bad(pickle_expansion_problem(b.limit));
  b.budget -= 1 + n->items().size();
  pickle_value v = n->k == k::dict  ? build_pickle_dict(n, depth, b)
                   : n->k == k::set ? build_pickle_set(n, depth, b)
                                    : build_pickle_sequence(n, depth, b);
  b.built.emplace(n, v);
  return v;
}

// Copies node n (checked: no cycle, bounded depth) into a pickle_value; a node reached again
// gives the value built the first time (`built`), so shared containers stay shared. Each
// container built takes 1 + its items from `budget` (which started at `limit`), each str
// copied its bytes / 8 more; on running out, or past `max_depth`, bad(why) is called (and must
// throw). A set leaves out an item Python holds equal to one before it.
template <class Bad>
pickle_value build_pickle_value(const pickle_node* n, std::size_t depth, std::size_t max_depth, std::size_t limit,
                                std::size_t& budget, std::unordered_map<const pickle_node*, pickle_value>& built,
                                const Bad& bad) {
  pickle_build<Bad> b{max_depth, limit, budget, built, bad, nullptr};
  return build_pickle_node(n, depth, b);
}

static_assert(sizeof(pickle_node) <= 32, "a value in the arena takes 32 bytes");

}  // namespace detail

/// A value a pickle reader read, seen in place (basic_pickle_reader::run(f)): valid while the
/// reader lives. The same questions as pickle_value, without copying; build() copies.
class pickle_view {
 public:
  explicit pickle_view(const detail::pickle_node* n) noexcept : n_(n) {}
  pickle_value::kind type() const noexcept { return n_->k; }
  bool is_none() const noexcept { return n_->k == pickle_value::kind::none; }
  bool is_sequence() const noexcept { return n_->k == pickle_value::kind::list || n_->k == pickle_value::kind::tuple; }
  bool as_bool(std::string_view ctx) const { return expect(pickle_value::kind::boolean, ctx).u.b; }
  std::int64_t as_int(std::string_view ctx) const { return expect(pickle_value::kind::integer, ctx).u.i; }
  double as_real(std::string_view ctx) const { return expect(pickle_value::kind::real, ctx).u.d; }
  std::string_view as_string(std::string_view ctx) const { return expect(pickle_value::kind::string, ctx).str(); }
  /// The length of a bytes or bytearray.
  std::size_t as_bytes_size() const { return expect(pickle_value::kind::bytes, "bytes").u.s.size; }
  /// Items of a list or tuple, entries of a dict; 0 for a scalar.
  std::size_t size() const noexcept {
    return n_->container() ? n_->items().size() / (n_->k == pickle_value::kind::dict ? 2 : 1) : 0;
  }
  /// Item i of a list or tuple; key and value of entry i of a dict (i < size()).
  pickle_view item(std::size_t i) const { return at(i); }
  pickle_view key(std::size_t i) const { return at(2 * i); }
  pickle_view value(std::size_t i) const { return at(2 * i + 1); }
  /// The value under string key `key` of a dict (the last, as Python keeps it), or nullopt.
  std::optional<pickle_view> find(std::string_view key) const noexcept {
    if (n_->k != pickle_value::kind::dict) return std::nullopt;
    const auto items = n_->items();
    for (std::size_t i = items.size() / 2; i-- > 0;)
      if (items[2 * i]->k == pickle_value::kind::string && items[2 * i]->str() == key)
        return pickle_view(items[2 * i + 1]);
    return std::nullopt;
  }
  /// What identifies the value: one container the pickle holds at several places (through its
  /// memo) has one id there.
  const void* id() const noexcept { return n_; }
  /// The containers built so far, by node: values of one reader built with one cache share the
  /// containers they share in the pickle (each is copied once, however many values hold it).
  using build_cache = std::unordered_map<const detail::pickle_node*, pickle_value>;
  /// A copy as a pickle_value (shared containers stay shared).
  pickle_value build() const {
    build_cache built;
    return build(built);
  }
  pickle_value build(build_cache& built) const {
    constexpr std::size_t no_limit = std::numeric_limits<std::size_t>::max();  // the reader checked the value
    std::size_t budget = no_limit;
    return detail::build_pickle_value(n_, 0, no_limit, no_limit, budget, built,
                                      [](const std::string& why) { fail(errc::invalid_metadata, "pickle " + why); });
  }

 private:
  const detail::pickle_node& expect(pickle_value::kind k, std::string_view ctx) const {
    if (n_->k != k)
      fail(errc::invalid_metadata,
           std::string(ctx) + ": expected " + pickle_value::kind_name(k) + ", got " + pickle_value::kind_name(n_->k));
    return *n_;
  }
  pickle_view at(std::size_t i) const {
    if (!n_->container() || i >= n_->items().size())
      throw std::out_of_range("pickle_view: no item " + std::to_string(i));
    return pickle_view(n_->items()[i]);
  }
  const detail::pickle_node* n_;
};

}  // namespace shardsafe
