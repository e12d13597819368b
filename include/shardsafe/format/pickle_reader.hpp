// shardsafe/format/pickle_reader.hpp - reads the plain-data subset of Python's pickle.
//
// Reads what Python writes with protocols 2 to 5 (and 0/1 where they use the same opcodes):
// None, bool, int (64-bit), float, str, list, tuple and dict. Every opcode that could name a
// class or call a function (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ, ...) goes
// to the reader's opcode policy, and the default policy (plain_data_only) refuses them all by
// name, so reading untrusted bytes runs no code. Whatever the policy, the work and memory are
// bounded by the input's size: each opcode makes at most one value, a shared reference (DUP,
// the memo) stays shared in the result (one container, referred to twice, as in Python),
// never copied into a tree; the values the result expands to when walked as a tree are at
// most 64 per input byte (plus 4096, and at most max_values); the stack, the memo and the
// nesting depth have limits; cycles and deep trees are refused or freed without recursion; a
// FRAME that declares more bytes than follow is refused as truncated, as Python does.
#pragma once

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/json.hpp"
#include "shardsafe/format/pickle_value.hpp"

namespace shardsafe {

template <class Policy>
class basic_pickle_reader;

/// What a pickle reader does with an opcode outside plain data: the hook for an unpickler that
/// allows a few named classes (an allowlist, as torch DCP's `.metadata` needs).
///
/// | expression                | requirement                                                        |
/// |---------------------------|--------------------------------------------------------------------|
/// | `p.on_opcode(r, op, at)`  | `r` is the `basic_pickle_reader<P>&` reading, `op` the opcode byte  |
/// |                           | (an `unsigned char`) at byte offset `at` (`std::size_t`). Called    |
/// |                           | for each opcode the reader does not read itself: GLOBAL,           |
/// |                           | STACK_GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ, PERSID, bytes, sets |
/// |                           | and protocol 0 text opcodes. Returns `true` when it handled the    |
/// |                           | opcode: read its argument with `r.take(n)` and pushed its result   |
/// |                           | with `r.push(value)`. Returns `false` to refuse it: the reader      |
/// |                           | then throws invalid_metadata naming the opcode and the byte        |
/// |                           | (`r.refuse(op, at)`). It may throw through `r.bad(why)` itself.    |
/// |                           | `r.pop_value()` pops a value (an opcode's operand), checked and   |
/// |                           | built; `r.kind_at(i)`, `r.string_entry_at(i, key)` (and, in O(1),  |
/// |                           | `r.first_string_entry_at(i, key)`) look at the                     |
/// |                           | stack; `r.extend_top(key, v)` and `r.merge_top_into_below(op)` add |
/// |                           | to a dict on the stack in place (BUILD on an object).              |
/// | `P{}` or a `P` passed in  | the reader holds its own copy (pass a pointer for shared state).   |
///
/// The reader's limits apply to what a policy pushes as to everything else.
template <class P>
concept PickleOpcodePolicy = std::move_constructible<P> &&
    requires(P& p, basic_pickle_reader<P>& r, unsigned char op, std::size_t at) {
      { p.on_opcode(r, op, at) } -> std::convertible_to<bool>;
    };

/// The default policy: plain data only; every class, call, persistent id or bytes is refused.
struct plain_data_only {
  template <class Reader>
  bool on_opcode(Reader&, unsigned char, std::size_t) const noexcept {
    return false;
  }
};

/// Reads one pickle (run() once): a value, or errc::invalid_metadata naming `what`, the byte and
/// the rule broken. Opcodes outside plain data go to `Policy` (a PickleOpcodePolicy).
template <class Policy = plain_data_only>
class basic_pickle_reader {
 public:
  /// Reads `in`; `what` names the bytes in messages.
  /// `max_values` bounds the values the result (and every pop_value) may expand to, as a tree;
  /// the reader lowers it to 64 per input byte plus 4096.
  basic_pickle_reader(std::string_view in, std::string what, Policy policy = {}, std::size_t max_values = default_max_values)
      : in_(in),
        what_(std::move(what)),
        max_nodes_(std::min<std::uint64_t>(max_values, 64 * std::uint64_t(in.size()) + 4096)),
        popped_budget_(8 * max_nodes_),
        work_budget_(8 * max_nodes_),
        policy_(std::move(policy)) {}
  /// The default bound on values: param groups hold dozens.
  static constexpr std::size_t default_max_values = std::size_t(1) << 20;
  basic_pickle_reader(const basic_pickle_reader&) = delete;
  basic_pickle_reader& operator=(const basic_pickle_reader&) = delete;
  // Containers may hold themselves (APPEND of a DUP or BINGET) or nest deeper than the call
  // stack can unwind: unlink every node first, so none is leaked in a cycle and none is freed
  // recursively.
  ~basic_pickle_reader() {
    for (const auto& n : all_) n->children.clear();
  }

