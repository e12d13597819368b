// libFuzzer target: parse_checkpoint_metadata on arbitrary bytes. Only shardsafe::error may
// escape. Accepted metadata must have specs that fit their tensors (cursor runs inside the
// tensor, increasing, summing to local_numel) and must round-trip through the writer. The
// On-Demand reading accepts nothing that simdjson's DOM parser refuses, and refuses as invalid
// JSON nothing the DOM parser takes (but duplicate keys): the library's two readings agree.
#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/format/metadata.hpp"

#include "fuzz_check.hpp"

using namespace shardsafe;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  simdjson::dom::parser dom;
  simdjson::dom::element root;
  const bool json_ok = detail::is_valid_utf8(text) && !dom.parse(text.data(), text.size(), true).get(root);
  checkpoint_metadata md;
  try {
    md = parse_checkpoint_metadata(text, "metadata.json");
  } catch (const shardsafe::error& e) {
    const bool json_error = e.code() == make_error_code(errc::invalid_json);
    // what the DOM parser takes as JSON is refused as JSON only for a key given twice. Not
    // compared: a scalar document (never metadata), where simdjson 3.0's two front ends differ
    // on trailing whitespace ("null\t", "null ")
    const auto first = text.find_first_not_of(" \t\r\n");
    const bool container = first != std::string_view::npos && (text[first] == '{' || text[first] == '[');
    FUZZ_CHECK(!container || !json_ok || !json_error ||
               std::string_view(e.what()).find("appears twice") != std::string_view::npos);
    return 0;
  }
  FUZZ_CHECK(json_ok);  // accepted: an object, which the DOM parser takes too
  for (const auto& [key, tm] : md.tensors) {
    const std::uint64_t n = tm.numel();
    for (const auto& [file, spec] : tm.files) {
      FUZZ_CHECK(spec.local_numel() <= n);
      // walk at most 4096 runs: a spec may have billions
      std::uint64_t prev_end = 0, local = 0;
      int runs = 0;
      bool complete = true;
      for (auto c = spec.cursor(tm.shape); !c.done(); c.next()) {
        if (++runs > 4096) {
          complete = false;
          break;
        }
        const spec_run r = c.run();
        FUZZ_CHECK(r.begin < r.end && r.end <= n);
        FUZZ_CHECK(runs == 1 || r.begin >= prev_end);
        FUZZ_CHECK(r.local == local);
        local += r.end - r.begin;
        prev_end = r.end;
      }
      FUZZ_CHECK(!complete || local == spec.local_numel());
    }
  }
  // an accepted grid (the compact form), up to the 2^20 parts a tensor may have, by its cheap
  // path only: the first parts in rank order (for_each_part stopped early), and single elements
  // found by division (overlapping), each checked against the format's rule computed here
  for (const auto& entry : md.tensors) {
    const tensor_metadata& tm = entry.second;  // not a structured binding: clang 14's lambdas cannot capture one
    if (!tm.grid) continue;
    const shard_grid& g = *tm.grid;
    const std::uint64_t count = g.part_count();
    FUZZ_CHECK(count >= 1 && count <= max_grid_parts);
    const shape_t dims = g.flat ? shape_t{tm.numel()} : tm.shape;
    // the first parts in rank order: ranks increasing from the base, each a valid spec
    std::uint64_t seen = 0, prev = 0;
    tm.for_each_file([&](const std::string& f, const shard_spec& s) {
      s.validate(tm.shape, "part");
      FUZZ_CHECK(f.starts_with("rank_"));
      const std::uint64_t r = std::stoull(f.substr(5));
      FUZZ_CHECK(seen == 0 ? r == g.base : r > prev);
      prev = r;
      return ++seen < 64;
    });
    FUZZ_CHECK(seen == std::min<std::uint64_t>(count, 64));
    // one element (the first, the last, one the input picks): exactly one part holds it, the one
    // whose piece indices are its indices divided by the chunks, at base + sum(index * stride)
    const std::uint64_t n = tm.numel();
    if (n > 0)
      for (const std::uint64_t e : {std::uint64_t(0), n - 1, std::uint64_t(size) * 2654435761u % n}) {
        const auto found = overlapping(g, tm.shape, shard_spec(flat_spec{{e, e + 1}}));
        FUZZ_CHECK(found.size() == 1);
        std::uint64_t rest = e, rank = g.base;
        shape_t at(dims.size());
        for (std::size_t d = dims.size(); d-- > 0;) {
          at[d] = rest % dims[d];
          rest /= dims[d];
          rank += at[d] / g.chunks[d] * g.strides[d];
        }
        FUZZ_CHECK(found[0].first == rank);
        const shard_spec& s = found[0].second;
        if (s.is_flat()) {
          FUZZ_CHECK(s.flat().ranges().size() == 1 && s.flat().ranges()[0].begin <= e && e < s.flat().ranges()[0].end);
        } else {
          for (std::size_t d = 0; d < dims.size(); ++d)
            FUZZ_CHECK(s.block().global_offset()[d] <= at[d] &&
                       at[d] < s.block().global_offset()[d] + s.block().local_shape()[d]);
        }
      }
    // small grids whole: every index in index order, ranked by the rule and sorted here, is what
    // expand lists; the parts are disjoint and cover the tensor; a query for the whole tensor
    // finds the non-empty ones
    if (count > 4096) continue;
    std::vector<std::pair<std::uint64_t, shard_spec>> want;
    std::vector<std::uint64_t> index(dims.size(), 0);
    for (std::uint64_t i = 0; i < count; ++i) {
      want.push_back(grid_part(g, tm.shape, index));
      for (std::size_t d = index.size(); d-- > 0;) {
        if (++index[d] < g.parts[d]) break;
        index[d] = 0;
      }
    }
    std::sort(want.begin(), want.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    const auto parts = expand(g, tm.shape);
    FUZZ_CHECK(parts == want);
    std::uint64_t held = 0, nonempty = 0;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      parts[i].second.validate(tm.shape, "part");
      FUZZ_CHECK(i == 0 || parts[i].first > parts[i - 1].first);
      held += parts[i].second.local_numel();
      nonempty += parts[i].second.local_numel() > 0;
    }
    FUZZ_CHECK(held == tm.numel());
    FUZZ_CHECK(overlapping(g, tm.shape, shard_spec(flat_spec{{0, tm.numel()}})).size() == nonempty);
  }
  // what was accepted is written and read back unchanged
  const std::string again = write_checkpoint_metadata(md);
  const checkpoint_metadata back = parse_checkpoint_metadata(again, "metadata.json (rewritten)");
  FUZZ_CHECK(back.tensors.size() == md.tensors.size());
  for (std::size_t i = 0; i < md.tensors.size(); ++i) {
    const auto& [ka, a] = md.tensors[i];
    const auto& [kb, b] = back.tensors[i];
    FUZZ_CHECK(ka == kb && a.shape == b.shape && a.type == b.type && a.is_sharded == b.is_sharded);
    FUZZ_CHECK(a.files.size() == b.files.size());
    for (std::size_t j = 0; j < a.files.size(); ++j) FUZZ_CHECK(a.files[j] == b.files[j]);
  }
  FUZZ_CHECK(back.extras.writer == md.extras.writer && back.extras.world_size == md.extras.world_size &&
             back.extras.file_sizes == md.extras.file_sizes);
  FUZZ_CHECK(back.extras.checksums.has_value() == md.extras.checksums.has_value());
  if (md.extras.checksums)
    FUZZ_CHECK(back.extras.checksums->algorithm == md.extras.checksums->algorithm &&
               back.extras.checksums->block_bytes == md.extras.checksums->block_bytes &&
               back.extras.checksums->files == md.extras.checksums->files);
  FUZZ_CHECK(write_checkpoint_metadata(back) == again);
  return 0;
}
