// Tests of shard/: shard specs, overlap, copy plans, load plans and read plans.
//
// Every property is checked against an element-by-element brute force written here: each
// spec is expanded into the list of global flat indices it holds, in local order (element
// i of the list is local offset i), and answers are computed from those lists alone.
#include "shardsafe/shard/copy_plan.hpp"
#include "shardsafe/shard/coverage.hpp"
#include "shardsafe/shard/overlap.hpp"
#include "shardsafe/shard/read_plan.hpp"
#include "shardsafe/shard/merged_ranges.hpp"
#include "shardsafe/shard/shard_spec.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

using namespace shardsafe;
using u64 = std::uint64_t;

namespace {

constexpr u64 kSeed = 0x5eed'5afe'2024ULL;
constexpr u64 kPairCases = 15000;

// ---------------------------------------------------------------------------------------
// brute force

u64 bf_numel(const shape_t& s) {
  u64 n = 1;
  for (auto d : s) n *= d;
  return n;
}

std::vector<u64> bf_elements(const flat_spec& s, const shape_t&) {
  std::vector<u64> v;
  for (auto r : s.ranges())
    for (u64 g = r.begin; g < r.end; ++g) v.push_back(g);
  return v;
}

std::vector<u64> bf_elements(const block_spec& s, const shape_t& full) {
  const auto& ls = s.local_shape();
  const auto& go = s.global_offset();
  const std::size_t nd = full.size();
  const u64 cnt = bf_numel(ls);
  std::vector<u64> v;
  std::vector<u64> idx(nd);
  for (u64 k = 0; k < cnt; ++k) {
    u64 rem = k;
    for (std::size_t d = nd; d-- > 0;) {
      idx[d] = rem % ls[d];
      rem /= ls[d];
    }
    u64 g = 0;
    for (std::size_t d = 0; d < nd; ++d) g = g * full[d] + go[d] + idx[d];
    v.push_back(g);
  }
  return v;
}

std::vector<u64> bf_elements(const shard_spec& s, const shape_t& full) {
  return s.is_flat() ? bf_elements(s.flat(), full) : bf_elements(s.block(), full);
}

/// global index -> local offset (or -1) over the whole tensor.
std::vector<long long> bf_local_of(const std::vector<u64>& elems, const shape_t& full) {
  std::vector<long long> m(bf_numel(full), -1);
  for (std::size_t i = 0; i < elems.size(); ++i) m[elems[i]] = static_cast<long long>(i);
  return m;
}

/// Maximal ranges of a set of indices.
std::vector<element_range> bf_ranges_of(std::vector<u64> v) {
  std::sort(v.begin(), v.end());
  std::vector<element_range> out;
  for (u64 x : v) {
    if (!out.empty() && out.back().end == x)
      ++out.back().end;
    else
      out.push_back({x, x + 1});
  }
  return out;
}

std::optional<overlap_type> bf_classify(const std::vector<u64>& mine, const std::vector<u64>& other,
                                        const shape_t& full) {
  auto om = bf_local_of(other, full), mm = bf_local_of(mine, full);
  u64 both = 0, only_mine = 0, only_other = 0;
  for (u64 g : mine) (om[g] >= 0 ? both : only_mine)++;
  for (u64 g : other)
    if (mm[g] < 0) ++only_other;
  if (both == 0) return std::nullopt;
  if (only_mine == 0 && only_other == 0) return overlap_type::equal;
  if (only_other == 0) return overlap_type::superset;
  if (only_mine == 0) return overlap_type::subset;
  return overlap_type::mixed;
}

std::string str(std::optional<overlap_type> t) { return t ? std::string(to_string(*t)) : "None"; }
std::string str(const copy_plan& p) {
  std::string s;
  for (auto r : p) s += "{" + std::to_string(r.dst) + "," + std::to_string(r.src) + "," + std::to_string(r.len) + "}";
  return s;
}
std::string str(const std::vector<element_range>& v) {
  std::string s;
  for (auto r : v) s += to_string(r);
  return s;
}

// compares by printed form, so a failure shows both sides
#define CHECK_SAME(got, ...) CHECK(str(got) == str(__VA_ARGS__))

/// Runs have len > 0, increase in both offsets without overlap, and no neighbour continues
/// the one before it in both offsets.
std::string runs_shape_error(const copy_plan& p) {
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (p[i].len == 0) return "empty run " + std::to_string(i);
    if (i == 0) continue;
    const auto& a = p[i - 1];
    const auto& b = p[i];
    if (a.dst + a.len > b.dst || a.src + a.len > b.src) return "runs not sorted/disjoint at " + std::to_string(i);
    if (a.dst + a.len == b.dst && a.src + a.len == b.src) return "runs not coalesced at " + std::to_string(i);
  }
  return {};
}

/// The plan moves exactly the elements both hold, each once, to and from the right place.
std::string copy_plan_error(const copy_plan& p, const std::vector<u64>& mine, const std::vector<u64>& other,
                            const shape_t& full) {
  if (auto e = runs_shape_error(p); !e.empty()) return e;
  auto om = bf_local_of(other, full);
  std::vector<std::pair<u64, u64>> want, got;
  for (u64 i = 0; i < mine.size(); ++i)
    if (om[mine[i]] >= 0) want.emplace_back(i, static_cast<u64>(om[mine[i]]));
  for (auto r : p)
    for (u64 k = 0; k < r.len; ++k) got.emplace_back(r.dst + k, r.src + k);
  if (got != want)
    return "moved elements differ from brute force (" + std::to_string(got.size()) + " vs " +
           std::to_string(want.size()) + ")";
  return {};
}

// ---------------------------------------------------------------------------------------
// random specs

using rng_t = std::mt19937_64;
u64 pick(rng_t& r, u64 lo, u64 hi) { return std::uniform_int_distribution<u64>(lo, hi)(r); }  // [lo, hi]
bool chance(rng_t& r, int one_in) { return pick(r, 0, one_in - 1) == 0; }

shape_t random_shape(rng_t& r) {
  static const u64 dims[] = {1, 1, 2, 2, 3, 3, 4, 5, 6, 7, 9};
  while (true) {
    shape_t s(pick(r, 0, 5));
    for (auto& d : s) d = chance(r, 25) ? 0 : dims[pick(r, 0, std::size(dims) - 1)];
    if (bf_numel(s) <= 3000) return s;
  }
}

flat_spec random_flat(rng_t& r, const shape_t& full) {
  const u64 n = bf_numel(full);
  std::vector<element_range> v;
  if (chance(r, 8)) {
    v.push_back({0, n});
  } else {
    std::vector<u64> pts(2 * pick(r, 0, 6));
    for (auto& p : pts) p = pick(r, 0, n);
    std::sort(pts.begin(), pts.end());
    for (std::size_t i = 0; i < pts.size(); i += 2) v.push_back({pts[i], pts[i + 1]});  // may be empty/adjacent
  }
  if (chance(r, 4)) {  // an empty range anywhere: allowed out of order
    const u64 x = pick(r, 0, n);
    v.insert(v.begin() + static_cast<std::ptrdiff_t>(pick(r, 0, v.size())), element_range{x, x});
  }
  return flat_spec(std::move(v));
}

block_spec random_block(rng_t& r, const shape_t& full) {
  shape_t ls(full.size()), go(full.size());
  for (std::size_t d = 0; d < full.size(); ++d) {
    if (chance(r, 3) || full[d] == 0) {
      ls[d] = full[d];
    } else {
      ls[d] = chance(r, 12) ? 0 : pick(r, 1, full[d]);
      go[d] = pick(r, 0, full[d] - ls[d]);
    }
  }
  return block_spec(ls, go);
}

shard_spec random_spec(rng_t& r, const shape_t& full) {
  if (chance(r, 2)) return random_flat(r, full);
  return random_block(r, full);
}

