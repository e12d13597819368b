// libFuzzer target: the messages ranks send each other while a save agrees up the tree of ranks
// (checkpoint/description_tree.hpp, checkpoint/save_agree.hpp; issue 56). A peer of another build
// or damaged memory sends them, never a user, but they are read with the same care. The first
// byte picks the reader:
//   even: decode_partial, as rank 0 reads its child holding ranks [0, 16); what it accepts is
//         expanded (at most 16 entries a tensor: the bound the decoder checks), checked and built
//         into metadata as rank 0 does (finish_partial), the compact form's grids found from the
//         boxes (grid_of_boxes) being what the listed form's expanded entries give, and encoded
//         again reads back as itself;
//   odd:  decode_agreed, as a rank reads rank 0's agreement: every tensor not sharded names the
//         file of its writer, a sharded one none.
// Only shardsafe::error may escape. With SHARDSAFE_FUZZ_WRITE_SEEDS=DIR set, the target writes its
// seeds (a partial of FSDP pieces, block rows, replicas, pairs of ranks saving one shard without
// roles and a multi-range spec, and the agreement rank 0 sends for it) into DIR and exits:
// fuzz/corpus/partial/ was made so.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "shardsafe/checkpoint/save_agree.hpp"

#include "fuzz_check.hpp"

using namespace shardsafe;

namespace {

constexpr std::uint64_t world = 16;

/// Ranks [0, 16) of a small model, merged as the tree merges them.
detail::partial_description seed_partial() {
  detail::partial_description all;
  for (std::uint64_t r = 0; r < world; ++r) {
    detail::partial_description p;
    p.first = r;
    p.end = r + 1;
    auto add = [&](std::string key, shape_t shape, bool sharded, shard_spec s, replica_role role) {
      p.add(std::move(key), std::move(shape), dtype::BF16, sharded, r, s, role);
    };
    add("fsdp", {50}, true, flat_spec{{std::min<std::uint64_t>(50, 4 * r), std::min<std::uint64_t>(50, 4 * r + 4)}},
        replica_role::none);
    add("rows", {4, 6}, true, block_spec({1, 3}, {(r / 2) % 4, 3 * (r % 2)}),
        r < 8 ? replica_role::writer : replica_role::copy);
    add("bias", {3}, false, flat_spec{{0, 3}}, replica_role::none);
    add("pairs", {24}, true, flat_spec{{3 * (r / 2), 3 * (r / 2) + 3}}, replica_role::none);  // without roles
    if (r < 2)
      add("multi", {10}, true, r == 0 ? flat_spec{{0, 3}, {5, 7}} : flat_spec{{3, 5}, {7, 10}}, replica_role::none);
    if (r == 0)
      all = std::move(p);
    else
      all.merge(std::move(p));
  }
  return all;
}

/// The entries boxes stand for, in order: (rank, spec, role).
std::vector<std::tuple<std::uint64_t, std::string, int>> entries_of(const std::vector<detail::entry_box>& boxes) {
  std::vector<std::tuple<std::uint64_t, std::string, int>> out;
  for (const auto& b : boxes)
    b.for_each([&](std::uint64_t r, const shard_spec& s) { out.emplace_back(r, to_string(s), int(b.role)); });
  return out;
}

std::string encoded(const detail::partial_description& p) {
  message_writer m;
  detail::encode_partial(m, p);
  return std::move(m).str();
}

void write_seeds(const std::string& dir) {
  const detail::partial_description p = seed_partial();
  std::ofstream(dir + "/partial", std::ios::binary) << '\0' << encoded(p);
  const detail::agreed_description a = detail::finish_partial(p, world, "seed", metadata_form::listed, 64);
  std::ofstream(dir + "/agreed", std::ios::binary) << '\1' << detail::encode_agreed(a, p);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const bool seeds = [] {
    if (const char* dir = std::getenv("SHARDSAFE_FUZZ_WRITE_SEEDS")) {
      write_seeds(dir);
      std::exit(0);
    }
    return true;
  }();
  (void)seeds;
  if (size == 0) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    message_reader m(bytes, "rank 1");
    if (data[0] % 2 == 0) {
      const detail::partial_description p = detail::decode_partial(m, 0, world);
      m.finish();
      for (const auto& t : p.tensors) {
        std::vector<std::pair<std::string, shard_spec>> files;
        std::vector<int> ranks;
        std::vector<replica_role> roles;
        try {
          detail::expand_entries(t, world, "fuzz", files, ranks, roles);
        } catch (const error&) {
        }
        FUZZ_CHECK(files.size() <= world);
        // the entries as single boxes, appended as two runs of ranks cut anywhere (inside a group
        // of ranks saving one shard too) and merged as the tree merges them: the same entries
        // (append_box's split of a cut group), in at most as many boxes as entries
        std::vector<std::tuple<std::uint64_t, shard_spec, replica_role>> entries;
        try {
          for (const auto& b : t.boxes)
            b.for_each([&](std::uint64_t r, const shard_spec& sp) { entries.emplace_back(r, sp, b.role); });
        } catch (const error&) {
          continue;
        }
        const auto want = entries_of(t.boxes);
        for (std::size_t cut = 0; cut <= entries.size(); ++cut) {
          std::vector<detail::entry_box> again, right;
          for (std::size_t k = 0; k < entries.size(); ++k) {
            const auto& [r, sp, role] = entries[k];
            detail::append_box(k < cut ? again : right, detail::entry_box::of(r, role, sp));
          }
          for (auto& x : right) detail::append_box(again, std::move(x));
          FUZZ_CHECK(entries_of(again) == want);
          FUZZ_CHECK(again.size() <= entries.size());
        }
      }
      // rank 0's grids found from boxes (compact: grid_of_boxes) answer what expanding every
      // entry answers (listed, then detect_grid): the same error, grids, files and checksum blocks
      std::optional<detail::agreed_description> listed, compact;
      std::string listed_error, compact_error;
      try {
        listed = detail::finish_partial(p, world, "fuzz", metadata_form::listed, 64);
      } catch (const error& e) {
        listed_error = e.what();
      }
      try {
        compact = detail::finish_partial(p, world, "fuzz", metadata_form::compact, 64);
      } catch (const error& e) {
        compact_error = e.what();
      }
      FUZZ_CHECK(listed_error == compact_error && listed.has_value() == compact.has_value());
      if (compact) {
        FUZZ_CHECK(compact->md.tensors.size() == p.tensors.size());
        FUZZ_CHECK(compact->checksum_hashes == listed->checksum_hashes);
        for (std::size_t i = 0; i < p.tensors.size(); ++i) {
          const tensor_metadata& want = listed->md.tensors[i].second;
          const tensor_metadata& got = compact->md.tensors[i].second;
          FUZZ_CHECK(got.grid == detect_grid(want));
          FUZZ_CHECK(got.grid ? got.files.empty() : got.files == want.files);
        }
      }
      const std::string again = encoded(p);
      message_reader back(again, "again");
      FUZZ_CHECK(encoded(detail::decode_partial(back, 0, world)) == again);
    } else {
      const detail::agreed_description a = detail::decode_agreed(m);
      m.finish();
      for (const auto& [key, tm] : a.md.tensors) FUZZ_CHECK(tm.files.size() == (tm.is_sharded ? 0u : 1u));
    }
  } catch (const error&) {
  }
  return 0;
}
