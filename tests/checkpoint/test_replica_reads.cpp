// Replicas read once (checkpoint/replica_reads.hpp, issue 56): ranks that load the same views
// read each byte of the checkpoint once between them and share it over the Comm. Every byte a
// rank file's data holds is counted as it is read from storage (a counting folder), every value
// is checked against the formula the checkpoint was saved from, and what the ranks exchange is
// counted (dist/counted.hpp), over point to point and over world broadcasts.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/load.hpp"
#include "shardsafe/checkpoint/replica_reads.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/storage/file.hpp"
#include "support/test_util.hpp"
#include "support/trainer_goldens.hpp"
#include "support/thread_world.hpp"

using namespace shardsafe;

namespace {

// --- sub_view and the pieces, against arithmetic of the test's own --------------------------

/// The global flat index of local element j of a view with this spec (none: the whole tensor).
std::uint64_t global_of(const std::optional<shard_spec>& s, const shape_t& full, std::uint64_t j) {
  if (!s) return j;
  if (s->is_flat()) {
    for (const auto& r : s->flat().ranges()) {
      if (j < r.size()) return r.begin + j;
      j -= r.size();
    }
    FAIL("local element past the spec");
  }
  const auto& b = s->block();
  shape_t idx(full.size());
  for (std::size_t d = full.size(); d-- > 0;) {
    idx[d] = j % b.local_shape()[d] + b.global_offset()[d];
    j /= b.local_shape()[d];
  }
  std::uint64_t g = 0;
  for (std::size_t d = 0; d < full.size(); ++d) g = g * full[d] + idx[d];
  return g;
}

flat_view random_view(std::mt19937_64& rng, std::vector<std::byte>& mem) {
  auto pick = [&](std::uint64_t lo, std::uint64_t hi) {
    return std::uniform_int_distribution<std::uint64_t>(lo, hi)(rng);
  };
  const dtype t = pick(0, 2) == 0 ? dtype::BF16 : pick(0, 1) ? dtype::F32 : dtype::U8;
  shape_t full(pick(0, 3));
  for (auto& d : full) d = pick(1, 9);
  flat_view v{"t", t, full, std::nullopt, nullptr, 0};
  const std::uint64_t n = numel(full);
  const auto kind = pick(0, 2);
  if (kind == 1) {  // flat ranges, some empty
    std::vector<element_range> rs;
    std::uint64_t at = 0;
    while (at < n && rs.size() < 4) {
      const std::uint64_t b = pick(at, n), e = pick(b, n);
      rs.push_back({b, e});
      at = e;
    }
    v.spec = flat_spec(std::move(rs));
  } else if (kind == 2 && !full.empty()) {  // a block
    shape_t ls(full.size()), off(full.size());
    for (std::size_t d = 0; d < full.size(); ++d) {
      off[d] = pick(0, full[d] - 1);
      ls[d] = pick(pick(0, 3) == 0 ? 1 : 0, full[d] - off[d]);
      if (pick(0, 2) == 0) ls[d] = std::min<std::uint64_t>(1, full[d] - off[d]);
    }
    v.spec = block_spec(ls, off);
  }
  v.nbytes = v.local_numel() * item_size(t);
  mem.resize(static_cast<std::size_t>(v.nbytes) + 1);
  v.data = mem.data();
  return v;
}

}  // namespace