/// Files as a checkpoint has them: a flat tiling, a block grid or random specs, with
/// replicated copies, extra strays and dropped files mixed in.
std::vector<shard_spec> random_files(rng_t& r, const shape_t& full) {
  std::vector<shard_spec> files;
  const u64 n = bf_numel(full);
  switch (pick(r, 0, 2)) {
    case 0: {  // flat tiling dealt round-robin to k files
      std::vector<u64> cuts(pick(r, 0, 8));
      for (auto& c : cuts) c = pick(r, 0, n);
      cuts.push_back(0);
      cuts.push_back(n);
      std::sort(cuts.begin(), cuts.end());
      const std::size_t k = pick(r, 1, 4);
      std::vector<std::vector<element_range>> per(k);
      for (std::size_t i = 0; i + 1 < cuts.size(); ++i) per[i % k].push_back({cuts[i], cuts[i + 1]});
      for (auto& v : per) files.push_back(flat_spec(std::move(v)));
      break;
    }
    case 1: {  // block grid
      std::vector<std::vector<u64>> cuts(full.size());
      u64 count = 1;
      for (std::size_t d = 0; d < full.size(); ++d) {
        cuts[d] = {0, full[d]};
        if (count < 12 && full[d] > 1 && chance(r, 2)) cuts[d].insert(cuts[d].begin() + 1, pick(r, 1, full[d] - 1));
        count *= cuts[d].size() - 1;
      }
      for (u64 k = 0; k < count; ++k) {
        shape_t ls(full.size()), go(full.size());
        u64 rem = k;
        for (std::size_t d = full.size(); d-- > 0;) {
          const u64 parts = cuts[d].size() - 1, j = rem % parts;
          rem /= parts;
          go[d] = cuts[d][j];
          ls[d] = cuts[d][j + 1] - cuts[d][j];
        }
        files.push_back(block_spec(ls, go));
      }
      break;
    }
    default:
      for (u64 k = pick(r, 0, 5); k > 0; --k) files.push_back(random_spec(r, full));
  }
  if (chance(r, 2))
    for (u64 k = pick(r, 1, 2); k > 0; --k) files.push_back(random_spec(r, full));
  if (!files.empty() && chance(r, 2))  // replicated: the same spec in several files
    for (u64 k = pick(r, 1, 3); k > 0; --k) {
      auto copy = files[pick(r, 0, files.size() - 1)];
      files.insert(files.begin() + static_cast<std::ptrdiff_t>(pick(r, 0, files.size())), std::move(copy));
    }
  if (!files.empty() && chance(r, 4))
    files.erase(files.begin() + static_cast<std::ptrdiff_t>(pick(r, 0, files.size() - 1)));
  if (chance(r, 2)) std::shuffle(files.begin(), files.end(), r);
  return files;
}

std::string case_ctx(u64 seed, u64 i, const shape_t& full) {
  return "seed=" + std::to_string(seed) + " case=" + std::to_string(i) + " full=" + to_string(full);
}

/// Stops a property after a few failures so one bug does not print thousands of lines.
struct failure_budget {
  int left = 5;
  bool check(const std::string& err, const std::string& ctx) {
    if (err.empty()) return true;
    const std::string msg = ctx + ": " + err;
    FAIL_CHECK(msg);
    return --left > 0;
  }
};

template <class A, class B>
std::string pair_error(const A& mine, const B& other, const shape_t& full, const std::vector<u64>& em,
                       const std::vector<u64>& eo) {
  auto plan = compute_copy_plan(mine, other, full);
  if (auto e = copy_plan_error(plan, em, eo, full); !e.empty()) return e + " plan=" + str(plan);
  auto want = bf_classify(em, eo, full);
  auto got = compute_overlap(mine, other, full);
  if (got != want) return "compute_overlap " + str(got) + ", brute force " + str(want);
  if (overlap_numel(mine, other, full) != plan_numel(plan)) return "overlap_numel differs from the plan";
  return {};
}

}  // namespace

// =======================================================================================
// properties

TEST_CASE("property: copy plans and overlap classes match the brute force (all form pairs)") {
  rng_t r(kSeed);
  failure_budget budget;
  u64 seen[5] = {}, seen_nd[6] = {};
  u64 numel_sum = 0;
  for (u64 i = 0; i < kPairCases; ++i) {
    const shape_t full = random_shape(r);
    shard_spec a = random_spec(r, full), b = chance(r, 6) ? a : random_spec(r, full);
    a.validate(full, "mine");
    b.validate(full, "other");
    const auto em = bf_elements(a, full), eo = bf_elements(b, full);
    const std::string ctx = case_ctx(kSeed, i, full) + " mine=" + to_string(a) + " other=" + to_string(b);
    // through the variant, and through the concrete types (flat x flat ... block x block)
    if (!budget.check(pair_error(a, b, full, em, eo), ctx + " [shard_spec]")) break;
    std::string typed = std::visit(
        [&](const auto& x) {
          return std::visit([&](const auto& y) { return pair_error(x, y, full, em, eo); }, b.variant());
        },
        a.variant());
    if (!budget.check(typed, ctx + " [typed]")) break;
    ++seen[bf_classify(em, eo, full) ? 1 + int(*bf_classify(em, eo, full)) : 0];
    ++seen_nd[full.size()];
    numel_sum += bf_numel(full);
  }
  // the generator reaches every class and rank, on tensors that are not all tiny
  for (int k = 0; k < 5; ++k)
    CHECK_MESSAGE(seen[k] > kPairCases / 40, "overlap class " << k << " seen " << seen[k] << " times");
  for (int k = 0; k < 6; ++k) CHECK_MESSAGE(seen_nd[k] > kPairCases / 40, k << "-d seen " << seen_nd[k] << " times");
  MESSAGE("classes none/equal/superset/subset/mixed: " << seen[0] << "/" << seen[1] << "/" << seen[2] << "/" << seen[3]
                                                       << "/" << seen[4] << ", mean numel " << numel_sum / kPairCases);
}

TEST_CASE("property: plan_load covers each of my elements once from a file that holds it") {
  rng_t r(kSeed + 1);
  failure_budget budget;
  for (u64 i = 0; i < 8000; ++i) {
    const shape_t full = random_shape(r);
    const shard_spec mine = random_spec(r, full);
    const auto files = random_files(r, full);
    for (const auto& f : files) f.validate(full, "file");
    const auto em = bf_elements(mine, full);
    std::vector<std::vector<u64>> ef;
    for (const auto& f : files) ef.push_back(bf_elements(f, full));
    std::string ctx = case_ctx(kSeed + 1, i, full) + " mine=" + to_string(mine) + " files=";
    for (const auto& f : files) ctx += to_string(f) + "; ";

    const load_plan plan = plan_load(mine, files, full);
    std::string err;
    std::vector<long long> from(em.size(), -1);
    std::optional<std::size_t> prev_file;
    for (const auto& fp : plan.files) {
      if (fp.file >= files.size() || (prev_file && fp.file <= *prev_file)) err = "file indices out of order";
      if (!err.empty()) break;
      prev_file = fp.file;
      if (fp.runs.empty() || fp.numel != plan_numel(fp.runs)) err = "file plan empty or numel wrong";
      if (auto e = runs_shape_error(fp.runs); !e.empty()) err = e;
      if (fp.overlap != bf_classify(em, ef[fp.file], full)) err = "overlap class of file " + std::to_string(fp.file);
      for (auto run : fp.runs)
        for (u64 k = 0; k < run.len && err.empty(); ++k) {
          const u64 d = run.dst + k, s = run.src + k;
          if (d >= em.size() || s >= ef[fp.file].size())
            err = "run out of range";
          else if (from[d] != -1)
            err = "element " + std::to_string(d) + " provided twice";
          else if (em[d] != ef[fp.file][s])
            err = "element " + std::to_string(d) + " from the wrong source";
          else
            from[d] = static_cast<long long>(fp.file);
        }
      if (!err.empty()) break;
    }
    // brute force coverage
    std::vector<bool> have(bf_numel(full), false);
    for (const auto& e : ef)
      for (u64 g : e) have[g] = true;
    std::vector<u64> uncovered;
    u64 covered = 0;
    for (u64 d = 0; d < em.size() && err.empty(); ++d) {
      if (have[em[d]] != (from[d] != -1)) err = "coverage of element " + std::to_string(d) + " differs";
      if (have[em[d]])
        ++covered;
      else
        uncovered.push_back(d);
    }
    if (err.empty() && plan.missing != bf_ranges_of(uncovered))
      err = "missing " + str(plan.missing) + ", brute force " + str(bf_ranges_of(uncovered));
    if (err.empty() && plan.covered != covered) err = "covered count";
    if (err.empty() && missing_elements(mine, std::span<const shard_spec>(files), full) != plan.missing)
      err = "missing_elements differs from plan_load";
    // a file holding all of my shard settles it alone: the first such file
    for (std::size_t f = 0; f < files.size() && err.empty() && !em.empty(); ++f) {
      auto c = bf_classify(em, ef[f], full);
      if (c == overlap_type::equal || c == overlap_type::subset) {
        if (plan.files.size() != 1 || plan.files[0].file != f) err = "a whole-cover file was not used alone";
        break;
      }
    }
    if (err.empty() && !em.empty()) {  // global_index_of agrees with the brute force
      const u64 l = pick(r, 0, em.size() - 1);
      if (global_index_of(mine, full, l) != std::optional<u64>(em[l])) err = "global_index_of";
      if (global_index_of(mine, full, em.size())) err = "global_index_of past the end";
    }
    if (!budget.check(err, ctx)) break;
  }
}

