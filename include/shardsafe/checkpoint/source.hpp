// shardsafe/checkpoint/source.hpp - what a checkpoint_reader reads, whatever wrote it: the
// tensors with the shard each file holds, and the files already opened.
//
// The loader, unshard, verify, export and the tool read any of these the same way, through the
// overlap engine and the read plans; only the description differs:
//
// | format          | how it is told apart                        | each tensor's files              |
// |-----------------|---------------------------------------------|----------------------------------|
// | sharded         | metadata.json (shardsafe, OLMo-core)        | shard_spec_per_file              |
// | hf              | model.safetensors.index.json, or            | the one file holding it, whole   |
// |                 | model.safetensors (checkpoint/hf/folder.hpp)| (flat spec [0, numel))           |
// |                 | (pytorch_model.bin[.index.json]: torch.save)|                                  |
// | dcp             | .metadata (torch.distributed.checkpoint,    | one block per chunk, at the      |
// |                 | format/dcp_metadata.hpp)                    | storage record of its archive    |
// | dcp_sharded_hf  | *.safetensors whose __metadata__ holds      | one block per file: its local    |
// |                 | DCP_SHARDING_INFO (format/dcp_sharding.hpp) | shape at saved_offsets           |
//
// They are tried in that order: a folder with metadata.json is a sharded checkpoint whatever
// else it holds; anything else is errc::not_found ("no metadata.json: ...").
//
// A DCP folder is described by `.metadata` alone: opening it reads that one file. Its data
// files are indexed when the reader first opens them (format/dcp_data.hpp: the zip headers of
// each chunk's torch.save archive, never the chunk's data), so a load opens and indexes only
// the files it reads from. A data file holding two chunks of one key (a rank with two shards of
// a tensor) is listed as `FILE`, `FILE#1`, ...: one name per chunk of that key, the same file.
// Non-tensor items (BytesStorageMetadata) are listed in non_tensors, their values read only on
// request (format/dcp_data.hpp's read_dcp_object). Tensors of a torch dtype shardsafe has no type
// for (complex128, quantized: dcp_item::foreign_dtype) are listed in foreign_tensors, not in the
// metadata: the loader, unshard, verify and the exports refuse them by name where they would
// read them (checkpoint_files::refuse_foreign), and a rename that drops them lets an export by.
//
// A folder is DCP-sharded when one of its safetensors files has DCP_SHARDING_INFO (rank files
// without metadata.json, a save that did not finish, stay "no metadata.json"). Its checks
// (errc::invalid_metadata, naming file and tensor): every safetensors file of the folder has it; a tensor has the same dtype and number of
// dimensions in every file. Coverage (every element in some file) is checked where it is
// needed: by the loader for what it loads, by verify for everything.
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

#include "shardsafe/checkpoint/hf/folder.hpp"
#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/dcp_data.hpp"
#include "shardsafe/format/dcp_metadata.hpp"
#include "shardsafe/format/dcp_sharding.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/format/torch_save.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/text.hpp"

