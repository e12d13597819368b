// shardsafe/checkpoint/layouts/megatron_dist.hpp - Megatron-Core `torch_dist` checkpoints
// (dist_checkpointing over torch DCP; docs/FORMAT.md §7, docs/layouts-notes/megatron.md §2): a
// folder whose `latest_checkpointed_iteration.txt` names the iteration (iter_NNNNNNN/ or
// release/), or that folder itself, holding
//
//   metadata.json    {"sharded_backend": "torch_dist", ...}: what makes it one
//   .metadata        torch DCP's metadata (read by the dcp layout's rules; Megatron's classes on it
//                    allowlisted: format/dcp_unpickler.hpp)
//   __R_T.distcp     DCP data files
//   common.pt        torch.save of what is not sharded: args, iteration, the optimizer's
//                    param_groups and its one step (optimizer.state.common_step)
//
// Presented (the DCP keys, Megatron's ShardedTensor keys, made whole per layer):
//   <key>                           a tensor as Megatron keys it (embedding.word_embeddings.weight,
//                                   output_layer.weight with its padded vocabulary rows, ...)
//   decoder.layers.<L>.<rest>       a stacked key decoder.layers.<rest> (one prepended axis: the
//                                   global layer) as its layers, each chunk a block of one layer
//   decoder.layers.<L>.mlp.experts.local_experts.<E>.<rest>   decoder.layers.mlp.experts.experts.<rest>
//                                   (two prepended axes: layer and global expert)
//   optimizer.state.<name>.exp_avg / .exp_avg_sq / .fp32   optimizer.state.{exp_avg,exp_avg_sq,param}.<key>
//                                   under the name its parameter is presented by (.fp32: the
//                                   distributed optimizer's `param`, or the bf16/fp16 wrapper's
//                                   masters `fp32_param`)
//   optimizer.state.<name>.step     common.pt's common_step (the bf16/fp16 wrapper's under
//                                   optimizer.optimizer.state), for each parameter with optimizer state
//   non-tensor items                the sharded objects (rng_state/shard_..., _extra_state/shard_...)
//                                   as DCP items, common.pt's plain values, megatron.layout
//   optimizer[.optimizer].param_groups.<g>.params   the names of the group's parameters, which
//                                   Megatron does not save: by Megatron-Core's default grouping rule
//                                   (detail::megatron_kind_of), matched to each group by its
//                                   wd_mult and is_expert_parallel; not given where two groups are
//                                   of one kind (megatron.layout says why)
//   listed, never read              the distributed optimizer's dp_reshardable buffers
//                                   (optimizer.distributed.*): which parameter lies where in them is
//                                   not in the checkpoint; the message says how to re-save
//
// Refused: `latest_checkpointed_iteration.txt` naming no iteration folder with metadata.json (a
// legacy folder, mp_rank_TT[_PPP][_EEE]/, is the megatron_legacy layout's), a
// metadata.json whose sharded_backend is not torch_dist, a chunk of a stacked key spanning more than one layer, a
// global in common.pt outside the torch.save allowlist and megatron_records.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/layouts/dcp.hpp"
#include "shardsafe/checkpoint/layouts/deepspeed_files.hpp"
#include "shardsafe/checkpoint/layouts/layout.hpp"
#include "shardsafe/checkpoint/layouts/single_file.hpp"
#include "shardsafe/checkpoint/source.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/json_dom.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/format/torch_save.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/text.hpp"

