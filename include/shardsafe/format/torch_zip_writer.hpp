// shardsafe/format/torch_zip_writer.hpp - torch.save archives as torch 2.x writes them, for the
// data files of a DCP checkpoint (docs/FORMAT.md §5): each chunk of a `.distcp` file is one
// archive holding one tensor, each non-tensor item one archive holding a pickled value.
//
// An archive is a zip of stored (uncompressed) records, offsets counted from its first byte:
//
// | record             | holds                                                              |
// |--------------------|--------------------------------------------------------------------|
// | archive/data.pkl   | the pickle (protocol 2): for a tensor, torch._utils._rebuild_tensor_v2|
// |                    | (v3 with an UntypedStorage for dtypes without a typed storage) of  |
// |                    | persistent id ('storage', torch.<T>Storage, '0', 'cpu', numel),    |
// |                    | offset 0, the size, row-major strides, False, OrderedDict()        |
// | archive/byteorder  | "little"                                                           |
// | archive/data/0     | the tensor's bytes, little-endian row-major (tensors only)         |
// | archive/version    | "3\n"                                                              |
//
// As torch does, every record's bytes start at a multiple of 64 (padded by an extra field 'FB'
// in its local header), and the local headers carry the data-descriptor flag: the CRC-32 and
// sizes follow the data and are in the central directory, so a tensor's bytes stream straight
// from memory to the file, the CRC computed as they pass. Sizes or offsets past 32 bits are
// written in zip64 form (central-directory extra fields, zip64 end records). torch.load
// (weights_only=True, which DCP's reader uses) accepts these archives; format/torch_zip.hpp reads
// them back.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/detail/crc32.hpp"
#include "shardsafe/format/pickle_writer.hpp"