namespace shardsafe {

/// Which writer's layout a checkpoint folder has (table at the top).
enum class checkpoint_format { sharded, hf, dcp, dcp_sharded_hf };

constexpr std::string_view name(checkpoint_format f) noexcept {
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

/// A tensor of a DCP folder whose torch dtype shardsafe has no type for: listed, never read.
struct foreign_tensor {
  std::string key;
  std::string dtype;  ///< torch's name: "torch.complex128"
  shape_t shape;
  std::size_t chunks = 0;
};

/// How messages name file `name` of a tensor's files: itself, or for the internal name of a DCP
/// data file's second (third, ...) chunk of one key, `FILE#k`, "FILE (chunk k+1 of this tensor in it)".
inline std::string display_file_name(std::string_view name) {
  const auto hash = name.rfind('#');
  if (hash == std::string_view::npos || hash + 1 == name.size() ||
      name.substr(hash + 1).find_first_not_of("0123456789") != std::string_view::npos)
    return std::string(name);
  return std::string(name.substr(0, hash)) + " (chunk " + std::to_string(std::stoull(std::string(name.substr(hash + 1))) + 1) +
         " of this tensor in it)";
}

/// A checkpoint's description and the files opened while making it.
template <ReadableDirectory D>
struct checkpoint_source {
  checkpoint_format format = checkpoint_format::sharded;
  std::string described_by;  ///< what holds the description, for messages ("metadata.json", ...)
  checkpoint_metadata metadata;
  std::vector<std::pair<std::string, std::unique_ptr<opened_file<typename D::reader_type>>>> files;
  /// Files the tensors name whose index is not their own safetensors header (a DCP folder's
  /// data files, format/dcp_data.hpp), by that name; the reader indexes each when it opens it.
  std::map<std::string, dcp_data_file> data_files;
  std::vector<non_tensor_item> non_tensors;  ///< by key
  std::vector<foreign_tensor> foreign_tensors;  ///< by key
  /// A DCP folder's planner_data: each key's path in the state dict torch flattened.
  std::map<std::string, pickle_value> paths;
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

template <ReadableDirectory D>
checkpoint_source<D> hf_source(const D& dir) {
  hf_folder<D> h = open_hf_folder(dir);
  checkpoint_source<D> s;
  s.format = checkpoint_format::hf;
  s.described_by = h.described_by;
  // tensors in name order (the index's order; a single file's by name too)
  for (const auto& [key, at] : h.tensors)
    s.metadata.tensors.emplace_back(key, whole_tensor(h.entry(at), h.files[at.file].name,
                                                      !h.files[at.file].header.stored_order(h.entry(at)).empty()));
  for (auto& f : h.files) {
    s.metadata.extras.file_sizes.emplace(f.name, f.header.file_size());
    s.files.emplace_back(f.name, std::make_unique<opened_file<typename D::reader_type>>(
                                     opened_file<typename D::reader_type>{std::move(f.storage), std::move(f.header)}));
  }
  return s;
}

/// The DCP-sharded source of the safetensors files `names` of dir (rules at the top), or
/// nothing when none of them has DCP_SHARDING_INFO (rank files of a save that did not finish,
/// for instance).
template <ReadableDirectory D>
std::optional<checkpoint_source<D>> dcp_sharded_source(const D& dir, const std::vector<std::string>& names) {
  using R = typename D::reader_type;
  std::vector<opened_file<R>> opened;
  bool any = false;
  for (const auto& n : names) {
    R st = dir.open(n);
    safetensors_header h = read_safetensors_header(st);
    any = any || is_dcp_sharded_header(h);
    opened.push_back({std::move(st), std::move(h)});
  }
  if (!any) return std::nullopt;
  checkpoint_source<D> s;
  s.format = checkpoint_format::dcp_sharded_hf;
  s.described_by = std::string(dcp_sharding_info_key);
  std::map<std::string, std::size_t> where;  // tensor -> index in s.metadata.tensors
  for (std::size_t fi = 0; fi < names.size(); ++fi) {
    const std::string& n = names[fi];
    R& st = opened[fi].storage;
    safetensors_header& h = opened[fi].header;
    if (!is_dcp_sharded_header(h))
      fail(errc::invalid_metadata, h.file + ": no " + std::string(dcp_sharding_info_key) +
                                       " in __metadata__, but other safetensors files of the folder have one "
                                       "(a folder of torch's sharded Hugging Face files holds only those)");
    const dcp_block_offsets offs = parse_dcp_sharding_info(h);
    // in data order is the writer's order; the table is sorted by name below
    for (const auto& e : h.tensors) {
      const shape_t& at = offs.at(e.name);
      auto [it, fresh] = where.emplace(e.name, s.metadata.tensors.size());
      if (fresh) {
        tensor_metadata tm;
        tm.type = e.type;
        tm.is_sharded = true;
        tm.shape.assign(e.shape.size(), 0);
        s.metadata.tensors.emplace_back(e.name, std::move(tm));
      }
      tensor_metadata& tm = s.metadata.tensors[it->second].second;
      const std::string ctx = h.file + ": tensor '" + e.name + "'";
      if (e.type != tm.type)
        fail(errc::invalid_metadata, ctx + ": dtype " + std::string(name(e.type)) + " but " +
                                         tm.files.front().first + " holds it as " + std::string(name(tm.type)));
      if (e.shape.size() != tm.shape.size())
        fail(errc::invalid_metadata, ctx + ": " + std::to_string(e.shape.size()) + " dimensions but " +
                                         tm.files.front().first + " gives it " + std::to_string(tm.shape.size()));
      for (std::size_t d = 0; d < at.size(); ++d) tm.shape[d] = std::max(tm.shape[d], at[d] + e.shape[d]);
      tm.files.emplace_back(n, shard_spec(block_spec(e.shape, at)));
    }
    s.metadata.extras.file_sizes.emplace(n, h.file_size());
    s.files.emplace_back(n, std::make_unique<opened_file<R>>(opened_file<R>{std::move(st), std::move(h)}));
  }
  std::sort(s.metadata.tensors.begin(), s.metadata.tensors.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [key, tm] : s.metadata.tensors) {
    if (!detail::checked_numel(tm.shape))
      fail(errc::invalid_metadata, std::string(dir.name()) + ": tensor '" + key + "': full shape " +
                                       to_string(tm.shape) + " has more than 2^64 elements");
    for (auto& [fname, spec] : tm.files) spec.validate(tm.shape, std::string(dir.name()) + "/" + fname);
  }
  return s;
}

/// The source of the torch DCP folder dir: `.metadata` read (rules in format/dcp_metadata.hpp),
/// no data file opened (rules at the top).
template <ReadableDirectory D>
checkpoint_source<D> dcp_source(const D& dir) {
  const std::string folder(dir.name());
  const dcp_metadata md =
      parse_dcp_metadata(read_text(dir.open(dcp_metadata_file_name), max_metadata_size, text_kind::pickle), folder + "/.metadata");
  checkpoint_source<D> s;
  s.format = checkpoint_format::dcp;
  s.described_by = std::string(dcp_metadata_file_name);
  s.paths = md.planner_data;
  std::map<std::pair<std::string, std::string>, std::size_t> chunks_of;  // (file, key) -> chunks so far
  for (const auto& [key, item] : md.items) {
    if (item.is_bytes) {
      s.non_tensors.push_back({key, item.bytes.relative_path, item.bytes.offset, item.bytes.length, std::nullopt});
      continue;
    }
    if (!item.foreign_dtype.empty()) {
      s.foreign_tensors.push_back({key, item.foreign_dtype, item.size, item.chunks.size()});
      continue;
    }
    tensor_metadata tm;
    tm.shape = item.size;
    tm.type = item.type;
    tm.is_sharded = item.chunks.size() > 1 || (item.chunks.size() == 1 && item.chunks.front().sizes != item.size);
    for (const auto& c : item.chunks) {
      const std::string& path = c.storage.relative_path;
      const std::size_t k = chunks_of[{path, key}]++;
      const std::string fname = k == 0 ? path : path + "#" + std::to_string(k);
      if (k > 0 && path.ends_with(".safetensors"))
        fail(errc::invalid_metadata, folder + "/.metadata: tensor '" + key + "': a second chunk (at " + to_string(c.offsets) +
                                         ") placed in '" + path + "', a safetensors file, which holds each key once");
      dcp_data_file& df = s.data_files[fname];
      if (!df.chunks.empty() && df.path != path)
        fail(errc::invalid_metadata, folder + "/.metadata: tensor '" + key + "': '" + fname + "' names both the data file '" +
                                         df.path + "' and chunk " + std::to_string(k) + " of '" + path + "' in it");
      df.path = path;
      df.safetensors = path.ends_with(".safetensors");
      df.chunks.push_back({{key, item.type, c.offsets, c.sizes}, c.storage.offset, c.storage.length});
      // a 0-d tensor's one chunk is its one element
      tm.files.emplace_back(fname, item.size.empty() ? shard_spec(flat_spec{{0, 1}}) : shard_spec(block_spec(c.sizes, c.offsets)));
    }
    for (auto& [fname, spec] : tm.files) spec.validate(tm.shape, folder + "/" + fname);
    s.metadata.tensors.emplace_back(key, std::move(tm));
  }
  return s;
}

}  // namespace detail

/// One safetensors file `name` of dir read as a checkpoint: every tensor whole in that file
/// (what `shardsafe to-hf FILE` exports), in name order. A torch.save file (format/torch_save.hpp:
/// is_torch_save_file) is read the same way, a training checkpoint's values that are not tensors
/// (an epoch, an optimizer's hyper-parameters) as non-tensor items, each key's place in the
/// nested dict as a DCP folder's (paths).
template <ReadableDirectory D>
checkpoint_source<D> single_file_source(const D& dir, const std::string& name) {
  using R = typename D::reader_type;
  checkpoint_source<D> s;
  s.format = checkpoint_format::hf;
  s.described_by = name;
  R st = dir.open(name);
  safetensors_header h;
  if (is_torch_save_file(st)) {
    torch_save_index x = index_torch_save_file(st);
    h = std::move(x.header);
    for (auto& v : x.values) s.non_tensors.push_back({v.name, name, 0, 0, std::move(v)});  // by name already
    s.paths = std::move(x.paths);
  } else {
    h = read_safetensors_header(st);
  }
  for (const auto& e : h.tensors) s.metadata.tensors.emplace_back(e.name, detail::whole_tensor(e, name, !h.stored_order(e).empty()));
  std::sort(s.metadata.tensors.begin(), s.metadata.tensors.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  s.files.emplace_back(name, std::make_unique<opened_file<R>>(opened_file<R>{std::move(st), std::move(h)}));
  return s;
}

namespace detail {

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

/// Opens file `name` of the checkpoint src describes, and indexes it as src says: a
/// safetensors file by its header, a DCP data file by its archives' zip headers
/// (format/dcp_data.hpp). A size metadata.json recorded must match.
template <ReadableDirectory D>
std::unique_ptr<opened_file<typename D::reader_type>> open_source_file(const D& dir, const checkpoint_source<D>& src,
                                                                       const std::string& name) {
  using R = typename D::reader_type;
  const auto df = src.data_files.find(name);
  const std::string& path = df == src.data_files.end() ? name : df->second.path;
  R s = detail::open_or(dir, path, [&] {
    return std::string(dir.name()) + "/" + path + ": missing: " + src.described_by + " lists it but it does not exist";
  });
  safetensors_header h = df == src.data_files.end() ? read_safetensors_header(s) : index_dcp_data_file(s, df->second);
  const auto size_it = src.metadata.extras.file_sizes.find(name);
  if (size_it != src.metadata.extras.file_sizes.end() && size_it->second != s.size())
    fail(errc::truncated, std::string(s.name()) + ": file is " + std::to_string(s.size()) + " bytes but " +
                              src.described_by + " recorded " + std::to_string(size_it->second));
  return std::make_unique<opened_file<R>>(opened_file<R>{std::move(s), std::move(h)});
}

/// Opens the checkpoint in dir, whichever layout it has (table at the top), reading only
/// descriptions and headers.
template <ReadableDirectory D>
checkpoint_source<D> open_checkpoint_source(const D& dir) {
  checkpoint_source<D> s;
  s.described_by = std::string(metadata_file_name);
  try {
    s.metadata = read_checkpoint_metadata(dir.open(metadata_file_name));
    return s;
  } catch (const error& e) {
    if (e.code() != errc::not_found) throw;
  }
  if (is_hf_folder(dir)) return detail::hf_source(dir);
  if (dir.exists(dcp_metadata_file_name)) return detail::dcp_source(dir);
  std::vector<std::string> tensors_files;
  bool distcp = false;
  for (auto& n : dir.list()) {
    if (n.ends_with(".safetensors")) tensors_files.push_back(n);
    if (n.ends_with(".distcp")) distcp = true;
  }
  if (!tensors_files.empty())
    if (auto s = detail::dcp_sharded_source(dir, tensors_files)) return std::move(*s);
  if (distcp)
    fail(errc::not_found, std::string(dir.name()) + ": .distcp files but no .metadata: not a complete "
                                                "torch.distributed.checkpoint folder (a save that did not finish?)");
  fail(errc::not_found, std::string(dir.name()) +
                            ": no metadata.json: not a complete checkpoint (a save that did not finish, or not a "
                            "checkpoint directory)");
}

}  // namespace shardsafe
