// tests/support/thread_world.hpp - the public world of threads (shardsafe/dist/threads.hpp) under the
// tests' names, and what a test asks of the exceptions its ranks threw.
#pragma once

#include <exception>
#include <string>
#include <system_error>

#include "shardsafe/core/error.hpp"
#include "shardsafe/dist/counted.hpp"
#include "shardsafe/dist/threads.hpp"

namespace testing {

using shardsafe::run_ranks;
using shardsafe::thread_comm;
using shardsafe::thread_world;

/// What an exception a rank threw says: its message, and its code (errc::io_error for one that is
/// not a shardsafe::error); "" and ok for no exception.
inline std::string error_message_of(const std::exception_ptr& e) {
  if (!e) return {};
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "(not a std::exception)";
  }
}
inline std::error_code error_code_of(const std::exception_ptr& e) {
  if (!e) return {};
  try {
    std::rethrow_exception(e);
  } catch (const shardsafe::error& x) {
    return x.code();
  } catch (...) {
    return shardsafe::make_error_code(shardsafe::errc::io_error);
  }
}

/// A thread_comm that counts what its rank sends and receives (dist/counted.hpp): a PeerComm
/// when `peer` is set, else a plain Comm (every_rank_step all-gathers then).
template <bool peer>
using counting_comm = shardsafe::counted_comm<thread_comm, peer>;
static_assert(shardsafe::PeerComm<counting_comm<true>> && shardsafe::Comm<counting_comm<false>> &&
              !shardsafe::PeerComm<counting_comm<false>>);

}  // namespace testing