  /// Reads the bytes up to STOP; the value is checked (cycles, depth, size) before it is built.
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
        case 0x95: {                                     // FRAME: its bytes must all be there
          const std::uint64_t n = le(take(8));
          if (n > in_.size() - pos_)
            bad("is truncated (a FRAME at byte " + std::to_string(at) + " declares " + std::to_string(n) +
                " bytes, " + std::to_string(in_.size() - pos_) + " follow)");
          break;
        }
        case '(': marks_.push_back(stack_.size()); break;  // MARK
        case '.': {                                      // STOP
          if (stack_.size() != 1 || !marks_.empty()) bad("STOP with " + std::to_string(stack_.size()) + " values on the stack");
          expanded_size(stack_.back(), 0);  // refuses cycles, deep nesting and blow-ups before building
          budget_ = max_nodes_;
          built_.clear();
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
          if (!policy_.on_opcode(*this, op, at)) refuse(op, at);
      }
      if (stack_.size() > max_stack_) bad("too many values on the stack");
    }
  }

  // --- for a PickleOpcodePolicy handling an opcode ---

  /// Refuses opcode `op` at byte `at`, naming it: what happens to every opcode outside plain
  /// data that the policy does not handle.
  [[noreturn]] void refuse(unsigned op, std::size_t at) const {
    bad("unsupported opcode 0x" + hex(op) + opcode_name(op) + " at byte " + std::to_string(at) +
        " (only plain data is read: None, bool, int, float, str, list, tuple, dict; classes and calls are refused)");
  }
  /// Throws errc::invalid_metadata: "<what>: pickle <why>".
  [[noreturn]] void bad(const std::string& why) const { fail(errc::invalid_metadata, what_ + ": pickle " + why); }
  /// The next n bytes of the input (an opcode's argument); refuses input that ends before them.
  std::string_view take(std::uint64_t n) {
    if (n > in_.size() - pos_) bad("is truncated (needs " + std::to_string(n) + " bytes at byte " + std::to_string(pos_) + ")");
    auto s = in_.substr(pos_, static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return s;
  }
  /// Pushes a value onto the stack (later opcodes may add items to it if it is a list or dict).
  void push(pickle_value v) { push(make(std::move(v))); }
  /// Pops the value on top of the stack, built as the result would be (cycles, depth and size
  /// refused alike; shared references stay shared); all pops together may build at most
  /// 8 x max_values values.
  pickle_value pop_value() {
    ptr n = pop();
    expanded_size(n, 0);
    budget_ = max_nodes_;
    built_.clear();
    const std::size_t before = budget_;
    pickle_value v = materialize(n, 0);
    const std::size_t made = before - budget_;
    if (made > popped_budget_) bad("operands expand to more than " + std::to_string(8 * max_nodes_) + " values");
    popped_budget_ -= made;
    return v;
  }
  /// The kind of the value `from_top` places below the top of the stack (0: the top).
  pickle_value::kind kind_at(std::size_t from_top) const { return at_(from_top)->k; }
  /// The string under string key `key` of the dict `from_top` places below the top of the
  /// stack, or "" when that value is not a dict or has no such string entry (the last counts).
  std::string string_entry_at(std::size_t from_top, std::string_view key) const {
    const ptr t = at_(from_top);
    if (t->k != pickle_value::kind::dict) return {};
    for (std::size_t i = t->children.size() / 2; i-- > 0;) {
      const auto& k = t->children[2 * i];
      const auto& v = t->children[2 * i + 1];
      if (k->k == pickle_value::kind::string && k->scalar.as_string("key") == key)
        return v->k == pickle_value::kind::string ? v->scalar.as_string("value") : std::string();
    }
    return {};
  }
  /// The string value of the first entry of the dict `from_top` places below the top of the stack
  /// when that entry's key is `key`, else "": O(1), where string_entry_at scans (an object a policy
  /// made carries its class as its first entry; BUILD may add entries after it, many times over).
  std::string first_string_entry_at(std::size_t from_top, std::string_view key) const {
    const ptr t = at_(from_top);
    if (t->k != pickle_value::kind::dict || t->children.size() < 2) return {};
    const auto& k = t->children[0];
    const auto& v = t->children[1];
    if (k->k != pickle_value::kind::string || k->scalar.as_string("key") != key) return {};
    return v->k == pickle_value::kind::string ? v->scalar.as_string("value") : std::string();
  }
  /// Pops the dict on top of the stack and adds its entries to the dict below it, in place, as
  /// SETITEMS would (BUILD with a state dict); the entries are shared, not copied.
  void merge_top_into_below(const char* op) {
    const ptr s = top();
    if (s->k != pickle_value::kind::dict) bad(std::string(op) + " of a " + pickle_value::kind_name(s->k) + " into a dict");
    stack_.pop_back();
    auto d = container(pickle_value::kind::dict, op);
    const auto items = s->children;  // a copy: s may be d itself
    charge(items.size());
    d->expanded = 0;
    d->children.insert(d->children.end(), items.begin(), items.end());
  }
  /// Adds entry (key, v) to the dict on top of the stack, in place (other references to it, from
  /// the memo, see the change), as SETITEM does.
  void extend_top(pickle_value key, pickle_value v) {
    auto d = container(pickle_value::kind::dict, "extend_top");
    d->expanded = 0;
    d->children.push_back(make(std::move(key)));
    d->children.push_back(make(std::move(v)));
  }

 private:
  struct node {
    pickle_value scalar;  // the value of a None, bool, int, float or str
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

  static std::string hex(unsigned v) {
    const char* d = "0123456789abcdef";
    return std::string{d[(v >> 4) & 15], d[v & 15]};
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
  // Counts n steps of work (nodes made, entries copied) against the budget of 8 x max_values.
  void charge(std::size_t n) {
    if (n > work_budget_) bad("needs more than " + std::to_string(8 * max_nodes_) + " steps to read");
    work_budget_ -= n;
  }
  // The address of v's container (one shared by several values is one node), or nullptr.
  static const void* container_of(const pickle_value& v) noexcept {
    return std::visit(
        [](const auto& x) -> const void* {
          if constexpr (requires { x.get(); }) return x.get();
          else return nullptr;
        },
        v.as_variant());
  }
  // A node for v; a container's items become nodes of their own, so opcodes can add to it. A
  // container v refers to more than once becomes one node (`seen`), so sharing is kept.
  ptr make(pickle_value v) {
    std::map<const void*, ptr> seen;
    return make(std::move(v), seen);
  }
  ptr make(pickle_value v, std::map<const void*, ptr>& seen) {
    const void* c = container_of(v);
    if (c)
      if (auto it = seen.find(c); it != seen.end()) return it->second;
    charge(1);
    auto n = std::make_shared<node>();
    n->k = v.type();
    all_.push_back(n);
    if (c) seen.emplace(c, n);
    if (n->k == pickle_value::kind::dict) {
      for (std::size_t i = 0; i < v.dict_size(); ++i) {
        n->children.push_back(make(v.dict_key(i), seen));
        n->children.push_back(make(v.dict_value(i), seen));
      }
    } else if (n->k == pickle_value::kind::list || n->k == pickle_value::kind::tuple) {
      for (const auto& x : v.as_sequence("")) n->children.push_back(make(x, seen));
    } else {
      n->scalar = std::move(v);
    }
    return n;
  }
  void push(ptr p) { stack_.push_back(std::move(p)); }
  std::size_t base() const { return marks_.empty() ? 0 : marks_.back(); }
  ptr top() const {
    if (stack_.size() <= base()) bad("reads an empty stack");
    return stack_.back();
  }
  ptr at_(std::size_t from_top) const {
    if (stack_.size() <= base() + from_top) bad("reads past the bottom of the stack");
    return stack_[stack_.size() - 1 - from_top];
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
  // Builds the value of n; a node reached again (a shared reference) gives the value built the
  // first time, which shares its container: each node is built once (built_, cleared by the
  // caller). The budget counts the nodes built.
  pickle_value materialize(const ptr& n, std::size_t depth) {
    if (depth > max_depth_) bad("nests deeper than " + std::to_string(max_depth_) + " (or refers to itself)");
    using k = pickle_value::kind;
    if (n->k != k::list && n->k != k::tuple && n->k != k::dict) return n->scalar;
    if (auto it = built_.find(n.get()); it != built_.end()) return it->second;
    if (budget_ < 1 + n->children.size()) bad("expands to more than " + std::to_string(max_nodes_) + " values");
    budget_ -= 1 + n->children.size();
    std::vector<pickle_value> items;
    items.reserve(n->children.size());
    for (const auto& c : n->children) items.push_back(materialize(c, depth + 1));
    pickle_value v;
    if (n->k == k::list) {
      v = pickle_value::list(std::move(items));
    } else if (n->k == k::tuple) {
      v = pickle_value::tuple(std::move(items));
    } else {
      std::vector<std::pair<pickle_value, pickle_value>> entries;
      for (std::size_t i = 0; i + 1 < items.size(); i += 2) entries.emplace_back(std::move(items[i]), std::move(items[i + 1]));
      v = pickle_value::dict(std::move(entries));
    }
    built_.emplace(n.get(), v);
    return v;
  }

  std::string_view in_;
  std::string what_;
  std::size_t pos_ = 0;
  std::vector<ptr> stack_;
  std::vector<std::size_t> marks_;
  std::vector<ptr> memo_;
  std::size_t max_nodes_;      // values a result may expand to, as a tree
  std::size_t popped_budget_;  // values all pop_value calls together may still build
  std::size_t work_budget_;    // nodes made and entries copied that are still allowed
  std::size_t budget_ = 0;     // values the materialize under way may still build
  std::map<const node*, pickle_value> built_;  // what the materialize under way built, by node
  std::vector<ptr> all_;  // every node made, unlinked by the destructor
  Policy policy_;
};

static_assert(PickleOpcodePolicy<plain_data_only>);

/// The reader of plain data.
using pickle_reader = basic_pickle_reader<plain_data_only>;

/// Unpickles plain data; `what` names the bytes in messages. Throws errc::invalid_metadata.
inline pickle_value pickle_loads(std::string_view bytes, std::string_view what) {
  return pickle_reader(bytes, std::string(what)).run();
}

/// Unpickles with `policy` deciding the opcodes outside plain data (see PickleOpcodePolicy).
template <PickleOpcodePolicy Policy>
pickle_value pickle_loads(std::string_view bytes, std::string_view what, Policy policy,
                          std::size_t max_values = basic_pickle_reader<Policy>::default_max_values) {
  return basic_pickle_reader<Policy>(bytes, std::string(what), std::move(policy), max_values).run();
}

}  // namespace shardsafe
