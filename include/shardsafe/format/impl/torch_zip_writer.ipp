// shardsafe/format/impl/torch_zip_writer.ipp - torch_zip_writer.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/format/torch_zip_writer.hpp"

namespace shardsafe {
namespace detail {

SHARDSAFE_DECL void zip_central_directory(std::string& out, std::uint64_t at,
                                          const std::vector<zip_record_out>& records) {
  const std::uint64_t cd_at = at;
  const std::size_t before = out.size();
  for (const auto& r : records) {
    std::string extra;
    std::uint64_t size32 = r.size, local32 = r.local;
    if (r.size >= zip32_max) {
      zip_put(extra, r.size, 8);  // size, compressed size
      zip_put(extra, r.size, 8);
      size32 = zip32_max;
    }
    if (r.local >= zip32_max) {
      zip_put(extra, r.local, 8);
      local32 = zip32_max;
    }
    if (!extra.empty()) {
      std::string head;
      zip_put(head, 1, 2);
      zip_put(head, extra.size(), 2);
      extra = head + extra;
    }
    zip_put(out, 0x02014b50, 4);
    zip_put(out, extra.empty() ? 20 : 45, 2);  // made by
    zip_put(out, extra.empty() ? 20 : 45, 2);  // needed
    zip_put(out, 0x0808, 2);
    zip_put(out, 0, 2);
    zip_put(out, 0, 4);
    zip_put(out, r.crc, 4);
    zip_put(out, size32, 4);
    zip_put(out, size32, 4);
    zip_put(out, r.name.size(), 2);
    zip_put(out, extra.size(), 2);
    zip_put(out, 0, 2);  // comment
    zip_put(out, 0, 2);  // disk
    zip_put(out, 0, 2);  // internal attributes
    zip_put(out, 0, 4);  // external attributes
    zip_put(out, local32, 4);
    out += r.name;
    out += extra;
  }
  const std::uint64_t cd_size = out.size() - before;
  const bool zip64 = cd_at >= zip32_max || cd_at + cd_size >= zip32_max;
  if (zip64) {
    const std::uint64_t z = cd_at + cd_size;
    zip_put(out, 0x06064b50, 4);  // zip64 end of central directory
    zip_put(out, 44, 8);
    zip_put(out, 45, 2);
    zip_put(out, 45, 2);
    zip_put(out, 0, 4);
    zip_put(out, 0, 4);
    zip_put(out, records.size(), 8);
    zip_put(out, records.size(), 8);
    zip_put(out, cd_size, 8);
    zip_put(out, cd_at, 8);
    zip_put(out, 0x07064b50, 4);  // its locator
    zip_put(out, 0, 4);
    zip_put(out, z, 8);
    zip_put(out, 1, 4);
  }
  // the end of central directory; past 32 bits its fields are the zip64 record's markers
  zip_put(out, 0x06054b50, 4);
  zip_put(out, 0, 4);
  zip_put(out, zip64 ? 0xffff : records.size(), 2);
  zip_put(out, zip64 ? 0xffff : records.size(), 2);
  zip_put(out, zip64 ? zip32_max : cd_size, 4);
  zip_put(out, zip64 ? zip32_max : cd_at, 4);
  zip_put(out, 0, 2);
}

}  // namespace detail

SHARDSAFE_DECL std::string torch_tensor_pickle(dtype type, const shape_t& shape) {
  const std::string_view cls = detail::torch_storage_class(type);
  const std::string_view tname = detail::torch_dtype_name(type);
  if (cls.empty() && tname.empty())
    fail(errc::unsupported_dtype, std::string("torch.save: torch has no dtype for ") + std::string(to_string(type)));
  const auto n = detail::checked_numel(shape);
  if (!n) fail(errc::invalid_argument, "torch.save: shape " + to_string(shape) + " overflows 64 bits");
  std::vector<std::uint64_t> stride(shape.size());
  std::uint64_t s = 1;
  for (std::size_t d = shape.size(); d-- > 0;) {
    stride[d] = s;
    s *= std::max<std::uint64_t>(shape[d], 1);  // torch's contiguous strides treat an empty dimension as 1
  }
  std::string out = "\x80\x02";
  detail::pickle_global(out, "torch._utils", cls.empty() ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2");
  out += '(';  // the arguments
  out += '(';  // the persistent id
  detail::pickle_put(out, pickle_value::string("storage"));
  if (cls.empty())
    detail::pickle_global(out, "torch.storage", "UntypedStorage");
  else
    detail::pickle_global(out, "torch", cls);
  detail::pickle_put(out, pickle_value::string("0"));
  detail::pickle_put(out, pickle_value::string("cpu"));
  // a typed storage counts elements, an untyped one bytes
  detail::pickle_put(out, pickle_value::integer(static_cast<std::int64_t>(cls.empty() ? *n * item_size(type) : *n)));
  out += 't';
  out += 'Q';  // BINPERSID
  detail::pickle_put(out, pickle_value::integer(0));
  detail::pickle_int_tuple(out, shape);
  detail::pickle_int_tuple(out, stride);
  out += '\x89';  // requires_grad False
  detail::pickle_global(out, "collections", "OrderedDict");
  out += ")R";
  if (cls.empty()) detail::pickle_global(out, "torch", tname);
  out += "tR.";
  return out;
}

}  // namespace shardsafe
