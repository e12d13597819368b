// shardsafe/torch/host_staging.hpp - tensors a load cannot write in place (a device's, a
// non-contiguous one) loaded into contiguous CPU tensors of their own and copied back after the
// load: one staging tensor per distinct memory, found by storage identity (entries whose tensors
// share storage, offset, sizes, strides and dtype - tied parameters - share it). All are staged at
// once, so their total size is the staging memory. Users: the HF import into a state dict
// (torch/hf_state_dict.hpp) and the collective load of one with replicas read once
// (torch/state_dict.hpp).
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

namespace shardsafe::detail {

/// What makes two tensors one memory: storage, offset, sizes, strides, dtype.
using tensor_identity =
    std::tuple<const void*, std::int64_t, std::vector<std::int64_t>, std::vector<std::int64_t>, int>;

inline tensor_identity identity_of(const at::Tensor& t) {
  return {t.storage().unsafeGetStorageImpl(), t.storage_offset(), t.sizes().vec(), t.strides().vec(),
          static_cast<int>(t.scalar_type())};
}

/// The staging tensors of one load, each with the caller's tensor it is copied back to.
class host_staging {
 public:
  /// The contiguous CPU tensor t's values are loaded into: made on first use, the same one for
  /// every tensor of t's memory.
  const at::Tensor& memory_for(const at::Tensor& t) {
    auto [it, fresh] = of_.emplace(identity_of(t), staged_.size());
    if (fresh)
      staged_.emplace_back(
          t, at::empty(t.sizes(), t.options().device(at::kCPU).memory_format(at::MemoryFormat::Contiguous)));
    return staged_[it->second].second;
  }

  /// Copies each staging tensor back to its tensor where fed(its first byte) says the load wrote
  /// it (a staging tensor nothing fed holds no values: its tensor keeps its own).
  template <class Fed>
  void copy_back(Fed&& fed) {
    at::NoGradGuard no_grad;
    for (auto& [to, from] : staged_)
      if (fed(static_cast<const std::byte*>(from.data_ptr()))) to.copy_(from);
  }

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> staged_;  // (the caller's tensor, its staging)
  std::map<tensor_identity, std::size_t> of_;
};

}  // namespace shardsafe::detail
