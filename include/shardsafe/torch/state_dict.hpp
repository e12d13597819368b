// shardsafe/torch/state_dict.hpp - named LibTorch tensors, each whole or a shard, saved to and
// loaded from sharded checkpoints; and full tensors out of a checkpoint.
//
// A sharded entry holds this rank's local data (`local`: the flat shard, as FSDP keeps it,
// or the block, as a tensor-parallel DTensor's local tensor) with its shard_spec and the full
// shape, and, when other ranks hold the same shard, its replica role (written once). Loading
// writes into the entries' tensors in place.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/torch/device_copy.hpp"
#include "shardsafe/torch/host_staging.hpp"
#include "shardsafe/torch/tensor_memory.hpp"
#include "shardsafe/torch/tensor_view.hpp"

namespace shardsafe {

struct sharded_tensor {
  at::Tensor local;                ///< this rank's data
  std::optional<shard_spec> spec;  ///< nullopt: local is the whole tensor
  shape_t full_shape;              ///< the full shape (for a whole tensor: local's shape)
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
/// Fails (naming the folder and the key) where a state dict's tensor is undefined.
inline void require_defined(std::string_view dir, const std::string& key, const sharded_tensor& t) {
  if (!t.local.defined()) fail(errc::invalid_argument, std::string(dir) + ": tensor '" + key + "' is undefined");
}

/// Adds to `st` the load of some more of a state dict's tensors: their count, reads and missing keys.
inline void add_load(load_stats& st, const load_stats& s) {
  st.tensors += s.tensors;
  st.add_reads(s);
  st.missing_keys.insert(st.missing_keys.end(), s.missing_keys.begin(), s.missing_keys.end());
}

/// The checkpoint's tensors that no entry of sd asks for.
template <class Reader>
std::vector<std::string> unexpected_in(const Reader& reader, const state_dict& sd) {
  return reader.unexpected_keys([&](const std::string& k) { return sd.find(k) != nullptr; });
}

inline flat_view view_of(const std::string& key, const sharded_tensor& t, const at::Tensor& memory) {
  flat_view v = make_flat_view(key, memory, t.spec, t.full_shape);
  v.replica = t.replica;
  return v;
}
/// The view of an entry without its memory (data: nullptr), for tensors a load or save reaches
/// through a copy (a device's, a non-contiguous one).
inline flat_view described_view(const std::string& key, const sharded_tensor& t, std::string_view dir) {
  flat_view v;
  v.key = key;
  v.type = to_dtype(t.local.scalar_type(), std::string(dir) + ": tensor '" + key + "'");
  v.full_shape = t.spec ? t.full_shape : shape_of(t.local);
  v.spec = t.spec;
  v.nbytes = static_cast<std::uint64_t>(t.local.numel()) * static_cast<std::uint64_t>(t.local.element_size());
  v.replica = t.replica;
  return v;
}
/// True for a tensor a load copies into through the staging ring (and a save fetches from):
/// contiguous and dense, on a CUDA device. (The engine uses only LibTorch's device-generic
/// streams and events, but only CUDA has been run; other devices take the CPU-copy path.)
inline bool is_device_loadable(const at::Tensor& t) {
  return t.defined() && t.device().is_cuda() && t.is_contiguous() && !t.is_sparse() && !t.is_quantized();
}
}  // namespace detail

namespace detail {
/// Device tensors a save fetches while it writes, by key.
using fetched_tensors = std::map<std::string, const at::Tensor*, std::less<>>;

/// The views of sd's tensors for a save: each tensor's own memory; with `fetched` given (the
/// shardsafe layout), for a contiguous tensor on a device, its description only (the tensor
/// listed in `fetched`; its bytes are copied while the file is written); else a contiguous CPU
/// copy (kept in `keep`). A rank whose tensors cannot be viewed fails the save on every rank,
/// before anything is written.
template <Comm C>
std::vector<flat_view> save_views(const state_dict& sd, std::vector<at::Tensor>& keep, C& comm, std::string_view dir,
                                  fetched_tensors* fetched = nullptr) {
  std::vector<flat_view> views;
  keep.reserve(sd.size());
  views.reserve(sd.size());
  every_rank_step(comm, [&] {
    for (const auto& [key, t] : sd) {
      require_defined(dir, key, t);
      if (fetched && is_device_loadable(t.local)) {
        views.push_back(described_view(key, t, dir));
        fetched->emplace(key, &t.local);
        continue;
      }
      at::Tensor mem = is_viewable(t.local) ? t.local : keep.emplace_back(t.local.detach().to(at::kCPU).contiguous());
      views.push_back(view_of(key, t, mem));
    }
  });
  return views;
}

/// The views of one or more state dicts for a blocking save, and how the save reaches the bytes
/// of their device tensors: add() each state dict (save_views's rules, device tensors fetched
/// where the layout's writer takes a fetch, unless opt has a fetch of its own), then save with
/// options(opt).
class state_dict_save_source {
 public:
  template <Comm C>
  std::span<const flat_view> add(const state_dict& sd, C& comm, std::string_view dir, const save_options& opt) {
    fetched_tensors fetched;
    const bool fetch = writer_takes_fetch(opt.format) && !opt.fetch;
    const auto& views = views_.emplace_back(save_views(sd, keep_, comm, dir, fetch ? &fetched : nullptr));
    for (const flat_view& v : views)
      if (auto it = fetched.find(v.key); it != fetched.end()) by_view_.emplace(&v, it->second);
    return views;
  }
  /// opt, with the fetch of the device tensors added where there are any (once the work queued
  /// on their devices is done). Valid while this object lives.
  save_options options(const save_options& opt) const {
    if (by_view_.empty()) return opt;
    std::vector<c10::Device> devices;
    for (const auto& [v, t] : by_view_)
      if (std::find(devices.begin(), devices.end(), t->device()) == devices.end()) devices.push_back(t->device());
    for (const c10::Device d : devices) wait_for_queued_work(d);
    save_options o = opt;
    o.fetch = [this](const flat_view& v, std::uint64_t off, std::span<std::byte> dst) {
      copy_from_device(*by_view_.at(&v), off, dst);
    };
    return o;
  }

