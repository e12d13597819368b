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

/// The SHA-256 of each range rs[i] = {offset, length} of s, in order: ranges of at most 1 MiB
/// read many at a time where s takes batches (one read_batch of up to chunk_bytes: an HTTP or
/// S3 object merges them into a request per part, not one per tensor), any other alone.
template <ReadableStorage S>
std::vector<std::string> hash_ranges(const S& s, std::span<const std::pair<std::uint64_t, std::uint64_t>> rs,
                                     progress& pr) {
  std::vector<std::string> out(rs.size());
  std::size_t i = 0;
  if constexpr (BatchReadableStorage<S>) {
    std::vector<std::byte> buf;
    std::vector<read_request> batch;
    while (i < rs.size()) {
      std::size_t j = i;
      std::uint64_t used = 0;
      for (; j < rs.size() && rs[j].second <= (std::uint64_t(1) << 20) && used + rs[j].second <= chunk_bytes; ++j)
        used += rs[j].second;
      if (j == i) {
        std::vector<std::byte>().swap(buf);  // hash_range holds a chunk of its own
        out[i] = hash_range(s, rs[i].first, rs[i].second, pr);
        ++i;
        continue;
      }
      buf.resize(static_cast<std::size_t>(used));
      batch.clear();
      for (std::uint64_t at = 0, k = i; k < j; at += rs[k].second, ++k)
        batch.push_back({rs[k].first, std::span<std::byte>(buf.data() + at, static_cast<std::size_t>(rs[k].second))});
      s.read_batch(std::span<const read_request>(batch));
      for (std::size_t k = i; k < j; ++k) {
        tool::sha256 h;
        h.update(batch[k - i].dst);
        out[k] = h.hex();
        pr.add(rs[k].second);
      }
      i = j;
    }
  }
  for (; i < rs.size(); ++i) out[i] = hash_range(s, rs[i].first, rs[i].second, pr);
  return out;
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
  // (its quantized weights' scales checked as open_checkpoint checks a checkpoint's)
  if (in.k == kind::whole_files)
    if (auto h = open_hf(in); !stores_permuted(h)) {
      check_folder_quantized(in, h);
      hf.emplace(std::move(h));
    }
  if (in.k == kind::file && !is_torch_save_file(open_file(in))) {
    const auto s = open_file(in);
    auto h = read_safetensors_header(s);
    progress pr("digest", h.data_size);
    std::vector<std::pair<std::uint64_t, std::uint64_t>> rs;
    for (const auto& t : h.tensors) rs.emplace_back(h.offset_of(t), t.nbytes());
    const auto hex = hash_ranges(s, std::span<const std::pair<std::uint64_t, std::uint64_t>>(rs), pr);
    for (std::size_t i = 0; i < h.tensors.size(); ++i)
      out.push_back({h.tensors[i].name, h.tensors[i].type, h.tensors[i].shape, hex[i]});
  } else if (hf) {
    const auto& h = *hf;
    std::uint64_t total = 0;
    for (const auto& [n, at] : h.tensors) total += h.entry(at).nbytes();
    progress pr("digest", total);
    // each file's tensors hashed together (in the file's order), then listed by name below
    for (std::size_t fi = 0; fi < h.files.size(); ++fi) {
      const auto& f = h.files[fi];
      std::vector<std::pair<std::uint64_t, std::uint64_t>> rs;
      std::vector<std::pair<std::string, const tensor_entry*>> ts;
      for (const auto& [n, at] : h.tensors)
        if (at.file == fi) {
          const tensor_entry& t = h.entry(at);
          rs.emplace_back(f.header.offset_of(t), t.nbytes());
          ts.emplace_back(n, &t);
        }
      const auto hex = hash_ranges(f.storage, std::span<const std::pair<std::uint64_t, std::uint64_t>>(rs), pr);
      for (std::size_t i = 0; i < ts.size(); ++i)
        out.push_back({ts[i].first, ts[i].second->type, ts[i].second->shape, hex[i]});
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
    // small tensors are loaded many at a time (for_each_full_tensor): each tensor's chunks
    // still come in order, one tensor after another
    for (auto& p : parts) {
      std::vector<std::string> keys;
      for (const auto& [key, tm] : p.reader->metadata().tensors) keys.push_back(key);
      std::optional<tool::sha256> h;
      const std::string* cur = nullptr;
      auto finish = [&] {
        if (!cur) return;
        const tensor_metadata& tm = *p.reader->find(*cur);
        out.push_back({p.prefix + *cur, tm.type, tm.shape, h->hex()});
      };
      for_each_full_tensor(*p.reader, std::span<const std::string>(keys),
                           [&](const std::string& key, std::span<const std::byte> b, std::uint64_t) {
                             if (cur != &key) {
                               finish();
                               cur = &key;
                               h.emplace();
                             }
                             h->update(b);
                             pr.add(b.size());
                           });
      // a tensor of no elements gets no call: hashed as empty
      finish();
      for (const auto& [key, tm] : p.reader->metadata().tensors)
        if (tm.numel() == 0) out.push_back({p.prefix + key, tm.type, tm.shape, tool::sha256().hex()});
    }
  }
  std::sort(out.begin(), out.end(), [](const line& a, const line& b) { return a.name < b.name; });
  for (const auto& l : out)
    std::cout << one_line(l.name) << ' ' << to_string(l.type) << ' ' << shape_str(l.shape) << ' ' << l.hex << '\n';
  return 0;
}

}  // namespace shardsafe::tool
