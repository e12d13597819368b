// shardsafe/checkpoint/rotation.hpp - keep the last N checkpoints under a root folder.
//
// Checkpoints are sub-folders named PREFIX + step number ("step120"). One is complete when
// its commit mark exists: model/metadata.json or model/.metadata (a model + optimizer
// checkpoint, in shardsafe's layout or as DCP folders), metadata.json or .metadata (a plain
// one). Removal deletes the commit marks first, so a removal cut short never leaves a folder
// that looks complete but lacks files.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

struct checkpoint_entry {
  std::string name;        ///< folder name, e.g. "step120"
  std::uint64_t step = 0;  ///< the number after the prefix
  bool complete = false;   ///< its commit mark exists
};

/// The name of the checkpoint of `step`: PREFIX + step.
inline std::string checkpoint_name(std::uint64_t step, std::string_view prefix = "step") {
  return std::string(prefix) + std::to_string(step);
}

/// True when dir holds a whole checkpoint: its commit mark exists (in model/ when dir has a
/// model/ folder): metadata.json, or a DCP folder's .metadata.
template <ReadableDirectory D>
bool is_complete_checkpoint(const D& dir) {
  const auto committed = [](const D& d) {
    return std::any_of(commit_mark_names.begin(), commit_mark_names.end(),
                       [&](std::string_view m) { return d.exists(m); });
  };
  if (dir.exists(model_folder_name)) return committed(dir.sub(model_folder_name));
  return committed(dir);
}

/// Checkpoint folders under root, by increasing step.
template <ReadableDirectory D>
std::vector<checkpoint_entry> list_checkpoints(const D& root, std::string_view prefix = "step") {
  std::vector<checkpoint_entry> out;
  for (const auto& n : root.list()) {
    if (n.size() <= prefix.size() || n.compare(0, prefix.size(), prefix) != 0) continue;
    std::uint64_t step = 0;
    const char* b = n.data() + prefix.size();
    const char* e = n.data() + n.size();
    auto [p, ec] = std::from_chars(b, e, step);
    if (ec != std::errc() || p != e) continue;
    out.push_back({n, step, is_complete_checkpoint(root.sub(n))});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  return out;
}

/// The newest complete checkpoint under root, if any.
template <ReadableDirectory D>
std::optional<checkpoint_entry> latest_checkpoint(const D& root, std::string_view prefix = "step") {
  auto all = list_checkpoints(root, prefix);
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if (it->complete) return *it;
  return std::nullopt;
}

/// Removes a checkpoint folder, its commit marks first (remove_commit_marks).
template <ReadableDirectory D>
void remove_checkpoint(const D& root, const std::string& name) {
  remove_commit_marks(root.sub(name));
  root.remove(name);
}

/// Keeps the newest `keep_last` complete checkpoints under root and removes the older ones,
/// with any unfinished ones older than the newest complete one (left by killed saves). Rank 0
/// removes; every rank gets the same list back (newest first) or the same error, with the
/// code rank 0 met (dist/agree.hpp). A collective.
template <WritableDirectory D, Comm C>
std::vector<std::string> rotate_checkpoints(const D& root, std::size_t keep_last, C& comm,
                                            std::string_view prefix = "step") {
  const std::string list = rank0_step(comm, [&] {
    std::vector<std::string> doomed;
    auto all = list_checkpoints(root, prefix);
    std::size_t complete_seen = 0;
    std::optional<std::uint64_t> newest_complete;
    for (auto it = all.rbegin(); it != all.rend(); ++it) {
      if (it->complete) {
        if (!newest_complete) newest_complete = it->step;
        if (++complete_seen <= keep_last) continue;
        doomed.push_back(it->name);
      } else if (newest_complete && it->step < *newest_complete) {
        doomed.push_back(it->name);
      }
    }
    std::string text;  // the names, each ended by '\0' (which no plain name holds)
    for (const auto& n : doomed) {
      remove_checkpoint(root, n);
      text += n + '\0';
    }
    return text;
  });
  std::vector<std::string> removed;
  for (std::size_t pos = 0; pos < list.size();) {
    const auto nl = list.find('\0', pos);
    removed.push_back(list.substr(pos, nl - pos));
    pos = nl + 1;
  }
  return removed;
}

}  // namespace shardsafe