 private:
  std::vector<at::Tensor> keep_;                           // contiguous CPU copies of tensors that are not
  std::deque<std::vector<flat_view>> views_;               // (a deque: the views' addresses stay put)
  std::map<const flat_view*, const at::Tensor*> by_view_;  // the device tensors fetched
};
}  // namespace detail

/// Saves a state dict as one checkpoint in dir (opt.format: shardsafe's layout or torch DCP's). A
/// collective over comm: an error on any rank is thrown, with its code, on every rank (dist/agree.hpp).
/// In shardsafe's layout, contiguous device (CUDA) tensors are copied to the host block by block
/// while the file is written (save_options::fetch, torch/device_copy.hpp), once the work queued
/// on their devices is done: host memory stays at the writer's blocks. Other tensors that are
/// not contiguous CPU tensors are copied whole first.
template <WritableDirectory D, Comm C>
save_stats save_state_dict(const D& dir, const state_dict& sd, C& comm, const save_options& opt = {}) {
  detail::state_dict_save_source src;
  const auto views = src.add(sd, comm, dir.name(), opt);
  return shardsafe::save(dir, views, comm, src.options(opt));
}

namespace detail {
/// A device tensor a load reaches through the staging ring: its view and the tensor.
struct device_entry {
  staged_view<std::byte*> staged;
  at::Tensor* tensor;
};

/// Loads entries that all live on `device` through one staging ring. With convert_dtypes and
/// convert_on_device, a tensor stored as another floating dtype is loaded as stored into a
/// scratch tensor on the device and converted there (copy_), a batch of at most 1 GiB of
/// scratch (or one tensor) at a time; else the ring converts on the host.
template <ReadableDirectory D>
load_stats load_on_device(checkpoint_reader<D>& reader, std::vector<device_entry>& entries, c10::Device device,
                          const device_load_options& opt) {
  std::vector<staged_view<std::byte*>> direct;
  std::vector<std::pair<const device_entry*, dtype>> convert;  // with the dtype stored
  // the views' dtype is checked here, on the tensors' own dtypes: the scratch views converted on
  // the device have the stored dtype
  for (const auto& e : entries) detail::require_view_dtype(e.staged.view, opt, reader.directory().name());
  device_load_options scratch_opt = opt;
  scratch_opt.view_dtype.reset();
  for (const auto& e : entries) {
    const tensor_metadata* tm = reader.find(e.staged.view.key);
    if (opt.convert_dtypes && opt.convert_on_device && tm && tm->type != e.staged.view.type &&
        is_convertible_float(tm->type) && is_convertible_float(e.staged.view.type) && to_scalar_type(tm->type))
      convert.emplace_back(&e, tm->type);
    else
      direct.push_back(e.staged);
  }
  device_copy_engine engine(device);
  staged_load_stats st = shardsafe::load(reader, std::span<const staged_view<std::byte*>>(direct), engine, opt);
  constexpr std::uint64_t scratch_limit = std::uint64_t(1) << 30;
  for (std::size_t first = 0; first < convert.size();) {
    std::vector<at::Tensor> scratch;
    std::vector<staged_view<std::byte*>> views;
    std::uint64_t bytes = 0;
    std::size_t last = first;
    for (; last < convert.size(); ++last) {
      const auto& [ep, stored] = convert[last];
      const device_entry& e = *ep;
      const std::uint64_t n = e.staged.view.local_numel() * item_size(stored);
      if (last > first && bytes + n > scratch_limit) break;
      bytes += n;
      at::Tensor& t =
          scratch.emplace_back(at::empty({static_cast<std::int64_t>(e.staged.view.local_numel())},
                                         at::TensorOptions().dtype(*to_scalar_type(stored)).device(device)));
      staged_view<std::byte*> v = e.staged;
      v.view.type = stored;
      v.view.nbytes = n;
      v.target = static_cast<std::byte*>(t.data_ptr());
      views.push_back(std::move(v));
    }
    const staged_load_stats s =
        shardsafe::load(reader, std::span<const staged_view<std::byte*>>(views), engine, scratch_opt);
    st.add_reads(s);
    st.tensors += s.tensors;
    {
      at::NoGradGuard no_grad;
      for (std::size_t i = first; i < last; ++i)
        convert[i].first->tensor->copy_(scratch[i - first].view(convert[i].first->tensor->sizes()));  // on the device
    }
    first = last;
  }
  return st;
}
}  // namespace detail

/// Loads a checkpoint into the state dict's tensors, in place. Contiguous tensors on a device
/// (CUDA) are loaded through the staging ring (torch/device_copy.hpp: pinned host buffers,
/// host-to-device copies overlapped with the reads; host memory is opt.staging's), converted on
/// the device where they are stored as another floating dtype (device_load_options::convert_on_device);
/// others that are not contiguous CPU tensors go through a CPU tensor of their own size, one at
/// a time.
template <ReadableDirectory D>
load_stats load_state_dict(checkpoint_reader<D>& reader, state_dict& sd, const device_load_options& opt = {}) {
  std::vector<flat_view> direct;
  std::vector<detail::device_entry> on_device;  // each on its tensor's device
  std::vector<std::pair<const std::string*, sharded_tensor*>> staged;
  for (auto& [key, t] : sd) {
    detail::require_defined(reader.directory().name(), key, t);
    if (is_viewable(t.local))
      direct.push_back(detail::view_of(key, t, t.local));
    else if (detail::is_device_loadable(t.local))
      on_device.push_back(
          {{detail::described_view(key, t, reader.directory().name()), static_cast<std::byte*>(t.local.data_ptr())},
           &t.local});
    else
      staged.emplace_back(&key, &t);
  }
  load_stats st = shardsafe::load(reader, std::span<const flat_view>(direct), opt);
  while (!on_device.empty()) {  // one ring per device, in order of first use
    const c10::Device dev = on_device.front().tensor->device();
    std::vector<detail::device_entry> entries;
    for (auto& e : on_device)
      if (e.tensor->device() == dev) entries.push_back(e);
    std::erase_if(on_device, [&](const detail::device_entry& e) { return e.tensor->device() == dev; });
    detail::add_load(st, detail::load_on_device(reader, entries, dev, opt));
  }
  load_options one = opt;
  one.list_unexpected = false;  // the first load listed them; these come one tensor at a time
  for (auto [key, t] : staged) {
    at::Tensor tmp =
        at::empty(t->local.sizes(), t->local.options().device(at::kCPU).memory_format(at::MemoryFormat::Contiguous));
    flat_view v = detail::view_of(*key, *t, tmp);
    detail::add_load(st, shardsafe::load(reader, std::span<const flat_view>(&v, 1), one));
    {
      at::NoGradGuard no_grad;
      t->local.copy_(tmp);
    }
  }
  if (direct.size() != sd.size())  // unexpected keys: recompute over all entries
    st.unexpected_keys = detail::unexpected_in(reader, sd);
  return st;
}

template <ReadableDirectory D>
load_stats load_state_dict(const D& dir, state_dict& sd, const device_load_options& opt = {}) {
  checkpoint_reader<D> reader(dir);
  return load_state_dict(reader, sd, opt);
}

namespace detail {
/// The collective load of a state dict from the reader open() makes (or hands over) in the first
/// agreed step: load_state_dict(dir, sd, comm, opt) and load_state_dict(reader, sd, comm, opt).
template <ReadableDirectory D, Comm C, class Open>
load_stats load_state_dict_collective(Open&& open, state_dict& sd, C& comm, const collective_load_options& opt) {
  checkpoint_reader<D>* reader = nullptr;
  std::vector<flat_view> direct;
  state_dict rest;
  host_staging staging;
  const bool stage = opt.replicas != replica_reads::every_rank_reads;
  every_rank_step(comm, [&] {
    reader = &open();
    for (auto& [key, t] : sd) {
      require_defined(reader->directory().name(), key, t);
      if (is_viewable(t.local))
        direct.push_back(view_of(key, t, t.local));
      else if (stage)
        direct.push_back(view_of(key, t, staging.memory_for(t.local)));
      else
        rest.add(key, t);  // the same tensor: loaded in place
    }
  });
  load_stats st = shardsafe::load(*reader, std::span<const flat_view>(direct), comm, opt);
  if (stage)
    every_rank_step(comm, [&] {  // a staging tensor whose keys were all missing holds no values
      const std::set<std::string, std::less<>> missing(st.missing_keys.begin(), st.missing_keys.end());
      std::set<const std::byte*> fed;
      for (const flat_view& v : direct)
        if (!missing.count(v.key)) fed.insert(v.data);
      staging.copy_back([&](const std::byte* p) { return fed.count(p) > 0; });
    });
  if (rest.empty()) return st;
  every_rank_step(comm, [&] {
    device_load_options one;
    static_cast<load_options&>(one) = opt;
    add_load(st, load_state_dict(*reader, rest, one));
    st.unexpected_keys = unexpected_in(*reader, sd);
  });
  return st;
}
}  // namespace detail

/// The collective load of a state dict (every rank calls it; the first failure of any rank is
/// thrown on every rank). Contiguous CPU tensors go through the collective load
/// (checkpoint/load.hpp): with opt.replicas, ranks that load the same tensors (HSDP replicas,
/// data-parallel copies) read each byte once between them and exchange the rest
/// (checkpoint/replica_reads.hpp). The others (device tensors, tensors that are not contiguous
/// CPU tensors) join them through CPU staging tensors of their own, copied back after the load
/// (torch/host_staging.hpp: all staged at once, their total size the host memory it takes);
/// without replicas they are loaded by each rank alone, as load_state_dict(reader, sd, opt)
/// loads them (a device's through its staging ring).
template <ReadableDirectory D, Comm C>
load_stats load_state_dict(const D& dir, state_dict& sd, C& comm, const collective_load_options& opt = {}) {
  std::optional<checkpoint_reader<D>> reader;
  return detail::load_state_dict_collective<D>([&]() -> checkpoint_reader<D>& { return reader.emplace(dir); }, sd, comm,
                                               opt);
}

/// The same from a reader each rank opened (of the same checkpoint): a layout that reads some of
/// the checkpoint's objects before its tensors (a trainer's, torch/train_layouts.hpp).
template <ReadableDirectory D, Comm C>
load_stats load_state_dict(checkpoint_reader<D>& reader, state_dict& sd, C& comm,
                           const collective_load_options& opt = {}) {
  return detail::load_state_dict_collective<D>([&]() -> checkpoint_reader<D>& { return reader; }, sd, comm, opt);
}

/// Every tensor of a checkpoint, whole, in one process (reads run on the thread pool), in
/// tensors it allocates: one at::empty each, or all in one huge-page arena populated ahead of
/// the reads (torch/tensor_memory.hpp: much less page-fault time for a load into new memory).
/// A tensor of a dtype shardsafe has no type for (a DCP folder's complex128) is refused.
template <ReadableDirectory D>
std::vector<std::pair<std::string, at::Tensor>> unshard_state(checkpoint_reader<D>& reader,
                                                              const load_options& opt = {},
                                                              tensor_memory memory = tensor_memory::separate) {
  reader.refuse_foreign();  // every tensor, or none
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::vector<flat_view> views;
  std::vector<at::ScalarType> types;
  for (const auto& [key, tm] : reader.metadata().tensors)
    types.push_back(require_scalar_type(tm.type, std::string(reader.directory().name()) + ": tensor '" + key + "'"));
  std::unique_ptr<tensor_arena> arena;
  if (memory != tensor_memory::separate) {
    std::vector<std::uint64_t> sizes;
    for (const auto& [key, tm] : reader.metadata().tensors) sizes.push_back(tm.numel() * item_size(tm.type));
    arena =
        std::make_unique<tensor_arena>(std::span<const std::uint64_t>(sizes), memory == tensor_memory::hugetlb_arena);
  }
  std::size_t i = 0;
  for (const auto& [key, tm] : reader.metadata().tensors) {
    at::Tensor t = arena ? arena->tensor(i, to_sizes(tm.shape), types[i]) : at::empty(to_sizes(tm.shape), types[i]);
    views.push_back(make_flat_view(key, t));
    out.emplace_back(key, std::move(t));
    ++i;
  }
  if (arena) arena->populate_ahead();
  shardsafe::load(reader, std::span<const flat_view>(views), opt);
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
