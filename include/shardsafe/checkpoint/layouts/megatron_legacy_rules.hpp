// shardsafe/checkpoint/layouts/megatron_legacy_rules.hpp - the rules the megatron_legacy layout
// (layouts/megatron_legacy.hpp; docs/FORMAT.md §7.1, docs/layouts-notes/megatron.md §3) reads
// Megatron-LM's legacy rank files by: the world its args give, the rank folders' names, the
// stages' layer numbers, Megatron's optimizer grouping, the distributed optimizer's buffer, and
// how TP pieces join (Megatron-Core's GPT rule set). Each refusal names the file and the rule.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/layouts/deepspeed_files.hpp"
#include "shardsafe/checkpoint/layouts/megatron_dist.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/format/torch_save.hpp"

namespace shardsafe {

/// How a tensor's TP pieces make the whole, by Megatron-Core's GPT (and Llama) layers.
enum class megatron_join { whole, rows, columns, swiglu, unknown };

/// The rule for module name n (gated: the MLP is SwiGLU, args.swiglu).
inline megatron_join megatron_join_rule(std::string_view n, bool gated) {
  auto ends = [&](std::string_view s) { return n.ends_with(s); };
  if (ends("word_embeddings.weight") || ends("output_layer.weight") || ends("linear_qkv.weight") ||
      ends("linear_qkv.bias"))
    return megatron_join::rows;
  if (ends("linear_fc1.weight") || ends("linear_fc1.bias")) return gated ? megatron_join::swiglu : megatron_join::rows;
  if (ends("linear_proj.weight") || ends("linear_fc2.weight")) return megatron_join::columns;
  if (ends("linear_proj.bias") || ends("linear_fc2.bias") || ends("position_embeddings.weight") ||
      n.find("norm") != std::string_view::npos || n.find(".router.") != std::string_view::npos)
    return megatron_join::whole;
  return megatron_join::unknown;
}

namespace detail {

struct megatron_legacy_rules {
  /// The element alignment of each parameter's start in the distributed optimizer's buffer.
  static constexpr std::uint64_t buffer_alignment = 64;

  /// mp_rank_TT[_PPP][_EEE], as Megatron's get_checkpoint_name makes it.
  static std::string rank_folder(std::uint64_t t, std::uint64_t p, std::uint64_t e, std::uint64_t pp,
                                 std::uint64_t ep) {
    auto digits = [](std::uint64_t v, std::size_t w) {
      std::string s = std::to_string(v);
      return std::string(s.size() < w ? w - s.size() : 0, '0') + s;
    };
    return "mp_rank_" + digits(t, 2) + (pp > 1 ? "_" + digits(p, 3) : "") + (ep > 1 ? "_" + digits(e, 3) : "");
  }

  struct world {
    std::uint64_t tp = 1, pp = 1, ep = 1;
    bool gated = false, distributed = false;
    std::optional<std::uint64_t> num_layers, expert_tp, padded_vocab, vocab;
    std::string said;
  };