TEST_CASE("replica reads: the pieces of R members partition every view, each a view of the same elements") {
  std::mt19937_64 rng(56);
  for (int trial = 0; trial < 3000; ++trial) {
    const int nv = 1 + static_cast<int>(rng() % 4);
    std::vector<std::vector<std::byte>> mem(static_cast<std::size_t>(nv));
    std::vector<flat_view> views;
    std::uint64_t total = 0;
    for (int i = 0; i < nv; ++i) {
      views.push_back(random_view(rng, mem[static_cast<std::size_t>(i)]));
      total += views.back().nbytes;
    }
    const std::uint64_t R = 1 + rng() % 7;
    const auto pieces = detail::all_pieces(views, 0, total, R);  // one sweep: the same cuts as each piece alone
    REQUIRE(pieces.size() == R);
    std::vector<std::vector<int>> owner(views.size());
    for (std::size_t i = 0; i < views.size(); ++i) owner[i].assign(static_cast<std::size_t>(views[i].nbytes), 0);
    for (std::uint64_t k = 0; k < R; ++k) {
      const auto segs =
          detail::stream_segments(views, detail::piece_boundary(total, k, R), detail::piece_boundary(total, k + 1, R));
      REQUIRE(segs.size() == pieces[k].size());
      for (std::size_t i = 0; i < segs.size(); ++i)
        REQUIRE((segs[i].view == pieces[k][i].view && segs[i].x == pieces[k][i].x && segs[i].y == pieces[k][i].y));
      for (const auto& s : segs) {
        const flat_view& v = views[s.view];
        const flat_view sub = detail::sub_view(v, s.x, s.y);
        sub.validate("sub");
        REQUIRE(sub.data == v.data + s.x);
        const std::uint64_t item = item_size(v.type);
        for (std::uint64_t j = 0; j < sub.local_numel(); ++j)
          REQUIRE(global_of(sub.spec, v.full_shape, j) == global_of(v.spec, v.full_shape, s.x / item + j));
        for (std::uint64_t b = s.x; b < s.y; ++b) ++owner[s.view][static_cast<std::size_t>(b)];
      }
    }
    for (const auto& o : owner)
      for (int c : o) REQUIRE(c == 1);
  }
}

