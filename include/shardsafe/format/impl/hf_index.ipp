// shardsafe/format/impl/hf_index.ipp - hf_index.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/format/hf_index.hpp"

namespace shardsafe {

SHARDSAFE_DECL hf_index parse_hf_index(std::string_view json, std::string_view file) {
  const std::string f(file);
  if (json.size() > max_hf_index_size)
    fail(errc::invalid_metadata, f + ": " + std::to_string(json.size()) + " bytes passes the " +
                                     std::to_string(max_hf_index_size) + " an index may hold");
  simdjson::dom::parser parser;
  auto root = detail::parse_json(parser, json, f);
  simdjson::dom::object top;
  if (root.get_object().get(top)) fail(errc::invalid_metadata, f + ": not a JSON object");
  hf_index idx;
  simdjson::dom::element md;
  if (!top["metadata"].get(md) && !md.is_null()) {
    simdjson::dom::object o;
    if (md.get_object().get(o)) fail(errc::invalid_metadata, f + ": \"metadata\" is not an object");
    for (auto kv : o) {
      if (kv.key == "total_size" || kv.key == "total_parameters") {
        // advisory, as for transformers (which never reads them): kept when a count, else left
        if (auto n = detail::as_count(kv.value)) (kv.key == "total_size" ? idx.total_size : idx.total_parameters) = *n;
      } else {
        std::string_view s;
        if (!kv.value.get_string().get(s)) idx.metadata[std::string(kv.key)] = std::string(s);
      }
    }
  }
  simdjson::dom::element wm;
  if (top["weight_map"].get(wm)) fail(errc::invalid_metadata, f + ": missing \"weight_map\"");
  simdjson::dom::object o;
  if (wm.get_object().get(o)) fail(errc::invalid_metadata, f + ": \"weight_map\" is not an object");
  for (auto kv : o) {
    const std::string name(kv.key);
    std::string_view target;
    if (kv.value.get_string().get(target))
      fail(errc::invalid_metadata, f + ": tensor '" + name + "': weight_map value is not a file name string");
    if (!is_plain_name(target))
      fail(errc::invalid_metadata, f + ": tensor '" + name + "': file '" + std::string(target) +
                                       "' is not a plain name in this folder (no '/', '\\' or '..')");
    if (!idx.weight_map.emplace(name, std::string(target)).second)
      fail(errc::invalid_metadata, f + ": tensor '" + name + "' is listed twice in weight_map");
  }
  detail::require_unique_keys(root, f);  // after the rule above: "metadata" or "weight_map" twice
  return idx;
}

SHARDSAFE_DECL std::string write_hf_index(const hf_index& idx) {
  std::string out = "{\n  \"metadata\": {";
  bool first = true;
  auto entry = [&](const std::string& k, const std::string& rendered) {
    out += first ? "\n" : ",\n";
    first = false;
    out += "    ";
    detail::append_json_string(out, k, /*ascii_only=*/true);
    out += ": " + rendered;
  };
  // sorted keys: total_size sorts among the others
  std::map<std::string, std::string> rendered;
  for (const auto& [k, v] : idx.metadata) {
    std::string s;
    detail::append_json_string(s, v, /*ascii_only=*/true);
    rendered[k] = s;
  }
  if (idx.total_size) rendered["total_size"] = std::to_string(*idx.total_size);
  if (idx.total_parameters) rendered["total_parameters"] = std::to_string(*idx.total_parameters);
  for (const auto& [k, v] : rendered) entry(k, v);
  out += first ? "}" : "\n  }";
  out += ",\n  \"weight_map\": {";
  first = true;
  for (const auto& [k, v] : idx.weight_map) {
    std::string s;
    detail::append_json_string(s, v, /*ascii_only=*/true);
    out += first ? "\n" : ",\n";
    first = false;
    out += "    ";
    detail::append_json_string(out, k, /*ascii_only=*/true);
    out += ": " + s;
  }
  out += first ? "}" : "\n  }";
  out += "\n}\n";
  return out;
}

}  // namespace shardsafe
