// shardsafe/checkpoint/dcp_export.hpp - any checkpoint a checkpoint_reader reads written out, in
// one process, as a torch.distributed.checkpoint folder that torch 2.x's dcp.load reads (the tool's
// `to-dcp`, docs/FORMAT.md §4 and §5).
//
// Keys (before options.rename applies to them; "" drops a key, two alike are an error; a tensor
// with no name that no rule names, and rules that drop every key, are errors too: parts.hpp):
//
// | source                                   | keys written                                        |
// |------------------------------------------|-----------------------------------------------------|
// | a checkpoint, HF folder, safetensors     | the tensors' names                                  |
// | file, DCP folder (prefix "")             | (a DCP folder's non-tensor items too, their         |
// |                                          | torch.save archives copied byte for byte)           |
// | model/ of a model + optimizer pair       | model.{key}                                         |
// | optim/ of a pair (OLMo-core's layout,    | optim.state.{param}.{key} for state.{param}.__{key};|
// | torch/optim.hpp)                         | optim.param_groups.{i}.{field} for each field of    |
// |                                          | param_group{i} (params: its _param_names), as torch |
// |                                          | 2.x's get_state_dict lays an optimizer out          |
// | a trainer's checkpoint (layout_info::    | model.{name} for a model tensor;                    |
// | trainer_state: DeepSpeed, Megatron)      | optim.state.{param}.{field} for optimizer.state.    |
// |                                          | {param}.{field}; optim.param_groups.{g}.{field} for |
// |                                          | the item optimizer.param_groups.{g}.{field}; other  |
// |                                          | items under their names, but the per-rank RNG       |
// |                                          | states (rng_state...), left out                     |
//
// planner_data gives a pair's keys their nested paths (('model', fqn), ('optim', 'state', fqn, k),
// ('optim', 'param_groups', i, field)), a DCP source's keys the paths its .metadata gives, other
// keys their own path (key,).
//
// Everything goes into one data file, __0_0.distcp: the non-tensor items, then each tensor as one
// chunk, whole, streamed from the sources in blocks of chunk_bytes (the CRC-32 computed as they
// pass: memory is one block, whatever the tensor sizes), the checksums the sources record checked. `.metadata` is written last (temporary
// name, rename). The output folder must not exist or be empty; its writer must take writes at
// offsets (a local folder).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/dcp_export_items.hpp"
#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/parts.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/detail/crc32.hpp"
#include "shardsafe/format/dcp_metadata_writer.hpp"
#include "shardsafe/format/pickle_reader.hpp"
#include "shardsafe/format/pickle_writer.hpp"
#include "shardsafe/format/rename.hpp"
#include "shardsafe/format/torch_zip_writer.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/text.hpp"

