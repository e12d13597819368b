// shardsafe/dist/agree.hpp - steps whose outcome every rank agrees on.
//
// A collective algorithm must not leave ranks behind: if one rank throws while the others go
// on to the next collective, they wait for it forever. So each step that can fail runs under
// one of these two, which catch what the step throws, exchange the outcomes and then throw the
// same error on every rank, or return on every rank:
//
// | call                   | who runs f    | exchange          | returns (f returns void / std::string) |
// |------------------------|---------------|-------------------|----------------------------------------|
// | every_rank_step(c, f)  | every rank    | all_gather_bytes  | void / every rank's string, by rank    |
// |                        |               | (void f over a    |                                        |
// |                        |               | PeerComm: a tree) |                                        |
// | rank0_step(c, f)       | rank 0 only   | broadcast_bytes   | void / rank 0's string, on every rank  |
// |                        |               | (over a PeerComm: |                                        |
// |                        |               | down a tree)      |                                        |
//
// A void step over a PeerComm whose peer_to_peer() holds agrees up and down the binomial tree of
// dist/tree.hpp: a rank sends and receives O(log world) messages of one outcome each, where an
// all-gather hands every rank world outcomes (issue 56); rank0_step's outcome goes down the same
// tree. The error thrown is the same. A child
// that cannot be heard (it died, or never came to the step) is a failure of its parent naming
// it; a rank that cannot hear its parent throws the Comm's errc::comm_error naming that parent.
//
// Both are collectives over a Comm (every rank calls them, in the same order). When a step
// fails somewhere, every rank throws a shardsafe::error with the code the failing rank threw,
// category included (a shardsafe errc, or an errno value in the generic or system category),
// and the message "rank R: <what() on rank R>". If several ranks fail, R is the lowest of them
// and the message adds how many more failed, so every rank throws the same error. What is not
// a shardsafe error with such a code (a std::bad_alloc, a std::system_error of another
// category, an exception of any other type) arrives as errc::foreign_exception with its
// what() (and the foreign category and value, if it had a code).
//
// When the exchange itself fails (a rank died, a link was cut: the Comm throws errc::comm_error),
// the error says which step of what was exchanging: the step_scope objects alive on the thread
// ("save /ckpt/step10: writing the rank files: c10d all_gather_bytes on rank 1 of 6 failed: ...").
#pragma once

#include <climits>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/dist/message.hpp"
#include "shardsafe/dist/tree.hpp"

namespace shardsafe {

/// One rank's outcome of a step, as it travels between ranks: success with the step's result
/// text, or failure with the error's category, value and message.
struct step_outcome {
  bool failed = false;
  std::string category;  ///< failure: "shardsafe", "generic" or "system"
  int value = 0;         ///< failure: the code's value in that category
  std::string text;      ///< success: the step's result; failure: the error's message

  /// The outcome of the exception p: its code kept if its category is one of the three above,
  /// errc::foreign_exception otherwise.
  static step_outcome of_exception(std::exception_ptr p) {
    step_outcome o;
    o.failed = true;
    auto keep = [&](const std::error_code& code, std::string what) {
      const std::error_category& cat = code.category();
      if (cat == error_category() || cat == std::generic_category() || cat == std::system_category()) {
        o.category = cat.name();
        o.value = code.value();
        o.text = std::move(what);
      } else {
        o.category = error_category().name();
        o.value = static_cast<int>(errc::foreign_exception);
        o.text = std::move(what) + " [" + cat.name() + " error " + std::to_string(code.value()) + "]";
      }
    };
    try {
      std::rethrow_exception(p);
    } catch (const std::system_error& e) {  // shardsafe::error included
      keep(e.code(), e.what());
    } catch (const std::exception& e) {
      keep(make_error_code(errc::foreign_exception), e.what());
    } catch (...) {
      keep(make_error_code(errc::foreign_exception), "an exception that is not a std::exception");
    }
    return o;
  }

  /// The code this outcome carries (failed outcomes only).
  std::error_code code() const {
    if (category == std::generic_category().name()) return {value, std::generic_category()};
    if (category == std::system_category().name()) return {value, std::system_category()};
    return {value, error_category()};
  }

