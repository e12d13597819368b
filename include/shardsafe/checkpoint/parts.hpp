// shardsafe/checkpoint/parts.hpp - the parts of a checkpoint to export: the checkpoint in a
// folder itself (whichever layout it has), or a model + optimizer pair's model/ and optim/
// (each a checkpoint of its own under a folder with no description of its own), opened once,
// with the name prefix each part's tensors take in a single output.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/checkpoint/layouts/registry.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// The opened parts of a checkpoint (readers kept alive here) and their sources.
template <ReadableDirectory S>
struct checkpoint_parts {
  std::vector<std::unique_ptr<checkpoint_reader<S>>> readers;
  std::vector<unshard_source<S>> sources;  ///< in order: model/ first
  bool pair = false;                       ///< model/ and optim/ of a model + optimizer checkpoint
};

/// Opens the parts of the checkpoint in src. A folder that no layout recognises but holds model/
/// (or optim/) is a model + optimizer pair: model/ is a part (refused when absent), with prefix
/// "model/", and optim/ (prefix "optim/") unless model_only, which also drops the prefixes.
template <ReadableDirectory S>
checkpoint_parts<S> open_checkpoint_parts(const S& src, bool model_only = false) {
  checkpoint_parts<S> p;
  p.pair = !recognise_folder(src) && (src.exists(model_folder_name) || src.exists(optim_folder_name));
  if (!p.pair) {
    p.readers.push_back(std::make_unique<checkpoint_reader<S>>(src));
    p.sources.push_back({p.readers.back().get(), ""});
    return p;
  }
  if (!src.exists(model_folder_name))
    fail(errc::not_found,
         std::string(src.name()) + ": a model + optimizer checkpoint without model/; nothing to export");
  for (std::string_view part : {model_folder_name, optim_folder_name}) {
    if (part == optim_folder_name && (model_only || !src.exists(part))) continue;
    p.readers.push_back(std::make_unique<checkpoint_reader<S>>(src.sub(part)));
    p.sources.push_back({p.readers.back().get(), model_only ? "" : std::string(part) + "/"});
  }
  return p;
}

}  // namespace shardsafe
