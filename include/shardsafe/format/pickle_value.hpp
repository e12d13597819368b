// shardsafe/format/pickle_value.hpp - a plain Python value: what format/pickle_reader.hpp reads
// and format/pickle_writer.hpp writes.
//
// One alternative of a std::variant per Python type of plain data: None, bool, int (64-bit),
// float, str, list, tuple and dict. Containers are held by shared_ptr, so copying a value is
// cheap; the only mutator (set) copies a container another value still shares before changing
// it, so a pickle_value behaves as a value: changing one never changes another. Values may
// share containers (the reader keeps a shared reference in the bytes shared: one container,
// held twice) but never contain themselves: the reader refuses cycles.
#pragma once

#include <algorithm>
#include <bit>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/hex.hpp"

namespace shardsafe {

struct pickle_list;
struct pickle_tuple;
struct pickle_dict;
struct pickle_set;

/// A bytes (or bytearray) value: its bytes.
struct pickle_bytes {
  std::string data;
  bool bytearray = false;  ///< a bytearray, not a bytes
  friend bool operator==(const pickle_bytes&, const pickle_bytes&) = default;
};

/// A plain Python value.
class pickle_value {
 public:
  /// The Python type; its order is the order of the variant's alternatives.
  /// (bytes: a bytes or bytearray; set: a set or frozenset, read from a torch.save file only.)
  enum class kind : unsigned char { none, boolean, integer, real, string, list, tuple, dict, bytes, set };
  using variant_type = std::variant<std::monostate, bool, std::int64_t, double, std::string,
                                    std::shared_ptr<pickle_list>, std::shared_ptr<pickle_tuple>,
                                    std::shared_ptr<pickle_dict>, pickle_bytes, std::shared_ptr<pickle_set>>;

  pickle_value() = default;
  static pickle_value none() { return {}; }
  static pickle_value boolean(bool b) { return pickle_value(variant_type(std::in_place_type<bool>, b)); }
  static pickle_value integer(std::int64_t i) {
    return pickle_value(variant_type(std::in_place_type<std::int64_t>, i));
  }
  static pickle_value real(double d) { return pickle_value(variant_type(std::in_place_type<double>, d)); }
  static pickle_value string(std::string s) {
    return pickle_value(variant_type(std::in_place_type<std::string>, std::move(s)));
  }
  static pickle_value list(std::vector<pickle_value> items = {});
  static pickle_value tuple(std::vector<pickle_value> items = {});
  /// A dict; entries are (key, value) pairs in insertion order.
  static pickle_value dict(std::vector<std::pair<pickle_value, pickle_value>> entries = {});
  /// A bytes (or bytearray) of these bytes.
  static pickle_value byte_string(std::string data, bool bytearray = false) {
    return pickle_value(variant_type(std::in_place_type<pickle_bytes>, pickle_bytes{std::move(data), bytearray}));
  }
  /// A set (or frozenset) of these items, as given (the reader leaves out an item equal to one
  /// before it, as Python does).
  static pickle_value set_of(std::vector<pickle_value> items, bool frozen = false);

  kind type() const noexcept { return static_cast<kind>(v_.index()); }
  /// The alternative itself, for std::visit.
  const variant_type& as_variant() const noexcept { return v_; }
  bool is_none() const noexcept { return type() == kind::none; }
  bool as_bool(std::string_view ctx) const { return get<bool>(kind::boolean, ctx); }
  std::int64_t as_int(std::string_view ctx) const { return get<std::int64_t>(kind::integer, ctx); }
  /// A float, or an int read as one (Python writes 0 for 0.0 when the user did).
  double as_real(std::string_view ctx) const {
    if (auto* i = std::get_if<std::int64_t>(&v_)) return static_cast<double>(*i);
    return get<double>(kind::real, ctx);
  }
  const std::string& as_string(std::string_view ctx) const { return get<std::string>(kind::string, ctx); }
  /// Items of a list or tuple.
  const std::vector<pickle_value>& as_sequence(std::string_view ctx) const;
  const pickle_bytes& as_bytes(std::string_view ctx) const { return get<pickle_bytes>(kind::bytes, ctx); }
  /// A set's (frozenset's) items.
  const pickle_set& as_set(std::string_view ctx) const { return *get<std::shared_ptr<pickle_set>>(kind::set, ctx); }
  std::size_t dict_size() const noexcept;
  /// Key and value of entry i of a dict (std::out_of_range past the end, or on another kind).
  const pickle_value& dict_key(std::size_t i) const;
  const pickle_value& dict_value(std::size_t i) const;
  /// The value under string key `key` of a dict, or nullptr.
  /// (With a key given twice, the last value wins, as when Python builds the dict.)
  const pickle_value* find(std::string_view key) const noexcept;
  const pickle_value& at(std::string_view key, std::string_view ctx) const;
  /// Sets (or replaces) string key `key` of a dict.
  void set(std::string key, pickle_value v);

