// shardsafe/torch/mapped_state.hpp - a zero-copy load for inference: every tensor held whole by
// one file (an unsharded checkpoint, a Hugging Face folder, a single-rank save) is a view of a
// copy-on-write mapping of that file, as torch.load(mmap=True) and safetensors' safe_open give.
//
//   auto state = map_state("/models/llama");          // no tensor byte is read here
//   at::Tensor w = state.at(0).second;                 // pages come in as they are touched
//
// | property        | what holds                                                            |
// |-----------------|-----------------------------------------------------------------------|
// | mapping         | MAP_PRIVATE, PROT_READ|PROT_WRITE: writes to a tensor copy its pages   |
// |                 | in memory and never reach the file                                    |
// | lifetime        | each tensor's deleter holds its file's mapping; it is unmapped when   |
// |                 | the last tensor of that file goes (the reader may be gone long before)|
// | what is mapped  | tensors whose one file holds all their elements in the stored dtype   |
// | everything else | tensors split over files: loaded (copied) into new memory, as by      |
// |                 | unshard_state; map_stats says how many of each                        |
// | alignment       | a tensor starts where its file puts it (safetensors: 8-byte aligned   |
// |                 | header, tensors packed): fine on x86 and ARMv8 for every dtype        |
// | files changed   | a file truncated while mapped raises SIGBUS on access (any mapping)   |
#pragma once

#include <sys/mman.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/detail/posix.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/tensor_view.hpp"

namespace shardsafe {

struct map_stats {
  std::size_t mapped = 0;  ///< tensors that are views of a file mapping
  std::size_t copied = 0;  ///< tensors assembled from several files into new memory
  std::uint64_t mapped_bytes = 0;
  std::uint64_t copied_bytes = 0;
};

namespace detail {

/// A whole file mapped copy-on-write, unmapped when the last holder goes.
struct cow_mapping {
  std::byte* base = nullptr;
  std::uint64_t size = 0;
  explicit cow_mapping(const std::filesystem::path& p) {
    const std::string name = p.string();
    unique_fd fd = open_fd(name, O_RDONLY);
    size = file_size_of(fd.get(), name);
    if (size == 0) return;
    void* m = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd.get(), 0);
    if (m == MAP_FAILED) fail_errno(errno, name + ": mmap of " + std::to_string(size) + " bytes (copy-on-write)");
    base = static_cast<std::byte*>(m);
  }
  cow_mapping(const cow_mapping&) = delete;
  cow_mapping& operator=(const cow_mapping&) = delete;
  ~cow_mapping() {
    if (base) ::munmap(base, size);
  }
};

}  // namespace detail

/// Every tensor of the checkpoint in folder dir (any layout checkpoint_reader opens: shardsafe,
/// OLMo-core, Hugging Face, torch DCP), whole: mapped where one file holds it (with the strides
/// torch.save kept, for a DCP chunk stored channels_last or transposed), else loaded.
/// Tensors in the checkpoint's order. stats (if given) says which were mapped. A tensor of a
/// dtype shardsafe has no type for (a DCP folder's complex128) is refused, not left out.
inline std::vector<std::pair<std::string, at::Tensor>> map_state(const std::filesystem::path& dir,
                                                                 map_stats* stats = nullptr,
                                                                 const load_options& opt = {}) {
  const file_directory d(dir);
  checkpoint_reader<file_directory> reader(d);
  reader.refuse_foreign();  // every tensor, or none
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::map<std::string, std::shared_ptr<detail::cow_mapping>> maps;  // by file name on disk
  std::vector<flat_view> to_load;
  map_stats st;
  for (const auto& [key, tm] : reader.metadata().tensors) {
    const std::string ctx = std::string(d.name()) + ": tensor '" + key + "'";
    const at::ScalarType type = require_scalar_type(tm.type, ctx);
    const auto sizes = to_sizes(tm.shape);
    const std::uint64_t nbytes = tm.numel() * item_size(tm.type);
    // one file holding every element, in the order of the tensor: a flat [0, numel) or the
    // whole block
    const bool whole_in_one = tm.files.size() == 1 && tm.files.front().second.local_numel() == tm.numel();
    if (whole_in_one) {
      const auto& [fname, spec] = tm.files.front();
      const auto& f = reader.file(fname);
      const tensor_entry& e = reader.entry_in(f, key, tm, spec);
      const std::string& on_disk = reader.path_of(fname);
      auto& m = maps[on_disk];
      if (!m) m = std::make_shared<detail::cow_mapping>(dir / on_disk);
      const std::uint64_t off = f.header.offset_of(e);
      if (off + nbytes > m->size)
        fail(errc::truncated, ctx + ": its bytes [" + std::to_string(off) + ", " + std::to_string(off + nbytes) +
                                  ") run past the end of " + on_disk + " (" + std::to_string(m->size) + " bytes)");
      // row-major, or the order of dimensions torch.save kept (a DCP chunk, channels_last or
      // transposed): mapped with those strides
      const shape_t dense = dense_strides(tm.shape, f.header.stored_order(e));
      const std::vector<std::int64_t> strides(dense.begin(), dense.end());
      auto keep = m;
      at::Tensor t = nbytes == 0 ? at::empty(sizes, type)
                                 : at::from_blob(
                                       m->base + off, sizes, strides, [keep](void*) mutable { keep.reset(); },
                                       at::TensorOptions().dtype(type));
      out.emplace_back(key, std::move(t));
      ++st.mapped;
      st.mapped_bytes += nbytes;
    } else {
      at::Tensor t = at::empty(sizes, type);
      to_load.push_back(make_flat_view(key, t));
      out.emplace_back(key, std::move(t));
      ++st.copied;
      st.copied_bytes += nbytes;
    }
  }
  if (!to_load.empty()) shardsafe::load(reader, std::span<const flat_view>(to_load), opt);
  if (stats) *stats = st;
  return out;
}

}  // namespace shardsafe
