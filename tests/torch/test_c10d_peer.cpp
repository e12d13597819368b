// tests/torch/test_c10d_peer.cpp - c10d_comm as a PeerComm over Gloo (torch/c10d_peer.hpp) and
// over the store transport (torch/c10d_store_peer.hpp, the point to point a device group's comm
// uses too): messages checked byte for byte against the formula they were made from, a save over
// c10d agreed up the tree written byte for byte as the all-gathered one with what each rank
// received counted, and a rank lost in the middle of a tree step named by every other rank
// (over Gloo without any of them waiting for the group's timeout; through the store, which
// cannot see a rank go, every other rank within the timeout), and replicas read once by the
// collective state-dict load and the training resume (model + optimizer) (issue 56).
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "fixtures.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/dist/counted.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "shardsafe/torch/model_and_optim.hpp"
#include "shardsafe/torch/state_dict.hpp"
#include "world.hpp"

using namespace shardsafe;
namespace fs = std::filesystem;

namespace {

/// Message k from rank `from` to rank `to`: its length from a list that crosses the head's
/// boundary (torch/c10d_peer.hpp: 4,088 bytes ride in the head), its bytes from the triple.
std::string peer_message(int from, int to, int k) {
  static const std::size_t sizes[] = {0, 1, 4087, 4088, 4089, 70000, (std::size_t(5) << 20) + 3, 17};
  std::string s(sizes[k % 8], '\0');
  for (std::size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>((i * 131 + from * 17 + to * 5 + k * 3) & 0xff);
  return s;
}
constexpr int peer_messages = 16;

/// Rank r's shard of the save test's model: 120 tensors of [world * 4, 8] F32, rows 4r to 4r + 4
/// each (a block), plus a tensor every rank holds whole; element values from their indices.
struct peer_model {
  std::vector<std::vector<float>> data;
  std::vector<flat_view> views;
  peer_model(int r, int world) {
    for (int t = 0; t <= 120; ++t) {
      const bool whole = t == 120;
      const std::uint64_t rows = whole ? 3 : 4, row0 = whole ? 0 : 4 * static_cast<std::uint64_t>(r);
      data.emplace_back(static_cast<std::size_t>(rows * 8));
      for (std::size_t i = 0; i < data.back().size(); ++i)
        data.back()[i] = static_cast<float>(t * 1000 + static_cast<int>(row0 * 8 + i)) * 0.25f;
      flat_view v;
      v.key = "layer." + std::to_string(t) + ".weight";
      v.full_shape = whole ? shape_t{3, 8} : shape_t{static_cast<std::uint64_t>(world) * 4, 8};
      if (!whole) v.spec = block_spec({4, 8}, {row0, 0});
      v.data = reinterpret_cast<std::byte*>(data.back().data());
      v.nbytes = data.back().size() * 4;
      views.push_back(std::move(v));
    }
  }
};

}  // namespace

// Every rank posts all its messages to every other rank before it receives any (sends return
// without waiting for their receive), then receives each peer's in order.
WORKER_SCENARIO("peer_messages") {
  c10d_world w = init_world_from_env(std::chrono::seconds(60));
  c10d_comm comm = w.comm();
  testing::worker_check(comm.peer_to_peer(), "c10d_comm is not peer to peer");
  testing::worker_check(comm.bulk_peer_to_peer(), "c10d_comm's point to point is not for bulk data");
  const int r = w.rank, n = w.world_size;
  for (int k = 0; k < peer_messages; ++k)
    for (int q = 0; q < n; ++q)
      if (q != r) comm.send_bytes(peer_message(r, q, k), q);
  for (int q = 0; q < n; ++q)
    for (int k = 0; k < peer_messages && q != r; ++k)
      testing::worker_check(comm.recv_bytes(q) == peer_message(q, r, k),
                            "message " + std::to_string(k) + " from rank " + std::to_string(q) + " differs");
  comm.set_peer_to_peer(false);
  testing::worker_check(!comm.peer_to_peer(), "point to point could not be turned off");
  return 0;
}

// args: folder, "tree" or "gather", stats file. Saves the model over c10d (counted), and
// writes what this rank received.
WORKER_SCENARIO("peer_save") {
  c10d_world w = init_world_from_env(std::chrono::seconds(60));
  c10d_comm comm = w.comm();
  comm.set_peer_to_peer(args.at(1) == "tree");
  counted_comm<c10d_comm> counted(comm);
  const peer_model m(w.rank, w.world_size);
  save_options opt;
  opt.metadata = metadata_form::listed;
  save(file_directory(args.at(0)), std::span<const flat_view>(m.views), counted, opt);
  std::ofstream(args.at(2) + "." + std::to_string(w.rank)) << counted.bytes_in << " " << counted.gathers;
  return 0;
}

// args: timeout in ms. Tree steps again and again; rank 3 leaves abruptly (its sockets closed,
// as a kill does) before the fourth. Every other rank prints its error and returns 3.
WORKER_SCENARIO("peer_rank_lost") {
  c10d_world w = init_world_from_env(std::chrono::milliseconds(std::stol(args.at(0))));
  c10d_comm comm = w.comm();
  try {
    for (int i = 0;; ++i) {
      if (i == 3 && w.rank == 3) std::_Exit(0);
      every_rank_step(comm, [] {});
    }
  } catch (const shardsafe::error& e) {
    std::fprintf(stderr, "rank %d: %s\n", w.rank, e.what());
    return e.code() == errc::comm_error ? 3 : 4;
  }
}

// args: folder, stats file. Every rank saves the same 6 whole tensors (rank 0 writes them), then
// loads them into zeroed tensors with replicas read once (one held through a transposed view:
// loaded through a CPU staging tensor, as a device's is, and read once too), checks every value
// against the formula, and writes its stats.
WORKER_SCENARIO("peer_replica_load") {
  c10d_world w = init_world_from_env(std::chrono::seconds(60));
  c10d_comm comm = w.comm();
  auto value = [](int t) { return at::arange(64 * 32, at::kFloat).reshape({64, 32}).mul_(0.5f).add_(t * 1000.0f); };
  state_dict saved, loaded;
  std::vector<at::Tensor> keep;
  for (int t = 0; t < 6; ++t) {
    const std::string key = "w." + std::to_string(t);
    saved.add(key, value(t));
    keep.push_back(t == 5 ? at::zeros({32, 64}).t() : at::zeros({64, 32}));  // 5: not contiguous
    loaded.add(key, keep.back());
  }
  save_state_dict(file_directory(args.at(0)), saved, comm);
  collective_load_options opt;
  opt.replicas = replica_reads::read_once;
  const load_stats st = load_state_dict(file_directory(args.at(0)), loaded, comm, opt);
  for (int t = 0; t < 6; ++t)
    testing::worker_check(keep[static_cast<std::size_t>(t)].equal(value(t)), "w." + std::to_string(t) + " differs");
  testing::worker_check(st.unexpected_keys.empty() && st.missing_keys.empty() && st.tensors >= 6,
                        "the load's keys or count are wrong");
  std::ofstream(args.at(1) + "." + std::to_string(w.rank))
      << st.bytes_read << " " << st.bytes_received << " " << st.replica_group << " " << to_string(st.replicas);
  return 0;
}

namespace {
/// The environment of a world over Gloo (the default) or over the store transport.
std::map<std::string, std::string> transport_env(const std::string& t) {
  if (t == "store") return {{"SHARDSAFE_C10D_TRANSPORT", "store"}};
  return {};
}
}  // namespace

// args: folder, "read_once" or "every_rank_reads", stats file, "shardsafe" or "dcp". A model and
// its Adam state, the same on every rank (one step on the same data), saved as shardsafe's pair or
// one DCP folder (rank 0 writes every tensor), loaded into a fresh model and optimizer by load_model_and_optim_state with the mode
// given; every tensor of both checked equal to the saved ones; the stats written.
WORKER_SCENARIO("peer_train_replica_load") {
  c10d_world w = init_world_from_env(std::chrono::seconds(60));
  c10d_comm comm = w.comm();
  auto make = [] { return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Linear(16, 4)); };
  torch::manual_seed(7);
  auto net = make();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  adam.zero_grad();
  net->forward(at::arange(32, at::kFloat).reshape({4, 8}).div(7)).pow(2).sum().backward();
  adam.step();
  save_options so;
  if (args.at(3) == "dcp") so.format = save_format::dcp;
  save_model_and_optim_state(file_directory(args.at(0)), *net, &adam, comm, so);
  torch::manual_seed(99 + w.rank);
  auto fresh = make();
  torch::optim::Adam adam2(fresh->parameters(), torch::optim::AdamOptions(0.5));
  train_load_options o;
  o.replica.replicas = args.at(1) == "read_once" ? replica_reads::read_once : replica_reads::every_rank_reads;
  const auto st = load_model_and_optim_state(file_directory(args.at(0)), *fresh, &adam2, comm, o);
  const state_dict want = module_state_dict(*net), got = module_state_dict(*fresh);
  const state_dict want_o = flatten_optimizer_state(adam, want), got_o = flatten_optimizer_state(adam2, got);
  for (const auto* pair : {&want, &want_o}) {
    const state_dict& other = pair == &want ? got : got_o;
    testing::worker_check(pair->size() == other.size(), "the loaded state has another number of tensors");
    auto it = other.begin();
    for (const auto& [key, t] : *pair) {
      testing::worker_check(it->first == key && it->second.local.equal(t.local), "'" + key + "' differs");
      ++it;
    }
  }
  testing::worker_check(adam2.param_groups()[0].options().get_lr() == 1e-2, "the learning rate was not restored");
  std::ofstream(args.at(2) + "." + std::to_string(w.rank))
      << st.model.bytes_read << " " << st.optim.stats.bytes_read << " "
      << st.model.bytes_received + st.optim.stats.bytes_received << " " << st.model.replica_group << " "
      << st.optim.stats.replica_group;
  return 0;
}

