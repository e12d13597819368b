// shardsafe/format/torch_zip.hpp - the storage record of one torch.save archive (a zip), as each
// chunk of a torch DCP `.distcp` file is (docs/FORMAT.md §5, issue 11).
//
// torch.save writes a zip of `PREFIX/data.pkl` (the pickled tensor), `PREFIX/data/KEY` (the
// storage bytes, stored, not compressed) and `PREFIX/version` (newer torch adds a few more
// records). The storage is found the way a zip reader does: the end-of-central-directory record
// (zip64 too), the central directory, then the record's local header, whose name and extra field
// give where its bytes start. Only the ranges needed are read, through `read_at(offset, n)`, so
// a reader of a large chunk never reads its data to find it.
//
// Rules (errc::invalid_metadata, naming the archive, the record and the rule):
//   - an end-of-central-directory record whose central directory lies inside the archive, with
//     at most 1024 records;
//   - exactly one record named `*/data/*`; it is stored (method 0), not encrypted, its sizes
//     agree, its local header carries the same name, and its bytes end before the central
//     directory; when the caller knows the chunk's bytes, the record holds exactly that many;
//   - data.pkl (read by torch_zip_tensor_info through an allowlist: torch._utils._rebuild_tensor_v2
//     and _v3 (torch 2.x's float8 and wide unsigned types: an UntypedStorage and the dtype),
//     torch.<T>Storage, torch.storage.UntypedStorage, torch.<dtype>, collections.OrderedDict) describes a tensor at storage offset 0,
//     dense (row-major, or its dimensions stored in another order: channels_last, transposed),
//     whose storage is the record.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/format/dcp_unpickler.hpp"
#include "shardsafe/format/pickle_reader.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// A record of the archive: its name and where its bytes are (from the archive's first byte).
struct torch_zip_record {
  std::string name;
  std::uint64_t data_offset = 0;
  std::uint64_t size = 0;
};

/// The records of a torch.save archive that a reader needs.
struct torch_zip_archive {
  torch_zip_record storage;                ///< PREFIX/data/KEY
  std::optional<torch_zip_record> pickle;  ///< PREFIX/data.pkl, when present and stored
};

namespace detail {

/// n bytes of st at off, as a string (what a zip reader parses its headers from).
template <ReadableStorage S>
std::string read_string(const S& st, std::uint64_t off, std::size_t n) {
  std::string out(n, '\0');
  st.read_into(off, std::as_writable_bytes(std::span<char>(out.data(), out.size())));
  return out;
}

/// Reads through one window kept between calls (headers and sizes that lie close together in a
/// file): n bytes at off come from the window when it holds them; else, with `ahead`, a new
/// window of up to 64 KiB at off (never past `end`) is read, or without it the n bytes alone.
template <class ReadAt>
struct read_window {
  ReadAt& read_at;
  std::string buf;
  std::uint64_t at = 0;
  std::string operator()(std::uint64_t off, std::size_t n, std::uint64_t end, bool ahead = true) {
    if (at <= off && off - at <= buf.size() && n <= buf.size() - (off - at)) return buf.substr(static_cast<std::size_t>(off - at), n);
    if (!ahead || off >= end) return read_at(off, n);
    at = off;
    buf = read_at(off, static_cast<std::size_t>(std::max<std::uint64_t>(n, std::min<std::uint64_t>(64 << 10, end - off))));
    return buf.substr(0, n);
  }
};

inline std::uint64_t zip_le(std::string_view b, std::size_t at, std::size_t n) {
  std::uint64_t x = 0;
  for (std::size_t i = n; i-- > 0;) x = (x << 8) | static_cast<unsigned char>(b[at + i]);
  return x;
}

struct zip_entry {
  std::string name;
  std::uint64_t method = 0, flags = 0, csize = 0, usize = 0, local = 0;
};

}  // namespace detail

/// The expected_size of an archive of a pickled value (a DCP non-tensor item: torch.save(obj)
/// with no tensor), which holds data.pkl and no storage record.
inline constexpr std::uint64_t torch_zip_value = UINT64_MAX;

