// shardsafe/checkpoint/layouts/deepspeed_universal.hpp - DeepSpeed universal checkpoints
// (ds_to_universal's output; docs/FORMAT.md §6, docs/layouts-notes/deepspeed.md §6): a folder
// whose `latest_universal` names the tag folder, or the tag folder itself, holding
//
//   mp_rank_MM_model_states.pt | zero_pp_rank_D_mp_rank_00_model_states.pt   copies of the save's model states
//   zero/optimizer_state.pt                        the optimizer's scalars and param_groups
//   zero/<param>/fp32.pt, exp_avg.pt, exp_avg_sq.pt   the parameter's fp32 master and Adam's moments, whole
//   zero/<param>/step.pt                           (ZeRO-1/2) the step, a 0-d tensor
//
// A state file holds {'param': the tensor, how ds_to_universal joined it (cat_dim, ...)}, the
// tensor whole with the TP ranks joined and any vocabulary padding cut; or (ZeRO-3) the tensor
// alone, flat, of param_shapes' numel. The parameters are those param_shapes lists, so a folder
// is read by name, listed or not (HTTP).
//
// Presented under the deepspeed layout's names (layouts/deepspeed.hpp):
//   <param>                                 its fp32 master (float32): the values DeepSpeed's
//                                           universal load puts back in the model (rounded to its dtype)
//   optimizer.state.<param>.fp32 / .exp_avg / .exp_avg_sq   whole, each from its file
//   optimizer.state.<param>.step            step.pt; ZeRO-3: its group's step in optimizer_state.pt
//   <buffer>, frozen parameters             from the model states, as the deepspeed layout presents
//                                           them (with TP, per TP rank as tp{T}/<name>)
//   non-tensor items                        the model states' plain values, optimizer.param_groups...
//                                           from zero/optimizer_state.pt, and deepspeed.layout
//
// Refused (naming the file, the parameter and the rule): `latest_universal` naming no tag folder,
// a parameter's missing state file, a state file holding neither form, a tensor whose shape is not
// param_shapes' (the dimensions, at most mp_world_size times one TP rank's elements; ZeRO-3's
// flat form exactly its numel), its three states disagreeing on shape, a parameter name that is
// not a folder name, ZeRO-3 with TP (not written by ds_to_universal).
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/checkpoint/layouts/deepspeed_files.hpp"
#include "shardsafe/checkpoint/layouts/deepspeed_zero.hpp"
#include "shardsafe/checkpoint/layouts/layout.hpp"
#include "shardsafe/checkpoint/layouts/single_file.hpp"
#include "shardsafe/checkpoint/source.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/format/torch_save.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

struct deepspeed_universal_layout : torch_save_values {
  static constexpr layout_info info{.id = "deepspeed_universal",
                                    .name = "DeepSpeed universal checkpoint",
                                    .commit_mark = "",
                                    .permuted_files = true,
                                    .trainer_state = true};
  /// The file naming the tag folder (what DeepSpeed's load_universal reads).
  static constexpr std::string_view latest_file = "latest_universal";
  /// The folder of the per-parameter state files, and the optimizer's file in it.
  static constexpr std::string_view state_folder = "zero";
  static constexpr std::string_view optimizer_file = "optimizer_state.pt";

  template <ReadableDirectory D>
  static bool recognise(const D& dir, folder_listing<D>& ls) {
    if (!ls.listed()) return dir.exists(latest_file) || dir.sub(state_folder).exists(optimizer_file);
    bool zero = false, model = false;
    for (const auto& n : ls.names()) {
      if (n == latest_file) return true;
      zero = zero || n == state_folder;
      model = model || detail::ds_is_model_states_name(n);
    }
    return zero && model;
  }

  template <ReadableDirectory D>
  static std::optional<checkpoint_source<D>> open(const D& dir, folder_listing<D>& ls) {
    return open_pointed<deepspeed_universal_layout>(dir, ls, latest_file, [](const D& d) {
      return detail::ds_tag_folder(
          d, latest_file, [](const D& tf) { return tf.sub(state_folder).exists(optimizer_file); },
          std::string(state_folder) + "/" + std::string(optimizer_file));
    });
  }

