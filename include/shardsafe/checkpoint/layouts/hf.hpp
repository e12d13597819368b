// shardsafe/checkpoint/layouts/hf.hpp - Hugging Face folders: model.safetensors or
// model.safetensors.index.json and its files, or torch.save's pytorch_model.bin (and its index),
// every tensor whole in one file (checkpoint/hf/folder.hpp reads and validates the folder).
// Exported by checkpoint/hf/export.hpp.
#pragma once

#include <memory>
#include <optional>

#include "shardsafe/checkpoint/hf/folder.hpp"
#include "shardsafe/checkpoint/layouts/layout.hpp"
#include "shardsafe/checkpoint/source.hpp"
#include "shardsafe/format/hf_index.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

struct hf_layout {
  static constexpr layout_info info{.id = "hf",
                                    .name = "Hugging Face folder",
                                    .commit_mark = "",       // none: an HF folder is written whole or not at all
                                    .permuted_files = true,  // a .bin's transposed tensor
                                    .folder_of_whole_files = true};

  template <ReadableDirectory D>
  static bool recognise(const D& dir, folder_listing<D>&) {
    return is_hf_folder(dir);
  }

  /// The folder's index (or single file) and every file's header read.
  template <ReadableDirectory D>
  static std::optional<checkpoint_source<D>> open(const D& dir, folder_listing<D>&) {
    if (!is_hf_folder(dir)) return std::nullopt;
    using R = typename D::reader_type;
    hf_folder<D> h = open_hf_folder(dir);
    checkpoint_source<D> s;
    s.layout = &info;
    s.described_by = h.described_by;
    // tensors in name order (the index's order; a single file's by name too)
    for (const auto& [key, at] : h.tensors)
      s.metadata.tensors.emplace_back(key,
                                      detail::whole_tensor(h.entry(at), h.files[at.file].name,
                                                           !h.files[at.file].header.stored_order(h.entry(at)).empty()));
    for (auto& f : h.files) {
      s.metadata.extras.file_sizes.emplace(f.name, f.header.file_size());
      s.files.emplace_back(f.name,
                           std::make_unique<opened_file<R>>(opened_file<R>{std::move(f.storage), std::move(f.header)}));
    }
    return s;
  }

  /// verify's folder rule: where an index lists the files, no other file of the folder claims
  /// its tensors or its set's names (check_unlisted_hf_files).
  template <class Reader>
  static void verify_folder(Reader& r) {
    if (r.described_by() == hf_index_file || r.described_by() == hf_bin_index_file)
      check_unlisted_hf_files(r.directory(), open_hf_folder(r.directory()));
  }
};

}  // namespace shardsafe
