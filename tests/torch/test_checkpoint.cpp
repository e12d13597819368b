// Sharded save and load in real multi-process c10d worlds, resharding between world sizes
// and spec forms, OLMo-core directories written by hand, and the errors a user meets.
#include "shardsafe/torch/state_dict.hpp"

#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>

#include "fixtures.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "shardsafe/torch/model_and_optim.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/memory.hpp"
#include "shardsafe/storage/mmap.hpp"
#include "world.hpp"

using namespace shardsafe;
using testing::block_part;
using testing::expected_full;
using testing::flat_part;
using testing::local_of;

namespace {

using spec_fn = std::function<std::optional<shard_spec>(int world, int rank)>;

struct tcase {
  std::string key;
  dtype type;
  shape_t shape;
  spec_fn save;  // how a rank of the saving world (2 ranks) holds it
  spec_fn load;  // how a rank of a loading world holds it
};

std::optional<shard_spec> whole(int, int) { return std::nullopt; }

// The catalogue: flat FSDP-like splits (uneven, several ranges, empty ranks), 2-D row and
// column blocks, a 3-D block, a replicated DTensor, replicated plain tensors, a 0-d tensor
// and an empty one, in BF16, F16, F32, F64, I32, I64 and BOOL; each loaded in another form.
std::vector<tcase> catalogue() {
  return {
      {"flat_uneven",
       dtype::F32,
       {37, 5},
       [](int, int r) -> std::optional<shard_spec> { return r == 0 ? flat_spec{{0, 100}} : flat_spec{{100, 185}}; },
       [](int w, int r) -> std::optional<shard_spec> { return block_part({37, 5}, 0, w, r); }},
      {"flat_multi",
       dtype::I64,
       {50},
       [](int, int r) -> std::optional<shard_spec> {
         return r == 0 ? flat_spec{{0, 10}, {20, 30}} : flat_spec{{10, 20}, {30, 30}, {30, 50}};
       },
       [](int w, int r) -> std::optional<shard_spec> { return flat_part({50}, w, r); }},
      {"row_tp",
       dtype::BF16,
       {16, 8},
       [](int w, int r) -> std::optional<shard_spec> { return block_part({16, 8}, 0, w, r); },
       [](int w, int r) -> std::optional<shard_spec> { return flat_part({16, 8}, w, r); }},
      {"col_tp",
       dtype::F32,
       {6, 10},
       [](int w, int r) -> std::optional<shard_spec> { return block_part({6, 10}, 1, w, r); },
       [](int w, int r) -> std::optional<shard_spec> { return block_part({6, 10}, 0, w, r); }},
      {"cube",
       dtype::I64,
       {4, 6, 5},
       [](int, int r) -> std::optional<shard_spec> {
         return r == 0 ? block_spec({4, 6, 2}, {0, 0, 0}) : block_spec({4, 6, 3}, {0, 0, 2});
       },
       [](int w, int r) -> std::optional<shard_spec> { return flat_part({4, 6, 5}, w, r); }},
      {"cube_to_block",
       dtype::I32,
       {3, 4, 6},
       [](int w, int r) -> std::optional<shard_spec> { return flat_part({3, 4, 6}, w, r); },
       [](int w, int r) -> std::optional<shard_spec> { return block_part({3, 4, 6}, 2, w, r); }},
      {"mask",
       dtype::BOOL,
       {33},
       [](int w, int r) -> std::optional<shard_spec> { return flat_part({33}, w, r); },
       [](int w, int r) -> std::optional<shard_spec> { return block_part({33}, 0, w, r); }},
      {"half_one_empty",
       dtype::F16,
       {9, 3},
       [](int, int r) -> std::optional<shard_spec> { return r == 0 ? flat_spec{{0, 27}} : flat_spec{{27, 27}}; },
       [](int w, int r) -> std::optional<shard_spec> { return block_part({9, 3}, 1, w, r); }},
      {"replicated_dtensor",
       dtype::I32,
       {8, 4},
       [](int, int) -> std::optional<shard_spec> { return block_spec({8, 4}, {0, 0}); },
       [](int w, int r) -> std::optional<shard_spec> { return flat_part({8, 4}, w, r); }},
      {"bias", dtype::F64, {7}, whole, whole},
      {"scalar", dtype::F32, {}, whole, whole},
      {"scalar_from_whole_to_block",
       dtype::I64,
       {},
       whole,
       [](int, int) -> std::optional<shard_spec> { return block_spec({}, {}); }},
      {"empty",
       dtype::F32,
       {0, 4},
       [](int w, int r) -> std::optional<shard_spec> { return flat_part({0, 4}, w, r); },
       [](int, int) -> std::optional<shard_spec> { return block_spec({0, 4}, {0, 0}); }},
      {"sharded_to_whole",
       dtype::F32,
       {5, 5},
       [](int w, int r) -> std::optional<shard_spec> { return block_part({5, 5}, 1, w, r); },
       whole},
  };
}

state_dict build_state(int world, int rank, bool for_save, bool save_whole = false) {
  state_dict sd;
  for (const auto& c : catalogue()) {
    auto spec = for_save ? (save_whole ? std::nullopt : c.save(world, rank)) : c.load(world, rank);
    at::Tensor full = expected_full(c.key, c.type, c.shape);
    if (for_save) {
      sd.add(c.key, local_of(full, spec), spec.value_or(flat_spec{}), c.shape);
      if (!spec) sd.find(c.key)->spec.reset();
    } else {
      // memory to load into: filled with a pattern that is not the expected data
      at::Tensor local = local_of(full, spec);
      local = at::empty_like(local);
      if (local.nbytes()) std::memset(local.data_ptr(), 0xA5, local.nbytes());
      if (spec)
        sd.add(c.key, local, *spec, c.shape);
      else
        sd.add(c.key, local);
    }
  }
  return sd;
}

/// Compares every loaded tensor with its expected shard; prints what differs.
int check_state(const state_dict& sd, int world, int rank) {
  int bad = 0;
  for (const auto& c : catalogue()) {
    const sharded_tensor* t = sd.find(c.key);
    at::Tensor want = local_of(expected_full(c.key, c.type, c.shape), c.load(world, rank));
    if (!testing::same_bits(t->local.reshape({-1}), want.reshape({-1}))) {
      std::fprintf(stderr, "rank %d of %d: tensor '%s' differs from the expected shard\n", rank, world, c.key.c_str());
      ++bad;
    }
  }
  return bad == 0 ? 0 : 1;
}

}  // namespace