namespace {

// --- a checkpoint saved from a formula, and a folder that counts its reads --------------------

struct tensor_def {
  std::string key;
  dtype type;
  shape_t shape;
};
const std::vector<tensor_def> model = {
    {"emb", dtype::F32, {37, 24}},    {"w1", dtype::BF16, {64, 48}}, {"norm", dtype::F32, {24}},
    {"cube", dtype::F32, {1, 30, 8}}, {"scalar", dtype::F32, {}},
};

/// Element e of tensor t: small integers, exact in BF16.
float value(std::size_t t, std::uint64_t e) { return static_cast<float>((e * 7 + t * 13) % 251) - 125.0f; }

void put(dtype type, std::byte* at, float f) {
  if (type == dtype::F32) {
    std::memcpy(at, &f, 4);
  } else {  // BF16: the float's upper half (exact for these values)
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    const std::uint16_t h = static_cast<std::uint16_t>(u >> 16);
    std::memcpy(at, &h, 2);
  }
}
float get(dtype type, const std::byte* at) {
  if (type == dtype::F32) {
    float f;
    std::memcpy(&f, at, 4);
    return f;
  }
  std::uint16_t h;
  std::memcpy(&h, at, 2);
  const std::uint32_t u = std::uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// A rank's views and their memory.
struct rank_views {
  std::vector<std::vector<std::byte>> mem;
  std::vector<flat_view> views;
  void add(std::size_t t, std::optional<shard_spec> spec, dtype type, bool fill) {
    flat_view v{model[t].key, type, model[t].shape, std::move(spec), nullptr, 0};
    v.nbytes = v.local_numel() * item_size(type);
    mem.emplace_back(static_cast<std::size_t>(v.nbytes), std::byte{0x5a});
    v.data = mem.back().data();
    if (fill)
      for (std::uint64_t j = 0; j < v.local_numel(); ++j)
        put(type, v.data + j * item_size(type), value(t, global_of(v.spec, v.full_shape, j)));
    views.push_back(v);
  }
};

}  // namespace

namespace {

/// Saves the model as FSDP's flat pieces from a world of 4 into dir.
void save_model(const file_directory& dir) {
  const auto thrown = testing::run_ranks(4, [&](testing::thread_comm& c) {
    rank_views rv;
    for (std::size_t t = 0; t < model.size(); ++t) {
      const std::uint64_t n = numel(model[t].shape), per = (n + 3) / 4, r = std::uint64_t(c.rank());
      if (model[t].shape.empty())
        rv.add(t, std::nullopt, model[t].type, true);
      else
        rv.add(t, flat_spec{{std::min(n, r * per), std::min(n, (r + 1) * per)}}, model[t].type, true);
    }
    save(dir, std::span<const flat_view>(rv.views), c);
  });
  for (const auto& e : thrown) REQUIRE(testing::error_message_of(e) == "");
}

/// How often each byte of each file was read (reads at offset 0, the header's, not counted).
struct read_counts {
  std::mutex m;
  std::map<std::string, std::vector<std::uint32_t>> per_byte;
};

struct counting_storage {
  file_storage inner;
  std::string file;
  std::shared_ptr<read_counts> counts;
  std::uint64_t size() const { return inner.size(); }
  std::string_view name() const { return inner.name(); }
  void read_into(std::uint64_t off, std::span<std::byte> dst) const {
    inner.read_into(off, dst);
    if (off == 0) return;
    std::lock_guard lock(counts->m);
    auto& v = counts->per_byte[file];
    v.resize(static_cast<std::size_t>(inner.size()));
    for (std::size_t i = 0; i < dst.size(); ++i) ++v[static_cast<std::size_t>(off) + i];
  }
};

struct counting_folder {
  using reader_type = counting_storage;
  file_directory d;
  std::shared_ptr<read_counts> counts = std::make_shared<read_counts>();
  std::string_view name() const noexcept { return d.name(); }
  reader_type open(std::string_view n) const { return {d.open(n), std::string(n), counts}; }
  bool exists(std::string_view n) const { return d.exists(n); }
  std::vector<std::string> list() const { return d.list(); }
  counting_folder sub(std::string_view n) const { return {d.sub(n), counts}; }
};

/// Checks that every byte of every rank file's data (past its header: the first 8 bytes say how
/// long) was read `times` times.
void check_data_read(const std::filesystem::path& folder, const read_counts& counts, std::uint32_t times) {
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(folder)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("rank_", 0) != 0 || e.path().extension() != ".safetensors") continue;
    ++files;
    const std::string bytes = testing::slurp(e.path());
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
    const auto it = counts.per_byte.find(name);
    REQUIRE(it != counts.per_byte.end());
    std::uint64_t wrong = 0, first = 0;
    for (std::uint64_t b = 8 + n; b < bytes.size(); ++b)
      if (it->second[static_cast<std::size_t>(b)] != times && wrong++ == 0) first = b;
    INFO(name << ": first byte read another number of times: " << first << " ("
              << (wrong ? it->second[static_cast<std::size_t>(first)] : 0) << " times)");
    CHECK(wrong == 0);
  }
  CHECK(files == 4);
}

/// Checks every element of every view against the formula.
void check_values(const rank_views& rv) {
  for (const flat_view& v : rv.views) {
    const auto t = static_cast<std::size_t>(
        std::find_if(model.begin(), model.end(), [&](const tensor_def& d) { return d.key == v.key; }) - model.begin());
    if (t == model.size()) continue;
    std::uint64_t wrong = 0;
    for (std::uint64_t j = 0; j < v.local_numel(); ++j)
      wrong += get(v.type, v.data + j * item_size(v.type)) != value(t, global_of(v.spec, v.full_shape, j));
    INFO("tensor " << v.key);
    CHECK(wrong == 0);
  }
}

/// Rows [a, b) of a 2-D or [1, rows, cols] tensor as a block.
block_spec rows(const shape_t& full, std::uint64_t a, std::uint64_t b) {
  shape_t ls = full, off(full.size(), 0);
  const std::size_t d = full.size() == 3 ? 1 : 0;
  ls[d] = b - a;
  off[d] = a;
  return block_spec(ls, off);
}