namespace shardsafe {

struct dcp_export_options {
  rename_rules rename;      ///< applied to every key of the table at the top (first match wins; "" drops)
  bool model_only = false;  ///< for a model + optimizer pair (or a DCP source, a trainer's), only model/ (model.*) keys
  std::uint64_t chunk_bytes = std::uint64_t(16) << 20;  ///< memory of the tensor stream
};

struct dcp_export_stats {
  std::size_t tensors = 0;  ///< tensors written
  std::size_t objects = 0;  ///< non-tensor items written
  std::uint64_t bytes = 0;  ///< size of the data file
  double seconds = 0;
};

namespace detail {

/// The keys of `sources` (the table at the top).
template <ReadableDirectory S>
std::vector<dcp_export_item<S>> dcp_export_items(std::span<const unshard_source<S>> sources,
                                                 const dcp_export_options& opt) {
  std::vector<dcp_export_item<S>> items;
  auto str = [](std::string s) { return pickle_value::string(std::move(s)); };
  for (const auto& src : sources) {
    auto& r = *src.reader;
    const std::string dname(r.directory().name());
    if (src.prefix == std::string(optim_folder_name) + "/") {
      if (opt.model_only) continue;
      // state.{param}.__{key} -> (param, key), or nothing for another tensor; and its key here
      auto state_of = [](const std::string& key) -> std::optional<std::pair<std::string, std::string>> {
        const auto sep = key.rfind(".__");
        if (!key.starts_with("state.") || sep == std::string::npos || sep <= 6) return std::nullopt;
        return std::pair{key.substr(6, sep - 6), key.substr(sep + 3)};
      };
      auto out_key = [](const std::pair<std::string, std::string>& s) {
        return "optim.state." + s.first + "." + s.second;
      };
      r.refuse_foreign(
          [&](const std::string& key) {
            const auto s = state_of(key);
            return s && !opt.rename.apply(out_key(*s)).empty();
          },
          r.foreign_export_remedy);
      for (const auto& [key, tm] : r.metadata().tensors)
        if (const auto s = state_of(key))
          items.push_back({out_key(*s),
                           pickle_value::tuple({str("optim"), str("state"), str(s->first), str(s->second)}),
                           &r,
                           key,
                           {}});
      // param groups: each field an item, params the names
      std::vector<std::byte> n(8);
      unshard_tensor(r, "num_param_groups", n);
      std::int64_t groups = 0;
      std::memcpy(&groups, n.data(), 8);
      if (groups < 0 || groups > 1'000'000)
        fail(errc::invalid_metadata, dname + ": num_param_groups is " + std::to_string(groups));
      for (std::int64_t g = 0; g < groups; ++g) {
        const std::string gkey = "param_group" + std::to_string(g);
        const tensor_metadata* tm = r.find(gkey);
        if (!tm || tm->type != dtype::U8)
          fail(errc::invalid_metadata, dname + ": '" + gkey + "' is not a U8 byte tensor");
        std::string bytes(static_cast<std::size_t>(tm->numel()), '\0');
        unshard_tensor(r, gkey, std::as_writable_bytes(std::span(bytes)));
        const pickle_value group = pickle_loads(bytes, dname + ": '" + gkey + "'");
        const std::string ctx = dname + ": '" + gkey + "'";
        for (std::size_t i = 0; i < group.dict_size(); ++i) {
          std::string field = group.dict_key(i).as_string(ctx);
          pickle_value v = group.dict_value(i);
          if (field == "params") continue;  // ids; the names follow
          if (field == "_param_names") field = "params";
          items.push_back(
              {"optim.param_groups." + std::to_string(g) + "." + field,
               pickle_value::tuple({str("optim"), str("param_groups"), pickle_value::integer(g), str(field)}),
               nullptr,
               {},
               std::move(v)});
        }
      }
      continue;
    }
    const bool model = src.prefix == std::string(model_folder_name) + "/", trainer = r.layout().trainer_state;
    // a trainer's names placed as get_state_dict places them; else a DCP source's own path, or None: (key,)
    auto place = [&](const std::string& key, bool item) -> std::pair<std::string, pickle_value> {
      if (model) return {"model." + key, pickle_value::tuple({str("model"), str(key)})};
      if (trainer)
        if (auto p = trainer_state_place(key, item)) return std::move(*p);
      const pickle_value* p = r.path_in_state_dict(key);
      return {key, p ? *p : pickle_value::none()};
    };
    auto kept = [&](const std::string& to) {  // by its key before renaming
      return model || !opt.model_only || to.starts_with("model.");
    };
    for (const auto& [key, tm] : r.metadata().tensors)
      if (auto [to, path] = place(key, false); kept(to)) items.push_back({std::move(to), std::move(path), &r, key, {}});
    // a tensor of a dtype shardsafe has no type for is refused where the export would keep it
    r.refuse_foreign(
        [&](const std::string& key) {
          const std::string to = place(key, false).first;
          return kept(to) && !opt.rename.apply(to).empty();
        },
        r.foreign_export_remedy);
    for (const auto& obj : r.non_tensors()) {
      if (model) continue;
      auto [to, path] = place(obj.key, true);
      if (trainer && to.empty()) continue;  // left out (a rank's RNG state)
      if (!kept(to)) {
        // one left out is still read by the rules of check_objects: an item keyed "model" whose
        // value holds the model's tensors (torch 1.13's nested dict) is refused, not left out
        if (!obj.value) r.read_object_archive(obj.key);
        continue;
      }
      items.push_back({std::move(to), std::move(path), &r, obj.key, {}, true});
    }
    if (trainer && !opt.model_only) spread_group_steps(r, items);
  }
  return items;
}

}  // namespace detail

/// Exports the tensors (and values) of `sources` into the DCP folder `out` (the top of this header).
template <ReadableDirectory S, WritableDirectory D>
  requires RandomAccessWritableStorage<typename D::writer_type>
dcp_export_stats export_to(std::span<const unshard_source<S>> sources, const D& out, const dcp_export_options& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string oname(out.name());
  if (!out.list().empty())
    fail(errc::already_exists, oname + ": not empty; an export writes into a new or empty folder");
  auto items = detail::dcp_export_items(sources, opt);
  // the items by key, in a sorted vector of their indices (a map of a million keys held each
  // key again in a node: issue 53); a key given twice is refused
  std::vector<std::size_t> by_name(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) by_name[i] = i;
  std::stable_sort(by_name.begin(), by_name.end(),
                   [&](std::size_t a, std::size_t b) { return items[a].key < items[b].key; });
  for (std::size_t i = 1; i < by_name.size(); ++i)
    if (items[by_name[i - 1]].key == items[by_name[i]].key)
      fail(errc::invalid_argument, oname + ": the sources give '" + items[by_name[i]].key + "' twice");
  auto index_of = [&](std::string_view key) {  // of a key the items hold
    return *std::lower_bound(by_name.begin(), by_name.end(), key,
                             [&](std::size_t i, std::string_view k) { return items[i].key < k; });
  };
  // a tensor or value without a name is refused, not left out; then an export that would
  // export nothing
  // (an item the export makes itself, an optim/ folder's param_groups value, has no reader: its
  // key is made here, never empty)
  for (const auto& it : items)
    if (it.reader)
      detail::refuse_unnamed(*it.reader, it.source_key, it.key, opt.rename, oname, it.tensor() ? "tensor" : "value");
  // new name -> item, sorted by new name (rename_keys' rules; without rules each key is its own
  // new name, and "" is left out as rename_keys leaves it)
  std::map<std::string, std::string> renamed_keys;
  std::vector<std::pair<std::string_view, std::size_t>> renamed;
  if (opt.rename.empty()) {
    for (const std::size_t i : by_name)
      if (!items[i].key.empty()) renamed.emplace_back(items[i].key, i);
  } else {
    std::vector<std::string> names;
    for (const auto& it : items) names.push_back(it.key);
    renamed_keys = rename_keys(names, opt.rename, oname + ": rename");
    for (const auto& [to, from] : renamed_keys) renamed.emplace_back(to, index_of(from));
  }
  if (renamed.empty() && !items.empty()) {
    std::vector<std::string> names;
    for (const auto& it : items) names.push_back(it.key);
    detail::refuse_export_of_nothing(names, opt.rename, oname, "keys", "");
  }

  // the layout: values first, then each tensor as one chunk
  const std::string file = dcp_data_file_name(0);
  dcp_metadata md;
  std::map<std::string, pickle_value> paths;
  struct tensor_out {
    const detail::dcp_export_item<S>* item;
    torch_tensor_archive archive;
    std::uint64_t at;
  };
  // a DCP item's archive goes across byte for byte (torch.save may have pickled any object); an
  // archive is made here for its size and again when written, so that a million values are not
  // held at once (issue 53)
  auto archive_of = [](const detail::dcp_export_item<S>& it) {
    return it.object ? it.reader->read_object_archive(it.source_key) : torch_value_archive(pickle_dumps(it.value));
  };
  std::vector<std::pair<std::uint64_t, const detail::dcp_export_item<S>*>> values;  // offset, item
  std::vector<tensor_out> tensors;
  std::uint64_t at = 0;
  for (const auto& [to_view, index] : renamed) {
    const std::string to(to_view);
    const auto& it = items[index];
    const std::string& from = it.key;
    // a renamed key's path is (to,), which .metadata gives a key without one: only the other
    // paths are held (a million (key,) tuples were about 250 bytes each, issue 53)
    if (to == from && !it.path.is_none()) paths.emplace(to, it.path);
    if (it.tensor()) continue;
    const std::uint64_t size = archive_of(it).size();
    dcp_item& d = md.items[to];
    d.is_bytes = true;
    d.bytes = {file, at, size};
    values.emplace_back(at, &it);
    at += size;
  }
  for (const auto& [to_view, index] : renamed) {
    const std::string to(to_view);
    const auto& it = items[index];
    if (!it.tensor()) continue;
    if (!it.made.empty()) {  // an F32 scalar the export made
      tensor_out& t = tensors.emplace_back(tensor_out{&it, torch_tensor_archive(dtype::F32, {}), at});
      dcp_item& d = md.items[to];
      d.type = dtype::F32;
      d.chunks.push_back({{}, {}, {file, at, t.archive.size()}});
      at += t.archive.size();
      continue;
    }
    const tensor_metadata* tm = it.reader->find(it.source_key);
    require_byte_sized(tm->type, std::string(it.reader->directory().name()) + ": tensor '" + it.source_key + "'");
    tensor_out& t = tensors.emplace_back(tensor_out{&it, torch_tensor_archive(tm->type, tm->shape), at});
    dcp_item& d = md.items[to];
    d.type = tm->type;
    d.size = tm->shape;
    d.chunks.push_back({shape_t(tm->shape.size(), 0), tm->shape, {file, at, t.archive.size()}});
    at += t.archive.size();
  }

  // a grid's files are opened and checked before the output is made (unshard.hpp)
  for (const auto& t : tensors)
    if (!t.item->made.empty()) {
    } else if (const tensor_metadata* tm = t.item->reader->find(t.item->source_key); tm->grid)
      detail::for_each_file_opened(*t.item->reader, t.item->source_key, *tm, [](const auto&...) {});
  dcp_export_stats st;
  st.bytes = at;
  out.make();
  auto w = out.create(file);
  detail::abort_on_failure(w, [&] {
    auto put = [&](std::uint64_t off, std::string_view s) {
      w.write_at(off, std::as_bytes(std::span<const char>(s.data(), s.size())));
    };
    for (const auto& [off, it] : values) put(off, archive_of(*it));
    unshard_options uo;
    uo.chunk_bytes = opt.chunk_bytes;
    // the tensors of one reader in a row go to for_each_full_tensor together (small ones are
    // loaded many at once: a request per part over HTTP or S3, not one per tensor)
    for (std::size_t first = 0; first < tensors.size();) {
      if (const tensor_out& t = tensors[first]; !t.item->made.empty()) {
        detail::crc32 crc;
        const auto b = std::as_bytes(std::span<const char>(t.item->made.data(), t.item->made.size()));
        crc.update(b);
        put(t.at, t.archive.head());
        w.write_at(t.at + t.archive.head().size(), b);
        put(t.at + t.archive.head().size() + t.archive.data_size(), t.archive.tail(crc.value()));
        ++first;
        continue;
      }
      std::size_t last = first + 1;
      while (last < tensors.size() && tensors[last].item->reader == tensors[first].item->reader &&
             tensors[last].item->made.empty())
        ++last;
      std::vector<std::string> keys;
      std::vector<detail::crc32> crcs(last - first);
      for (std::size_t i = first; i < last; ++i) {
        keys.push_back(tensors[i].item->source_key);
        put(tensors[i].at, tensors[i].archive.head());
      }
      for_each_full_tensor(
          *tensors[first].item->reader, std::span<const std::string>(keys),
          [&](const std::string& key, std::span<const std::byte> b, std::uint64_t at) {
            const std::size_t i = static_cast<std::size_t>(&key - keys.data());
            const tensor_out& t = tensors[first + i];
            crcs[i].update(b);
            w.write_at(t.at + t.archive.head().size() + at, b);
          },
          uo);
      for (std::size_t i = first; i < last; ++i) {
        const tensor_out& t = tensors[i];
        put(t.at + t.archive.head().size() + t.archive.data_size(), t.archive.tail(crcs[i - first].value()));
      }
      first = last;
    }
    w.sync();
    w.commit();
  });
  st.tensors = tensors.size();
  st.objects = values.size();
  // the commit mark, last: written as it is made (a million items' .metadata is hundreds of MB)
  auto mw = out.create(dcp_metadata_file_name);
  detail::abort_on_failure(mw, [&] {
    std::uint64_t off = 0;
    write_dcp_metadata(md, paths, [&](std::string_view piece) {
      mw.write_at(off, std::as_bytes(std::span<const char>(piece.data(), piece.size())));
      off += piece.size();
    });
    mw.sync();
    mw.commit();
  });
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

/// Exports the checkpoint in src, whichever layout it has, into the DCP folder out; a model +
/// optimizer pair's model/ and optim/ as model.* and optim.* keys (checkpoint/parts.hpp).
template <ReadableDirectory S, WritableDirectory D>
  requires RandomAccessWritableStorage<typename D::writer_type>
dcp_export_stats export_to(const S& src, const D& out, const dcp_export_options& opt) {
  const checkpoint_parts<S> parts = open_checkpoint_parts(src);
  return export_to(std::span<const unshard_source<S>>(parts.sources), out, opt);
}

/// (the export's name before issue 52)
template <ReadableDirectory S, WritableDirectory D>
  requires RandomAccessWritableStorage<typename D::writer_type>
[[deprecated("export_dcp is shardsafe::export_to with dcp_export_options (CHANGELOG migration table)")]]
dcp_export_stats export_dcp(std::span<const unshard_source<S>> sources, const D& out,
                            const dcp_export_options& opt = {}) {
  return export_to(sources, out, opt);
}

}  // namespace shardsafe
