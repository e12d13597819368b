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

SHARDSAFE_DECL std::string torch_value_repr(const pickle_value& v, std::size_t max_chars) {
  using k = pickle_value::kind;
  // a str as repr() quotes it, bounded (a key or class name is the pickle's own text)
  auto quoted = [](const pickle_value& s) { return pickle_repr(s, 80); };
  auto bare = [&](const pickle_value& s) {
    const std::string q = quoted(s);
    return s.type() == k::string && q.size() >= 2 && q.back() == q.front() ? q.substr(1, q.size() - 2) : q;
  };
  auto storage = [&](const pickle_value& d) -> std::string {
    const pickle_value* key = d.find(torch_storage_key);
    const pickle_value* type = d.find("type");
    const pickle_value* numel = d.find("numel");
    return (type ? bare(*type) : std::string("torch storage")) + " " + (key ? quoted(*key) : std::string("?")) +
           " of size " + (numel ? pickle_repr(*numel, 24) : std::string("?"));
  };
  auto special = [&](const pickle_value& d) -> std::optional<std::string> {
    if (d.dict_size() == 0) return std::nullopt;
    const pickle_value& first = d.dict_key(0);
    if (first == pickle_value::string(std::string(torch_storage_key))) return "<" + storage(d) + ">";
    if (first == pickle_value::string(std::string(torch_tensor_key))) {
      const pickle_value& st = d.dict_value(0);
      std::string t = "<tensor";
      if (const pickle_value* size = d.find("size")) t += " of size " + pickle_repr(*size, 80);
      if (const pickle_value* dt = d.find("dtype")) t += " " + bare(*dt);
      return t + " over " + (st.type() == k::dict ? storage(st) : std::string("a storage")) + ">";
    }
    if (d.dict_size() == 1 && first == pickle_value::string(std::string(dcp_unpickle_policy::global_key))) {
      const std::string name = bare(d.dict_value(0));
      const std::string_view n(name);
      // what repr() of a dtype or memory format gives; a class or function is not one
      if (n.starts_with("torch.") && !n.ends_with("Storage") &&
          (dcp_torch_dtype(n.substr(6)) || n == "torch.contiguous_format" || n == "torch.channels_last" ||
           n == "torch.channels_last_3d" || n == "torch.preserve_format" || n == "torch.strided"))
        return name;
      return "<class '" + name + "'>";
    }
    return std::nullopt;
  };
  return pickle_repr(v, max_chars, special);
}

}  // namespace shardsafe
