// shardsafe/checkpoint/hf/folder.hpp - a Hugging Face folder opened and validated (docs/FORMAT.md §3):
// one model.safetensors, or model.safetensors.index.json with the shard files it names; where
// the folder has neither, the older torch.save layout in the same two forms, pytorch_model.bin
// or pytorch_model.bin.index.json and its files, each indexed without running its pickle
// (format/torch_save.hpp; a value that is not a tensor is refused, naming it).
//
// open_hf_folder(dir) reads every file's header and checks the folder as a whole, in this
// order, throwing at the first problem with a message that names the file, the tensor and the
// rule:
//   - the index is valid JSON of the right shape, its file names are plain names, no tensor
//     is listed twice (format/hf_index.hpp);
//   - every file the index names exists (errc::not_found) and has a valid header;
//   - every tensor the index lists is in the file it names (errc::not_found);
//   - every tensor of every file is listed, and listed in that file (errc::invalid_metadata);
//   (metadata.total_size and metadata.total_parameters are not compared with the files: no
//   reader uses them, and writers count them otherwise, e.g. transformers' total_parameters
//   counts parameters without buffers, older transformers' total_size a bool as 1/8 byte);
//   - no tensor is in two files (errc::invalid_metadata).
// check_unlisted_hf_files (run by verify) adds: no safetensors file (.bin in the torch.save
// layout) the index does not name holds a tensor the index lists, or is named as one of the
// index's set of shards (a .bin that is no file of tensors, training_args.bin, is left alone).
// What comes back holds the opened files and a map from tensor name to where it lives, so a
// caller (the shardsafe tool's inspect and digest) reads tensors without opening anything again.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/format/hf_index.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/format/torch_save.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// Where a tensor of a Hugging Face folder lives: hf_folder::files[file], header.tensors[entry].
struct hf_tensor_location {
  std::size_t file = 0;
  std::size_t entry = 0;
  friend bool operator==(const hf_tensor_location&, const hf_tensor_location&) = default;
};

/// A Hugging Face folder whose files are open and whose headers and index agree.
template <ReadableDirectory D>
struct hf_folder {
  /// One safetensors file of the folder.
  struct file {
    std::string name;                 ///< its object name in the folder
    typename D::reader_type storage;  ///< open for reading
    safetensors_header header;        ///< validated
  };

  std::optional<hf_index> index;                      ///< the index of a sharded folder; none for model.safetensors
  std::vector<file> files;                            ///< the index's files sorted by name, or model.safetensors alone
  std::map<std::string, hf_tensor_location> tensors;  ///< every tensor of every file, by name
  std::string described_by;                           ///< the index or single file read (hf_index_file, ...)
  bool torch_bin = false;                             ///< torch.save files (pytorch_model.bin), not safetensors

  /// Whether the folder is sharded (model.safetensors.index.json and its files).
  bool sharded() const noexcept { return index.has_value(); }

  /// The header entry of a tensor.
  const tensor_entry& entry(const hf_tensor_location& at) const { return files[at.file].header.tensors[at.entry]; }

  /// The bytes of all tensors (what the index's total_size counts).
  std::uint64_t tensor_bytes() const noexcept {
    std::uint64_t n = 0;
    for (const auto& [name, at] : tensors) n += entry(at).nbytes();
    return n;
  }
};

/// Whether dir holds a Hugging Face checkpoint: an index or a model.safetensors (or, the older
/// layout, pytorch_model.bin or its index).
template <ReadableDirectory D>
bool is_hf_folder(const D& dir) {
  return dir.exists(hf_index_file) || dir.exists(hf_single_file) || dir.exists(hf_bin_index_file) ||
         dir.exists(hf_bin_single_file);
}

