// shardsafe/detail/fork_guard.hpp - the one owner of what this library does about fork(): a
// single pthread_atfork registration, and the objects (participants) that take part in it.
//
// fork() copies one thread: a lock another thread of the parent held stays held in the child
// for ever. So every object whose lock a child may take (each thread pool,
// detail/thread_pool.hpp; the descriptor cache, storage/file.hpp) registers here as a
// participant with three callbacks, which run as pthread_atfork's handlers would:
//
//   prepare  before the fork, in the forking thread: take the object's lock (and hold it across)
//   parent   after it, in the parent: let it go
//   child    after it, in the child (one thread, the one that forked): let it go, or start afresh
//
// prepare runs in reverse order of registration, parent and child in order of registration,
// as pthread_atfork orders its own handlers. The registry's mutex is held from before the
// first prepare until after the last parent or child, so no participant comes or goes during
// a fork. A participant's lock is never held while its owner adds or removes it, and no
// participant's lock is taken under another's, so the order among participants cannot deadlock.
//
// A participant registers once it can be locked (its mutex constructed) and removes itself
// before its mutex is destroyed; callbacks must not throw and must not add or remove
// participants. The registry itself is never destroyed: a fork may come during exit.
#pragma once

#include <pthread.h>

#include <algorithm>
#include <cstddef>
#include <mutex>
#include <vector>

namespace shardsafe::detail {

/// One object that takes part in fork: its address and what to do before and after it.
struct fork_participant {
  void* self = nullptr;
  void (*prepare)(void* self) noexcept = nullptr;
  void (*parent)(void* self) noexcept = nullptr;
  void (*child)(void* self) noexcept = nullptr;
};

/// The process's participants in fork, and the single pthread_atfork registration that runs them.
class fork_guard {
 public:
  static fork_guard& instance() {
    static fork_guard* g = [] {
      auto* made = new fork_guard;  // never destroyed: a fork may come during exit
      // (fails only without memory for the handlers: the participants then work as before,
      // unsafe in a child made by fork)
      (void)::pthread_atfork(&prepare_all, &parent_all, &child_all);
      return made;
    }();
    return *g;
  }

  fork_guard(const fork_guard&) = delete;
  fork_guard& operator=(const fork_guard&) = delete;

  /// Adds p; its callbacks run at every fork from now until remove(p.self).
  void add(const fork_participant& p) {
    std::lock_guard lock(m_);
    participants_.push_back(p);
  }
  /// Removes the participant at `self` (nothing if none); waits for a fork under way to finish.
  void remove(const void* self) noexcept {
    std::lock_guard lock(m_);
    std::erase_if(participants_, [&](const fork_participant& p) { return p.self == self; });
  }

  /// Participants registered now.
  std::size_t size() const {
    std::lock_guard lock(m_);
    return participants_.size();
  }

 private:
  fork_guard() = default;

  static void prepare_all() noexcept {
    auto& g = instance();
    g.m_.lock();
    for (auto it = g.participants_.rbegin(); it != g.participants_.rend(); ++it) it->prepare(it->self);
  }
  static void parent_all() noexcept {
    auto& g = instance();
    for (const auto& p : g.participants_) p.parent(p.self);
    g.m_.unlock();
  }
  static void child_all() noexcept {
    auto& g = instance();
    for (const auto& p : g.participants_) p.child(p.self);
    g.m_.unlock();  // the child's one thread is the one that took it
  }

  mutable std::mutex m_;
  std::vector<fork_participant> participants_;
};

}  // namespace shardsafe::detail
