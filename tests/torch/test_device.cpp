// tests/torch/test_device.cpp - loads into and saves from CUDA tensors (torch/device_copy.hpp,
// the staging ring), bit-exact against torch's own indexing and conversion of the tensors
// saved. Every case needs a CUDA device: without one (CI, a CPU-only LibTorch) each is counted
// as skipped (doctest::skip, decided once as the cases register: cuda_cases_skipped); the ring
// itself is tested without a device in tests/checkpoint/test_staging.cpp.
// scripts/device-check.sh builds the torch suite against a CUDA LibTorch (torch's wheel) and runs
// these cases first; the last one runs multi-process worlds (store worlds there: the wheel has
// no Gloo headers).
#include <doctest/doctest.h>
#include <link.h>
#include <stdlib.h>

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>

#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/async_checkpointer.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "shardsafe/torch/device_copy.hpp"
#include "shardsafe/torch/state_dict.hpp"
#include "world.hpp"

using namespace shardsafe;

namespace {

/// Whether the CUDA cases are skipped (doctest::skip, so that doctest counts them as skipped, not
/// passed): decided once, as the cases register, and cheaply, without initializing CUDA (as
/// at::hasCUDA() would, in every run of the suite and in each worker process it starts). They
/// run when a CUDA build of LibTorch is loaded (libtorch_cuda or libc10_cuda among the process's
/// libraries) and the machine shows an NVIDIA device (/dev/nvidiaN; /dev/dxg under WSL2) that
/// CUDA_VISIBLE_DEVICES does not hide. A case that runs and then finds no device fails
/// (require_cuda): scripts/device-check.sh, on a GPU machine, treats skipped cases as a failure too.
bool cuda_cases_skipped() {
  static const bool skipped = [] {
    bool cuda_lib = false;
    ::dl_iterate_phdr(
        [](dl_phdr_info* info, std::size_t, void* found) {
          const std::string_view n = info->dlpi_name ? info->dlpi_name : "";
          if (n.find("libtorch_cuda") == std::string_view::npos && n.find("libc10_cuda") == std::string_view::npos)
            return 0;
          *static_cast<bool*>(found) = true;
          return 1;
        },
        &cuda_lib);
    if (!cuda_lib) return true;
    if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES"))
      if (std::string_view(v).empty() || std::string_view(v).starts_with("-1")) return true;
    std::error_code ec;
    if (std::filesystem::exists("/dev/dxg", ec)) return false;
    for (std::filesystem::directory_iterator it("/dev", ec), end; !ec && it != end; it.increment(ec)) {
      const std::string n = it->path().filename().string();
      if (n.size() > 6 && n.starts_with("nvidia") && n.find_first_not_of("0123456789", 6) == std::string::npos)
        return false;
    }
    return true;
  }();
  return skipped;
}

/// In a case that runs (not skipped): LibTorch must see the device the machine shows.
void require_cuda() {
  REQUIRE_MESSAGE(at::hasCUDA(),
                  "no CUDA device found by LibTorch, where the case runs (cuda_cases_skipped saw a "
                  "CUDA LibTorch and an NVIDIA device, or --no-skip): a driver too old for its CUDA?");
}

struct device_dir {
  std::filesystem::path path;
  device_dir() {
    std::string t = (std::filesystem::temp_directory_path() / "shardsafe-device-XXXXXX").string();
    REQUIRE(::mkdtemp(t.data()) != nullptr);
    path = t;
  }
  ~device_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  file_directory dir(const std::string& sub = "") const { return file_directory(sub.empty() ? path : path / sub); }
};

/// Same dtype, shape and bytes (a CUDA tensor is brought to the CPU first).
bool same_bytes(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor g = got.cpu().contiguous(), w = want.cpu().contiguous();
  return g.scalar_type() == w.scalar_type() && g.sizes() == w.sizes() &&
         std::memcmp(g.data_ptr(), w.data_ptr(), static_cast<std::size_t>(g.nbytes())) == 0;
}

at::TensorOptions on_cuda(at::ScalarType t) { return at::TensorOptions().dtype(t).device(at::kCUDA); }

/// a: BF16 [300, 257]; b: F32 [1000, 1000] (4 MB: several 1 MiB slots); c: F32 [7].
state_dict dev_sample() {
  state_dict sd;
  sd.add("a", at::randn({300, 257}).to(at::kBFloat16));
  sd.add("b", at::randn({1000, 1000}));
  sd.add("c", at::randn({7}));
  return sd;
}

device_load_options dev_small_ring() {
  device_load_options o;
  o.staging.slots = 3;
  o.staging.slot_bytes = std::uint64_t(1) << 20;
  return o;
}

}  // namespace