/// Locates the storage record of a torch.save archive of `length` bytes read through
/// `read_at(offset, n)` (returning a std::string of exactly n bytes at that offset of the
/// archive); `what` names the archive in messages ("ckpt/__0_0.distcp [0, 747)").
/// With `expected_size`, the record must hold exactly that many bytes (numel x item size); with
/// torch_zip_value, the archive must hold a pickled value (no storage record; then only
/// `pickle` is set).
namespace detail {

/// The central directory of a zip archive of `length` bytes read through read_at: its records
/// and where it starts (the first byte no record's bytes may reach).
struct zip_directory {
  std::vector<zip_entry> entries;
  std::uint64_t at = 0;
};

/// Reads the central directory (the end record first: zip64 too), refusing more than
/// max_entries records or a directory over max_bytes; `bad` throws naming the archive.
template <class ReadAt, class Bad>
zip_directory read_zip_directory(std::uint64_t length, ReadAt& read_at, Bad& bad, std::uint64_t max_entries,
                                 std::uint64_t max_bytes, std::string_view kind) {
  constexpr std::uint64_t eocd_size = 22, max_comment = 65535;
  if (length < eocd_size) bad("zip archive of " + std::to_string(length) + " bytes is shorter than its end record");
  // torch writes no archive comment, so the end record is in the last few bytes: look there
  // first (a reader that caches the archive's ends then serves it), then in the largest tail a
  // comment allows
  std::uint64_t tail_len = 0;
  std::string tail;
  std::optional<std::size_t> eocd;
  for (const std::uint64_t want : {std::uint64_t(1024), eocd_size + max_comment}) {
    if (tail_len == length || (tail_len != 0 && want <= tail_len)) break;
    tail_len = std::min<std::uint64_t>(length, want);
    tail = read_at(length - tail_len, static_cast<std::size_t>(tail_len));
    for (std::size_t i = tail.size() - eocd_size + 1; i-- > 0;)
      if (zip_le(tail, i, 4) == 0x06054b50 && zip_le(tail, i + 20, 2) == tail.size() - i - eocd_size) {
        eocd = i;
        break;
      }
    if (eocd) break;
  }
  if (!eocd) bad("no zip end-of-central-directory record (not a torch.save archive, or truncated)");
  const std::uint64_t eocd_at = length - tail_len + *eocd;
  std::uint64_t entries = zip_le(tail, *eocd + 10, 2), cd_size = zip_le(tail, *eocd + 12, 4), cd_at = zip_le(tail, *eocd + 16, 4);
  std::uint64_t cd_end_limit = eocd_at;
  if (entries == 0xffff || cd_size == 0xffffffff || cd_at == 0xffffffff) {  // zip64
    if (eocd_at < 20) bad("zip64 end record locator is missing");
    const std::string loc = read_at(eocd_at - 20, 20);
    if (zip_le(loc, 0, 4) != 0x07064b50) bad("zip64 end record locator is missing");
    const std::uint64_t z = zip_le(loc, 8, 8);
    if (z > eocd_at - 20 || eocd_at - 20 - z < 56) bad("zip64 end record lies outside the archive");
    const std::string rec = read_at(z, 56);
    if (zip_le(rec, 0, 4) != 0x06064b50) bad("zip64 end record has a bad signature");
    entries = zip_le(rec, 32, 8);
    cd_size = zip_le(rec, 40, 8);
    cd_at = zip_le(rec, 48, 8);
    cd_end_limit = z;
  }
  const auto cd_end = checked_add(cd_at, cd_size);
  if (!cd_end || *cd_end > cd_end_limit) bad("central directory [" + std::to_string(cd_at) + ", +" + std::to_string(cd_size) + ") lies outside the archive");
  if (entries > max_entries || cd_size > max_bytes)
    bad("central directory of " + std::to_string(entries) + " records (" + std::to_string(cd_size) + " bytes) is too large for " +
        std::string(kind) + " (at most " + std::to_string(max_entries) + " records, " + std::to_string(max_bytes) + " bytes)");
  const std::string cd = read_at(cd_at, static_cast<std::size_t>(cd_size));

  zip_directory out;
  out.at = cd_at;
  std::vector<zip_entry>& all = out.entries;
  all.reserve(static_cast<std::size_t>(std::min(entries, cd_size / 46)));  // a record takes at least 46 bytes
  std::size_t p = 0;
  for (std::uint64_t i = 0; i < entries; ++i) {
    if (cd.size() - p < 46 || zip_le(cd, p, 4) != 0x02014b50) bad("central directory record " + std::to_string(i) + " is damaged");
    zip_entry e;
    e.flags = zip_le(cd, p + 8, 2);
    e.method = zip_le(cd, p + 10, 2);
    e.csize = zip_le(cd, p + 20, 4);
    e.usize = zip_le(cd, p + 24, 4);
    const std::size_t n = zip_le(cd, p + 28, 2), x = zip_le(cd, p + 30, 2), c = zip_le(cd, p + 32, 2);
    e.local = zip_le(cd, p + 42, 4);
    if (cd.size() - p - 46 < n + x + c) bad("central directory record " + std::to_string(i) + " is damaged");
    e.name = cd.substr(p + 46, n);
    // zip64 extra field: the 64-bit values of the fields that read 0xffffffff, in this order
    for (std::size_t q = p + 46 + n, end = q + x; end - q >= 4;) {
      const std::size_t id = zip_le(cd, q, 2), len = zip_le(cd, q + 2, 2);
      if (end - q - 4 < len) break;
      if (id == 1) {
        std::size_t f = q + 4;
        for (auto* v : {&e.usize, &e.csize, &e.local})
          if (*v == 0xffffffff) {
            if (f + 8 > q + 4 + len) bad("record '" + e.name + "': zip64 extra field is too short");
            *v = zip_le(cd, f, 8);
            f += 8;
          }
      }
      q += 4 + len;
    }
    all.push_back(std::move(e));
    p += 46 + n + x + c;
  }
  // torch's zip reader finds a record by its name without telling case apart (and of two alike,
  // not always the first): two names alike so would be read as other records than torch's
  std::set<std::string> names;
  for (const auto& e : all) {
    std::string folded = e.name;
    for (char& ch : folded)
      if (ch >= 'A' && ch <= 'Z') ch = static_cast<char>(ch - 'A' + 'a');
    if (!names.insert(std::move(folded)).second)
      bad("holds two records named '" + e.name + "' alike, but for case (torch's reader does not tell them apart)");
  }
  return out;
}

/// Where record e's bytes lie, checked against its local header (one read of the header and
/// its name): stored, not encrypted, sizes agreeing, ending before the central directory at cd_at.
template <class ReadAt, class Bad>
torch_zip_record place_zip_record(const zip_entry& e, std::uint64_t cd_at, ReadAt& read_at, Bad& bad) {
  const std::string rec = "record '" + e.name + "'";
  if (e.flags & 1) bad(rec + " is encrypted");
  if (e.method != 0) bad(rec + " is compressed (method " + std::to_string(e.method) + "); torch.save stores records uncompressed");
  if (e.csize != e.usize) bad(rec + " is stored with compressed size " + std::to_string(e.csize) + " != size " + std::to_string(e.usize));
  if (e.local > cd_at || cd_at - e.local < 30 + e.name.size())
    bad(rec + ": local header at " + std::to_string(e.local) + " lies outside the archive");
  const std::string h = read_at(e.local, 30 + e.name.size());
  if (zip_le(h, 0, 4) != 0x04034b50) bad(rec + ": no local header at byte " + std::to_string(e.local));
  if (zip_le(h, 8, 2) != e.method) bad(rec + ": local header disagrees on the compression method");
  const std::uint64_t n = zip_le(h, 26, 2), x = zip_le(h, 28, 2);
  if (n != e.name.size() || std::string_view(h).substr(30) != e.name) bad(rec + ": local header names another record");
  const std::uint64_t data = e.local + 30 + n + x;
  if (data > cd_at || cd_at - data < e.usize)
    bad(rec + ": bytes [" + std::to_string(data) + ", +" + std::to_string(e.usize) + ") run into the central directory at " + std::to_string(cd_at));
  return torch_zip_record{e.name, data, e.usize};
}

}  // namespace detail