TEST_CASE(
    "c10d over Gloo or the store is a PeerComm: messages of 0 bytes to 5 MiB between 4 ranks, in order, bit for bit") {
  for (const std::string t : {"gloo", "store"}) {
    CAPTURE(t);
    auto res = testing::run_world("peer_messages", 4, {}, std::chrono::seconds(240), transport_env(t));
    CHECK_MESSAGE(res.ok(), res.report());
  }
}

namespace {
/// The save test over transport t ("gloo" or "store").
void check_tree_save(const std::string& t) {
  CAPTURE(t);
  constexpr int ranks = 6;
  testing::temp_dir dir("c10d-peer-save-" + t);
  std::map<std::string, std::vector<std::uint64_t>> received;
  std::map<std::string, std::vector<std::uint64_t>> gathers;
  for (const std::string mode : {"tree", "gather"}) {
    const fs::path out = dir.path / mode;
    auto res = testing::run_world("peer_save", ranks, {out.string(), mode, (dir.path / ("stats-" + mode)).string()},
                                  std::chrono::seconds(240), transport_env(t));
    REQUIRE_MESSAGE(res.ok(), res.report());
    for (int r = 0; r < ranks; ++r) {
      std::ifstream f(dir.path / ("stats-" + mode + "." + std::to_string(r)));
      std::uint64_t in = 0, g = 0;
      f >> in >> g;
      received[mode].push_back(in);
      gathers[mode].push_back(g);
    }
  }
  // the same files, byte for byte
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path / "gather")) names.push_back(e.path().filename().string());
  CHECK(names.size() == ranks + 1);
  for (const auto& name : names) {
    CAPTURE(name);
    REQUIRE(fs::exists(dir.path / "tree" / name));
    CHECK(testing::slurp(dir.path / "tree" / name) == testing::slurp(dir.path / "gather" / name));
  }
  std::size_t in_tree = 0;
  for (const auto& e : fs::directory_iterator(dir.path / "tree")) in_tree += e.is_regular_file();
  CHECK(in_tree == names.size());
  // over the tree no step all-gathers, and no rank but 0 (which hears the file sizes) receives
  // half of what the all-gather hands each rank (every rank's description of 121 tensors; the
  // share falls as the world grows: tests/checkpoint/test_description_tree.cpp counts it to 256)
  std::uint64_t least_gathered = received["gather"][0];
  for (int r = 0; r < ranks; ++r) least_gathered = std::min(least_gathered, received["gather"][r]);
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(gathers["tree"][r] == 0);
    CHECK(gathers["gather"][r] > 0);
    if (r > 0) CHECK(received["tree"][r] * 2 < least_gathered);
  }
  MESSAGE("bytes received, tree: " << received["tree"][0] << " (rank 0), " << received["tree"][1] << " (rank 1); "
                                   << "all-gather: " << received["gather"][1] << " (rank 1)");
}
}  // namespace

