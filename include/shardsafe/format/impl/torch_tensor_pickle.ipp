// shardsafe/format/impl/torch_tensor_pickle.ipp - torch_tensor_pickle.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/format/torch_tensor_pickle.hpp"

namespace shardsafe {

SHARDSAFE_DECL torch_zip_tensor torch_tensor_of(const pickle_value& v, std::string_view what) {
  auto bad = [&](const std::string& rule) { fail(errc::invalid_metadata, std::string(what) + ": " + rule); };
  const auto* st = v.find(torch_tensor_key);
  if (!st) bad("does not hold one tensor (torch._utils._rebuild_tensor_v2)");
  auto uint = [&](const pickle_value& x, const char* field) {
    if (x.type() != pickle_value::kind::integer || x.as_int("") < 0)
      bad(std::string(field) + " is not a non-negative int");
    return static_cast<std::uint64_t>(x.as_int(""));
  };
  auto ints = [&](const pickle_value& x, const char* field) {
    if (x.type() != pickle_value::kind::tuple && x.type() != pickle_value::kind::list)
      bad(std::string(field) + " is not a tuple");
    std::vector<std::uint64_t> out;
    for (const auto& i : x.as_sequence("")) out.push_back(uint(i, field));
    return out;
  };
  torch_zip_tensor t;
  t.storage_key = st->at(torch_storage_key, what).as_string(what);
  const std::string& type = st->at("type", what).as_string(what);
  const auto st_type = torch_tensor_pickle_policy::storage_type_of(type);
  if (!st_type) bad("storage type '" + type + "' is not a torch storage class");
  t.type = *st_type;
  t.storage_numel = uint(st->at("numel", what), "storage numel");
  if (const auto* d = v.find("dtype")) {  // _rebuild_tensor_v3: the tensor's dtype over an untyped storage
    const std::string& dn = d->as_string(what);
    const auto dt = dn.starts_with("torch.") ? dcp_torch_dtype(std::string_view(dn).substr(6)) : std::nullopt;
    if (!dt) bad("dtype '" + dn + "' is not a torch dtype");
    if (!*dt) fail(errc::unsupported_dtype, std::string(what) + ": dtype " + dn + " is not supported");
    if (t.type) bad("_rebuild_tensor_v3 of a typed storage '" + type + "'");
    t.view_type = **dt;
  }
  t.storage_offset = uint(v.at("offset", what), "storage offset");
  t.size = ints(v.at("size", what), "size");
  t.stride = ints(v.at("stride", what), "stride");
  return t;
}

}  // namespace shardsafe