TEST_CASE("property: missing_in_whole names exactly the elements no file holds (brute force), in order") {
  rng_t r(kSeed + 7);
  failure_budget budget;
  for (u64 i = 0; i < 6000; ++i) {
    const shape_t full = random_shape(r);
    const auto files = random_files(r, full);
    const u64 n = numel(full);
    std::vector<bool> held(n, false);
    for (const auto& f : files)
      for (u64 e : bf_elements(f, full)) held[e] = true;
    std::vector<element_range> want;
    for (u64 e = 0; e < n; ++e)
      if (!held[e]) {
        if (!want.empty() && want.back().end == e)
          ++want.back().end;
        else
          want.push_back({e, e + 1});
      }
    const auto got = missing_in_whole(std::span<const shard_spec>(files), full);
    const shard_spec whole = flat_spec{{0, n}};
    const auto via = missing_elements(whole, std::span<const shard_spec>(files), full);  // takes the same path
    // the first gap alone (what an error names): where the walk stops
    const auto first = missing_elements(whole, std::span<const shard_spec>(files), full, 1);
    const std::vector<element_range> want_first(want.begin(), want.begin() + (want.empty() ? 0 : 1));
    std::string ctx = case_ctx(kSeed + 7, i, full) + " files=";
    for (const auto& f : files) ctx += to_string(f) + "; ";
    if (!budget.check(got != want || via != want || first != want_first ? "gaps differ from the brute force" : "", ctx))
      break;
  }
  // memory O(files), whatever the runs: a column block of 2^24 rows is 2^24 runs, merged lazily
  const shape_t tall{std::uint64_t(1) << 24, 2};
  const std::vector<shard_spec> cols{block_spec({std::uint64_t(1) << 24, 1}, {0, 0}),
                                     block_spec({std::uint64_t(1) << 24, 1}, {0, 1})};
  CHECK(missing_in_whole(std::span<const shard_spec>(cols), tall).empty());
  const std::vector<shard_spec> one{cols[0]};
  const auto gaps = missing_in_whole(std::span<const shard_spec>(one), tall, 3);
  CHECK(gaps == std::vector<element_range>{{1, 2}, {3, 4}, {5, 6}});  // the first three of 2^24, no more kept
  // a save's agreement, verify and unshard name the first missing element: the walk stops there
  // (a peer's description of 2^40 rows of column blocks, past a gap in the first rows, is no
  // 2^40-run walk)
  const shape_t huge{std::uint64_t(1) << 40, 2};
  const std::vector<shard_spec> far{block_spec({4, 2}, {0, 0}), block_spec({(std::uint64_t(1) << 40) - 8, 1}, {8, 0}),
                                    block_spec({(std::uint64_t(1) << 40) - 8, 1}, {8, 1})};
  CHECK(missing_elements(flat_spec{{0, numel(huge)}}, std::span<const shard_spec>(far), huge, 1) ==
        std::vector<element_range>{{8, 16}});
  // first_gap_in_whole, which they call: the same first gap, and the shards' elements summed
  const coverage_gap near = first_gap_in_whole(std::span<const shard_spec>(far), huge);
  CHECK((near.first && *near.first == element_range{8, 16} && !near.by_count && !near.whole()));
  CHECK(near.held == 8 + 2 * ((std::uint64_t(1) << 40) - 8));
  CHECK(first_gap_in_whole(std::span<const shard_spec>(cols), tall).whole());
  // shards that hold fewer elements than the tensor, their first gap past coverage_walk_runs
  // runs: the walk stops there and says so by count (2^23 rows of two column blocks: 2^24 runs)
  const std::vector<shard_spec> short_cols{block_spec({std::uint64_t(1) << 23, 1}, {0, 0}),
                                           block_spec({std::uint64_t(1) << 23, 1}, {0, 1})};
  REQUIRE((std::uint64_t(1) << 24) > coverage_walk_runs);
  const coverage_gap cut = first_gap_in_whole(std::span<const shard_spec>(short_cols), huge);
  CHECK((!cut.first && cut.by_count && !cut.whole() && cut.held == std::uint64_t(1) << 24));
  // shorter columns (2^21 runs, within the walk) of a tensor they nearly cover: the gap is named
  const shape_t near_tall{(std::uint64_t(1) << 20) + 1, 2};
  const std::vector<shard_spec> mid_cols{block_spec({std::uint64_t(1) << 20, 1}, {0, 0}),
                                         block_spec({std::uint64_t(1) << 20, 1}, {0, 1})};
  const coverage_gap last = first_gap_in_whole(std::span<const shard_spec>(mid_cols), near_tall);
  CHECK((last.first && *last.first == element_range{std::uint64_t(1) << 21, (std::uint64_t(1) << 21) + 2} &&
         !last.by_count));
}

TEST_CASE("property: merged ranges and cursor runs match the brute force; seek lands right") {
  rng_t r(kSeed + 2);
  failure_budget budget;
  for (u64 i = 0; i < 8000; ++i) {
    const shape_t full = random_shape(r);
    const shard_spec s = random_spec(r, full);
    const auto es = bf_elements(s, full);
    const std::string ctx = case_ctx(kSeed + 2, i, full) + " spec=" + to_string(s);
    std::string err;

    if (auto m = merged_ranges_vector(s, full); m != bf_ranges_of(es))
      err = "merged_ranges_vector " + str(m) + ", brute force " + str(bf_ranges_of(es));
    std::vector<element_range> lazy;
    for (auto x : merged_ranges(s, full)) lazy.push_back(x);
    if (err.empty() && lazy != bf_ranges_of(es)) err = "merged_ranges (lazy) differs";

    // the runs: non-empty, increasing, and laid end to end they are the brute-force elements
    std::vector<spec_run> runs;
    for (auto c = s.cursor(full); !c.done(); c.next()) runs.push_back(c.run());
    std::vector<u64> from_runs;
    for (std::size_t k = 0; k < runs.size() && err.empty(); ++k) {
      if (runs[k].begin >= runs[k].end || runs[k].local != from_runs.size() || (k && runs[k - 1].end > runs[k].begin))
        err = "bad run " + std::to_string(k);
      for (u64 g = runs[k].begin; g < runs[k].end; ++g) from_runs.push_back(g);
    }
    if (err.empty() && from_runs != es) err = "cursor runs do not spell the brute-force elements";

    // seek(pos) from run k goes to max(k, first run with end > pos): linear scan reference
    const u64 n = bf_numel(full);
    for (int t = 0; t < 12 && err.empty(); ++t) {
      const u64 pos = pick(r, 0, n + 1), k = runs.empty() ? 0 : pick(r, 0, runs.size());
      auto check_cursor = [&](auto c) {
        for (u64 j = 0; j < k; ++j) c.next();
        c.seek(pos);
        std::size_t want = k;
        while (want < runs.size() && runs[want].end <= pos) ++want;
        if (want == runs.size() ? !c.done() : (c.done() || !(c.run() == runs[want])))
          err = "seek(" + std::to_string(pos) + ") after " + std::to_string(k) + " steps";
      };
      check_cursor(s.cursor(full));
      std::visit([&](const auto& x) { check_cursor(x.cursor(full)); }, s.variant());
    }
    // a monotone sequence of seeks, as a merge does it
    auto c = s.cursor(full);
    for (u64 pos = 0; pos <= n && err.empty(); pos += pick(r, 0, 4)) {
      c.seek(pos);
      auto it = std::find_if(runs.begin(), runs.end(), [&](const spec_run& x) { return x.end > pos; });
      if (it == runs.end() ? !c.done() : (c.done() || !(c.run() == *it)))
        err = "monotone seek(" + std::to_string(pos) + ")";
      if (pos == n) break;
    }
    if (!budget.check(err, ctx)) break;
  }
}

