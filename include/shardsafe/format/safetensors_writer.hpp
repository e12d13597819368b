// shardsafe/format/safetensors_writer.hpp - plan a safetensors layout and stream a file out.
//
// The layout puts tensors in decreasing alignment, then name order, and pads the header with
// spaces so the data buffer starts at a multiple of 8: every tensor is then aligned to its
// element size in the file (and in a mapping of it). The writer sends the header first and
// then each tensor's bytes straight from caller memory, in any order and from several
// threads; nothing is assembled in memory. The target storage publishes the file atomically
// on commit.
#pragma once

#include <algorithm>
#include <iterator>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/detail/checksum.hpp"
#include "shardsafe/detail/copy.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// A tensor to be written: its name, dtype, shape and (for the convenience writers) bytes.
struct tensor_data {
  std::string name;
  dtype type = dtype::U8;
  shape_t shape;
  std::span<const std::byte> bytes;
};

/// Where each tensor goes in a file that is yet to be written.
class safetensors_layout {
 public:
  std::string file;                   ///< the target, for messages
  std::string header;                 ///< the 8-byte length and the padded JSON
  std::vector<tensor_entry> tensors;  ///< in file order, offsets relative to the data buffer

  std::uint64_t data_start() const noexcept { return header.size(); }
  std::uint64_t file_size() const noexcept { return header.size() + (tensors.empty() ? 0 : tensors.back().end); }
  /// Index of the tensor with this name; throws errc::not_found.
  std::size_t index_of(std::string_view name) const {
    auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                               [&](std::size_t i, std::string_view n) { return tensors[i].name < n; });
    if (it == by_name_.end() || tensors[*it].name != name)
      fail(errc::not_found, file + ": the layout has no tensor '" + std::string(name) + "'");
    return *it;
  }
  /// Index of the first tensor (file order) whose bytes end past data-buffer offset p
  /// (tensors.size() when none does): where a walk over the data from p starts.
  std::size_t first_ending_after(std::uint64_t p) const noexcept {
    auto it = std::upper_bound(tensors.begin(), tensors.end(), p,
                               [](std::uint64_t q, const tensor_entry& t) { return q < t.end; });
    return static_cast<std::size_t>(it - tensors.begin());
  }
  /// The walk over file bytes [offset, end) (end <= file_size()), in file order: the header's
  /// part as header(file offset, length), then each tensor's part as piece(tensor index, byte
  /// offset in the tensor, length, file offset); empty tensors are skipped.
  template <class Header, class Piece>
  void for_each_piece(std::uint64_t offset, std::uint64_t end, Header&& header_part, Piece&& piece) const {
    const std::uint64_t hs = data_start();
    std::uint64_t pos = offset;
    if (pos < hs && pos < end) {
      const std::uint64_t n = std::min(end, hs) - pos;
      header_part(pos, n);
      pos += n;
    }
    for (std::size_t i = first_ending_after(pos - std::min(pos, hs)); pos < end && i < tensors.size(); ++i) {
      const std::uint64_t b = hs + tensors[i].begin, n = std::min(end, hs + tensors[i].end) - pos;
      if (n) piece(i, pos - b, n, pos);
      pos += n;
    }
  }

 private:
  friend safetensors_layout plan_safetensors(std::vector<tensor_entry>, const std::map<std::string, std::string>&,
                                             std::string_view);
  std::vector<std::size_t> by_name_;
};

/// Orders the tensors (begin/end are ignored and recomputed), checks names, shapes and
/// metadata, and renders the header.
SHARDSAFE_DECL safetensors_layout plan_safetensors(std::vector<tensor_entry> tensors,
                                                   const std::map<std::string, std::string>& metadata,
                                                   std::string_view file);

/// Streams one safetensors file into a RandomAccessWritableStorage: the header at construction, then
/// tensor bytes by write()/write_part() in any order (from several threads for different
/// tensors or disjoint parts), then finish() checks every byte arrived, syncs and commits.
template <RandomAccessWritableStorage W>
class safetensors_writer {
 public:
  safetensors_writer(W& out, const safetensors_layout& layout)
      : out_(out), layout_(layout), written_(layout.tensors.size()) {
    out_.write_at(0, std::as_bytes(std::span(layout_.header)));
  }

  const safetensors_layout& layout() const noexcept { return layout_; }

  /// Writes all bytes of tensor `index` (in layout order).
  void write(std::size_t index, std::span<const std::byte> bytes) { write_part(index, 0, bytes); }
  void write(std::string_view name, std::span<const std::byte> bytes) { write(layout_.index_of(name), bytes); }

