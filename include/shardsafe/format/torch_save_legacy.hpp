// shardsafe/format/torch_save_legacy.hpp - torch.save's legacy format (torch < 1.6, or
// _use_new_zipfile_serialization=False; old Hugging Face checkpoints), indexed: its magic
// number, the tar header torch.load would try first, and index_torch_save_legacy, which reads
// its five pickles and the size before each storage (the rules are at the top of
// format/torch_save.hpp, whose index_torch_save_file calls it).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/format/pickle_reader.hpp"
#include "shardsafe/format/torch_state_dict.hpp"
#include "shardsafe/format/torch_zip.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// What a torch.save file in the legacy format (torch < 1.6, or
/// _use_new_zipfile_serialization=False) begins with, after PROTO (and, from protocol 4 on, a
/// FRAME): its pickled magic number, LONG1 of 0x1950a86a20f9469cfc6c.
inline constexpr std::string_view torch_save_legacy_magic("\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19", 12);

/// The bytes of the legacy format's first pickle (the magic number, with PROTO 2 to 5, a FRAME
/// where protocol 4 or 5 writes one, and STOP) when b begins with it, else 0: at most 24 bytes
/// are looked at.
inline std::size_t torch_save_legacy_magic_size(std::string_view b) {
  if (b.size() < 2 || b[0] != '\x80' || b[1] < 2 || b[1] > 5) return 0;
  std::size_t at = 2;
  if (b.size() > at && b[at] == '\x95') at += 9;  // FRAME and its 8-byte length (index_torch_save_legacy checks it)
  if (b.size() < at + torch_save_legacy_magic.size() + 1 ||
      b.substr(at, torch_save_legacy_magic.size()) != torch_save_legacy_magic ||
      b[at + torch_save_legacy_magic.size()] != '.')
    return 0;
  return at + torch_save_legacy_magic.size() + 1;
}