TEST_CASE("a save over c10d agrees up the tree: the bytes the all-gather writes, a fraction of what it receives") {
  check_tree_save("gloo");
  check_tree_save("store");
}

TEST_CASE("a rank lost in the middle of a tree step over c10d: every other rank names it, none waits for the timeout") {
  constexpr int ranks = 6;
  // a group timeout far longer than the abort needs: a rank that waited for it would say so
  auto res = testing::run_world("peer_rank_lost", ranks, {"20000"}, std::chrono::seconds(240));
  REQUIRE(res.status.size() == ranks);
  CHECK(res.status[3] == 0);
  int aborted = 0;
  for (int r = 0; r < ranks; ++r) {
    if (r == 3) continue;
    CAPTURE(r);
    const std::string& err = res.err[r];
    CHECK_MESSAGE(res.status[r] == 3, res.report());
    CHECK_MESSAGE(err.find("c10d ") != std::string::npos, err);
    CHECK_MESSAGE(err.find(" on rank " + std::to_string(r) + " of 6 failed") != std::string::npos, err);
    CHECK_MESSAGE(err.find("rank 3 did not answer the roll call") != std::string::npos, err);
    CHECK_MESSAGE(err.find("imed out") == std::string::npos, err);  // no Gloo or store timeout
    aborted += err.find("the world was aborted: rank ") != std::string::npos;
  }
  // rank 3's parent in the tree (rank 2) sees it go; ranks that wait on others learn it by the abort
  CHECK(aborted >= 3);
  MESSAGE("rank 0: " << res.err[0] << "\nrank 5: " << res.err[5]);
}