  /// The parallel world the args of rank 0's file (folder `first`) describe.
  template <class F>
  static world world_of(const F& f0, const std::string& first) {
    const pickle_value* args = detail::ds_get(&f0.value(), "args");
    if (!args || torch_record_class(*args) != "argparse.Namespace")
      f0.bad("'args' is not the run's argparse.Namespace (Megatron-LM saves it: the TP, PP and EP sizes are in it)");
    auto size = [&](const char* k, bool required) -> std::optional<std::uint64_t> {
      const pickle_value* v = detail::ds_get(args, k);
      if (!v || v->is_none()) {
        if (required) f0.bad("args." + std::string(k) + " is missing: the model-parallel world is not known");
        return std::nullopt;
      }
      const auto n = detail::ds_uint(v);
      if (!n || *n == 0 || *n > (1u << 20))
        f0.bad("args." + std::string(k) + " is " + pickle_repr(*v, 40) + ", not a count from 1 to 2^20");
      return n;
    };
    auto flag = [&](const char* k) {
      const pickle_value* v = detail::ds_get(args, k);
      return v && v->type() == pickle_value::kind::boolean && v->as_bool("");
    };
    world w;
    w.tp = *size("tensor_model_parallel_size", true);
    w.pp = *size("pipeline_model_parallel_size", true);
    w.ep = size("expert_model_parallel_size", false).value_or(1);
    if (w.tp > 1024 || w.pp > 1024 || w.ep > 1024 || w.tp * w.pp * w.ep > (1u << 16))
      f0.bad("a model-parallel world of TP " + std::to_string(w.tp) + " x PP " + std::to_string(w.pp) + " x EP " +
             std::to_string(w.ep) + " is past the 2^16 rank files read");
    w.num_layers = size("num_layers", false);
    w.expert_tp = size("expert_tensor_parallel_size", false);
    w.padded_vocab = size("padded_vocab_size", false);
    w.vocab = size("vocab_size", false);
    w.gated = flag("swiglu");
    w.distributed = flag("use_distributed_optimizer");
    if (size("virtual_pipeline_model_parallel_size", false) || detail::ds_get(&f0.value(), "model0"))
      f0.bad("holds virtual pipeline stages (model0, model1, ...): not read yet");
    if (const pickle_value* v = detail::ds_get(&f0.value(), "checkpoint_version");
        v && v->type() == pickle_value::kind::real && v->as_real("") < 2.0)
      f0.bad("checkpoint_version " + pickle_repr(*v, 20) +
             " is before 2.0, whose QKV order differs (Megatron's fix_query_key_value_ordering): not read");
    const std::string expected = rank_folder(0, 0, 0, w.pp, w.ep);
    if (expected != first)
      f0.bad("its args say TP " + std::to_string(w.tp) + ", PP " + std::to_string(w.pp) + ", EP " +
             std::to_string(w.ep) + ", whose rank 0 folder is " + expected + ", not " + first);
    w.said = "TP " + std::to_string(w.tp) + " x PP " + std::to_string(w.pp) + " x EP " + std::to_string(w.ep);
    return w;
  }

  /// The names of file m's model tensors, in its state dict's order (TE's _extra_state left out).
  template <class F>
  static std::vector<std::string> model_names(const F& m) {
    const pickle_value* model = detail::ds_get(&m.value(), "model");
    if (!model || model->type() != pickle_value::kind::dict)
      m.bad("'model' is not the model's state dict (a legacy Megatron-LM checkpoint holds one)");
    std::vector<std::string> out;
    for (std::size_t i = 0; i < model->dict_size(); ++i) {
      if (model->dict_key(i).type() != pickle_value::kind::string) continue;
      const std::string n = model->dict_key(i).as_string("");
      if (!n.ends_with("._extra_state") && m.x.header.find("model." + n)) out.push_back(n);
    }
    return out;
  }

  /// How many distinct numbers follow `marker` ("decoder.layers.", ".local_experts.") in names,
  /// checked to be 0 .. count - 1.
  static std::uint64_t count_of(const std::vector<std::string>& names, std::string_view marker) {
    std::set<std::uint64_t> seen;
    for (const auto& n : names)
      if (const auto i = n.find(marker); i != std::string::npos) {
        const auto j = n.find('.', i + marker.size());
        const std::string num = n.substr(i + marker.size(), j == std::string::npos ? j : j - i - marker.size());
        if (!num.empty() && num.size() < 10 && num.find_first_not_of("0123456789") == std::string::npos)
          seen.insert(std::stoull(num));
      }
    return seen.empty() ? 0 : *seen.rbegin() + 1;
  }

  /// name with the number after `marker` raised by `by`.
  template <class F>
  static std::string renumber(const F& m, const std::string& name, std::string_view marker, std::uint64_t by) {
    const auto i = name.find(marker);
    if (i == std::string::npos) return name;
    const auto at = i + marker.size(), j = name.find('.', at);
    const std::string num = name.substr(at, j == std::string::npos ? j : j - at);
    if (num.empty() || num.size() >= 10 || num.find_first_not_of("0123456789") != std::string::npos)
      m.bad("tensor 'model." + name + "' has no number after '" + std::string(marker) + "'");
    return name.substr(0, at) + std::to_string(std::stoull(num) + by) + (j == std::string::npos ? "" : name.substr(j));
  }