namespace detail {

/// Whether Python's tarfile takes b, 512 bytes, as a tar header: its checksum field, read as
/// tarfile reads it, equals the sum of its bytes (unsigned or signed) with that field as spaces.
inline bool passes_tar_checksum(std::string_view b) {
  if (b.size() != 512 || b.find_first_not_of('\0') == std::string_view::npos) return false;
  std::int64_t sum_u = 256, sum_s = 256;
  for (std::size_t i = 0; i < 512; ++i)
    if (i < 148 || i >= 156) {
      sum_u += static_cast<unsigned char>(b[i]);
      sum_s += static_cast<signed char>(b[i]);
    }
  const std::string_view f = b.substr(148, 8);
  std::int64_t n = 0;
  if (f[0] == '\x80' || f[0] == '\xff') {  // base-256
    for (std::size_t i = 1; i < 8; ++i) n = (n << 8) | static_cast<unsigned char>(f[i]);
    if (f[0] == '\xff') n -= std::int64_t(1) << 56;
  } else {  // octal text up to a NUL, blanks around it; int(s, 8) also takes a sign, 0o and _
    std::string_view t = f.substr(0, f.find('\0'));
    while (!t.empty() && std::string_view(" \t\n\r\v\f").find(t.front()) != std::string_view::npos) t.remove_prefix(1);
    while (!t.empty() && std::string_view(" \t\n\r\v\f").find(t.back()) != std::string_view::npos) t.remove_suffix(1);
    bool neg = false;
    if (!t.empty() && (t[0] == '+' || t[0] == '-')) {
      neg = t[0] == '-';
      t.remove_prefix(1);
    }
    if (t.size() >= 2 && t[0] == '0' && (t[1] == 'o' || t[1] == 'O')) t.remove_prefix(2);
    bool digit = false;
    for (const char ch : t) {
      if (ch == '_') continue;
      if (ch < '0' || ch > '7') return false;
      n = n * 8 + (ch - '0');
      digit = true;
    }
    if (!digit && !t.empty()) return false;
    if (neg) n = -n;
  }
  return n == sum_u || n == sum_s;
}

/// The legacy format (rules at the top of format/torch_save.hpp): five pickles, then each
/// storage in the order the last lists them, an int64 of its elements before its bytes.
template <ReadableStorage S>
torch_save_index index_torch_save_legacy(const S& st, const torch_save_read_options& o = {}) {
  const std::string file(st.name());
  auto bad = [&](const std::string& rule) { fail(errc::invalid_metadata, file + ": " + rule); };
  auto read_at = [&](std::uint64_t off, std::size_t n) { return detail::read_string(st, off, n); };
  // torch.load tries torch < 0.4's tar format first, on a file whose first block tarfile takes
  // as a tar header, and then reads no pickle of this stream
  if (st.size() >= 512 && passes_tar_checksum(read_at(0, 512)))
    bad("its first 512 bytes are also a tar header, which torch.load reads first (the tar format of torch < 0.4): not "
        "read here");
  struct pickles {
    torch_state_dict_pickle sd;
    std::vector<std::string> keys;  // the storages, in the order their bytes follow
    std::uint64_t data = 0;         // where the first storage's size is
  };
  // The pickles are read from a window of the file's head, 1 MiB first, 8x larger while they
  // run past its end, up to max_torch_save_pickle.
  const std::uint64_t limit = std::min<std::uint64_t>(st.size(), max_torch_save_pickle);
  auto read_pickles = [&](std::string_view b, bool& ran_out) {
    pickles out;
    std::size_t at = torch_save_legacy_magic_size(b);
    if (at == 0) bad("does not begin with the legacy format's magic number");
    // Python reads a FRAME whole: one longer than the 13 bytes to STOP would hide the start of
    // the next pickle from torch (the reader checks the later pickles' frames itself)
    if (at > 15 && b.substr(3, 8) != std::string_view("\x0d\0\0\0\0\0\0\0", 8))
      bad("the magic number's pickle lies in a FRAME of " + std::to_string(zip_le(b, 3, 8)) +
          " bytes, not 13 (Python would skip the rest of it)");
    auto next = [&](auto& reader, auto&& f) {
      try {
        auto v = reader.run(f);
        at += reader.consumed();
        return v;
      } catch (const shardsafe::error&) {
        ran_out = reader.ran_out();
        throw;
      }
    };
    auto plain = [&](const char* what) {
      // a list of more keys than max_torch_save_storages is the named rule's to refuse (a list
      // of 2^18 and more, the reader's: its memory stays bounded)
      pickle_reader r(b.substr(at), file + ": " + what, {}, std::size_t(1) << 18);
      return next(r, [](pickle_view v) { return v.build(); });
    };
    const pickle_value version = plain("protocol version");
    if (version != pickle_value::integer(1001))
      bad("protocol version " +
          (version.type() == pickle_value::kind::integer ? std::to_string(version.as_int("")) : std::string("?")) +
          " is not 1001 (torch.save's legacy format)");
    const pickle_value info = plain("sys_info");
    if (const auto* le = info.find("little_endian"); le && *le == pickle_value::boolean(false))
      bad("was written on a big-endian machine (sys_info little_endian False); only little-endian files are read");
    const std::string w = file + ": state dict";  // "FILE: state dict: pickle <rule>"
    std::map<std::string, torch_storage_id, std::less<>> ids;
    auto reader = state_dict_pickle_reader(b.substr(at), w, true, ids, o.records);
    out.sd = next(reader, [&](pickle_view root) {
      torch_state_dict_pickle sd = flatten_torch_state_dict(root, reader.consumed(), w);
      if (o.keep_value) sd.value = root.build();
      return sd;
    });
    out.sd.storages = std::move(ids);
    const pickle_value keys = plain("storage keys");
    if (keys.type() != pickle_value::kind::list)
      bad("its storage keys are a " + std::string(pickle_value::kind_name(keys.type())) + ", not a list");
    const auto& ks = keys.as_sequence("");
    if (ks.size() > max_torch_save_storages)
      bad("lists " + std::to_string(ks.size()) + " storages (at most " + std::to_string(max_torch_save_storages) +
          " are read from a torch.save file: docs/FORMAT.md §3)");
    for (const auto& k : ks) {
      if (k.type() != pickle_value::kind::string)
        bad("a storage key is a " + std::string(pickle_value::kind_name(k.type())) + ", not a str");
      out.keys.push_back(k.as_string(""));
    }
    out.data = at;
    return out;
  };
  pickles p;
  std::string b;  // the file's head the pickles were read from, kept: the first sizes lie in it
  for (std::uint64_t window = std::min<std::uint64_t>(limit, std::uint64_t(1) << 20);;
       window = std::min(limit, window * 8)) {
    b = read_at(0, static_cast<std::size_t>(window));
    bool ran_out = false;
    try {
      p = read_pickles(b, ran_out);
      break;
    } catch (const shardsafe::error&) {
      if (!ran_out || window == st.size()) throw;
      if (window == limit)
        bad("its pickles run past the first " + std::to_string(limit) + " bytes (at most " +
            std::to_string(max_torch_save_pickle) + " bytes of pickle are read)");
    }
  }
  // each storage's bytes, in the listed order: its elements of the type its first persistent id
  // gives (where it stands: torch reads every listed storage, a tensor's or not)
  // (KEY, where its bytes start, their size), sorted by KEY once all are placed: 32 bytes a
  // storage, where a map of records took about 150; a record is made when a tensor asks (2^20
  // storages, issue 53)
  struct placed_storage {
    std::string_view key;
    std::uint64_t at, size;
  };
  std::vector<placed_storage> storages;
  storages.reserve(p.keys.size());
  std::unordered_set<std::string_view> listed;
  // from the head already read, then 64 KiB at a time: small storages lie close together
  read_window<decltype(read_at)> sizes{read_at, std::move(b), 0};
  std::uint64_t pos = p.data;
  for (const std::string& key : p.keys) {
    const std::string rec = "storage '" + key + "'";
    const auto id = p.sd.storages.find(key);
    if (id == p.sd.storages.end()) bad(rec + " of the storage list is named nowhere in the pickle");
    const auto type = torch_tensor_pickle_policy::storage_type_of(id->second.type);
    if (!type) bad(rec + ": its type '" + id->second.type + "' is not a torch storage class");
    const std::uint64_t item = *type ? item_size(**type) : 1;
    if (st.size() - pos < 8)
      bad(rec + ": its size at byte " + std::to_string(pos) + " runs past the file's end (truncated?)");
    const std::uint64_t numel = zip_le(sizes(pos, 8, st.size()), 0, 8);
    if (numel != id->second.numel)
      bad(rec + ": the file says " + std::to_string(numel) + " elements at byte " + std::to_string(pos) +
          " but its persistent id says " + std::to_string(id->second.numel));
    const auto bytes = checked_mul(numel, item);
    if (!bytes || *bytes > st.size() - pos - 8)
      bad(rec + ": its " + std::to_string(numel) + " elements at byte " + std::to_string(pos + 8) +
          " run past the file's end (" + std::to_string(st.size()) + " bytes: truncated?)");
    if (!listed.insert(key).second) bad(rec + " is listed twice");
    storages.push_back({key, pos + 8, *bytes});
    pos += 8 + *bytes;
  }
  listed = {};
  std::sort(storages.begin(), storages.end(),  // keys distinct
            [](const placed_storage& a, const placed_storage& b) { return a.key < b.key; });
  return index_state_dict_tensors(
      file, st.size(), std::move(p.sd), [&](const std::string& key, auto& tbad) -> torch_zip_record {
        const auto s = std::lower_bound(storages.begin(), storages.end(), std::string_view(key),
                                        [](const placed_storage& a, std::string_view k) { return a.key < k; });
        if (s == storages.end() || s->key != key) tbad("its storage '" + key + "' is not in the file's storage list");
        return torch_zip_record{"storage '" + key + "'", s->at, s->size};
      });
}

}  // namespace detail

}  // namespace shardsafe