  static const char* kind_name(kind k) noexcept {
    switch (k) {
      case kind::none: return "None";
      case kind::boolean: return "bool";
      case kind::integer: return "int";
      case kind::real: return "float";
      case kind::string: return "str";
      case kind::list: return "list";
      case kind::tuple: return "tuple";
      case kind::dict: return "dict";
      case kind::bytes: return "bytes";
      case kind::set: return "set";
    }
    return "?";
  }

  /// Equal type and value; floats compare by their bits (NaN equals the same NaN, -0.0 is not 0.0).
  friend bool operator==(const pickle_value& a, const pickle_value& b);

 private:
  explicit pickle_value(variant_type v) : v_(std::move(v)) {}
  void expect(kind k, std::string_view ctx) const {
    if (type() != k)
      fail(errc::invalid_metadata, std::string(ctx) + ": expected " + kind_name(k) + ", got " + kind_name(type()));
  }
  template <class T>
  const T& get(kind k, std::string_view ctx) const {
    expect(k, ctx);
    return *std::get_if<T>(&v_);
  }
  variant_type v_;
};

/// The items of a list.
struct pickle_list {
  std::vector<pickle_value> items;
};
/// The items of a tuple.
struct pickle_tuple {
  std::vector<pickle_value> items;
};
/// The entries of a dict, in insertion order (a key given twice is kept twice; find takes the last).
struct pickle_dict {
  std::vector<std::pair<pickle_value, pickle_value>> entries;
};
/// The items of a set or frozenset, in the order the pickle gave them.
struct pickle_set {
  std::vector<pickle_value> items;
  bool frozen = false;  ///< a frozenset
};

inline pickle_value pickle_value::list(std::vector<pickle_value> items) {
  return pickle_value(variant_type(std::make_shared<pickle_list>(pickle_list{std::move(items)})));
}
inline pickle_value pickle_value::tuple(std::vector<pickle_value> items) {
  return pickle_value(variant_type(std::make_shared<pickle_tuple>(pickle_tuple{std::move(items)})));
}
inline pickle_value pickle_value::dict(std::vector<std::pair<pickle_value, pickle_value>> entries) {
  return pickle_value(variant_type(std::make_shared<pickle_dict>(pickle_dict{std::move(entries)})));
}

inline pickle_value pickle_value::set_of(std::vector<pickle_value> items, bool frozen) {
  return pickle_value(variant_type(std::make_shared<pickle_set>(pickle_set{std::move(items), frozen})));
}

inline const std::vector<pickle_value>& pickle_value::as_sequence(std::string_view ctx) const {
  if (auto* l = std::get_if<std::shared_ptr<pickle_list>>(&v_)) return (*l)->items;
  if (auto* t = std::get_if<std::shared_ptr<pickle_tuple>>(&v_)) return (*t)->items;
  fail(errc::invalid_metadata, std::string(ctx) + ": expected a list or tuple, got " + kind_name(type()));
}

inline std::size_t pickle_value::dict_size() const noexcept {
  auto* d = std::get_if<std::shared_ptr<pickle_dict>>(&v_);
  return d ? (*d)->entries.size() : 0;
}

inline const pickle_value& pickle_value::dict_key(std::size_t i) const {
  auto* d = std::get_if<std::shared_ptr<pickle_dict>>(&v_);
  if (!d) throw std::out_of_range("pickle_value::dict_key on a " + std::string(kind_name(type())));
  return (*d)->entries.at(i).first;
}

inline const pickle_value& pickle_value::dict_value(std::size_t i) const {
  auto* d = std::get_if<std::shared_ptr<pickle_dict>>(&v_);
  if (!d) throw std::out_of_range("pickle_value::dict_value on a " + std::string(kind_name(type())));
  return (*d)->entries.at(i).second;
}

inline const pickle_value* pickle_value::find(std::string_view key) const noexcept {
  auto* d = std::get_if<std::shared_ptr<pickle_dict>>(&v_);
  if (!d) return nullptr;
  const auto& e = (*d)->entries;
  for (std::size_t i = e.size(); i-- > 0;)
    if (auto* s = std::get_if<std::string>(&e[i].first.v_); s && *s == key) return &e[i].second;
  return nullptr;
}

inline const pickle_value& pickle_value::at(std::string_view key, std::string_view ctx) const {
  expect(kind::dict, ctx);
  if (auto* v = find(key)) return *v;
  fail(errc::invalid_metadata, std::string(ctx) + ": no key '" + std::string(key) + "'");
}

inline void pickle_value::set(std::string key, pickle_value v) {
  expect(kind::dict, "pickle_value::set");
  auto& d = *std::get_if<std::shared_ptr<pickle_dict>>(&v_);
  if (d.use_count() > 1) d = std::make_shared<pickle_dict>(*d);  // another value shares it: copy on write
  for (auto& [k, x] : d->entries)
    if (auto* s = std::get_if<std::string>(&k.v_); s && *s == key) {
      x = std::move(v);
      return;
    }
  d->entries.emplace_back(string(std::move(key)), std::move(v));
}

inline bool operator==(const pickle_value& a, const pickle_value& b) {
  if (a.v_.index() != b.v_.index()) return false;
  return std::visit(
      [&](const auto& x) -> bool {
        using T = std::decay_t<decltype(x)>;
        const T& y = *std::get_if<T>(&b.v_);
        if constexpr (std::is_same_v<T, std::monostate>)
          return true;
        else if constexpr (std::is_same_v<T, double>)
          return std::bit_cast<std::uint64_t>(x) == std::bit_cast<std::uint64_t>(y);
        else if constexpr (std::is_same_v<T, std::shared_ptr<pickle_dict>>)
          return x == y || x->entries == y->entries;
        else if constexpr (std::is_same_v<T, std::shared_ptr<pickle_list>> ||
                           std::is_same_v<T, std::shared_ptr<pickle_tuple>>)
          return x == y || x->items == y->items;
        else if constexpr (std::is_same_v<T, std::shared_ptr<pickle_set>>)
          return x == y || (x->frozen == y->frozen && x->items == y->items);
        else
          return x == y;
      },
      a.v_);
}

namespace detail {

/// Numbers hashable values so that two get one number exactly when Python holds them equal
/// (1, True and 1.0; 0.0 and -0.0; a tuple item by item; a frozenset whatever its order): a set
/// keeps one item of each number. A NaN equals nothing. Each tuple and frozenset is numbered once
/// (by address: it holds them), from its items' numbers, so the work is
/// linear in the values numbered however they nest or share. Recursive: the caller bounds the
/// depth (a reader's values nest at most 1000 deep).
class pickle_hash_ids {
 public:
  /// v's number, or nullopt when Python cannot hash v (a list, dict, set, bytearray, or a tuple
  /// or frozenset holding one).
  std::optional<std::uint64_t> id(const pickle_value& v) {
    using k = pickle_value::kind;
    std::string key;
    const void* shared = nullptr;
    switch (v.type()) {
      case k::none: key = "N"; break;
      case k::boolean: key = v.as_bool("") ? "i1" : "i0"; break;
      case k::integer: key = 'i' + std::to_string(v.as_int("")); break;
      case k::real: {
        const double d = v.as_real("");
        if (d != d)
          key = 'n' + std::to_string(nans_++);
        else if (d >= -0x1p63 && d < 0x1p63 && d == static_cast<double>(static_cast<std::int64_t>(d)))
          key = 'i' + std::to_string(static_cast<std::int64_t>(d));
        else
          detail::append_hex(key = "f", std::bit_cast<std::uint64_t>(d), 16);
        break;
      }
      case k::string: key = 's' + v.as_string(""); break;
      case k::bytes:
        if (v.as_bytes("").bytearray) return std::nullopt;
        key = 'b' + v.as_bytes("").data;
        break;
      case k::tuple:
      case k::set: {
        const bool tuple = v.type() == k::tuple;
        if (!tuple && !v.as_set("").frozen) return std::nullopt;
        shared = tuple ? static_cast<const void*>(&v.as_sequence("")) : &v.as_set("");
        if (const auto m = memo_.find(shared); m != memo_.end()) return m->second;
        held_.push_back(v);  // its address stays its own while this numbers values
        std::vector<std::uint64_t> ids;
        for (const auto& x : tuple ? v.as_sequence("") : v.as_set("").items) {
          const auto i = id(x);
          if (!i) return memo_[shared] = std::nullopt;
          ids.push_back(*i);
        }
        if (!tuple) {
          std::sort(ids.begin(), ids.end());
          ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
        }
        key = tuple ? "(" : "{";
        for (const std::uint64_t i : ids) key += std::to_string(i) + ',';
        break;
      }
      default: return std::nullopt;
    }
    const std::uint64_t i = ids_.emplace(std::move(key), ids_.size()).first->second;
    if (shared) memo_[shared] = i;
    return i;
  }

 private:
  std::unordered_map<std::string, std::uint64_t> ids_;
  std::unordered_map<const void*, std::optional<std::uint64_t>> memo_;
  std::vector<pickle_value> held_;
  std::uint64_t nans_ = 0;
};

}  // namespace detail

}  // namespace shardsafe