  /// For each parameter of file m (global name, model entry) with optimizer state: its index in
  /// the optimizer's state, by Megatron's grouping rule (top of this file), and where its state
  /// and fp32 master lie in the file.
  struct indexed {
    std::string param;
    std::int64_t index;
    detail::megatron_group_kind group;  // its group's kind
    std::string state;                  // its state's tensors: <state>.exp_avg, ...
    std::string master;                 // its fp32 master's tensor, or "" (the parameter is its own)
    const tensor_entry* model;          // the parameter's model tensor
  };
  /// The optimizer of file m: the torch optimizer's state dict (FP32Optimizer), or Megatron's
  /// bf16/fp16 wrapper (Float16OptimizerWithFloat16Params): that state dict under 'optimizer',
  /// beside fp32_from_fp16_params, per group the fp32 masters of its bf16/fp16 parameters in the
  /// group's order. Where the torch optimizer's state dict lies: "optimizer." or
  /// "optimizer.optimizer.".
  template <class F>
  static std::string inner_optimizer(const F& m) {
    const pickle_value* opt = detail::ds_get(&m.value(), "optimizer");
    if (!opt || opt->type() != pickle_value::kind::dict) m.bad("'optimizer' is not the optimizer's state dict");
    const pickle_value* masters = detail::ds_get(opt, "fp32_from_fp16_params");
    const pickle_value* inner = detail::ds_get(opt, "optimizer");
    if (!masters && !inner) return "optimizer.";
    if (!masters || masters->type() != pickle_value::kind::list || !inner || inner->type() != pickle_value::kind::dict)
      m.bad("'optimizer' holds " + std::string(masters ? "fp32_from_fp16_params" : "an 'optimizer'") + " but no " +
            (masters ? "'optimizer' state dict" : "fp32_from_fp16_params list") +
            ": not Megatron's bf16/fp16 wrapper (Float16OptimizerWithFloat16Params); not read");
    return "optimizer.optimizer.";
  }
  template <class F>
  static std::vector<indexed> optimizer_indices(
      const F& m, const std::vector<std::pair<std::string, const tensor_entry*>>& params) {
    const std::string inner = inner_optimizer(m);
    const bool wrapped = inner != "optimizer.";
    const pickle_value* opt = detail::ds_get(&m.value(), "optimizer");
    if (wrapped) opt = detail::ds_get(opt, "optimizer");
    const pickle_value* groups = detail::ds_get(opt, "param_groups");
    if (!groups || groups->type() != pickle_value::kind::list) m.bad("'" + inner + "param_groups' is not a list");
    const pickle_value* masters =
        wrapped ? detail::ds_get(detail::ds_get(&m.value(), "optimizer"), "fp32_from_fp16_params") : nullptr;
    if (masters && masters->as_sequence("").size() != groups->as_sequence("").size())
      m.bad("'optimizer.fp32_from_fp16_params' has " + std::to_string(masters->as_sequence("").size()) + " groups, '" +
            inner + "param_groups' " + std::to_string(groups->as_sequence("").size()) +
            " (Float16OptimizerWithFloat16Params keeps one list of masters per group)");
    std::vector<indexed> out;
    std::set<detail::megatron_group_kind> kinds;
    const auto& gs = groups->as_sequence("");
    for (std::size_t g = 0; g < gs.size(); ++g) {
      const std::string where = inner + "param_groups." + std::to_string(g);
      const pickle_value *wd = detail::ds_get(&gs[g], "wd_mult"), *ps = detail::ds_get(&gs[g], "params");
      const auto kind = detail::megatron_group_kind_of(wd, detail::ds_get(&gs[g], "is_expert_parallel"));
      if (!kind || !ps || ps->type() != pickle_value::kind::list)
        m.bad("'" + where + "' has no wd_mult, is_expert_parallel and params (Megatron's param groups have them)");
      if (!kinds.insert(*kind).second)
        m.bad("'" + where + "' is a second group of wd_mult " + pickle_repr(*wd, 20) + ", is_expert_parallel " +
              (kind->expert ? "True" : "False") +
              ": custom parameter-group overrides, which the grouping rule does not name (not read)");
      std::vector<std::pair<std::string, const tensor_entry*>> members;
      for (const auto& [n, te] : params)
        if (detail::megatron_kind_of(n, te->shape.size()) == *kind) members.emplace_back(n, te);
      const auto& ids = ps->as_sequence("");
      if (ids.size() != members.size())
        m.bad("'" + where + "' lists " + std::to_string(ids.size()) + " parameters, but the model holds " +
              std::to_string(members.size()) + " of its kind (" + kind->said() +
              "): Megatron's grouping rule does not name them");
      // the wrapper's masters: one per bf16/fp16 parameter of the group, in the group's order
      const std::string mg = "optimizer.fp32_from_fp16_params." + std::to_string(g);
      std::size_t j = 0;
      for (std::size_t i = 0; i < ids.size(); ++i) {
        if (ids[i].type() != pickle_value::kind::integer || ids[i].as_int("") < 0)
          m.bad("'" + where + ".params." + std::to_string(i) + "' is not an optimizer index");
        const dtype t = members[i].second->type;
        const bool half = masters && (t == dtype::BF16 || t == dtype::F16);
        out.push_back({members[i].first, ids[i].as_int(""), *kind, inner + "state." + std::to_string(ids[i].as_int("")),
                       half ? mg + "." + std::to_string(j++) : std::string(), members[i].second});
      }
      if (masters) {
        const auto& mv = masters->as_sequence("")[g];
        const std::size_t have = mv.type() == pickle_value::kind::list ? mv.as_sequence("").size() : SIZE_MAX;
        if (have != j)
          m.bad("'" + mg + "' holds " + (have == SIZE_MAX ? std::string("no list") : std::to_string(have)) +
                " fp32 masters, but group " + std::to_string(g) + " has " + std::to_string(j) +
                " bf16/fp16 parameters (Float16OptimizerWithFloat16Params keeps one per such parameter)");
      }
    }
    return out;
  }

