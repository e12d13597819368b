// shardsafe/torch/state_dict.hpp - named LibTorch tensors, each whole or a shard, saved to and
// loaded from sharded checkpoints; and full tensors out of a checkpoint.
//
// A sharded entry holds this rank's local data (`local`: the flat shard, as FSDP keeps it,
// or the block, as a tensor-parallel DTensor's local tensor) with its shard_spec and the full
// shape, and, when other ranks hold the same shard, its replica role (written once). Loading
// writes into the entries' tensors in place.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/torch/tensor_memory.hpp"
#include "shardsafe/torch/tensor_view.hpp"

namespace shardsafe {

struct sharded_tensor {
  at::Tensor local;                 ///< this rank's data
  std::optional<shard_spec> spec;   ///< nullopt: local is the whole tensor
  shape_t full_shape;               ///< the full shape (for a whole tensor: local's shape)
  /// For a shard other ranks hold too (HSDP, a replicated mesh dimension): whether this rank
  /// writes it (flat_view::replica; mesh_replica_role gives it from a mesh).
  replica_role replica = replica_role::none;
};

/// Named tensors in insertion order.
class state_dict {
 public:
  using value_type = std::pair<std::string, sharded_tensor>;

  /// A whole (replicated) tensor.
  state_dict& add(std::string key, at::Tensor t) {
    shape_t full = shape_of(t);
    entries_.push_back({std::move(key), sharded_tensor{std::move(t), std::nullopt, std::move(full)}});
    return *this;
  }
  /// This rank's shard of a tensor of shape `full`.
  state_dict& add(std::string key, at::Tensor local, shard_spec spec, shape_t full,
                  replica_role replica = replica_role::none) {
    entries_.push_back({std::move(key), sharded_tensor{std::move(local), std::move(spec), std::move(full), replica}});
    return *this;
  }
  state_dict& add(std::string key, sharded_tensor t) {
    entries_.push_back({std::move(key), std::move(t)});
    return *this;
  }

  const sharded_tensor* find(std::string_view key) const noexcept {
    for (const auto& [k, t] : entries_)
      if (k == key) return &t;
    return nullptr;
  }
  sharded_tensor* find(std::string_view key) noexcept {
    for (auto& [k, t] : entries_)
      if (k == key) return &t;
    return nullptr;
  }
  std::size_t size() const noexcept { return entries_.size(); }
  bool empty() const noexcept { return entries_.empty(); }
  auto begin() noexcept { return entries_.begin(); }
  auto end() noexcept { return entries_.end(); }
  auto begin() const noexcept { return entries_.begin(); }
  auto end() const noexcept { return entries_.end(); }

