// shardsafe/torch/compat.hpp - the one place where LibTorch versions differ.
//
// shardsafe builds against LibTorch 1.13 (Debian 12) and 2.x (Debian 13's 2.6, the wheels' 2.x)
// from one source. Every difference between those versions is here, chosen by
// TORCH_VERSION_MAJOR / TORCH_VERSION_MINOR (torch/version.h); no other header, test, example or
// benchmark tests the version (scripts/check_layering.sh checks that).
//
// | what                         | LibTorch 1.13                         | LibTorch 2.x                                |
// |------------------------------|---------------------------------------|---------------------------------------------|
// | optimizer state map's key    | the parameter's TensorImpl* printed   | the parameter's TensorImpl* (void*)         |
// |                              | as a string (c10::guts::to_string)    |                                             |
// | a Gloo world's process group | ProcessGroupGloo is a ProcessGroup    | a ProcessGroup over the store, with the     |
// |                              |                                       | ProcessGroupGloo Backend registered for CPU |
// |                              |                                       | and made its default (as Python's           |
// |                              |                                       | init_process_group does)                    |
// | TCPStore                     | -                                     | useLibUV off when USE_LIBUV=0 is set (a     |
// |                              |                                       | LibTorch built without libuv, as Debian's)  |
// | waiting for a device event   | polls query(), yielding (c10::Event   | c10::Event::synchronize (2.6 and newer)     |
// |                              | has no synchronize)                   |                                             |
//
// The files a checkpoint holds are the same under both: the optimizer's state is named by the
// parameters' names in the model's state dict (torch/optim.hpp), never by these keys.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/optim/optimizer.h>
#include <torch/version.h>
#ifdef USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#ifndef TORCH_VERSION_MAJOR
#error "shardsafe/torch/compat.hpp: torch/version.h did not define TORCH_VERSION_MAJOR"
#endif

/// LibTorch's version as MAJOR * 100 + MINOR (1.13: 113, 2.6: 206).
#define SHARDSAFE_TORCH_VERSION (TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR)

#if SHARDSAFE_TORCH_VERSION < 113
#error "shardsafe needs LibTorch 1.13 or newer"
#endif

namespace shardsafe {

/// LibTorch's version, "MAJOR.MINOR.PATCH", as the headers compiled against say.
inline std::string torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

namespace compat {

#if SHARDSAFE_TORCH_VERSION >= 200
/// The key of a parameter in torch::optim::Optimizer::state().
using optimizer_state_key = void*;
inline optimizer_state_key state_key_of(const at::Tensor& p) { return p.unsafeGetTensorImpl(); }
#else
using optimizer_state_key = std::string;
inline optimizer_state_key state_key_of(const at::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }
#endif

/// Sets what this LibTorch's TCPStore needs beyond `so`: LibTorch 2.4 and newer serve the store
/// with libuv by default, which a LibTorch built without it (Debian's) cannot; as Python's
/// rendezvous does, USE_LIBUV=0 in the environment turns it off.
inline void tcp_store_options(c10d::TCPStoreOptions& so) {
#if SHARDSAFE_TORCH_VERSION >= 204
  if (const char* v = std::getenv("USE_LIBUV"); v && std::string_view(v) == "0") so.useLibUV = false;
#else
  (void)so;
#endif
}

/// Blocks until the work recorded by `e` is done (a device event: torch/device_copy.hpp).
inline void synchronize_event(const c10::Event& e) {
#if SHARDSAFE_TORCH_VERSION >= 206
  e.synchronize();
#else
  while (!e.query()) std::this_thread::yield();
#endif
}

#ifdef USE_C10D_GLOO
/// A process group of `size` ranks over `store` whose collectives run on Gloo. LibTorch 1.13:
/// ProcessGroupGloo itself. 2.x: a ProcessGroup with the Gloo Backend registered for CPU and made
/// its default, as torch.distributed.init_process_group builds it.
inline c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_process_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    const c10::intrusive_ptr<c10d::ProcessGroupGloo::Options>& options) {
#if SHARDSAFE_TORCH_VERSION >= 200
  auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
#if SHARDSAFE_TORCH_VERSION >= 205
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
#else
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(
      store, rank, size, c10::make_intrusive<c10d::ProcessGroup::Options>("gloo", options->timeout));
#endif
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
  return pg;
#else
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
#endif
}
#endif

}  // namespace compat

/// The state `opt` keeps for parameter `p` (nullptr before its first step, or for a tensor that
/// is not one of its parameters), under whichever key this LibTorch uses.
inline torch::optim::OptimizerParamState* optimizer_state_of(torch::optim::Optimizer& opt, const at::Tensor& p) {
  auto it = opt.state().find(compat::state_key_of(p));
  return it == opt.state().end() ? nullptr : it->second.get();
}
inline const torch::optim::OptimizerParamState* optimizer_state_of(const torch::optim::Optimizer& opt,
                                                                   const at::Tensor& p) {
  auto it = opt.state().find(compat::state_key_of(p));
  return it == opt.state().end() ? nullptr : it->second.get();
}

/// The state slot of parameter `p` in `opt`, created empty (a null pointer) when missing.
inline std::unique_ptr<torch::optim::OptimizerParamState>& optimizer_state_slot(torch::optim::Optimizer& opt,
                                                                                const at::Tensor& p) {
  return opt.state()[compat::state_key_of(p)];
}

}  // namespace shardsafe