TEST_CASE("cuda: whole, flat, row and column shards load into CUDA tensors bit-exact" *
          doctest::skip(cuda_cases_skipped())) {
  require_cuda();
  device_dir tmp;
  single_process comm;
  const state_dict src = dev_sample();
  save_state_dict(tmp.dir(), src, comm);
  const at::Tensor a = src.find("a")->local, b = src.find("b")->local, c = src.find("c")->local;
  for (const device_load_options& o : {dev_small_ring(), device_load_options{}}) {
    state_dict whole, flat, rows, cols;
    whole.add("a", at::empty({300, 257}, on_cuda(at::kBFloat16)));
    whole.add("c", at::empty({7}, on_cuda(at::kFloat)));
    flat.add("b", at::empty({654321 - 123457}, on_cuda(at::kFloat)), flat_spec{{123457, 654321}}, {1000, 1000});
    rows.add("b", at::empty({444, 1000}, on_cuda(at::kFloat)), block_spec({444, 1000}, {333, 0}), {1000, 1000});
    cols.add("a", at::empty({300, 129}, on_cuda(at::kBFloat16)), block_spec({300, 129}, {0, 100}), {300, 257});
    const load_stats st = load_state_dict(tmp.dir(), whole, o);
    CHECK(st.tensors == 2);
    CHECK(st.unexpected_keys == std::vector<std::string>{"b"});
    for (state_dict* sd : {&flat, &rows, &cols}) load_state_dict(tmp.dir(), *sd, o);
    CHECK(same_bytes(whole.find("a")->local, a));
    CHECK(same_bytes(whole.find("c")->local, c));
    CHECK(same_bytes(flat.find("b")->local, b.flatten().narrow(0, 123457, 654321 - 123457)));
    CHECK(same_bytes(rows.find("b")->local, b.narrow(0, 333, 444)));
    CHECK(same_bytes(cols.find("a")->local, a.narrow(1, 100, 129)));
  }
}

TEST_CASE("cuda: the ring holds the host memory, whatever the tensor's size" * doctest::skip(cuda_cases_skipped())) {
  require_cuda();
  device_dir tmp;
  single_process comm;
  const state_dict src = dev_sample();
  save_state_dict(tmp.dir(), src, comm);
  checkpoint_reader<file_directory> reader(tmp.dir());
  at::Tensor b = at::empty({1000, 1000}, on_cuda(at::kFloat));
  staged_view<std::byte*> sv;
  sv.view.key = "b";
  sv.view.type = dtype::F32;
  sv.view.full_shape = {1000, 1000};
  sv.view.nbytes = b.nbytes();
  sv.target = static_cast<std::byte*>(b.data_ptr());
  device_copy_engine engine(b.device());
  const staged_load_stats st = load(reader, std::span<const staged_view<std::byte*>>(&sv, 1), engine, dev_small_ring());
  CHECK(st.host_bytes == 3 * (std::uint64_t(1) << 20));
  CHECK(st.fills == 4);  // 4,000,000 bytes in 1 MiB slots
  CHECK(same_bytes(b, src.find("b")->local));
}