  struct buffer_range {
    std::string param;
    std::uint64_t offset;  // in elements
    const tensor_entry* flat;
    const char* kind;
    shape_t shape;  // the parameter's
  };
  /// distrib_optim.pt's buffer o cut into the parameters (global name, model entry) of its rank:
  /// reverse order, each start a multiple of buffer_alignment, the last ending at numel_unpadded.
  template <class F>
  static std::vector<buffer_range> buffer_ranges(
      const F& o, const std::vector<std::pair<std::string, const tensor_entry*>>& params) {
    const pickle_value* bc = detail::ds_get(&o.value(), "buckets_coalesced");
    if (!bc || bc->type() != pickle_value::kind::boolean || !bc->as_bool(""))
      o.bad("has no buckets_coalesced: True (the per-bucket lists of older Megatron-LM are not read)");
    // the one buffer: <gbuf>.<(param dtype, grad dtype)>.{param,exp_avg,exp_avg_sq,numel_unpadded}
    std::string prefix;
    for (const auto& te : o.x.header.tensors) {
      const auto dot = te.name.rfind('.');
      const std::string p = dot == std::string::npos ? std::string() : te.name.substr(0, dot);
      if (prefix.empty()) prefix = p;
      if (p != prefix || p.empty())
        o.bad("holds tensors '" + prefix + ".*' and '" + te.name +
              "': more than one buffer (expert or other dtypes) is not read yet");
    }
    const tensor_entry* flats[3];
    const char* names[3] = {"param", "exp_avg", "exp_avg_sq"};
    const char* kinds[3] = {".fp32", ".exp_avg", ".exp_avg_sq"};
    for (int k = 0; k < 3; ++k) flats[k] = &o.tensor(prefix + "." + names[k], "the buffer's " + std::string(names[k]));
    std::optional<std::uint64_t> unpadded;
    for (const auto& v : o.x.values)
      if (v.name == prefix + ".numel_unpadded") unpadded = detail::ds_uint(&v.value);
    if (!unpadded) o.bad("'" + prefix + ".numel_unpadded' is not a count");
    std::vector<buffer_range> out;
    std::uint64_t off = 0;
    for (auto it = params.rbegin(); it != params.rend(); ++it) {
      off = (off + buffer_alignment - 1) / buffer_alignment * buffer_alignment;
      for (int k = 0; k < 3; ++k) out.push_back({it->first, off, flats[k], kinds[k], it->second->shape});
      off += it->second->numel();
    }
    if (off != *unpadded)
      o.bad("the parameters, in reverse order with starts aligned to " + std::to_string(buffer_alignment) +
            " elements, end at " + std::to_string(off) + ", but numel_unpadded is " + std::to_string(*unpadded) +
            ": the buffer is laid out otherwise (more than one bucket, frozen parameters): not read");
    for (int k = 0; k < 3; ++k)
      if (flats[k]->shape.size() != 1 || flats[k]->numel() < off || flats[k]->type != flats[0]->type)
        o.bad("'" + flats[k]->name + "' " + to_string(flats[k]->shape) + " is not a 1-D buffer of at least " +
              std::to_string(off) + " elements of " + std::string(to_string(flats[0]->type)));
    return out;
  }

