// shardsafe/format/dcp_unpickler.hpp - the allowlist that torch DCP's `.metadata` pickle is read
// through (docs/FORMAT.md §5, issue 11): a PickleOpcodePolicy for format/pickle_reader.hpp.
//
// It is a restricted unpickler, not an interpreter, with the rule of
// torch.load(weights_only=True): GLOBAL and STACK_GLOBAL may name only the globals below, and
// REDUCE, NEWOBJ, NEWOBJ_EX and BUILD act only on them; any other global is errc::invalid_metadata
// naming it ("refers to global 'os.system', which is not on the DCP allowlist"). Nothing is
// called: each allowed global becomes plain data, so the result is a pickle_value tree:
//
// | global                                              | becomes                                 |
// |-----------------------------------------------------|-----------------------------------------|
// | a DCP class: Metadata, TensorStorageMetadata,       | NEWOBJ/REDUCE: a dict {"__class__":     |
// | BytesStorageMetadata, ChunkStorageMetadata,         | "module.Name"} (REDUCE's arguments under|
// | MetadataIndex, TensorProperties, StorageMeta of     | "__args__"); BUILD adds a state dict's  |
// | torch.distributed.checkpoint.metadata (torch >= 2.0)| entries in place (both dicts of a       |
// | or torch.distributed._shard.checkpoint.metadata and | (dict, slots) pair), another state under|
// | ._shard.sharded_tensor.metadata (1.13); _StorageInfo| "__state__"; the first "__class__" is   |
// | of either .filesystem                               | the class                               |
// | MEM_FORMAT_ENCODING (1.13, 2.0-2.2),                | REDUCE (value,): the value; getattr: a   |
// | _MEM_FORMAT_ENCODING (2.2 and later), either module | marker {"__global__": "...NAME"}        |
// | torch.Size                                          | REDUCE (seq,): a tuple                  |
// | collections.OrderedDict                             | REDUCE (): an empty dict                |
// | torch.serialization._get_layout                     | REDUCE (str,): the string               |
// | builtins.getattr (__builtin__ in protocol 2)         | REDUCE (marker, name): the marker of    |
// |                                                     | that attribute, itself allowlisted      |
// | pathlib[._local].{Pure,}{Posix,Windows}Path         | REDUCE (str, ...): the parts joined by / |
// | (StorageMeta.checkpoint_id; Python 3.13 writes      |                                         |
// | pathlib._local)                                     |                                         |
// | torch.<dtype>, torch.<memory format>, torch.strided | a marker {"__global__": "torch.name"}   |
// | torch.distributed.checkpoint.planner's SavePlan,    | as a DCP class; WriteItemType as the    |
// | WriteItem, TensorWriteData, WriteItemType; Megatron-| memory-format enum (Megatron-Core's     |
// | Core's MCoreMetadata                                | saves: all_local_plans, mcore_data)     |
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/dtype.hpp"
#include "shardsafe/format/pickle_reader.hpp"

