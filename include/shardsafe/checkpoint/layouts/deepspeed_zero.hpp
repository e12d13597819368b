// shardsafe/checkpoint/layouts/deepspeed_zero.hpp - where DeepSpeed's ZeRO stages put each
// parameter's pieces (docs/layouts-notes/deepspeed.md §3, §4), as the deepspeed layout
// (layouts/deepspeed.hpp) presents them: the file names, ZeRO-1/2's flat group partitions
// (ds_zero12), ZeRO-3's per-parameter partitions (ds_zero3), and the non-tensor items (ds_items).
//
// ZeRO-1/2: a group's parameters, in param_shapes order, are one flat run of N elements padded at
// the end to P = a multiple of 2 x dp (nccl_start_alignment_factor 2), cut in dp parts of P / dp;
// rank d's fp32 master (single_partition_of_fp32_groups, its padding left out or not) and Adam's
// exp_avg / exp_avg_sq (base_optimizer_state.state[g]) hold part d. group_paddings,
// partition_count and param_slice_mappings, where the file has them, must say the same.
// ZeRO-3: each parameter of n elements is cut in dp pieces of ceil(n / dp) (the last padded);
// rank d's fp32_flat_groups[g] and optimizer_state_dict.state[g] hold its piece of each
// parameter of the group in param_shapes order, nothing else.
#pragma once

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/layouts/deepspeed_files.hpp"
#include "shardsafe/checkpoint/source.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/pickle_value.hpp"

