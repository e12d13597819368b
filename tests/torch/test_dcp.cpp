// torch DCP folders written by a 3-process Gloo world of Debian's torch 1.13
// (tests/dcp_fixture_dist.py) loaded with load_state_dict into real c10d worlds of 1, 2 and 4
// processes, by rows, by columns and by flattened ranges. Expected values are torch's own bytes
// of the full tensors cut with ATen (fixtures.hpp), never the library's cursors. Also a 1-process
// folder (tests/dcp_fixture.py) with tensors of dtypes no safetensors name holds.
#include "shardsafe/torch/state_dict.hpp"

#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/dcp_digest.hpp"
#include "fixtures.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "shardsafe/torch/mapped_state.hpp"
#include "support/test_util.hpp"
#include "world.hpp"

using namespace shardsafe;
namespace fs = std::filesystem;

namespace {

struct full_tensor {
  std::string key;
  at::Tensor t;
};

/// The full tensors torch wrote out (tests/support/dcp_digest.hpp).
std::vector<full_tensor> torch_tensors(const fs::path& dir) {
  std::vector<full_tensor> out;
  for (const auto& e : testing::read_torch_digest(dir)) {
    at::Tensor t = at::empty(to_sizes(e.shape), *to_scalar_type(e.type));
    std::memcpy(t.data_ptr(), e.raw.data(), e.raw.size());
    out.push_back({e.key, t});
  }
  return out;
}

/// This rank's spec of a tensor of `shape` cut `how` over `world` ranks (torch.chunk sizes).
std::optional<shard_spec> spec_of(const shape_t& shape, const std::string& how, std::uint64_t world,
                                  std::uint64_t rank) {
  if (shape.empty()) return std::nullopt;
  auto chunk = [&](std::uint64_t n) {
    const std::uint64_t c = (n + world - 1) / world, b = std::min(n, rank * c);
    return std::pair{b, std::min(n, b + c)};
  };
  if (how == "flat") {
    const auto [b, e] = chunk(numel(shape));
    return shard_spec(flat_spec{{b, e}});
  }
  const std::size_t d = how == "cols" && shape.size() == 2 ? 1 : 0;
  shape_t local = shape, off(shape.size(), 0);
  const auto [b, e] = chunk(shape[d]);
  local[d] = e - b;
  off[d] = b;
  return shard_spec(block_spec(local, off));
}

}  // namespace

WORKER_SCENARIO("dcp_load") {
  auto w = init_world_from_env();
  const fs::path dir = args.at(0);
  const std::string how = args.at(2);
  state_dict sd;
  std::vector<at::Tensor> want;
  for (const auto& f : torch_tensors(dir)) {
    const auto spec = spec_of(shape_of(f.t), how, w.world_size, w.rank);
    const at::Tensor expect = testing::local_of(f.t, spec);
    at::Tensor local = at::full(expect.sizes(), 7, expect.options());
    if (spec && spec->is_flat()) local = local.reshape({-1});
    if (spec)
      sd.add(f.key, local, *spec, shape_of(f.t));
    else
      sd.add(f.key, local);
    want.push_back(expect);
  }
  const load_stats st = load_state_dict(file_directory(dir / args.at(1)), sd);
  int bad = 0;
  std::size_t i = 0;
  for (const auto& [key, t] : sd) {
    if (!testing::same_bits(t.local.reshape({-1}), want[i++].reshape({-1}))) {
      std::fprintf(stderr, "rank %d of %d (%s %s): %s differs\n", w.rank, w.world_size, args.at(1).c_str(), how.c_str(),
                   key.c_str());
      ++bad;
    }
  }
  if (st.unexpected_keys.size() != 0 || st.missing_keys.size() != 0 || st.bytes_read < st.bytes_needed) ++bad;
  return bad == 0 ? 0 : 1;
}

namespace {
/// Writes the folders of tests/SCRIPT with Debian's torch 1.13 into dir.
void write_torch113_fixture(const char* script, const testing::temp_dir& dir) {
  REQUIRE_MESSAGE(testing::torch_major() == 1,
                  "the test command asks for torch 1.13 but " << testing::torch_python << " does not hold it");
  const auto r =
      testing::peer(testing::torch_python, {(fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / script).string(), dir.str()});
  REQUIRE_MESSAGE(r.code == 0, r.err);
}
}  // namespace

TEST_CASE("dcp: a torch 1.13 DCP checkpoint of 3 ranks loads into c10d worlds of 1, 2 and 4, rows/cols/flat" *
          testing::torch_major_check(1)) {
  testing::temp_dir dir("dcp-c10d");
  write_torch113_fixture("dcp_fixture_dist.py", dir);
  for (const char* folder : {"ckpt", "ckpt_single"})
    for (const char* how : {"rows", "cols", "flat"})
      for (int n : {1, 2, 4}) {
        CAPTURE(folder);
        CAPTURE(how);
        CAPTURE(n);
        auto res = testing::run_world("dcp_load", n, {dir.str(), folder, how});
        CHECK_MESSAGE(res.ok(), res.report());
      }
}

TEST_CASE(
    "dcp: tensors of a dtype no safetensors name holds (torch 1.13's complex128, qint8): unshard_state and "
    "map_state refuse them by name, load_state_dict loads the rest and reports them unexpected" *
    testing::torch_major_check(1)) {
  testing::temp_dir dir("dcp-foreign");
  write_torch113_fixture("dcp_fixture.py", dir);
  const fs::path ck = dir.path / "ckpt_foreign";
  const std::vector<std::string> why{"'freqs'", "torch.complex128", "no type for"};
  checkpoint_reader<file_directory> r{file_directory(ck)};
  testing::expect_error([&] { unshard_state(r); }, errc::unsupported_dtype, why);
  testing::expect_error([&] { map_state(ck); }, errc::unsupported_dtype, why);
  at::Tensor w = at::zeros({3, 4}, at::kFloat);
  state_dict sd;
  sd.add("w", w);
  load_options lo;
  lo.strict = false;
  const load_stats st = load_state_dict(r, sd, lo);
  const std::string raw = testing::slurp(dir.path / "raw_foreign_w.bin");
  REQUIRE(raw.size() == 48u);
  CHECK(std::memcmp(w.data_ptr(), raw.data(), raw.size()) == 0);  // the bytes torch wrote
  CHECK(st.unexpected_keys == std::vector<std::string>{"freqs", "q"});
}