namespace shardsafe {

/// The classes Megatron-Core's common.pt holds besides torch's (the run's args), read as opaque
/// records by this layout alone: never imported, never called.
inline constexpr std::string_view megatron_record_names[] = {
    "argparse.Namespace",
    "signal.Signals",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.AttnType",
    "megatron.core.enums.ModelType",
    "torch.Size",
    // a legacy checkpoint's rng_state holds numpy's generator state (an ndarray)
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
};
/// tensor_attributes: the bf16/fp16 wrapper's fp32 masters (fp32_from_fp16_params) carry the
/// tensor-parallel attributes Megatron copies onto them (tensor_model_parallel, partition_dim,
/// partition_stride): read as plain tensors, the attributes dropped.
inline constexpr pickle_record_classes megatron_records{megatron_record_names, true};

namespace detail {

/// The kind of param group Megatron-Core's default grouping rule puts a parameter in
/// (megatron/core/optimizer: _get_param_groups): no weight decay (wd_mult 0) for a name ending in
/// .bias or a tensor of one dimension, is_expert_parallel for an expert's (.local_experts.).
struct megatron_group_kind {
  bool no_wd = false, expert = false;
  auto operator<=>(const megatron_group_kind&) const = default;
  std::string said() const {
    return std::string(no_wd ? "biases and 1-D tensors" : "weights") + (expert ? ", experts" : "");
  }
};

inline megatron_group_kind megatron_kind_of(std::string_view param, std::size_t dims) {
  return {param.ends_with(".bias") || dims == 1, param.find(".local_experts.") != std::string_view::npos};
}

/// The kind a param group's wd_mult and is_expert_parallel say, or nullopt where either is
/// missing or not a number / bool.
inline std::optional<megatron_group_kind> megatron_group_kind_of(const pickle_value* wd, const pickle_value* ex) {
  if (!wd || (wd->type() != pickle_value::kind::real && wd->type() != pickle_value::kind::integer) || !ex ||
      ex->type() != pickle_value::kind::boolean)
    return std::nullopt;
  return megatron_group_kind{(wd->type() == pickle_value::kind::real ? wd->as_real("") : double(wd->as_int(""))) == 0.0,
                             ex->as_bool("")};
}

/// The names of each param group's parameters by that rule, Megatron saving none: `groups` is
/// what each group's wd_mult and is_expert_parallel say (megatron_group_kind_of), `params` each
/// parameter with state and its kind, in order. `why` is empty where every parameter found its
/// one group; else it says why no names are given (and `names` is empty).
struct megatron_named_groups {
  std::vector<std::vector<std::string>> names;
  std::string why;
};

inline megatron_named_groups megatron_name_groups(
    const std::vector<std::optional<megatron_group_kind>>& groups,
    const std::vector<std::pair<std::string, megatron_group_kind>>& params) {
  if (groups.empty()) return {{}, "no param groups"};
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (!groups[g])
      return {{}, "param group " + std::to_string(g) + " has no wd_mult and is_expert_parallel: its params not named"};
    if (std::find(groups.begin(), groups.begin() + static_cast<std::ptrdiff_t>(g), groups[g]) !=
        groups.begin() + static_cast<std::ptrdiff_t>(g))
      return {{},
              "two param groups of " + groups[g]->said() +
                  " (custom overrides): their params not named, the grouping rule cannot tell them apart"};
  }
  megatron_named_groups out{std::vector<std::vector<std::string>>(groups.size()), {}};
  for (const auto& [param, k] : params) {
    const auto at = std::find(groups.begin(), groups.end(), k);
    if (at == groups.end()) return {{}, "no param group of " + k.said() + " for " + param + ": params not named"};
    out.names[static_cast<std::size_t>(at - groups.begin())].push_back(param);
  }
  return out;
}

}  // namespace detail

struct megatron_dist_layout {
  static constexpr layout_info info{.id = "megatron_dist",
                                    .name = "Megatron-Core torch_dist checkpoint",
                                    .commit_mark = "",
                                    .permuted_files = true,
                                    .trainer_state = true};
  static constexpr std::string_view tracker_file = "latest_checkpointed_iteration.txt";
  static constexpr std::string_view config_file = "metadata.json";
  static constexpr std::string_view common_file = "common.pt";

  template <ReadableDirectory D>
  static bool recognise(const D&, folder_listing<D>& ls) {
    // (a folder that cannot be listed is not asked for metadata.json: describe reads it)
    return ls.has(tracker_file) ||
           (ls.has(common_file) && ls.has(dcp_metadata_file_name) && (!ls.listed() || ls.has(config_file)));
  }