WORKER_SCENARIO("save_catalogue") {
  auto w = init_world_from_env();
  auto comm = w.comm();
  state_dict sd = build_state(w.world_size, w.rank, true);
  save_state_dict(file_directory(args.at(0)), sd, comm);
  return 0;
}

WORKER_SCENARIO("load_catalogue") {
  auto w = init_world_from_env();
  state_dict sd = build_state(w.world_size, w.rank, false);
  load_options opt;
  opt.threads = 2;
  opt.reads.max_read_bytes = 64;  // many small reads: exercises splitting and staging
  if (args.size() > 1 && args[1] == "mmap") {
    load_state_dict(mmap_directory(args.at(0)), sd, opt);
  } else {
    load_state_dict(file_directory(args.at(0)), sd, opt);
  }
  return check_state(sd, w.world_size, w.rank);
}

TEST_CASE("save with 2 ranks, load with 1, 3 and 4 ranks in other shardings, bit for bit") {
  testing::temp_dir dir("catalogue");
  const std::string ckpt = (dir.path / "model").string();
  auto saved = testing::run_world("save_catalogue", 2, {ckpt});
  REQUIRE_MESSAGE(saved.ok(), saved.report());

  SUBCASE("metadata.json follows docs/FORMAT.md §2") {
    file_storage f(dir.path / "model" / "metadata.json");
    auto md = read_checkpoint_metadata(f);
    CHECK(md.tensors.size() == catalogue().size());
    const auto* bias = md.find("bias");
    REQUIRE(bias);
    CHECK_FALSE(bias->is_sharded);
    REQUIRE(bias->files.size() == 1);  // replicated tensors are written once, by the lowest rank
    CHECK(bias->files[0].first == "rank_0.safetensors");
    CHECK(bias->files[0].second == shard_spec(flat_spec{{0, 7}}));
    const auto* row = md.find("row_tp");
    REQUIRE(row->files.size() == 2);
    CHECK(row->files[1].second == shard_spec(block_spec({8, 8}, {8, 0})));
    const auto* rep = md.find("replicated_dtensor");
    CHECK(rep->is_sharded);
    CHECK(rep->files.size() == 2);
    CHECK(md.extras.world_size == 2u);
    // rank 1's file holds no replicated plain tensor
    file_storage r1(dir.path / "model" / "rank_1.safetensors");
    auto h1 = read_safetensors_header(r1);
    CHECK(h1.find("bias") == nullptr);
    CHECK(h1.find("scalar") == nullptr);
    REQUIRE(h1.find("row_tp"));
    CHECK(h1.find("row_tp")->shape == shape_t{64});  // flattened local block
  }
  SUBCASE("other world sizes and spec forms") {
    for (int w : {1, 3, 4}) {
      CAPTURE(w);
      auto loaded = testing::run_world("load_catalogue", w, {ckpt});
      CHECK_MESSAGE(loaded.ok(), loaded.report());
    }
    auto mm = testing::run_world("load_catalogue", 3, {ckpt, "mmap"});
    CHECK_MESSAGE(mm.ok(), mm.report());
  }
  SUBCASE("the tool: verify, digest and unshard agree with the expected full tensors") {
    if (testing::tool_subcase_skipped()) return;
    auto v = testing::run_tool({"verify", ckpt});
    CHECK_MESSAGE(v.code == 0, v.err);
    // digest: NAME DTYPE [shape] SHA256 of the full tensor, sorted by name
    std::vector<std::string> lines;
    for (const auto& c : catalogue()) {
      std::string shape = "[";
      for (std::size_t i = 0; i < c.shape.size(); ++i) shape += (i ? "," : "") + std::to_string(c.shape[i]);
      lines.push_back(c.key + " " + std::string(to_string(c.type)) + " " + shape + "] " +
                      testing::sha256_hex(expected_full(c.key, c.type, c.shape)));
    }
    std::sort(lines.begin(), lines.end());
    std::string want;
    for (const auto& l : lines) want += l + "\n";
    auto d = testing::run_tool({"digest", ckpt});
    CHECK_MESSAGE(d.code == 0, d.err);
    CHECK(d.out == want);
    // unshard: one file with every full tensor
    const std::string out = (dir.path / "full.safetensors").string();
    auto u = testing::run_tool({"unshard", ckpt, out});
    REQUIRE_MESSAGE(u.code == 0, u.err);
    file_storage f(out);
    auto h = read_safetensors_header(f);
    CHECK(h.tensors.size() == catalogue().size());
    for (const auto& c : catalogue()) {
      const tensor_entry& e = h.at(c.key);
      CHECK(e.shape == c.shape);
      CHECK(e.type == c.type);
      at::Tensor got = at::empty(to_sizes(c.shape), *to_scalar_type(c.type));
      read_tensor(f, h, e, {static_cast<std::byte*>(got.data_ptr()), got.nbytes()});
      CHECK_MESSAGE(testing::same_bits(got, expected_full(c.key, c.type, c.shape)), c.key);
    }
    // a damaged rank file: verify fails with one line naming it
    std::filesystem::resize_file(dir.path / "model" / "rank_1.safetensors", 64);
    auto bad = testing::run_tool({"verify", ckpt});
    CHECK(bad.code == 1);
    CHECK(bad.err.find("rank_1.safetensors") != std::string::npos);
    CHECK(std::count(bad.err.begin(), bad.err.end(), '\n') == 1);
  }
  SUBCASE("unshard in one process gives the expected full tensors") {
    auto full = unshard_state(file_directory(ckpt));
    CHECK(full.size() == catalogue().size());
    for (const auto& c : catalogue()) {
      auto it = std::find_if(full.begin(), full.end(), [&](const auto& p) { return p.first == c.key; });
      REQUIRE(it != full.end());
      CHECK_MESSAGE(testing::same_bits(it->second, expected_full(c.key, c.type, c.shape)), c.key);
      CHECK(shape_of(it->second) == c.shape);
    }
  }
}