namespace {

/// Checks a read plan byte by byte against the runs it came from.
std::string read_plan_error(const copy_plan& runs, u64 data_offset, u64 item, const read_options& opt,
                            const read_plan& rp) {
  u64 src_end = 0, needed = 0;
  bool stepped = false;
  for (auto x : runs) {
    src_end = std::max(src_end, (x.src + (x.len - 1) * x.src_step + 1) * item);
    needed += x.len * item;
    stepped = stepped || x.dst_step != 1 || x.src_step != 1;
  }
  // file byte (relative to data_offset) -> my byte, or -1: element k of a run from src + k * src_step
  // to dst + k * dst_step
  std::vector<long long> want(src_end, -1), seen(src_end, 0);
  for (auto x : runs)
    for (u64 k = 0; k < x.len; ++k)
      for (u64 b = 0; b < item; ++b)
        want[(x.src + k * x.src_step) * item + b] = static_cast<long long>((x.dst + k * x.dst_step) * item + b);
  u64 read = 0, got = 0, prev_start = 0;
  for (std::size_t i = 0; i < rp.ops.size(); ++i) {
    const auto& op = rp.ops[i];
    const std::string at = "op " + std::to_string(i) + ": ";
    if (op.pieces.empty() || op.len == 0) return at + "empty";
    if (op.file_offset < data_offset || op.file_offset < prev_start) return at + "out of order";
    // reads of a plan without steps never overlap; a stepped run cut at max_read may start its
    // rest after the next run's start (each byte is still delivered once: `seen`)
    if (!stepped && i && op.file_offset < rp.ops[i - 1].file_offset + rp.ops[i - 1].len) return at + "overlapping";
    prev_start = op.file_offset;
    if (op.len > std::max(opt.max_read_bytes, item)) return at + "longer than max_read_bytes";
    u64 op_needed = 0, lo = UINT64_MAX, hi = 0;
    std::vector<u64> delivered;  // the op's bytes that reach memory, as offsets in the read
    for (const auto& p : op.pieces) {
      if (p.len == 0) return at + "empty piece";
      if (p.stepped() && p.len % item != 0) return at + "a stepped piece cuts an element";
      lo = std::min(lo, p.offset);
      hi = std::max(hi, p.offset + p.span(item));
      op_needed += p.len;
      const u64 ds = p.dst_stride(item), ss = p.src_stride(item);
      for (u64 b = 0; b < p.len; ++b) {
        const u64 off = p.stepped() ? p.offset + b / item * ss + b % item : p.offset + b;
        const u64 lands = p.stepped() ? p.dst + b / item * ds + b % item : p.dst + b;
        const u64 f = op.file_offset + off - data_offset;
        if (off >= op.len) return at + "a piece reaches past its read";
        if (f >= src_end || want[f] < 0) return at + "reads a byte nobody needs into memory";
        if (want[f] != static_cast<long long>(lands)) return at + "byte lands at the wrong place";
        if (seen[f]++) return at + "byte delivered twice";
        delivered.push_back(off);
      }
    }
    if (lo != 0 || hi != op.len) return at + "reads bytes at its edges for nothing";
    std::sort(delivered.begin(), delivered.end());
    for (std::size_t k = 1; k < delivered.size(); ++k)
      if (delivered[k] - delivered[k - 1] - 1 > opt.max_gap_bytes) return at + "gap over max_gap_bytes";
    if (op_needed != op.needed()) return at + "needed()";
    const double wasted = double(op.len - op_needed);
    if (!stepped &&
        wasted > opt.max_over_read * double(op_needed) * (1 + 1e-12))  // a permuted block's merge on the gap alone
      return at + "over-read " + std::to_string(wasted) + " of " + std::to_string(op_needed) + " needed";
    const bool whole =
        op.pieces.size() == 1 && op.pieces[0].offset == 0 && op.pieces[0].len == op.len && !op.pieces[0].stepped();
    if (op.direct() != whole) return at + "direct() wrong";
    read += op.len;
    got += op_needed;
  }
  if (got != needed) return "delivered " + std::to_string(got) + " of " + std::to_string(needed) + " bytes";
  if (rp.bytes_needed != needed || rp.bytes_read != read) return "bytes_needed/bytes_read";
  return {};
}

/// Runs with disjoint src and dst ranges, in random order (not the sorted order of a plan).
copy_plan random_runs(rng_t& r) {
  copy_plan runs(pick(r, 0, 12));
  u64 src = pick(r, 0, 5);
  for (auto& x : runs) {
    x.len = pick(r, 1, chance(r, 5) ? 200 : 12);
    x.src = src;
    src += x.len + (chance(r, 3) ? 0 : pick(r, 0, 40));
  }
  std::vector<std::size_t> order(runs.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), r);
  u64 dst = 0;
  for (auto k : order) {
    runs[k].dst = dst;
    dst += runs[k].len + pick(r, 0, 3);
  }
  if (chance(r, 2)) std::shuffle(runs.begin(), runs.end(), r);
  return runs;
}

}  // namespace

TEST_CASE("property: read plans deliver every needed byte once, within their bounds") {
  rng_t r(kSeed + 3);
  failure_budget budget;
  static const u64 gaps[] = {0, 1, 8, 64, 4096};
  static const double ratios[] = {0.0, 0.02, 0.25, 1.0, 4.0};
  static const u64 maxes[] = {1, 3, 16, 100, 1000, u64(64) << 20};
  static const u64 items[] = {1, 2, 4, 8};
  for (u64 i = 0; i < 10000; ++i) {
    copy_plan runs;
    std::string what;
    if (chance(r, 2)) {
      const shape_t full = random_shape(r);
      shard_spec a = random_spec(r, full), b = random_spec(r, full);
      runs = compute_copy_plan(a, b, full);
      what = "plan of " + to_string(a) + " x " + to_string(b);
    } else {
      runs = random_runs(r);
      what = "runs " + str(runs);
    }
    read_options opt;
    opt.max_gap_bytes = gaps[pick(r, 0, std::size(gaps) - 1)];
    opt.max_over_read = ratios[pick(r, 0, std::size(ratios) - 1)];
    opt.max_read_bytes = maxes[pick(r, 0, std::size(maxes) - 1)];
    const u64 item = items[pick(r, 0, std::size(items) - 1)], data_offset = pick(r, 0, 1000);
    const auto rp = make_read_plan(runs, data_offset, item, opt);
    const std::string ctx = "seed=" + std::to_string(kSeed + 3) + " case=" + std::to_string(i) + " " + what +
                            " item=" + std::to_string(item) + " gap=" + std::to_string(opt.max_gap_bytes) +
                            " ratio=" + std::to_string(opt.max_over_read) +
                            " max=" + std::to_string(opt.max_read_bytes);
    if (!budget.check(read_plan_error(runs, data_offset, item, opt, rp), ctx)) break;
  }
}

/// The brute force of a permuted block's plan: each element of `mine` that `chunk` holds, as
/// (its offset in the chunk's bytes, stored with its dimensions in `order`) -> my local offset.
std::map<u64, u64> bf_permuted(const shard_spec& mine, const block_spec& chunk, const std::vector<std::size_t>& order,
                               const shape_t& full) {
  const auto lm = bf_local_of(bf_elements(mine, full), full);
  const auto gc = bf_elements(chunk, full);  // the chunk's global indices in logical row-major order
  const shape_t& cs = chunk.local_shape();
  shape_t stride(full.size());
  u64 t = 1;
  for (std::size_t i = order.size(); i-- > 0;) {
    stride[order[i]] = t;
    t *= cs[order[i]];
  }
  std::map<u64, u64> out;
  for (u64 k = 0; k < gc.size(); ++k) {
    u64 rem = k, at = 0;
    for (std::size_t d = full.size(); d-- > 0;) {
      at += rem % cs[d] * stride[d];
      rem /= cs[d];
    }
    if (lm[gc[k]] >= 0) out[at] = static_cast<u64>(lm[gc[k]]);
  }
  return out;
}

