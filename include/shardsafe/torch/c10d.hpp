// shardsafe/torch/c10d.hpp - the world built from the variables torchrun sets (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT), over its Comm, c10d_comm (torch/c10d_comm.hpp: a process
// group, Gloo on CPU or NCCL on GPUs, or, where no Gloo is compiled in, the store the ranks met
// through).
//
// Define USE_C10D_GLOO (the Meson dependency shardsafe-torch does where LibTorch's Gloo is
// installed) for worlds over ProcessGroupGloo. Without it (a LibTorch that ships no Gloo
// headers: Python's torch wheels), init_world_from_env builds a world whose collectives travel
// through c10d's TCPStore (c10d_transport::store): the same Comm, with no process group.
// What differs with USE_C10D_GLOO (c10d_world's members, init_world_from_env,
// detail::resolve_transport) lives in an inline namespace named after it (SHARDSAFE_C10D_ABI,
// below): units built with and without it link into one program with a definition each, not
// two definitions of one class (tests/torch/odr/ links the two), as SHARDSAFE_HTTP_ABI does
// for TLS. A c10d_world does not pass between two such units: each half has its own type.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/torch/c10d_comm.hpp"
#include "shardsafe/torch/compat.hpp"

// The Gloo switch names the namespace of what it changes (an inline namespace: code never spells
// it); defined here only.
#ifdef USE_C10D_GLOO
#define SHARDSAFE_C10D_ABI c10d_gloo
#else
#define SHARDSAFE_C10D_ABI c10d_store
#endif