/// HSDP's views: shard s of 2 (rows, a flat half, the scalar on shard 0 only); w1 into F32.
rank_views hsdp_views(int s) {
  rank_views rv;
  const std::uint64_t u = std::uint64_t(s);
  rv.add(0, rows(model[0].shape, u ? 19 : 0, u ? 37 : 19), dtype::F32, false);
  rv.add(1, rows(model[1].shape, u * 32, u * 32 + 32), dtype::F32, false);
  rv.add(2, flat_spec{{u * 12, u * 12 + 12}}, dtype::F32, false);
  rv.add(3, rows(model[3].shape, u * 15, u * 15 + 15), dtype::F32, false);
  if (s == 0) rv.add(4, std::nullopt, dtype::F32, false);
  return rv;
}

/// Data parallelism: every tensor whole, as stored.
rank_views whole_views() {
  rank_views rv;
  for (std::size_t t = 0; t < model.size(); ++t) rv.add(t, std::nullopt, model[t].type, false);
  return rv;
}

/// FSDP x TP over 4 ranks (dp = rank / 2, tp = rank % 2): the matrices in four row blocks, one
/// a rank; the norm in two flat halves by dp, each half loaded by both ranks of a TP pair; the
/// scalar whole on every rank. No two ranks load the same set of views.
rank_views fsdp_tp_views(int r) {
  rank_views rv;
  const std::uint64_t u = std::uint64_t(r), dp = u / 2;
  for (const std::size_t t : {std::size_t(0), std::size_t(1), std::size_t(3)}) {
    const std::uint64_t n = model[t].shape[model[t].shape.size() == 3 ? 1 : 0], per = (n + 3) / 4;
    rv.add(t, rows(model[t].shape, std::min(n, u * per), std::min(n, (u + 1) * per)), dtype::F32, false);
  }
  rv.add(2, flat_spec{{dp * 12, dp * 12 + 12}}, dtype::F32, false);
  rv.add(4, std::nullopt, dtype::F32, false);
  return rv;
}

struct load_run {
  std::vector<load_stats> stats;
  std::vector<std::uint64_t> comm_in;
  std::shared_ptr<read_counts> counts;
};

/// Loads in a world of n thread ranks: views_of(rank), over point to point (peer) or without.
template <class ViewsOf>
load_run load_world(const file_directory& dir, int n, bool peer, const collective_load_options& opt,
                    ViewsOf&& views_of) {
  const counting_folder folder{dir};
  load_run out;
  out.stats.resize(static_cast<std::size_t>(n));
  out.comm_in.resize(static_cast<std::size_t>(n));
  out.counts = folder.counts;
  const auto thrown = testing::run_ranks(n, [&](testing::thread_comm& tc) {
    rank_views rv = views_of(tc.rank());
    auto go = [&](auto& comm) {
      const auto r = static_cast<std::size_t>(tc.rank());
      out.stats[r] = load(folder, std::span<const flat_view>(rv.views), comm, opt);
      out.comm_in[r] = comm.bytes_in;
    };
    if (peer) {
      testing::counting_comm<true> c{tc};
      go(c);
    } else {
      testing::counting_comm<false> c{tc};
      go(c);
    }
    check_values(rv);
  });
  for (const auto& e : thrown) REQUIRE(testing::error_message_of(e) == "");
  return out;
}

std::uint64_t bytes_of(const rank_views& rv) {
  std::uint64_t n = 0;
  for (const auto& v : rv.views) n += v.nbytes;
  return n;
}

collective_load_options exact_reads(replica_reads mode) {
  collective_load_options o;
  o.replicas = mode;
  o.convert_dtypes = true;
  o.reads.max_gap_bytes = 0;      // no read merged across a gap: each byte read is a byte needed
  o.exchange_chunk_bytes = 1000;  // several chunks a piece
  return o;
}

}  // namespace