// ---------------------------------------------------------------------------------------
// in one process, with no communication at all

TEST_CASE("single process save and load through every backend") {
  single_process comm;
  for (int variant = 0; variant < 3; ++variant) {
    CAPTURE(variant);
    state_dict sd = build_state(1, 0, true, /*save_whole=*/true);
    testing::temp_dir dir("single");
    state_dict into = build_state(1, 0, false);
    if (variant == 2) {
      memory_directory mem;
      save_state_dict(mem.sub("ckpt"), sd, comm);
      load_state_dict(mem.sub("ckpt"), into);
    } else {
      save_state_dict(file_directory(dir.path), sd, comm);
      if (variant == 0)
        load_state_dict(file_directory(dir.path), into);
      else
        load_state_dict(mmap_directory(dir.path), into);
    }
    CHECK(check_state(into, 1, 0) == 0);
  }
}

TEST_CASE("non-contiguous tensors are saved and loaded through staging") {
  single_process comm;
  testing::temp_dir dir("noncontig");
  at::Tensor full = expected_full("t", dtype::F32, {6, 4});
  state_dict sd;
  sd.add("t", full.t());  // a transposed view: [4, 6], not contiguous
  save_state_dict(file_directory(dir.path), sd, comm);
  at::Tensor target = at::zeros({6, 4}, at::kFloat).t();
  state_dict into;
  into.add("t", target);
  load_state_dict(file_directory(dir.path), into);
  CHECK(testing::same_bits(target.contiguous(), full.t().contiguous()));
}

TEST_CASE("validate_nan finds elements that were never loaded") {
  single_process comm;
  testing::temp_dir dir("nan");
  at::Tensor full = expected_full("w", dtype::F32, {4, 4}, /*finite=*/true);
  state_dict sd;
  sd.add("w", full);
  save_state_dict(file_directory(dir.path), sd, comm);
  at::Tensor into = at::zeros({4, 4});
  state_dict t;
  t.add("w", into);
  load_options o;
  o.validate_nan = true;
  CHECK_NOTHROW(load_state_dict(file_directory(dir.path), t, o));
  CHECK(testing::same_bits(into, full));
}

// ---------------------------------------------------------------------------------------
// OLMo-core directories, written byte by byte from the schema

namespace {
/// A safetensors file by hand: header JSON as Python's safetensors writes it, padded.
std::string hand_safetensors(const std::vector<std::tuple<std::string, std::string, std::uint64_t, std::string>>& ts) {
  std::string json = "{", data;
  for (std::size_t i = 0; i < ts.size(); ++i) {
    const auto& [name, dt, n, bytes] = ts[i];
    json += (i ? "," : "") + std::string("\"") + name + "\":{\"dtype\":\"" + dt + "\",\"shape\":[" + std::to_string(n) +
            "],\"data_offsets\":[" + std::to_string(data.size()) + "," + std::to_string(data.size() + bytes.size()) +
            "]}";
    data += bytes;
  }
  json += "}";
  while ((8 + json.size()) % 8) json += ' ';
  std::string out(8, '\0');
  std::uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json + data;
}
std::string bytes_of(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}
}  // namespace