namespace detail {

/// "dir/name", the way a Directory's objects are named in messages (one '/' between the two,
/// also when the directory's name ends in one, as a folder given as "hf/" does).
template <ReadableDirectory D>
std::string object_path(const D& dir, std::string_view name) {
  std::string p(dir.name());
  if (p.empty() || p.back() != '/') p += '/';
  return p + std::string(name);
}

/// Opens file `name` of dir with its header: a safetensors file's own, or a torch.save file's
/// index (torch_bin), which must hold tensors only.
template <ReadableDirectory D>
typename hf_folder<D>::file open_hf_file(const D& dir, std::string name, bool torch_bin = false) {
  typename D::reader_type s = dir.open(name);
  safetensors_header h = torch_bin ? read_torch_save_header(s) : read_safetensors_header(s);
  return {std::move(name), std::move(s), std::move(h)};
}

/// The index's checks against the opened files (every row of the list above that needs both).
template <ReadableDirectory D>
void check_hf_index_against_files(const D& dir, const hf_folder<D>& h) {
  const hf_index& idx = *h.index;
  const std::string& index_name = h.described_by;
  auto file_index = [&](const std::string& name) {
    std::size_t i = 0;
    while (h.files[i].name != name) ++i;  // every name of weight_map is in files
    return i;
  };
  for (const auto& [tensor, fname] : idx.weight_map) {
    const tensor_entry* e = h.files[file_index(fname)].header.find(tensor);
    if (!e)
      fail(errc::not_found, object_path(dir, fname) + ": tensor '" + tensor + "': listed in " + index_name +
                                " but absent from the file");
  }
}

/// Every tensor of file f is one the index places there: checked as each file is opened, so
/// that the files of a folder hold together no more tensors than its index lists (hard links
/// of one file at every cap would otherwise all be held before the second is refused).
template <class File>
void check_hf_file_against_index(const hf_index& idx, const std::string& index_name, const File& f) {
  for (const auto& t : f.header.tensors) {
    auto it = idx.weight_map.find(t.name);
    if (it == idx.weight_map.end())
      fail(errc::invalid_metadata, f.header.file + ": tensor '" + t.name + "': not listed in " + index_name);
    if (it->second != f.name)
      fail(errc::invalid_metadata, f.header.file + ": tensor '" + t.name + "': the index places it in " + it->second);
  }
}

/// The "-of-MMMMM.safetensors" ending and the part before "-NNNNN" of a shard name in the
/// transformers style ("model-00001-of-00002.safetensors" -> {"model", "-of-00002.safetensors"}),
/// or nothing; `ext` is the files' extension (".bin" in the torch.save layout).
inline std::optional<std::pair<std::string, std::string>> shard_name_pattern(std::string_view n,
                                                                             std::string_view ext = ".safetensors") {
  if (!n.ends_with(ext)) return std::nullopt;
  const std::size_t of = n.rfind("-of-");
  if (of == std::string_view::npos || of < 2) return std::nullopt;
  const std::size_t dash = n.rfind('-', of - 1);
  if (dash == std::string_view::npos) return std::nullopt;
  auto digits = [](std::string_view d) {
    return !d.empty() && std::all_of(d.begin(), d.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  if (!digits(n.substr(dash + 1, of - dash - 1)) || !digits(n.substr(of + 4, n.size() - ext.size() - of - 4)))
    return std::nullopt;
  return std::pair{std::string(n.substr(0, dash)), std::string(n.substr(of))};
}

}  // namespace detail

/// The checks of a sharded Hugging Face folder that look past its index (what `verify` adds to
/// open_hf_folder; a load reads only what the index names): a safetensors file of the folder
/// that the index does not name is refused (errc::invalid_metadata, naming it) when it holds a
/// tensor the index lists (in another file), or when its name is one of the index's set of
/// shards ("PREFIX-NNNNN-of-MMMMM.safetensors" with the PREFIX and MMMMM of a file the index
/// names: a shard the index forgot). Other safetensors files (consolidated.safetensors next to
/// an HF layout, adapters) are left alone. A directory that cannot list (HTTP) is not checked.
template <ReadableDirectory D>
void check_unlisted_hf_files(const D& dir, const hf_folder<D>& h) {
  if (!h.sharded()) return;
  std::vector<std::string> names;
  try {
    names = dir.list();
  } catch (const error& e) {
    if (e.code() == errc::invalid_argument) return;  // no listing (HTTP)
    throw;
  }
  const std::string_view ext = h.torch_bin ? ".bin" : ".safetensors";
  std::set<std::pair<std::string, std::string>> patterns;
  std::set<std::string> named;
  for (const auto& f : h.files) {
    named.insert(f.name);
    if (auto p = detail::shard_name_pattern(f.name, ext)) patterns.insert(*p);
  }
  const std::string& index_name = h.described_by;
  for (const auto& n : names) {
    if (!n.ends_with(ext) || named.count(n)) continue;
    const auto p = detail::shard_name_pattern(n, ext);
    const bool of_the_set = p && patterns.count(*p);
    // beside a torch.save layout lie other pickles (transformers' training_args.bin, an
    // optimizer.bin): one that is not of the set and not a file of tensors is not the folder's
    std::optional<typename hf_folder<D>::file> opened;
    try {
      opened.emplace(detail::open_hf_file(dir, n, h.torch_bin));
    } catch (const error& e) {
      if (!h.torch_bin || of_the_set || (e.code() != errc::invalid_metadata && e.code() != errc::unsupported_dtype))
        throw;
      continue;
    }
    const auto& f = *opened;
    for (const auto& t : f.header.tensors)
      if (auto it = h.index->weight_map.find(t.name); it != h.index->weight_map.end())
        fail(errc::invalid_metadata, f.header.file + ": tensor '" + t.name + "': " + index_name + " places it in " +
                                         it->second + ", but this file, which the index does not name, holds it too");
    if (of_the_set)
      fail(errc::invalid_metadata,
           f.header.file + ": a shard of this folder's set (" + p->first + "-*" + p->second + ") that " + index_name +
               " does not name: its " + std::to_string(f.header.tensors.size()) + " tensor(s)" +
               (f.header.tensors.empty() ? "" : ", '" + f.header.tensors.front().name + "' first,") +
               " are not part of the checkpoint");
  }
}

/// Opens the Hugging Face checkpoint in dir and validates it (see the list at the top): the
/// index and its files when dir holds model.safetensors.index.json, else model.safetensors;
/// where it holds neither, pytorch_model.bin.index.json and its files, else pytorch_model.bin
/// (the safetensors files first, as transformers reads them). errc::not_found when it holds none.
template <ReadableDirectory D>
hf_folder<D> open_hf_folder(const D& dir) {
  hf_folder<D> h;
  for (const auto& [index_name, single_name, bin] :
       {std::tuple{hf_index_file, hf_single_file, false}, std::tuple{hf_bin_index_file, hf_bin_single_file, true}}) {
    if (dir.exists(index_name)) {
      h.described_by = std::string(index_name);
      h.torch_bin = bin;
      h.index = read_hf_index(dir.open(index_name));
      for (const auto& f : h.index->files()) {
        if (!dir.exists(f))
          fail(errc::not_found, detail::object_path(dir, f) + ": listed in " + h.described_by + " but missing");
        h.files.push_back(detail::open_hf_file(dir, f, bin));
        detail::check_hf_file_against_index(*h.index, h.described_by, h.files.back());
      }
      detail::check_hf_index_against_files(dir, h);
      break;
    }
    if (dir.exists(single_name)) {
      h.described_by = std::string(single_name);
      h.torch_bin = bin;
      h.files.push_back(detail::open_hf_file(dir, std::string(single_name), bin));
      break;
    }
  }
  if (h.described_by.empty())
    fail(errc::not_found, std::string(dir.name()) + ": none of " + std::string(hf_index_file) + ", " +
                              std::string(hf_single_file) + ", " + std::string(hf_bin_index_file) + ", " +
                              std::string(hf_bin_single_file));
  for (std::size_t i = 0; i < h.files.size(); ++i) {
    const auto& ts = h.files[i].header.tensors;
    for (std::size_t k = 0; k < ts.size(); ++k)
      if (auto [it, fresh] = h.tensors.emplace(ts[k].name, hf_tensor_location{i, k}); !fresh)
        fail(errc::invalid_metadata, h.files[i].header.file + ": tensor '" + ts[k].name + "' also appears in " +
                                         h.files[it->second.file].header.file);
  }
  return h;
}

}  // namespace shardsafe