  /// Writes bytes at `offset` within tensor `index`.
  void write_part(std::size_t index, std::uint64_t offset, std::span<const std::byte> bytes) {
    const tensor_entry& t = layout_.tensors.at(index);
    if (offset > t.nbytes() || bytes.size() > t.nbytes() - offset)
      fail(errc::invalid_argument, detail::tensor_context(layout_.file, t.name) + ": writing " +
                                       std::to_string(bytes.size()) + " bytes at " + std::to_string(offset) +
                                       " passes its " + std::to_string(t.nbytes()) + " bytes");
    if (bytes.empty()) return;
    record(index, offset, offset + bytes.size());
    out_.write_at(layout_.data_start() + t.begin + offset, bytes);
  }

  /// Checks that every tensor got all its bytes, then syncs and commits the file.
  void finish() {
    for (std::size_t i = 0; i < layout_.tensors.size(); ++i) {
      const auto& t = layout_.tensors[i];
      std::uint64_t got = 0;
      for (const auto& [b, e] : written_[i]) got += e - b;
      if (got != t.nbytes()) {
        std::uint64_t hole = 0;  // the first byte not written
        for (const auto& [b, e] : written_[i]) {
          if (b != hole) break;
          hole = e;
        }
        fail(errc::invalid_argument, detail::tensor_context(layout_.file, t.name) + ": " + std::to_string(got) +
                                         " of " + std::to_string(t.nbytes()) + " bytes were written (byte " +
                                         std::to_string(hole) + " first missing)");
      }
    }
    out_.sync();
    out_.commit();
  }

 private:
  // Notes bytes [b, e) of tensor `index` as written, merging with neighbours; a part that
  // overlaps one written before is refused before any byte of it is written.
  void record(std::size_t index, std::uint64_t b, std::uint64_t e) {
    std::lock_guard lock(mu_);
    auto& ranges = written_[index];
    auto next = ranges.upper_bound(b);  // first range starting after b
    auto clash = [&](std::uint64_t cb, std::uint64_t ce) {
      fail(errc::invalid_argument, detail::tensor_context(layout_.file, layout_.tensors[index].name) + ": bytes [" +
                                       std::to_string(b) + ", " + std::to_string(e) + ") overlap bytes [" +
                                       std::to_string(cb) + ", " + std::to_string(ce) + ") written before");
    };
    if (next != ranges.end() && next->first < e) clash(next->first, next->second);
    if (next != ranges.begin()) {
      auto prev = std::prev(next);
      if (prev->second > b) clash(prev->first, prev->second);
      if (prev->second == b) {  // extend the range that ends where this one starts
        b = prev->first;
        ranges.erase(prev);
      }
    }
    if (next != ranges.end() && next->first == e) {
      e = next->second;
      ranges.erase(next);
    }
    ranges.emplace(b, e);
  }

  W& out_;
  const safetensors_layout& layout_;
  std::mutex mu_;
  std::vector<std::map<std::uint64_t, std::uint64_t>> written_;  ///< per tensor: start -> end of written bytes
};

/// What the writers ask for the bytes of a tensor given without memory (data[i] == nullptr):
/// fetch(i, offset, dst) puts tensor i's bytes [offset, offset + dst.size()) into dst (a
/// device tensor's, copied on demand). This one refuses: every tensor must have memory.
struct no_fetch {
  void operator()(std::size_t i, std::uint64_t, std::span<std::byte>) const {
    fail(errc::invalid_argument, "tensor #" + std::to_string(i) + " of a file being written has no memory");
  }
};

/// Bytes [offset, offset + dst.size()) of the file `layout` describes, into dst: the header,
/// then tensor i's bytes from data[i] (layout order; each holds layout.tensors[i].nbytes()),
/// or from fetch where data[i] is null. Lets a writer produce the file in blocks of its own
/// choosing (file_writer::write_blocks) instead of tensor by tensor.
template <class Fetch = no_fetch>
void render_safetensors_bytes(const safetensors_layout& layout, std::span<const std::byte* const> data,
                              std::uint64_t offset, std::span<std::byte> dst, Fetch&& fetch = {}) {
  const std::uint64_t end = offset + dst.size();
  if (data.size() != layout.tensors.size() || end < offset || end > layout.file_size())
    fail(errc::invalid_argument, layout.file + ": rendering bytes " + std::to_string(offset) + ".." +
                                     std::to_string(end) + " of a " + std::to_string(layout.file_size()) +
                                     "-byte file from " + std::to_string(data.size()) + " of " +
                                     std::to_string(layout.tensors.size()) + " tensors");
  layout.for_each_piece(
      offset, end,
      [&](std::uint64_t pos, std::uint64_t n) {
        std::memcpy(dst.data() + (pos - offset), layout.header.data() + pos, static_cast<std::size_t>(n));
      },
      [&](std::size_t i, std::uint64_t in_tensor, std::uint64_t n, std::uint64_t pos) {
        std::byte* to = dst.data() + (pos - offset);
        if (const std::byte* src = data[i])
          detail::stream_copy(to, src + in_tensor, static_cast<std::size_t>(n));
        else
          fetch(i, in_tensor, std::span<std::byte>(to, static_cast<std::size_t>(n)));
      });
}

