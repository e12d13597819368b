// shardsafe/checkpoint/layouts/writers.hpp - the layouts a save writes, each a writer of one
// layout: `format` (the save_options::format that asks for it), `layout` (its layout_info) and
// save(dir, views, comm, opt), a collective. The only list of writers; adding one is its header
// and one line below (and its save_format value).
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/layouts/dcp_write.hpp"
#include "shardsafe/checkpoint/layouts/layout.hpp"
#include "shardsafe/checkpoint/layouts/shardsafe_write.hpp"
#include "shardsafe/checkpoint/save_options.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// The writable layouts.
using writable_layouts = layout_list<shardsafe_layout_writer, dcp_layout_writer>;

/// Calls f.template operator()<W>() with the W of `list` whose `format` is `format`
/// (errc::invalid_argument where none is: `what` names the save, `where` the list, in the
/// message). What the writers below and the training layouts (torch/train_layouts.hpp) are
/// picked by.
template <class List, class F>
void with_format(List list, save_format format, std::string_view what, std::string_view where, F&& f) {
  const bool found = any_layout(list, [&]<class W>() {
    if (W::format != format) return false;
    f.template operator()<W>();
    return true;
  });
  if (!found)
    fail(errc::invalid_argument, std::string(what) + ": save_format " + std::to_string(static_cast<int>(format)) +
                                     " has no " + std::string(where));
}

/// Calls f.template operator()<W>() with the writer W of `format`.
template <class F>
void with_writer(save_format format, std::string_view what, F&& f) {
  with_format(writable_layouts{}, format, what, "writer (checkpoint/layouts/writers.hpp)", std::forward<F>(f));
}

/// The layout a save of `format` writes.
inline const layout_info& layout_written_by(save_format format) {
  const layout_info* found = nullptr;
  with_writer(format, "save", [&]<class W>() { found = &W::layout; });
  return *found;
}

/// Whether the writer of `format` writes views without memory through save_options::fetch.
inline bool writer_takes_fetch(save_format format) {
  bool r = false;
  with_writer(format, "save", [&]<class W>() { r = W::takes_fetch; });
  return r;
}

/// Saves views in the layout opt.format names, by its writer. A collective.
template <WritableDirectory D, Comm C>
save_stats save_in_layout(const D& dir, std::span<const flat_view> views, C& comm, const save_options& opt) {
  save_stats st;
  with_writer(opt.format, dir.name(), [&]<class W>() { st = W::save(dir, views, comm, opt); });
  return st;
}

}  // namespace shardsafe