WORKER_SCENARIO("load_olmo") {
  auto w = init_world_from_env();
  const std::filesystem::path dir = args.at(0);
  at::Tensor x = expected_full("x", dtype::I64, {2, 3}), y = expected_full("y", dtype::F32, {2, 3});
  at::Tensor wt = expected_full("w", dtype::BF16, {16, 8}), leg = expected_full("legacy", dtype::F32, {10});
  state_dict sd;
  auto yspec = flat_part({2, 3}, w.world_size, w.rank);
  auto wspec = block_part({16, 8}, 1, w.world_size, w.rank);  // columns, where the files hold rows
  auto lspec = block_part({10}, 0, w.world_size, w.rank);
  at::Tensor xl = at::zeros({2, 3}, at::kLong), yl = at::zeros_like(local_of(y, yspec)),
             wl = at::zeros_like(local_of(wt, wspec)), ll = at::zeros_like(local_of(leg, lspec));
  sd.add("x", xl).add("y", yl, yspec, {2, 3}).add("w", wl, wspec, {16, 8}).add("legacy", ll, lspec, {10});
  load_state_dict(file_directory(dir), sd);
  bool ok = testing::same_bits(xl, x) && testing::same_bits(yl, local_of(y, yspec)) &&
            testing::same_bits(wl, local_of(wt, wspec)) && testing::same_bits(ll, local_of(leg, lspec));
  if (!ok) std::fprintf(stderr, "rank %d: OLMo-format checkpoint loaded wrong values\n", w.rank);
  return ok ? 0 : 1;
}

TEST_CASE("directories in OLMo-core's format load in any world size") {
  testing::temp_dir dir("olmo");
  at::Tensor x = expected_full("x", dtype::I64, {2, 3}), y = expected_full("y", dtype::F32, {2, 3});
  at::Tensor wt = expected_full("w", dtype::BF16, {16, 8}), leg = expected_full("legacy", dtype::F32, {10});
  auto yflat = y.reshape({-1});
  // rank 0: x whole (not sharded), y[0:3], w rows 0-7; rank 1: y[3:6], w rows 8-15; legacy split 0-4, 4-10
  testing::write_file(dir.path / "rank_0.safetensors",
                      hand_safetensors({{"x", "I64", 6, bytes_of(x)},
                                        {"y", "F32", 3, bytes_of(yflat.slice(0, 0, 3))},
                                        {"w", "BF16", 64, bytes_of(wt.narrow(0, 0, 8))},
                                        {"legacy", "F32", 4, bytes_of(leg.slice(0, 0, 4))}}));
  testing::write_file(dir.path / "rank_1.safetensors",
                      hand_safetensors({{"y", "F32", 3, bytes_of(yflat.slice(0, 3, 6))},
                                        {"w", "BF16", 64, bytes_of(wt.narrow(0, 8, 8))},
                                        {"legacy", "F32", 6, bytes_of(leg.slice(0, 4, 10))}}));
  testing::write_file(
      dir.path / "metadata.json",
      R"({"tensors": {"x": {"shape": [2, 3], "is_sharded": false, "dtype": "I64", "shard_spec_per_file": {"rank_0.safetensors": {"flattened_offsets": [[0, 6]], "local_shape": null, "global_offset": null}}}, )"
      R"("y": {"shape": [2, 3], "is_sharded": true, "dtype": "F32", "shard_spec_per_file": {"rank_0.safetensors": {"flattened_offsets": [[0, 3]], "local_shape": null, "global_offset": null}, "rank_1.safetensors": {"flattened_offsets": [[3, 6]], "local_shape": null, "global_offset": null}}}, )"
      R"("w": {"shape": [16, 8], "is_sharded": true, "dtype": "BF16", "shard_spec_per_file": {"rank_0.safetensors": {"flattened_offsets": null, "local_shape": [8, 8], "global_offset": [0, 0]}, "rank_1.safetensors": {"flattened_offsets": null, "local_shape": [8, 8], "global_offset": [8, 0]}}}, )"
      R"("legacy": {"flattened_offsets_per_file": {"rank_0.safetensors": [0, 4], "rank_1.safetensors": [[4, 6], [6, 10]]}, "shape": [10], "is_sharded": true, "dtype": "F32"}}})");
  for (int w : {1, 2, 3}) {
    CAPTURE(w);
    auto res = testing::run_world("load_olmo", w, {dir.str()});
    CHECK_MESSAGE(res.ok(), res.report());
  }
}

// ---------------------------------------------------------------------------------------
// errors

using testing::error_of;

