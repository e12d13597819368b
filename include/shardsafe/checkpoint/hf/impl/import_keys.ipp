// shardsafe/checkpoint/hf/impl/import_keys.ipp - import_keys.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/checkpoint/hf/import_keys.hpp"

namespace shardsafe {

SHARDSAFE_DECL hf_key_mapping map_hf_keys(std::span<const flat_view> views, std::span<const hf_tensor_info> table,
                                          const hf_key_options& opt, std::string_view ctx) {
  hf_key_mapping m;
  struct fed {
    std::size_t tensor;
    std::string rule;
  };
  std::map<std::string, fed, std::less<>> by_model_name;
  for (std::size_t t = 0; t < table.size(); ++t) {
    const std::string& fk = table[t].name;
    std::string rule;
    std::string mk = fk;
    for (const auto& r : opt.rename.rules())
      if (r.matches(fk)) {
        mk = r.replace_all(fk);
        rule = "rename rule '" + r.text + "'";
        break;
      }
    if (mk.empty()) {
      m.dropped_keys.push_back(fk);
      continue;
    }
    auto [it, fresh] = by_model_name.emplace(mk, fed{t, rule});
    if (!fresh)
      fail(errc::invalid_argument, std::string(ctx) + ": tensors '" + table[it->second.tensor].name + "' and '" + fk +
                                       "' are both renamed to '" + mk + "' (" +
                                       (rule.empty() ? it->second.rule : rule) +
                                       "); rename rules must keep names distinct");
  }
  auto feed = [&](const std::string& key) -> const fed* {
    if (auto it = by_model_name.find(key); it != by_model_name.end()) return &it->second;
    if (opt.lora_base_layer && has_base_layer(key))
      if (auto it = by_model_name.find(strip_base_layer(key)); it != by_model_name.end()) return &it->second;
    return nullptr;
  };

  std::vector<bool> used(table.size(), false);
  std::vector<bool> grouped(views.size(), false);
  std::multimap<const std::byte*, std::size_t> by_data;  // for tie lookup
  for (std::size_t i = 0; i < views.size(); ++i) by_data.emplace(views[i].data, i);
  for (std::size_t i = 0; i < views.size(); ++i) {
    if (grouped[i]) continue;
    std::vector<std::size_t> group{i};  // i and the later views tied to it
    auto [lo, hi] = by_data.equal_range(views[i].data);
    for (auto it = lo; it != hi; ++it)
      if (it->second > i && !grouped[it->second] && detail::same_memory(views[i], views[it->second]))
        group.push_back(it->second);
    std::sort(group.begin(), group.end());
    std::optional<hf_import_entry> leader;
    for (std::size_t v : group) {
      grouped[v] = true;
      const fed* f = feed(views[v].key);
      if (!f) continue;
      used[f->tensor] = true;
      if (leader) continue;
      std::string how = f->rule;
      if (by_model_name.find(views[v].key) == by_model_name.end())
        how += std::string(how.empty() ? "" : ", ") + "LoRA base layer";
      leader = hf_import_entry{v, f->tensor, std::move(how)};
    }
    if (leader) {
      m.loads.push_back(std::move(*leader));
      m.loaded_views += group.size();
      m.tied_views += group.size() - 1;
    } else {
      for (std::size_t v : group) m.missing_keys.push_back(views[v].key);
    }
  }
  for (std::size_t t = 0; t < table.size(); ++t)
    if (!used[t] && std::find(m.dropped_keys.begin(), m.dropped_keys.end(), table[t].name) == m.dropped_keys.end())
      m.unexpected_keys.push_back(table[t].name);
  std::sort(m.missing_keys.begin(), m.missing_keys.end());
  std::sort(m.unexpected_keys.begin(), m.unexpected_keys.end());
  std::sort(m.dropped_keys.begin(), m.dropped_keys.end());
  if (opt.strict) {
    std::vector<std::string> strict_missing;
    for (const auto& k : m.missing_keys)
      if (!is_lora_adapter_name(k)) strict_missing.push_back(k);
    if (!strict_missing.empty())
      fail(errc::not_found,
           std::string(ctx) + ": strict import: " + std::to_string(strict_missing.size()) +
               " model tensor(s) fed by no tensor of the checkpoint (LoRA adapter weights excepted): " +
               key_examples(strict_missing, opt.examples));
  }
  return m;
}

}  // namespace shardsafe