TEST_CASE(
    "replica reads: HSDP's 4 replicas of 2 shards read each byte once, bit-exact, over point to point or broadcasts") {
  testing::temp_dir tmp("replicas");
  const file_directory dir(tmp.str());
  save_model(dir);
  auto shard_of = [](int r) { return hsdp_views(r % 2); };
  SUBCASE("every rank reads: each byte 4 times") {
    const load_run run = load_world(dir, 8, true, exact_reads(replica_reads::every_rank_reads), shard_of);
    check_data_read(tmp.path, *run.counts, 4);
    for (const auto& st : run.stats) {
      CHECK(st.replicas == replica_reads::every_rank_reads);
      CHECK(st.bytes_received == 0);
    }
  }
  for (const bool peer : {true, false}) {
    CAPTURE(peer);
    const load_run run = load_world(dir, 8, peer, exact_reads(replica_reads::read_once), shard_of);
    check_data_read(tmp.path, *run.counts, 1);
    for (int r = 0; r < 8; ++r) {
      const load_stats& st = run.stats[static_cast<std::size_t>(r)];
      CAPTURE(r);
      CHECK(st.replicas == replica_reads::read_once);
      CHECK(st.replica_group == 4);
      CHECK(st.tensors == (r % 2 == 0 ? 5u : 4u));
      // the group's members read a quarter each, and receive the rest
      const std::uint64_t share = bytes_of(hsdp_views(r % 2));
      CHECK(st.bytes_received > share / 2);
      CHECK(st.bytes_received < share);
      if (peer)  // the pieces, the 48-byte descriptions, the outcomes: nothing of the other group
        CHECK(run.comm_in[static_cast<std::size_t>(r)] < st.bytes_received + 2048);
      else  // each broadcast reaches every rank: the other group's pieces too
        CHECK(run.comm_in[static_cast<std::size_t>(r)] > st.bytes_received + bytes_of(hsdp_views(1 - r % 2)) / 2);
    }
    std::uint64_t got[2] = {0, 0};
    for (int r = 0; r < 8; ++r) got[r % 2] += run.stats[static_cast<std::size_t>(r)].bytes_received;
    // each member receives the 3 pieces it did not read: the group's share 3 times over
    for (int s = 0; s < 2; ++s) CHECK(got[s] == 3 * bytes_of(hsdp_views(s)));
  }
}

TEST_CASE("replica reads: 6 data-parallel ranks load the whole model, each byte read once") {
  testing::temp_dir tmp("replicas-dp");
  const file_directory dir(tmp.str());
  save_model(dir);
  auto whole = [](int) { return whole_views(); };
  const load_run every = load_world(dir, 6, true, exact_reads(replica_reads::every_rank_reads), whole);
  check_data_read(tmp.path, *every.counts, 6);
  for (const bool peer : {true, false}) {
    CAPTURE(peer);
    const load_run once = load_world(dir, 6, peer, exact_reads(replica_reads::read_once), whole);
    check_data_read(tmp.path, *once.counts, 1);
    std::uint64_t read = 0, got = 0;
    for (const auto& st : once.stats) {
      CHECK(st.replica_group == 6);
      read += st.bytes_read;
      got += st.bytes_received;
    }
    const std::uint64_t model_bytes = bytes_of(whole_views());
    CHECK(read == model_bytes);  // stored as loaded: the bytes read are the views' bytes
    CHECK(got == 5 * model_bytes);
    if (!peer)  // one group: the broadcasts carry nothing a rank does not keep, but its tallies
      for (std::size_t r = 0; r < 6; ++r) CHECK(once.comm_in[r] < once.stats[r].bytes_received + 2048);
  }
}

