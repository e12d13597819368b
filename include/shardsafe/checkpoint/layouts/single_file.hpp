// shardsafe/checkpoint/layouts/single_file.hpp - one file read as a checkpoint, every tensor
// whole in it, in name order (what `shardsafe to-hf FILE` exports): a safetensors file, or a
// torch.save file (format/torch_save.hpp: zip or legacy; a pytorch_model.bin, a training .pt) whose
// values that are not tensors (an epoch, an optimizer's hyper-parameters) are non-tensor items,
// each key's place in the nested dict given as a DCP folder's (paths).
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "shardsafe/checkpoint/layouts/layout.hpp"
#include "shardsafe/checkpoint/source.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/format/pickle_writer.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/format/torch_save.hpp"
#include "shardsafe/format/torch_zip_writer.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {
namespace detail {

/// The source of one file, its header h: every tensor whole, by name.
template <ReadableDirectory D>
checkpoint_source<D> whole_file_source(const layout_info& info, const std::string& name, typename D::reader_type st,
                                       safetensors_header h, checkpoint_source<D> s = {}) {
  using R = typename D::reader_type;
  s.layout = &info;
  s.described_by = name;
  for (const auto& e : h.tensors)
    s.metadata.tensors.emplace_back(e.name, whole_tensor(e, name, !h.stored_order(e).empty()));
  std::sort(s.metadata.tensors.begin(), s.metadata.tensors.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  s.files.emplace_back(name, std::make_unique<opened_file<R>>(opened_file<R>{std::move(st), std::move(h)}));
  return s;
}

}  // namespace detail

/// A torch.save file.
struct torch_save_file_layout {
  static constexpr layout_info info{
      .id = "torch_save", .name = "torch.save file", .commit_mark = "", .permuted_files = true, .single_file = true};

  template <ReadableStorage S>
  static bool recognise_file(const S& st) {
    return is_torch_save_file(st);
  }

  template <ReadableDirectory D>
  static checkpoint_source<D> open_file(const D&, const std::string& name, typename D::reader_type st) {
    torch_save_index x = index_torch_save_file(st);
    checkpoint_source<D> s;
    s.non_tensors.reserve(x.values.size());  // a million values: no vector grown twice their size
    for (auto& v : x.values) s.non_tensors.push_back({v.name, name, 0, 0, std::move(v)});  // by name already
    x.values = {};
    for (auto& u : x.unread)  // a view that is not dense: listed, refused where asked for
      s.foreign_tensors.push_back({u.name, std::string(to_string(u.type)), u.shape, 1, std::move(u.why)});
    s.paths = std::move(x.paths);
    return detail::whole_file_source<D>(info, name, std::move(st), std::move(x.header), std::move(s));
  }

  /// A value as the file's pickle held it.
  template <ReadableDirectory D>
  static pickle_value read_object(const D&, const non_tensor_item& it) {
    return it.value->value;
  }
  /// The value pickled again into a torch.save archive, refused (errc::invalid_metadata, naming
  /// it) when it cannot be (torch_save_value::unwritable).
  template <ReadableDirectory D>
  static std::string read_object_archive(const D& dir, const non_tensor_item& it) {
    if (!it.value->unwritable.empty())
      fail(errc::invalid_metadata, std::string(dir.name()) + "/" + it.file + ": value '" + it.key + "' (" +
                                       torch_value_repr(it.value->value, 80) + ") " + it.value->unwritable +
                                       " (a rename rule may drop it)");
    return torch_value_archive(pickle_dumps(it.value->value));
  }
};

/// The non-tensor item hooks of a layout whose items are values of torch.save files (the trainer
/// layouts: deepspeed, deepspeed_universal, megatron_legacy), inherited: each read as its file's
/// pickle held it, and pickled again, as a torch.save file's.
struct torch_save_values {
  template <ReadableDirectory D>
  static pickle_value read_object(const D& dir, const non_tensor_item& it) {
    return torch_save_file_layout::read_object(dir, it);
  }
  template <ReadableDirectory D>
  static std::string read_object_archive(const D& dir, const non_tensor_item& it) {
    return torch_save_file_layout::read_object_archive(dir, it);
  }
};

/// A safetensors file: what any other file is taken for (its header says whether it is one).
struct safetensors_file_layout {
  static constexpr layout_info info{
      .id = "safetensors", .name = "safetensors file", .commit_mark = "", .single_file = true};

  template <ReadableStorage S>
  static bool recognise_file(const S&) {
    return true;
  }

  template <ReadableDirectory D>
  static checkpoint_source<D> open_file(const D&, const std::string& name, typename D::reader_type st) {
    safetensors_header h = read_safetensors_header(st);
    return detail::whole_file_source<D>(info, name, std::move(st), std::move(h));
  }
};

}  // namespace shardsafe
