// shardsafe/checkpoint/parts.hpp - the parts of a checkpoint to export: the checkpoint in a
// folder itself (whichever layout it has), or a model + optimizer pair's model/ and optim/
// (each a checkpoint of its own under a folder with no description of its own), opened once,
// with the name prefix each part's tensors take in a single output; and what both exports
// refuse rather than leave out (a tensor without a name; an export of nothing).
#pragma once

#include <algorithm>
#include <iterator>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/checkpoint/layouts/registry.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/format/rename.hpp"
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

namespace detail {

/// What the exports (hf/export.hpp, dcp_export.hpp) refuse rather than leave out: a tensor
/// (or, `what`, a value) whose name is empty (a `torch.save` key '', or the pickle's root: a
/// tensor saved alone, not in a state dict) that no rename rule names. Its name to the rules is
/// `name`, its key in r `key`; `out` names the output. errc::invalid_argument naming the item,
/// its file and why it has no name; the rename rules only where some were given.
template <ReadableDirectory S>
void refuse_unnamed(const checkpoint_reader<S>& r, const std::string& key, const std::string& name,
                    const rename_rules& rules, std::string_view out, std::string_view what = "tensor") {
  if (!name.empty()) return;
  const rename_rule* by = nullptr;
  if (!rules.apply(name, &by).empty() || by) return;  // a rule names it, or drops it as asked
  const pickle_value* path = r.path_in_state_dict(key);
  const std::string why = path && *path == pickle_value::tuple()
                              ? "is the root of the pickle (a tensor saved alone, not in a state dict)"
                              : "has an empty name (its key is '')";
  const std::string dir(r.directory().name());
  fail(errc::invalid_argument, std::string(out) + ": " + std::string(what) + " '" + key + "' of " +
                                   (dir.empty() ? "" : dir + "/") + r.described_by() + " " + why +
                                   ", so it has no name to be written under" +
                                   (rules.empty() ? std::string() : ", and no rename rule names it") +
                                   "; an export that would leave it out is refused");
}

/// Refuses an export whose rename rules drop every one of `names` (there are some): nothing
/// would be written. errc::invalid_argument naming the rules that dropped them (`what`: what
/// the names are, "tensors" or "keys"; `hint` ends the message).
template <class Names>
void refuse_export_of_nothing(const Names& names, const rename_rules& rules, std::string_view out,
                              std::string_view what, std::string_view hint) {
  std::vector<std::string> by_rules;
  for (const auto& n : names) {
    const rename_rule* by = nullptr;
    rules.apply(n, &by);
    const std::string t = by ? "'" + by->text + "'" : std::string("a rule that passes names on");
    if (std::find(by_rules.begin(), by_rules.end(), t) == by_rules.end()) by_rules.push_back(t);
  }
  std::string list;
  for (std::size_t i = 0; i < by_rules.size() && i < 4; ++i) list += (i ? ", " : "") + by_rules[i];
  fail(errc::invalid_argument, std::string(out) + ": the rename rules drop all " + std::to_string(std::size(names)) +
                                   " " + std::string(what) + " (dropped by " + list +
                                   (by_rules.size() > 4 ? ", ..." : "") +
                                   "); an export that exports nothing is refused" + std::string(hint));
}

}  // namespace detail

}  // namespace shardsafe