  /// The description of tag folder f: the model states, zero/optimizer_state.pt and each
  /// parameter's state files read and indexed (their pickles, no tensor data).
  template <ReadableDirectory D>
  static checkpoint_source<D> describe(const D& f) {
    using R = typename D::reader_type;
    using F = detail::ds_file<R>;
    const bool zero3 = !f.exists(detail::ds_model_name(0));
    std::deque<F> files;  // references into it stay valid as it grows
    const F& m0 = files.emplace_back(
        detail::open_ds_file(f, zero3 ? detail::ds_zero3_model_name(0, 0) : detail::ds_model_name(0),
                             "the model states of TP rank 0 (ds_to_universal copies them into its output)"));
    const auto dp = detail::ds_uint(detail::ds_get(&m0.value(), "dp_world_size"));
    const auto mp_given = detail::ds_uint(detail::ds_get(&m0.value(), "mp_world_size"));
    const std::uint64_t mp = mp_given ? *mp_given : 1;
    if (!dp || *dp == 0 || *dp > (1u << 20) || mp == 0 || mp > 100)
      m0.bad("dp_world_size / mp_world_size are not a DP world of 1 to 2^20 ranks and a TP world of 1 to 100");
    if (zero3 && mp > 1)
      m0.bad("a ZeRO-3 universal checkpoint of mp_world_size " + std::to_string(mp) +
             " is not read (ds_to_universal joins no ZeRO-3 TP ranks)");
    // the model states of the other TP ranks (ZeRO-1/2) or DP ranks (ZeRO-3)
    std::vector<const F*> models{&m0};
    for (std::uint64_t r = 1; r < (zero3 ? *dp : mp); ++r)
      models.push_back(&files.emplace_back(detail::open_ds_file(
          f, zero3 ? detail::ds_zero3_model_name(r, 0) : detail::ds_model_name(r),
          "the model states of " + std::string(zero3 ? "DP" : "TP") + " rank " + std::to_string(r) + " (" +
              (zero3 ? "dp_world_size " + std::to_string(*dp) : "mp_world_size " + std::to_string(mp)) + ")")));
    const D zero = f.sub(state_folder);
    const std::string zname(state_folder);
    const F& opt = files.emplace_back(detail::open_ds_file(zero, std::string(optimizer_file),
                                                           "the optimizer's state that ds_to_universal writes",
                                                           zname + "/" + std::string(optimizer_file)));
    const std::vector<detail::ds_group> groups = detail::ds_param_groups(m0);
    detail::ds_builder<R> b;
    std::set<std::string> params;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      for (const auto& [name, local] : groups[g]) {
        if (!is_plain_name(name))
          m0.bad("parameter '" + name + "' of param_shapes[" + std::to_string(g) + "] is not a name " + zname +
                 "/<param>/ can have (a plain folder name)");
        params.insert(name);
        const D pf = zero.sub(name);
        const std::string at = zname + "/" + name + "/";
        std::optional<shape_t> first;
        for (std::size_t k = 0; k < 3; ++k) {
          const std::string kind = detail::ds_kinds[k] + 1, key = "optimizer.state." + name + detail::ds_kinds[k];
          const F& sf = files.emplace_back(detail::open_ds_file(pf, kind + ".pt",
                                                                "parameter '" + name + "': its " + kind +
                                                                    " (ds_to_universal writes " + zname +
                                                                    "/<param>/{fp32,exp_avg,exp_avg_sq}.pt)",
                                                                at + kind + ".pt", true));
          const tensor_entry* e = sf.x.header.find("param");
          if (!e) e = sf.x.header.find("");
          if (!e)
            sf.bad("parameter '" + name + "': holds no 'param' tensor nor a tensor alone (a universal state file)");
          const std::uint64_t n = numel(local);
          if (e->shape.size() == 1 && local.size() != 1 && e->numel() == n && (zero3 || mp == 1)) {
            // the flat form (ZeRO-3): param_shapes' shape over the 1-D tensor
            if (first && *first != local) sf.bad(disagree(name, local, *first));
            first = local;
            b.piece(sf, key, e->type, local, 0, n, sf.x.header.offset_of(*e));
            if (k == 0) b.piece(sf, name, e->type, local, 0, n, sf.x.header.offset_of(*e));
            continue;
          }
          if (zero3 ? e->shape != local : e->shape.size() != local.size() || e->numel() == 0 || e->numel() > mp * n)
            sf.bad("parameter '" + name +
                   "': " + (e->name.empty() ? std::string("its tensor ") : "'" + e->name + "' ") + to_string(e->shape) +
                   " is not param_shapes[" + std::to_string(g) + "]'s " + to_string(local) +
                   (zero3 ? std::string(", whole or flat (") + std::to_string(n) + " elements)"
                          : " joined over mp_world_size " + std::to_string(mp) +
                                " (as many dimensions, at most mp_world_size times its elements; fewer where "
                                "vocabulary padding was cut)"));
          if (first && *first != e->shape) sf.bad(disagree(name, e->shape, *first));
          first = e->shape;
          b.whole(sf, key, *e);
          if (k == 0) b.whole(sf, name, *e);
        }
        if (!zero3 && pf.exists("step.pt")) {
          const F& sf = files.emplace_back(
              detail::open_ds_file(pf, "step.pt", "parameter '" + name + "': its step", at + "step.pt", true));
          const tensor_entry* e = sf.x.header.find("");
          if (!e || !e->shape.empty()) sf.bad("parameter '" + name + "': not a 0-d tensor alone (the step)");
          b.piece(sf, "optimizer.state." + name + ".step", e->type, {}, 0, 1, sf.x.header.offset_of(*e));
        }
      }
      if (zero3) detail::ds_step(b, opt, "optimizer_state_dict.state.", g, groups[g], "");
    }
    if (zero3) {
      detail::ds_zero3_untrained(b, models, params, "");
    } else {
      for (std::uint64_t t = 0; t < mp; ++t)
        detail::ds_module_tensors(b, *models[t], mp > 1 ? "tp" + std::to_string(t) + "/" : std::string(), params);
    }
    const std::string said =
        std::string("DeepSpeed universal checkpoint of ZeRO-") + (zero3 ? "3" : "1/2") + ", dp " + std::to_string(*dp) +
        ", TP " + std::to_string(mp) +
        ": each trainable parameter is presented as its fp32 master (float32) and its optimizer state, whole as " +
        zname + "/<param>/ holds them" + (mp > 1 ? " (TP ranks joined by ds_to_universal)" : "") +
        "; buffers and frozen parameters from the model states" + (mp > 1 ? ", per TP rank as tp{T}/<name>" : "");
    checkpoint_source<D> s = detail::ds_make_source(f, info, b, files);
    detail::ds_items(s, files.front(), opt, said);
    return s;
  }

 private:
  static std::string disagree(const std::string& name, const shape_t& here, const shape_t& fp32) {
    return "parameter '" + name + "': " + to_string(here) + " here, " + to_string(fp32) +
           " in its fp32.pt (its states disagree on shape)";
  }
};

}  // namespace shardsafe