/// The checksums of a file's tensors (detail/checksum.hpp), computed as the file is written:
/// hash_range(lo, hi) hashes, from the tensors' memory, every block whose last byte lies in
/// file bytes [lo, hi). A writer calls it for each part of the file it has just produced
/// (a block of write_blocks, a part of write_part), so every block is hashed once, by the
/// thread that wrote its end, while its bytes are still in the cache: no second pass over
/// the data. Calls for disjoint ranges may run on several threads at once.
class safetensors_checksummer {
 public:
  /// data[i]: the bytes of layout.tensors[i] (layout order); block_bytes > 0.
  safetensors_checksummer(const safetensors_layout& layout, std::span<const std::byte* const> data,
                          std::uint64_t block_bytes)
      : layout_(layout), data_(data.begin(), data.end()), block_(block_bytes), hashes_(layout.tensors.size()) {
    if (block_ == 0 || data_.size() != layout_.tensors.size())
      fail(errc::invalid_argument, layout_.file + ": checksums of " + std::to_string(data_.size()) + " of " +
                                       std::to_string(layout_.tensors.size()) + " tensors in blocks of " +
                                       std::to_string(block_) + " bytes");
    for (std::size_t i = 0; i < hashes_.size(); ++i)
      hashes_[i].resize(static_cast<std::size_t>(detail::checksum_block_count(layout_.tensors[i].nbytes(), block_)));
  }

  std::uint64_t block_bytes() const noexcept { return block_; }

  /// Hashes the blocks whose last byte is in file bytes [lo, hi).
  void hash_range(std::uint64_t lo, std::uint64_t hi) { hash_range(lo, hi, {}, 0, no_fetch{}); }

  /// The same where some tensors have no memory (data[i] null): their blocks' bytes come from
  /// `have`, file bytes [have_at, have_at + have.size()) the writer has just produced, where it
  /// holds the whole block, else from fetch(i, offset, dst) (render_safetensors_bytes's fetch).
  template <class Fetch>
  void hash_range(std::uint64_t lo, std::uint64_t hi, std::span<const std::byte> have, std::uint64_t have_at,
                  Fetch&& fetch) {
    const std::uint64_t hs = layout_.data_start();
    if (hi <= hs || hi <= lo) return;
    // data-buffer offsets: a block ends in (a, b]
    const std::uint64_t a = lo < hs ? 0 : lo - hs, b = hi - hs;
    std::vector<std::byte> fetched;  // a block only partly in `have`
    for (std::size_t i = layout_.first_ending_after(a); i < layout_.tensors.size() && layout_.tensors[i].begin < b;
         ++i) {
      const auto* it = &layout_.tensors[i];
      const std::uint64_t n = it->nbytes();
      // the first block of this tensor ending past a (a block k ends at begin + min((k+1)B, n))
      std::uint64_t k = a <= it->begin ? 0 : (a - it->begin) / block_;
      for (; k < hashes_[i].size(); ++k) {
        const std::uint64_t from = k * block_, to = std::min(n, from + block_);
        if (it->begin + to <= a) continue;
        if (it->begin + to > b) break;
        const std::size_t len = static_cast<std::size_t>(to - from);
        const std::byte* src = data_[i] ? data_[i] + from : nullptr;
        if (!src) {
          const std::uint64_t at = hs + it->begin + from;  // the block's file offset
          if (at >= have_at && at + len <= have_at + have.size()) {
            src = have.data() + (at - have_at);
          } else {
            fetched.resize(len);
            fetch(i, from, std::span<std::byte>(fetched));
            src = fetched.data();
          }
        }
        hashes_[i][static_cast<std::size_t>(k)] = detail::xxh3_64(src, len);
      }
    }
  }

  /// The hashes, by tensor name (call once every range is hashed).
  std::map<std::string, std::vector<std::uint64_t>> table() const {
    std::map<std::string, std::vector<std::uint64_t>> t;
    for (std::size_t i = 0; i < hashes_.size(); ++i) t.emplace(layout_.tensors[i].name, hashes_[i]);
    return t;
  }

 private:
  const safetensors_layout& layout_;
  std::vector<const std::byte*> data_;
  std::uint64_t block_;
  std::vector<std::vector<std::uint64_t>> hashes_;  // per tensor (layout order), per block
};

/// Writes a whole file from tensors in memory: plan, stream, commit.
template <RandomAccessWritableStorage W>
void write_safetensors(W& out, std::span<const tensor_data> tensors,
                       const std::map<std::string, std::string>& metadata = {}) {
  std::vector<tensor_entry> entries;
  entries.reserve(tensors.size());
  for (const auto& t : tensors) entries.push_back({t.name, t.type, t.shape, 0, 0});
  auto layout = plan_safetensors(std::move(entries), metadata, out.name());
  safetensors_writer<W> w(out, layout);
  for (const auto& t : tensors) w.write(t.name, t.bytes);
  w.finish();
}

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/format/impl/safetensors_writer.ipp"
#endif
