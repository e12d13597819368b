// shardsafe/checkpoint/layouts/dcp_write.hpp - how a torch.distributed.checkpoint folder is
// written (checkpoint/dcp_save.hpp): __R_0.distcp per rank, .metadata last as the commit mark.
#pragma once

#include <chrono>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/dcp_save.hpp"
#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/layouts/dcp.hpp"
#include "shardsafe/checkpoint/save_options.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

struct dcp_layout_writer {
  static constexpr save_format format = save_format::dcp;
  static constexpr const layout_info& layout = dcp_layout::info;
  /// Every view must have memory (save_options::fetch is not called): a device tensor is copied
  /// to the host first.
  static constexpr bool takes_fetch = false;

  /// The whole save (steps 1-4), a collective; no non-tensor objects (save_dcp takes them).
  template <WritableDirectory D, Comm C>
  static save_stats save(const D& dir, std::span<const flat_view> views, C& comm, const save_options& opt) {
    return save_dcp(dir, views, comm, opt, {}, std::map<std::string, pickle_value>{});
  }
  /// Step 1, a collective (detail::agree_dcp): over a PeerComm up the tree of ranks, else the
  /// descriptions all-gathered, every rank whole.
  template <Comm C>
  static detail::agreed_description agree(std::span<const flat_view> views, C& comm, const std::string& dname,
                                          const save_options&) {
    return detail::agree_dcp(views, comm, dname);
  }
  /// The views of `views` this rank writes chunks of, once step 1 is agreed.
  static std::vector<const flat_view*> views_to_write(std::span<const flat_view> views,
                                                      const detail::agreed_description& agreed, int rank) {
    return detail::dcp_views_to_write(views, agreed, rank);
  }
  /// Steps 2-4 once step 1 is agreed (an asynchronous save runs them in the background).
  template <WritableDirectory D, Comm C>
  static save_stats write(const D& dir, std::span<const flat_view> views, detail::agreed_description agreed, C& comm,
                          const save_options& opt, std::chrono::steady_clock::time_point t0) {
    return detail::write_dcp_and_commit(dir, views, agreed, comm, opt, {}, std::map<std::string, pickle_value>{}, t0);
  }
};

}  // namespace shardsafe
