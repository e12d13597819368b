// shardsafe/checkpoint/hf/impl/export.ipp - export.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/checkpoint/hf/export.hpp"

namespace shardsafe {

SHARDSAFE_DECL hf_export_layout plan_hf_export_layout(const std::vector<hf_export_input>& inputs,
                                                      const hf_export_options& opt, std::string_view out) {
  if (opt.convert_to && !is_convertible_float(*opt.convert_to))
    fail(errc::invalid_argument, std::string(out) + ": export dtype " + std::string(to_string(*opt.convert_to)) +
                                     " is not one tensors convert to (F16, BF16, F32 or F64)");
  std::vector<std::string> names;
  std::map<std::string, std::size_t> by_name;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    names.push_back(inputs[i].name);
    by_name.emplace(inputs[i].name, i);
  }
  const auto renamed = rename_keys(names, opt.rename, std::string(out) + ": rename");
  std::vector<hf_tensor_info> infos;
  for (const auto& [to, from] : renamed) {
    const hf_export_input& in = inputs[by_name.at(from)];
    const dtype t = opt.convert_to && is_convertible_float(in.type) ? *opt.convert_to : in.type;
    infos.push_back({to, t, in.shape});
  }
  hf_export_layout l;
  l.plan = plan_hf_export(std::move(infos), opt.max_shard_size);
  for (const auto& t : l.plan.tensors) l.source.push_back(by_name.at(renamed.at(t.name)));
  for (const auto& f : l.plan.files) {
    std::vector<tensor_entry> entries;
    for (std::size_t t : f.tensors)
      entries.push_back({l.plan.tensors[t].name, l.plan.tensors[t].type, l.plan.tensors[t].shape, 0, 0});
    l.files.push_back(plan_safetensors(std::move(entries), opt.file_metadata, std::string(out) + "/" + f.name));
    l.bytes += l.files.back().file_size();
  }
  return l;
}

}  // namespace shardsafe