TEST_CASE(
    "property: a block stored with its dimensions in another order: every shared element once, from its stored "
    "place; the reads deliver it") {
  rng_t r(kSeed + 7);
  failure_budget budget;
  u64 stepped = 0, gathered = 0, cases = 0, tiled = 0;
  for (u64 i = 0; i < 6000; ++i) {
    const shape_t full = random_shape(r);
    if (full.empty()) continue;
    const shard_spec mine = random_spec(r, full);
    const block_spec chunk = random_block(r, full);
    std::vector<std::size_t> order(full.size());
    std::iota(order.begin(), order.end(), std::size_t(0));
    std::shuffle(order.begin(), order.end(), r);
    // tiles of gathering runs as the library cuts them, or small enough to cut these blocks
    const u64 tile = chance(r, 2) ? u64(1) << 16 : pick(r, 1, 64);
    const copy_plan runs = permuted_copy_plan(mine, chunk, order, full, tile);
    std::string ctx = case_ctx(kSeed + 7, i, full) + " mine=" + to_string(mine) + " chunk=" + to_string(chunk) +
                      " order=" + to_string(shape_t(order.begin(), order.end())) + " tile=" + std::to_string(tile);
    std::string err;
    std::map<u64, u64> got;
    for (std::size_t k = 0; k < runs.size() && err.empty(); ++k) {
      const copy_run& x = runs[k];
      if (x.len == 0) err = "empty run";
      if (k && runs[k - 1].src >= x.src) err = "runs not sorted by src";
      if (k && x.src_step == 1 && runs[k - 1].src + runs[k - 1].len == x.src && runs[k - 1].dst_step == x.dst_step &&
          runs[k - 1].src_step == 1 && runs[k - 1].dst + runs[k - 1].len * x.dst_step == x.dst)
        err = "runs not coalesced";  // (a gathering run is kept to its tile)
      if (x.src_step != 1 && x.len > 1 && x.len > std::max<u64>(1, tile / x.src_step))
        err = "a gathering run spans more than a tile";
      if (x.src_step != 1 && x.len > 1 && tile < (u64(1) << 16) && x.len == tile / x.src_step) ++tiled;
      if (x.src_step != 1 && x.dst_step != 1 && x.len > 1) err = "a run with neither side contiguous";
      for (u64 j = 0; j < x.len; ++j)
        if (!got.emplace(x.src + j * x.src_step, x.dst + j * x.dst_step).second) err = "an element moved twice";
      if (x.dst_step != 1 && x.len > 1) ++stepped;
      if (x.src_step != 1 && x.len > 1) ++gathered;
    }

    if (err.empty() && got != bf_permuted(mine, chunk, order, full)) err = "moves other elements than the brute force";
    if (err.empty()) {  // and the reads of those runs
      read_options opt;
      opt.max_gap_bytes = pick(r, 0, 1) ? 0 : 64;
      opt.max_over_read = pick(r, 0, 1) ? 0.0 : 1.0;
      opt.max_read_bytes = chance(r, 2) ? pick(r, 1, 40) : u64(64) << 20;
      const u64 item = u64(1) << pick(r, 0, 3), data_offset = pick(r, 0, 100);
      err = read_plan_error(runs, data_offset, item, opt, make_read_plan(runs, data_offset, item, opt));
      ctx += " item=" + std::to_string(item) + " max=" + std::to_string(opt.max_read_bytes);
    }
    ++cases;
    if (!budget.check(err, ctx + " runs=" + str(runs))) break;
  }
  CHECK(cases > 4000);
  CHECK(stepped > 1000);   // the property saw runs that land apart
  CHECK(gathered > 1000);  // and runs that gather from apart
  CHECK(tiled > 300);      // and gathering runs a small tile cut
}

TEST_CASE("permuted copy plan: a transposed and a channels_last block, a run per row of the longer side") {
  // [2, 3] stored transposed (order 1, 0): my rows (3 elements) are longer than the stored ones
  // (2), so each run gathers a row of mine, its elements 2 apart in the chunk
  const shape_t t{2, 3};
  const std::vector<std::size_t> tr{1, 0};
  const copy_plan p = permuted_copy_plan(shard_spec(block_spec::whole(t)), block_spec::whole(t), tr, t);
  CHECK(p == copy_plan{{0, 0, 3, 1, 2}, {3, 1, 3, 1, 2}});
  // my second row only, as a flat range: one run
  const copy_plan q = permuted_copy_plan(shard_spec(flat_spec{{3, 6}}), block_spec::whole(t), tr, t);
  CHECK(q == copy_plan{{0, 1, 3, 1, 2}});
  // [3, 2] stored transposed: the stored rows (3) are the longer, each lands 2 apart in mine
  const shape_t t2{3, 2};
  CHECK(permuted_copy_plan(shard_spec(block_spec::whole(t2)), block_spec::whole(t2), tr, t2) ==
        copy_plan{{0, 0, 3, 2, 1}, {1, 3, 3, 2, 1}});
  // channels_last [N, C, H, W] = [2, 3, 2, 2], stored N, H, W, C: a run of C per (n, h, w), H*W apart
  const shape_t cl{2, 3, 2, 2};
  const copy_plan c = permuted_copy_plan(shard_spec(block_spec::whole(cl)), block_spec::whole(cl),
                                         std::vector<std::size_t>{0, 2, 3, 1}, cl);
  REQUIRE(c.size() == 8);
  CHECK(c[0] == copy_run{0, 0, 3, 4});
  CHECK(c[1] == copy_run{1, 3, 3, 4});
  CHECK(c[4] == copy_run{12, 12, 3, 4});
  // the runs' reads: one read of the whole block, pieces that land 4 elements (16 bytes) apart
  const read_plan rp = make_read_plan(c, 100, 4);
  REQUIRE(rp.ops.size() == 1);
  CHECK(rp.ops[0].len == 96);
  CHECK_FALSE(rp.ops[0].direct());
  CHECK(rp.ops[0].pieces[1].dst == 4);
  CHECK(rp.ops[0].pieces[1].dst_step == 16);
  CHECK(rp.ops[0].pieces[1].src_step == 0);
  // reads cut at whole elements: 10 bytes a read of 4-byte elements take 2 at most
  for (const auto& op : make_read_plan(c, 0, 4, {.max_read_bytes = 10}).ops)
    for (const auto& piece : op.pieces) CHECK(piece.len % 4 == 0);
  CHECK_THROWS_AS(
      permuted_copy_plan(shard_spec(block_spec::whole(t)), block_spec::whole(t), std::vector<std::size_t>{1, 1}, t),
      error);
}

