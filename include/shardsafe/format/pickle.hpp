// shardsafe/format/pickle.hpp - the plain-data subset of Python's pickle, both ways.
//
// OLMo-core stores each optimizer param group (hyper-parameters and parameter names) and the
// list of state keys as pickled bytes in U8 tensors. To share optimizer checkpoints with
// Python, shardsafe writes such pickles (protocol 2, which every Python 3 reads) and reads
// the ones Python writes (protocols 2 to 5). Only plain data is accepted: None, bool, int
// (64-bit), float, str, list, tuple and dict. Every opcode that could name a class or call a
// function (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ, ...) is refused by name,
// so reading untrusted bytes runs no code; sizes, nesting and memo references are bounded.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/json.hpp"

namespace shardsafe {

/// A plain Python value.
class pickle_value {
 public:
  enum class kind { none, boolean, integer, real, string, list, tuple, dict };

  pickle_value() = default;
  static pickle_value none() { return {}; }
  static pickle_value boolean(bool b) { pickle_value v(kind::boolean); v.i_ = b; return v; }
  static pickle_value integer(std::int64_t i) { pickle_value v(kind::integer); v.i_ = i; return v; }
  static pickle_value real(double d) { pickle_value v(kind::real); v.d_ = d; return v; }
  static pickle_value string(std::string s) { pickle_value v(kind::string); v.s_ = std::move(s); return v; }
  static pickle_value list(std::vector<pickle_value> items = {}) { pickle_value v(kind::list); v.items_ = std::move(items); return v; }
  static pickle_value tuple(std::vector<pickle_value> items = {}) { pickle_value v(kind::tuple); v.items_ = std::move(items); return v; }
  /// A dict; entries are (key, value) pairs in insertion order.
  static pickle_value dict(std::vector<std::pair<pickle_value, pickle_value>> entries = {}) {
    pickle_value v(kind::dict);
    for (auto& [k, x] : entries) {
      v.items_.push_back(std::move(k));
      v.items_.push_back(std::move(x));
    }
    return v;
  }

  kind type() const noexcept { return k_; }
  bool is_none() const noexcept { return k_ == kind::none; }
  bool as_bool(std::string_view ctx) const { expect(kind::boolean, ctx); return i_ != 0; }
  std::int64_t as_int(std::string_view ctx) const { expect(kind::integer, ctx); return i_; }
  /// A float, or an int read as one (Python writes 0 for 0.0 when the user did).
  double as_real(std::string_view ctx) const {
    if (k_ == kind::integer) return static_cast<double>(i_);
    expect(kind::real, ctx);
    return d_;
  }
  const std::string& as_string(std::string_view ctx) const { expect(kind::string, ctx); return s_; }
  /// Items of a list or tuple.
  const std::vector<pickle_value>& as_sequence(std::string_view ctx) const {
    if (k_ != kind::list && k_ != kind::tuple)
      fail(errc::invalid_metadata, std::string(ctx) + ": expected a list or tuple, got " + kind_name(k_));
    return items_;
  }
  std::size_t dict_size() const noexcept { return k_ == kind::dict ? items_.size() / 2 : 0; }
  const pickle_value& dict_key(std::size_t i) const { return items_.at(2 * i); }
  const pickle_value& dict_value(std::size_t i) const { return items_.at(2 * i + 1); }
  /// The value under string key `key` of a dict, or nullptr.
  /// (With a key given twice, the last value wins, as when Python builds the dict.)
  const pickle_value* find(std::string_view key) const noexcept {
    if (k_ != kind::dict) return nullptr;
    for (std::size_t i = items_.size() / 2; i-- > 0;)
      if (items_[2 * i].k_ == kind::string && items_[2 * i].s_ == key) return &items_[2 * i + 1];
    return nullptr;
  }
  const pickle_value& at(std::string_view key, std::string_view ctx) const {
    expect(kind::dict, ctx);
    if (auto* v = find(key)) return *v;
    fail(errc::invalid_metadata, std::string(ctx) + ": no key '" + std::string(key) + "'");
  }
  /// Sets (or replaces) string key `key` of a dict.
  void set(std::string key, pickle_value v) {
    expect(kind::dict, "pickle_value::set");
    for (std::size_t i = 0; i + 1 < items_.size(); i += 2)
      if (items_[i].k_ == kind::string && items_[i].s_ == key) {
        items_[i + 1] = std::move(v);
        return;
      }
    items_.push_back(string(std::move(key)));
    items_.push_back(std::move(v));
  }

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
    }
    return "?";
  }

  friend bool operator==(const pickle_value& a, const pickle_value& b) {
    if (a.k_ != b.k_) return false;
    switch (a.k_) {
      case kind::none: return true;
      case kind::boolean: case kind::integer: return a.i_ == b.i_;
      case kind::real: return std::bit_cast<std::uint64_t>(a.d_) == std::bit_cast<std::uint64_t>(b.d_);
      case kind::string: return a.s_ == b.s_;
      default: return a.items_ == b.items_;
    }
  }

 private:
  explicit pickle_value(kind k) : k_(k) {}
  void expect(kind k, std::string_view ctx) const {
    if (k_ != k)
      fail(errc::invalid_metadata, std::string(ctx) + ": expected " + kind_name(k) + ", got " + kind_name(k_));
  }
  kind k_ = kind::none;
  std::int64_t i_ = 0;
  double d_ = 0;
  std::string s_;
  std::vector<pickle_value> items_;  // list/tuple items; dict keys and values alternating
};