  template <ReadableDirectory D>
  static std::optional<checkpoint_source<D>> open(const D& dir, folder_listing<D>& ls) {
    return open_pointed<megatron_dist_layout>(dir, ls, tracker_file, [](const D& d) { return iteration_folder(d); });
  }

  template <ReadableStorage S, class Source>
  static safetensors_header index_file(const S& s, const Source& src, const std::string& name) {
    return dcp_layout::index_file(s, src, name);
  }
  /// A DCP item's value from its data file; a common.pt value as its pickle held it.
  template <ReadableDirectory D>
  static pickle_value read_object(const D& dir, const non_tensor_item& it) {
    return it.value ? torch_save_file_layout::read_object(dir, it) : dcp_layout::read_object(dir, it);
  }
  /// The archive an export copies: a DCP item's as its data file holds it, whatever it holds (the
  /// RNG states hold tensors and numpy's state: copied, never unpickled); a common.pt value pickled.
  template <ReadableDirectory D>
  static std::string read_object_archive(const D& dir, const non_tensor_item& it) {
    return it.value ? torch_save_file_layout::read_object_archive(dir, it)
                    : dcp_layout::read_object_archive(dir, it, true);
  }

  /// How a DCP key's chunk is presented (table at the top); nullopt: under its key.
  static std::optional<dcp_chunk_name> chunk_name(const std::string& key, const shape_t& offsets, const shape_t&) {
    std::string model = key, suffix;
    for (const auto& [kind, as] : {std::pair<const char*, const char*>{"exp_avg_sq", ".exp_avg_sq"},
                                   {"exp_avg", ".exp_avg"},
                                   {"param", ".fp32"},
                                   {"fp32_param", ".fp32"}}) {
      const std::string prefix = std::string("optimizer.state.") + kind + ".";
      if (key.starts_with(prefix)) {
        model = key.substr(prefix.size());
        suffix = as;
        break;
      }
    }
    std::size_t axes = 0;
    for (std::string_view stack : {"decoder.layers.", "encoder.layers."}) {
      if (!model.starts_with(stack) || model.size() == stack.size() ||
          (model[stack.size()] >= '0' && model[stack.size()] <= '9'))
        continue;  // a key with its layer number (non-homogeneous layers) is one tensor
      const std::string rest = model.substr(stack.size());
      static constexpr std::string_view experts = "mlp.experts.experts.";
      axes = rest.starts_with(experts) ? 2 : 1;
      if (offsets.size() <= axes) return std::nullopt;  // not a stacked tensor after all
      model = std::string(stack) + std::to_string(offsets[0]) + "." +
              (axes == 2 ? "mlp.experts.local_experts." + std::to_string(offsets[1]) + "." + rest.substr(experts.size())
                         : rest);
      break;
    }
    if (suffix.empty() && axes == 0) return std::nullopt;
    return dcp_chunk_name{suffix.empty() ? model : "optimizer.state." + model + suffix, axes};
  }

