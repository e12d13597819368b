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
// most 64 per input byte (plus 4096, and at most max_values), a str counting one more per 8 of
// its bytes (pickle_string_cost: a string the memo holds once is copied at each reference when
// the tree is built, so its bytes count there too); the stack, the memo and the
// nesting depth have limits; cycles and deep trees are refused; a FRAME that declares more
// bytes than follow is refused as truncated, as Python does, and one that runs past STOP too
// (Python would read the rest of it, so a stream's next pickle would begin elsewhere for it).
// A policy's value pushed with push_sealed (a tensor) takes no SETITEM or SETITEMS.
//
// Memory: the values are made in an arena the reader owns (32 bytes a value, strings read in
// place from the input, a container's items 8 bytes each; a string the policy makes, such as a
// class name, is held once however often it is made; ints 0-255, None and bools are shared), so
// a reader holds a small multiple of its input. run() copies the result into a pickle_value;
// run(f) hands f a pickle_view of it instead, read in place while the reader lives, for a
// large pickle read once (DCP's `.metadata`).
//
// The reader's parts: format/pickle_view.hpp (the values in the arena, and pickle_view) and
// format/pickle_machine.hpp (the arena, stack, memo and limits the opcodes below work on).
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <concepts>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/hex.hpp"
#include "shardsafe/detail/json.hpp"
#include "shardsafe/format/pickle_machine.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/format/pickle_view.hpp"

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
concept PickleOpcodePolicy =
    std::move_constructible<P> && requires(P& p, basic_pickle_reader<P>& r, unsigned char op, std::size_t at) {
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
class basic_pickle_reader : private detail::pickle_machine {
 public:
  /// Reads `in`; `what` names the bytes in messages.
  /// `max_values` bounds the values the result (and every pop_value) may expand to, as a tree;
  /// the strings the input holds come on top (their bytes / 8: a str read once is never what
  /// the bound refuses, only one copied at each of many references); the reader lowers the sum
  /// to 64 per input byte plus 4096. `max_made` bounds the values made in all (the arena's
  /// nodes, those dropped or a policy made among them): a bound on the reader's memory.
  basic_pickle_reader(std::string_view in, std::string what, Policy policy = {},
                      std::size_t max_values = default_max_values, std::size_t max_made = SIZE_MAX)
      : detail::pickle_machine(in, std::move(what), max_values, max_made), policy_(std::move(policy)) {}
  /// The default bound on values: param groups hold dozens.
  static constexpr std::size_t default_max_values = std::size_t(1) << 20;
  basic_pickle_reader(const basic_pickle_reader&) = delete;
  basic_pickle_reader& operator=(const basic_pickle_reader&) = delete;

  /// Reads the bytes up to STOP; the value is checked (cycles, depth, size) before it is built.
  pickle_value run() {
    return run([this](pickle_view) { return build(root_); });
  }
  /// Reads the bytes up to STOP, checks the value (cycles, depth, size) and returns f(view of
  /// it): the value is read in place, not copied (the view is valid during the call).
  template <class F>
  decltype(auto) run(F&& f) {
    read();
    expanded_size(root_, 0);  // refuses cycles, deep nesting and blow-ups before anything walks it
    return std::forward<F>(f)(pickle_view(root_));
  }

  /// The bytes read up to and with STOP, after run(): where a next pickle of the same stream
  /// begins (torch.save's legacy format writes several in turn).
  std::size_t consumed() const { return pos_; }
  /// Whether run() failed because the input ended before the pickle did (a caller reading a
  /// stream a window at a time then reads a larger window), not because of what it holds.
  bool ran_out() const { return ran_out_; }

  // --- for a PickleOpcodePolicy handling an opcode ---

  /// Refuses opcode `op` at byte `at`, naming it: what happens to every opcode outside plain
  /// data that the policy does not handle.
  [[noreturn]] void refuse(unsigned op, std::size_t at) const {
    bad("unsupported opcode 0x" + detail::hex_digits(op, 2) + opcode_name(op) + " at byte " + std::to_string(at) +
        " (only plain data is read: None, bool, int, float, str, list, tuple, dict; classes and calls are refused)");
  }
  // bad(why): throws errc::invalid_metadata naming the input; take(n): the next n bytes (an
  // opcode's argument). Both are detail::pickle_machine's, where the opcodes below use them too.
  using detail::pickle_machine::bad;
  using detail::pickle_machine::take;
  /// Pushes a value onto the stack (later opcodes may add items to it if it is a list or dict).
  void push(const pickle_value& v) {
    std::unordered_map<const void*, node*> seen;
    push(make(v, seen));
  }
  /// Pushes a value that stands for an object the policy made (a tensor, a storage): SETITEM
  /// and SETITEMS on it are refused (Python would call the object's __setitem__, which can
  /// change it), wherever the memo or DUP take it.
  void push_sealed(const pickle_value& v, const char* what) {
    push(v);
    sealed_.emplace(top(), what);
  }
  /// Pops the value on top of the stack, built as the result would be (cycles, depth and size
  /// refused alike; shared references stay shared); all pops together may build at most
  /// 8 x max_values values.
  pickle_value pop_value() {
    node* n = pop();
    expanded_size(n, 0);
    std::size_t budget = max_nodes_;
    pickle_value v = build(n, &budget);
    const std::size_t made = max_nodes_ - budget;
    if (made > popped_budget_) bad("operands expand to more than " + std::to_string(8 * max_nodes_) + " values");
    popped_budget_ -= made;
    return v;
  }
  /// The kind of the value `from_top` places below the top of the stack (0: the top).
  pickle_value::kind kind_at(std::size_t from_top) const { return at_(from_top)->k; }
  /// The string under string key `key` of the dict `from_top` places below the top of the
  /// stack, or "" when that value is not a dict or has no such string entry (the last counts).
  std::string string_entry_at(std::size_t from_top, std::string_view key) const {
    const auto v = pickle_view(at_(from_top)).find(key);
    return v && v->type() == pickle_value::kind::string ? std::string(v->as_string("")) : std::string();
  }
  /// The string value of the first entry of the dict `from_top` places below the top of the stack
  /// when that entry's key is `key`, else "": O(1), where string_entry_at scans (an object a policy
  /// made carries its class as its first entry; BUILD may add entries after it, many times over).
  std::string first_string_entry_at(std::size_t from_top, std::string_view key) const {
    const node* t = at_(from_top);
    if (t->k != pickle_value::kind::dict || t->items().size() < 2) return {};
    const node* k = t->items()[0];
    const node* v = t->items()[1];
    if (k->k != pickle_value::kind::string || k->str() != key) return {};
    return v->k == pickle_value::kind::string ? std::string(v->str()) : std::string();
  }
  /// The key of the first entry of the dict `from_top` places below the top of the stack, when
  /// that key is a str, else "": O(1) (a dict a policy made carries its marker as its first key).
  std::string first_key_at(std::size_t from_top) const {
    const node* t = at_(from_top);
    if (t->k != pickle_value::kind::dict || t->items().size() < 2 || t->items()[0]->k != pickle_value::kind::string)
      return {};
    return std::string(t->items()[0]->str());
  }
  /// Pops the dict on top of the stack and adds its entries to the dict below it, in place, as
  /// SETITEMS would (BUILD with a state dict); the entries are shared, not copied.
  void merge_top_into_below(const char* op) {
    const node* s = top();
    if (s->k != pickle_value::kind::dict)
      bad(std::string(op) + " of a " + pickle_value::kind_name(s->k) + " into a dict");
    stack_.pop_back();
    node* d = container(pickle_value::kind::dict, op);
    charge(s->items().size());
    const std::vector<node*> items(s->items().begin(), s->items().end());  // a copy: s may be d itself
    changed();
    add(d, items.data(), items.size());
  }
  /// Pushes a bytes (bytearray) whose bytes are `in`, a part of the input (what take gave): read
  /// in place (BINBYTES, SHORT_BINBYTES, BINBYTES8, BYTEARRAY8).
  void push_bytes(std::string_view in, bool bytearray) { push(input_bytes(in, bytearray)); }
  /// EMPTY_SET: pushes a new set.
  void push_empty_set() { push(new_node(pickle_value::kind::set)); }
  /// ADDITEMS: adds the values above the innermost MARK to the set below it, in place.
  void add_set_items() {
    const std::size_t m = mark();
    node* c = container_below(m, pickle_value::kind::set, "ADDITEMS");
    if (c->alt) bad("ADDITEMS on a frozenset");
    changed();
    add(c, stack_.data() + m, stack_.size() - m);
    stack_.resize(m);
  }
  /// FROZENSET: the values above the innermost MARK become a frozenset.
  void push_frozenset() {
    collect(pickle_value::kind::set, mark());
    stack_.back()->alt = true;
  }
  /// Adds entry (key, v) to the dict on top of the stack, in place (other references to it, from
  /// the memo, see the change), as SETITEM does.
  void extend_top(const pickle_value& key, const pickle_value& v) {
    node* d = container(pickle_value::kind::dict, "extend_top");
    std::unordered_map<const void*, node*> seen;
    node* kn = make(key, seen);
    node* vn = make(v, seen);
    node* kv[2] = {kn, vn};
    changed();
    add(d, kv, 2);
  }

 private:
  using detail::pickle_machine::push;  // push(node*): the opcodes' own, beside push(pickle_value) above

  // Runs the opcodes up to STOP; root_ is then the value.
  void read() {
    while (true) {
      if (pos_ >= in_.size()) {
        ran_out_ = true;
        bad("ends without STOP");
      }
      const std::size_t at = pos_;
      const unsigned char op = static_cast<unsigned char>(in_[pos_++]);
      switch (op) {
        case 0x80: {  // PROTO
          const auto v = static_cast<unsigned char>(take(1)[0]);
          if (v > 5) bad("protocol " + std::to_string(v) + " is newer than 5, the highest Python writes");
          break;
        }
        case 0x95: {  // FRAME: its bytes must all be there
          const std::uint64_t n = le(take(8));
          if (n > in_.size() - pos_) ran_out_ = true;
          if (n > in_.size() - pos_)
            bad("is truncated (a FRAME at byte " + std::to_string(at) + " declares " + std::to_string(n) + " bytes, " +
                std::to_string(in_.size() - pos_) + " follow)");
          frame_end_ = pos_ + static_cast<std::size_t>(n);
          break;
        }
        case '(': marks_.push_back(stack_.size()); break;  // MARK
        case '.': {                                        // STOP
          if (stack_.size() != 1 || !marks_.empty())
            bad("STOP with " + std::to_string(stack_.size()) + " values on the stack");
          // Python reads a whole frame before its opcodes: a frame reaching past STOP hides
          // bytes a stream's next pickle would start with here, and Python after them
          if (frame_end_ > pos_)
            bad("STOP at byte " + std::to_string(at) + " lies inside a FRAME that runs to byte " +
                std::to_string(frame_end_));
          root_ = stack_.back();
          return;
        }
        case 'N': push(none_node()); break;
        case 0x88: push(bool_node(true)); break;
        case 0x89: push(bool_node(false)); break;
        case 'K': push(int_node(static_cast<std::int64_t>(le(take(1))))); break;
        case 'M': push(int_node(static_cast<std::int64_t>(le(take(2))))); break;
        case 'J': push(int_node(static_cast<std::int32_t>(static_cast<std::uint32_t>(le(take(4)))))); break;
        case 0x8a: push(int_node(long_int(le(take(1)), at))); break;  // LONG1
        case 0x8b: push(int_node(long_int(le(take(4)), at))); break;  // LONG4
        case 'G': {
          std::uint64_t bits = 0;
          for (unsigned char c : take(8)) bits = (bits << 8) | c;
          node* n = new_node(kind::real);
          n->u.d = std::bit_cast<double>(bits);
          push(n);
          break;
        }
        case 'X': push(input_string(text(le(take(4))))); break;   // BINUNICODE
        case 0x8c: push(input_string(text(le(take(1))))); break;  // SHORT_BINUNICODE
        case 0x8d: push(input_string(text(le(take(8))))); break;  // BINUNICODE8
        case ']': push(new_node(kind::list)); break;
        case ')': push(empty_tuple()); break;  // tuples never change: one empty tuple, as in Python
        case '}': push(new_node(kind::dict)); break;
        case 'a': {  // APPEND
          node* x = pop();
          node* c = container(kind::list, "APPEND");
          changed();
          add(c, &x, 1);
          break;
        }
        case 'e': {  // APPENDS
          const std::size_t m = mark();
          node* c = container_below(m, kind::list, "APPENDS");
          changed();
          add(c, stack_.data() + m, stack_.size() - m);
          stack_.resize(m);
          break;
        }
        case 's': {  // SETITEM
          node* v = pop();
          node* k = pop();
          node* c = container(kind::dict, "SETITEM");
          node* kv[2] = {k, v};
          changed();
          add(c, kv, 2);
          break;
        }
        case 'u': {  // SETITEMS
          const std::size_t m = mark();
          if ((stack_.size() - m) % 2) bad("SETITEMS with an odd number of values");
          node* c = container_below(m, kind::dict, "SETITEMS");
          changed();
          add(c, stack_.data() + m, stack_.size() - m);
          stack_.resize(m);
          break;
        }
        case 0x85:
        case 0x86:
        case 0x87: {  // TUPLE1..3
          const std::size_t n = op - 0x84u;
          if (stack_.size() < n + base()) bad("TUPLE" + std::to_string(n) + " with too few values");
          collect(kind::tuple, stack_.size() - n);
          break;
        }
        case 't': collect(kind::tuple, mark()); break;  // TUPLE
        case 'l': collect(kind::list, mark()); break;   // LIST (protocol 0/1)
        case 'd': {                                     // DICT (protocol 0/1)
          const std::size_t m = mark();
          if ((stack_.size() - m) % 2) bad("DICT with an odd number of values");
          collect(kind::dict, m);
          break;
        }
        case 0x94: memo_put(memo_.size()); break;  // MEMOIZE
        case 'q': memo_put(le(take(1))); break;    // BINPUT
        case 'r': memo_put(le(take(4))); break;    // LONG_BINPUT
        case 'h': memo_get(le(take(1))); break;    // BINGET
        case 'j': memo_get(le(take(4))); break;    // LONG_BINGET
        case '0': pop(); break;                    // POP
        case '2': push(top()); break;              // DUP
        default:
          if (!policy_.on_opcode(*this, op, at)) refuse(op, at);
      }
      if (stack_.size() > max_stack_) bad("too many values on the stack");
    }
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
