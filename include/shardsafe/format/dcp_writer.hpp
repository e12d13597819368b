// shardsafe/format/dcp_writer.hpp - the bytes of one torch DCP data file (`__R_0.distcp`), laid out
// before a byte is written (docs/FORMAT.md §5).
//
// A data file is its items one after another, as torch's FileSystemWriter writes them: first
// the non-tensor items (each a torch.save archive of its pickled value), then the tensor chunks
// (each a torch.save archive of one tensor, format/torch_zip_writer.hpp). Every item's place in
// the file, [offset, offset + length), is what `.metadata`'s _StorageInfo records.
//
// The CRC-32 of each chunk's data is an input (its archive's tail holds it), so the layout is
// fixed once made: render(offset, dst) produces any byte range of the file from the chunks'
// memory, in any order and on any number of threads, as render_safetensors_bytes does for rank
// files.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/format/dcp_metadata.hpp"
#include "shardsafe/format/torch_zip_writer.hpp"

namespace shardsafe {

/// One tensor chunk of a data file: a block of `key` and its bytes (row-major, little-endian).
struct dcp_chunk_data : dcp_block {
  const std::byte* data = nullptr;
  std::uint32_t crc = 0;  ///< CRC-32 of the block's bytes
};

/// One non-tensor item of a data file: its key and the torch.save archive of its value.
struct dcp_object_data {
  std::string key;
  std::string archive;  ///< torch_value_archive(pickle of the value)
};

/// Where an item of the file lies.
struct dcp_item_place {
  std::uint64_t offset = 0, length = 0;
};

/// The laid-out data file (rules at the top).
class dcp_file_layout {
 public:
  dcp_file_layout(std::string file, std::vector<dcp_object_data> objects, std::vector<dcp_chunk_data> chunks)
      : file_(std::move(file)), objects_(std::move(objects)), chunks_(std::move(chunks)) {
    for (std::size_t i = 0; i < objects_.size(); ++i) {
      place_.push_back({size_, objects_[i].archive.size()});
      segments_.push_back({size_, &objects_[i].archive, nullptr, objects_[i].archive.size()});
      size_ += objects_[i].archive.size();
    }
    archives_.reserve(chunks_.size());
    tails_.reserve(chunks_.size());
    for (const auto& c : chunks_) {
      const torch_tensor_archive& a = archives_.emplace_back(c.type, c.sizes);
      const std::string& tail = tails_.emplace_back(a.tail(c.crc));
      if (a.data_size() > 0 && !c.data)
        fail(errc::invalid_argument,
             file_ + ": chunk of '" + c.key + "' at " + to_string(c.offsets) + " has no memory");
      place_.push_back({size_, a.size()});
      segments_.push_back({size_, &a.head(), nullptr, a.head().size()});
      segments_.push_back({size_ + a.head().size(), nullptr, c.data, a.data_size()});
      segments_.push_back({size_ + a.head().size() + a.data_size(), &tail, nullptr, tail.size()});
      size_ += a.size();
    }
  }
  dcp_file_layout(const dcp_file_layout&) = delete;  // segments point into the members
  dcp_file_layout& operator=(const dcp_file_layout&) = delete;

  const std::string& file() const noexcept { return file_; }
  std::uint64_t size() const noexcept { return size_; }
  const std::vector<dcp_object_data>& objects() const noexcept { return objects_; }
  const std::vector<dcp_chunk_data>& chunks() const noexcept { return chunks_; }
  /// Where object i is.
  dcp_item_place object_place(std::size_t i) const { return place_.at(i); }
  /// Where chunk i's archive is.
  dcp_item_place chunk_place(std::size_t i) const { return place_.at(objects_.size() + i); }

  /// Puts the file's bytes [offset, offset + dst.size()) into dst.
  void render(std::uint64_t offset, std::span<std::byte> dst) const {
    const std::uint64_t end = offset + dst.size();
    if (end < offset || end > size_)
      fail(errc::invalid_argument, file_ + ": rendering bytes " + std::to_string(offset) + ".." + std::to_string(end) +
                                       " of a " + std::to_string(size_) + "-byte file");
    auto it = std::upper_bound(segments_.begin(), segments_.end(), offset,
                               [](std::uint64_t o, const segment& s) { return o < s.at; });
    std::uint64_t pos = offset;
    for (--it; pos < end; ++it) {
      const std::uint64_t from = pos - it->at, n = std::min(end, it->at + it->size) - pos;
      const std::byte* src = it->text ? reinterpret_cast<const std::byte*>(it->text->data()) : it->data;
      if (n) std::memcpy(dst.data() + (pos - offset), src + from, static_cast<std::size_t>(n));
      pos += n;
    }
  }

 private:
  struct segment {
    std::uint64_t at;
    const std::string* text;  ///< a header or tail, or nullptr: `data`
    const std::byte* data;
    std::uint64_t size;
  };
  std::string file_;
  std::vector<dcp_object_data> objects_;
  std::vector<dcp_chunk_data> chunks_;
  std::vector<torch_tensor_archive> archives_;
  std::vector<std::string> tails_;
  std::vector<dcp_item_place> place_;
  std::vector<segment> segments_;
  std::uint64_t size_ = 0;
};

}  // namespace shardsafe
