// shardsafe/checkpoint/layouts/shardsafe.hpp - shardsafe's own layout (OLMo-core's before 1.0):
// a folder of rank_R.safetensors files described by metadata.json, listed or compact
// (format/metadata.hpp), written last as the commit mark; checksums of the tensor data in it or
// in each rank file's sidecar (checkpoint/checksums.hpp). Written by checkpoint/saver.hpp.
#pragma once

#include <optional>
#include <string>

#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/checkpoint/layouts/layout.hpp"
#include "shardsafe/checkpoint/source.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

struct shardsafe_layout {
  static constexpr layout_info info{
      .id = "shardsafe", .name = "sharded checkpoint", .commit_mark = metadata_file_name, .records_checksums = true};

  template <ReadableDirectory D>
  static bool recognise(const D&, folder_listing<D>& ls) {
    return ls.has(metadata_file_name);
  }

  /// metadata.json read; nullopt where there is none (the open is the check, one round trip).
  template <ReadableDirectory D>
  static std::optional<checkpoint_source<D>> open(const D& dir, folder_listing<D>&) {
    checkpoint_source<D> s;
    s.layout = &info;
    s.described_by = std::string(metadata_file_name);
    try {
      s.metadata = read_checkpoint_metadata(dir.open(metadata_file_name));
    } catch (const error& e) {
      if (e.code() != errc::not_found) throw;
      return std::nullopt;
    }
    return s;
  }
};

}  // namespace shardsafe
