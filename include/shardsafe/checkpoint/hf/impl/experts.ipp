// shardsafe/checkpoint/hf/impl/experts.ipp - experts.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/checkpoint/hf/experts.hpp"

namespace shardsafe {

SHARDSAFE_DECL unstacked_views unstack_experts(std::span<const flat_view> views, const expert_stacking& rules,
                                               std::string_view ctx) {
  unstacked_views out;
  for (std::size_t vi = 0; vi < views.size(); ++vi) {
    const flat_view& v = views[vi];
    const rename_rule* r = rules.empty() ? nullptr : rules.match(v.key);
    if (!r) {
      out.views.push_back(v);
      out.origin.push_back(vi);
      out.expert.push_back(0);
      continue;
    }
    v.validate(ctx);
    const std::string c = std::string(ctx) + ": tensor '" + v.key + "' (expert stacking rule '" + r->text + "')";
    if (v.full_shape.empty()) fail(errc::invalid_argument, c + ": a 0-d tensor has no expert dimension to split");
    ++out.stacked;
    const std::uint64_t E = v.full_shape[0];
    if (E > max_experts)
      fail(errc::invalid_argument,
           c + ": " + std::to_string(E) + " experts pass the limit of " + std::to_string(max_experts));
    const shape_t rest(v.full_shape.begin() + 1, v.full_shape.end());
    const std::uint64_t S = numel(rest), item = item_size(v.type);
    std::vector<bool> held(static_cast<std::size_t>(E), false);
    auto add = [&](std::uint64_t i, std::optional<shard_spec> spec, std::uint64_t local_first, std::uint64_t n) {
      if (spec && n == 0 && S != 0) return;  // holds nothing of this expert
      held[static_cast<std::size_t>(i)] = true;
      flat_view e;
      e.key = expert_stacking::expert_name(*r, v.key, i);
      e.type = v.type;
      e.full_shape = rest;
      e.spec = std::move(spec);
      e.data = v.data + local_first * item;
      e.nbytes = n * item;
      e.replica = v.replica;
      out.views.push_back(std::move(e));
      out.origin.push_back(vi);
      out.expert.push_back(i);
    };
    if (!v.spec) {
      for (std::uint64_t i = 0; i < E; ++i) add(i, std::nullopt, i * S, S);
    } else if (v.spec->is_block()) {
      const block_spec& b = v.spec->block();
      const shape_t lrest(b.local_shape().begin() + 1, b.local_shape().end());
      const shape_t orest(b.global_offset().begin() + 1, b.global_offset().end());
      const std::uint64_t per = numel(lrest);
      const std::uint64_t o0 = b.global_offset()[0], l0 = b.local_shape()[0];
      for (std::uint64_t k = 0; k < l0; ++k) add(o0 + k, shard_spec(block_spec(lrest, orest)), k * per, per);
    } else {
      for (std::uint64_t i = 0; i < E; ++i)
        if (auto part = detail::expert_part(v.spec->flat(), i, S)) {
          const std::uint64_t n = part->first.local_numel();
          add(i, shard_spec(std::move(part->first)), part->second, n);
        }
    }
    for (std::uint64_t i = 0; i < E; ++i)
      if (!held[static_cast<std::size_t>(i)]) out.elsewhere.push_back(expert_stacking::expert_name(*r, v.key, i));
  }
  std::sort(out.elsewhere.begin(), out.elsewhere.end());
  std::set<std::string_view> names;
  for (const auto& v : out.views)
    if (!names.insert(v.key).second)
      fail(errc::invalid_argument, std::string(ctx) + ": two views are named '" + v.key +
                                       "' once experts are unstacked; expert stacking rules must keep names distinct");
  return out;
}

}  // namespace shardsafe