TEST_CASE("replica reads: tensors shared apart from a rank's other views are read once: TP's norms, a whole scalar") {
  testing::temp_dir tmp("replicas-tp");
  const file_directory dir(tmp.str());
  save_model(dir);
  const load_run every = load_world(dir, 4, true, exact_reads(replica_reads::every_rank_reads), fsdp_tp_views);
  std::uint64_t every_read = 0;
  for (const auto& st : every.stats) every_read += st.bytes_read;
  for (const bool peer : {true, false}) {
    CAPTURE(peer);
    const load_run once = load_world(dir, 4, peer, exact_reads(replica_reads::read_once), fsdp_tp_views);
    check_data_read(tmp.path, *once.counts, 1);
    std::uint64_t read = 0, got = 0;
    for (std::size_t r = 0; r < 4; ++r) {
      CAPTURE(r);
      const load_stats& st = once.stats[r];
      CHECK(st.replicas == replica_reads::read_once);
      CHECK(st.replica_group == 4);  // the scalar's group; the norm's is 2
      CHECK(st.tensors == 5);
      read += st.bytes_read;
      got += st.bytes_received;
      if (peer) CHECK(once.comm_in[r] < st.bytes_received + 2048);
    }
    // a norm half (12 F32) once more for its pair, the scalar 3 more times than read
    CHECK(got == 2 * 12 * 4 + 3 * 4);
    CHECK(read == every_read - got);
  }
}

TEST_CASE("replica reads: a key the checkpoint lacks is listed or refused by its rank alone, as in any load") {
  testing::temp_dir tmp("replicas-missing");
  const file_directory dir(tmp.str());
  save_model(dir);
  auto with_extra = [](int r) {  // rank 2 also asks for a tensor the checkpoint lacks, and none asks for "scalar"
    rank_views rv = whole_views();
    rv.views.pop_back();
    if (r == 2) rv.add(0, std::nullopt, dtype::F32, false), rv.views.back().key = "nope";
    return rv;
  };
  collective_load_options lax = exact_reads(replica_reads::read_once);
  lax.strict = false;
  const load_run every = load_world(
      dir, 4, true,
      [&] {
        collective_load_options o = lax;
        o.replicas = replica_reads::every_rank_reads;
        return o;
      }(),
      with_extra);
  const load_run once = load_world(dir, 4, true, lax, with_extra);
  for (std::size_t r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(once.stats[r].replica_group == 4);  // the missing view is not part of what the group shares
    CHECK(once.stats[r].missing_keys == every.stats[r].missing_keys);
    CHECK(once.stats[r].missing_keys == (r == 2 ? std::vector<std::string>{"nope"} : std::vector<std::string>{}));
    CHECK(once.stats[r].unexpected_keys == every.stats[r].unexpected_keys);
    CHECK(once.stats[r].unexpected_keys == std::vector<std::string>{"scalar"});
    CHECK(once.stats[r].tensors == every.stats[r].tensors);
  }
  // strict: every rank throws rank 2's refusal
  std::vector<std::string> errors(4);
  const counting_folder folder{dir};
  const auto thrown = testing::run_ranks(4, [&](testing::thread_comm& tc) {
    rank_views rv = with_extra(tc.rank());
    load(folder, std::span<const flat_view>(rv.views), tc, exact_reads(replica_reads::read_once));
  });
  for (const auto& e : thrown) {
    CHECK(testing::error_message_of(e) == testing::error_message_of(thrown[0]));
    CHECK(testing::error_message_of(e).find("rank 2:") != std::string::npos);
    CHECK(testing::error_message_of(e).find("'nope'") != std::string::npos);
  }
}