TEST_CASE(
    "permuted copy plan: a view that cuts the dimension stored innermost gathers, a run per row, not per element") {
  const std::vector<std::size_t> tr{1, 0};
  // row 0 of [2, 1000] stored transposed: one run gathering every other element of the chunk;
  // one read of the span (the other row's elements between are read for nothing)
  const shape_t wide{2, 1000};
  const copy_plan row =
      permuted_copy_plan(shard_spec(block_spec({1, 1000}, {0, 0})), block_spec::whole(wide), tr, wide);
  CHECK(row == copy_plan{{0, 0, 1000, 1, 2}});
  const read_plan one = make_read_plan(row, 0, 4);
  REQUIRE(one.ops.size() == 1);
  REQUIRE(one.ops[0].pieces.size() == 1);
  CHECK(one.ops[0].len == (999 * 2 + 1) * 4);
  CHECK(one.ops[0].pieces[0].src_step == 8);
  CHECK(one.ops[0].pieces[0].dst_step == 0);
  CHECK(one.bytes_needed == 4000);
  CHECK(read_plan_error(row, 0, 4, {}, one).empty());
  // both rows of [2, 100000]: runs in tiles of 2^16 chunk elements (32768 of a row), the rows of
  // a tile side by side, so the file is read once, in one read, though every run's elements
  // interleave with another's
  const shape_t big{2, 100000};
  const copy_plan both = permuted_copy_plan(shard_spec(block_spec::whole(big)), block_spec::whole(big), tr, big);
  REQUIRE(both.size() == 8);
  CHECK(both[0] == copy_run{0, 0, 32768, 1, 2});
  CHECK(both[1] == copy_run{100000, 1, 32768, 1, 2});
  CHECK(both[2] == copy_run{32768, 65536, 32768, 1, 2});
  CHECK(both[7] == copy_run{100000 + 98304, 196609, 1696, 1, 2});
  const read_plan once = make_read_plan(both, 16, 4);
  REQUIRE(once.ops.size() == 1);
  CHECK(once.bytes_read == 800000);
  CHECK(read_plan_error(both, 16, 4, {}, once).empty());
  read_plan tampered = once;  // the checker itself: a piece whose elements lie elsewhere is caught
  tampered.ops[0].pieces[1].src_step += 4;
  CHECK(read_plan_error(both, 16, 4, {}, tampered) == "op 0: byte lands at the wrong place");
  // cut at 100,000 bytes a read: a tile's second row may start before its first row's rest; what
  // is read twice stays within a tile per read
  const read_options small{.max_read_bytes = 100000};
  const read_plan cut = make_read_plan(both, 16, 4, small);
  CHECK(read_plan_error(both, 16, 4, small, cut).empty());
  CHECK(cut.bytes_read <= 800000 + cut.ops.size() * (u64(1) << 16) * 4);
  // the rows of a tile fill each other's holes: one read even where no gap may merge
  const read_options no_gap{.max_gap_bytes = 0};
  const read_plan tight = make_read_plan(both, 16, 4, no_gap);
  CHECK(tight.ops.size() == 1);
  CHECK(read_plan_error(both, 16, 4, no_gap, tight).empty());
  // stored rows of 16 elements or more are read as stored, however long my rows: a transposed
  // [1100, 1200] (elements 1100 apart along my rows) is 1200 runs and one read, not a read per
  // element; a [260, 260, 300] stored (2, 0, 1) seen as 10 x 260 x 300 is 300 runs
  const shape_t sq{1100, 1200};
  const copy_plan rows = permuted_copy_plan(shard_spec(block_spec::whole(sq)), block_spec::whole(sq), tr, sq);
  CHECK(rows.size() == 1200);
  CHECK(make_read_plan(rows, 0, 4).ops.size() == 1);
  const shape_t cube{260, 260, 300};
  CHECK(permuted_copy_plan(shard_spec(block_spec({10, 260, 300}, {0, 0, 0})), block_spec::whole(cube),
                           std::vector<std::size_t>{2, 0, 1}, cube)
            .size() == 300);
  // a flat window over a transposed chunk: a partial row, whole rows, a partial row; stored rows
  // 1100 long are read as stored (one read, as before runs gathered), and a chunk whose rows are
  // short gathers each box in tiles that interleave with the other boxes' in the file
  const shape_t t1100{1100, 20};
  const copy_plan win = permuted_copy_plan(shard_spec(flat_spec{{10, 22000}}), block_spec::whole(t1100), tr, t1100);
  CHECK(std::none_of(win.begin(), win.end(), [](const copy_run& x) { return x.src_step != 1; }));
  CHECK(make_read_plan(win, 0, 4).ops.size() == 1);
  const shape_t t500{500, 2000};
  const copy_plan win2 =
      permuted_copy_plan(shard_spec(flat_spec{{600, 600 + (1 << 18)}}), block_spec::whole(t500), tr, t500);
  CHECK(std::any_of(win2.begin(), win2.end(), [](const copy_run& x) { return x.src_step != 1; }));
  const read_plan wp = make_read_plan(win2, 0, 4);
  CHECK(wp.ops.size() == 1);
  CHECK(read_plan_error(win2, 0, 4, {}, wp).empty());
  // elements further apart than max_gap_bytes: read one by one, nothing between them
  const shape_t tall{300, 4};
  const copy_plan sparse =
      permuted_copy_plan(shard_spec(block_spec({1, 4}, {5, 0})), block_spec::whole(tall), tr, tall);
  CHECK(sparse == copy_plan{{0, 5, 4, 1, 300}});
  const read_options gap64{.max_gap_bytes = 64};
  const read_plan each = make_read_plan(sparse, 0, 4, gap64);
  CHECK(each.ops.size() == 4);
  CHECK(each.bytes_read == 16);
  CHECK(read_plan_error(sparse, 0, 4, gap64, each).empty());
  // elements over 512 apart are not gathered: a run per stored row (here of one element)
  const shape_t taller{3000, 4};
  CHECK(permuted_copy_plan(shard_spec(block_spec({1, 4}, {5, 0})), block_spec::whole(taller), tr, taller) ==
        copy_plan{{0, 5, 1, 4}, {1, 3005, 1, 4}, {2, 6005, 1, 4}, {3, 9005, 1, 4}});
}

TEST_CASE("read plan: small gaps merge into one staged read; a lone run is read in place") {
  const copy_plan runs{{0, 0, 100}, {100, 101, 100}};  // a one-element gap in the file
  auto merged = make_read_plan(runs, 8, 4, {.max_gap_bytes = 16, .max_over_read = 0.02});
  REQUIRE(merged.ops.size() == 1);
  CHECK(merged.ops[0].file_offset == 8);
  CHECK(merged.ops[0].len == 804);
  CHECK_FALSE(merged.ops[0].direct());
  CHECK(merged.bytes_read == 804);
  CHECK(merged.bytes_needed == 800);
  auto apart = make_read_plan(runs, 8, 4, {.max_gap_bytes = 3, .max_over_read = 0.02});
  REQUIRE(apart.ops.size() == 2);
  CHECK(apart.ops[0].direct());
  CHECK(apart.ops[1].file_offset == 8 + 404);
  auto split = make_read_plan(copy_plan{{0, 0, 100}}, 0, 4, {.max_read_bytes = 128});
  REQUIRE(split.ops.size() == 4);  // 400 bytes in reads of at most 128
  for (const auto& op : split.ops) CHECK(op.direct());
  CHECK(split.ops[3].len == 16);
  CHECK(split.ops[3].pieces[0].dst == 384);
}

// =======================================================================================
// OLMo-core's own cases

namespace {
flat_spec fo(std::initializer_list<element_range> r) { return flat_spec(r); }
block_spec blk(shape_t ls, shape_t go) { return block_spec(std::move(ls), std::move(go)); }
const shape_t flat_full{128, 256};
const shape_t block_full{16, 8};

template <class A, class B>
void check_overlap_case(const A& mine, const B& other, const shape_t& full, std::optional<overlap_type> want) {
  INFO("mine=" << to_string(mine) << " other=" << to_string(other));
  mine.validate(full, "mine");
  other.validate(full, "other");
  CHECK(str(compute_overlap(mine, other, full)) == str(want));
  CHECK(str(compute_overlap(shard_spec(mine), shard_spec(other), full)) == str(want));
  CHECK(str(bf_classify(bf_elements(mine, full), bf_elements(other, full), full)) == str(want));  // the table itself
  CHECK(copy_plan_error(compute_copy_plan(mine, other, full), bf_elements(mine, full), bf_elements(other, full),
                        full) == "");
}
}  // namespace

TEST_CASE("OLMo-core overlap table: flattened offsets, full (128,256)") {
  check_overlap_case(fo({{0, 3}, {3, 6}}), fo({{0, 6}}), flat_full, overlap_type::equal);
  check_overlap_case(fo({{0, 3}, {6, 12}}), fo({{0, 3}, {6, 9}}), flat_full, overlap_type::superset);
  check_overlap_case(fo({{0, 3}, {6, 12}}), fo({{0, 15}}), flat_full, overlap_type::subset);
  check_overlap_case(fo({{0, 3}, {6, 12}}), fo({{2, 5}}), flat_full, overlap_type::mixed);
  check_overlap_case(fo({{0, 3}, {6, 12}}), fo({{12, 15}}), flat_full, std::nullopt);
  CHECK_SAME(compute_copy_plan(fo({{0, 3}, {6, 12}}), fo({{2, 5}}), flat_full), copy_plan{{2, 0, 1}});
  CHECK_SAME(compute_copy_plan(fo({{0, 3}, {3, 6}}), fo({{0, 6}}), flat_full), copy_plan{{0, 0, 6}});
  CHECK_SAME(compute_copy_plan(fo({{0, 3}, {6, 12}}), fo({{0, 15}}), flat_full), copy_plan{{0, 0, 3}, {3, 6, 6}});
}

TEST_CASE("OLMo-core overlap table: blocks, full (16,8)") {
  check_overlap_case(blk({2, 8}, {0, 0}), blk({2, 8}, {0, 0}), block_full, overlap_type::equal);
  check_overlap_case(blk({4, 8}, {0, 0}), blk({2, 8}, {1, 0}), block_full, overlap_type::superset);
  check_overlap_case(blk({2, 8}, {1, 0}), blk({4, 8}, {0, 0}), block_full, overlap_type::subset);
  check_overlap_case(blk({2, 8}, {0, 0}), blk({4, 4}, {0, 0}), block_full, overlap_type::mixed);
  check_overlap_case(blk({2, 4}, {1, 2}), blk({4, 8}, {0, 0}), block_full, overlap_type::subset);
  check_overlap_case(blk({2, 4}, {1, 2}), blk({2, 4}, {0, 0}), block_full, overlap_type::mixed);
  CHECK_SAME(compute_copy_plan(blk({4, 8}, {0, 0}), blk({2, 8}, {1, 0}), block_full), copy_plan{{8, 0, 16}});
  CHECK_SAME(compute_copy_plan(blk({2, 4}, {1, 2}), blk({2, 4}, {0, 0}), block_full), copy_plan{{0, 6, 2}});
}

