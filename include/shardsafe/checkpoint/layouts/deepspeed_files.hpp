// shardsafe/checkpoint/layouts/deepspeed_files.hpp - the parts of a DeepSpeed ZeRO checkpoint the
// deepspeed layout (layouts/deepspeed.hpp) is made of: each torch.save file read past the
// torch.save allowlist only by DeepSpeed's own classes, as opaque records (deepspeed_records), and
// the tensors presented, piece by piece, as element ranges of their files (ds_builder).
//
// A file is indexed once (format/torch_save.hpp with torch_save_read_options: the classes below
// read as records, the pickle's value kept for its order); nothing of DeepSpeed is imported or
// called. What the layout presents is an index of its own per file: one entry per piece of a
// presented tensor, named as the tensor is, at the bytes the piece occupies (a flat range of a
// partition), and each tensor's files with the flat element ranges each holds.
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

#include "shardsafe/checkpoint/layouts/layout.hpp"
#include "shardsafe/checkpoint/source.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/format/torch_save.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/text.hpp"

namespace shardsafe {

/// The classes DeepSpeed's checkpoint pickles hold besides torch's, read as opaque records
/// (format/torch_tensor_pickle.hpp's pickle_record_classes): never imported, never called. A
/// global outside these and the torch.save allowlist is refused naming it. ZeRO-3's flat fp32
/// groups are tensors with an attribute (ds_id): read as tensors (tensor_attributes).
inline constexpr std::string_view deepspeed_record_names[] = {
    "deepspeed.utils.tensor_fragment.fragment_address",      // a dataclass {numel, start}
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",         // {cur_scale, dynamic, ...}
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",  // the same, dynamic
    "deepspeed.runtime.zero.config.ZeroStageEnum",           // an int enum: ZeroStageEnum(2)
    "argparse.Namespace",                                    // a client's args
    "torch.Size",                                            // param_shapes' sizes: torch.Size((11, 6))
};
inline constexpr pickle_record_classes deepspeed_records{deepspeed_record_names, true};

namespace detail {

/// A file of the tag folder, indexed with its pickle's value.
template <class R>
struct ds_file {
  std::string name;
  R storage;
  torch_save_index x;
  const pickle_value& value() const { return *x.value; }
  [[noreturn]] void bad(const std::string& rule) const {
    fail(errc::invalid_metadata, std::string(storage.name()) + ": " + rule);
  }
  /// The tensor entry of flattened name n (errc::invalid_metadata naming `why` when absent).
  const tensor_entry& tensor(const std::string& n, const std::string& why) const {
    const tensor_entry* e = x.header.find(n);
    if (!e) bad("holds no tensor '" + n + "' (" + why + ")");
    return *e;
  }
};

/// Opens and indexes file `name` of folder f (errc::not_found naming it and `why` when absent),
/// known to the layout as `as` (default: name). A DeepSpeed checkpoint file holds a dict; with
/// `bare_tensor`, a bare tensor is taken too (a universal checkpoint's ZeRO-3 state files).
/// `records`: the trainer's classes read as records (Megatron's files: megatron_records).
template <ReadableDirectory D>
ds_file<typename D::reader_type> open_ds_file(const D& f, const std::string& name, const std::string& why,
                                              std::string as = {}, bool bare_tensor = false,
                                              const pickle_record_classes& records = deepspeed_records) {
  typename D::reader_type st =
      open_or(f, name, [&] { return std::string(f.name()) + "/" + name + ": missing: " + why; });
  torch_save_index x = index_torch_save_file(st, torch_save_read_options{&records, true});
  const bool bare = bare_tensor && x.header.tensors.size() == 1 && x.header.tensors[0].name.empty();
  if (!bare && (!x.value || x.value->type() != pickle_value::kind::dict))
    fail(errc::invalid_metadata, std::string(st.name()) + ": not a dict (a trainer's checkpoint file holds one)" +
                                     (bare_tensor ? " nor a tensor alone" : ""));
  return {as.empty() ? name : std::move(as), std::move(st), std::move(x)};
}

/// v[key] of a dict v, or nullptr.
inline const pickle_value* ds_get(const pickle_value* v, std::string_view key) {
  return v && v->type() == pickle_value::kind::dict ? v->find(key) : nullptr;
}

/// A non-negative int, or nullopt.
inline std::optional<std::uint64_t> ds_uint(const pickle_value* v) {
  if (!v || v->type() != pickle_value::kind::integer || v->as_int("") < 0) return std::nullopt;
  return static_cast<std::uint64_t>(v->as_int(""));
}

/// The shape a torch.Size record (or a plain tuple or list of ints) holds, or nullopt.
inline std::optional<shape_t> ds_shape(const pickle_value& v) {
  const pickle_value* seq = &v;
  if (torch_record_class(v) == "torch.Size") {
    const pickle_value* a = v.find(torch_record_args_key);
    if (!a || (a->type() != pickle_value::kind::tuple && a->type() != pickle_value::kind::list) ||
        a->as_sequence("").size() != 1)
      return std::nullopt;
    seq = &a->as_sequence("")[0];
  }
  if (seq->type() != pickle_value::kind::tuple && seq->type() != pickle_value::kind::list) return std::nullopt;
  shape_t s;
  for (const auto& d : seq->as_sequence("")) {
    const auto n = ds_uint(&d);
    if (!n) return std::nullopt;
    s.push_back(*n);
  }
  if (!checked_numel(s)) return std::nullopt;
  return s;
}

/// The parameters of one optimizer group in flattening order: (name, shape).
using ds_group = std::vector<std::pair<std::string, shape_t>>;

/// param_shapes of a model-states file: one ds_group per optimizer param group.
template <class R>
std::vector<ds_group> ds_param_groups(const ds_file<R>& m) {
  const pickle_value* ps = ds_get(&m.value(), "param_shapes");
  if (!ps || ps->type() != pickle_value::kind::list)
    m.bad("'param_shapes' is not a list of {name: torch.Size} per optimizer group");
  std::vector<ds_group> out;
  for (const auto& g : ps->as_sequence("")) {
    if (g.type() != pickle_value::kind::dict) m.bad("'param_shapes' holds a group that is not a dict");
    ds_group grp;
    for (std::size_t i = 0; i < g.dict_size(); ++i) {
      const auto shape = ds_shape(g.dict_value(i));
      if (g.dict_key(i).type() != pickle_value::kind::string || !shape)
        m.bad("'param_shapes' group " + std::to_string(out.size()) + ": entry " + std::to_string(i) +
              " is not a name and a torch.Size");
      grp.emplace_back(g.dict_key(i).as_string(""), *shape);
    }
    out.push_back(std::move(grp));
  }
  return out;
}

/// The presented tensors and each file's index of them, built piece by piece.
template <class R>
struct ds_builder {
  std::map<std::string, tensor_metadata> tensors;
  std::map<std::string, std::vector<tensor_entry>> entries;  // file -> its pieces
  std::map<std::string, std::map<std::string, std::vector<std::size_t>, std::less<>>> orders;

