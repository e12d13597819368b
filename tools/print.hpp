// tools/print.hpp - how the shardsafe tool writes what it found: one line per message (control
// bytes from the input escaped), the table of inspect, the progress line on a terminal, and the
// phrases several commands print (how a tensor is sharded, what a safetensors output left out,
// the rename rules' warnings). The texts are the tool's contract (docs/FORMAT.md §4).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/hex.hpp"
#include "shardsafe/format/checkpoint_metadata.hpp"
#include "shardsafe/format/rename.hpp"

namespace shardsafe::tool {

/// A message as one line of text: control characters (a newline or an escape sequence in a
/// tensor or file name read from the input) are written as \n, \r, \t or \xHH.
inline std::string one_line(std::string_view s) {
  std::string r;
  for (unsigned char c : s) {
    if (c == '\n')
      r += "\\n";
    else if (c == '\r')
      r += "\\r";
    else if (c == '\t')
      r += "\\t";
    else if (c < 0x20 || c == 0x7f) {
      r += "\\x";
      shardsafe::detail::append_hex(r, c, 2);
    } else
      r += static_cast<char>(c);
  }
  return r;
}

/// "\r[what] done/total" on stderr, at most ten times a second, only on a terminal.
class progress {
 public:
  progress(std::string what, std::uint64_t total) : what_(std::move(what)), total_(total), tty_(::isatty(2) == 1) {}
  ~progress() {
    if (tty_ && shown_) std::fprintf(stderr, "\r\033[K");
  }
  void add(std::uint64_t n) { set(done_ + n, total_); }
  void set(std::uint64_t done, std::uint64_t total) {
    done_ = done;
    total_ = total;
    if (!tty_) return;
    auto now = std::chrono::steady_clock::now();
    if (shown_ && now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    shown_ = true;
    std::fprintf(stderr, "\r\033[K[%s] %.1f / %.1f MB (%.0f%%)", what_.c_str(), double(done_) / 1e6,
                 double(total_) / 1e6, total_ ? 100.0 * double(done_) / double(total_) : 100.0);
  }

 private:
  std::string what_;
  std::uint64_t total_, done_ = 0;
  bool tty_, shown_ = false;
  std::chrono::steady_clock::time_point last_{};
};

inline std::string shape_str(std::span<const std::uint64_t> s) { return shardsafe::to_string(s); }

/// The distinct files tm's parts are in: how many, and the first `shown` of them in order (a DCP
/// file holding two chunks of a tensor is listed under two names: checkpoint_reader::path_of).
/// A grid's parts are distinct files (its ranks are: validate), counted, not listed: O(shown).
struct stored_files {
  std::size_t count = 0;
  std::vector<std::string> first;
};
template <class Reader>
stored_files files_of(const tensor_metadata& tm, const Reader& r, std::size_t shown) {
  stored_files out;
  if (tm.grid) {
    out.count = static_cast<std::size_t>(tm.grid->part_count());
    tm.for_each_file([&](const std::string& f, const shard_spec&) {
      out.first.push_back(r.path_of(f));
      return out.first.size() < shown;
    });
    return out;
  }
  std::set<std::string_view> seen;
  for (const auto& [f, s] : tm.files) {
    const std::string& p = r.path_of(f);
    if (!seen.insert(p).second) continue;
    if (out.first.size() < shown) out.first.push_back(p);
    ++out.count;
  }
  return out;
}

/// "blocks over 3 file(s)"; "blocks (4) over 3 file(s)" when a file holds two parts.
inline std::string describe_sharding(const tensor_metadata& tm, std::size_t files) {
  if (!tm.is_sharded) return "not sharded";
  if (tm.grid)
    return std::string(tm.grid->flat ? "flattened offsets" : "blocks") + " over " + std::to_string(files) +
           " file(s), a grid";
  bool flat = true, block = true;
  for (const auto& [f, s] : tm.files) {
    flat = flat && s.is_flat();
    block = block && s.is_block();
  }
  std::string how = flat ? "flattened offsets" : block ? "blocks" : "flattened offsets and blocks";
  if (tm.files.size() != files) how += " (" + std::to_string(tm.files.size()) + ")";
  return how + " over " + std::to_string(files) + " file(s)";
}

/// One line of inspect's table.
struct row {
  std::string name, dtype, shape, bytes, stored, sharding;
};

/// The title (each of its lines after '# ' as given, escaped) and the rows sorted by name, in
/// columns: NAME DTYPE SHAPE BYTES STORED SHARDING.
inline void print_rows(const std::string& title, std::vector<row> rows) {
  // every field that came from the input (names, file names) escaped, one way: no control
  // byte from a checkpoint reaches the terminal
  for (auto& r : rows)
    for (std::string* f : {&r.name, &r.dtype, &r.shape, &r.bytes, &r.stored, &r.sharding}) *f = one_line(*f);
  std::sort(rows.begin(), rows.end(), [](const row& a, const row& b) { return a.name < b.name; });
  // the title's lines, each escaped (a __metadata__ value may hold a newline)
  std::size_t start = 0;
  while (true) {
    const std::size_t nl = title.find('\n', start);
    std::cout << one_line(title.substr(start, nl == std::string::npos ? std::string::npos : nl - start)) << "\n";
    if (nl == std::string::npos) break;
    start = nl + 1;
  }
  row head{"NAME", "DTYPE", "SHAPE", "BYTES", "STORED", "SHARDING"};
  std::size_t w[5] = {4, 5, 5, 5, 6};
  for (const auto& r : rows) {
    w[0] = std::max(w[0], r.name.size());
    w[1] = std::max(w[1], r.dtype.size());
    w[2] = std::max(w[2], r.shape.size());
    w[3] = std::max(w[3], r.bytes.size());
    w[4] = std::max(w[4], r.stored.size());
  }
  auto line = [&](const row& r) {
    auto pad = [](const std::string& s, std::size_t n) { return s + std::string(n - s.size() + 2, ' '); };
    std::cout << pad(r.name, w[0]) << pad(r.dtype, w[1]) << pad(r.shape, w[2]) << pad(r.bytes, w[3])
              << pad(r.stored, w[4]) << r.sharding << "\n";
  };
  line(head);
  for (const auto& r : rows) line(r);
}

/// What a safetensors output leaves out of parts (each with a reader): "; N non-tensor item(s)
/// left out (...)", or "".
template <class Parts>
std::string left_out(const Parts& parts) {
  std::size_t n = 0;
  for (const auto& p : parts) n += p.reader->non_tensors().size();
  return n ? "; " + std::to_string(n) + " non-tensor item(s) left out (safetensors holds tensors; to-dcp keeps them)"
           : std::string();
}

/// The warnings of the rules that have one (a preset's): for each, how many names it decided and
/// the first few of them, `shardsafe: warning: N name(s) WARNING: OLD -> NEW, ...`, a line each;
/// printed once the export succeeded (a failed one prints its one error line alone).
inline std::string rename_warnings(const std::vector<std::string>& keys, const rename_rules& rules) {
  std::string out;
  std::map<const rename_rule*, std::vector<std::string>> hits;
  for (const auto& k : keys) {
    const rename_rule* by = nullptr;
    const std::string n = rules.apply(k, &by);
    if (by && !by->warning.empty()) hits[by].push_back(n.empty() ? k : k + " -> " + n);
  }
  for (const auto& r : rules.rules())
    if (auto it = hits.find(&r); it != hits.end()) {
      std::string list;
      for (std::size_t i = 0; i < it->second.size() && i < 5; ++i) list += (i ? ", " : "") + one_line(it->second[i]);
      if (it->second.size() > 5) list += ", ...";
      out += "shardsafe: warning: " + std::to_string(it->second.size()) + " name(s) " + r.warning + ": " + list + "\n";
    }
  return out;
}

}  // namespace shardsafe::tool