 private:
  std::vector<value_type> entries_;
};

namespace detail {
inline flat_view view_of(const std::string& key, const sharded_tensor& t, const at::Tensor& memory) {
  flat_view v = make_flat_view(key, memory, t.spec, t.full_shape);
  v.replica = t.replica;
  return v;
}
}  // namespace detail

namespace detail {
/// The views of sd's tensors for a save: each tensor's own memory, or a contiguous CPU copy
/// (kept in `keep`) of one that is not viewable. A rank whose tensors cannot be viewed fails the
/// save on every rank, before anything is written.
template <Comm C>
std::vector<flat_view> save_views(const state_dict& sd, std::vector<at::Tensor>& keep, C& comm, std::string_view dir) {
  std::vector<flat_view> views;
  keep.reserve(sd.size());
  views.reserve(sd.size());
  every_rank_step(comm, [&] {
    for (const auto& [key, t] : sd) {
      if (!t.local.defined()) fail(errc::invalid_argument, std::string(dir) + ": tensor '" + key + "' is undefined");
      at::Tensor mem = is_viewable(t.local) ? t.local : keep.emplace_back(t.local.detach().to(at::kCPU).contiguous());
      views.push_back(view_of(key, t, mem));
    }
  });
  return views;
}
}  // namespace detail

/// Saves a state dict as one checkpoint in dir (opt.format: shardsafe's layout or torch DCP's). A
/// collective over comm: an error on any rank is thrown, with its code, on every rank (dist/agree.hpp).
template <WritableDirectory D, Comm C>
save_stats save_state_dict(const D& dir, const state_dict& sd, C& comm, const save_options& opt = {}) {
  std::vector<at::Tensor> keep;  // contiguous CPU copies of tensors that are not
  const auto views = detail::save_views(sd, keep, comm, dir.name());
  return save_flat_views(dir, std::span<const flat_view>(views), comm, opt);
}

/// Loads a checkpoint into the state dict's tensors, in place. Tensors that are not CPU and
/// contiguous (e.g. CUDA) go through a CPU tensor of their own size, one at a time.
template <ReadableDirectory D>
load_stats load_state_dict(checkpoint_reader<D>& reader, state_dict& sd, const load_options& opt = {}) {
  std::vector<flat_view> direct;
  std::vector<std::pair<const std::string*, sharded_tensor*>> staged;
  for (auto& [key, t] : sd) {
    if (!t.local.defined())
      fail(errc::invalid_argument, std::string(reader.directory().name()) + ": tensor '" + key + "' is undefined");
    if (is_viewable(t.local))
      direct.push_back(detail::view_of(key, t, t.local));
    else
      staged.emplace_back(&key, &t);
  }
  load_stats st = reader.load(std::span<const flat_view>(direct), opt);
  for (auto [key, t] : staged) {
    at::Tensor tmp = at::empty(t->local.sizes(), t->local.options().device(at::kCPU).memory_format(at::MemoryFormat::Contiguous));
    flat_view v = detail::view_of(*key, *t, tmp);
    load_stats s = reader.load(std::span<const flat_view>(&v, 1), opt);
    {
      at::NoGradGuard no_grad;
      t->local.copy_(tmp);
    }
    st.tensors += s.tensors;
    st.bytes_needed += s.bytes_needed;
    st.bytes_read += s.bytes_read;
    st.read_ops += s.read_ops;
    st.missing_keys.insert(st.missing_keys.end(), s.missing_keys.begin(), s.missing_keys.end());
  }
  if (!staged.empty()) {  // unexpected keys: recompute over all entries
    st.unexpected_keys.clear();
    for (const auto& [k, tm] : reader.metadata().tensors)
      if (!sd.find(k)) st.unexpected_keys.push_back(k);
  }
  return st;
}

template <ReadableDirectory D>
load_stats load_state_dict(const D& dir, state_dict& sd, const load_options& opt = {}) {
  checkpoint_reader<D> reader(dir);
  return load_state_dict(reader, sd, opt);
}

/// Every tensor of a checkpoint, whole, in one process (reads run on the thread pool), in
/// tensors it allocates: one at::empty each, or all in one huge-page arena populated ahead of
/// the reads (torch/tensor_memory.hpp: much less page-fault time for a load into new memory).
template <ReadableDirectory D>
std::vector<std::pair<std::string, at::Tensor>> unshard_state(checkpoint_reader<D>& reader, const load_options& opt = {},
                                                              tensor_memory memory = tensor_memory::separate) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::vector<flat_view> views;
  std::vector<at::ScalarType> types;
  for (const auto& [key, tm] : reader.metadata().tensors)
    types.push_back(require_scalar_type(tm.type, std::string(reader.directory().name()) + ": tensor '" + key + "'"));
  std::unique_ptr<tensor_arena> arena;
  if (memory != tensor_memory::separate) {
    std::vector<std::uint64_t> sizes;
    for (const auto& [key, tm] : reader.metadata().tensors) sizes.push_back(tm.numel() * item_size(tm.type));
    arena = std::make_unique<tensor_arena>(std::span<const std::uint64_t>(sizes), memory == tensor_memory::hugetlb_arena);
  }
  std::size_t i = 0;
  for (const auto& [key, tm] : reader.metadata().tensors) {
    at::Tensor t = arena ? arena->tensor(i, to_sizes(tm.shape), types[i]) : at::empty(to_sizes(tm.shape), types[i]);
    views.push_back(make_flat_view(key, t));
    out.emplace_back(key, std::move(t));
    ++i;
  }
  if (arena) arena->populate_ahead();
  reader.load(std::span<const flat_view>(views), opt);
  return out;
}

template <ReadableDirectory D>
std::vector<std::pair<std::string, at::Tensor>> unshard_state(const D& dir, const load_options& opt = {},
                                                              tensor_memory memory = tensor_memory::separate) {
  checkpoint_reader<D> reader(dir);
  return unshard_state(reader, opt, memory);
}

/// unshard_state on rank 0 only (others get nothing); the ranks agree on the outcome: if rank 0
/// fails, every rank throws its error, with its code (dist/agree.hpp).
template <ReadableDirectory D, Comm C>
std::vector<std::pair<std::string, at::Tensor>> unshard_state_on_rank0(const D& dir, C& comm,
                                                                       const load_options& opt = {}) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  rank0_step(comm, [&] { out = unshard_state(dir, opt); });
  return out;
}

}  // namespace shardsafe