namespace shardsafe {

/// What an allowlisted global is (table at the top).
enum class dcp_global_kind { object_class, enum_class, size, ordered_dict, get_layout, getattr, path, value };

/// The torch dtypes DCP may record, by the name after `torch.`, with shardsafe's dtype (nullopt:
/// a dtype torch has that shardsafe cannot hold: a DCP folder's tensor of it is foreign,
/// dcp_item::foreign_dtype, listed and never read).
inline std::optional<std::optional<dtype>> dcp_torch_dtype(std::string_view n) noexcept {
  struct entry {
    std::string_view name;
    std::optional<dtype> type;
  };
  static constexpr std::array<entry, 33> table{{
      {"float32", dtype::F32},
      {"float", dtype::F32},
      {"float64", dtype::F64},
      {"double", dtype::F64},
      {"float16", dtype::F16},
      {"half", dtype::F16},
      {"bfloat16", dtype::BF16},
      {"int64", dtype::I64},
      {"long", dtype::I64},
      {"int32", dtype::I32},
      {"int", dtype::I32},
      {"int16", dtype::I16},
      {"short", dtype::I16},
      {"int8", dtype::I8},
      {"uint8", dtype::U8},
      {"bool", dtype::BOOL},
      {"uint16", dtype::U16},
      {"uint32", dtype::U32},
      {"uint64", dtype::U64},
      {"float8_e4m3fn", dtype::F8_E4M3},
      {"float8_e5m2", dtype::F8_E5M2},
      {"float8_e4m3fnuz", dtype::F8_E4M3FNUZ},
      {"float8_e5m2fnuz", dtype::F8_E5M2FNUZ},
      {"float8_e8m0fnu", dtype::F8_E8M0},
      {"complex64", dtype::C64},
      {"cfloat", dtype::C64},
      {"complex128", std::nullopt},
      {"cdouble", std::nullopt},
      {"complex32", std::nullopt},
      {"chalf", std::nullopt},
      {"qint8", std::nullopt},
      {"quint8", std::nullopt},
      {"qint32", std::nullopt},
  }};
  for (const auto& e : table)
    if (e.name == n) return e.type;
  return std::nullopt;
}

/// The kind of global `full` ("module.name"), or nullopt when it is not on the allowlist.
inline std::optional<dcp_global_kind> dcp_global(std::string_view full) noexcept {
  using k = dcp_global_kind;
  static constexpr std::array<std::string_view, 3> metadata_modules{
      "torch.distributed.checkpoint.metadata.", "torch.distributed._shard.checkpoint.metadata.",
      "torch.distributed._shard.sharded_tensor.metadata."};
  static constexpr std::array<std::string_view, 7> classes{
      "Metadata",      "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
      "MetadataIndex", "TensorProperties",      "StorageMeta"};
  // the memory-format enum: MEM_FORMAT_ENCODING (torch 1.13, 2.0-2.2's sharded_tensor module),
  // _MEM_FORMAT_ENCODING (torch.distributed.checkpoint.metadata, 2.2 and later)
  for (auto m : metadata_modules) {
    if (!full.starts_with(m)) continue;
    auto rest = full.substr(m.size());
    for (auto c : classes)
      if (rest == c) return k::object_class;
    if (rest.starts_with('_')) rest.remove_prefix(1);
    static constexpr std::string_view enum_name = "MEM_FORMAT_ENCODING";
    if (rest == enum_name) return k::enum_class;
    if (rest.starts_with(enum_name) && rest.size() > enum_name.size() && rest[enum_name.size()] == '.') {
      const auto member = rest.substr(enum_name.size() + 1);
      if (member == "TORCH_CONTIGUOUS_FORMAT" || member == "TORCH_CHANNELS_LAST" || member == "TORCH_PRESERVE_FORMAT")
        return k::value;
    }
    return std::nullopt;
  }
  if (full == "torch.distributed.checkpoint.filesystem._StorageInfo" ||
      full == "torch.distributed._shard.checkpoint.filesystem._StorageInfo")
    return k::object_class;
  // Megatron-Core's saves: the local plans it keeps on the Metadata (core 0.16, all_local_plans),
  // and its Metadata subclass of core 0.15 and before (one more field, mcore_data)
  static constexpr std::string_view planner = "torch.distributed.checkpoint.planner.";
  if (full.starts_with(planner)) {
    const auto rest = full.substr(planner.size());
    if (rest == "SavePlan" || rest == "WriteItem" || rest == "TensorWriteData") return k::object_class;
    if (rest == "WriteItemType") return k::enum_class;
    return std::nullopt;
  }
  if (full == "megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata") return k::object_class;
  if (full == "torch.Size") return k::size;
  if (full == "collections.OrderedDict") return k::ordered_dict;
  if (full == "torch.serialization._get_layout") return k::get_layout;
  if (full == "builtins.getattr" || full == "__builtin__.getattr") return k::getattr;  // protocol 2 spells it so
  // StorageMeta.checkpoint_id: a path, pickled under pathlib (Python <= 3.12) or pathlib._local (3.13+)
  for (std::string_view m : {std::string_view("pathlib."), std::string_view("pathlib._local.")})
    if (full.starts_with(m))
      for (std::string_view c : {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"})
        if (full.substr(m.size()) == c) return k::path;
  if (full.starts_with("torch.")) {
    const auto n = full.substr(6);
    if (dcp_torch_dtype(n) || n == "strided" || n == "contiguous_format" || n == "channels_last" ||
        n == "channels_last_3d" || n == "preserve_format")
      return k::value;
  }
  return std::nullopt;
}

/// The PickleOpcodePolicy of DCP's `.metadata` (table at the top).
struct dcp_unpickle_policy {
  static constexpr std::string_view global_key = "__global__";
  static constexpr std::string_view class_key = "__class__";

  /// The global a marker names, or "" when v is not a marker.
  static std::string marker_name(const pickle_value& v) {
    if (v.type() != pickle_value::kind::dict || v.dict_size() != 1) return {};
    const auto* g = v.find(global_key);
    return g && g->type() == pickle_value::kind::string ? g->as_string("") : std::string();
  }
  static pickle_value marker(std::string name) {
    return pickle_value::dict({{pickle_value::string(std::string(global_key)), pickle_value::string(std::move(name))}});
  }

  template <class Reader>
  bool on_opcode(Reader& r, unsigned char op, std::size_t at) const {
    switch (op) {
      case 'c': {  // GLOBAL: "module\nname\n"
        std::string module = line(r), name = line(r);
        r.push(global(r, module + "." + name, at));
        return true;
      }
      case 0x93: {  // STACK_GLOBAL
        const auto name = r.pop_value(), module = r.pop_value();
        if (name.type() != pickle_value::kind::string || module.type() != pickle_value::kind::string)
          r.bad("STACK_GLOBAL at byte " + std::to_string(at) + " needs two strings");
        r.push(global(r, module.as_string("") + "." + name.as_string(""), at));
        return true;
      }
      case 'R': {  // REDUCE
        auto args = r.pop_value();
        auto callable = r.pop_value();
        r.push(reduce(r, callable, args, at));
        return true;
      }
      case 0x81:    // NEWOBJ
      case 0x92: {  // NEWOBJ_EX
        if (op == 0x92) {
          const auto kwargs = r.pop_value();
          if (kwargs.type() != pickle_value::kind::dict || kwargs.dict_size() != 0)
            r.bad("NEWOBJ_EX at byte " + std::to_string(at) + " with keyword arguments");
        }
        auto args = r.pop_value();
        auto cls = r.pop_value();
        const auto name = class_of(r, cls, "NEWOBJ", at);
        if (args.type() != pickle_value::kind::tuple)
          r.bad("NEWOBJ at byte " + std::to_string(at) + " without an argument tuple");
        r.push(object(name, args));
        return true;
      }
      case 'b': {  // BUILD
        // the object's class is its first entry (object() puts it there): O(1), so that a pickle
        // of many BUILDs on one object costs what its bytes cost, not their square
        if (r.first_string_entry_at(1, class_key).empty())
          r.bad("BUILD at byte " + std::to_string(at) + " on a value that is not an allowlisted object");
        using k = pickle_value::kind;
        if (r.kind_at(0) == k::dict) {  // a dataclass's __dict__: its entries join the object, unbuilt
          r.merge_top_into_below("BUILD");
          return true;
        }
        auto state = r.pop_value();
        auto add = [&](const pickle_value& d) {
          for (std::size_t i = 0; i < d.dict_size(); ++i) r.extend_top(d.dict_key(i), d.dict_value(i));
        };
        const auto* s = state.type() == k::tuple ? &state.as_sequence("") : nullptr;
        if (s && s->size() == 2 && ((*s)[0].is_none() || (*s)[0].type() == k::dict) && (*s)[1].type() == k::dict) {
          add((*s)[0]);  // (__dict__ or None, slots)
          add((*s)[1]);
        } else {
          r.extend_top(pickle_value::string("__state__"), state);
        }
        return true;
      }
      default: return false;
    }
  }

 private:
  template <class Reader>
  static std::string line(Reader& r) {
    std::string s;
    while (true) {
      const char c = r.take(1)[0];
      if (c == '\n') return s;
      if (s.size() >= 256) r.bad("GLOBAL name longer than 256 bytes");
      s += c;
    }
  }
  template <class Reader>
  static pickle_value global(Reader& r, const std::string& full, std::size_t at) {
    if (!dcp_global(full))
      r.bad("refers to global '" + full + "' at byte " + std::to_string(at) + ", which is not on the DCP allowlist");
    return marker(full);
  }
  template <class Reader>
  static std::string class_of(Reader& r, const pickle_value& cls, const char* op, std::size_t at) {
    const auto name = marker_name(cls);
    if (name.empty() || dcp_global(name) != dcp_global_kind::object_class)
      r.bad(std::string(op) + " at byte " + std::to_string(at) + " on " +
            (name.empty() ? "a value" : "'" + name + "'") + ", which is not an allowlisted class");
    return name;
  }
  static pickle_value object(const std::string& name, const pickle_value& args) {
    auto o = pickle_value::dict({{pickle_value::string(std::string(class_key)), pickle_value::string(name)}});
    if (args.type() == pickle_value::kind::tuple && !args.as_sequence("").empty()) o.set("__args__", args);
    return o;
  }
  template <class Reader>
  static pickle_value reduce(Reader& r, const pickle_value& callable, const pickle_value& args, std::size_t at) {
    const auto name = marker_name(callable);
    const auto where = " at byte " + std::to_string(at);
    const auto kind = name.empty() ? std::nullopt : dcp_global(name);
    if (!kind) r.bad("REDUCE" + where + " calls a value that is not an allowlisted global");
    if (args.type() != pickle_value::kind::tuple)
      r.bad("REDUCE" + where + " of '" + name + "' without an argument tuple");
    const auto& a = args.as_sequence("");
    using k = pickle_value::kind;
    auto want = [&](bool ok, const char* what) {
      if (!ok) r.bad("REDUCE" + where + " of '" + name + "' needs " + what);
    };
    switch (*kind) {
      case dcp_global_kind::object_class: return object(name, args);
      case dcp_global_kind::enum_class:
        want(a.size() == 1 && a[0].type() == k::integer, "one int");
        if (name.ends_with(".WriteItemType")) {  // SHARD, TENSOR, BYTE_IO
          want(a[0].as_int("") >= 1 && a[0].as_int("") <= 3, "a member's value (1, 2 or 3)");
          return a[0];
        }
        // TORCH_CONTIGUOUS_FORMAT, TORCH_CHANNELS_LAST, TORCH_PRESERVE_FORMAT: torch refuses any other
        want(a[0].as_int("") >= 0 && a[0].as_int("") <= 2, "a member's value (0, 1 or 2)");
        return a[0];
      case dcp_global_kind::size:
        want(a.size() == 1 && (a[0].type() == k::tuple || a[0].type() == k::list), "one list or tuple");
        return pickle_value::tuple(a[0].as_sequence(""));
      case dcp_global_kind::ordered_dict: want(a.empty(), "no arguments"); return pickle_value::dict();
      case dcp_global_kind::get_layout: want(a.size() == 1 && a[0].type() == k::string, "one str"); return a[0];
      case dcp_global_kind::getattr: {
        want(a.size() == 2 && !marker_name(a[0]).empty() && a[1].type() == k::string,
             "an allowlisted global and a str");
        return global(r, marker_name(a[0]) + "." + a[1].as_string(""), at);
      }
      case dcp_global_kind::path: {
        std::string p;
        for (const auto& x : a) {
          want(x.type() == k::string, "str parts");
          p += (p.empty() ? "" : "/") + x.as_string("");
        }
        return pickle_value::string(p);
      }
      case dcp_global_kind::value: break;
    }
    r.bad("REDUCE" + where + " calls '" + name + "', which is a value, not a class or function");
  }
};

static_assert(PickleOpcodePolicy<dcp_unpickle_policy>);

}  // namespace shardsafe