// ---------------------------------------------------------------------------------------
// writing (protocol 2)

namespace detail {

inline void pickle_put(std::string& out, const pickle_value& v) {
  using k = pickle_value::kind;
  auto le = [&](std::uint64_t x, int n) {
    for (int i = 0; i < n; ++i) out += static_cast<char>((x >> (8 * i)) & 0xff);
  };
  switch (v.type()) {
    case k::none: out += 'N'; break;
    case k::boolean: out += v.as_bool("") ? '\x88' : '\x89'; break;
    case k::integer: {
      const std::int64_t i = v.as_int("");
      if (i >= 0 && i < 256) {
        out += 'K';
        le(static_cast<std::uint64_t>(i), 1);
      } else if (i >= 0 && i < 65536) {
        out += 'M';
        le(static_cast<std::uint64_t>(i), 2);
      } else if (i >= INT32_MIN && i <= INT32_MAX) {
        out += 'J';
        le(static_cast<std::uint32_t>(static_cast<std::int32_t>(i)), 4);
      } else {  // LONG1: minimal little-endian two's complement
        std::string bytes;
        std::int64_t x = i;
        do {
          bytes += static_cast<char>(x & 0xff);
          x >>= 8;
        } while (!((x == 0 && !(bytes.back() & 0x80)) || (x == -1 && (bytes.back() & 0x80))));
        out += '\x8a';
        out += static_cast<char>(bytes.size());
        out += bytes;
      }
      break;
    }
    case k::real: {
      out += 'G';
      const std::uint64_t bits = std::bit_cast<std::uint64_t>(v.as_real(""));
      for (int i = 7; i >= 0; --i) out += static_cast<char>((bits >> (8 * i)) & 0xff);  // big-endian
      break;
    }
    case k::string: {
      const std::string& s = v.as_string("");
      out += 'X';
      le(s.size(), 4);
      out += s;
      break;
    }
    // Lists and dicts are filled in batches of 1000, a batch of one with APPEND/SETITEM, as
    // Python's pickler does: the reader then never holds more than 1000 of their items on its
    // stack, and the bytes are Python's own (less its memo PUTs).
    case k::list: {
      out += ']';
      const auto& items = v.as_sequence("");
      for (std::size_t b = 0; b < items.size(); b += 1000) {
        const std::size_t e = std::min(items.size(), b + 1000);
        if (e - b > 1) out += '(';
        for (std::size_t i = b; i < e; ++i) pickle_put(out, items[i]);
        out += e - b > 1 ? 'e' : 'a';
      }
      break;
    }
    case k::tuple: {
      const auto& items = v.as_sequence("");
      if (items.empty()) {
        out += ')';
        break;
      }
      if (items.size() > 3) out += '(';
      for (const auto& x : items) pickle_put(out, x);
      out += items.size() == 1 ? '\x85' : items.size() == 2 ? '\x86' : items.size() == 3 ? '\x87' : 't';
      break;
    }
    case k::dict: {
      out += '}';
      const std::size_t n = v.dict_size();
      for (std::size_t b = 0; b < n; b += 1000) {
        const std::size_t e = std::min(n, b + 1000);
        if (e - b > 1) out += '(';
        for (std::size_t i = b; i < e; ++i) {
          pickle_put(out, v.dict_key(i));
          pickle_put(out, v.dict_value(i));
        }
        out += e - b > 1 ? 'u' : 's';
      }
      break;
    }
  }
}

}  // namespace detail

/// Pickles a plain value with protocol 2 (strings must be UTF-8).
inline std::string pickle_dumps(const pickle_value& v) {
  std::string out = "\x80\x02";
  detail::pickle_put(out, v);
  out += '.';
  return out;
}

// ---------------------------------------------------------------------------------------
// reading (protocols 0-5, plain data only)