  /// The bytes sent to other ranks, a message (dist/message.hpp): a flag (failed), then the
  /// result, or the category, the value (as a two's complement 64-bit count) and the message.
  std::string encode() const {
    message_writer m;
    m.flag(failed);
    if (failed) m.text(category).count(static_cast<std::uint64_t>(static_cast<std::int64_t>(value)));
    m.text(text);
    return std::move(m).str();
  }

  /// The outcome encode() wrote; `from` ("rank 3") names the sender in the errc::comm_error
  /// for bytes that are not one.
  static step_outcome decode(std::string_view bytes, std::string_view from) {
    message_reader m(bytes, std::string(from) + " (the outcome of a step)");
    step_outcome o;
    o.failed = m.flag("the failure flag");
    if (o.failed) {
      o.category = m.text();
      if (o.category != error_category().name() && o.category != std::generic_category().name() &&
          o.category != std::system_category().name())
        m.malformed("the error category '" + o.category + "' is none of shardsafe, generic and system");
      const auto v = static_cast<std::int64_t>(m.count());
      if (v < INT_MIN || v > INT_MAX) m.malformed("the error value " + std::to_string(v) + " is not an int");
      o.value = static_cast<int>(v);
    }
    o.text = m.text();
    m.finish();
    return o;
  }
};

namespace detail {

/// The error every rank throws when `failed` ranks failed, `first` the lowest with outcome o.
[[noreturn]] inline void throw_step_failure(std::uint64_t first, std::uint64_t failed, const step_outcome& o) {
  std::string msg = "rank " + std::to_string(first) + ": " + o.text;
  if (failed > 1) msg += " (and " + std::to_string(failed - 1) + " more rank(s) failed)";
  throw error(o.code(), msg);
}

}  // namespace detail

/// Throws on the calling rank, if any outcome (indexed by rank) failed, the error of the lowest
/// failing rank: its code, and "rank R: " before its message (plus how many more ranks failed).
inline void throw_if_any_failed(std::span<const step_outcome> outcomes) {
  std::uint64_t failed = 0, first = 0;
  for (std::size_t r = 0; r < outcomes.size(); ++r)
    if (outcomes[r].failed && failed++ == 0) first = r;
  if (failed > 0) detail::throw_step_failure(first, failed, outcomes[first]);
}

/// Names, for the errors of exchanges that fail, what the collective steps run on this thread
/// are part of while it lives (nested scopes join with ": "; a scope equal to the one it nests
/// in, as when one call of a library function wraps another, is said once). Thread-local.
class step_scope {
 public:
  explicit step_scope(std::string what) { stack().push_back(std::move(what)); }
  ~step_scope() { stack().pop_back(); }
  step_scope(const step_scope&) = delete;
  step_scope& operator=(const step_scope&) = delete;

  /// The scopes alive on this thread, outermost first, joined with ": " (empty without any).
  static std::string describe() {
    std::string s;
    const std::vector<std::string>& st = stack();
    for (std::size_t i = 0; i < st.size(); ++i)
      if (i == 0 || st[i] != st[i - 1]) s += (s.empty() ? "" : ": ") + st[i];
    return s;
  }

 private:
  static std::vector<std::string>& stack() {
    static thread_local std::vector<std::string> s;
    return s;
  }
};

namespace detail {

/// Runs an exchange (returning what it returns, or nothing); a comm_error it throws gets the
/// step scopes in front.
template <class X>
auto exchange_in_scope(X&& x) {
  try {
    return x();
  } catch (const error& e) {
    const std::string where = step_scope::describe();
    if (e.code() != make_error_code(errc::comm_error) || where.empty()) throw;
    throw error(e.code(), where + ": " + e.what());
  }
}

template <class F>
concept step_function = std::is_void_v<std::invoke_result_t<F&>> || std::same_as<std::invoke_result_t<F&>, std::string>;

/// Runs f and returns its outcome; never throws (but for running out of memory).
template <class F>
step_outcome run_step(F& f) {
  try {
    if constexpr (std::is_void_v<std::invoke_result_t<F&>>) {
      f();
      return {};
    } else {
      step_outcome o;
      o.text = f();
      return o;
    }
  } catch (...) {
    return step_outcome::of_exception(std::current_exception());
  }
}

/// What the ranks of a subtree agree on: how many failed, and the lowest failing rank with its
/// outcome.
struct outcome_tally {
  std::uint64_t failed = 0, first = 0;
  step_outcome outcome;