  /// Elements [first, first + count) of tensor `key` (shape, type) lie in file f from byte `at`.
  void piece(const ds_file<R>& f, const std::string& key, dtype type, const shape_t& shape, std::uint64_t first,
             std::uint64_t count, std::uint64_t at) {
    placed(f, key, type, shape, {{first, first + count}}, at);
  }
  /// The elements of tensor `key` (shape, type) that `ranges` (sorted, disjoint) name lie in file
  /// f one after another from byte `at`.
  void placed(const ds_file<R>& f, const std::string& key, dtype type, const shape_t& shape,
              std::vector<element_range> ranges, std::uint64_t at) {
    std::uint64_t count = 0;
    for (const auto& r : ranges) count += r.end - r.begin;
    tensor_metadata& tm = tensors[key];
    if (tm.files.empty()) {
      tm.shape = shape;
      tm.type = type;
    } else if (tm.shape != shape || tm.type != type) {
      f.bad("tensor '" + key + "': " + to_string(shape) + " " + std::string(to_string(type)) + " here, " +
            to_string(tm.shape) + " " + std::string(to_string(tm.type)) + " in " + tm.files.front().first +
            " (the partitions disagree)");
    }
    tensor_entry e;
    e.name = key;
    e.type = type;
    e.shape = shape.empty() ? shape_t{} : shape_t{count};
    e.begin = at;
    e.end = at + count * item_size(type);
    entries[f.name].push_back(std::move(e));
    tm.files.emplace_back(f.name, shard_spec(flat_spec(std::move(ranges))));
  }
  /// Tensor `key` whole, as entry e of file f holds it.
  void whole(const ds_file<R>& f, const std::string& key, const tensor_entry& e) {
    tensor_metadata tm;
    tm.shape = e.shape;
    tm.type = e.type;
    const auto order = f.x.header.stored_order(e);
    tm.files.emplace_back(f.name, order.empty() ? shard_spec(flat_spec{{0, e.numel()}})
                                                : shard_spec(block_spec(e.shape, shape_t(e.shape.size(), 0))));
    if (!order.empty()) orders[f.name].emplace(key, std::vector<std::size_t>(order.begin(), order.end()));
    tensor_entry c = e;
    c.name = key;
    entries[f.name].push_back(std::move(c));
    if (!tensors.emplace(key, std::move(tm)).second) f.bad("tensor '" + key + "' is presented twice");
  }
  /// A piece of `n` elements from element `from` of the flat 1-D tensor `flat` of file f, checked
  /// to lie inside it: the byte it starts at.
  static std::uint64_t flat_at(const ds_file<R>& f, const tensor_entry& flat, std::uint64_t from, std::uint64_t n,
                               const std::string& param, const char* rule) {
    if (flat.shape.size() != 1 || from > flat.numel() || n > flat.numel() - from)
      f.bad("parameter '" + param + "': elements [" + std::to_string(from) + ", " + std::to_string(from + n) +
            ") of '" + flat.name + "' " + to_string(flat.shape) + " are outside it (" + rule + ")");
    return f.x.header.offset_of(flat) + from * item_size(flat.type);
  }
};

/// Where a TP piece's elements go in the tensor joined on one dimension: `local` (sorted flat
/// element ranges of the piece) mapped to the joined tensor's flat ranges, each block of `lblock`
/// local elements (one index of the dimensions before the joined one) lying at element `start`
/// of a block of `gblock` (adjacent ranges merged). deepspeed_tp.hpp's and megatron_legacy's joins.
inline std::vector<element_range> ds_joined_ranges(const std::vector<element_range>& local, std::uint64_t lblock,
                                                   std::uint64_t gblock, std::uint64_t start) {
  std::vector<element_range> out;
  for (const auto& r : local)
    for (std::uint64_t a = r.begin; a < r.end;) {
      const std::uint64_t q = a / lblock, e = std::min(r.end, (q + 1) * lblock);
      const std::uint64_t ga = q * gblock + start + (a - q * lblock);
      if (!out.empty() && out.back().end == ga)
        out.back().end += e - a;
      else
        out.push_back({ga, ga + (e - a)});
      a = e;
    }
  return out;
}

/// The tag folder that text file `latest` of dir names (DeepSpeed's `latest`, a universal
/// checkpoint's `latest_universal`), checked to be a plain name and to hold what `holds` looks
/// for (`what`, for the message).
template <ReadableDirectory D, class Holds>
D ds_tag_folder(const D& dir, std::string_view latest, Holds&& holds, const std::string& what) {
  const std::string where = std::string(dir.name()) + "/" + std::string(latest);
  std::string tag = read_text(dir.open(latest), 4096);
  while (!tag.empty() && (tag.back() == '\n' || tag.back() == '\r' || tag.back() == ' ' || tag.back() == '\t'))
    tag.pop_back();
  while (!tag.empty() && (tag.front() == '\n' || tag.front() == ' ' || tag.front() == '\t')) tag.erase(0, 1);
  if (!is_plain_name(tag))
    fail(errc::invalid_metadata,
         where + ": names the tag '" + tag + "', which is not a folder name in " + std::string(dir.name()));
  D folder = dir.sub(tag);
  if (!holds(folder))
    fail(errc::not_found, where + ": names the tag '" + tag + "', but " + std::string(folder.name()) + " holds no " +
                              what + " (a save that did not finish, or `" + std::string(latest) +
                              "` pointing nowhere)");
  return folder;
}

/// Sets the items optimizer.param_groups.<g>.params of s (file `file`) to the names of group g's
/// parameters, names[g], where the trainer's file lists indices: as torch's get_state_dict names
/// them (layout_info::trainer_state). The items s had under ...params.<i> are dropped; the items
/// are left sorted by key.
template <class Source>
void trainer_group_params(Source& s, const std::string& file, const std::vector<std::vector<std::string>>& names,
                          std::string_view groups = "optimizer.param_groups.") {
  for (std::size_t g = 0; g < names.size(); ++g) {
    const std::string key = std::string(groups) + std::to_string(g) + ".params";
    std::erase_if(s.non_tensors, [&](const auto& it) { return it.key == key || it.key.starts_with(key + "."); });
    std::vector<pickle_value> list;
    for (const auto& n : names[g]) list.push_back(pickle_value::string(n));
    s.non_tensors.push_back({key, file, 0, 0, torch_save_value{key, pickle_value::list(std::move(list)), {}}});
  }
  std::sort(s.non_tensors.begin(), s.non_tensors.end(), [](const auto& a, const auto& b) { return a.key < b.key; });
}

/// The description of folder f the builder made: its tensors, checked against their files'
/// specs, and every file of `files` (their storages moved in) with the index of the pieces it
/// holds. described_by: the first file.
template <ReadableDirectory D, class Files>
checkpoint_source<D> ds_make_source(const D& f, const layout_info& info, ds_builder<typename D::reader_type>& b,
                                    Files& files) {
  using R = typename D::reader_type;
  checkpoint_source<D> s;
  s.layout = &info;
  s.described_by = files.front().name;
  for (auto& [key, tm] : b.tensors) {
    tm.is_sharded = tm.files.size() > 1;
    for (const auto& [fname, spec] : tm.files)
      spec.validate(tm.shape, std::string(f.name()) + "/" + fname + ": tensor '" + key + "'");
    s.metadata.tensors.emplace_back(key, std::move(tm));
  }
  for (auto& df : files) {
    const std::uint64_t size = df.storage.size();
    safetensors_header h = safetensors_header::of_records(std::string(df.storage.name()), size,
                                                          std::move(b.entries[df.name]), std::move(b.orders[df.name]));
    s.files.emplace_back(df.name,
                         std::make_unique<opened_file<R>>(opened_file<R>{std::move(df.storage), std::move(h)}));
  }
  return s;
}

}  // namespace detail
}  // namespace shardsafe