namespace shardsafe {
namespace detail {

inline std::string ds_two_digits(std::uint64_t t) { return (t < 10 ? "0" : "") + std::to_string(t); }
/// mp_rank_MM_model_states.pt (ZeRO-1/2)
inline std::string ds_model_name(std::uint64_t tp) { return "mp_rank_" + ds_two_digits(tp) + "_model_states.pt"; }
/// zero_pp_rank_D_mp_rank_MM_model_states.pt (ZeRO-3)
inline std::string ds_zero3_model_name(std::uint64_t d, std::uint64_t tp) {
  return "zero_pp_rank_" + std::to_string(d) + "_mp_rank_" + ds_two_digits(tp) + "_model_states.pt";
}
/// zero_pp_rank_D_mp_rank_MM_optim_states.pt, after its prefix (bf16_, fp16_ or none)
inline std::string ds_optim_name(std::uint64_t d, std::uint64_t tp) {
  return "zero_pp_rank_" + std::to_string(d) + "_mp_rank_" + ds_two_digits(tp) + "_optim_states.pt";
}
/// Whether n is a model-states file's name (either form).
inline bool ds_is_model_states_name(std::string_view n) {
  return n.ends_with("_model_states.pt") && (n.starts_with("mp_rank_") || n.starts_with("zero_pp_rank_"));
}

/// The three flat tensors of group g in an optim file: fp32 master, exp_avg, exp_avg_sq.
template <class R>
std::vector<const tensor_entry*> ds_flats(const ds_file<R>& f, const std::string& fp32, const std::string& state,
                                          std::size_t g) {
  const std::string gs = std::to_string(g);
  return {&f.tensor(fp32 + gs, "the fp32 partition of group " + gs),
          &f.tensor(state + gs + ".exp_avg", "Adam's exp_avg of group " + gs),
          &f.tensor(state + gs + ".exp_avg_sq", "Adam's exp_avg_sq of group " + gs)};
}
inline constexpr const char* ds_kinds[] = {".fp32", ".exp_avg", ".exp_avg_sq"};

/// The group's step (a 0-d tensor of DP rank 0's file), presented for each of its parameters.
template <class R>
void ds_step(ds_builder<R>& b, const ds_file<R>& f, const std::string& state, std::size_t g, const ds_group& grp,
             const std::string& tp) {
  const tensor_entry* st = f.x.header.find(state + std::to_string(g) + ".step");
  if (!st || !st->shape.empty()) return;
  for (const auto& [name, shape] : grp)
    b.piece(f, tp + "optimizer.state." + name + ".step", st->type, {}, 0, 1, f.x.header.offset_of(*st));
}

/// The tensors of model file m's `module` (its state dict), each whole under tp + its name, but
/// those named in `skip`.
template <class R>
void ds_module_tensors(ds_builder<R>& b, const ds_file<R>& m, const std::string& tp,
                       const std::set<std::string>& skip) {
  const pickle_value* module = ds_get(&m.value(), "module");
  if (!module || module->type() != pickle_value::kind::dict) m.bad("'module' is not the module's state dict");
  for (std::size_t i = 0; i < module->dict_size(); ++i)
    if (module->dict_key(i).type() == pickle_value::kind::string && !skip.count(module->dict_key(i).as_string("")))
      if (const tensor_entry* e = m.x.header.find("module." + module->dict_key(i).as_string("")))
        b.whole(m, tp + module->dict_key(i).as_string(""), *e);
}

/// ZeRO-1/2 (DeepSpeedZeroOptimizer, BF16_Optimizer) of one TP rank: model file m, optim files
/// of its DP ranks. What was presented, in words.
template <class R>
std::string ds_zero12(ds_builder<R>& b, const ds_file<R>& m, const std::vector<const ds_file<R>*>& opt,
                      const std::string& tp) {
  ds_module_tensors(b, m, tp, {});
  const std::vector<ds_group> groups = ds_param_groups(m);
  const std::uint64_t dp = opt.size();
  const std::string fp32 = "optimizer_state_dict.single_partition_of_fp32_groups.",
                    state = "optimizer_state_dict.base_optimizer_state.state.";
  for (std::size_t g = 0; g < groups.size(); ++g) {
    std::uint64_t n = 0;
    for (const auto& [name, shape] : groups[g]) n += numel(shape);
    const std::uint64_t align = 2 * dp, part = (n + align - 1) / align * align / dp;
    const std::string gs = std::to_string(g);
    for (std::uint64_t d = 0; d < dp; ++d) {
      const ds_file<R>& f = *opt[d];
      const pickle_value* osd = ds_get(&f.value(), "optimizer_state_dict");
      if (ds_get(osd, "fp32_flat_groups"))
        f.bad("is a ZeRO-3 partition (fp32_flat_groups) beside ZeRO-1/2 model states");
      const std::uint64_t begin = d * part, pad = std::min(part, (d + 1) * part > n ? (d + 1) * part - n : 0);
      auto listed = [&](const char* key) -> const pickle_value* {
        const pickle_value* l = ds_get(osd, key);
        return l && l->type() == pickle_value::kind::list && g < l->as_sequence("").size() ? &l->as_sequence("")[g]
                                                                                           : nullptr;
      };
      if (const pickle_value* pc = listed("partition_count"); pc && ds_uint(pc) != dp)
        f.bad("partition_count[" + gs + "] is " + pickle_repr(*pc, 20) + ", but the folder holds " +
              std::to_string(dp) + " DP ranks' partitions (dp_world_size)");
      if (const pickle_value* gp = listed("group_paddings"); gp && ds_uint(gp) != pad)
        f.bad("group_paddings[" + gs + "] is " + pickle_repr(*gp, 20) + ", but param_shapes[" + gs + "] (" +
              std::to_string(n) + " elements, padded to a multiple of 2 x dp = " + std::to_string(align) + ") leaves " +
              std::to_string(pad) + " elements of padding in DP rank " + std::to_string(d) +
              "'s partition: the partitions disagree on padding");
      const auto flats = ds_flats(f, fp32, state, g);
      for (const tensor_entry* e : flats)
        if (e->shape.size() != 1 || (e->numel() != part && e->numel() != part - pad))
          f.bad("'" + e->name + "' " + to_string(e->shape) + " is not the " + std::to_string(part) + " elements (or " +
                std::to_string(part - pad) + " without padding) that param_shapes[" + gs + "] gives DP rank " +
                std::to_string(d) + " of " + std::to_string(dp) + ": the partitions disagree on sizes");
      const pickle_value* maps = listed("param_slice_mappings");
      std::size_t mapped = 0;
      std::uint64_t off = 0;
      for (const auto& [name, shape] : groups[g]) {
        const std::uint64_t pn = numel(shape), a = std::max(off, begin), e = std::min(off + pn, begin + part);
        off += pn;
        if (a >= e) continue;
        if (maps) {
          const pickle_value* fa = ds_get(maps, name);
          const auto mn = ds_uint(ds_get(fa, "numel")), ms = ds_uint(ds_get(fa, "start"));
          if (!fa || mn != e - a || ms != a - begin)
            f.bad("parameter '" + name + "': param_slice_mappings[" + gs + "] " +
                  (fa ? "says " + torch_value_repr(*fa, 120) : std::string("does not name it")) +
                  ", but param_shapes[" + gs + "] places its elements [" + std::to_string(a - (off - pn)) + ", " +
                  std::to_string(e - (off - pn)) + ") at [" + std::to_string(a - begin) + ", " +
                  std::to_string(e - begin) + ") of DP rank " + std::to_string(d) + "'s partition");
          ++mapped;
        }
        for (std::size_t k = 0; k < 3; ++k)
          b.piece(f, tp + "optimizer.state." + name + ds_kinds[k], flats[k]->type, shape, a - (off - pn), e - a,
                  ds_builder<R>::flat_at(f, *flats[k], a - begin, e - a, name, "a ZeRO-1/2 flat partition"));
      }
      if (maps && (maps->type() != pickle_value::kind::dict || maps->dict_size() != mapped))
        f.bad("param_slice_mappings[" + gs + "] names " +
              std::to_string(maps->type() == pickle_value::kind::dict ? maps->dict_size() : 0) +
              " parameters in DP rank " + std::to_string(d) + "'s partition, param_shapes[" + gs + "] places " +
              std::to_string(mapped) + " there");
      if (d == 0) ds_step(b, f, state, g, groups[g], tp);
    }
  }
  return "ZeRO-1/2, dp " + std::to_string(dp) + ": the module's tensors whole; optimizer state from " +
         std::to_string(dp) + " flat partitions per group";
}

/// ZeRO-3's tensors that are not trainable parameters (names not in `params`), of one TP rank's
/// DP model files: frozen parameters from each DP rank's ceil(numel / dp) piece
/// (frozen_param_fragments), buffers whole from DP rank 0's module.
template <class R>
void ds_zero3_untrained(ds_builder<R>& b, const std::vector<const ds_file<R>*>& models, std::set<std::string>& params,
                        const std::string& tp) {
  const ds_file<R>& m = *models[0];
  const std::uint64_t dp = models.size();
  // frozen parameters: each DP rank's model file holds its ceil(numel / dp) piece
  const pickle_value* frozen = ds_get(&m.value(), "frozen_param_shapes");
  if (frozen && frozen->type() == pickle_value::kind::dict)
    for (std::size_t i = 0; i < frozen->dict_size(); ++i) {
      const auto shape = ds_shape(frozen->dict_value(i));
      if (frozen->dict_key(i).type() != pickle_value::kind::string || !shape)
        m.bad("'frozen_param_shapes' entry " + std::to_string(i) + " is not a name and a torch.Size");
      const std::string name = frozen->dict_key(i).as_string("");
      params.insert(name);
      const std::uint64_t n = numel(*shape), part = (n + dp - 1) / dp;
      for (std::uint64_t d = 0; d < dp; ++d) {
        const ds_file<R>& f = *models[d];
        const tensor_entry& piece = f.tensor("frozen_param_fragments." + name, "frozen parameter '" + name + "'");
        const std::uint64_t a = std::min(n, d * part), e = std::min(n, (d + 1) * part);
        if (piece.numel() != part)
          f.bad("frozen parameter '" + name + "': its fragment " + to_string(piece.shape) + " is not the " +
                std::to_string(part) + " elements (ceil(" + std::to_string(n) + " / " + std::to_string(dp) +
                ")) of DP rank " + std::to_string(d) + ": the partitions disagree on sizes");
        if (a < e) b.piece(f, tp + name, piece.type, *shape, a, e - a, f.x.header.offset_of(piece));
      }
    }
  // buffers (and anything else the module holds that is not a partitioned parameter): whole
  ds_module_tensors(b, m, tp, params);
}

/// ZeRO-3 of one TP rank: its DP ranks' model files and optim files.
template <class R>
std::string ds_zero3(ds_builder<R>& b, const std::vector<const ds_file<R>*>& models,
                     const std::vector<const ds_file<R>*>& opt, const std::string& tp) {
  const ds_file<R>& m = *models[0];
  const std::vector<ds_group> groups = ds_param_groups(m);
  const std::uint64_t dp = opt.size();
  const std::string fp32 = "optimizer_state_dict.fp32_flat_groups.",
                    state = "optimizer_state_dict.optimizer_state_dict.state.";
  std::set<std::string> params;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    std::uint64_t total = 0;
    for (const auto& [name, shape] : groups[g]) total += (numel(shape) + dp - 1) / dp;
    const std::string gs = std::to_string(g);
    for (std::uint64_t d = 0; d < dp; ++d) {
      const ds_file<R>& f = *opt[d];
      const pickle_value* osd = ds_get(&f.value(), "optimizer_state_dict");
      if (ds_uint(ds_get(osd, "partition_count")) != dp)
        f.bad("partition_count is not " + std::to_string(dp) + ", the DP ranks whose partitions the folder holds");
      const auto flats = ds_flats(f, fp32, state, g);
      for (const tensor_entry* e : flats)
        if (e->shape.size() != 1 || e->numel() != total)
          f.bad("'" + e->name + "' " + to_string(e->shape) + " is not the " + std::to_string(total) +
                " elements param_shapes[" + gs + "] gives each DP rank (ceil(numel / " + std::to_string(dp) +
                ") per parameter): the partitions disagree on sizes");
      std::uint64_t local = 0;
      for (const auto& [name, shape] : groups[g]) {
        params.insert(name);
        const std::uint64_t n = numel(shape), part = (n + dp - 1) / dp, a = std::min(n, d * part),
                            e = std::min(n, (d + 1) * part);
        if (a < e)
          for (std::size_t k = 0; k < 3; ++k) {
            const std::uint64_t at = ds_builder<R>::flat_at(f, *flats[k], local, e - a, name, "a ZeRO-3 partition");
            b.piece(f, tp + "optimizer.state." + name + ds_kinds[k], flats[k]->type, shape, a, e - a, at);
            if (k == 0) b.piece(f, tp + name, flats[k]->type, shape, a, e - a, at);  // the model's weight: its master
          }
        local += part;
      }
      if (d == 0) ds_step(b, f, state, g, groups[g], tp);
    }
  }
  ds_zero3_untrained(b, models, params, tp);
  return "ZeRO-3, dp " + std::to_string(dp) +
         ": the files hold no low-precision weights; each trainable parameter is presented as its fp32 master "
         "(float32), frozen ones from their fragments, buffers whole";
}

/// The non-tensor items: the plain values of model file m (TP rank 0; the parameter shapes the
/// layout read aside), the optimizer param_groups of o (DP rank 0's partition, or a universal
/// checkpoint's zero/optimizer_state.pt) as optimizer.param_groups..., and
/// deepspeed.layout: `said`.
template <ReadableDirectory D, class R>
void ds_items(checkpoint_source<D>& s, const ds_file<R>& m, const ds_file<R>& o, const std::string& said) {
  auto add = [&](std::string key, const ds_file<R>& f, const torch_save_value& v) {
    if (v.unwritable.empty()) s.non_tensors.push_back({key, f.name, 0, 0, torch_save_value{key, v.value, {}}});
  };
  for (const auto& v : m.x.values)
    if (!v.name.starts_with("param_shapes.") && !v.name.starts_with("frozen_param_shapes.")) add(v.name, m, v);
  for (const std::string p : {"optimizer_state_dict.base_optimizer_state.param_groups.",
                              "optimizer_state_dict.optimizer_state_dict.param_groups.", "param_groups."})
    for (const auto& v : o.x.values)
      if (v.name.starts_with(p)) add("optimizer.param_groups." + v.name.substr(p.size()), o, v);
  add("deepspeed.layout", m, torch_save_value{"", pickle_value::string(said), {}});
  std::sort(s.non_tensors.begin(), s.non_tensors.end(), [](const auto& a, const auto& b) { return a.key < b.key; });
  s.non_tensors.erase(std::unique(s.non_tensors.begin(), s.non_tensors.end(),
                                  [](const auto& a, const auto& b) { return a.key == b.key; }),
                      s.non_tensors.end());
  // each group's params by name (the base optimizer lists its one flat tensor's index)
  std::vector<std::vector<std::string>> names;
  for (const ds_group& g : ds_param_groups(m)) {
    names.emplace_back();
    for (const auto& [n, shape] : g) names.back().push_back(n);
  }
  trainer_group_params(s, o.name, names);
}

}  // namespace detail
}  // namespace shardsafe