namespace detail {

class pickle_reader {
 public:
  pickle_reader(std::string_view in, std::string what) : in_(in), what_(std::move(what)) {}
  pickle_reader(const pickle_reader&) = delete;
  pickle_reader& operator=(const pickle_reader&) = delete;
  // Containers may hold themselves (APPEND of a DUP or BINGET) or nest deeper than the call
  // stack can unwind: unlink every node first, so none is leaked in a cycle and none is freed
  // recursively.
  ~pickle_reader() {
    for (const auto& n : all_) n->children.clear();
  }

  pickle_value run() {
    while (true) {
      if (pos_ >= in_.size()) bad("ends without STOP");
      const std::size_t at = pos_;
      const unsigned char op = static_cast<unsigned char>(in_[pos_++]);
      switch (op) {
        case 0x80: {                                     // PROTO
          const auto v = static_cast<unsigned char>(take(1)[0]);
          if (v > 5) bad("protocol " + std::to_string(v) + " is newer than 5, the highest Python writes");
          break;
        }
        case 0x95: take(8); break;                       // FRAME (length is advisory)
        case '(': marks_.push_back(stack_.size()); break;  // MARK
        case '.': {                                      // STOP
          if (stack_.size() != 1 || !marks_.empty()) bad("STOP with " + std::to_string(stack_.size()) + " values on the stack");
          expanded_size(stack_.back(), 0);  // refuses cycles, deep nesting and blow-ups before building
          budget_ = max_nodes_;
          return materialize(stack_.back(), 0);
        }
        case 'N': push(make(pickle_value::none())); break;
        case 0x88: push(make(pickle_value::boolean(true))); break;
        case 0x89: push(make(pickle_value::boolean(false))); break;
        case 'K': push(make(pickle_value::integer(le(take(1))))); break;
        case 'M': push(make(pickle_value::integer(le(take(2))))); break;
        case 'J': push(make(pickle_value::integer(static_cast<std::int32_t>(static_cast<std::uint32_t>(le(take(4)))))));
          break;
        case 0x8a: push(make(pickle_value::integer(long_int(le(take(1)), at)))); break;  // LONG1
        case 0x8b: push(make(pickle_value::integer(long_int(le(take(4)), at)))); break;  // LONG4
        case 'G': {
          std::uint64_t bits = 0;
          for (unsigned char c : take(8)) bits = (bits << 8) | c;
          push(make(pickle_value::real(std::bit_cast<double>(bits))));
          break;
        }
        case 'X': push(make(pickle_value::string(text(le(take(4)))))); break;   // BINUNICODE
        case 0x8c: push(make(pickle_value::string(text(le(take(1)))))); break;  // SHORT_BINUNICODE
        case 0x8d: push(make(pickle_value::string(text(le(take(8)))))); break;  // BINUNICODE8
        case ']': push(make(pickle_value::list())); break;
        case ')': push(make(pickle_value::tuple())); break;
        case '}': push(make(pickle_value::dict())); break;
        case 'a': {  // APPEND
          auto x = pop();
          container(pickle_value::kind::list, "APPEND")->children.push_back(std::move(x));
          break;
        }
        case 'e': {  // APPENDS
          auto items = pop_mark();
          auto& c = container(pickle_value::kind::list, "APPENDS")->children;
          for (auto& x : items) c.push_back(std::move(x));
          break;
        }
        case 's': {  // SETITEM
          auto v = pop();
          auto k = pop();
          auto d = container(pickle_value::kind::dict, "SETITEM");
          d->children.push_back(std::move(k));
          d->children.push_back(std::move(v));
          break;
        }
        case 'u': {  // SETITEMS
          auto items = pop_mark();
          if (items.size() % 2) bad("SETITEMS with an odd number of values");
          auto& c = container(pickle_value::kind::dict, "SETITEMS")->children;
          for (auto& x : items) c.push_back(std::move(x));
          break;
        }
        case 0x85: case 0x86: case 0x87: {  // TUPLE1..3
          const std::size_t n = op - 0x84u;
          if (stack_.size() < n + base()) bad("TUPLE" + std::to_string(n) + " with too few values");
          auto t = make(pickle_value::tuple());
          t->children.assign(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
          stack_.resize(stack_.size() - n);
          push(std::move(t));
          break;
        }
        case 't': {
          auto t = make(pickle_value::tuple());
          t->children = pop_mark();
          push(std::move(t));
          break;
        }
        case 'l': {  // LIST (protocol 0/1)
          auto l = make(pickle_value::list());
          l->children = pop_mark();
          push(std::move(l));
          break;
        }
        case 'd': {  // DICT (protocol 0/1)
          auto items = pop_mark();
          if (items.size() % 2) bad("DICT with an odd number of values");
          auto d = make(pickle_value::dict());
          d->children = std::move(items);
          push(std::move(d));
          break;
        }
        case 0x94: memo_put(memo_.size()); break;                // MEMOIZE
        case 'q': memo_put(le(take(1))); break;                  // BINPUT
        case 'r': memo_put(le(take(4))); break;                  // LONG_BINPUT
        case 'h': memo_get(le(take(1))); break;                  // BINGET
        case 'j': memo_get(le(take(4))); break;                  // LONG_BINGET
        case '0': pop(); break;                                  // POP
        case '2': push(top()); break;                            // DUP
        default:
          bad("unsupported opcode 0x" + hex(op) + opcode_name(op) + " at byte " + std::to_string(at) +
              " (only plain data is read: None, bool, int, float, str, list, tuple, dict; classes and calls are refused)");
      }
      if (stack_.size() > max_stack_) bad("too many values on the stack");
    }
  }

 private:
  struct node {
    pickle_value scalar;
    pickle_value::kind k;
    std::vector<std::shared_ptr<node>> children;
    std::uint64_t expanded = 0;  // values this node becomes when materialized (0: not counted yet)
    std::size_t height = 0;      // nesting levels below it
    bool visiting = false;       // on the path being counted: reaching it again is a cycle
  };
  using ptr = std::shared_ptr<node>;

  static constexpr std::size_t max_stack_ = 1 << 16;
  static constexpr std::size_t max_memo_ = 1 << 20;
  static constexpr std::size_t max_depth_ = 200;
  static constexpr std::size_t max_nodes_ = 1 << 20;  // param groups hold dozens

  [[noreturn]] void bad(const std::string& why) const { fail(errc::invalid_metadata, what_ + ": pickle " + why); }
  static std::string hex(unsigned v) {
    const char* d = "0123456789abcdef";
    return std::string{d[(v >> 4) & 15], d[v & 15]};
  }
  std::string_view take(std::uint64_t n) {
    if (n > in_.size() - pos_) bad("is truncated (needs " + std::to_string(n) + " bytes at byte " + std::to_string(pos_) + ")");
    auto s = in_.substr(pos_, static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return s;
  }
  static std::uint64_t le(std::string_view b) {
    std::uint64_t x = 0;
    for (std::size_t i = b.size(); i-- > 0;) x = (x << 8) | static_cast<unsigned char>(b[i]);
    return x;
  }
  std::int64_t long_int(std::uint64_t n, std::size_t at) {
    if (n > 8) bad("integer of " + std::to_string(n) + " bytes at byte " + std::to_string(at) + " does not fit 64 bits");
    auto b = take(n);
    if (n == 0) return 0;
    std::uint64_t x = le(b);
    if (n < 8 && (static_cast<unsigned char>(b[n - 1]) & 0x80)) x |= ~std::uint64_t(0) << (8 * n);  // sign-extend
    return static_cast<std::int64_t>(x);
  }
  std::string text(std::uint64_t n) {
    auto b = take(n);
    if (!detail::is_valid_utf8(b)) bad("string at byte " + std::to_string(pos_ - n) + " is not UTF-8");
    return std::string(b);
  }
  ptr make(pickle_value v) {
    auto n = std::make_shared<node>();
    n->k = v.type();
    n->scalar = std::move(v);
    all_.push_back(n);
    return n;
  }
  std::size_t base() const { return marks_.empty() ? 0 : marks_.back(); }
  void push(ptr p) { stack_.push_back(std::move(p)); }
  ptr top() const {
    if (stack_.size() <= base()) bad("reads an empty stack");
    return stack_.back();
  }
  ptr pop() {
    ptr p = top();
    stack_.pop_back();
    return p;
  }
  std::vector<ptr> pop_mark() {
    if (marks_.empty()) bad("needs a MARK that is not there");
    const std::size_t m = marks_.back();
    marks_.pop_back();
    std::vector<ptr> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  ptr container(pickle_value::kind k, const char* op) {
    ptr c = top();
    if (c->k != k) bad(std::string(op) + " on a " + pickle_value::kind_name(c->k));
    return c;
  }
  void memo_put(std::uint64_t i) {
    if (i > max_memo_) bad("memo index " + std::to_string(i) + " is too large");
    if (i >= memo_.size()) memo_.resize(static_cast<std::size_t>(i) + 1);
    memo_[static_cast<std::size_t>(i)] = top();
  }
  void memo_get(std::uint64_t i) {
    if (i >= memo_.size() || !memo_[static_cast<std::size_t>(i)]) bad("memo index " + std::to_string(i) + " was never stored");
    push(memo_[static_cast<std::size_t>(i)]);
  }
  // Counts the values n expands to, once per node (shared references are cheap to count but
  // are copied when materialized), so a memo blow-up is refused before anything is built.
  std::uint64_t expanded_size(const ptr& n, std::size_t depth) {
    if (n->visiting) bad("container contains itself (a cycle cannot be read as plain data)");
    if (n->expanded) {
      if (depth + n->height > max_depth_) bad("nests deeper than " + std::to_string(max_depth_));
      return n->expanded;
    }
    if (depth > max_depth_) bad("nests deeper than " + std::to_string(max_depth_));
    n->visiting = true;
    std::uint64_t total = 1;
    std::size_t height = 0;
    for (const auto& c : n->children) {
      total += expanded_size(c, depth + 1);
      if (total > max_nodes_) bad("expands to more than " + std::to_string(max_nodes_) + " values");
      height = std::max(height, c->height + 1);
    }
    n->visiting = false;
    n->height = height;
    n->expanded = total;
    return total;
  }
  static std::string opcode_name(unsigned op) {
    const char* n = nullptr;
    switch (op) {
      case 'c': n = "GLOBAL"; break;
      case 0x93: n = "STACK_GLOBAL"; break;
      case 'R': n = "REDUCE"; break;
      case 'b': n = "BUILD"; break;
      case 'i': n = "INST"; break;
      case 'o': n = "OBJ"; break;
      case 0x81: n = "NEWOBJ"; break;
      case 0x92: n = "NEWOBJ_EX"; break;
      case 'P': n = "PERSID"; break;
      case 'Q': n = "BINPERSID"; break;
      case 0x82: n = "EXT1"; break;
      case 0x83: n = "EXT2"; break;
      case 0x84: n = "EXT4"; break;
      case 'B': n = "BINBYTES"; break;
      case 'C': n = "SHORT_BINBYTES"; break;
      case 0x8e: n = "BINBYTES8"; break;
      case 0x96: n = "BYTEARRAY8"; break;
      case 0x97: n = "NEXT_BUFFER"; break;
      case 0x98: n = "READONLY_BUFFER"; break;
      case 0x8f: n = "EMPTY_SET"; break;
      case 0x90: n = "ADDITEMS"; break;
      case 0x91: n = "FROZENSET"; break;
      case 'S': n = "STRING"; break;
      case 'T': n = "BINSTRING"; break;
      case 'U': n = "SHORT_BINSTRING"; break;
      case 'I': n = "INT"; break;
      case 'L': n = "LONG"; break;
      case 'F': n = "FLOAT"; break;
      case 'V': n = "UNICODE"; break;
      case 'p': n = "PUT"; break;
      case 'g': n = "GET"; break;
      case '1': n = "POP_MARK"; break;
      default: return "";
    }
    return std::string(" (") + n + ")";
  }
  // Shared and self-referencing containers become trees; the node budget stops blow-ups.
  pickle_value materialize(const ptr& n, std::size_t depth) {
    if (depth > max_depth_) bad("nests deeper than " + std::to_string(max_depth_) + " (or refers to itself)");
    if (budget_-- == 0) bad("expands to more than " + std::to_string(max_nodes_) + " values");
    using k = pickle_value::kind;
    if (n->k != k::list && n->k != k::tuple && n->k != k::dict) return n->scalar;
    std::vector<pickle_value> items;
    items.reserve(n->children.size());
    for (const auto& c : n->children) items.push_back(materialize(c, depth + 1));
    if (n->k == k::list) return pickle_value::list(std::move(items));
    if (n->k == k::tuple) return pickle_value::tuple(std::move(items));
    std::vector<std::pair<pickle_value, pickle_value>> entries;
    for (std::size_t i = 0; i + 1 < items.size(); i += 2) entries.emplace_back(std::move(items[i]), std::move(items[i + 1]));
    return pickle_value::dict(std::move(entries));
  }

  std::string_view in_;
  std::string what_;
  std::size_t pos_ = 0;
  std::vector<ptr> stack_;
  std::vector<std::size_t> marks_;
  std::vector<ptr> memo_;
  std::size_t budget_ = 0;
  std::vector<ptr> all_;  // every node made, unlinked by the destructor
};

}  // namespace detail

/// Unpickles plain data; `what` names the bytes in messages. Throws errc::invalid_metadata.
inline pickle_value pickle_loads(std::string_view bytes, std::string_view what) {
  return detail::pickle_reader(bytes, std::string(what)).run();
}

}  // namespace shardsafe