TEST_CASE("a rank lost in a tree step through the store: every other rank names it within the timeout") {
  constexpr int ranks = 6;
  // the store cannot see a rank go: rank 3's parent in the tree (rank 2) waits for its message
  // up to the timeout (3 s); the others wait on their parents as long, unless the abort of the
  // first to fail reaches them first; every one's roll call names rank 3
  auto res = testing::run_world("peer_rank_lost", ranks, {"3000"}, std::chrono::seconds(240), transport_env("store"));
  REQUIRE(res.status.size() == ranks);
  CHECK(res.status[3] == 0);
  for (int r = 0; r < ranks; ++r) {
    if (r == 3) continue;
    CAPTURE(r);
    const std::string& err = res.err[r];
    CHECK_MESSAGE(res.status[r] == 3, res.report());
    CHECK_MESSAGE(err.find(" on rank " + std::to_string(r) + " of 6 failed") != std::string::npos, err);
    CHECK_MESSAGE(err.find("rank 3 did not answer the roll call") != std::string::npos, err);
    if (r == 2) CHECK_MESSAGE(err.find("no message from rank 3 within 3000 ms") != std::string::npos, err);
  }
  MESSAGE("rank 0: " << res.err[0] << "\nrank 2: " << res.err[2]);
}

namespace {
/// The training-resume replicas test over a checkpoint saved as `format` ("shardsafe" or "dcp").
void check_train_replicas(const std::string& format) {
  CAPTURE(format);
  constexpr int ranks = 4;
  testing::temp_dir dir("c10d-train-replicas-" + format);
  std::map<std::string, std::array<std::uint64_t, 3>> sums;  // model read, optimizer read, received
  for (const std::string mode : {"every_rank_reads", "read_once"}) {
    const fs::path ckpt = dir.path / mode;
    auto res = testing::run_world("peer_train_replica_load", ranks,
                                  {ckpt.string(), mode, (dir.path / ("st-" + mode)).string(), format},
                                  std::chrono::seconds(240));
    REQUIRE_MESSAGE(res.ok(), res.report());
    for (int r = 0; r < ranks; ++r) {
      std::ifstream f(dir.path / ("st-" + mode + "." + std::to_string(r)));
      std::uint64_t model = 0, optim = 0, received = 0, group_m = 0, group_o = 0;
      f >> model >> optim >> received >> group_m >> group_o;
      auto& s = sums[mode];
      s[0] += model;
      s[1] += optim;
      s[2] += received;
      CHECK(group_m == (mode == "read_once" ? 4u : 1u));
      CHECK(group_o == (mode == "read_once" ? 4u : 1u));
    }
  }
  // every rank reading is 4 x the bytes; once, each byte once, the other 3 copies received
  const auto& every = sums["every_rank_reads"];
  const auto& once = sums["read_once"];
  CHECK(every[0] > 0);
  CHECK(every[1] > 0);
  CHECK(every[2] == 0);
  CHECK(once[0] * ranks == every[0]);
  CHECK(once[1] * ranks == every[1]);
  CHECK(once[2] == (ranks - 1) * (once[0] + once[1]));
}
}  // namespace

TEST_CASE("a model and its optimizer loaded by 4 data-parallel ranks read each byte once with replicas") {
  check_train_replicas("shardsafe");
  check_train_replicas("dcp");
}

TEST_CASE("a LibTorch state dict loaded by 4 data-parallel ranks over c10d reads each byte once between them") {
  constexpr int ranks = 4;
  testing::temp_dir dir("c10d-replica-load");
  auto res = testing::run_world("peer_replica_load", ranks, {(dir.path / "ckpt").string(), (dir.path / "st").string()},
                                std::chrono::seconds(240));
  REQUIRE_MESSAGE(res.ok(), res.report());
  constexpr std::uint64_t tensor = 64 * 32 * 4, shared = 6 * tensor;  // w.5 (staged) too
  std::uint64_t read = 0;
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    std::ifstream f(dir.path / ("st." + std::to_string(r)));
    std::uint64_t bytes_read = 0, received = 0, group = 0;
    std::string mode;
    f >> bytes_read >> received >> group >> mode;
    CHECK(mode == "read_once");
    CHECK(group == ranks);
    // each rank reads its quarter of the 6 tensors and receives the rest
    CHECK(bytes_read == shared / ranks);
    CHECK(received + bytes_read == shared);
    read += bytes_read;
  }
  CHECK(read == shared);  // every rank reading everything would be 4 x 6 tensors
}
