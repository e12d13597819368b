// shardsafe/format/torch_tensor_pickle.hpp - the data.pkl of a torch.save archive, read through
// an allowlist (docs/FORMAT.md §5): torch_tensor_pickle_policy (the globals
// torch._utils._rebuild_tensor_v2 and _v3, torch.<T>Storage, torch.UntypedStorage, torch.<dtype>
// and collections.OrderedDict; BINPERSID of a storage; nothing is called) and the tensor it
// describes (torch_zip_tensor: its storage, offset, size and stride). format/torch_zip.hpp
// checks such a tensor against its record; format/torch_save.hpp reads a whole state dict so.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/dcp_unpickler.hpp"
#include "shardsafe/format/pickle_reader.hpp"
#include "shardsafe/format/pickle_repr.hpp"

namespace shardsafe {

/// The tensor data.pkl describes: its storage (key, element type, elements) and view.
struct torch_zip_tensor {
  std::string storage_key;    ///< KEY of PREFIX/data/KEY
  std::optional<dtype> type;  ///< nullopt for an untyped (byte) storage
  std::uint64_t storage_numel = 0;
  std::uint64_t storage_offset = 0;
  std::vector<std::uint64_t> size, stride;
  std::optional<dtype> view_type;  ///< the tensor's dtype when given apart from its storage (torch 2.x, v3)
};

/// The first keys of the dicts torch_tensor_pickle_policy makes for a tensor and for a storage:
/// not UTF-8, so that no str a pickle spells is one (a plain dict cannot pass for a tensor).
inline constexpr std::string_view torch_tensor_key =
                                      "\xff"
                                      "tensor",
                                  torch_storage_key =
                                      "\xff"
                                      "storage";

/// The most storages (distinct keys) a torch.save file's pickle may name, and so records of
/// storages and a legacy file's listed storages: what a file of max_torch_save_tensors tensors,
/// each over its own storage, needs (docs/FORMAT.md §3: within the tool's 256 MiB).
inline constexpr std::size_t max_torch_save_storages = std::size_t(1) << 16;

/// The keys of the dict torch_tensor_pickle_policy makes for an opaque record (a class a caller
/// allows as a record, pickle_record_classes): its class's full name first, then the arguments
/// NEWOBJ or REDUCE gave it, then (BUILD) its state's entries when the state is a dict of str
/// keys, else the state itself under torch_record_state_key. Not UTF-8: no pickle spells them.
inline constexpr std::string_view torch_record_key =
                                      "\xff"
                                      "record",
                                  torch_record_args_key =
                                      "\xff"
                                      "args",
                                  torch_record_state_key =
                                      "\xff"
                                      "state";

/// Classes a caller reads as opaque records (a trainer's dataclasses and enums in its checkpoint
/// pickles: DeepSpeed's fragment_address, LossScaler, ZeroStageEnum), by full name
/// ("module.Name"): each GLOBAL of one is allowed, NEWOBJ, NEWOBJ_EX (without keyword arguments)
/// and REDUCE of it make a record (torch_record_key) and BUILD on a record keeps its state. Nothing
/// is imported or called, and a class not named stays refused: only the layout that passes the
/// list reads more than the torch.save allowlist.
struct pickle_record_classes {
  std::span<const std::string_view> names;
  /// Also a plain tensor saved with attributes of its own (torch._tensor._rebuild_from_type_v2 of
  /// _rebuild_tensor_v2's arguments, the class torch.Tensor, a state of str keys and plain
  /// scalars: DeepSpeed's ds_id): the tensor; torch sets the attributes, which hold no data (a
  /// scalar cannot replace its data or grad), and they are dropped.
  bool tensor_attributes = false;
  bool has(std::string_view full) const noexcept {
    for (std::string_view n : names)
      if (n == full) return true;
    return false;
  }
};

/// Whether v is an opaque record (pickle_record_classes) and of which class: its name, or "".
inline std::string_view torch_record_class(const pickle_value& v) {
  if (v.type() != pickle_value::kind::dict || v.dict_size() == 0 ||
      v.dict_key(0) != pickle_value::string(std::string(torch_record_key)) ||
      v.dict_value(0).type() != pickle_value::kind::string)
    return {};
  return v.dict_value(0).as_string("");
}

/// A storage as the first persistent id naming its key gave it (torch makes it then, and every
/// later use of the key is that storage, whatever it says).
struct torch_storage_id {
  std::string type;  ///< its class or dtype, "torch.FloatStorage"
  std::uint64_t numel = 0;
  std::size_t at = 0;  ///< the byte of that BINPERSID
};

/// The PickleOpcodePolicy of a torch.save data.pkl holding one tensor: the globals
/// torch._utils._rebuild_tensor_v2, collections.OrderedDict, torch.<T>Storage, torch.UntypedStorage
/// and torch.<dtype>; BINPERSID of ('storage', type, key, location, numel). Nothing is called.
/// With state_dict (a whole state dict's pickle, format/torch_save.hpp) it also takes
/// torch._utils._rebuild_parameter (a Parameter: its tensor) and BUILD on a dict (a state dict's
/// `_metadata` attribute, dropped); with legacy, a storage's persistent id is the legacy
/// format's six-tuple, its view_metadata None.
struct torch_tensor_pickle_policy {
  bool state_dict = false;
  bool legacy = false;  ///< torch.save's legacy format: BINPERSID of ('storage', type, key, location, numel, None)
  /// When set, every storage the pickle names, by key, wherever it stands (a tensor's, one
  /// popped, one in an argument the reader drops): a later id naming the key with another type
  /// or size is refused (torch would view the first storage as its type and size).
  std::map<std::string, torch_storage_id, std::less<>>* storages = nullptr;
  /// Classes read as opaque records (pickle_record_classes), or nullptr: none.
  const pickle_record_classes* records = nullptr;
  /// A record of class `name` made with `args`.
  static pickle_value record(const std::string& name, const pickle_value& args) {
    return pickle_value::dict({{pickle_value::string(std::string(torch_record_key)), pickle_value::string(name)},
                               {pickle_value::string(std::string(torch_record_args_key)), args}});
  }
  /// The dtype of storage class `n` (after "torch."): nullopt if not one, {nullopt} if untyped.
  static std::optional<std::optional<dtype>> storage_type(std::string_view n) {
    static constexpr std::pair<std::string_view, dtype> table[] = {
        {"FloatStorage", dtype::F32},     {"DoubleStorage", dtype::F64},      {"HalfStorage", dtype::F16},
        {"BFloat16Storage", dtype::BF16}, {"LongStorage", dtype::I64},        {"IntStorage", dtype::I32},
        {"ShortStorage", dtype::I16},     {"CharStorage", dtype::I8},         {"ByteStorage", dtype::U8},
        {"BoolStorage", dtype::BOOL},     {"ComplexFloatStorage", dtype::C64}};
    for (const auto& [name, t] : table)
      if (n == name) return std::optional<dtype>(t);
    if (n == "UntypedStorage" || n == "storage.UntypedStorage") return std::optional<dtype>();
    if (auto t = dcp_torch_dtype(n); t && *t) return t;  // newer torch: the dtype itself
    return std::nullopt;
  }
  /// The same for a full name, "torch.FloatStorage": nullopt unless it is torch's.
  static std::optional<std::optional<dtype>> storage_type_of(std::string_view full) {
    return full.starts_with("torch.") ? storage_type(full.substr(6)) : std::nullopt;
  }
  /// A builtin a training checkpoint's values are made with (protocol 2 writes a set, frozenset,
  /// bytes or bytearray as a REDUCE of it), under Python 3's name or Python 2's (protocol 2 writes
  /// "__builtin__"): "set", "frozenset", "bytes", "bytearray", or "" for any other name.
  static std::string_view value_builtin(std::string_view full) {
    for (std::string_view n : {"set", "frozenset", "bytes", "bytearray"})
      if ((full.starts_with("builtins.") && full.substr(9) == n) ||
          (full.starts_with("__builtin__.") && full.substr(12) == n))
        return n;
    return {};
  }
  /// The bytes codecs.encode(s, 'latin1') gives: nullopt when s holds a code point past U+00FF
  /// (Python raises). s is UTF-8 (the reader checked).
  static std::optional<std::string> latin1(std::string_view s) {
    std::string out;
    for (std::size_t i = 0; i < s.size(); ++i) {
      const auto c = static_cast<unsigned char>(s[i]);
      if (c < 0x80)
        out += char(c);
      else if ((c == 0xc2 || c == 0xc3) && i + 1 < s.size())
        out += char(((c & 0x1f) << 6) | (static_cast<unsigned char>(s[++i]) & 0x3f));
      else
        return std::nullopt;
    }
    return out;
  }
  template <class Reader>
  bool on_opcode(Reader& r, unsigned char op, std::size_t at) const {
    const auto where = " at byte " + std::to_string(at);
    using k = pickle_value::kind;
    if (state_dict) {  // a training checkpoint's values: bytes, bytearray, set, frozenset (protocols 3 to 5)
      auto length = [&](std::size_t n) {
        std::uint64_t x = 0;
        const std::string_view b = r.take(n);
        for (std::size_t i = b.size(); i-- > 0;) x = (x << 8) | static_cast<unsigned char>(b[i]);
        return x;
      };
      switch (op) {
        case 'B': r.push_bytes(r.take(length(4)), false); return true;   // BINBYTES
        case 'C': r.push_bytes(r.take(length(1)), false); return true;   // SHORT_BINBYTES
        case 0x8e: r.push_bytes(r.take(length(8)), false); return true;  // BINBYTES8
        case 0x96: r.push_bytes(r.take(length(8)), true); return true;   // BYTEARRAY8
        case 0x8f: r.push_empty_set(); return true;                      // EMPTY_SET
        case 0x90: r.add_set_items(); return true;                       // ADDITEMS
        case 0x91: r.push_frozenset(); return true;                      // FROZENSET
        default: break;
      }
    }
    if (op == 'c' || op == 0x93) {
      std::string full;
      if (op == 'c') {
        std::string m, n;
        for (auto* s : {&m, &n})
          for (char c; (c = r.take(1)[0]) != '\n';) {
            if (s->size() >= 256) r.bad("GLOBAL name longer than 256 bytes");
            *s += c;
          }
        full = m + "." + n;
      } else {
        const auto n = r.pop_value(), m = r.pop_value();
        if (n.type() != k::string || m.type() != k::string) r.bad("STACK_GLOBAL" + where + " needs two strings");
        full = m.as_string("") + "." + n.as_string("");
      }
      const bool ok = full == "torch._utils._rebuild_tensor_v2" || full == "torch._utils._rebuild_tensor_v3" ||
                      full == "collections.OrderedDict" ||
                      (state_dict && (full == "torch._utils._rebuild_parameter" ||
                                      full == "torch._utils._rebuild_parameter_with_state" ||
                                      full == "_codecs.encode" || !value_builtin(full).empty())) ||
                      storage_type_of(full) || (records && records->has(full)) ||
                      (records && records->tensor_attributes &&
                       (full == "torch._tensor._rebuild_from_type_v2" || full == "torch.Tensor"));
      if (!ok) r.bad("refers to global '" + full + "'" + where + ", which is not on the torch.save tensor allowlist");
      r.push(dcp_unpickle_policy::marker(full));
      return true;
    }
    if (records && (op == 0x81 || op == 0x92)) {  // NEWOBJ, NEWOBJ_EX of a record class
      if (op == 0x92) {
        const auto kwargs = r.pop_value();
        if (kwargs.type() != k::dict || kwargs.dict_size() != 0) r.bad("NEWOBJ_EX" + where + " with keyword arguments");
      }
      const auto args = r.pop_value(), cls = r.pop_value();
      const std::string name = dcp_unpickle_policy::marker_name(cls);
      if (name.empty() || !records->has(name))
        r.bad("NEWOBJ" + where + " of " + (name.empty() ? "a value" : "'" + name + "'") +
              ", which is not a class read as a record");
      if (args.type() != k::tuple) r.bad("NEWOBJ" + where + " of '" + name + "' without an argument tuple");
      r.push(record(name, args));
      return true;
    }
    if (records && op == 'b' && r.first_key_at(1) == torch_record_key) {  // BUILD on a record: its state kept
      if (r.kind_at(0) == k::dict && r.first_key_at(0) != torch_tensor_key && r.first_key_at(0) != torch_storage_key &&
          r.first_key_at(0) != torch_record_key) {
        r.merge_top_into_below("BUILD");  // a dataclass's __dict__: its entries join the record
        return true;
      }
      const auto state = r.pop_value();
      r.extend_top(pickle_value::string(std::string(torch_record_state_key)), state);
      return true;
    }
    if (op == 'Q') {  // BINPERSID
      const auto pid = r.pop_value();
      const auto* t = pid.type() == k::tuple ? &pid.as_sequence("") : nullptr;
      if (!t || t->size() != (legacy ? 6 : 5) || (*t)[0] != pickle_value::string("storage") ||
          (*t)[2].type() != k::string || (*t)[4].type() != k::integer || (*t)[4].as_int("") < 0 ||
          dcp_unpickle_policy::marker_name((*t)[1]).empty())
        r.bad("BINPERSID" + where + " is not ('storage', type, key, location, numel" +
              (legacy ? ", view_metadata)" : ")"));
      if (legacy && (*t)[5].type() != k::none)
        r.bad("BINPERSID" + where +
              " is a view into another storage (its view_metadata is not None), which torch.save "
              "does not write; not read here");
      if (storages) {
        const std::string& key = (*t)[2].as_string("");
        const torch_storage_id id{dcp_unpickle_policy::marker_name((*t)[1]),
                                  static_cast<std::uint64_t>((*t)[4].as_int("")), at};
        if (storages->size() >= max_torch_save_storages && !storages->contains(key))
          r.bad("BINPERSID" + where + " names a storage more than the " + std::to_string(max_torch_save_storages) +
                " a torch.save file may hold (docs/FORMAT.md §3)");
        const auto [first, fresh] = storages->try_emplace(key, id);
        if (!fresh && (first->second.type != id.type || first->second.numel != id.numel))
          r.bad("BINPERSID" + where + " names storage '" + key + "' as " + std::to_string(id.numel) + " of " + id.type +
                ", the one at byte " + std::to_string(first->second.at) + " as " + std::to_string(first->second.numel) +
                " of " + first->second.type + " (torch would view the first as both)");
      }
      r.push_sealed(pickle_value::dict({{pickle_value::string(std::string(torch_storage_key)), (*t)[2]},
                                        {pickle_value::string("type"),
                                         pickle_value::string(dcp_unpickle_policy::marker_name((*t)[1]))},
                                        {pickle_value::string("numel"), (*t)[4]}}),
                    "storage");
      return true;
    }
    if (op == 'R') {
      const auto args = r.pop_value(), fn = r.pop_value();
      const auto name = dcp_unpickle_policy::marker_name(fn);
      if (args.type() != k::tuple) r.bad("REDUCE" + where + " without an argument tuple");
      const auto& a = args.as_sequence("");
      // what torch applies after making a tensor and would change its values (torch 2.x's
      // metadata: the conj and neg bits; a Parameter's state: setattr, `data` among them) must be
      // absent, None or empty
      auto inert = [](const pickle_value& v, auto& self) -> bool {
        if (v.type() == k::none) return true;
        if (v.type() == k::dict) return v.dict_size() == 0;
        if (v.type() == k::tuple || v.type() == k::list) {
          for (const auto& x : v.as_sequence(""))
            if (!self(x, self)) return false;
          return true;
        }
        return false;
      };
      auto inert_from = [&](std::size_t i, const char* what) {
        for (; i < a.size(); ++i)
          if (!inert(a[i], inert))
            r.bad("REDUCE" + where + " of '" + name + "' with " + what +
                  " that is not empty (torch would apply it to the tensor: " +
                  "a conjugate or negative view, or a changed attribute); not read here");
      };
      if (records && records->has(name)) {
        r.push(record(name, args));
      } else if (records && records->tensor_attributes && name == "torch._tensor._rebuild_from_type_v2") {
        // (_rebuild_tensor_v2, torch.Tensor, its arguments, {attribute: scalar})
        const pickle_value* v2 = a.size() == 4 && a[2].type() == k::tuple ? &a[2] : nullptr;
        const auto* inner = v2 ? &v2->as_sequence("") : nullptr;
        bool plain_state = a.size() == 4 && a[3].type() == k::dict;
        for (std::size_t i = 0; plain_state && i < a[3].dict_size(); ++i) {
          const auto t = a[3].dict_value(i).type();
          plain_state = a[3].dict_key(i).type() == k::string &&
                        (t == k::none || t == k::boolean || t == k::integer || t == k::real || t == k::string);
        }
        if (!inner || dcp_unpickle_policy::marker_name(a[0]) != "torch._utils._rebuild_tensor_v2" ||
            dcp_unpickle_policy::marker_name(a[1]) != "torch.Tensor" || inner->size() < 4 ||
            !(*inner)[0].find(torch_storage_key) || !plain_state)
          r.bad("REDUCE" + where +
                " of 'torch._tensor._rebuild_from_type_v2' other than a torch.Tensor made by _rebuild_tensor_v2 "
                "with attributes of plain scalars");
        for (std::size_t i = 6; i < inner->size(); ++i)
          if (!inert((*inner)[i], inert))
            r.bad("REDUCE" + where + " of a tensor with metadata that is not empty; not read here");
        r.push_sealed(pickle_value::dict({{pickle_value::string(std::string(torch_tensor_key)), (*inner)[0]},
                                          {pickle_value::string("offset"), (*inner)[1]},
                                          {pickle_value::string("size"), (*inner)[2]},
                                          {pickle_value::string("stride"), (*inner)[3]}}),
                      "tensor");
      } else if (name == "collections.OrderedDict" && a.empty()) {
        r.push(pickle_value::dict());
      } else if (name == "torch._utils._rebuild_tensor_v2" && a.size() >= 4 && a[0].find(torch_storage_key)) {
        inert_from(6, "metadata");
        r.push_sealed(pickle_value::dict({{pickle_value::string(std::string(torch_tensor_key)), a[0]},
                                          {pickle_value::string("offset"), a[1]},
                                          {pickle_value::string("size"), a[2]},
                                          {pickle_value::string("stride"), a[3]}}),
                      "tensor");
      } else if (name == "torch._utils._rebuild_tensor_v3" && a.size() >= 7 && a[0].find(torch_storage_key) &&
                 dcp_unpickle_policy::marker_name(a[6]).starts_with("torch.")) {
        // torch 2.x, dtypes without a typed storage (float8, uint16/32/64): an untyped (byte)
        // storage and the dtype as the seventh argument
        inert_from(7, "metadata");
        r.push_sealed(pickle_value::dict({{pickle_value::string(std::string(torch_tensor_key)), a[0]},
                                          {pickle_value::string("offset"), a[1]},
                                          {pickle_value::string("size"), a[2]},
                                          {pickle_value::string("stride"), a[3]},
                                          {pickle_value::string("dtype"),
                                           pickle_value::string(dcp_unpickle_policy::marker_name(a[6]))}}),
                      "tensor");
      } else if (const std::string_view b = state_dict ? value_builtin(name) : std::string_view();
                 (b == "set" || b == "frozenset") &&
                 (a.empty() || (a.size() == 1 && (a[0].type() == k::list || a[0].type() == k::tuple)))) {
        // set(list), frozenset(list) as protocol 2 writes them (set() and frozenset() too); an
        // item equal to one before it is left out, as Python does, when the value is built
        r.push(pickle_value::set_of(a.empty() ? std::vector<pickle_value>() : a[0].as_sequence(""), b == "frozenset"));
      } else if (state_dict && name == "_codecs.encode" && a.size() == 2 && a[0].type() == k::string &&
                 (a[1] == pickle_value::string("latin1") || a[1] == pickle_value::string("latin-1"))) {
        // bytes as protocol 2 writes them: codecs.encode(str, 'latin1')
        const auto bytes = latin1(a[0].as_string(""));
        if (!bytes) r.bad("REDUCE" + where + " of '_codecs.encode' with a str past U+00FF (Python raises)");
        r.push(pickle_value::byte_string(*bytes));
      } else if (b == "bytes" && a.empty()) {
        r.push(pickle_value::byte_string(""));
      } else if (b == "bytearray" &&
                 (a.empty() || (a.size() == 1 && a[0].type() == k::bytes && !a[0].as_bytes("").bytearray))) {
        // bytearray() and bytearray(bytes), as protocol 2 writes a bytearray
        r.push(pickle_value::byte_string(a.empty() ? std::string() : a[0].as_bytes("").data, true));
      } else if (b == "bytearray" && a.size() == 2 && a[0].type() == k::string &&
                 (a[1] == pickle_value::string("latin1") || a[1] == pickle_value::string("latin-1"))) {
        const auto bytes = latin1(a[0].as_string(""));  // bytearray(str, 'latin-1'): older Pythons' form
        if (!bytes) r.bad("REDUCE" + where + " of 'bytearray' with a str past U+00FF (Python raises)");
        r.push(pickle_value::byte_string(*bytes, true));
      } else if (state_dict && name.starts_with("torch._utils._rebuild_parameter") && a.size() >= 3 &&
                 a[0].find(torch_tensor_key)) {
        inert_from(3, "a state");
        r.push_sealed(a[0], "tensor");  // a Parameter is its tensor here (requires_grad and hooks are not data)
      } else {
        r.bad("REDUCE" + where + " of " + (name.empty() ? "a value" : "'" + name + "'") +
              " with arguments it does not take");
      }
      return true;
    }
    if (op == 'b' && state_dict) {  // BUILD: an OrderedDict's attributes (a state dict's _metadata), dropped
      // torch applies BUILD on a tensor (set_: another storage, offset, size): refused, as is
      // any state but {'_metadata': ...}, so that no byte range here differs from torch's load
      if (r.kind_at(1) != k::dict || r.first_key_at(1) == torch_tensor_key || r.first_key_at(1) == torch_storage_key)
        r.bad("BUILD" + where + " on a value that is not a state dict");
      const auto state = r.pop_value();
      if (state.type() != k::dict || state.dict_size() != 1 || state.dict_key(0) != pickle_value::string("_metadata"))
        r.bad("BUILD" + where + " with a state other than {'_metadata': ...}");
      return true;
    }
    return false;
  }
};

/// The tensor a torch.save pickle's value v describes (what torch_tensor_pickle_policy makes of
/// _rebuild_tensor_v2 / _v3); `what` names it in messages.
SHARDSAFE_DECL torch_zip_tensor torch_tensor_of(const pickle_value& v, std::string_view what);

/// A value of a torch.save pickle as Python's repr() writes it (pickle_repr), where the objects
/// torch_tensor_pickle_policy made stand as they would be to a user, never as the dicts that
/// carry them (whose first key is not UTF-8): a storage `<torch.FloatStorage '0' of size 4>`
/// (its class, its key in the archive, its elements), a tensor `<tensor of size (2, 3) over
/// torch.FloatStorage '0' of size 6>`, a dtype or memory format by its name (`torch.float32`,
/// as torch writes it), another global `<class 'collections.OrderedDict'>`. At most max_chars.
SHARDSAFE_DECL std::string torch_value_repr(const pickle_value& v, std::size_t max_chars);

/// Reads a torch.save data.pkl holding one tensor; `what` names it in messages.
inline torch_zip_tensor parse_torch_tensor_pickle(std::string_view bytes, std::string_view what) {
  return torch_tensor_of(pickle_loads(bytes, what, torch_tensor_pickle_policy{}), what);
}

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/format/impl/torch_tensor_pickle.ipp"
#endif