TEST_CASE("where OLMo-core's pairwise rule differs: set semantics say SUPERSET") {
  // OLMo-core pairs range (0,3) with (0,3) and ignores (6,9), answering EQUAL; the file
  // lacks half of my elements, so it cannot be the only source.
  check_overlap_case(fo({{0, 3}, {6, 9}}), fo({{0, 3}}), flat_full, overlap_type::superset);
  const std::vector<flat_spec> files{fo({{0, 3}})};
  auto plan = plan_load(fo({{0, 3}, {6, 9}}), files, flat_full);
  CHECK(plan.covered == 3);
  CHECK_SAME(plan.missing, std::vector<element_range>{{3, 6}});
}

TEST_CASE("OLMo-core merged flattened offsets") {
  using V = std::vector<element_range>;
  CHECK_SAME(merged_ranges_vector(fo({{0, 3}}), flat_full), V{{0, 3}});
  CHECK_SAME(merged_ranges_vector(fo({{0, 3}, {3, 6}}), flat_full), V{{0, 6}});
  CHECK_SAME(merged_ranges_vector(fo({{0, 3}, {6, 9}, {9, 12}, {15, 18}}), flat_full), V{{0, 3}, {6, 12}, {15, 18}});
  CHECK_SAME(merged_ranges_vector(fo({{0, 3}, {4, 4}, {3, 6}}), flat_full), V{{0, 6}});  // empty ones drop out
  CHECK_SAME(merged_ranges_vector(blk({8}, {0}), shape_t{16}), V{{0, 8}});
  CHECK_SAME(merged_ranges_vector(blk({4, 8}, {4, 0}), block_full), V{{32, 64}});  // rows (32,40)..(56,64)
  V cols;
  for (u64 row = 0; row < 16; ++row) cols.push_back({row * 8 + 2, row * 8 + 4});
  CHECK(merged_ranges_vector(blk({16, 2}, {0, 2}), block_full) == cols);
  CHECK(cols.back() == element_range{122, 124});
  CHECK_SAME(merged_ranges_vector(blk({}, {}), shape_t{}), V{{0, 1}});  // 0-d: one element
}

// =======================================================================================
// hand-computed cases

TEST_CASE("cross-form: flat vs block and block vs flat") {
  const shape_t full{4, 4};
  // block rows 0-1, cols 2-3 = globals 2,3,6,7 = its locals 0..3
  check_overlap_case(fo({{2, 10}}), blk({2, 2}, {0, 2}), full, overlap_type::superset);
  CHECK_SAME(compute_copy_plan(fo({{2, 10}}), blk({2, 2}, {0, 2}), full), copy_plan{{0, 0, 2}, {4, 2, 2}});
  // block rows 1-2 = globals 4..11; flat [0,5) [10,16): 4 is its local 4, 10,11 its locals 5,6
  check_overlap_case(blk({2, 4}, {1, 0}), fo({{0, 5}, {10, 16}}), full, overlap_type::mixed);
  CHECK_SAME(compute_copy_plan(blk({2, 4}, {1, 0}), fo({{0, 5}, {10, 16}}), full), copy_plan{{0, 4, 1}, {6, 5, 2}});
  // a flat spec equal as a set to a block: EQUAL across forms, one run
  check_overlap_case(fo({{4, 6}, {6, 12}}), blk({2, 4}, {1, 0}), full, overlap_type::equal);
  CHECK_SAME(compute_copy_plan(fo({{4, 6}, {6, 12}}), blk({2, 4}, {1, 0}), full), copy_plan{{0, 0, 8}});
  check_overlap_case(blk({4, 1}, {0, 3}), fo({{0, 3}, {4, 7}}), full, std::nullopt);
}

TEST_CASE("3-D blocks, hand-computed runs") {
  const shape_t full{2, 3, 4};
  const auto mine = blk({2, 2, 4}, {0, 1, 0});   // globals [4,12) and [16,24)
  const auto other = blk({1, 3, 2}, {1, 0, 1});  // globals 13,14 17,18 21,22
  CHECK_SAME(merged_ranges_vector(mine, full), std::vector<element_range>{{4, 12}, {16, 24}});
  CHECK_SAME(merged_ranges_vector(other, full), std::vector<element_range>{{13, 15}, {17, 19}, {21, 23}});
  check_overlap_case(mine, other, full, overlap_type::mixed);
  CHECK_SAME(compute_copy_plan(mine, other, full), copy_plan{{9, 2, 2}, {13, 4, 2}});
  CHECK_SAME(compute_copy_plan(other, mine, full), copy_plan{{2, 9, 2}, {4, 13, 2}});
}

TEST_CASE("5-D blocks, hand-computed runs") {
  const shape_t full{2, 2, 2, 2, 3};
  const auto mine = blk({2, 1, 2, 2, 3}, {0, 1, 0, 0, 0});   // globals [12,24) [36,48)
  const auto other = blk({1, 2, 2, 1, 3}, {1, 0, 0, 1, 0});  // 27-29 33-35 39-41 45-47
  CHECK_SAME(merged_ranges_vector(mine, full), std::vector<element_range>{{12, 24}, {36, 48}});
  check_overlap_case(mine, other, full, overlap_type::mixed);
  CHECK_SAME(compute_copy_plan(mine, other, full), copy_plan{{15, 6, 3}, {21, 9, 3}});
  const auto whole = block_spec::whole(full);
  check_overlap_case(whole, other, full, overlap_type::superset);
  CHECK_SAME(compute_copy_plan(whole, other, full), copy_plan{{27, 0, 3}, {33, 3, 3}, {39, 6, 3}, {45, 9, 3}});
  check_overlap_case(other, whole, full, overlap_type::subset);
  // the rows of `mine` (i0, i1=1) as flattened offsets: EQUAL across forms
  check_overlap_case(mine, fo({{12, 24}, {36, 48}}), full, overlap_type::equal);
  CHECK_SAME(compute_copy_plan(mine, fo({{12, 24}, {36, 48}}), full), copy_plan{{0, 0, 24}});
}

TEST_CASE("plan_load: replicated files, partial files and gaps") {
  const shape_t full{16};
  const std::vector<shard_spec> files{fo({{0, 4}}), fo({{0, 4}}), blk({6}, {3}), fo({{12, 14}})};
  auto plan = plan_load(shard_spec(fo({{2, 16}})), files, full);  // my locals 0..13 = globals 2..15
  REQUIRE(plan.files.size() == 3);
  CHECK(plan.files[0].file == 0);  // the first replica; its twin provides nothing
  CHECK_SAME(plan.files[0].runs, copy_plan{{0, 2, 2}});
  CHECK(plan.files[0].overlap == overlap_type::mixed);
  CHECK(plan.files[1].file == 2);
  CHECK_SAME(plan.files[1].runs, copy_plan{{2, 1, 5}});  // globals 4..8 of the block at 3
  CHECK(plan.files[1].overlap == overlap_type::superset);
  CHECK(plan.files[2].file == 3);
  CHECK_SAME(plan.files[2].runs, copy_plan{{10, 0, 2}});
  CHECK_SAME(plan.missing, std::vector<element_range>{{7, 10}, {12, 14}});
  CHECK(plan.covered == 9);
  const std::vector<shard_spec> more{fo({{0, 4}}), blk({6}, {3}), fo({{12, 14}}), fo({{8, 16}})};
  auto all = plan_load(shard_spec(fo({{2, 16}})), more, full);
  CHECK(all.missing.empty());
  CHECK(all.covered == 14);
  // a file holding all of mine settles it alone, even after partial ones
  const std::vector<shard_spec> whole{fo({{0, 4}}), block_spec::whole(full)};
  auto one = plan_load(shard_spec(fo({{2, 16}})), whole, full);
  REQUIRE(one.files.size() == 1);
  CHECK(one.files[0].file == 1);
  CHECK(one.files[0].overlap == overlap_type::subset);
  CHECK_SAME(one.files[0].runs, copy_plan{{0, 2, 14}});
}

// =======================================================================================
// validation