  /// The description of iteration folder f: .metadata's, renamed (chunk_name), with common.pt.
  template <ReadableDirectory D>
  static checkpoint_source<D> describe(const D& f) {
    using R = typename D::reader_type;
    const std::string where = std::string(f.name()) + "/" + std::string(config_file);
    {
      const std::string text = read_text(f.open(config_file), 1 << 16);
      simdjson::dom::parser parser;
      const simdjson::dom::element root = detail::parse_json(parser, text, where);
      std::string_view backend;
      if (root["sharded_backend"].get(backend) != simdjson::SUCCESS)
        fail(errc::invalid_metadata,
             where + ": no \"sharded_backend\" (Megatron-Core's dist_checkpointing writes one)");
      if (backend != "torch_dist")
        fail(errc::invalid_metadata, where + ": sharded_backend \"" + std::string(backend) +
                                         "\" is not read (torch_dist is; zarr and others are not)");
    }
    checkpoint_source<D> s = dcp_layout::describe(
        f, [](const std::string& k, const shape_t& o, const shape_t& z) { return chunk_name(k, o, z); });
    s.layout = &info;
    s.described_by = std::string(dcp_metadata_file_name);
    s.paths.clear();  // DCP's planner paths name the keys, not what is presented
    // the distributed optimizer's buffers (dp_reshardable): listed, never read
    std::size_t buffers = 0;
    std::erase_if(s.metadata.tensors, [&](auto& kt) {
      if (!kt.first.starts_with("optimizer.distributed.")) return false;
      ++buffers;
      s.foreign_tensors.push_back(
          {kt.first, std::string(to_string(kt.second.type)), kt.second.shape, kt.second.files.size(),
           "is not read: a buffer of Megatron-Core's distributed optimizer saved dp_reshardable, whose parameters' "
           "places are not in the checkpoint; save with --dist-ckpt-optim-fully-reshardable (Megatron-Core 0.14 "
           "and later) for the optimizer state per parameter"});
      return true;
    });
    // common.pt: its plain values, and the one step of the optimizer for each parameter
    R cst = detail::open_or(f, common_file, [&] {
      return std::string(f.name()) + "/" + std::string(common_file) +
             ": missing: Megatron-Core writes it with every torch_dist checkpoint";
    });
    torch_save_index x = index_torch_save_file(cst, torch_save_read_options{&megatron_records, true});
    std::vector<tensor_entry> entries;
    std::size_t states = 0;
    const tensor_entry* step = x.header.find("optimizer.state.common_step");
    if (!step) step = x.header.find("optimizer.optimizer.state.common_step");  // the bf16/fp16 wrapper's
    if (step && step->shape.empty()) {
      std::vector<std::pair<std::string, tensor_metadata>> steps;
      for (const auto& [name, tm] : s.metadata.tensors) {
        if (!name.starts_with("optimizer.state.") || !name.ends_with(".exp_avg")) continue;
        const std::string key = name.substr(0, name.size() - 8) + ".step";
        tensor_entry e = *step;
        e.name = key;
        entries.push_back(std::move(e));
        tensor_metadata t;
        t.type = step->type;
        t.files.emplace_back(std::string(common_file), shard_spec(flat_spec{{0, 1}}));
        steps.emplace_back(key, std::move(t));
        ++states;
      }
      for (auto& st : steps) s.metadata.tensors.push_back(std::move(st));
      std::sort(s.metadata.tensors.begin(), s.metadata.tensors.end(),
                [](const auto& a, const auto& b) { return a.first < b.first; });
    }
    for (const auto& v : x.values)
      if (v.unwritable.empty())
        s.non_tensors.push_back({v.name, std::string(common_file), 0, 0, torch_save_value{v.name, v.value, {}}});
    const std::string named = name_group_params(s, x);
    const std::string said =
        "Megatron-Core torch_dist: tensors under their dist_checkpointing keys, stacked layers (and experts) "
        "presented one per layer as decoder.layers.<L>.<rest> (decoder.layers.<L>.mlp.experts.local_experts.<E>."
        "<rest>); optimizer state as optimizer.state.<name>.{exp_avg,exp_avg_sq,fp32}, " +
        std::to_string(states) + " parameters' step from common.pt; " + named +
        (buffers ? "; " + std::to_string(buffers) +
                       " distributed-optimizer buffers (dp_reshardable) listed, not read: re-save with "
                       "--dist-ckpt-optim-fully-reshardable"
                 : std::string());
    s.non_tensors.push_back(
        {"megatron.layout", std::string(common_file), 0, 0, torch_save_value{"", pickle_value::string(said), {}}});
    std::sort(s.non_tensors.begin(), s.non_tensors.end(), [](const auto& a, const auto& b) { return a.key < b.key; });
    const std::uint64_t size = cst.size();
    s.files.emplace_back(
        std::string(common_file),
        std::make_unique<opened_file<R>>(opened_file<R>{
            std::move(cst), safetensors_header::of_records(std::string(f.name()) + "/" + std::string(common_file), size,
                                                           std::move(entries), {})}));
    return s;
  }

