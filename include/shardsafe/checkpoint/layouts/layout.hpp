// shardsafe/checkpoint/layouts/layout.hpp - what a checkpoint layout is: the one place that
// knows an on-disk format (shardsafe's metadata.json folders, torch DCP, Hugging Face folders,
// torch's DCP-sharded HF files, single safetensors and torch.save files) and tells the rest of
// the library how to read it. The reader, planner, executor, unshard, verify, the exports and the
// tool take a layout and never ask which one it is: they ask what it can do (layout_info's
// traits) or call its hooks through visit_layout.
//
// A layout is a plain type L (no virtual functions) with:
//
// | member                                   | what it does                                        |
// |------------------------------------------|-----------------------------------------------------|
// | static constexpr layout_info info        | its name, commit mark and traits (below)            |
// | L::recognise(dir, listing) -> bool       | whether dir looks like this layout, by names only   |
// |                                          | (a folder layout; no file is parsed)                |
// | L::open(dir, listing) -> optional<source>| the description (checkpoint/source.hpp) read, or    |
// |                                          | nullopt where dir is not in this layout             |
// | L::recognise_file(storage) -> bool       | (a file layout, instead of the two above) whether   |
// | L::open_file(dir, name) -> source        | the one file is in it; its description              |
// |                                          |                                                     |
// | optional hooks (looked for with requires):                                                     |
// | L::incomplete(dir, listing) -> optional<string> | why a folder holding some of its files is |
// |                                          | not a complete checkpoint (folder_listing below)    |
// | L::index_file(storage, src, name) -> safetensors_header | a file's index where it is not a |
// |                                          | safetensors header (a DCP data file's zip headers)  |
// | L::read_object(dir, item) -> pickle_value | a non-tensor item's value                          |
// | L::read_object_archive(dir, item) -> string | the item's torch.save archive                     |
// | L::verify_folder(reader)                 | the folder-level rules verify adds                  |
//
// Adding a layout: its header here, and one line in layouts/registry.hpp.
#pragma once

#include <algorithm>
#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/error.hpp"

namespace shardsafe {

/// What a layout is and what it can do: data, compared by address (every layout has one).
struct layout_info {
  std::string_view id;           ///< short and stable: "shardsafe", "dcp", "hf", ...
  std::string_view name;         ///< for messages and inspect: "sharded checkpoint"
  std::string_view commit_mark;  ///< the object whose presence makes the checkpoint complete ("" none)
  /// Checksums of the tensor data may be recorded (metadata.json or its sidecars): verify reports
  /// whether they were.
  bool records_checksums = false;
  /// A file may store a tensor's dimensions in another order than the tensor's (a torch.save'd
  /// transposed tensor): readers ask the file's header for the stored order.
  bool permuted_files = false;
  /// A folder of whole tensors, each in one file, validated as a set (a Hugging Face folder):
  /// the tool inspects and verifies it file by file.
  bool folder_of_whole_files = false;
  /// The checkpoint is one file, not a folder.
  bool single_file = false;
  /// A trainer's whole training state under the names the trainer layouts share (docs/FORMAT.md
  /// §6, §7): model tensors by their module names, optimizer.state.<param>.<field> tensors and
  /// optimizer.param_groups.<g>.<field> items (params: the group's parameter names). to-dcp keys
  /// them as torch's get_state_dict does (model.<param>, optim.state.<param>.<field>,
  /// optim.param_groups.<g>.<field>): checkpoint/dcp_export.hpp.
  bool trainer_state = false;

  friend constexpr bool operator==(const layout_info& a, const layout_info& b) noexcept { return &a == &b; }
};

/// A folder's listing, made on first use and kept: the layouts tried one after another share one
/// dir.list(). A backend that cannot list (HTTP: errc::invalid_argument) gives no names, and
/// listed() says so: such a folder is probed by name alone. has(n) probes by name until a layout
/// needs the listing, so that recognising a sharded checkpoint of many files lists nothing.
template <class D>
class folder_listing {
 public:
  explicit folder_listing(const D& dir) : dir_(&dir) {}
  const std::vector<std::string>& names() {
    if (!names_) {
      try {
        names_ = dir_->list();
      } catch (const error& e) {
        if (e.code() != errc::invalid_argument) throw;
        names_.emplace();
        listed_ = false;
      }
    }
    return *names_;
  }
  /// Whether the backend could list the folder (after names()).
  bool listed() {
    names();
    return listed_;
  }
  /// Whether the folder holds `n`: by its listing where one was made, else by asking it (one
  /// probe a name, kept): a folder of 16,384 ranks' files is not listed, on every rank, to learn
  /// whether it holds one name (issue 56).
  bool has(std::string_view n) {
    if (names_ && listed_) return std::find(names_->begin(), names_->end(), n) != names_->end();
    const auto it = probed_.find(n);
    if (it != probed_.end()) return it->second;
    const bool found = dir_->exists(n);
    probed_.emplace(std::string(n), found);
    return found;
  }
  /// Whether a name ends in `suffix` (".safetensors").
  bool any_ends_with(std::string_view suffix) {
    for (const auto& n : names())
      if (n.ends_with(suffix)) return true;
    return false;
  }

 private:
  const D* dir_;
  std::optional<std::vector<std::string>> names_;
  bool listed_ = true;
  std::map<std::string, bool, std::less<>> probed_;  // has()'s answers before a listing
};

/// L::open for a layout whose checkpoint folder a pointer file may name (DeepSpeed's `latest`,
/// Megatron's `latest_checkpointed_iteration.txt`): nullopt where L does not recognise dir; dir
/// described itself where it holds no `pointer`; else the folder resolve(dir) gives, described,
/// with its folder set.
template <class L, class D, class Resolve>
auto open_pointed(const D& dir, folder_listing<D>& ls, std::string_view pointer, Resolve&& resolve)
    -> std::optional<decltype(L::describe(dir))> {
  if (!L::recognise(dir, ls)) return std::nullopt;
  if (!ls.has(pointer)) return L::describe(dir);
  const D folder = resolve(dir);
  auto s = L::describe(folder);
  s.folder = folder;
  return s;
}

/// A list of layouts, tried in this order.
template <class... L>
struct layout_list {
  static constexpr std::size_t size = sizeof...(L);
};

/// Calls f.template operator()<L>() for each L of the list in order until one returns true;
/// whether one did.
template <class... L, class F>
constexpr bool any_layout(layout_list<L...>, F&& f) {
  return (f.template operator()<L>() || ...);
}

/// Calls f.template operator()<L>() for the layout L of the list whose info is `info`; false
/// where none is (a layout_info not registered).
template <class... L, class F>
bool visit_layout(layout_list<L...> list, const layout_info& info, F&& f) {
  return any_layout(list, [&]<class X>() {
    if (!(X::info == info)) return false;
    f.template operator()<X>();
    return true;
  });
}

}  // namespace shardsafe
