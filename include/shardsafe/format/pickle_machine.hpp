// shardsafe/format/pickle_machine.hpp - the machine a pickle reader runs on: its input, the arena
// of values it makes (format/pickle_view.hpp's nodes), its stack, marks and memo, the limits on
// all of them (values, steps of work, stack, depth, memo), and the checks and copies of a value
// made (cycles, depth and size refused before anything is built).
//
// Not a template: one copy serves every opcode policy. basic_pickle_reader
// (format/pickle_reader.hpp) derives from it, reads the opcodes, and says which of its members a
// PickleOpcodePolicy may call; nothing else uses it.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/json_error.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/format/pickle_view.hpp"

namespace shardsafe {

namespace detail {

/// The state of a pickle reader and what works on it, but for the opcodes: what
/// basic_pickle_reader<Policy> (format/pickle_reader.hpp) derives from. Everything is protected:
/// the reader makes public what a PickleOpcodePolicy may call (bad, take).
class pickle_machine {
 protected:
  /// Reads `in`; `what` names the bytes in messages; `max_values` and `max_made` as
  /// basic_pickle_reader takes them.
  pickle_machine(std::string_view in, std::string what, std::size_t max_values, std::size_t max_made)
      : in_(in),
        what_(std::move(what)),
        max_nodes_(
            std::min<std::uint64_t>(max_values > SIZE_MAX - in.size() / 8 ? SIZE_MAX : max_values + in.size() / 8,
                                    64 * std::uint64_t(in.size()) + 4096)),
        popped_budget_(8 * max_nodes_),
        work_budget_(8 * max_nodes_),
        max_made_(max_made) {
    true_.u.b = true;
    empty_tuple_.u.seq = {nullptr, 0, 0};
  }
  pickle_machine(const pickle_machine&) = delete;
  pickle_machine& operator=(const pickle_machine&) = delete;

  /// Throws errc::invalid_metadata: "<what>: pickle <why>".
  [[noreturn]] void bad(const std::string& why) const { fail(errc::invalid_metadata, what_ + ": pickle " + why); }
  /// The next n bytes of the input (an opcode's argument); refuses input that ends before them.
  std::string_view take(std::uint64_t n) {
    if (n > in_.size() - pos_) ran_out_ = true;
    if (n > in_.size() - pos_)
      bad("is truncated (needs " + std::to_string(n) + " bytes at byte " + std::to_string(pos_) + ")");
    auto s = in_.substr(pos_, static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return s;
  }

  using node = detail::pickle_node;
  using kind = pickle_value::kind;

  static constexpr std::size_t max_stack_ = 1 << 16;
  // Python's own bound on a pickle it writes (sys.getrecursionlimit(): pickle.dumps, torch.save and
  // dcp.save raise RecursionError past it); each level costs the readers and writers here about
  // half a KiB of call stack (under 1 MiB in all, measured: docs/FORMAT.md §3)
  static constexpr std::size_t max_depth_ = 1000;

  static std::uint64_t le(std::string_view b) {
    std::uint64_t x = 0;
    for (std::size_t i = b.size(); i-- > 0;) x = (x << 8) | static_cast<unsigned char>(b[i]);
    return x;
  }
  std::int64_t long_int(std::uint64_t n, std::size_t at) {
    if (n > 8)
      bad("integer of " + std::to_string(n) + " bytes at byte " + std::to_string(at) + " does not fit 64 bits");
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
  // A node more in the arena: at most max_made_ of them (what bounds the reader's memory where
  // values made and dropped, or made by a policy, are not the result's)
  node* arena_node() {
    if (nodes_.size() >= max_made_)
      bad("makes more than " + std::to_string(max_made_) + " values (ints, strs, containers: the reader's bound)");
    return &nodes_.emplace_back();
  }
  node* new_node(kind k) {
    charge(1);
    node* n = arena_node();
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
        c = arena_node();
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
  // A bytes (bytearray) of the input, read in place.
  node* input_bytes(std::string_view s, bool bytearray) {
    node* n = new_node(kind::bytes);
    n->u.s = {s.data(), s.size()};
    n->alt = bytearray;
    return n;
  }
  // A string a policy made (a class name, a key): held once, however often it is made.
  node* own_string(const std::string& s) {
    charge(1);
    if (auto it = owned_.find(s); it != owned_.end()) return it->second;
    node* n = arena_node();
    const std::string& kept = owned_text_.emplace_back(s);
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
          } else if constexpr (std::is_same_v<T, pickle_bytes>) {
            node* n = new_node(kind::bytes);
            const std::string& kept = owned_text_.emplace_back(x.data);
            n->u.s = {kept.data(), kept.size()};
            n->alt = x.bytearray;
            return n;
          } else {
            if (auto it = seen.find(x.get()); it != seen.end()) return it->second;
            node* n = new_node(v.type());
            if constexpr (std::is_same_v<T, std::shared_ptr<pickle_set>>) n->alt = x->frozen;
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
    if (i >= memo_.size() || !memo_[static_cast<std::size_t>(i)])
      bad("memo index " + std::to_string(i) + " was never stored");
    push(memo_[static_cast<std::size_t>(i)]);
  }

  // Counts the values n expands to, once per node (shared references are cheap to count but
  // are copied when built), so a memo blow-up is refused before anything is built.
  std::uint64_t expanded_size(node* n, std::size_t depth) {
    if (n->k == kind::string || n->k == kind::bytes) return detail::pickle_string_cost(n->u.s.size);
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
  std::size_t frame_end_ = 0;                            // where the last FRAME's bytes end
  bool ran_out_ = false;                                 // the input ended before the pickle did
  std::unordered_map<const node*, const char*> sealed_;  // values push_sealed made: what each stands for
  std::vector<node*> stack_;
  std::vector<std::size_t> marks_;
  std::deque<node*> memo_;     // a deque: no spare capacity, however many entries
  std::size_t max_nodes_;      // values a result may expand to, as a tree
  std::size_t popped_budget_;  // values all pop_value calls together may still build
  std::size_t work_budget_;    // values made and entries copied that are still allowed
  std::size_t max_made_;       // nodes the arena may hold
  std::uint32_t epoch_ = 1;    // counts of values made in this epoch (stamp) are current
  node* root_ = nullptr;       // the value, after STOP
  // the arena: nodes, containers' items, strings a policy made (once each), shared scalars
  std::deque<node> nodes_;
  detail::slot_pool slots_;
  std::deque<std::string> owned_text_;
  std::unordered_map<std::string_view, node*> owned_;
  std::array<node*, 256> small_ints_{};
  node none_{}, true_{pickle_value::kind::boolean}, false_{pickle_value::kind::boolean},
      empty_tuple_{pickle_value::kind::tuple};
};

}  // namespace detail

}  // namespace shardsafe