  /// Adds the tally of other ranks (the failure of the lower rank is kept).
  void add(outcome_tally o) {
    if (o.failed > 0 && (failed == 0 || o.first < first)) {
      first = o.first;
      outcome = std::move(o.outcome);
    }
    failed += o.failed;
  }
  std::string encode() const {
    message_writer m;
    m.count(failed).count(first).text(outcome.encode());
    return std::move(m).str();
  }
  static outcome_tally decode(std::string_view bytes, std::string_view from) {
    message_reader m(bytes, std::string(from) + " (the outcomes of a step)");
    outcome_tally t;
    t.failed = m.count(INT_MAX, "the failed ranks");
    t.first = m.count(INT_MAX, "the first failing rank");
    t.outcome = step_outcome::decode(m.text(), from);
    m.finish();
    return t;
  }
  /// Throws what throw_if_any_failed throws for the same outcomes.
  void throw_if_failed() const {
    if (failed > 0) throw_step_failure(first, failed, outcome);
  }
};

/// A failure of rank r.
inline outcome_tally failure_of(int r, step_outcome o) {
  outcome_tally t;
  t.failed = 1;
  t.first = static_cast<std::uint64_t>(r);
  t.outcome = std::move(o);
  return t;
}

/// bytes becomes rank 0's bytes on every rank, down the tree (dist/tree.hpp): a rank hears its
/// parent (the Comm's errc::comm_error, in the step scopes, if it cannot), then tells its
/// children, farthest first (a child that is gone is passed over: the others still hear).
template <PeerComm C>
void broadcast_over_tree(C& comm, std::string& bytes) {
  const int r = comm.rank();
  if (r != 0) bytes = exchange_in_scope([&] { return comm.recv_bytes(tree_parent(r)); });
  const std::vector<int> children = tree_children(r, comm.world_size());
  for (auto it = children.rbegin(); it != children.rend(); ++it) try {
      comm.send_bytes(bytes, *it);
    } catch (const error&) {
    }
}

/// bytes becomes rank 0's bytes on every rank, down the binary tree of runs (run_tree_node):
/// a rank hears its parent, then tells its two children at most.
template <PeerComm C>
void broadcast_over_runs(C& comm, std::string& bytes) {
  const run_node node = run_tree_node(comm.rank(), comm.world_size());
  if (node.parent >= 0) bytes = exchange_in_scope([&] { return comm.recv_bytes(node.parent); });
  for (int k = 1; k >= 0; --k)
    if (node.children[k] >= 0) try {
        comm.send_bytes(bytes, node.children[k]);
      } catch (const error&) {
      }
}

/// every_rank_step's agreement on `mine` up and down the tree (dist/tree.hpp).
template <PeerComm C>
void agree_over_tree(C& comm, step_outcome mine) {
  const int r = comm.rank(), n = comm.world_size();
  outcome_tally t;
  if (mine.failed) t = failure_of(r, std::move(mine));
  const std::vector<int> children = tree_children(r, n);
  for (int child : children) {
    const std::string from = "rank " + std::to_string(child);
    try {
      t.add(outcome_tally::decode(exchange_in_scope([&] { return comm.recv_bytes(child); }), from));
    } catch (...) {  // a child that cannot be heard: this rank's failure, naming it
      t.add(failure_of(r, step_outcome::of_exception(std::current_exception())));
    }
  }
  std::string agreed = t.encode();
  if (r != 0) try {
      comm.send_bytes(agreed, tree_parent(r));
    } catch (const error&) {  // the parent is gone: hearing from it below fails, naming it
    }
  broadcast_over_tree(comm, agreed);
  outcome_tally::decode(agreed, r == 0 ? "rank 0" : "rank " + std::to_string(tree_parent(r))).throw_if_failed();
}

}  // namespace detail

/// Every rank runs f; then all ranks agree (see the table above). f returns void or
/// std::string; with std::string, every rank gets every rank's result, indexed by rank.
template <Comm C, class F>
  requires detail::step_function<F>
auto every_rank_step(C& comm, F&& f) {
  if constexpr (PeerComm<C> && std::is_void_v<std::invoke_result_t<F&>>) {
    if (comm.peer_to_peer() && comm.world_size() > 1) return detail::agree_over_tree(comm, detail::run_step(f));
  }
  const std::string mine = detail::run_step(f).encode();
  const std::vector<std::string> gathered = detail::exchange_in_scope([&] { return comm.all_gather_bytes(mine); });
  std::vector<step_outcome> outcomes;
  outcomes.reserve(gathered.size());
  for (std::size_t r = 0; r < gathered.size(); ++r)
    outcomes.push_back(step_outcome::decode(gathered[r], "rank " + std::to_string(r)));
  throw_if_any_failed(outcomes);
  if constexpr (!std::is_void_v<std::invoke_result_t<F&>>) {
    std::vector<std::string> results;
    results.reserve(outcomes.size());
    for (auto& o : outcomes) results.push_back(std::move(o.text));
    return results;
  }
}

/// Rank 0 runs f (the other ranks do not); then all ranks agree (see the table above). f
/// returns void or std::string; with std::string, every rank gets rank 0's result.
template <Comm C, class F>
  requires detail::step_function<F>
auto rank0_step(C& comm, F&& f) {
  std::string bytes = comm.rank() == 0 ? detail::run_step(f).encode() : std::string();
  bool tree = false;
  if constexpr (PeerComm<C>) tree = comm.peer_to_peer() && comm.world_size() > 1;
  if (tree) {
    if constexpr (PeerComm<C>) detail::broadcast_over_tree(comm, bytes);
  } else {
    detail::exchange_in_scope([&] { comm.broadcast_bytes(bytes, 0); });
  }
  step_outcome o = step_outcome::decode(bytes, "rank 0");
  throw_if_any_failed(std::span<const step_outcome>(&o, 1));
  if constexpr (!std::is_void_v<std::invoke_result_t<F&>>) return std::move(o.text);
}

namespace detail {

/// A tree's last step, where rank 0 alone needs one message from every rank (a save's sizes,
/// checksums or chunk places): each rank but 0 sends `own` to rank 0 alone; then `step(g)` runs
/// (rank0_step, or a step built on it), where g, on rank 0, hears every rank's message before it
/// reads any (one malformed leaves none behind unread) and returns use(messages), indexed by rank.
template <PeerComm C, class Step, class Use>
std::string gathered_at_rank0(C& comm, std::string own, Step&& step, Use&& use) {
  const int world = comm.world_size();
  if (comm.rank() != 0) try {
      comm.send_bytes(std::move(own), 0);
    } catch (const error&) {  // rank 0 is gone: hearing from it in the step fails, naming it
    }
  return step([&] {
    std::vector<std::string> messages;
    messages.reserve(static_cast<std::size_t>(world));
    messages.push_back(std::move(own));
    for (int r = 1; r < world; ++r) messages.push_back(exchange_in_scope([&] { return comm.recv_bytes(r); }));
    return std::string(use(messages));
  });
}

/// The step down from rank 0 where each rank needs a message of its own (on rank 0, `messages`,
/// indexed by rank): rank 0 sends each rank its message alone and each rank runs use(its
/// message), then every rank agrees (every_rank_step: a rank that cannot be reached, or whose
/// use throws, fails the step on every rank; rank 0 tries every other rank first).
template <PeerComm C, class Use>
void scattered_from_rank0(C& comm, std::vector<std::string> messages, Use&& use) {
  every_rank_step(comm, [&] {
    if (comm.rank() != 0) {
      use(exchange_in_scope([&] { return comm.recv_bytes(0); }));
      return;
    }
    std::exception_ptr first;
    for (int r = 1; r < comm.world_size(); ++r) try {
        exchange_in_scope([&] { comm.send_bytes(messages[static_cast<std::size_t>(r)], r); });
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    if (first) std::rethrow_exception(first);
    use(std::move(messages.at(0)));
  });
}

}  // namespace detail

}  // namespace shardsafe