template <class ReadAt>
torch_zip_archive locate_torch_zip(std::uint64_t length, ReadAt&& read_at, std::string_view what,
                                   std::optional<std::uint64_t> expected_size = std::nullopt) {
  auto bad = [&](const std::string& rule) { fail(errc::invalid_metadata, std::string(what) + ": " + rule); };
  const detail::zip_directory dir = detail::read_zip_directory(length, read_at, bad, 1024, 1 << 20, "a torch.save archive of one value");
  const std::vector<detail::zip_entry>& all = dir.entries;
  const std::uint64_t cd_at = dir.at;
  auto place = [&](const detail::zip_entry& e) { return detail::place_zip_record(e, cd_at, read_at, bad); };

  torch_zip_archive out;
  std::vector<const detail::zip_entry*> storages;
  for (const auto& e : all) {
    const auto d = e.name.find("/data/");
    if (d == std::string::npos || d == 0 || e.name.find('/', d + 6) != std::string::npos || e.name.size() == d + 6) continue;
    storages.push_back(&e);
  }
  if (expected_size == torch_zip_value) {  // a pickled value: PREFIX/data.pkl alone
    if (!storages.empty())
      bad("holds " + std::to_string(storages.size()) + " storage record" + (storages.size() > 1 ? "s" : "") + " ('" +
          storages.front()->name + "'" + (storages.size() > 1 ? ", ..." : "") +
          "): a non-tensor item whose value holds tensors, which only torch can unpickle (torch 1.13 saves a nested dict, "
          "and torch 2.x one saved with flatten_state_dict=False, as such an item): shardsafe reads tensors from a DCP "
          "folder's tensor entries only; save the state dict flattened");
    const detail::zip_entry* pkl = nullptr;
    for (const auto& e : all)
      if (e.name.ends_with("/data.pkl") && e.name.find('/') == e.name.size() - 9) {
        if (pkl) bad("holds two pickles, '" + pkl->name + "' and '" + e.name + "'");
        pkl = &e;
      }
    if (!pkl) bad("holds no PREFIX/data.pkl");
    out.pickle = place(*pkl);
    return out;
  }
  if (storages.size() > 1)
    bad("holds two storage records, '" + storages[0]->name + "' and '" + storages[1]->name + "' (a DCP chunk holds one tensor)");
  if (storages.empty()) bad("holds no storage record (PREFIX/data/KEY)");
  const detail::zip_entry* storage = storages.front();
  out.storage = place(*storage);
  if (expected_size && out.storage.size != *expected_size)
    bad("record '" + out.storage.name + "' holds " + std::to_string(out.storage.size) + " bytes but the chunk needs " + std::to_string(*expected_size));
  const std::string pkl = storage->name.substr(0, storage->name.find("/data/")) + "/data.pkl";
  for (const auto& e : all)
    if (e.name == pkl) out.pickle = place(e);
  return out;
}

