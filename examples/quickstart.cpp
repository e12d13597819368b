// quickstart - the README's code sample. Save a state dict as a sharded checkpoint, load a
// differently sharded piece of it in place, and stream LibTorch tensors through a plain
// safetensors file. One include for all of it: shardsafe/torch.hpp (the LibTorch parts and,
// through shardsafe/shardsafe.hpp, the rest of the library).
#include "shardsafe/torch.hpp"

#include <cstdio>
#include <filesystem>
#include <string_view>

using namespace shardsafe;

int main(int argc, char** argv) {
  if (argc > 1 && (std::string_view(argv[1]) == "--help" || std::string_view(argv[1]) == "-h")) {
    std::printf(
        "quickstart: saves a small state dict, loads a column shard of it, writes and reads a\n"
        "plain safetensors file, in %s/shardsafe-quickstart. No options.\n",
        std::filesystem::temp_directory_path().c_str());
    return 0;
  }
  if (argc > 1) {
    std::fprintf(stderr, "quickstart: takes no arguments (--help says what it does)\n");
    return 2;
  }
  const auto dir = std::filesystem::temp_directory_path() / "shardsafe-quickstart";
  std::filesystem::remove_all(dir);

  // 1. Save. One process here (single_process); in a job, c10d_comm from init_world_from_env()
  //    and each rank adds only its shard: sd.add("w", my_rows, block_spec({4, 16}, {4 * rank, 0}), {8, 16}).
  single_process comm;
  at::Tensor w = at::arange(128, at::kFloat).reshape({8, 16});
  state_dict sd;
  sd.add("w", w).add("b", at::ones({16}));
  save_state_dict(file_directory(dir / "ckpt"), sd, comm);

  // 2. Load columns 4-11 of "w" (a tensor-parallel shard) straight into a tensor: only those
  //    bytes are read, and nothing else is allocated.
  at::Tensor cols = at::empty({8, 8});
  state_dict part;
  part.add("w", cols, block_spec({8, 8}, {0, 4}), {8, 16});
  load_options opt;
  opt.strict = true;  // every tensor asked for must be in the checkpoint
  load_stats st = load_state_dict(file_directory(dir / "ckpt"), part, opt);
  std::printf("read %llu bytes; columns equal: %d; not asked for: %s\n", (unsigned long long)st.bytes_read,
              (int)at::equal(cols, w.narrow(1, 4, 8)), st.unexpected_keys.at(0).c_str());

  // 3. A plain safetensors file, streamed from tensor memory; one tensor read back in place.
  at::Tensor a = at::randn({3, 5});
  std::vector<tensor_data> ts{{"a", dtype::F32, {3, 5}, {static_cast<const std::byte*>(a.data_ptr()), a.nbytes()}}};
  file_writer out(dir / "plain.safetensors");  // written under a temporary name, renamed on commit
  write_safetensors(out, std::span<const tensor_data>(ts), {{"format", "pt"}});
  file_storage in(dir / "plain.safetensors");
  safetensors_header h = read_safetensors_header(in);  // validated: every rule of the format
  at::Tensor back = at::empty({3, 5});
  read_tensor(in, h, h.at("a"), {static_cast<std::byte*>(back.data_ptr()), back.nbytes()});

  const bool ok = at::equal(cols, w.narrow(1, 4, 8)) && at::equal(a, back);
  std::filesystem::remove_all(dir);
  return ok ? 0 : 1;
}
