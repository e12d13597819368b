// The snippets of docs/USAGE.md, compiled and run: each `// [usage: NAME]` ... `// [/usage]`
// region below is what USAGE.md shows under `<!-- snippet: tests/checkpoint/test_usage.cpp#NAME -->`, byte for
// byte (tests/usage_check.py, the `usage` test, compares them). The test runs them in order in a
// temporary folder and checks what they produce.
#include "shardsafe/shardsafe.hpp"

#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "support/test_util.hpp"

using namespace shardsafe;

namespace {

std::vector<float> iota_floats(std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i);
  return v;
}

}  // namespace

TEST_CASE("usage: the snippets of docs/USAGE.md run") {
  testing::temp_dir tmp("usage");
  const std::filesystem::path dir = tmp.path;
  // [usage: save]
  // this rank's memory, described: a tensor "w" [8, 6], here held whole (a block or flat
  // ranges in a sharded job), and "b" [6]
  std::vector<float> w = iota_floats(48), b(6, 1.0f);
  const std::vector<flat_view> views{
      {"w", dtype::F32, {8, 6}, block_spec({8, 6}, {0, 0}), reinterpret_cast<std::byte*>(w.data()), w.size() * 4},
      {"b", dtype::F32, {6}, std::nullopt, reinterpret_cast<std::byte*>(b.data()), b.size() * 4}};
  single_process comm;  // or c10d_comm (torch/c10d.hpp), or any type that models Comm
  save_stats st = save(file_directory(dir / "ckpt"), std::span<const flat_view>(views), comm);
  // [/usage]
  CHECK(st.total_bytes > 48 * 4);

  // [usage: threads]
  // four ranks as four threads of this process, each saving its quarter of the rows of "w"
  std::vector<std::exception_ptr> thrown = run_ranks(4, [&](thread_comm& rank_comm) {
    const std::uint64_t r = static_cast<std::uint64_t>(rank_comm.rank());
    const flat_view quarter{
        "w",   dtype::F32, {8, 6}, block_spec({2, 6}, {2 * r, 0}), reinterpret_cast<std::byte*>(w.data() + 12 * r),
        12 * 4};
    save(file_directory(dir / "by_threads"), std::span<const flat_view>(&quarter, 1), rank_comm);
  });
  // [/usage]
  for (const auto& e : thrown) CHECK_FALSE(e);
  CHECK(read_checkpoint_metadata(file_directory(dir / "by_threads").open(metadata_file_name)).find("w")->files.size() ==
        4);

  // [usage: load]
  // rows 2..5 of "w" straight into this buffer: only those bytes are read
  std::vector<float> rows(4 * 6);
  const flat_view part{
      "w", dtype::F32, {8, 6}, block_spec({4, 6}, {2, 0}), reinterpret_cast<std::byte*>(rows.data()), rows.size() * 4};
  checkpoint_reader<file_directory> reader(file_directory(dir / "ckpt"));  // any layout: shardsafe, HF, DCP
  load_stats ls = load(reader, std::span<const flat_view>(&part, 1));
  // [/usage]
  CHECK(ls.bytes_needed == 96);
  CHECK(rows[0] == 12.0f);

  // [usage: load_collective]
  // the collective load: every rank its own views; a failure on any rank is thrown on all
  std::vector<std::exception_ptr> failed = run_ranks(2, [&](thread_comm& rank_comm) {
    std::vector<float> half(4 * 6);
    const flat_view mine{"w",
                         dtype::F32,
                         {8, 6},
                         block_spec({4, 6}, {4 * std::uint64_t(rank_comm.rank()), 0}),
                         reinterpret_cast<std::byte*>(half.data()),
                         half.size() * 4};
    load(file_directory(dir / "ckpt"), std::span<const flat_view>(&mine, 1), rank_comm);
    if (half[0] != 24.0f * float(rank_comm.rank())) throw std::runtime_error("not the rows of this rank");
  });
  // [/usage]
  for (const auto& e : failed) CHECK_FALSE(e);

  // [usage: load_replicas]
  // replicas read once: 4 data-parallel ranks each load all of "w"; each reads a quarter of it
  // from storage and receives the rest from the other three
  failed = run_ranks(4, [&](thread_comm& rank_comm) {
    std::vector<float> all(8 * 6);
    const flat_view whole{"w", dtype::F32, {8, 6}, std::nullopt, reinterpret_cast<std::byte*>(all.data()), 48 * 4};
    collective_load_options o;
    o.replicas = replica_reads::read_once;  // or automatic: measured; every_rank_reads is the default
    const load_stats st = load(file_directory(dir / "ckpt"), std::span<const flat_view>(&whole, 1), rank_comm, o);
    if (st.replica_group != 4 || st.bytes_read != 48 || st.bytes_received != 3 * 48 || all[47] != 47.0f)
      throw std::runtime_error("not read once");
  });
  // [/usage]
  for (const auto& e : failed) CHECK_FALSE(e);
  // a rank that fails (a view the checkpoint lacks) fails the load on every rank, with its code
  failed = run_ranks(2, [&](thread_comm& rank_comm) {
    std::vector<float> buf(6);
    const flat_view v{rank_comm.rank() == 1 ? "nope" : "b",     dtype::F32,    {6}, std::nullopt,
                      reinterpret_cast<std::byte*>(buf.data()), buf.size() * 4};
    load(file_directory(dir / "ckpt"), std::span<const flat_view>(&v, 1), rank_comm);
  });
  for (const auto& e : failed) {
    REQUIRE(e);
    testing::expect_error([&] { std::rethrow_exception(e); }, errc::not_found, {"rank 1: ", "tensor 'nope'"});
  }

  // [usage: verify]
  checkpoint_report rep = verify_checkpoint(file_directory(dir / "ckpt"));  // every rule, every checksum
  // [/usage]
  CHECK(rep.tensors == 2);
  CHECK(rep.checksums);

  // [usage: hf_export]
  hf_export_options ho;
  ho.max_shard_size = 100;            // bytes of tensors per file
  ho.rename.add("^w$=model.weight");  // REGEX=REPL (RE2), first match wins
  hf_export_stats hs = export_to(file_directory(dir / "ckpt"), file_directory(dir / "hf"), ho);
  // [/usage]
  CHECK(hs.files == 2);

  // [usage: hf_import]
  std::vector<float> mine(8 * 6);
  const std::vector<flat_view> model{
      {"w", dtype::F32, {8, 6}, std::nullopt, reinterpret_cast<std::byte*>(mine.data()), mine.size() * 4}};
  hf_import_options io;
  io.rename.add("^model\\.weight$=w");  // the folder's names -> the model's
  io.mode = hf_import_mode::automatic;  // the default: picks by what it measures (or every_rank_read, rank0_broadcast)
  hf_import_stats ir = import_hf(file_directory(dir / "hf"), std::span<const flat_view>(model), comm, io);
  // [/usage]
  CHECK(ir.keys.unexpected_keys.size() == 1);  // "b", which no view asked for
  CHECK(std::memcmp(mine.data(), w.data(), w.size() * 4) == 0);

  // [usage: dcp]
  // torch.distributed.checkpoint: .metadata + __R_0.distcp, read by torch 2.x's dcp.load
  save_options dcp;
  dcp.format = save_format::dcp;
  save(file_directory(dir / "dcp"), std::span<const flat_view>(views), comm, dcp);
  checkpoint_reader<file_directory> from_torch(file_directory(dir / "dcp"));  // a folder torch wrote reads alike
  for (const non_tensor_item& item : from_torch.non_tensors()) (void)from_torch.read_object(item.key);  // its values
  // [/usage]
  CHECK(from_torch.layout() == dcp_layout::info);
  CHECK(from_torch.metadata().tensors.size() == 2);

  // [usage: async]
  async_saver<single_process> saver(comm);  // keeps its staging memory from save to save
  async_save_handle h = saver.save(file_directory(dir / "async"), std::span<const flat_view>(views));
  // ... training goes on: the views were copied, the files are written in the background ...
  const async_save_stats& done = h.wait();  // rethrows the save's error, on every rank
  // [/usage]
  CHECK(done.staged_bytes == 54 * 4);

  // [usage: folder_set]
  // several folders as one checkpoint, committed in order (a model + optimizer pair: optim/,
  // then model/, whose metadata.json is the pair's mark); async_saver::save alike
  const std::vector<flat_view> optim_state{views[1]};  // (here: any views)
  const std::vector<folder_views> pair = model_and_optim_folders(views, optim_state, /*with_optim=*/true);
  std::vector<save_stats> each = save(file_directory(dir / "pair"), std::span<const folder_views>(pair), comm);
  // [/usage]
  REQUIRE(each.size() == 2);
  CHECK(each[0].tensors_written == 1);
  CHECK(each[1].tensors_written == 2);
  CHECK(is_complete_checkpoint(file_directory(dir / "pair")));
  // refused when the parent holds anything, unless overwrite; the async counterpart replaces it
  testing::expect_error([&] { save(file_directory(dir / "pair"), std::span<const folder_views>(pair), comm); },
                        errc::already_exists, {"pair: not empty"});
  save_options replace;
  replace.overwrite = true;
  const std::vector<folder_views> model_only = model_and_optim_folders(views, {}, /*with_optim=*/false);
  saver.save(file_directory(dir / "pair"), std::span<const folder_views>(model_only), replace).wait();
  CHECK(file_directory(dir / "pair").list() == std::vector<std::string>{"model"});
  CHECK(is_complete_checkpoint(file_directory(dir / "pair")));

  // [usage: mesh]
  // HSDP on a [2, 2] mesh ("replicate", "shard"): this rank's block of a [8, 6] tensor and its role
  const device_mesh mesh({2, 2}, {"replicate", "shard"}, /*rank=*/3);
  const std::vector<placement> hsdp{replicate(), shard(0)};
  const std::vector<std::uint64_t> full{8, 6};
  block_spec blk = mesh_block(full, mesh, hsdp, "w");             // rows 4..7 ("w" names it in messages)
  replica_role role = mesh_replica_role(mesh, hsdp, /*salt=*/0);  // writer or copy: a replica is written once
  // [/usage]
  CHECK(blk.global_offset() == shape_t{4, 0});
  CHECK(role != replica_role::none);

  // [usage: configured]
  // the backend, the communicator and the policy fixed in the type: a wrong mix is a compile error
  using strict_f32_loader =
      configured_loader<file_directory, single_process,
                        load_policy{.strict = true, .validate_nan = true, .views = only(dtype::F32)}>;
  strict_f32_loader loader(file_directory(dir / "ckpt"), comm);
  load(loader, std::span<const flat_view>(&part, 1));
  // [/usage]
  CHECK(rows[0] == 12.0f);
}
