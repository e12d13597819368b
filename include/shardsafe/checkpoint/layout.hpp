// shardsafe/checkpoint/layout.hpp - the names of the objects in a checkpoint folder.
//
// A sharded checkpoint is a folder holding metadata.json (written last, by rank 0: its
// presence is the commit mark) and one rank_R.safetensors per rank. A model + optimizer
// checkpoint holds two such folders, model/ and optim/ (docs/FORMAT.md). A torch.distributed.checkpoint
// folder's commit mark is `.metadata`, its data files `__R_N.distcp` (docs/FORMAT.md §5).
#pragma once

#include <array>
#include <string>
#include <string_view>

#include "shardsafe/format/metadata.hpp"  // rank_file_name: a grid of the compact form names rank files too

namespace shardsafe {

/// The checkpoint's description, written last: a folder without it is not a checkpoint.
inline constexpr std::string_view metadata_file_name = "metadata.json";

/// The name a torch DCP folder's description (and commit mark) has.
inline constexpr std::string_view dcp_metadata_file_name = ".metadata";

/// The data file rank R writes in a DCP folder (torch's __R_0.distcp: one file per rank).
inline std::string dcp_data_file_name(int rank) { return "__" + std::to_string(rank) + "_0.distcp"; }

/// The sub-folders of a model + optimizer checkpoint.
inline constexpr std::string_view model_folder_name = "model";
inline constexpr std::string_view optim_folder_name = "optim";

/// The names a folder's commit mark may have: shardsafe's metadata.json, a DCP folder's .metadata.
inline constexpr std::array<std::string_view, 2> commit_mark_names{metadata_file_name, dcp_metadata_file_name};

/// Removes every commit mark a checkpoint folder may hold, whatever its layout: a model +
/// optimizer pair's (model/metadata.json, model/.metadata), then a plain or DCP folder's own
/// (metadata.json, .metadata). What a removal or an overwrite does first, so that if it is cut
/// short, no folder of any layout is left that looks complete but lacks files. A mark that is
/// not there is left alone.
template <class D>
void remove_commit_marks(const D& dir) {
  const auto remove_marks = [](const D& d) {
    for (std::string_view mark : commit_mark_names)
      if (d.exists(mark)) d.remove(mark);  // asked first: `model` may be a file, not a folder
  };
  if (dir.exists(model_folder_name)) remove_marks(dir.sub(model_folder_name));
  remove_marks(dir);
}

}  // namespace shardsafe