namespace shardsafe {

namespace detail {

inline void zip_put(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}

/// torch's storage class for dtype t ("FloatStorage"), or "" where torch 2.x saves the dtype
/// through an UntypedStorage and _rebuild_tensor_v3 (float8, the wide unsigned types, F4/F6).
inline std::string_view torch_storage_class(dtype t) noexcept {
  switch (t) {
    case dtype::F32: return "FloatStorage";
    case dtype::F64: return "DoubleStorage";
    case dtype::F16: return "HalfStorage";
    case dtype::BF16: return "BFloat16Storage";
    case dtype::I64: return "LongStorage";
    case dtype::I32: return "IntStorage";
    case dtype::I16: return "ShortStorage";
    case dtype::I8: return "CharStorage";
    case dtype::U8: return "ByteStorage";
    case dtype::BOOL: return "BoolStorage";
    case dtype::C64: return "ComplexFloatStorage";
    default: return "";
  }
}

/// torch's dtype name for t ("float32"), or "" when torch has none.
inline std::string_view torch_dtype_name(dtype t) noexcept {
  switch (t) {
    case dtype::F32: return "float32";
    case dtype::F64: return "float64";
    case dtype::F16: return "float16";
    case dtype::BF16: return "bfloat16";
    case dtype::I64: return "int64";
    case dtype::I32: return "int32";
    case dtype::I16: return "int16";
    case dtype::I8: return "int8";
    case dtype::U8: return "uint8";
    case dtype::BOOL: return "bool";
    case dtype::U16: return "uint16";
    case dtype::U32: return "uint32";
    case dtype::U64: return "uint64";
    case dtype::F8_E4M3: return "float8_e4m3fn";
    case dtype::F8_E5M2: return "float8_e5m2";
    case dtype::F8_E4M3FNUZ: return "float8_e4m3fnuz";
    case dtype::F8_E5M2FNUZ: return "float8_e5m2fnuz";
    case dtype::F8_E8M0: return "float8_e8m0fnu";
    case dtype::C64: return "complex64";
    default: return "";
  }
}

inline void pickle_global(std::string& out, std::string_view module, std::string_view name) {
  out += 'c';
  out.append(module);
  out += '\n';
  out.append(name);
  out += '\n';
}

/// A tuple of non-negative ints in protocol 2.
inline void pickle_int_tuple(std::string& out, const std::vector<std::uint64_t>& v) {
  std::vector<pickle_value> items;
  for (auto x : v) items.push_back(pickle_value::integer(static_cast<std::int64_t>(x)));
  pickle_put(out, pickle_value::tuple(std::move(items)));
}

/// One record of an archive being laid out: its local header written, where its data starts.
struct zip_record_out {
  std::string name;
  std::uint64_t local = 0, size = 0;
  std::uint32_t crc = 0;
};

inline constexpr std::uint64_t zip32_max = 0xffffffffu;

/// Appends the local header of `name` at out.size() (== its offset in the archive), padded so that
/// its data starts at a multiple of 64; returns the record.
inline zip_record_out zip_local_header(std::string& out, std::string name) {
  zip_record_out r{std::move(name), out.size(), 0, 0};
  const std::uint64_t fixed = 30 + r.name.size() + 4;  // header, name, 'FB' extra field's own 4 bytes
  const std::uint64_t pad = (64 - (r.local + fixed) % 64) % 64;
  zip_put(out, 0x04034b50, 4);
  zip_put(out, 20, 2);      // version needed
  zip_put(out, 0x0808, 2);  // data descriptor follows; UTF-8 names
  zip_put(out, 0, 2);       // stored
  zip_put(out, 0, 4);       // time, date
  zip_put(out, 0, 4);       // crc (in the descriptor)
  zip_put(out, 0, 4);       // compressed size
  zip_put(out, 0, 4);       // size
  zip_put(out, r.name.size(), 2);
  zip_put(out, 4 + pad, 2);
  out += r.name;
  zip_put(out, 0x4246, 2);  // 'FB', torch's padding field
  zip_put(out, pad, 2);
  out.append(static_cast<std::size_t>(pad), 'Z');
  return r;
}

/// The data descriptor after a record's bytes.
inline void zip_descriptor(std::string& out, const zip_record_out& r) {
  const bool wide = r.size >= zip32_max;
  zip_put(out, 0x08074b50, 4);
  zip_put(out, r.crc, 4);
  zip_put(out, r.size, wide ? 8 : 4);
  zip_put(out, r.size, wide ? 8 : 4);
}

inline std::uint32_t crc_of(std::string_view s) {
  return crc32_of(std::as_bytes(std::span<const char>(s.data(), s.size())));
}

/// A small record whose bytes are known: local header, bytes, descriptor.
inline zip_record_out zip_small_record(std::string& out, std::string name, std::string_view bytes) {
  zip_record_out r = zip_local_header(out, std::move(name));
  out.append(bytes);
  r.size = bytes.size();
  r.crc = crc_of(bytes);
  zip_descriptor(out, r);
  return r;
}

/// The central directory and end records of `records`, appended at `at` (== the archive's size so far).
SHARDSAFE_DECL void zip_central_directory(std::string& out, std::uint64_t at,
                                          const std::vector<zip_record_out>& records);

}  // namespace detail

/// data.pkl of a tensor of `type` and `shape` (row-major, contiguous), as torch 2.x's torch.save
/// writes it (table at the top). errc::unsupported_dtype for a dtype torch cannot hold.
SHARDSAFE_DECL std::string torch_tensor_pickle(dtype type, const shape_t& shape);

/// The bytes of a torch.save archive around one tensor's data: head() precedes the data,
/// tail(crc) follows it. head().size() + data_size() + tail_size() is the archive's length.
class torch_tensor_archive {
 public:
  torch_tensor_archive(dtype type, const shape_t& shape) : type_(type) {
    const auto n = detail::checked_numel(shape);
    const auto bytes = n ? detail::checked_mul(*n, item_size(type)) : std::nullopt;
    if (!bytes) fail(errc::invalid_argument, "torch.save: shape " + to_string(shape) + " overflows 64 bits");
    size_ = *bytes;
    records_.push_back(detail::zip_small_record(head_, "archive/data.pkl", torch_tensor_pickle(type, shape)));
    records_.push_back(detail::zip_small_record(head_, "archive/byteorder", "little"));
    records_.push_back(detail::zip_local_header(head_, "archive/data/0"));
    records_.back().size = size_;
    tail_size_ = tail(0).size();
  }
  dtype type() const noexcept { return type_; }
  const std::string& head() const noexcept { return head_; }
  std::uint64_t data_size() const noexcept { return size_; }
  std::uint64_t tail_size() const noexcept { return tail_size_; }
  std::uint64_t size() const noexcept { return head_.size() + size_ + tail_size_; }
  /// What follows the data whose CRC-32 is `crc`.
  std::string tail(std::uint32_t crc) const {
    std::vector<detail::zip_record_out> records = records_;
    records.back().crc = crc;
    std::string out;
    const std::uint64_t at = head_.size() + size_;  // out's first byte in the archive
    detail::zip_descriptor(out, records.back());
    // the version record, laid out as if `out` started at `at`
    std::string shifted(static_cast<std::size_t>(at % 64), '\0');
    const std::size_t skip = shifted.size();
    shifted += out;
    detail::zip_record_out v = detail::zip_small_record(shifted, "archive/version", "3\n");
    v.local += at - skip;
    records.push_back(v);
    detail::zip_central_directory(shifted, at - skip + shifted.size(), records);
    return shifted.substr(skip);
  }

 private:
  dtype type_;
  std::string head_;
  std::vector<detail::zip_record_out> records_;
  std::uint64_t size_ = 0, tail_size_ = 0;
};

/// A torch.save archive of a pickled value (a non-tensor item of DCP: torch.save(obj) with no
/// tensor), data.pkl holding `pickle`.
inline std::string torch_value_archive(std::string_view pickle) {
  std::string out;
  std::vector<detail::zip_record_out> records;
  records.push_back(detail::zip_small_record(out, "archive/data.pkl", pickle));
  records.push_back(detail::zip_small_record(out, "archive/byteorder", "little"));
  records.push_back(detail::zip_small_record(out, "archive/version", "3\n"));
  detail::zip_central_directory(out, out.size(), records);
  return out;
}

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/format/impl/torch_zip_writer.ipp"
#endif
