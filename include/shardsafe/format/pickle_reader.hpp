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
  bool visiting = false;       // on the path being counted: reaching it again is a cycle
  std::uint16_t height = 0;    // nesting levels below it (as counted in epoch `stamp`)
  std::uint32_t stamp = 0;     // the reader's epoch when expanded and height were counted
  std::uint64_t expanded = 0;  // values it becomes as a tree (as counted in epoch `stamp`)
  struct slots {  // a container's items, in the reader's slot_pool
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
    return k == pickle_value::kind::list || k == pickle_value::kind::tuple || k == pickle_value::kind::dict;
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
    const std::uint64_t cap = std::min<std::uint64_t>(UINT32_MAX, std::max<std::uint64_t>(need, s.capacity ? 2 * std::uint64_t(s.capacity) : need));
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

// Copies node n (checked: no cycle, bounded depth) into a pickle_value; a node reached again
// gives the value built the first time (`built`), so shared containers stay shared. Each
// container built takes 1 + its items from `budget` (which started at `limit`), each str
// copied its bytes / 8 more; on running out, or past `max_depth`, bad(why) is called (and must
// throw).
template <class Bad>
pickle_value build_pickle_value(const pickle_node* n, std::size_t depth, std::size_t max_depth, std::size_t limit,
                                std::size_t& budget, std::unordered_map<const pickle_node*, pickle_value>& built,
                                const Bad& bad) {
  using k = pickle_value::kind;
  if (depth > max_depth) bad("nests deeper than " + std::to_string(max_depth) + " (or refers to itself)");
  switch (n->k) {
    case k::none: return pickle_value::none();
    case k::boolean: return pickle_value::boolean(n->u.b);
    case k::integer: return pickle_value::integer(n->u.i);
    case k::real: return pickle_value::real(n->u.d);
    case k::string: {
      const std::uint64_t extra = pickle_string_cost(n->u.s.size) - 1;  // its 1 is in its container's items
      if (budget < extra) bad(pickle_expansion_problem(limit));
      budget -= static_cast<std::size_t>(extra);
      return pickle_value::string(std::string(n->str()));
    }
    default: break;
  }
  if (auto it = built.find(n); it != built.end()) return it->second;
  const auto items = n->items();
  if (budget < 1 + items.size()) bad(pickle_expansion_problem(limit));
  budget -= 1 + items.size();
  pickle_value v;
  if (n->k == k::dict) {
    std::vector<std::pair<pickle_value, pickle_value>> entries;
    entries.reserve(items.size() / 2);
    for (std::size_t i = 0; i + 1 < items.size(); i += 2)
      entries.emplace_back(build_pickle_value(items[i], depth + 1, max_depth, limit, budget, built, bad),
                           build_pickle_value(items[i + 1], depth + 1, max_depth, limit, budget, built, bad));
    v = pickle_value::dict(std::move(entries));
  } else {
    std::vector<pickle_value> xs;
    xs.reserve(items.size());
    for (const auto* c : items) xs.push_back(build_pickle_value(c, depth + 1, max_depth, limit, budget, built, bad));
    v = n->k == k::list ? pickle_value::list(std::move(xs)) : pickle_value::tuple(std::move(xs));
  }
  built.emplace(n, v);
  return v;
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
  /// Items of a list or tuple, entries of a dict; 0 for a scalar.
  std::size_t size() const noexcept { return n_->container() ? n_->items().size() / (n_->k == pickle_value::kind::dict ? 2 : 1) : 0; }
  /// Item i of a list or tuple; key and value of entry i of a dict (i < size()).
  pickle_view item(std::size_t i) const { return at(i); }
  pickle_view key(std::size_t i) const { return at(2 * i); }
  pickle_view value(std::size_t i) const { return at(2 * i + 1); }
  /// The value under string key `key` of a dict (the last, as Python keeps it), or nullopt.
  std::optional<pickle_view> find(std::string_view key) const noexcept {
    if (n_->k != pickle_value::kind::dict) return std::nullopt;
    const auto items = n_->items();
    for (std::size_t i = items.size() / 2; i-- > 0;)
      if (items[2 * i]->k == pickle_value::kind::string && items[2 * i]->str() == key) return pickle_view(items[2 * i + 1]);
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
      fail(errc::invalid_metadata, std::string(ctx) + ": expected " + pickle_value::kind_name(k) + ", got " + pickle_value::kind_name(n_->k));
    return *n_;
  }
  pickle_view at(std::size_t i) const {
    if (!n_->container() || i >= n_->items().size()) throw std::out_of_range("pickle_view: no item " + std::to_string(i));
    return pickle_view(n_->items()[i]);
  }
  const detail::pickle_node* n_;
};

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
  /// the strings the input holds come on top (their bytes / 8: a str read once is never what
  /// the bound refuses, only one copied at each of many references); the reader lowers the sum
  /// to 64 per input byte plus 4096.
  basic_pickle_reader(std::string_view in, std::string what, Policy policy = {}, std::size_t max_values = default_max_values)
      : in_(in),
        what_(std::move(what)),
        max_nodes_(std::min<std::uint64_t>(max_values > SIZE_MAX - in.size() / 8 ? SIZE_MAX : max_values + in.size() / 8,
                                           64 * std::uint64_t(in.size()) + 4096)),
        popped_budget_(8 * max_nodes_),
        work_budget_(8 * max_nodes_),
        policy_(std::move(policy)) {
    true_.u.b = true;
    empty_tuple_.u.seq = {nullptr, 0, 0};
  }
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
  /// Throws errc::invalid_metadata: "<what>: pickle <why>".
  [[noreturn]] void bad(const std::string& why) const { fail(errc::invalid_metadata, what_ + ": pickle " + why); }
  /// The next n bytes of the input (an opcode's argument); refuses input that ends before them.
  std::string_view take(std::uint64_t n) {
    if (n > in_.size() - pos_) ran_out_ = true;
    if (n > in_.size() - pos_) bad("is truncated (needs " + std::to_string(n) + " bytes at byte " + std::to_string(pos_) + ")");
    auto s = in_.substr(pos_, static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return s;
  }
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
    if (t->k != pickle_value::kind::dict || t->items().size() < 2 || t->items()[0]->k != pickle_value::kind::string) return {};
    return std::string(t->items()[0]->str());
  }
  /// Pops the dict on top of the stack and adds its entries to the dict below it, in place, as
  /// SETITEMS would (BUILD with a state dict); the entries are shared, not copied.
  void merge_top_into_below(const char* op) {
    const node* s = top();
    if (s->k != pickle_value::kind::dict) bad(std::string(op) + " of a " + pickle_value::kind_name(s->k) + " into a dict");
    stack_.pop_back();
    node* d = container(pickle_value::kind::dict, op);
    charge(s->items().size());
    const std::vector<node*> items(s->items().begin(), s->items().end());  // a copy: s may be d itself
    changed();
    add(d, items.data(), items.size());
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
  using node = detail::pickle_node;
  using kind = pickle_value::kind;

  static constexpr std::size_t max_stack_ = 1 << 16;
  static constexpr std::size_t max_depth_ = 200;

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
        case 0x80: {                                     // PROTO
          const auto v = static_cast<unsigned char>(take(1)[0]);
          if (v > 5) bad("protocol " + std::to_string(v) + " is newer than 5, the highest Python writes");
          break;
        }
        case 0x95: {                                     // FRAME: its bytes must all be there
          const std::uint64_t n = le(take(8));
          if (n > in_.size() - pos_) ran_out_ = true;
          if (n > in_.size() - pos_)
            bad("is truncated (a FRAME at byte " + std::to_string(at) + " declares " + std::to_string(n) +
                " bytes, " + std::to_string(in_.size() - pos_) + " follow)");
          frame_end_ = pos_ + static_cast<std::size_t>(n);
          break;
        }
        case '(': marks_.push_back(stack_.size()); break;  // MARK
        case '.': {                                      // STOP
          if (stack_.size() != 1 || !marks_.empty()) bad("STOP with " + std::to_string(stack_.size()) + " values on the stack");
          // Python reads a whole frame before its opcodes: a frame reaching past STOP hides
          // bytes a stream's next pickle would start with here, and Python after them
          if (frame_end_ > pos_)
            bad("STOP at byte " + std::to_string(at) + " lies inside a FRAME that runs to byte " + std::to_string(frame_end_));
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
        case 0x85: case 0x86: case 0x87: {  // TUPLE1..3
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
  std::string_view text(std::uint64_t n) {
    auto b = take(n);
    if (!detail::is_valid_utf8(b)) bad("string at byte " + std::to_string(pos_ - n) + " is not UTF-8");
    return b;
  }
  // Counts n steps of work (values made, entries copied) against the budget of 8 x max_values.
  void charge(std::size_t n) {
    if (n > work_budget_) bad("needs more than " + std::to_string(8 * max_nodes_) + " steps to read");
    work_budget_ -= n;
  }

  // --- the arena: every value made lives until the reader goes ---
  node* new_node(kind k) {
    charge(1);
    node* n = &nodes_.emplace_back();
    n->k = k;
    if (n->container()) n->u.seq = {nullptr, 0, 0};
    return n;
  }
  node* none_node() {
    charge(1);
    return &none_;
  }
  node* bool_node(bool b) {
    charge(1);
    return b ? &true_ : &false_;
  }
  node* empty_tuple() {
    charge(1);
    return &empty_tuple_;
  }
  node* int_node(std::int64_t i) {
    if (i >= 0 && i < static_cast<std::int64_t>(small_ints_.size())) {
      charge(1);
      node*& c = small_ints_[static_cast<std::size_t>(i)];
      if (!c) {
        c = &nodes_.emplace_back();
        c->k = kind::integer;
        c->u.i = i;
      }
      return c;
    }
    node* n = new_node(kind::integer);
    n->u.i = i;
    return n;
  }
  // A string of the input, read in place.
  node* input_string(std::string_view s) {
    node* n = new_node(kind::string);
    n->u.s = {s.data(), s.size()};
    return n;
  }
  // A string a policy made (a class name, a key): held once, however often it is made.
  node* own_string(const std::string& s) {
    charge(1);
    if (auto it = owned_.find(s); it != owned_.end()) return it->second;
    const std::string& kept = owned_text_.emplace_back(s);
    node* n = &nodes_.emplace_back();
    n->k = kind::string;
    n->u.s = {kept.data(), kept.size()};
    owned_.emplace(std::string_view(kept), n);
    return n;
  }
  // A node for v; a container's items become nodes of their own, so opcodes can add to it. A
  // container v refers to more than once becomes one node (`seen`), so sharing is kept.
  node* make(const pickle_value& v, std::unordered_map<const void*, node*>& seen) {
    return std::visit(
        [&](const auto& x) -> node* {
          using T = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<T, std::monostate>) {
            return none_node();
          } else if constexpr (std::is_same_v<T, bool>) {
            return bool_node(x);
          } else if constexpr (std::is_same_v<T, std::int64_t>) {
            return int_node(x);
          } else if constexpr (std::is_same_v<T, double>) {
            node* n = new_node(kind::real);
            n->u.d = x;
            return n;
          } else if constexpr (std::is_same_v<T, std::string>) {
            return own_string(x);
          } else {
            if (auto it = seen.find(x.get()); it != seen.end()) return it->second;
            node* n = new_node(v.type());
            seen.emplace(x.get(), n);
            if constexpr (std::is_same_v<T, std::shared_ptr<pickle_dict>>) {
              for (const auto& [key, val] : x->entries) {
                node* kv[2] = {make(key, seen), make(val, seen)};
                add(n, kv, 2);
              }
            } else {
              for (const auto& item : x->items) {
                node* c = make(item, seen);
                add(n, &c, 1);
              }
            }
            return n;
          }
        },
        v.as_variant());
  }

  // --- the stack and the memo ---
  void push(node* p) { stack_.push_back(p); }
  std::size_t base() const { return marks_.empty() ? 0 : marks_.back(); }
  node* top() const {
    if (stack_.size() <= base()) bad("reads an empty stack");
    return stack_.back();
  }
  node* at_(std::size_t from_top) const {
    if (stack_.size() <= base() + from_top) bad("reads past the bottom of the stack");
    return stack_[stack_.size() - 1 - from_top];
  }
  node* pop() {
    node* p = top();
    stack_.pop_back();
    return p;
  }
  // Pops the innermost MARK; the values above it are stack_[mark, end).
  std::size_t mark() {
    if (marks_.empty()) bad("needs a MARK that is not there");
    const std::size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }
  // A new container of kind k holding stack_[from, end), which it replaces on the stack.
  void collect(kind k, std::size_t from) {
    node* c = new_node(k);
    add(c, stack_.data() + from, stack_.size() - from);
    stack_.resize(from);
    push(c);
  }
  node* container(kind k, const char* op) {
    node* c = top();
    if (c->k != k) bad(std::string(op) + " on a " + pickle_value::kind_name(c->k));
    unsealed(c, op);
    return c;
  }
  void unsealed(const node* c, const char* op) const {
    if (const auto s = sealed_.find(c); s != sealed_.end())
      bad(std::string(op) + " on a " + s->second + " (Python would call its __setitem__, which may change its values)");
  }
  // A container is about to change: every count of values made before is stale (it may be
  // inside any container counted), so the epoch moves on.
  void changed() {
    if (++epoch_ == 0) {  // after 2^32 changes: no stamp may match by chance
      for (auto& n : nodes_) n.stamp = 0;
      epoch_ = 1;
    }
  }
  // Appends items [p, p + n) to container c (p may point into the stack; not into c's own items).
  void add(node* c, node* const* p, std::size_t n) {
    if (!n) return;
    if (!slots_.reserve(c->u.seq, n)) bad("container of more than " + std::to_string(UINT32_MAX) + " items");
    std::copy(p, p + n, c->u.seq.data + c->u.seq.size);
    c->u.seq.size += static_cast<std::uint32_t>(n);
  }
  // The container of kind k just below MARK m (what APPENDS and SETITEMS add to).
  node* container_below(std::size_t m, kind k, const char* op) {
    if (m <= base()) bad("reads an empty stack");
    node* c = stack_[m - 1];
    if (c->k != k) bad(std::string(op) + " on a " + pickle_value::kind_name(c->k));
    unsealed(c, op);
    return c;
  }
  void memo_put(std::uint64_t i) {
    // Python's pickler memoizes each object once, after the opcode that made it: a pickle of n
    // bytes has fewer than n / 2 entries (2^20 are allowed whatever the size)
    if (i > std::max<std::size_t>(std::size_t(1) << 20, in_.size() / 2))
      bad("memo index " + std::to_string(i) + " is too large for " + std::to_string(in_.size()) + " bytes");
    if (i >= memo_.size()) memo_.resize(static_cast<std::size_t>(i) + 1);
    memo_[static_cast<std::size_t>(i)] = top();
  }
  void memo_get(std::uint64_t i) {
    if (i >= memo_.size() || !memo_[static_cast<std::size_t>(i)]) bad("memo index " + std::to_string(i) + " was never stored");
    push(memo_[static_cast<std::size_t>(i)]);
  }

  // Counts the values n expands to, once per node (shared references are cheap to count but
  // are copied when built), so a memo blow-up is refused before anything is built.
  std::uint64_t expanded_size(node* n, std::size_t depth) {
    if (n->k == kind::string) return detail::pickle_string_cost(n->u.s.size);
    if (!n->container()) return 1;
    if (n->visiting) bad("container contains itself (a cycle cannot be read as plain data)");
    if (n->stamp == epoch_) {
      if (depth + n->height > max_depth_) bad("nests deeper than " + std::to_string(max_depth_));
      return n->expanded;
    }
    if (depth > max_depth_) bad("nests deeper than " + std::to_string(max_depth_));
    std::uint64_t total = 1;
    std::size_t height = 0;
    n->visiting = true;
    for (node* c : n->items()) {
      total += expanded_size(c, depth + 1);
      if (total > max_nodes_) bad(detail::pickle_expansion_problem(max_nodes_));
      height = std::max<std::size_t>(height, c->container() ? c->height + 1u : 1u);
    }
    n->visiting = false;
    n->height = static_cast<std::uint16_t>(height);
    n->expanded = total;
    n->stamp = epoch_;
    return total;
  }
  // The value of n as a pickle_value, each node built once (shared containers stay shared);
  // at most max_values of them; `budget` (when given, starting at max_values) counts those built.
  pickle_value build(const node* n, std::size_t* budget = nullptr) const {
    std::size_t whole = max_nodes_;
    std::unordered_map<const node*, pickle_value> built;
    return detail::build_pickle_value(n, 0, max_depth_, max_nodes_, budget ? *budget : whole, built,
                                      [this](const std::string& why) { bad(why); });
  }

  std::string_view in_;
  std::string what_;
  std::size_t pos_ = 0;
  std::size_t frame_end_ = 0;  // where the last FRAME's bytes end
  bool ran_out_ = false;  // the input ended before the pickle did
  std::unordered_map<const node*, const char*> sealed_;  // values push_sealed made: what each stands for
  std::vector<node*> stack_;
  std::vector<std::size_t> marks_;
  std::deque<node*> memo_;  // a deque: no spare capacity, however many entries
  std::size_t max_nodes_;      // values a result may expand to, as a tree
  std::size_t popped_budget_;  // values all pop_value calls together may still build
  std::size_t work_budget_;    // values made and entries copied that are still allowed
  std::uint32_t epoch_ = 1;    // counts of values made in this epoch (stamp) are current
  node* root_ = nullptr;       // the value, after STOP
  // the arena: nodes, containers' items, strings a policy made (once each), shared scalars
  std::deque<node> nodes_;
  detail::slot_pool slots_;
  std::deque<std::string> owned_text_;
  std::unordered_map<std::string_view, node*> owned_;
  std::array<node*, 256> small_ints_{};
  node none_{}, true_{pickle_value::kind::boolean}, false_{pickle_value::kind::boolean}, empty_tuple_{pickle_value::kind::tuple};
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