namespace {
template <class S>
void check_invalid(const S& s, const shape_t& full, const char* needle) {
  INFO(to_string(s) << " in " << to_string(full));
  try {
    s.validate(full, "ckpt/model: tensor 'w'");
    FAIL("accepted");
  } catch (const error& e) {
    CHECK(e.code() == make_error_code(errc::invalid_spec));
    const std::string what = e.what();
    CHECK(what.rfind("ckpt/model: tensor 'w'", 0) == 0);
    CHECK_MESSAGE(what.find(needle) != std::string::npos, what);
  }
  CHECK_THROWS_AS(shard_spec(s).validate(full, "via shard_spec"), error);
}
}  // namespace

TEST_CASE("validation errors name the context and the rule") {
  check_invalid(fo({{0, 10}}), {3, 3}, "out of bounds");
  check_invalid(fo({{0, 3}, {10, 10}}), {3, 3}, "out of bounds");  // empty, but past the end
  check_invalid(fo({{0, 5}, {4, 8}}), {3, 3}, "overlaps");
  check_invalid(fo({{5, 8}, {0, 3}}), {3, 3}, "out of order");
  check_invalid(fo({{5, 3}}), {3, 3}, "ends before it begins");
  check_invalid(blk({2, 2}, {0, 0}), {4, 4, 4}, "dimensions");
  check_invalid(blk({2, 2, 2}, {0, 0}), {4, 4, 4}, "dimensions");
  check_invalid(blk({2, 4}, {3, 0}), {4, 4}, "passes the end of dimension 0");
  check_invalid(blk({1, 5}, {0, 0}), {4, 4}, "passes the end of dimension 1");
  check_invalid(blk({1}, {~u64(0)}), {4}, "passes the end");  // offset + extent overflows
  check_invalid(fo({{0, 1}}), {u64(1) << 40, u64(1) << 40}, "overflows");
  // valid: empty ranges anywhere, adjacent ranges, empty blocks, 0-d
  CHECK_NOTHROW(fo({{5, 8}, {2, 2}, {8, 9}}).validate(shape_t{3, 3}, "ok"));
  CHECK_NOTHROW(fo({}).validate(shape_t{3, 3}, "ok"));
  CHECK_NOTHROW(blk({0, 4}, {4, 0}).validate(shape_t{4, 4}, "ok"));
  CHECK_NOTHROW(blk({}, {}).validate(shape_t{}, "ok"));
  CHECK_NOTHROW(fo({{0, 1}}).validate(shape_t{}, "ok"));
}

// =======================================================================================
// concepts

// Ranges of elements and of bytes are different types: a plan in elements cannot be handed to
// code that expects bytes, nor the other way round.
static_assert(!std::is_convertible_v<element_range, byte_range>);
static_assert(!std::is_convertible_v<byte_range, element_range>);
static_assert(!std::is_invocable_v<decltype([](const byte_range&) {}), element_range>);
static_assert(
    std::is_same_v<decltype(merged_ranges_vector(std::declval<const flat_spec&>(), {})), std::vector<element_range>>);

TEST_CASE("numel: the product of the extents, 1 for a 0-d tensor, 0 with an empty extent") {
  static_assert(numel(shape_t{}) == 1);
  CHECK(numel(shape_t{4, 5}) == bf_numel({4, 5}));
  CHECK(numel(shape_t{3, 0, 7}) == 0);
  CHECK(numel(shape_t{}) == 1);
  CHECK(numel(shape_t{1u << 20, 1u << 20}) == (u64(1) << 40));
}

namespace {
struct no_cursor {
  u64 local_numel() const { return 0; }
  void validate(std::span<const u64>, std::string_view) const {}
};
struct no_numel {
  void validate(std::span<const u64>, std::string_view) const {}
  flat_spec::cursor_type cursor(std::span<const u64>) const { return flat_spec::cursor_type(f); }
  flat_spec f;
};
struct complete_spec : no_numel {
  u64 local_numel() const { return f.local_numel(); }
};
struct cursor_without_seek {
  bool done() const { return true; }
  spec_run run() const { return {}; }
  void next() {}
};
}  // namespace

static_assert(ShardSpec<flat_spec>);
static_assert(ShardSpec<block_spec>);
static_assert(ShardSpec<shard_spec>);
static_assert(!ShardSpec<no_cursor>);
static_assert(!ShardSpec<no_numel>);
static_assert(ShardSpec<complete_spec>);
static_assert(!ShardSpec<int>);
static_assert(SpecCursor<flat_spec::cursor_type>);
static_assert(SpecCursor<block_spec::cursor_type>);
static_assert(SpecCursor<shard_spec::cursor_type>);
static_assert(!SpecCursor<cursor_without_seek>);

TEST_CASE("a user type that models ShardSpec works with the algorithms") {
  complete_spec s;
  s.f = fo({{2, 5}});
  CHECK_SAME(compute_copy_plan(s, fo({{0, 4}}), shape_t{8}), copy_plan{{0, 2, 2}});
  CHECK(compute_overlap(s, fo({{0, 4}}), shape_t{8}) == overlap_type::mixed);
}

// =======================================================================================
// laziness

TEST_CASE("merged ranges are lazy: huge row and column blocks") {
  // Laziness is counted, not timed: the cursors count the loop iterations they take, and a
  // walk over the blocks' rows would take a million of them.
  const shape_t rows_full{2'000'000, 64};
  const auto rows = blk({1'000'000, 64}, {500'000, 0});
  rows.validate(rows_full, "rows");
  int count = 0;
  const auto row_ranges = merged_ranges(rows, rows_full);
  auto it = row_ranges.begin();
  for (; it != row_ranges.end(); ++it) {
    CHECK(*it == element_range{500'000ull * 64, 1'500'000ull * 64});
    ++count;
  }
  CHECK(count == 1);
  CHECK_MESSAGE(it.steps() <= 4, "a one-run block took " << it.steps() << " steps");

  const shape_t cols_full{1'000'000, 64};
  const auto cols = blk({1'000'000, 8}, {0, 8});
  cols.validate(cols_full, "cols");
  std::vector<element_range> first;
  const auto col_ranges = merged_ranges(cols, cols_full);
  auto ci = col_ranges.begin();
  for (; ci != col_ranges.end(); ++ci) {
    first.push_back(*ci);
    if (first.size() == 3) break;
  }
  CHECK_SAME(first, std::vector<element_range>{{8, 16}, {72, 80}, {136, 144}});
  // three rows: each a next() carrying through the one outer dimension, plus the look-ahead
  CHECK_MESSAGE(ci.steps() <= 4 * 2, "three rows took " << ci.steps() << " steps");
  // seeking deep into the column block is O(ndim), not a walk
  auto c = cols.cursor(cols_full);
  const u64 before = c.steps();
  c.seek(999'999ull * 64 + 10);
  REQUIRE_FALSE(c.done());
  CHECK(c.run() == spec_run{999'999ull * 64 + 8, 999'999ull * 64 + 16, 999'999ull * 8});
  CHECK_MESSAGE(c.steps() - before <= 1 + 2 * cols_full.size(), "seek took " << c.steps() - before << " steps");
  // the same seek through shard_spec's cursor counts the same steps
  auto sc = shard_spec(cols).cursor(cols_full);
  sc.seek(999'999ull * 64 + 10);
  CHECK(sc.run() == c.run());
  CHECK(sc.steps() == c.steps() - before);
}

TEST_CASE("cursor steps count the work: a walk costs one step per run, a seek a few") {
  // the counter itself must be able to tell a walk from a seek, or the laziness test above
  // could not fail: walking 1000 rows of a column block costs at least 1000 steps.
  const shape_t full{1000, 16};
  const auto cols = blk({1000, 4}, {0, 4});
  cols.validate(full, "cols");
  auto walk = cols.cursor(full);
  u64 runs = 0;
  for (; !walk.done(); walk.next()) ++runs;
  CHECK(runs == 1000);
  CHECK(walk.steps() >= 1000);
  auto jump = cols.cursor(full);
  jump.seek(999 * 16 + 5);
  CHECK(jump.run() == spec_run{999 * 16 + 4, 999 * 16 + 8, 999 * 4});
  CHECK(jump.steps() <= 1 + 2 * full.size());
  // a flat spec's seek is a binary search: about log2(ranges) comparisons, not one per range
  std::vector<element_range> many;
  for (u64 i = 0; i < 1024; ++i) many.push_back({i * 4, i * 4 + 2});
  const flat_spec f(many);
  auto fc = f.cursor(shape_t{4096});
  fc.seek(1023 * 4 + 1);
  CHECK(fc.run() == spec_run{1023 * 4, 1023 * 4 + 2, 1023 * 2});
  CHECK(fc.steps() <= 1 + 12);
}
