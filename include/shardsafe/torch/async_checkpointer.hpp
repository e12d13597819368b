// shardsafe/torch/async_checkpointer.hpp - asynchronous saves of LibTorch state: the training thread
// pays for the plan agreement and a snapshot of its tensors into staging memory; the writing,
// fsync and commit run in the background (checkpoint/async_save.hpp has the rules).
//
//   c10d_world world = init_world_from_env();
//   async_checkpointer ckpt(world.new_group());   // checkpoint traffic on a group of its own
//   for (step ...) {
//     train_step();
//     if (step % 100 == 0) {
//       ckpt.wait();   // optional: surface the previous save's error now
//       ckpt.save_model_and_optim_state(root.sub(checkpoint_name(step)), model_sd, &optim);
//     }
//   }
//   ckpt.wait();       // the last save is durable (destroying ckpt waits too)
//
// Tensors the snapshot can read directly (contiguous CPU) are copied with memcpy in 16 MiB
// pieces on the thread pool; others (CUDA, non-contiguous) are copied whole by ATen. When
// CUDA is available, staging is pinned host memory, so those device-to-host copies run at
// full speed.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/async_save.hpp"
#include "shardsafe/torch/model_and_optim.hpp"
#include "shardsafe/torch/optim.hpp"
#include "shardsafe/torch/state_dict.hpp"
#include "shardsafe/torch/tensor_view.hpp"

namespace shardsafe {

namespace detail {

/// A source view of a state dict entry: its memory when the snapshot can read it directly,
/// else only its description (the copy goes through ATen).
inline flat_view source_view_of(const std::string& key, const sharded_tensor& t, std::string_view dir) {
  require_defined(dir, key, t);
  if (is_viewable(t.local)) return view_of(key, t, t.local);
  return described_view(key, t, dir);
}

/// The snapshot copy of state dict tensors: memcpy for directly readable ones, ATen's copy_
/// (device to host, strided) for the others.
struct copy_tensor_bytes {
  const std::vector<const at::Tensor*>* tensors;
  void operator()(std::size_t i, const flat_view& src, std::uint64_t off, std::span<std::byte> dst) const {
    if (dst.empty()) return;
    if (src.data) {
      std::memcpy(dst.data(), src.data + off, dst.size());
      return;
    }
    const at::Tensor& t = *(*tensors)[i];
    at::Tensor host = at::from_blob(dst.data(), t.sizes(), at::TensorOptions().dtype(t.scalar_type()));
    host.copy_(t);
  }
};

/// Staging memory pinned when CUDA is available (faster device-to-host copies), else the
/// default huge-page-advised allocation.
inline staging_buffer torch_staging() {
  if (!at::hasCUDA()) return {};
  return staging_buffer(pinned_host_bytes);
}

}  // namespace detail

/// Asynchronous saves of state dicts, and of model + optimizer pairs, over a comm of its own.
template <Comm C>
class async_checkpointer {
 public:
  explicit async_checkpointer(C comm, unsigned threads = 0)
      : saver_(std::move(comm), threads, detail::torch_staging()) {}

  /// save_state_dict's asynchronous counterpart: returns once the tensors are copied.
  template <WritableDirectory D>
  async_save_handle save_state_dict(const D& dir, const state_dict& sd, const save_options& opt = {}) {
    std::vector<flat_view> views;
    std::vector<const at::Tensor*> tensors;
    every_rank_step(saver_.comm(), [&] { describe(sd, dir.name(), views, tensors); });
    return saver_.save(dir, std::span<const flat_view>(views), opt, detail::copy_tensor_bytes{&tensors});
  }

  /// save_model_and_optim_state's asynchronous counterpart: DIR/optim, then DIR/model (whose
  /// metadata.json is the pair's commit mark), written in the background.
  template <WritableDirectory D>
  async_save_handle save_model_and_optim_state(const D& dir, const state_dict& model, torch::optim::Optimizer* optim,
                                               const save_options& opt = {}) {
    state_dict flat;
    std::vector<flat_view> optim_views, model_views;
    std::vector<const at::Tensor*> tensors;
    every_rank_step(saver_.comm(), [&] {
      if (optim) {
        flat = flatten_optimizer_state(*optim, model);
        describe(flat, dir.name(), optim_views, tensors);
      }
      describe(model, dir.name(), model_views, tensors);
    });
    const auto folders = model_and_optim_folders(model_views, optim_views, optim != nullptr);
    return saver_.save(dir, std::span<const folder_views>(folders), opt, detail::copy_tensor_bytes{&tensors});
  }

  /// Waits for the save in flight; rethrows its error.
  void wait() { saver_.wait(); }
  bool busy() const { return saver_.busy(); }
  async_saver<C>& saver() noexcept { return saver_; }

 private:
  static void describe(const state_dict& sd, std::string_view dir, std::vector<flat_view>& views,
                       std::vector<const at::Tensor*>& tensors) {
    for (const auto& [key, t] : sd) {
      views.push_back(detail::source_view_of(key, t, dir));
      tensors.push_back(&t.local);
    }
  }

  async_saver<C> saver_;
};

}  // namespace shardsafe