TEST_CASE("load errors name the file, the tensor and the rule") {
  single_process comm;
  testing::temp_dir dir("errors");
  const auto ckpt = dir.path / "ckpt";
  {
    state_dict sd;
    sd.add("w", expected_full("w", dtype::F32, {4, 6}));
    sd.add("b", expected_full("b", dtype::I64, {6}));
    save_state_dict(file_directory(ckpt), sd, comm);
  }
  errc code{};
  SUBCASE("shape mismatch") {
    state_dict t;
    t.add("w", at::zeros({4, 5}));
    auto msg = error_of([&] { load_state_dict(file_directory(ckpt), t); }, &code);
    CHECK(code == errc::shape_mismatch);
    CHECK(msg.find("'w'") != std::string::npos);
    CHECK(msg.find("[4,6]") != std::string::npos);
    CHECK(msg.find("[4,5]") != std::string::npos);
  }
  SUBCASE("dtype mismatch") {
    state_dict t;
    t.add("w", at::zeros({4, 6}, at::kDouble));
    auto msg = error_of([&] { load_state_dict(file_directory(ckpt), t); }, &code);
    CHECK(code == errc::dtype_mismatch);
    CHECK(msg.find("F32") != std::string::npos);
    CHECK(msg.find("F64") != std::string::npos);
  }
  SUBCASE("missing tensor: an error when strict, listed otherwise") {
    state_dict t;
    t.add("nope", at::zeros({3}));
    auto msg = error_of([&] { load_state_dict(file_directory(ckpt), t); }, &code);
    CHECK(code == errc::not_found);
    CHECK(msg.find("'nope'") != std::string::npos);
    load_options o;
    o.strict = false;
    auto st = load_state_dict(file_directory(ckpt), t, o);
    REQUIRE(st.missing_keys.size() == 1);
    CHECK(st.missing_keys[0] == "nope");
    CHECK(st.unexpected_keys.size() == 2);
  }
  SUBCASE("missing rank file") {
    std::filesystem::remove(ckpt / "rank_0.safetensors");
    state_dict t;
    t.add("b", at::zeros({6}, at::kLong));
    auto msg = error_of([&] { load_state_dict(file_directory(ckpt), t); }, &code);
    CHECK(code == errc::not_found);
    CHECK(msg.find("rank_0.safetensors") != std::string::npos);
  }
  SUBCASE("corrupt rank file: truncated") {
    std::filesystem::resize_file(ckpt / "rank_0.safetensors", 100);
    state_dict t;
    t.add("b", at::zeros({6}, at::kLong));
    auto msg = error_of([&] { load_state_dict(file_directory(ckpt), t); }, &code);
    CHECK(code == errc::truncated);
    CHECK(msg.find("rank_0.safetensors") != std::string::npos);
  }
  SUBCASE("corrupt rank file: garbage header") {
    std::fstream f(ckpt / "rank_0.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.write("{{{{", 4);
    f.close();
    state_dict t;
    t.add("b", at::zeros({6}, at::kLong));
    auto msg = error_of([&] { load_state_dict(file_directory(ckpt), t); }, &code);
    CHECK(code == errc::invalid_json);
    CHECK(msg.find("rank_0.safetensors") != std::string::npos);
  }
  SUBCASE("no metadata.json: an unfinished save does not load") {
    std::filesystem::remove(ckpt / "metadata.json");
    state_dict t;
    t.add("b", at::zeros({6}, at::kLong));
    auto msg = error_of([&] { load_state_dict(file_directory(ckpt), t); }, &code);
    CHECK(code == errc::not_found);
    CHECK(msg.find("metadata.json") != std::string::npos);
  }
  SUBCASE("a non-empty target needs overwrite") {
    state_dict sd;
    sd.add("b", expected_full("b2", dtype::I64, {6}));
    auto msg = error_of([&] { save_state_dict(file_directory(ckpt), sd, comm); }, &code);
    CHECK(code == errc::already_exists);
    save_options o;
    o.overwrite = true;
    save_state_dict(file_directory(ckpt), sd, comm, o);
    state_dict t;
    at::Tensor b = at::zeros({6}, at::kLong);
    t.add("b", b);
    load_state_dict(file_directory(ckpt), t);
    CHECK(testing::same_bits(b, expected_full("b2", dtype::I64, {6})));
    CHECK_FALSE(std::filesystem::exists(ckpt / "rank_1.safetensors"));
    CHECK((file_directory(ckpt).list() == std::vector<std::string>{"metadata.json", "rank_0.safetensors"}));
  }
  SUBCASE("missing coverage is an error naming the elements") {
    // the files hold rows 0-3 of an [8,6] tensor only
    std::filesystem::remove_all(ckpt);
    std::filesystem::create_directories(ckpt);
    at::Tensor w = expected_full("w", dtype::F32, {8, 6});
    testing::write_file(ckpt / "rank_0.safetensors", hand_safetensors({{"w", "F32", 24, bytes_of(w.narrow(0, 0, 4))}}));
    testing::write_file(
        ckpt / "metadata.json",
        R"({"tensors": {"w": {"shape": [8, 6], "is_sharded": true, "dtype": "F32", "shard_spec_per_file": {"rank_0.safetensors": {"flattened_offsets": null, "local_shape": [4, 6], "global_offset": [0, 0]}}}}})");
    state_dict t;
    t.add("w", at::zeros({8, 6}));
    auto msg = error_of([&] { load_state_dict(file_directory(ckpt), t); }, &code);
    CHECK(code == errc::missing_coverage);
    CHECK(msg.find("'w'") != std::string::npos);
    CHECK(msg.find("[24, 48)") != std::string::npos);
    CHECK(msg.find("[4,0]") != std::string::npos);
    // a shard inside the covered rows loads fine
    at::Tensor top = at::zeros({2, 6});
    state_dict ok;
    ok.add("w", top, block_spec({2, 6}, {1, 0}), {8, 6});
    load_state_dict(file_directory(ckpt), ok);
    CHECK(testing::same_bits(top, w.narrow(0, 1, 2).contiguous()));
  }
}

WORKER_SCENARIO("save_disagreeing") {
  auto w = init_world_from_env();
  auto comm = w.comm();
  state_dict sd;
  // rank 1 says the tensor is [8,4]; rank 0 says [8,5]
  shape_t full = w.rank == 0 ? shape_t{8, 5} : shape_t{8, 4};
  sd.add("w", at::zeros({4, static_cast<long>(full[1])}), block_part(full, 0, 2, w.rank), full);
  try {
    save_state_dict(file_directory(args.at(0)), sd, comm);
  } catch (const shardsafe::error& e) {
    std::string m = e.what();
    bool named = m.find("rank 0") != std::string::npos && m.find("rank 1") != std::string::npos &&
                 m.find("'w'") != std::string::npos;
    std::fprintf(stderr, "%s\n", e.what());
    return named ? 3 : 4;
  }
  return 0;
}

WORKER_SCENARIO("save_gap") {
  auto w = init_world_from_env();
  auto comm = w.comm();
  state_dict sd;
  // rows 0-3 and 5-7 of an [8,2] tensor: row 4 is held by nobody
  shard_spec s = w.rank == 0 ? shard_spec(block_spec({4, 2}, {0, 0})) : shard_spec(block_spec({3, 2}, {5, 0}));
  sd.add("w", at::zeros({w.rank == 0 ? 4 : 3, 2}), s, {8, 2});
  try {
    save_state_dict(file_directory(args.at(0)), sd, comm);
  } catch (const shardsafe::error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return e.code() == make_error_code(errc::missing_coverage) ? 3 : 4;
  }
  return 0;
}

TEST_CASE("ranks that disagree fail together, naming both ranks, without hanging") {
  testing::temp_dir dir("disagree");
  auto res = testing::run_world("save_disagreeing", 2, {(dir.path / "c").string()}, std::chrono::seconds(60));
  CHECK_MESSAGE((res.status == std::vector<int>{3, 3}), res.report());
  CHECK_FALSE(std::filesystem::exists(dir.path / "c" / "metadata.json"));
  auto gap = testing::run_world("save_gap", 2, {(dir.path / "g").string()}, std::chrono::seconds(60));
  CHECK_MESSAGE((gap.status == std::vector<int>{3, 3}), gap.report());
}

namespace {
/// Runs f, which must throw on every rank a shardsafe::error whose code is exactly `want`
/// (category and value) and whose message starts "rank <failing>: "; prints what differs.
template <class F>
int expect_everywhere(const char* what, int rank, std::error_code want, int failing, F&& f) {
  try {
    f();
    std::fprintf(stderr, "%s: rank %d threw nothing\n", what, rank);
  } catch (const shardsafe::error& e) {
    const std::string m = e.what();
    if (e.code() == want && m.rfind("rank " + std::to_string(failing) + ": ", 0) == 0) return 0;
    std::fprintf(stderr, "%s: rank %d threw %s:%d (%s), not %s:%d: %s\n", what, rank, e.code().category().name(),
                 e.code().value(), e.code().message().c_str(), want.category().name(), want.value(), m.c_str());
  }
  return 1;
}
}  // namespace

// Each torch call site of dist/agree.hpp: the failing rank's own code arrives on every rank.
// args: a folder to work in, a regular file.
WORKER_SCENARIO("agree_keeps_codes") {
  auto w = init_world_from_env();
  auto comm = w.comm();
  const std::filesystem::path base = args.at(0), plain = args.at(1);
  int bad = 0;
  // save_state_dict: a dtype safetensors lacks, on rank 1 only (was invalid_argument)
  bad += expect_everywhere("save_state_dict", w.rank, make_error_code(errc::unsupported_dtype), 1, [&] {
    state_dict sd;
    sd.add("z", w.rank == 1 ? at::zeros({3}, at::kComplexDouble) : at::zeros({3}, at::kDouble));
    save_state_dict(file_directory(base / "dtype"), sd, comm);
  });
  // save_model_and_optim_state: rank 0's mkdir under a regular file fails (was already_exists)
  bad += expect_everywhere("save_model_and_optim_state", w.rank, std::error_code(ENOTDIR, std::generic_category()), 0,
                           [&] {
                             state_dict sd;
                             sd.add("w", at::zeros({4, 6}));
                             save_model_and_optim_state(file_directory(plain / "ckpt"), sd, nullptr, comm);
                           });
  // load_model_and_optim_state: rank 1's tensor has the wrong shape (was io_error)
  {
    state_dict sd;
    sd.add("w", expected_full("w", dtype::F32, {4, 6}));
    save_model_and_optim_state(file_directory(base / "pair"), sd, nullptr, comm);
  }
  bad += expect_everywhere("load_model_and_optim_state", w.rank, make_error_code(errc::shape_mismatch), 1, [&] {
    state_dict sd;
    sd.add("w", w.rank == 1 ? at::zeros({4, 5}) : at::zeros({4, 6}));
    load_model_and_optim_state(file_directory(base / "pair"), sd, nullptr, comm);
  });
  // unshard_state_on_rank0: no checkpoint there (was io_error)
  bad += expect_everywhere("unshard_state_on_rank0", w.rank, make_error_code(errc::not_found), 0,
                           [&] { unshard_state_on_rank0(file_directory(base / "none"), comm); });
  // and the agreement leaves the world usable: a save and an unshard that work
  {
    state_dict sd;
    sd.add("w", local_of(expected_full("w", dtype::F32, {4, 6}), block_part({4, 6}, 0, 2, w.rank)),
           block_part({4, 6}, 0, 2, w.rank), {4, 6});
    save_state_dict(file_directory(base / "ok"), sd, comm);
    auto full = unshard_state_on_rank0(file_directory(base / "ok"), comm);
    if (w.rank == 0 &&
        (full.size() != 1 || !testing::same_bits(full[0].second, expected_full("w", dtype::F32, {4, 6})))) {
      std::fprintf(stderr, "unshard after the failures: wrong tensors\n");
      ++bad;
    }
    if (w.rank != 0 && !full.empty()) ++bad;
  }
  return bad == 0 ? 0 : 1;
}

TEST_CASE("a failure on one rank arrives on every rank with its own code (c10d)") {
  testing::temp_dir dir("agree");
  testing::write_file(dir.path / "plain", "x");
  auto res =
      testing::run_world("agree_keeps_codes", 2, {dir.str(), (dir.path / "plain").string()}, std::chrono::seconds(120));
  CHECK_MESSAGE(res.ok(), res.report());
  CHECK_FALSE(std::filesystem::exists(dir.path / "dtype" / "metadata.json"));
  CHECK(std::filesystem::exists(dir.path / "ok" / "metadata.json"));
}

// A save killed at any moment leaves either a complete checkpoint or one that does not load.
WORKER_SCENARIO("save_big_slowly") {
  single_process comm;
  state_dict sd;
  for (int i = 0; i < 6; ++i)
    sd.add("t" + std::to_string(i), expected_full("t" + std::to_string(i), dtype::F32, {1 << 20}));
  save_options o;
  o.overwrite = true;
  o.write_chunk_bytes = 1 << 16;
  o.threads = 1;
  save_state_dict(file_directory(args.at(0)), sd, comm, o);
  return 0;
}

TEST_CASE("a save killed part way never leaves a checkpoint that loads as complete") {
  testing::temp_dir dir("killed");
  const auto ckpt = dir.path / "c";
  int complete = 0, refused = 0;
  for (int delay_ms : {0, 5, 20, 60, 150, 400, 2000}) {
    CAPTURE(delay_ms);
    const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
    pid_t pid = fork();
    if (pid == 0) {
      setenv("SHARDSAFE_WORKER", "save_big_slowly", 1);
      setenv("SHARDSAFE_WORKER_ARGS", (ckpt.string() + "\x1f").c_str(), 1);
      execl(self.c_str(), self.c_str(), nullptr);
      _exit(127);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    kill(pid, SIGKILL);
    int st;
    waitpid(pid, &st, 0);
    state_dict t;
    std::vector<at::Tensor> into;
    for (int i = 0; i < 6; ++i) t.add("t" + std::to_string(i), into.emplace_back(at::zeros({1 << 20})));
    errc code{};
    auto msg = error_of([&] { load_state_dict(file_directory(ckpt), t); }, &code);
    if (msg.empty()) {
      ++complete;
      for (int i = 0; i < 6; ++i)
        CHECK(testing::same_bits(into[i], expected_full("t" + std::to_string(i), dtype::F32, {1 << 20})));
    } else {
      ++refused;
      CHECK_MESSAGE(code == errc::not_found, msg);
    }
  }
  MESSAGE("killed saves: " << complete << " complete, " << refused << " refused as incomplete");
  CHECK(refused > 0);
}

namespace {
/// What rank q contributes to the store-transport all-gathers below: lengths differ by rank,
/// rank 0's is empty, rank 1's is over 9 MiB (three pieces of the store's keys: one key of a
/// TCPStore served with libuv holds at most 8 MiB).
std::string gathered_bytes(int q, int i) {
  if (q == 0) return {};
  std::string s((q == 1 ? (std::size_t(9) << 20) : 0) + std::size_t(q + i), char('a' + q));
  for (std::size_t k = 0; k < s.size(); k += 4093) s[k] = static_cast<char>(k / 4093 + q);
  s[0] = static_cast<char>(i);
  return s;
}
}  // namespace

// The store transport's collectives, checked against what each rank sent: all-gathers of
// lengths 0 to 9 MiB, broadcasts from every root (the last one's 5 MiB), a buffer and a tensor
// broadcast, a second group (made from a copy of the world) used from another thread while the
// world's and a third run, and the store holding only the keys of the collectives under way
// after hundreds of them.
WORKER_SCENARIO("store_collectives") {
  c10d_world w = init_world_from_env();
  testing::worker_check(w.transport == c10d_transport::store && !w.pg,
                        "SHARDSAFE_C10D_TRANSPORT=store did not give a store world");
  c10d_comm comm = w.comm();
  const int r = w.rank, n = w.world_size;
  for (int i = 0; i < 3; ++i) {
    const auto all = comm.all_gather_bytes(gathered_bytes(r, i));
    testing::worker_check(static_cast<int>(all.size()) == n,
                          "all_gather_bytes gave " + std::to_string(all.size()) + " strings");
    for (int q = 0; q < n; ++q)
      testing::worker_check(all[q] == gathered_bytes(q, i),
                            "all_gather_bytes: rank " + std::to_string(q) + "'s bytes differ");
  }
  for (int root = 0; root < n; ++root) {
    const std::string want =
        "from rank " + std::to_string(root) + (root == n - 1 ? std::string(std::size_t(5) << 20, 'z') : "");
    std::string s = r == root ? want : std::string(100, 'x');
    comm.broadcast_bytes(s, root);
    testing::worker_check(
        s == want, "broadcast_bytes from " + std::to_string(root) + " gave " + std::to_string(s.size()) + " bytes");
  }
  std::vector<std::byte> buf(1000, std::byte{0});
  if (r == n - 1)
    for (std::size_t k = 0; k < buf.size(); ++k) buf[k] = static_cast<std::byte>(k * 7 + 3);
  comm.broadcast_buffer(buf, n - 1);
  for (std::size_t k = 0; k < buf.size(); ++k)
    testing::worker_check(buf[k] == static_cast<std::byte>(k * 7 + 3), "broadcast_buffer differs");
  at::Tensor t = r == 1 ? at::arange(12, at::kFloat).mul_(0.5) : at::zeros({12});
  comm.broadcast_tensor(t, 1);
  testing::worker_check(t.equal(at::arange(12, at::kFloat).mul_(0.5)), "broadcast_tensor differs");

  comm.barrier();
  const std::int64_t before = w.store->getNumKeys();
  c10d_comm again = w.comm();  // another comm of the world: the same group, one sequence
  for (int i = 0; i < 100; ++i) {
    c10d_comm& c = i % 2 ? again : comm;
    testing::worker_check(
        c.all_gather_bytes(std::to_string(i * n + r)).at((r + 1) % n) == std::to_string(i * n + (r + 1) % n),
        "all_gather_bytes " + std::to_string(i) + " differs");
    c.barrier();
    std::string s = std::to_string(i);
    c.broadcast_bytes(s, i % n);
  }
  const std::int64_t after = w.store->getNumKeys();
  // the last collectives' keys may wait for a slower rank: at most the n + 2 of two of them
  testing::worker_check(after <= before + 2 * (n + 2), "the store grew from " + std::to_string(before) + " to " +
                                                           std::to_string(after) + " keys over 300 collectives");

  c10d_world copy = w;                 // a copy's groups are counted with the world's:
  c10d_comm group = copy.new_group();  // this is group 1, the one below group 2
  c10d_comm third = w.new_group();
  std::string group_error;
  std::thread other([&] {
    try {
      for (int i = 0; i < 50; ++i)
        testing::worker_check(group.all_gather_bytes("g" + std::to_string(i) + "/" + std::to_string(r)).at(0) ==
                                  "g" + std::to_string(i) + "/0",
                              "the second group's all-gather differs");
    } catch (const std::exception& e) {
      group_error = e.what();
    }
  });
  for (int i = 0; i < 50; ++i)  // the world's group and the third, beside the second
    testing::worker_check(
        (i % 2 ? third : comm).all_gather_bytes("c" + std::to_string(i) + "/" + std::to_string(r)).at(n - 1) ==
            "c" + std::to_string(i) + "/" + std::to_string(n - 1),
        "an all-gather beside the second group differs");
  other.join();
  testing::worker_check(group_error.empty(), group_error);
  return 0;
}

// args: the timeout in ms. The last rank leaves without a collective; the others' all-gather
// then fails within the timeout and the roll call names it.
WORKER_SCENARIO("store_rank_lost") {
  c10d_world w = init_world_from_env(std::chrono::milliseconds(std::stol(args.at(0))));
  if (w.rank == w.world_size - 1) return 0;
  c10d_comm comm = w.comm();
  try {
    comm.all_gather_bytes("x");
  } catch (const shardsafe::error& e) {
    std::fprintf(stderr, "rank %d: %s\n", w.rank, e.what());
    return e.code() == errc::comm_error ? 3 : 4;
  }
  return 0;
}

TEST_CASE("the store transport (no Gloo): collectives, a save on 2 ranks loaded on 3 bit for bit, a lost rank named") {
  const std::map<std::string, std::string> store{{"SHARDSAFE_C10D_TRANSPORT", "store"}};
  auto col = testing::run_world("store_collectives", 3, {}, std::chrono::seconds(240), store);
  CHECK_MESSAGE(col.ok(), col.report());

  testing::temp_dir dir("store_transport");
  const std::string ckpt = (dir.path / "model").string();
  auto saved = testing::run_world("save_catalogue", 2, {ckpt}, std::chrono::seconds(240), store);
  REQUIRE_MESSAGE(saved.ok(), saved.report());
  auto loaded = testing::run_world("load_catalogue", 3, {ckpt}, std::chrono::seconds(240), store);
  CHECK_MESSAGE(loaded.ok(), loaded.report());

  auto lost = testing::run_world("store_rank_lost", 3, {"2000"}, std::chrono::seconds(240), store);
  REQUIRE(lost.status.size() == 3);
  CHECK(lost.status[2] == 0);
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK_MESSAGE(lost.status[r] == 3, lost.report());
    CHECK_MESSAGE(
        lost.err[r].find("c10d all_gather_bytes on rank " + std::to_string(r) + " of 3 failed") != std::string::npos,
        lost.err[r]);
    CHECK_MESSAGE(lost.err[r].find("rank 2 did not answer the roll call") != std::string::npos, lost.err[r]);
  }
}