  /// Tensor `key`'s TP pieces v placed in its whole by `rule` (rows, columns, swiglu).
  template <class R, class P>
  static void join(detail::ds_builder<R>& b, const std::string& key, const std::vector<P>& v, megatron_join rule) {
    const std::size_t c = rule == megatron_join::columns ? 1 : 0;
    const P& p0 = v[0];
    shape_t g = p0.shape;
    if (g.size() <= c)
      p0.f->bad("tensor '" + key + "' " + to_string(g) + " has no dim " + std::to_string(c) + " to join on");
    g[c] = 0;
    for (const P& p : v) {
      bool same = p.shape.size() == p0.shape.size() && p.type == p0.type;
      for (std::size_t d = 0; same && d < p.shape.size(); ++d) same = d == c || p.shape[d] == p0.shape[d];
      if (!same || (rule == megatron_join::swiglu && p.shape[0] % 2))
        p.f->bad("tensor '" + key + "' " + to_string(p.shape) + " " + std::string(to_string(p.type)) +
                 " does not join with TP rank 0's " + to_string(p0.shape) + " on dim " + std::to_string(c) +
                 (rule == megatron_join::swiglu ? " as SwiGLU halves (an even count of rows)" : ""));
      if (p.e && !p.f->x.header.stored_order(*p.e).empty())
        p.f->bad("tensor '" + key + "' is stored transposed: its TP pieces are not joined");
      g[c] += p.shape[c];
    }
    std::uint64_t rest = 1;
    for (std::size_t d = c + 1; d < g.size(); ++d) rest *= g[d];
    // SwiGLU: each rank's [gate_t; up_t] joins as two halves, gate_t in the first half of the
    // rows and up_t in the second, both at the rank's offset in its half
    const bool halves = rule == megatron_join::swiglu;
    const std::uint64_t gblock = (halves ? g[0] / 2 : g[c]) * rest;
    std::uint64_t o = 0;  // rank t's offset on dim c (swiglu: in each half)
    for (const P& p : v) {
      const std::uint64_t local = halves ? p.shape[0] / 2 : p.shape[c];
      b.placed(*p.f, key, p.type, g, detail::ds_joined_ranges({{0, numel(p.shape)}}, local * rest, gblock, o * rest),
               p.e ? p.f->x.header.offset_of(*p.e) : p.at);
      o += local;
    }
  }
};

}  // namespace detail
}  // namespace shardsafe
