// shardsafe/checkpoint/layouts/megatron_legacy.hpp - Megatron-LM's legacy `torch` checkpoints
// (--ckpt-format torch; docs/FORMAT.md §7, docs/layouts-notes/megatron.md §3): a folder whose
// `latest_checkpointed_iteration.txt` names the iteration (iter_NNNNNNN/ or release/), or that
// folder itself, holding one folder per model-parallel rank written by its DP rank 0
//
//   mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt   torch.save: args, model (this rank's pieces, local
//                                               layer and expert numbers), optimizer, rng_state
//   mp_rank_TT[_PPP][_EEE]/distrib_optim.pt     the distributed optimizer's DP-gathered buffer
//
// TT the tensor-parallel rank, PPP the pipeline stage (with PP > 1), EEE the expert-parallel rank
// (with EP > 1); the TP, PP and EP sizes are the args' (tensor_model_parallel_size, ...).
//
// Presented (the model's own names, the pieces joined into whole tensors):
//   <name>                        a tensor of the model: decoder.layers.<L>.<rest> with L the
//                                 global layer (the stage's local number + the layers of the
//                                 stages before it), decoder.layers.<L>.mlp.experts.local_experts.<X>.<rest>
//                                 with X the global expert (EP rank x local experts + local), the
//                                 TP pieces joined by Megatron-Core's GPT rule set (megatron_join):
//                                 vocabulary (embeddings, output layer: padded rows kept) and column
//                                 parallel (linear_qkv, query-group-major, left fused) on dim 0,
//                                 SwiGLU linear_fc1 as [gate; up] from each rank's halves, row
//                                 parallel (linear_proj, linear_fc2) on dim 1, norms, position
//                                 embeddings, row-parallel biases and routers from TP rank 0; a
//                                 tensor the rule set does not name, with TP > 1, per TP rank as
//                                 tp{T}/<name>
//   optimizer.state.<name>.exp_avg / .exp_avg_sq / .step   Adam's state, joined as its parameter;
//                                 its index in the optimizer named by Megatron's grouping rule
//                                 (wd_mult 0 for biases and 1-D tensors, is_expert_parallel for
//                                 experts; named_parameters order within a group)
//   optimizer.state.<name>.fp32   with Megatron's bf16/fp16 wrapper (Float16OptimizerWithFloat16Params:
//                                 the torch optimizer's state under optimizer.optimizer), the fp32
//                                 master of each bf16/fp16 parameter from fp32_from_fp16_params
//                                 (per group, its bf16/fp16 parameters in order); its groups are
//                                 optimizer.optimizer.param_groups
//   optimizer.state.<name>.fp32 / .exp_avg / .exp_avg_sq   with the distributed optimizer, from
//                                 distrib_optim.pt: the parameters in reverse order, each start a
//                                 multiple of 64 elements, the last ending at numel_unpadded; its
//                                 groups (optimizer.optimizer.param_groups, a step each) get
//                                 params named by the same grouping rule
//   non-tensor items              the plain values of TP, PP and EP rank 0's file (checkpoint_version,
//                                 iteration, optimizer.param_groups...), megatron.layout
//
// Refused (naming the file, the tensor and the rule): a missing rank file, args that are not a
// TP x PP x EP world or disagree with the folder names, virtual pipeline stages (model0, model1:
// not read yet), checkpoint_version < 2 (another QKV order), pieces whose shapes the rule does not
// join, optimizer groups the grouping rule cannot name, a bf16/fp16 wrapper whose masters do not
// match its groups' bf16/fp16 parameters, a distributed optimizer buffer of another layout (more
// than one buffer or dtype, a length other than the parameters'), globals outside the torch.save
// allowlist and megatron_records. A legacy folder that cannot be listed (HTTP) is read from the
// folder holding latest_checkpointed_iteration.txt.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/layouts/deepspeed_files.hpp"
#include "shardsafe/checkpoint/layouts/layout.hpp"
#include "shardsafe/checkpoint/layouts/megatron_dist.hpp"
#include "shardsafe/checkpoint/layouts/megatron_legacy_rules.hpp"
#include "shardsafe/checkpoint/layouts/single_file.hpp"
#include "shardsafe/checkpoint/source.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/format/torch_save.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