/// The same, on an archive held in memory.
inline torch_zip_archive locate_torch_zip(std::string_view archive, std::string_view what,
                                          std::optional<std::uint64_t> expected_size = std::nullopt) {
  return locate_torch_zip(
      archive.size(), [&](std::uint64_t off, std::size_t n) { return std::string(archive.substr(static_cast<std::size_t>(off), n)); },
      what, expected_size);
}

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
inline constexpr std::string_view torch_tensor_key = "\xff" "tensor", torch_storage_key = "\xff" "storage";

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
  /// The dtype of storage class `n` (after "torch."): nullopt if not one, {nullopt} if untyped.
  static std::optional<std::optional<dtype>> storage_type(std::string_view n) {
    static constexpr std::pair<std::string_view, dtype> table[] = {
        {"FloatStorage", dtype::F32}, {"DoubleStorage", dtype::F64}, {"HalfStorage", dtype::F16},
        {"BFloat16Storage", dtype::BF16}, {"LongStorage", dtype::I64}, {"IntStorage", dtype::I32},
        {"ShortStorage", dtype::I16}, {"CharStorage", dtype::I8}, {"ByteStorage", dtype::U8},
        {"BoolStorage", dtype::BOOL}, {"ComplexFloatStorage", dtype::C64}};
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
  template <class Reader>
  bool on_opcode(Reader& r, unsigned char op, std::size_t at) const {
    const auto where = " at byte " + std::to_string(at);
    using k = pickle_value::kind;
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
                      (state_dict && (full == "torch._utils._rebuild_parameter" || full == "torch._utils._rebuild_parameter_with_state")) ||
                      storage_type_of(full);
      if (!ok) r.bad("refers to global '" + full + "'" + where + ", which is not on the torch.save tensor allowlist");
      r.push(dcp_unpickle_policy::marker(full));
      return true;
    }
    if (op == 'Q') {  // BINPERSID
      const auto pid = r.pop_value();
      const auto* t = pid.type() == k::tuple ? &pid.as_sequence("") : nullptr;
      if (!t || t->size() != (legacy ? 6 : 5) || (*t)[0] != pickle_value::string("storage") || (*t)[2].type() != k::string ||
          (*t)[4].type() != k::integer || (*t)[4].as_int("") < 0 || dcp_unpickle_policy::marker_name((*t)[1]).empty())
        r.bad("BINPERSID" + where + " is not ('storage', type, key, location, numel" + (legacy ? ", view_metadata)" : ")"));
      if (legacy && (*t)[5].type() != k::none)
        r.bad("BINPERSID" + where + " is a view into another storage (its view_metadata is not None), which torch.save "
              "does not write; not read here");
      if (storages) {
        const std::string& key = (*t)[2].as_string("");
        const torch_storage_id id{dcp_unpickle_policy::marker_name((*t)[1]), static_cast<std::uint64_t>((*t)[4].as_int("")), at};
        const auto [first, fresh] = storages->try_emplace(key, id);
        if (!fresh && (first->second.type != id.type || first->second.numel != id.numel))
          r.bad("BINPERSID" + where + " names storage '" + key + "' as " + std::to_string(id.numel) + " of " + id.type +
                ", the one at byte " + std::to_string(first->second.at) + " as " + std::to_string(first->second.numel) + " of " +
                first->second.type + " (torch would view the first as both)");
      }
      r.push_sealed(pickle_value::dict({{pickle_value::string(std::string(torch_storage_key)), (*t)[2]},
                                        {pickle_value::string("type"), pickle_value::string(dcp_unpickle_policy::marker_name((*t)[1]))},
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
            r.bad("REDUCE" + where + " of '" + name + "' with " + what + " that is not empty (torch would apply it to the tensor: " +
                  "a conjugate or negative view, or a changed attribute); not read here");
      };
      if (name == "collections.OrderedDict" && a.empty()) {
        r.push(pickle_value::dict());
      } else if (name == "torch._utils._rebuild_tensor_v2" && a.size() >= 4 && a[0].find(torch_storage_key)) {
        inert_from(6, "metadata");
        r.push_sealed(pickle_value::dict({{pickle_value::string(std::string(torch_tensor_key)), a[0]}, {pickle_value::string("offset"), a[1]},
                                          {pickle_value::string("size"), a[2]}, {pickle_value::string("stride"), a[3]}}),
                      "tensor");
      } else if (name == "torch._utils._rebuild_tensor_v3" && a.size() >= 7 && a[0].find(torch_storage_key) &&
                 dcp_unpickle_policy::marker_name(a[6]).starts_with("torch.")) {
        // torch 2.x, dtypes without a typed storage (float8, uint16/32/64): an untyped (byte)
        // storage and the dtype as the seventh argument
        inert_from(7, "metadata");
        r.push_sealed(pickle_value::dict({{pickle_value::string(std::string(torch_tensor_key)), a[0]}, {pickle_value::string("offset"), a[1]},
                                          {pickle_value::string("size"), a[2]}, {pickle_value::string("stride"), a[3]},
                                          {pickle_value::string("dtype"), pickle_value::string(dcp_unpickle_policy::marker_name(a[6]))}}),
                      "tensor");
      } else if (state_dict && name.starts_with("torch._utils._rebuild_parameter") && a.size() >= 3 && a[0].find(torch_tensor_key)) {
        inert_from(3, "a state");
        r.push_sealed(a[0], "tensor");  // a Parameter is its tensor here (requires_grad and hooks are not data)
      } else {
        r.bad("REDUCE" + where + " of " + (name.empty() ? "a value" : "'" + name + "'") + " with arguments it does not take");
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
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL torch_zip_tensor torch_tensor_of(const pickle_value& v, std::string_view what) {
  auto bad = [&](const std::string& rule) { fail(errc::invalid_metadata, std::string(what) + ": " + rule); };
  const auto* st = v.find(torch_tensor_key);
  if (!st) bad("does not hold one tensor (torch._utils._rebuild_tensor_v2)");
  auto uint = [&](const pickle_value& x, const char* field) {
    if (x.type() != pickle_value::kind::integer || x.as_int("") < 0) bad(std::string(field) + " is not a non-negative int");
    return static_cast<std::uint64_t>(x.as_int(""));
  };
  auto ints = [&](const pickle_value& x, const char* field) {
    if (x.type() != pickle_value::kind::tuple && x.type() != pickle_value::kind::list) bad(std::string(field) + " is not a tuple");
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
#else
SHARDSAFE_DECL torch_zip_tensor torch_tensor_of(const pickle_value& v, std::string_view what);
#endif

/// Reads a torch.save data.pkl holding one tensor; `what` names it in messages.
inline torch_zip_tensor parse_torch_tensor_pickle(std::string_view bytes, std::string_view what) {
  return torch_tensor_of(pickle_loads(bytes, what, torch_tensor_pickle_policy{}), what);
}

/// The order t's dimensions are stored in, outermost first, when it is dense (its elements fill
/// numel consecutive elements of its storage) but not row-major: each dimension's stride is the
/// product of the sizes stored inside it (torch.save keeps a channels_last or transposed
/// tensor's strides). Empty for row-major. Dimensions of size 1 come first in such an order
/// (where they lie does not move a byte). `bad` throws naming the rule.
template <class Bad>
std::vector<std::size_t> dense_stored_order(const torch_zip_tensor& t, std::uint64_t n, Bad&& bad) {
  if (t.stride.size() != t.size.size()) bad("stride " + to_string(t.stride) + " has another rank than size " + to_string(t.size));
  // the dimensions of size > 1 by decreasing stride (no two are equal in a dense layout), each
  // stride the product of the sizes after it in that order
  std::vector<std::size_t> order, ones;
  for (std::size_t d = 0; d < t.size.size(); ++d) (t.size[d] > 1 ? order : ones).push_back(d);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return t.stride[a] > t.stride[b]; });
  std::uint64_t dense = 1;
  for (std::size_t i = order.size(); n != 0 && i-- > 0;) {
    if (t.stride[order[i]] != dense)
      bad("stride " + to_string(t.stride) + " is not dense for size " + to_string(t.size) +
          " (a tensor read here fills its bytes in some order of its dimensions, each stride the product of the sizes "
          "stored inside it)");
    dense *= t.size[order[i]];
  }
  std::vector<std::size_t> stored;
  if (n != 0 && !std::is_sorted(order.begin(), order.end())) {
    stored = std::move(ones);
    stored.insert(stored.end(), order.begin(), order.end());
  }
  return stored;
}

/// Checks that data.pkl's tensor is the DCP chunk `sizes` of dtype `type` stored whole and dense
/// from the first byte of `storage`: the rules at the top, named in the message. Returns the
/// order its dimensions are stored in, outermost first, when it is not row-major (torch.save
/// keeps a channels_last or transposed tensor's strides: each dimension's stride is then the
/// product of the sizes stored inside it); empty for row-major. Dimensions of size 1 come first
/// in such an order (where they lie does not move a byte).
inline std::vector<std::size_t> check_torch_zip_tensor(const torch_zip_tensor& t, const torch_zip_record& storage, dtype type,
                                                       const std::vector<std::uint64_t>& sizes, std::string_view what) {
  auto bad = [&](const std::string& rule) { fail(errc::invalid_metadata, std::string(what) + ": data.pkl: " + rule); };
  if (!storage.name.ends_with("/data/" + t.storage_key)) bad("tensor's storage '" + t.storage_key + "' is not the record '" + storage.name + "'");
  if (t.type && *t.type != type) bad("storage holds " + std::string(name(*t.type)) + " but .metadata says " + std::string(name(type)));
  if (t.view_type && *t.view_type != type)
    bad("tensor is " + std::string(name(*t.view_type)) + " but .metadata says " + std::string(name(type)));
  if (t.storage_offset != 0) bad("storage offset " + std::to_string(t.storage_offset) + " is not 0");
  if (t.size != sizes) bad("size " + to_string(t.size) + " is not the chunk's sizes " + to_string(sizes));
  const auto n = detail::checked_numel(t.size);
  if (!n) bad("size " + to_string(t.size) + " overflows");
  std::vector<std::size_t> stored = dense_stored_order(t, *n, bad);
  const std::uint64_t item = t.type ? item_size(*t.type) : 1;
  const auto bytes = detail::checked_mul(t.storage_numel, item);
  if (!bytes || *bytes != storage.size)
    bad("storage of " + std::to_string(t.storage_numel) + " elements is not the " + std::to_string(storage.size) + " bytes of '" + storage.name + "'");
  const auto need = detail::checked_mul(*n, item_size(type));
  if (!need || *need != storage.size)
    bad("record '" + storage.name + "' holds " + std::to_string(storage.size) + " bytes, not the chunk's " + to_string(sizes) + " " + std::string(name(type)));
  return stored;
}

}  // namespace shardsafe