  /// The folder latest_checkpointed_iteration.txt of dir names: iter_{:07d} or release (the
  /// megatron_legacy layout reads the same file).
  template <ReadableDirectory D>
  static std::string iteration_name(const D& dir) {
    const std::string where = std::string(dir.name()) + "/" + std::string(tracker_file);
    std::string it = read_text(dir.open(tracker_file), 4096);
    while (!it.empty() && (it.back() == '\n' || it.back() == '\r' || it.back() == ' ')) it.pop_back();
    if (it == "release") return it;
    if (it.empty() || it.size() > 12 || it.find_first_not_of("0123456789") != std::string::npos)
      fail(errc::invalid_metadata, where + ": '" + it + "' is neither an iteration number nor 'release'");
    const std::string n = std::to_string(std::stoull(it));
    return "iter_" + std::string(n.size() < 7 ? 7 - n.size() : 0, '0') + n;
  }

 private:
  /// common.pt's param groups keep no params: each group's names are given (items
  /// optimizer[.optimizer].param_groups.<g>.params) by Megatron-Core's default grouping rule, matched to the
  /// group by its wd_mult and is_expert_parallel. What was done, for megatron.layout.
  template <class Source>
  static std::string name_group_params(Source& s, const torch_save_index& x) {
    std::map<std::string, const pickle_value*> values;
    for (const auto& v : x.values) values[v.name] = &v.value;
    // the distributed optimizer's (fully_reshardable) are its inner optimizer's
    const std::string groups = values.count("optimizer.optimizer.param_groups.0.lr")
                                   ? "optimizer.optimizer.param_groups."
                                   : "optimizer.param_groups.";
    auto field = [&](std::size_t g, const char* f) -> const pickle_value* {
      auto it = values.find(groups + std::to_string(g) + "." + f);
      return it == values.end() ? nullptr : it->second;
    };
    std::vector<std::optional<detail::megatron_group_kind>> kinds;
    for (std::size_t g = 0; field(g, "lr"); ++g) {
      if (field(g, "params")) return "param groups as saved";
      kinds.push_back(detail::megatron_group_kind_of(field(g, "wd_mult"), field(g, "is_expert_parallel")));
    }
    std::vector<std::pair<std::string, detail::megatron_group_kind>> params;
    for (const auto& [name, tm] : s.metadata.tensors)
      if (name.starts_with("optimizer.state.") && name.ends_with(".exp_avg")) {
        std::string param = name.substr(16, name.size() - 16 - 8);
        const auto k = detail::megatron_kind_of(param, tm.shape.size());
        params.emplace_back(std::move(param), k);
      }
    const auto named = detail::megatron_name_groups(kinds, params);
    if (!named.why.empty()) return named.why;
    detail::trainer_group_params(s, std::string(common_file), named.names, groups);
    return "each param group's params named by Megatron-Core's default grouping rule (wd_mult 0: biases and 1-D "
           "tensors; is_expert_parallel: experts)";
  }

  /// The iteration folder, checked to hold metadata.json (a legacy folder is megatron_legacy's).
  template <ReadableDirectory D>
  static D iteration_folder(const D& dir) {
    const std::string name = iteration_name(dir);
    D folder = dir.sub(name);
    if (folder.exists(config_file)) return folder;
    fail(errc::not_found, std::string(dir.name()) + "/" + std::string(tracker_file) + ": names " + name + ", but " +
                              std::string(folder.name()) + " holds no " + std::string(config_file) +
                              " (a save that did not finish, or `" + std::string(tracker_file) + "` pointing nowhere)");
  }
};

}  // namespace shardsafe
