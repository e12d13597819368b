// quickstart - the README's code sample: save a sharded state dict, load it into tensors
// sharded another way, in place; write LibTorch tensors to a safetensors file and read one
// back straight into a tensor's memory.
#include <ATen/ATen.h>

#include <cstdio>
#include <filesystem>

#include "shardsafe/dist/single.hpp"
#include "shardsafe/format/safetensors_writer.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/state_dict.hpp"

using namespace shardsafe;

int main() {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "shardsafe-quickstart";
  std::filesystem::remove_all(dir);
  single_process comm;  // or c10d_comm from init_world_from_env() in a multi-process job

  // This "rank" holds rows 0-3 of an [8, 16] weight (a tensor-parallel block) and the whole bias.
  at::Tensor w = at::arange(128, at::kFloat).reshape({8, 16});
  state_dict sd;
  sd.add("w", w.narrow(0, 0, 4).contiguous(), block_spec({4, 16}, {0, 0}), {8, 16});
  sd.add("w_rest", w.narrow(0, 4, 4).contiguous());  // just another tensor
  sd.add("b", at::ones({16}));
  // A one-process world must hold all of every sharded tensor, so save the rest of "w" too:
  sd.find("w")->spec = block_spec({8, 16}, {0, 0});
  sd.find("w")->local = w;
  save_state_dict(file_directory(dir / "ckpt"), sd, comm);

  // Load columns 4-11 of "w" (another sharding) into a tensor, in place.
  at::Tensor cols = at::empty({8, 8});
  state_dict want;
  want.add("w", cols, block_spec({8, 8}, {0, 4}), {8, 16});
  load_options opt;
  opt.strict = true;
  auto stats = load_state_dict(file_directory(dir / "ckpt"), want, opt);
  std::printf("loaded %llu tensor(s), %llu bytes; cols equal: %s; not asked for: %zu\n",
              static_cast<unsigned long long>(stats.tensors), static_cast<unsigned long long>(stats.bytes_needed),
              at::equal(cols, w.narrow(1, 4, 8)) ? "yes" : "no", stats.unexpected_keys.size());

  // A plain safetensors file, streamed from tensor memory, and a tensor read back in place.
  at::Tensor a = at::randn({3, 5}), c = at::arange(6, at::kLong);
  std::vector<tensor_data> ts{{"a", dtype::F32, {3, 5}, std::as_bytes(std::span(a.data_ptr<float>(), 15))},
                              {"c", dtype::I64, {6}, std::as_bytes(std::span(c.data_ptr<std::int64_t>(), 6))}};
  {
    file_writer out(dir / "plain.safetensors");
    write_safetensors(out, std::span<const tensor_data>(ts), {{"format", "pt"}});
  }
  file_storage in(dir / "plain.safetensors");
  safetensors_header h = read_safetensors_header(in);
  at::Tensor back = at::empty({3, 5});
  read_tensor(in, h, h.at("a"), {static_cast<std::byte*>(back.data_ptr()), back.nbytes()});
  std::printf("plain file: %zu tensors, a equal: %s\n", h.tensors.size(), at::equal(a, back) ? "yes" : "no");
  const bool ok = at::equal(cols, w.narrow(1, 4, 8)) && at::equal(a, back);
  std::filesystem::remove_all(dir);
  return ok ? 0 : 1;
}
