// shardsafe/checkpoint/source.hpp - what a checkpoint_reader reads, whatever wrote it: the
// tensors with the shard each file holds, its non-tensor items, and the files already opened.
//
// The loader, unshard, verify, export and the tool read any checkpoint the same way, through
// the overlap engine and the read plans; only the description differs, and each layout
// (checkpoint/layouts/) makes it: layouts/registry.hpp lists them in the order they are tried
// (open_checkpoint_source) and opens a file as its layout indexes it (open_source_file).
//
// A file named in a tensor's files is the file itself, or, for a DCP data file holding two
// chunks of one key (a rank with two shards of a tensor), `FILE`, `FILE#1`, ...: one name per
// chunk of that key, the same file (data_files maps each such name to its file and index).
// Non-tensor items are listed in non_tensors, their values read only on request through their
// layout (checkpoint_reader::read_object). Tensors of a dtype shardsafe has no type for
// (complex128, quantized) are listed in foreign_tensors, not in the metadata: the loader,
// unshard, verify and the exports refuse them by name where they would read them
// (checkpoint_files::refuse_foreign), and a rename that drops them lets an export by.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/checkpoint/layouts/layout.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/dcp_data.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/format/torch_save.hpp"  // torch_save_value: a non-tensor item's value
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// Deprecated (one release): which writer's layout a checkpoint has, as an enum. Use
/// checkpoint_files::layout(), a layout_info (checkpoint/layouts/layout.hpp), and its traits.
enum class checkpoint_format { sharded, hf, dcp, dcp_sharded_hf };

[[deprecated("use checkpoint_files::layout().name")]] constexpr std::string_view name(checkpoint_format f) noexcept {
  switch (f) {
    case checkpoint_format::sharded: return "sharded checkpoint";
    case checkpoint_format::hf: return "Hugging Face folder";
    case checkpoint_format::dcp: return "torch.distributed.checkpoint folder";
    case checkpoint_format::dcp_sharded_hf: return "torch sharded Hugging Face files";
  }
  return "?";
}

/// A file of a checkpoint, open, with its validated header.
template <class R>
struct opened_file {
  R storage;
  safetensors_header header;
};

/// An item of a checkpoint that is not a tensor (a DCP folder's non-tensor values, a torch.save
/// file's: an optimizer's hyper-parameters, an epoch counter): listed, and read on request
/// (checkpoint_reader::read_object).
struct non_tensor_item {
  std::string key;
  std::string file;          ///< the data file holding its bytes (a torch.save file: that file)
  std::uint64_t offset = 0;  ///< where they start in it
  std::uint64_t bytes = 0;   ///< how many (a torch.save archive of the pickled value; 0 for a torch.save file's)
  /// A torch.save file's value, read with the file's pickle (it has no bytes of its own); nullopt
  /// for a DCP item.
  std::optional<torch_save_value> value;
};

/// A tensor of a DCP folder whose torch dtype shardsafe has no type for, or of a torch.save file
/// a view that is not dense in its storage: listed, never read.
struct foreign_tensor {
  std::string key;
  std::string dtype;  ///< torch's name: "torch.complex128" (a torch.save file's view: shardsafe's, "F32")
  shape_t shape;
  std::size_t chunks = 0;
  /// Why it is not read, when its dtype is not the reason (a torch.save file's non-dense view:
  /// "is not read: stride [12, 1] is not dense for size [6, 4] ...").
  std::string why;
};

/// How messages name file `name` of a tensor's files: itself, or for the internal name of a DCP
/// data file's second (third, ...) chunk of one key, `FILE#k`, "FILE (chunk k+1 of this tensor in it)".
inline std::string display_file_name(std::string_view name) {
  const auto hash = name.rfind('#');
  if (hash == std::string_view::npos || hash + 1 == name.size() ||
      name.substr(hash + 1).find_first_not_of("0123456789") != std::string_view::npos)
    return std::string(name);
  return std::string(name.substr(0, hash)) + " (chunk " +
         std::to_string(std::stoull(std::string(name.substr(hash + 1))) + 1) + " of this tensor in it)";
}

/// A checkpoint's description and the files opened while making it.
template <ReadableDirectory D>
struct checkpoint_source {
  const layout_info* layout = nullptr;  ///< the layout that read it (checkpoint/layouts/)
  std::string described_by;             ///< what holds the description, for messages ("metadata.json", ...)
  checkpoint_metadata metadata;
  std::vector<std::pair<std::string, std::unique_ptr<opened_file<typename D::reader_type>>>> files;
  /// Files the tensors name whose index is not their own safetensors header (a DCP folder's
  /// data files, format/dcp_data.hpp), by that name; the reader indexes each when it opens it.
  std::map<std::string, dcp_data_file> data_files;
  std::vector<non_tensor_item> non_tensors;     ///< by key
  std::vector<foreign_tensor> foreign_tensors;  ///< by key
  /// A DCP folder's planner_data: each key's path in the state dict torch flattened.
  std::map<std::string, pickle_value> paths;
  /// The folder the files are in, where it is not the one opened (a DeepSpeed folder's `latest`
  /// names the tag folder holding them): the reader opens files, and names them, there.
  std::optional<D> folder;
};

namespace detail {

/// A tensor stored whole in one file: a flat spec [0, numel) there, or the whole block where
/// the file stores its dimensions in another order (`permuted`: a torch.save file's transposed
/// tensor), as the read plans of such bytes need.
inline tensor_metadata whole_tensor(const tensor_entry& e, const std::string& file, bool permuted = false) {
  tensor_metadata tm;
  tm.shape = e.shape;
  tm.type = e.type;
  tm.files.emplace_back(file, permuted ? shard_spec(block_spec(e.shape, shape_t(e.shape.size(), 0)))
                                       : shard_spec(flat_spec{{0, e.numel()}}));
  return tm;
}

/// dir.open(n), with not_found reported as `missing()` says (there is no exists() check first:
/// the open is the check, in one round trip).
template <ReadableDirectory D, class Message>
typename D::reader_type open_or(const D& dir, std::string_view n, Message&& missing) {
  try {
    return dir.open(n);
  } catch (const error& e) {
    if (e.code() == errc::not_found) fail(errc::not_found, missing());
    throw;
  }
}

}  // namespace detail

/// The file a name of a tensor's files is in: itself, or for a DCP data file's second chunk of
/// a key (`FILE#1`) the file it names.
template <ReadableDirectory D>
const std::string& path_of(const checkpoint_source<D>& src, const std::string& name) {
  const auto it = src.data_files.find(name);
  return it == src.data_files.end() ? name : it->second.path;
}

}  // namespace shardsafe
