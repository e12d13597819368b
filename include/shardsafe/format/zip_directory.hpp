// shardsafe/format/zip_directory.hpp - the records of a stored zip archive (a torch.save file
// or archive), found the way a zip reader finds them: the end-of-central-directory record (zip64
// too), the central directory, then each record's local header, whose name and extra field
// give where its bytes start. Only the ranges needed are read, through `read_at(offset, n)`;
// `bad(rule)` throws naming the archive. format/torch_zip.hpp and format/torch_save.hpp read
// their archives with it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/detail/checked.hpp"
#include "shardsafe/detail/checksum.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// A record of the archive: its name and where its bytes are (from the archive's first byte).
struct torch_zip_record {
  std::string name;
  std::uint64_t data_offset = 0;
  std::uint64_t size = 0;
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
    if (at <= off && off - at <= buf.size() && n <= buf.size() - (off - at))
      return buf.substr(static_cast<std::size_t>(off - at), n);
    if (!ahead || off >= end) return read_at(off, n);
    at = off;
    buf = read_at(off,
                  static_cast<std::size_t>(std::max<std::uint64_t>(n, std::min<std::uint64_t>(64 << 10, end - off))));
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

/// The central directory of a zip archive of `length` bytes read through read_at: its records
/// (those kept) and where it starts (the first byte no record's bytes may reach).
struct zip_directory {
  std::vector<zip_entry> entries;
  std::uint64_t at = 0;
};

/// name with A-Z as a-z.
inline std::string fold_case(std::string name) {
  for (char& ch : name)
    if (ch >= 'A' && ch <= 'Z') ch = static_cast<char>(ch - 'A' + 'a');
  return name;
}

/// Keeps every record (read_zip_directory's default).
struct zip_keep_all {
  bool operator()(std::string_view) const noexcept { return true; }
};

/// Calls f(i, entry) for each of the first `entries` records of the central directory
/// [cd_at, cd_at + cd_size), read through a window of 1 MiB (a longer record alone), so that
/// what is held at once is one window, whatever the directory's size.
template <class ReadAt, class Bad, class F>
void for_each_zip_record(std::uint64_t cd_at, std::uint64_t cd_size, std::uint64_t entries, ReadAt& read_at, Bad& bad,
                         F&& f) {
  constexpr std::uint64_t window = std::uint64_t(1) << 20;
  std::string buf;
  std::uint64_t buf_at = 0, p = 0;  // offsets in the directory: of buf's first byte, of the next record
  auto bytes = [&](std::uint64_t n) -> std::string_view {  // up to n bytes at p (fewer where the directory ends)
    if (p < buf_at || p - buf_at + n > buf.size()) {
      buf_at = p;
      buf = read_at(cd_at + p, static_cast<std::size_t>(std::min(cd_size - p, std::max(n, window))));
    }
    return std::string_view(buf).substr(static_cast<std::size_t>(p - buf_at), static_cast<std::size_t>(n));
  };
  for (std::uint64_t i = 0; i < entries; ++i) {
    std::string_view cd = bytes(46);
    if (cd.size() < 46 || zip_le(cd, 0, 4) != 0x02014b50)
      bad("central directory record " + std::to_string(i) + " is damaged");
    const std::size_t n = zip_le(cd, 28, 2), x = zip_le(cd, 30, 2), c = zip_le(cd, 32, 2);
    cd = bytes(46 + n + x + c);
    if (cd.size() < 46 + n + x + c) bad("central directory record " + std::to_string(i) + " is damaged");
    zip_entry e;
    e.flags = zip_le(cd, 8, 2);
    e.method = zip_le(cd, 10, 2);
    e.csize = zip_le(cd, 20, 4);
    e.usize = zip_le(cd, 24, 4);
    e.local = zip_le(cd, 42, 4);
    e.name = std::string(cd.substr(46, n));
    // zip64 extra field: the 64-bit values of the fields that read 0xffffffff, in this order
    for (std::size_t q = 46 + n, end = q + x; end - q >= 4;) {
      const std::size_t id = zip_le(cd, q, 2), len = zip_le(cd, q + 2, 2);
      if (end - q - 4 < len) break;
      if (id == 1) {
        std::size_t at = q + 4;
        for (auto* v : {&e.usize, &e.csize, &e.local})
          if (*v == 0xffffffff) {
            if (at + 8 > q + 4 + len) bad("record '" + e.name + "': zip64 extra field is too short");
            *v = zip_le(cd, at, 8);
            at += 8;
          }
      }
      q += 4 + len;
    }
    p += 46 + n + x + c;
    f(i, std::move(e));
  }
}

/// Reads the central directory (the end record first: zip64 too), refusing more than
/// max_entries records or a directory over max_bytes; `bad` throws naming the archive. As
/// torch's reader (miniz) does, it reads as many records as the end record counts, not the
/// whole directory's bytes as Python's zipfile does: of an archive of more than 65,535 records
/// without zip64, whose 16-bit count wrapped, the records past the count are not there. The
/// directory is read a window at a time; of its records those keep(name) accepts are kept,
/// their names at most max_bytes / 4 in all.
template <class ReadAt, class Bad, class Keep = zip_keep_all>
zip_directory read_zip_directory(std::uint64_t length, ReadAt& read_at, Bad& bad, std::uint64_t max_entries,
                                 std::uint64_t max_bytes, std::string_view kind, Keep keep = {}) {
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
  std::uint64_t entries = zip_le(tail, *eocd + 10, 2), cd_size = zip_le(tail, *eocd + 12, 4),
                cd_at = zip_le(tail, *eocd + 16, 4);
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
  if (!cd_end || *cd_end > cd_end_limit)
    bad("central directory [" + std::to_string(cd_at) + ", +" + std::to_string(cd_size) + ") lies outside the archive");
  if (entries > max_entries || cd_size > max_bytes)
    bad("central directory of " + std::to_string(entries) + " records (" + std::to_string(cd_size) +
        " bytes) is too large for " + std::string(kind) + " (at most " + std::to_string(max_entries) + " records, " +
        std::to_string(max_bytes) + " bytes)");
  zip_directory out;
  out.at = cd_at;
  // torch's zip reader finds a record by its name without telling case apart (and of two alike,
  // not always the first): two names alike so would be read as other records than torch's. Each
  // name's case-folded hash is kept (16 bytes a record), the names only where two hashes meet.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> folded;  // (hash, record index)
  std::uint64_t kept_names = 0;                                 // at most max_bytes / 4
  for_each_zip_record(cd_at, cd_size, entries, read_at, bad, [&](std::uint64_t i, zip_entry&& e) {
    folded.emplace_back(xxh3_64(fold_case(e.name).data(), e.name.size()), i);
    if (!keep(std::string_view(e.name))) return;
    if ((kept_names += e.name.size()) > max_bytes / 4)
      bad("the names of the records read for " + std::string(kind) + " pass " + std::to_string(max_bytes / 4) +
          " bytes (at record " + std::to_string(i) + ")");
    out.entries.push_back(std::move(e));
  });
  std::sort(folded.begin(), folded.end());
  std::set<std::uint64_t> alike;  // the records whose hashes meet another's
  for (std::size_t k = 1; k < folded.size(); ++k)
    if (folded[k].first == folded[k - 1].first) alike.insert({folded[k - 1].second, folded[k].second});
  if (!alike.empty()) {
    std::set<std::string> seen;  // folded names
    for_each_zip_record(cd_at, cd_size, entries, read_at, bad, [&](std::uint64_t i, zip_entry&& e) {
      if (!alike.count(i)) return;
      if (!seen.insert(fold_case(e.name)).second)
        bad("holds two records named '" + e.name + "' alike, but for case (torch's reader does not tell them apart)");
    });
  }
  return out;
}

/// Where record e's bytes lie, checked against its local header (one read of the header and
/// its name): stored, not encrypted, sizes agreeing, ending before the central directory at cd_at.
template <class ReadAt, class Bad>
torch_zip_record place_zip_record(const zip_entry& e, std::uint64_t cd_at, ReadAt& read_at, Bad& bad) {
  const std::string rec = "record '" + e.name + "'";
  if (e.flags & 1) bad(rec + " is encrypted");
  if (e.method != 0)
    bad(rec + " is compressed (method " + std::to_string(e.method) + "); torch.save stores records uncompressed");
  if (e.csize != e.usize)
    bad(rec + " is stored with compressed size " + std::to_string(e.csize) + " != size " + std::to_string(e.usize));
  if (e.local > cd_at || cd_at - e.local < 30 + e.name.size())
    bad(rec + ": local header at " + std::to_string(e.local) + " lies outside the archive");
  const std::string h = read_at(e.local, 30 + e.name.size());
  if (zip_le(h, 0, 4) != 0x04034b50) bad(rec + ": no local header at byte " + std::to_string(e.local));
  if (zip_le(h, 8, 2) != e.method) bad(rec + ": local header disagrees on the compression method");
  const std::uint64_t n = zip_le(h, 26, 2), x = zip_le(h, 28, 2);
  if (n != e.name.size() || std::string_view(h).substr(30) != e.name) bad(rec + ": local header names another record");
  const std::uint64_t data = e.local + 30 + n + x;
  if (data > cd_at || cd_at - data < e.usize)
    bad(rec + ": bytes [" + std::to_string(data) + ", +" + std::to_string(e.usize) +
        ") run into the central directory at " + std::to_string(cd_at));
  return torch_zip_record{e.name, data, e.usize};
}

}  // namespace detail

}  // namespace shardsafe
