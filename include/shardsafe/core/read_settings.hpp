// shardsafe/core/read_settings.hpp - the one type for how reads are merged and issued: what a
// load asks (load_options::reads), what a backend suggests (its read_defaults(), storage/
// concepts.hpp) and what an import asks (hf_import_reads::reads). Every field is optional: one
// left empty comes from the next place that sets it, load options first, then the backend's
// hint, then the library's defaults (shard/read_plan.hpp's read_options, the resolved values a
// read plan uses; detail::default_threads() requests in flight).
#pragma once

#include <cstdint>
#include <optional>

namespace shardsafe {

/// (fields in read_hints' order, max_over_read last: an initializer of the old read_hints by
/// position keeps its meaning; set fields by name)
struct read_settings {
  std::optional<std::uint64_t> max_gap_bytes;   ///< merge reads separated by at most this
  std::optional<std::uint64_t> max_read_bytes;  ///< split reads longer than this
  std::optional<unsigned> requests_in_flight;   ///< reads of one load issued at once
  std::optional<double> max_over_read;          ///< wasted bytes / needed bytes, per read
};

/// Deprecated names (one release): what a backend suggests, and what a load overrides, are both
/// read_settings.
using read_hints = read_settings;
using read_overrides = read_settings;

}  // namespace shardsafe