struct megatron_legacy_layout : torch_save_values, private detail::megatron_legacy_rules {
  static constexpr layout_info info{.id = "megatron_legacy",
                                    .name = "Megatron-LM legacy (torch) checkpoint",
                                    .commit_mark = "",
                                    .permuted_files = true,
                                    .trainer_state = true};
  static constexpr std::string_view model_file = "model_optim_rng.pt", optim_file = "distrib_optim.pt";

  template <ReadableDirectory D>
  static bool recognise(const D& dir, folder_listing<D>& ls) {
    if (ls.has(megatron_dist_layout::tracker_file)) {
      try {
        const D it = dir.sub(megatron_dist_layout::iteration_name(dir));
        return !it.exists(megatron_dist_layout::config_file) && first_rank(it).has_value();
      } catch (const error&) {
        return false;  // megatron_dist says what is wrong with it
      }
    }
    // a folder with metadata.json (Megatron-Core's, shardsafe's) or .metadata (torch DCP's) is not
    // one: asked first, so that a sharded checkpoint of many files is not listed by every rank
    return !ls.has(megatron_dist_layout::config_file) && !ls.has(dcp_metadata_file_name) && ls.listed() &&
           (ls.has("mp_rank_00") || ls.has("mp_rank_00_000"));
  }

  template <ReadableDirectory D>
  static std::optional<checkpoint_source<D>> open(const D& dir, folder_listing<D>& ls) {
    return open_pointed<megatron_legacy_layout>(dir, ls, megatron_dist_layout::tracker_file, [](const D& d) {
      return d.sub(megatron_dist_layout::iteration_name(d));
    });
  }