namespace shardsafe {

inline namespace SHARDSAFE_C10D_ABI {

struct c10d_world;
/// Joins the world of RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (defined below).
inline c10d_world init_world_from_env(std::chrono::milliseconds timeout = std::chrono::minutes(5),
                                      c10d_transport transport = c10d_transport::automatic);

/// A process's place in a world: the store it rendezvoused through and its process group (null
/// over c10d_transport::store).
struct c10d_world {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  int rank = 0;
  int world_size = 1;
  c10d_transport transport = c10d_transport::gloo;  ///< gloo or store: how comm()'s collectives travel
#ifdef USE_C10D_GLOO
  c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> gloo_options;  ///< those pg was made with
#endif
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  ///< the store's and the group's
  /// A Comm over pg (or the store) whose failures call a roll call in the store (c10d_comm), a
  /// tenth of the timeout long (1 to 10 s). Every comm() of a world is the same group.
  c10d_comm comm() const {
    if (transport == c10d_transport::store)
      return c10d_comm(channel_, rank, world_size, store, roll_call(), store_host_wait());
    return c10d_comm(pg, at::kCPU, store, roll_call(), store_host_wait());
  }
  std::chrono::milliseconds roll_call() const {
    return std::clamp<std::chrono::milliseconds>(timeout / 10, std::chrono::seconds(1), std::chrono::seconds(10));
  }
  /// Rank 0 serves the store (init_world_from_env): it keeps it up for the others' roll calls.
  std::chrono::milliseconds store_host_wait() const { return rank == 0 ? timeout : std::chrono::milliseconds(0); }

  /// A second group over the same ranks (a Gloo process group, or a store channel over a
  /// connection of its own to the store), through the same store under a prefix of its own
  /// ("shardsafe/group/N", N counting the groups this world made): its collectives never
  /// interleave with comm()'s, and the two may run at once from two threads. For checkpoint traffic of
  /// asynchronous saves (torch/async_checkpointer.hpp), as torch's async checkpointing uses a
  /// group of its own. A collective: every rank calls it, in the same order.
  c10d_comm new_group() {
    if (!store) fail(errc::invalid_argument, "c10d_world::new_group: this world was not made by init_world_from_env");
    const std::string prefix = "shardsafe/group/" + std::to_string(++*groups_made_);
    try {
      if (transport == c10d_transport::store) {
        // a connection of its own: a TCPStore client serves one operation at a time, and a
        // rank waiting for a key of one group must not hold up its keys of the other
        if (store_port_ == 0)
          fail(errc::invalid_argument, "c10d_world::new_group: this world was not made by init_world_from_env");
        auto client = detail::open_tcp_store(store_addr_, store_port_, timeout, false, 0);
        auto ch = std::make_shared<detail::store_channel>();
        ch->store = c10::make_intrusive<c10d::PrefixStore>(prefix, client);
        c10d_comm group(std::move(ch), rank, world_size, client, roll_call(), store_host_wait());
        group.barrier();
        return group;
      }
#ifdef USE_C10D_GLOO
      if (!gloo_options)
        fail(errc::invalid_argument, "c10d_world::new_group: this world was not made by init_world_from_env");
      auto ps = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
      auto group = compat::make_gloo_process_group(ps, rank, world_size, gloo_options);
      group->barrier()->wait();  // every rank's side of every connection set up (init_world_from_env)
      return c10d_comm(std::move(group), at::kCPU, store, roll_call(), store_host_wait());
#else
      fail(errc::invalid_argument, "c10d_world::new_group: a Gloo world in a build without USE_C10D_GLOO");
#endif
    } catch (const c10::Error& e) {
      throw error(errc::comm_error, "c10d_world::new_group: rank " + std::to_string(rank) + " could not make " +
                                        prefix + ": " + e.what_without_backtrace());
    }
  }

 private:
  friend c10d_world init_world_from_env(std::chrono::milliseconds, c10d_transport);
  std::shared_ptr<detail::store_channel> channel_;  ///< comm()'s, over a store
  std::string store_addr_;                          ///< where the store is served (new_group's
  std::uint16_t store_port_ = 0;                    ///< connections, over a store)
  /// new_group's count, shared by the world's copies (two groups of one name would share keys)
  std::shared_ptr<std::atomic<int>> groups_made_ = std::make_shared<std::atomic<int>>(0);
};

}  // namespace SHARDSAFE_C10D_ABI

namespace detail {
inline std::string required_env(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v)
    fail(errc::invalid_argument,
         std::string("world from environment: ") + name +
             " is not set (set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as torchrun does)");
  return v;
}
inline long env_number(const char* name, long lo, long hi) {
  const std::string v = required_env(name);
  char* end = nullptr;
  errno = 0;
  long n = std::strtol(v.c_str(), &end, 10);
  if (errno || end == v.c_str() || *end || n < lo || n > hi)
    fail(errc::invalid_argument, std::string("world from environment: ") + name + "='" + v + "' is not a number in [" +
                                     std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return n;
}
}  // namespace detail

namespace detail {
inline namespace SHARDSAFE_C10D_ABI {
/// The transport `t` names, automatic resolved: SHARDSAFE_C10D_TRANSPORT, else Gloo where built in.
inline c10d_transport resolve_transport(c10d_transport t) {
  if (t == c10d_transport::automatic) {
    const char* v = std::getenv("SHARDSAFE_C10D_TRANSPORT");
    const std::string_view name = v ? v : "";
    if (name == "gloo")
      t = c10d_transport::gloo;
    else if (name == "store")
      t = c10d_transport::store;
    else if (!name.empty())
      fail(errc::invalid_argument, "world from environment: SHARDSAFE_C10D_TRANSPORT='" + std::string(name) +
                                       "' is neither 'gloo' nor 'store'");
    else
#ifdef USE_C10D_GLOO
      t = c10d_transport::gloo;
#else
      t = c10d_transport::store;
#endif
  }
#ifndef USE_C10D_GLOO
  if (t == c10d_transport::gloo)
    fail(errc::invalid_argument,
         "world from environment: Gloo was asked for, but this program was built without "
         "USE_C10D_GLOO (its LibTorch has no Gloo headers): use the store transport");
#endif
  return t;
}
}  // namespace SHARDSAFE_C10D_ABI
}  // namespace detail

inline namespace SHARDSAFE_C10D_ABI {

/// Joins the world described by RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: rank 0 serves
/// a TCPStore at MASTER_ADDR:MASTER_PORT and every rank connects. With Gloo (`transport`,
/// resolved as c10d_transport::automatic says) a Gloo process group is built on the store; its
/// interface: GLOO_SOCKET_IFNAME if set, loopback when MASTER_ADDR is a loopback address, else
/// the interface of this host's name. With the store, the collectives travel through it.
/// `timeout` bounds the store's operations and every collective of the group: a rank whose
/// peer died or whose link was cut ends with errc::comm_error at most `timeout` plus the roll
/// call (c10d_world::roll_call(), a tenth of it) after the failure, naming the ranks it lost;
/// rank 0, which serves the store, keeps it up for the others' roll calls: at most twice that.
inline c10d_world init_world_from_env(std::chrono::milliseconds timeout, c10d_transport transport) {
  c10d_world w;
  const int world = static_cast<int>(detail::env_number("WORLD_SIZE", 1, 1 << 20));
  const int rank = static_cast<int>(detail::env_number("RANK", 0, world - 1));
  const std::string addr = detail::required_env("MASTER_ADDR");
  const auto port = static_cast<std::uint16_t>(detail::env_number("MASTER_PORT", 1, 65535));
  w.transport = detail::resolve_transport(transport);
  w.rank = rank;
  w.world_size = world;
  w.timeout = timeout;
  try {
    w.store = detail::open_tcp_store(addr, port, timeout, rank == 0, world);
    if (w.transport == c10d_transport::store) {
      w.store_addr_ = addr;
      w.store_port_ = port;
      w.channel_ = std::make_shared<detail::store_channel>();
      w.channel_->store = w.store;
      return w;
    }
#ifdef USE_C10D_GLOO
    auto go = c10d::ProcessGroupGloo::Options::create(timeout);
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
      go->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    else if (addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1")
      go->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(addr));
    else
      go->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    w.pg = compat::make_gloo_process_group(w.store, rank, world, go);
    // A rank's ProcessGroupGloo is ready once its own side of each connection is; a peer may
    // still be reading its handshake. Without this barrier a rank that needs no collective
    // afterwards could exit first and break the peer's join ("Connection closed by peer"),
    // as torch's init_process_group waits on a barrier for the same reason.
    w.pg->barrier()->wait();
    w.gloo_options = go;
#endif
  } catch (const c10::Error& e) {
    throw error(errc::comm_error, "world from environment: rank " + std::to_string(rank) + " of " +
                                      std::to_string(world) + " could not join " + addr + ":" + std::to_string(port) +
                                      ": " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw error(errc::comm_error, "world from environment: rank " + std::to_string(rank) + " of " +
                                      std::to_string(world) + " could not join " + addr + ":" + std::to_string(port) +
                                      ": " + e.what());
  }
  return w;
}

}  // namespace SHARDSAFE_C10D_ABI

}  // namespace shardsafe