TEST_CASE("replica reads: ranks with views of their own share nothing and exchange only their descriptions") {
  testing::temp_dir tmp("replicas-fsdp");
  const file_directory dir(tmp.str());
  save_model(dir);
  auto fsdp = [](int r) {  // flat pieces of 3 ranks: every rank's views its own
    rank_views rv;
    for (std::size_t t = 0; t + 1 < model.size(); ++t) {
      const std::uint64_t n = numel(model[t].shape), per = (n + 2) / 3, u = std::uint64_t(r);
      rv.add(t, flat_spec{{std::min(n, u * per), std::min(n, (u + 1) * per)}}, model[t].type, false);
    }
    return rv;
  };
  for (const bool peer : {true, false}) {
    const load_run run = load_world(dir, 3, peer, exact_reads(replica_reads::read_once), fsdp);
    for (std::size_t r = 0; r < 3; ++r) {
      CHECK(run.stats[r].replica_group == 1);
      CHECK(run.stats[r].bytes_received == 0);
      CHECK(run.comm_in[r] < 1024);
    }
  }
  // automatic decides without measuring: nobody to share with, or one host
  collective_load_options a = exact_reads(replica_reads::automatic);
  const load_run alone = load_world(dir, 3, true, a, fsdp);
  for (const auto& st : alone.stats) {
    CHECK(st.replicas == replica_reads::every_rank_reads);
    CHECK(st.why == "no two ranks load the same views");
  }
  const load_run dp = load_world(dir, 3, true, a, [](int) { return whole_views(); });
  check_data_read(tmp.path, *dp.counts, 3);
  for (const auto& st : dp.stats) {
    CHECK(st.replicas == replica_reads::every_rank_reads);
    CHECK(st.why == "every rank runs on one host");
  }
}

TEST_CASE("replica reads: a rank that never comes to the load is named by the others within the world's timeout") {
  testing::temp_dir tmp("replicas-late");
  const file_directory dir(tmp.str());
  save_model(dir);
  const auto thrown = testing::run_ranks(
      4,
      [&](testing::thread_comm& tc) {
        if (tc.rank() == 3) return;
        rank_views rv = whole_views();
        load(dir, std::span<const flat_view>(rv.views), tc, exact_reads(replica_reads::read_once));
      },
      std::chrono::seconds(2));
  for (int r = 0; r < 3; ++r) {
    const std::string m = testing::error_message_of(thrown[static_cast<std::size_t>(r)]);
    CAPTURE(m);
    CHECK(testing::error_code_of(thrown[static_cast<std::size_t>(r)]) == make_error_code(errc::comm_error));
    CHECK(m.find("rank(s) 3") != std::string::npos);
  }
  CHECK(!thrown[3]);
}

TEST_CASE("replica reads: automatic measures when the ranks run on several hosts, and every rank picks alike") {
  testing::temp_dir tmp("replicas-auto");
  const file_directory dir(tmp.str());
  save_model(dir);
  // each rank thread says it runs on a host of its own (detail::simulated_host)
  for (const bool peer : {true, false}) {
    CAPTURE(peer);
    collective_load_options o = exact_reads(replica_reads::automatic);
    o.probe_bytes = 3000;
    const load_run dp = load_world(dir, 4, peer, o, [](int r) {
      detail::simulated_host = "host" + std::to_string(r);
      return whole_views();
    });
    const load_run hsdp = load_world(dir, 4, peer, o, [](int r) {
      detail::simulated_host = "host" + std::to_string(r);
      return hsdp_views(r % 2);
    });
    const load_run tp = load_world(dir, 4, peer, o, [](int r) {
      detail::simulated_host = "host" + std::to_string(r);
      return fsdp_tp_views(r);
    });
    // the probe is part of the load: picked read_once, every data byte is still read once
    if (dp.stats[0].replicas == replica_reads::read_once) check_data_read(tmp.path, *dp.counts, 1);
    if (hsdp.stats[0].replicas == replica_reads::read_once) check_data_read(tmp.path, *hsdp.counts, 1);
    if (tp.stats[0].replicas == replica_reads::read_once) check_data_read(tmp.path, *tp.counts, 1);
    for (const load_run* run : {&dp, &hsdp, &tp})
      for (const auto& st : run->stats) {
        CHECK(st.replicas == run->stats[0].replicas);
        CHECK(st.why == run->stats[0].why);
        CHECK(st.why.rfind("estimated every_rank_reads ", 0) == 0);
        CHECK(st.replica_group == (st.replicas == replica_reads::read_once ? (run == &hsdp ? 2u : 4u) : 1u));
      }
  }
}