TEST_CASE("cuda: a BF16 checkpoint loads into F32 CUDA tensors, converted as torch converts, on the GPU or the host" *
          doctest::skip(cuda_cases_skipped())) {
  require_cuda();
  device_dir tmp;
  single_process comm;
  const state_dict src = dev_sample();
  save_state_dict(tmp.dir(), src, comm);
  for (const bool on_device : {true, false}) {  // converted on the GPU, or on the host in the ring
    state_dict d;
    d.add("a", at::empty({300, 257}, on_cuda(at::kFloat)));
    d.add("a_cols", at::empty({300, 129}, on_cuda(at::kFloat)));
    state_dict cols;
    cols.add("a", d.find("a_cols")->local, block_spec({300, 129}, {0, 100}), {300, 257});
    device_load_options o = dev_small_ring();
    o.convert_dtypes = true;
    o.convert_on_device = on_device;
    state_dict whole;
    whole.add("a", d.find("a")->local);
    const load_stats st = load_state_dict(tmp.dir(), whole, o);
    CHECK(st.tensors == 1);
    load_state_dict(tmp.dir(), cols, o);
    CHECK(same_bytes(d.find("a")->local, src.find("a")->local.to(at::kFloat)));
    CHECK(same_bytes(d.find("a_cols")->local, src.find("a")->local.narrow(1, 100, 129).to(at::kFloat)));
  }
}

TEST_CASE("cuda: a save from CUDA tensors, whole and sharded, loads back bit-exact on the CPU" *
          doctest::skip(cuda_cases_skipped())) {
  require_cuda();
  device_dir tmp;
  single_process comm;
  const state_dict src = dev_sample();
  state_dict on_gpu;
  for (const auto& [k, t] : src) on_gpu.add(k, t.local.cuda());
  // and one held as a flat shard (one rank: all of it)
  const at::Tensor full = at::randn({1000, 1000});
  on_gpu.add("flat", full.flatten().cuda(), flat_spec{{0, 1000000}}, {1000, 1000});
  // shardsafe's layout (bytes fetched block by block while writing, checksums from them) and
  // torch DCP's (a CPU copy first)
  for (const save_format f : {save_format::shardsafe, save_format::dcp}) {
    const std::string sub = f == save_format::dcp ? "dcp" : "st";
    save_options so;
    so.format = f;
    so.write_chunk_bytes = 1 << 20;  // many blocks, checksum blocks straddling them
    save_state_dict(tmp.dir(sub), on_gpu, comm, so);
    state_dict back;
    for (const auto& [k, t] : src) back.add(k, at::empty_like(t.local));
    back.add("flat", at::empty({1000000}), flat_spec{{0, 1000000}}, {1000, 1000});
    load_options lo;
    lo.verify_checksums = true;
    load_state_dict(tmp.dir(sub), back, lo);
    for (const auto& [k, t] : src) CHECK_MESSAGE(same_bytes(back.find(k)->local, t.local), (sub + " " + k));
    CHECK(same_bytes(back.find("flat")->local, full.flatten()));
  }
}

TEST_CASE("cuda: an async save snapshots CUDA tensors; changing them afterwards changes nothing saved" *
          doctest::skip(cuda_cases_skipped())) {
  require_cuda();
  device_dir tmp;
  const state_dict src = dev_sample();
  state_dict on_gpu;
  for (const auto& [k, t] : src) on_gpu.add(k, t.local.cuda());
  async_checkpointer<single_process> ckpt(single_process{});
  async_save_handle h = ckpt.save_state_dict(tmp.dir("step1"), on_gpu);  // returns after the snapshot
  {
    at::NoGradGuard g;
    for (auto& [k, t] : on_gpu) t.local.add_(1);  // the next training step, while the save writes
  }
  const async_save_stats& r = h.wait();
  CHECK(r.staged_bytes == 300 * 257 * 2 + 1000 * 1000 * 4 + 7 * 4);
  state_dict back;
  for (const auto& [k, t] : src) back.add(k, at::empty_like(t.local));
  load_state_dict(tmp.dir("step1"), back, {});
  for (const auto& [k, t] : src) CHECK_MESSAGE(same_bytes(back.find(k)->local, t.local), k);
}

