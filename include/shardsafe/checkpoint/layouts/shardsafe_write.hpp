// shardsafe/checkpoint/layouts/shardsafe_write.hpp - how shardsafe's layout is written: the
// save of checkpoint/saver.hpp's protocol (checkpoint/save_agree.hpp, checkpoint/save_write.hpp),
// metadata.json last as the commit mark.
#pragma once

#include <chrono>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/layouts/shardsafe.hpp"
#include "shardsafe/checkpoint/save_options.hpp"
#include "shardsafe/checkpoint/save_write.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

struct shardsafe_layout_writer {
  static constexpr save_format format = save_format::shardsafe;
  static constexpr const layout_info& layout = shardsafe_layout::info;
  /// Views without memory are written through save_options::fetch (device tensors copied while
  /// the rank file is written).
  static constexpr bool takes_fetch = true;

  /// The whole save (steps 1-4), a collective.
  template <WritableDirectory D, Comm C>
  static save_stats save(const D& dir, std::span<const flat_view> views, C& comm, const save_options& opt) {
    return detail::save_shardsafe(dir, views, comm, opt);
  }
  /// Step 1, a collective: over a PeerComm's tree, or all-gathered (detail::agree_on_description).
  template <Comm C>
  static detail::agreed_description agree(std::span<const flat_view> views, C& comm, const std::string& dname,
                                          const save_options& opt) {
    return detail::agree_on_description(views, comm, dname, opt);
  }
  /// The views of `views` this rank writes, once step 1 is agreed (an asynchronous save
  /// snapshots these alone).
  static std::vector<const flat_view*> views_to_write(std::span<const flat_view> views,
                                                      const detail::agreed_description& agreed, int rank) {
    return detail::views_to_write(views, agreed.md, rank);
  }
  /// Steps 2-4 once step 1 is agreed (an asynchronous save runs them in the background).
  template <WritableDirectory D, Comm C>
  static save_stats write(const D& dir, std::span<const flat_view> views, detail::agreed_description agreed, C& comm,
                          const save_options& opt, std::chrono::steady_clock::time_point t0) {
    return detail::write_and_commit(dir, views, std::move(agreed), comm, opt, t0);
  }
};

}  // namespace shardsafe