TEST_CASE("replica reads: views of no bytes are checked by every member; options must agree") {
  testing::temp_dir tmp("replicas-empty");
  const file_directory dir(tmp.str());
  save_model(dir);
  auto with_empty = [](dtype t) {
    return [t](int) {
      rank_views rv = whole_views();
      rv.add(2, flat_spec{{0, 0}}, t, false);  // no element of "norm", as t
      return rv;
    };
  };
  // F32: loads (nothing to read); I32: refused as the plain load refuses it
  const load_run ok = load_world(dir, 3, true, exact_reads(replica_reads::read_once), with_empty(dtype::F32));
  for (const auto& st : ok.stats) CHECK(st.tensors == 6);
  for (const replica_reads mode : {replica_reads::every_rank_reads, replica_reads::read_once}) {
    CAPTURE(to_string(mode));
    const auto thrown = testing::run_ranks(3, [&](testing::thread_comm& tc) {
      rank_views rv = with_empty(dtype::I32)(tc.rank());
      load(dir, std::span<const flat_view>(rv.views), tc, exact_reads(mode));
    });
    for (const auto& e : thrown) {
      CHECK(testing::error_code_of(e) == make_error_code(errc::dtype_mismatch));
      CHECK(testing::error_message_of(e).find("'norm'") != std::string::npos);
    }
  }
  // a rank with another chunk size: refused alike on every rank, naming it
  const auto thrown = testing::run_ranks(3, [&](testing::thread_comm& tc) {
    rank_views rv = whole_views();
    collective_load_options o = exact_reads(replica_reads::read_once);
    if (tc.rank() == 1) o.exchange_chunk_bytes = 3000;
    load(dir, std::span<const flat_view>(rv.views), tc, o);
  });
  for (const auto& e : thrown) {
    CHECK(testing::error_message_of(e) == testing::error_message_of(thrown[0]));
    CHECK(testing::error_code_of(e) == make_error_code(errc::invalid_argument));
    CHECK(testing::error_message_of(e).find("rank 1's collective_load_options differ from rank 0's") !=
          std::string::npos);
  }
}

TEST_CASE("replica reads: quantized weights dequantized by pieces, bit-exact; their scales not unexpected") {
  const std::filesystem::path golden =
      std::filesystem::path(SHARDSAFE_SOURCE_DIR) / "tests" / "fixtures" / "quant" / "fp8_block";
  const auto want = testing::read_golden_tensors(golden / "expected" / "f32.safetensors");
  REQUIRE(want.size() == 3);
  std::vector<std::string> listed;  // every_rank_reads' unexpected keys (the plain load's)
  for (const replica_reads mode : {replica_reads::every_rank_reads, replica_reads::read_once}) {
    CAPTURE(to_string(mode));
    std::vector<load_stats> stats(3);
    const auto thrown = testing::run_ranks(3, [&](testing::thread_comm& tc) {
      std::vector<std::string> mem;
      std::vector<flat_view> views;
      mem.reserve(want.size());
      for (const auto& [key, w] : want) {
        mem.emplace_back(w.bytes.size(), '\x5a');
        views.push_back(
            {key, w.type, w.shape, std::nullopt, reinterpret_cast<std::byte*>(mem.back().data()), mem.back().size()});
      }
      collective_load_options o;
      o.replicas = mode;
      o.convert_dtypes = true;
      stats[static_cast<std::size_t>(tc.rank())] =
          load(file_directory(golden), std::span<const flat_view>(views), tc, o);
      std::size_t i = 0;
      for (const auto& [key, w] : want)
        if (mem[i++] != w.bytes) throw std::runtime_error("tensor " + key + " differs");
    });
    for (const auto& e : thrown) CHECK(testing::error_message_of(e) == "");
    for (const auto& st : stats) {
      CHECK(st.replica_group == (mode == replica_reads::read_once ? 3u : 1u));
      CHECK(st.tensors == 3);
      if (mode == replica_reads::every_rank_reads) listed = st.unexpected_keys;
      CHECK(st.unexpected_keys == listed);
      for (const auto& k : st.unexpected_keys) CHECK(k.find("scale") == std::string::npos);
    }
  }
}
