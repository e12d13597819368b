// tools/commands/digest.hpp - `shardsafe digest PATH`: one line per tensor, sorted by name,
// "NAME DTYPE [SHAPE] SHA256" of the tensor's bytes in row-major order, whichever way PATH
// stores them (docs/FORMAT.md §4).
#pragma once

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "../input.hpp"
#include "../print.hpp"
#include "../sha256.hpp"
#include "shardsafe/checkpoint/unshard.hpp"

namespace shardsafe::tool {

/// The bytes read at once.
inline constexpr std::uint64_t chunk_bytes = std::uint64_t(64) << 20;

/// The SHA-256 of bytes [off, off + len) of s, read in chunks (counted on pr).
template <ReadableStorage S>
std::string hash_range(const S& s, std::uint64_t off, std::uint64_t len, progress& pr) {
  tool::sha256 h;
  std::vector<std::byte> buf(static_cast<std::size_t>(std::min(len, chunk_bytes)));
  for (std::uint64_t done = 0; done < len;) {
    const std::uint64_t n = std::min<std::uint64_t>(buf.size(), len - done);
    std::span<std::byte> b(buf.data(), static_cast<std::size_t>(n));
    s.read_into(off + done, b);
    h.update(b);
    done += n;
    pr.add(n);
  }
  return h.hex();
}

template <ReadableDirectory D>
int cmd_digest(const input<D>& in) {
  struct line {
    std::string name;
    dtype type;
    shape_t shape;
    std::string hex;
  };
  std::vector<line> out;
  // a folder of whole files' tensors are hashed as raw ranges, as its files hold each tensor in
  // order; one whose torch.save file holds a transposed tensor goes through the reader below
  std::optional<hf_folder<D>> hf;
  if (in.k == kind::whole_files)
    if (auto h = open_hf(in); !stores_permuted(h)) hf.emplace(std::move(h));
  if (in.k == kind::file && !is_torch_save_file(open_file(in))) {
    const auto s = open_file(in);
    auto h = read_safetensors_header(s);
    progress pr("digest", h.data_size);
    for (const auto& t : h.tensors)
      out.push_back({t.name, t.type, t.shape, hash_range(s, h.offset_of(t), t.nbytes(), pr)});
  } else if (hf) {
    const auto& h = *hf;
    std::uint64_t total = 0;
    for (const auto& [n, at] : h.tensors) total += h.entry(at).nbytes();
    progress pr("digest", total);
    for (const auto& [n, at] : h.tensors) {
      const tensor_entry& t = h.entry(at);
      const auto& f = h.files[at.file];
      out.push_back({n, t.type, t.shape, hash_range(f.storage, f.header.offset_of(t), t.nbytes(), pr)});
    }
  } else {
    auto parts = open_checkpoint(in);
    // an item whose value holds tensors, or a tensor of a dtype shardsafe has no type for, is
    // refused, not left out of the digest (unshard and the exports check the same in the library)
    for (auto& p : parts) p.reader->check_all_readable();
    std::uint64_t total = 0;
    for (auto& p : parts)
      for (const auto& [k, tm] : p.reader->metadata().tensors) total += tm.numel() * bit_size(tm.type) / 8;
    progress pr("digest", total);
    for (auto& p : parts)
      for (const auto& [key, tm] : p.reader->metadata().tensors) {
        tool::sha256 h;
        for_each_full_chunk(*p.reader, key, [&](std::span<const std::byte> b, std::uint64_t) {
          h.update(b);
          pr.add(b.size());
        });
        out.push_back({p.prefix + key, tm.type, tm.shape, h.hex()});
      }
  }
  std::sort(out.begin(), out.end(), [](const line& a, const line& b) { return a.name < b.name; });
  for (const auto& l : out)
    std::cout << one_line(l.name) << ' ' << to_string(l.type) << ' ' << shape_str(l.shape) << ' ' << l.hex << '\n';
  return 0;
}

}  // namespace shardsafe::tool