  /// The description of iteration folder f: every rank's files read and indexed (their pickles,
  /// no tensor data) and the pieces joined.
  template <ReadableDirectory D>
  static checkpoint_source<D> describe(const D& f) {
    using R = typename D::reader_type;
    using F = detail::ds_file<R>;
    const auto first = first_rank(f);
    if (!first)
      fail(errc::not_found, std::string(f.name()) + ": holds no mp_rank_00[_000[_000]]/" + std::string(model_file) +
                                " (a Megatron-LM legacy checkpoint has one per model-parallel rank)");
    std::deque<F> files;  // references into it stay valid as it grows
    auto open_rank = [&](const std::string& folder, std::string_view file, const std::string& why) -> const F& {
      return files.emplace_back(detail::open_ds_file(f.sub(folder), std::string(file), why,
                                                     folder + "/" + std::string(file), false, megatron_records));
    };
    const F& f0 = open_rank(*first, model_file, "TP, PP and EP rank 0's model");
    const world w = world_of(f0, *first);

    // every rank's file; the stages' layer offsets and the EP ranks' local expert counts
    std::map<std::tuple<std::uint64_t, std::uint64_t, std::uint64_t>, const F*> rank;
    std::map<const F*, std::vector<std::string>> names_of;  // each file's model tensors (model_names)
    for (std::uint64_t p = 0; p < w.pp; ++p)
      for (std::uint64_t e = 0; e < w.ep; ++e)
        for (std::uint64_t t = 0; t < w.tp; ++t) {
          const std::string folder = rank_folder(t, p, e, w.pp, w.ep);
          rank[{t, p, e}] = folder == *first ? &f0
                                             : &open_rank(folder, model_file,
                                                          "the model of TP rank " + std::to_string(t) + ", stage " +
                                                              std::to_string(p) + ", EP rank " + std::to_string(e) +
                                                              " (" + w.said + ")");
          names_of[rank[{t, p, e}]] = model_names(*rank[{t, p, e}]);
        }
    std::vector<std::uint64_t> layer_offset(w.pp, 0);
    std::uint64_t layers = 0;
    for (std::uint64_t p = 0; p < w.pp; ++p) {
      layer_offset[p] = layers;
      layers += count_of(names_of[rank[{0, p, 0}]], "decoder.layers.");
    }
    if (w.num_layers && layers != *w.num_layers)
      f0.bad("args.num_layers is " + std::to_string(*w.num_layers) + ", but the " + std::to_string(w.pp) +
             " stages' files hold " + std::to_string(layers) + " layers");
    std::vector<std::uint64_t> experts(w.ep, 0);
    for (std::uint64_t e = 0; e < w.ep; ++e) {
      experts[e] = count_of(names_of[rank[{0, 0, e}]], ".local_experts.");
      if (e > 0 && experts[e] != experts[0])
        rank[{0, 0, e}]->bad("holds " + std::to_string(experts[e]) + " local experts, EP rank 0's file " +
                             std::to_string(experts[0]) + ": the EP ranks disagree");
    }
    if (w.tp > 1 && experts[0] && w.expert_tp && *w.expert_tp != w.tp)
      f0.bad("expert_tensor_parallel_size " + std::to_string(*w.expert_tp) +
             " differs from tensor_model_parallel_size " + std::to_string(w.tp) +
             ": expert tensor parallelism of its own is not read yet");

    // the pieces of each presented tensor, per TP rank
    struct piece {
      const F* f = nullptr;
      const tensor_entry* e = nullptr;  // the tensor in the file, or (a buffer's range) nullptr
      std::uint64_t at = 0;             // its first byte (a buffer's range)
      shape_t shape;
      dtype type{};
    };
    std::map<std::string, std::vector<piece>> pieces;  // name -> one per TP rank
    std::map<std::string, std::string> from;           // name -> the folder of its stage and EP rank
    auto add = [&](const std::string& key, std::uint64_t t, piece pc, const std::string& folder) {
      auto& v = pieces[key];
      if (v.empty()) {
        v.resize(w.tp);
        from[key] = folder;
      } else if (t == 0 && v[0].f) {
        pc.f->bad("tensor '" + key + "' is also in " + from[key] + ": two stages or EP ranks hold it");
      }
      v[t] = std::move(pc);
    };
    detail::ds_builder<R> b;
    std::size_t states = 0, masters = 0;
    // the parameters of each kind of optimizer group (no weight decay, expert), by global name,
    // and the kinds in the order of TP, PP and EP rank 0's groups
    std::map<detail::megatron_group_kind, std::vector<std::string>> group_names;
    std::vector<detail::megatron_group_kind> group_order;
    // with the distributed optimizer, whose groups keep no params: each parameter and its kind
    std::vector<std::pair<std::string, detail::megatron_group_kind>> kinds_of;
    for (std::uint64_t p = 0; p < w.pp; ++p)
      for (std::uint64_t e = 0; e < w.ep; ++e)
        for (std::uint64_t t = 0; t < w.tp; ++t) {
          const F& m = *rank[{t, p, e}];
          const std::string folder = rank_folder(t, p, e, w.pp, w.ep);
          auto global = [&](const std::string& local) {
            std::string g = renumber(m, local, "decoder.layers.", layer_offset[p]);
            return renumber(m, g, ".local_experts.", e * experts[0]);
          };
          std::vector<std::pair<std::string, const tensor_entry*>> params;  // (global name, model entry)
          for (const auto& n : names_of[&m])
            params.emplace_back(global(n), &m.tensor("model." + n, "the model's tensor"));
          for (const auto& [g, te] : params) {
            if (e > 0 && g.find(".local_experts.") == std::string::npos)
              continue;  // the same on every EP rank: EP rank 0's
            add(g, t, piece{&m, te, 0, te->shape, te->type}, folder);
          }
          // the optimizer's state of each parameter
          auto state = [&](const std::string& g, const char* kind, piece pc) {
            if (e > 0 && g.find(".local_experts.") == std::string::npos) return;
            add("optimizer.state." + g + kind, t, std::move(pc), folder);
          };
          if (w.distributed) {
            const F& o = open_rank(folder, optim_file,
                                   "the distributed optimizer's state of " + folder + " (use_distributed_optimizer)");
            for (const auto& r : buffer_ranges(o, params))
              state(r.param, r.kind,
                    piece{&o, nullptr, o.x.header.offset_of(*r.flat) + r.offset * item_size(r.flat->type), r.shape,
                          r.flat->type});
            // its groups keep no params: named by the grouping rule below, each parameter by its kind
            if (t == 0)
              for (const auto& [g, te] : params)
                if (e == 0 || g.find(".local_experts.") != std::string::npos)
                  kinds_of.emplace_back(g, detail::megatron_kind_of(g, te->shape.size()));
          } else {
            for (const auto& [g, index, group, at, master, model] : optimizer_indices(m, params)) {
              if (t == 0 && (e == 0 || g.find(".local_experts.") != std::string::npos)) {
                auto& names = group_names[group];
                if (names.empty() && p == 0 && e == 0) group_order.push_back(group);
                names.push_back(g);
              }
              for (const char* kind : {".exp_avg", ".exp_avg_sq", ".step"}) {
                const tensor_entry& te = m.tensor(at + kind, "the state of parameter '" + g + "' (optimizer index " +
                                                                 std::to_string(index) + ", Megatron's grouping rule)");
                state(g, kind, piece{&m, &te, 0, te.shape, te.type});
                if (t == 0 && std::string_view(kind) == ".step") ++states;
              }
              if (master.empty()) continue;
              // the bf16/fp16 wrapper's fp32 master: the model tensor's shape, in F32
              const tensor_entry& te = m.tensor(master, "the fp32 master of parameter '" + g + "'");
              if (te.type != dtype::F32 || te.shape != model->shape)
                m.bad("tensor '" + master + "' " + to_string(te.shape) + " " + std::string(to_string(te.type)) +
                      " is not the F32 master of parameter '" + g + "' " + to_string(model->shape) +
                      " (fp32_from_fp16_params: one per bf16/fp16 parameter of the group, in its order)");
              state(g, ".fp32", piece{&m, &te, 0, te.shape, te.type});
              if (t == 0) ++masters;
            }
          }
        }

    // joined
    std::size_t per_tp = 0;
    for (auto& [key, v] : pieces) {
      for (std::uint64_t t = 1; t < w.tp && !v[0].f; ++t)
        if (v[t].f)
          v[t].f->bad("tensor '" + key + "' is in TP rank " + std::to_string(t) + "'s file but not in TP rank 0's");
      const std::string param = key.starts_with("optimizer.state.") ? key.substr(16, key.rfind('.') - 16) : key;
      const bool step = key.ends_with(".step");
      const megatron_join rule = w.tp == 1 || step ? megatron_join::whole : megatron_join_rule(param, w.gated);
      auto whole = [&](const piece& pc, const std::string& as) {
        if (pc.e)
          b.whole(*pc.f, as, *pc.e);
        else
          b.piece(*pc.f, as, pc.type, pc.shape, 0, numel(pc.shape), pc.at);
      };
      for (std::uint64_t t = 0; t < w.tp; ++t)
        if (!v[t].f)
          v[0].f->bad("tensor '" + key + "' is in TP rank 0's file but not in TP rank " + std::to_string(t) + "'s");
      if (rule == megatron_join::unknown) {
        ++per_tp;
        for (std::uint64_t t = 0; t < w.tp; ++t) whole(v[t], "tp" + std::to_string(t) + "/" + key);
        continue;
      }
      for (std::uint64_t t = 1; t < w.tp && rule == megatron_join::whole; ++t)
        if (v[t].shape != v[0].shape || v[t].type != v[0].type)
          v[t].f->bad("tensor '" + key + "' " + to_string(v[t].shape) + " " + std::string(to_string(v[t].type)) +
                      " here, " + to_string(v[0].shape) +
                      " in TP rank 0's file: it is replicated by its rule "
                      "(norms, position embeddings, row-parallel biases, routers), the TP ranks must agree");
      if (rule == megatron_join::whole) {
        whole(v[0], key);
        continue;
      }
      join(b, key, v, rule);
    }

    const std::string said =
        "Megatron-LM legacy (torch) checkpoint, " + w.said +
        ": the model under its module names, layers numbered "
        "globally" +
        (experts[0] ? std::string(" and experts as EP rank x ") + std::to_string(experts[0]) + " + local" : "") +
        "; TP pieces joined by Megatron-Core's GPT rule set (vocabulary and column parallel on dim 0, " +
        (w.gated ? "SwiGLU linear_fc1 as [gate; up], " : "") +
        "row parallel on dim 1, the rest replicated from TP rank 0); linear_qkv left fused (query-group-major "
        "[q; k; v] per group), vocabulary padding rows kept" +
        (w.padded_vocab ? " (padded_vocab_size " + std::to_string(*w.padded_vocab) +
                              (w.vocab ? ", vocab_size " + std::to_string(*w.vocab) : std::string()) + ")"
                        : std::string()) +
        (per_tp ? "; " + std::to_string(per_tp) + " tensors the rule set does not name per TP rank as tp{T}/<name>"
                : std::string()) +
        (w.distributed ? "; the distributed optimizer's state (fp32 master, exp_avg, exp_avg_sq) from distrib_optim.pt "
                         "per parameter (reverse order, starts aligned to 64 elements); its step per param group"
                       : "; Adam's state of " + std::to_string(states) + " parameters by Megatron's grouping rule" +
                             (masters ? " (the bf16/fp16 wrapper's: fp32 masters of " + std::to_string(masters) +
                                            " parameters from fp32_from_fp16_params)"
                                      : std::string())) +
        "; non-tensor items from " + *first + "/" + std::string(model_file);
    checkpoint_source<D> s = detail::ds_make_source(f, info, b, files);
    for (const auto& v : f0.x.values)
      if (v.unwritable.empty() && !v.name.starts_with("model.") && !v.name.starts_with("optimizer.state.") &&
          !v.name.starts_with("rng_state.") && v.name != "rng_state" && !v.name.starts_with("args"))
        s.non_tensors.push_back({v.name, f0.name, 0, 0, torch_save_value{v.name, v.value, {}}});
    s.non_tensors.push_back({"megatron.layout", f0.name, 0, 0, torch_save_value{"", pickle_value::string(said), {}}});
    // each group's params by name, the items sorted (the distributed optimizer's groups, which
    // keep none, as optimizer.optimizer.param_groups.<g>.params by the grouping rule, where it
    // tells them apart; else none, the items sorted all the same)
    if (w.distributed) {
      const pickle_value* gs =
          detail::ds_get(detail::ds_get(detail::ds_get(&f0.value(), "optimizer"), "optimizer"), "param_groups");
      std::vector<std::optional<detail::megatron_group_kind>> kinds;
      if (gs && gs->type() == pickle_value::kind::list)
        for (const auto& grp : gs->as_sequence(""))
          kinds.push_back(detail::megatron_group_kind_of(detail::ds_get(&grp, "wd_mult"),
                                                         detail::ds_get(&grp, "is_expert_parallel")));
      detail::trainer_group_params(s, f0.name, detail::megatron_name_groups(kinds, kinds_of).names,
                                   "optimizer.optimizer.param_groups.");
      return s;
    }
    std::vector<std::vector<std::string>> names;
    for (const auto& k : group_order) names.push_back(group_names[k]);
    detail::trainer_group_params(s, f0.name, names, inner_optimizer(f0) + "param_groups.");
    return s;
  }

 private:
  /// The folder of TP, PP and EP rank 0 (its name depends on PP and EP), or nullopt.
  template <ReadableDirectory D>
  static std::optional<std::string> first_rank(const D& f) {
    for (const char* n : {"mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"})
      if (f.sub(n).exists(model_file)) return std::string(n);
    return std::nullopt;
  }
};

}  // namespace shardsafe