TEST_CASE("cuda: the GPU snippet of docs/USAGE.md" * doctest::skip(cuda_cases_skipped())) {
  require_cuda();
  device_dir tmp;
  const std::filesystem::path dir = tmp.path;
  single_process comm;
  {
    state_dict f32;  // the checkpoint the snippet loads: F32, converted to the BF16 tensor
    f32.add("w", at::randn({4096, 4096}));
    save_state_dict(file_directory(dir / "ckpt"), f32, comm);
  }
  // [usage: gpu]
  state_dict sd;
  sd.add("w", at::empty({4096, 4096}, at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA)));
  device_load_options opt;
  opt.staging.slots = 4;  // the ring: 4 pinned buffers of 64 MiB (the default)
  opt.staging.slot_bytes = std::uint64_t(64) << 20;
  opt.convert_dtypes = true;  // a file in F32 converts on the GPU (convert_on_device)
  load_state_dict(file_directory(dir / "ckpt"), sd, opt);
  save_state_dict(file_directory(dir / "next"), sd, comm);  // device-to-host copies overlap the writes
  // [/usage]
  state_dict back;
  back.add("w", at::empty({4096, 4096}, at::TensorOptions().dtype(at::kBFloat16)));
  load_state_dict(file_directory(dir / "next"), back, {});
  CHECK(same_bytes(back.find("w")->local, sd.find("w")->local));
}

namespace {
/// The tensor the CUDA worlds below shard: F32 [96, 40], element i = i / 4 - 100 (exact in F32).
at::Tensor world_full() { return at::arange(96 * 40, at::kFloat).mul_(0.25).sub_(100).view({96, 40}); }
}  // namespace

// args: folder, "save" or "load". save: rank r of n holds rows [96r/n, 96(r+1)/n) of w on its
// CUDA device and saves them. load: rank r of 3 loads a flat third of w and a column block
// (columns [0, 14), [14, 27), [27, 40)) into CUDA tensors, compared with torch's own slicing.
WORKER_SCENARIO("cuda_world") {
  c10d_world w = init_world_from_env();
  c10d_comm comm = w.comm();
  const std::int64_t r = w.rank, n = w.world_size;
  const at::Tensor full = world_full();
  const file_directory dir(args.at(0));
  if (args.at(1) == "save") {
    const std::int64_t lo = 96 * r / n, hi = 96 * (r + 1) / n;
    state_dict sd;
    sd.add("w", full.narrow(0, lo, hi - lo).cuda(), block_spec{{std::uint64_t(hi - lo), 40}, {std::uint64_t(lo), 0}},
           {96, 40});
    save_state_dict(dir, sd, comm);
    return 0;
  }
  const std::int64_t flo = 3840 * r / n, fhi = 3840 * (r + 1) / n;
  const std::int64_t cols[] = {0, 14, 27, 40};
  const std::int64_t clo = cols[r], chi = cols[r + 1];
  state_dict flat, block;
  flat.add("w", at::full({fhi - flo}, -1.f, on_cuda(at::kFloat)), flat_spec{{std::uint64_t(flo), std::uint64_t(fhi)}},
           {96, 40});
  block.add("w", at::full({96, chi - clo}, -1.f, on_cuda(at::kFloat)),
            block_spec{{96, std::uint64_t(chi - clo)}, {0, std::uint64_t(clo)}}, {96, 40});
  load_state_dict(dir, flat);  // a load is each rank's own: no collective
  load_state_dict(dir, block);
  int bad = 0;
  if (!flat.find("w")->local.is_cuda() ||
      !same_bytes(flat.find("w")->local, full.flatten().narrow(0, flo, fhi - flo))) {
    std::fprintf(stderr, "rank %lld: the flat shard differs\n", static_cast<long long>(r));
    ++bad;
  }
  if (!same_bytes(block.find("w")->local, full.narrow(1, clo, chi - clo))) {
    std::fprintf(stderr, "rank %lld: the column block differs\n", static_cast<long long>(r));
    ++bad;
  }
  return bad;
}

TEST_CASE("cuda: 2 ranks save row blocks from CUDA; 3 ranks load flat and column shards into CUDA, bit-exact" *
          doctest::skip(cuda_cases_skipped())) {
  require_cuda();
  device_dir tmp;
  const std::string ckpt = (tmp.path / "c").string();
  auto saved = testing::run_world("cuda_world", 2, {ckpt, "save"});
  REQUIRE_MESSAGE(saved.ok(), saved.report());
  auto loaded = testing::run_world("cuda_world", 3, {ckpt, "load"});
  CHECK_MESSAGE(loaded.ok(), loaded.report());
}
