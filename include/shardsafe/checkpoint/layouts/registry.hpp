// shardsafe/checkpoint/layouts/registry.hpp - the layouts shardsafe reads, in the order they are
// tried, and what is done with whichever a checkpoint has: recognise a folder, open its
// description, index a file, read a non-tensor item. The only list of layouts; adding one is its
// header and one line below.
//
// | layout (checkpoint/layouts/) | how it is told apart                                   |
// |------------------------------|--------------------------------------------------------|
// | megatron_legacy_layout       | latest_checkpointed_iteration.txt naming a folder of   |
// |                              | mp_rank_TT[_PPP][_EEE]/, or such folders (Megatron-LM) |
// | megatron_dist_layout         | latest_checkpointed_iteration.txt, or metadata.json    |
// |                              | beside common.pt and .metadata (Megatron-Core)         |
// | shardsafe_layout             | metadata.json (shardsafe, OLMo-core before 1.0)        |
// | hf_layout                    | model.safetensors[.index.json] or pytorch_model.bin[.index.json] |
// | dcp_layout                   | .metadata (torch.distributed.checkpoint)               |
// | dcp_sharded_hf_layout        | *.safetensors whose __metadata__ has DCP_SHARDING_INFO |
// | deepspeed_universal_layout   | `latest_universal`, or zero/ beside *_model_states.pt  |
// | deepspeed_layout             | `latest` (DeepSpeed's tag), or *_model_states.pt files |
// | torch_save_file_layout       | one file torch.save wrote (zip or legacy)              |
// | safetensors_file_layout      | one safetensors file                                   |
//
// Recognising asks the folder for names (exists) and lists it only where a layout needs its
// names (DeepSpeed's files, Megatron-LM's mp_rank_ folders) after the names that rule that
// layout out: a shardsafe or DCP folder of many ranks' files is listed by no rank that loads it.
// A folder with metadata.json is a sharded checkpoint whatever else it holds (but Megatron-Core's,
// beside its common.pt and .metadata); a folder none
// recognises is errc::not_found ("no metadata.json: ..."), or what a layout says of the pieces
// it found (".distcp files but no .metadata").
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "shardsafe/checkpoint/layouts/dcp.hpp"
#include "shardsafe/checkpoint/layouts/dcp_sharded_hf.hpp"
#include "shardsafe/checkpoint/layouts/deepspeed.hpp"
#include "shardsafe/checkpoint/layouts/deepspeed_universal.hpp"
#include "shardsafe/checkpoint/layouts/hf.hpp"
#include "shardsafe/checkpoint/layouts/layout.hpp"
#include "shardsafe/checkpoint/layouts/megatron_dist.hpp"
#include "shardsafe/checkpoint/layouts/megatron_legacy.hpp"
#include "shardsafe/checkpoint/layouts/shardsafe.hpp"
#include "shardsafe/checkpoint/layouts/single_file.hpp"
#include "shardsafe/checkpoint/source.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// The folder layouts, in the order they are tried.
using folder_layouts = layout_list<megatron_legacy_layout, megatron_dist_layout, shardsafe_layout, hf_layout,
                                   dcp_layout, dcp_sharded_hf_layout, deepspeed_universal_layout, deepspeed_layout>;
/// The single-file layouts, in the order they are tried (the last takes any file).
using file_layouts = layout_list<torch_save_file_layout, safetensors_file_layout>;

/// Calls f.template operator()<L>() for the layout L, of either list, whose info is `info`.
template <class F>
void with_layout(const layout_info& info, F&& f) {
  if (!visit_layout(folder_layouts{}, info, f) && !visit_layout(file_layouts{}, info, f))
    fail(errc::invalid_argument,
         "layout '" + std::string(info.id) + "' is not registered (checkpoint/layouts/registry.hpp)");
}

/// The first folder layout that recognises dir by the names in it (no file parsed), or nullptr.
template <ReadableDirectory D>
const layout_info* recognise_folder(const D& dir) {
  folder_listing<D> ls(dir);
  const layout_info* found = nullptr;
  any_layout(folder_layouts{}, [&]<class L>() {
    if (!L::recognise(dir, ls)) return false;
    found = &L::info;
    return true;
  });
  return found;
}

/// Opens the checkpoint in dir, whichever layout it has (table at the top), reading only
/// descriptions and headers.
template <ReadableDirectory D>
checkpoint_source<D> open_checkpoint_source(const D& dir) {
  folder_listing<D> ls(dir);
  std::optional<checkpoint_source<D>> s;
  any_layout(folder_layouts{}, [&]<class L>() {
    s = L::open(dir, ls);
    return s.has_value();
  });
  if (s) return std::move(*s);
  std::optional<std::string> why;
  any_layout(folder_layouts{}, [&]<class L>() {
    if constexpr (requires { L::incomplete(dir, ls); }) why = L::incomplete(dir, ls);
    return why.has_value();
  });
  if (why) fail(errc::not_found, *why);
  fail(errc::not_found, std::string(dir.name()) + ": no " + std::string(shardsafe_layout::info.commit_mark) +
                            ": not a complete checkpoint (a save that did not finish, or not a checkpoint directory" +
                            (ls.listed() ? ")" : "; a folder that cannot be listed is probed by name)"));
}

/// One file `name` of dir read as a checkpoint, by the first file layout that takes it.
template <ReadableDirectory D>
checkpoint_source<D> single_file_source(const D& dir, const std::string& name) {
  typename D::reader_type st = dir.open(name);
  std::optional<checkpoint_source<D>> s;
  any_layout(file_layouts{}, [&]<class L>() {
    if (!L::recognise_file(st)) return false;
    s = L::open_file(dir, name, std::move(st));
    return true;
  });
  return std::move(*s);
}

/// Opens file `name` of the checkpoint src describes, and indexes it as its layout says (a
/// safetensors header unless the layout has index_file: a DCP data file's zip headers). A size
/// the description recorded must match. `keep`: what of a safetensors header to keep (header_keep).
template <ReadableDirectory D>
std::unique_ptr<opened_file<typename D::reader_type>> open_source_file(const D& dir, const checkpoint_source<D>& src,
                                                                       const std::string& name, header_keep keep = {}) {
  using R = typename D::reader_type;
  const std::string& path = path_of(src, name);
  R s = detail::open_or(dir, path, [&] {
    return std::string(dir.name()) + "/" + path + ": missing: " + src.described_by + " lists it but it does not exist";
  });
  std::optional<safetensors_header> h;
  if (src.layout)
    with_layout(*src.layout, [&]<class L>() {
      if constexpr (requires { L::index_file(s, src, name); }) h = L::index_file(s, src, name);
    });
  if (!h) h = read_safetensors_header(s, std::move(keep));
  const auto size_it = src.metadata.extras.file_sizes.find(name);
  if (size_it != src.metadata.extras.file_sizes.end() && size_it->second != s.size())
    fail(errc::truncated, std::string(s.name()) + ": file is " + std::to_string(s.size()) + " bytes but " +
                              src.described_by + " recorded " + std::to_string(size_it->second));
  return std::make_unique<opened_file<R>>(opened_file<R>{std::move(s), std::move(*h)});
}

}  // namespace shardsafe
