// A program that uses the LibTorch parts of an installed shardsafe through the umbrella header
// shardsafe/torch.hpp: it saves a state dict of two tensors as a checkpoint in memory, loads a
// column block of one back in place and checks every value. Built by run.sh with pkg-config
// (shardsafe-torch) and with CMake (shardsafe::torch).
#include "shardsafe/torch.hpp"

#include <cstdio>

int main() {
  using namespace shardsafe;
  single_process comm;
  memory_directory ckpt;  // the checkpoint's files, in memory
  const at::Tensor w = at::arange(48, at::kFloat).reshape({6, 8});
  state_dict sd;
  sd.add("w", w).add("step", at::full({}, 7, at::kLong));
  save_state_dict(ckpt, sd, comm);

  at::Tensor cols = at::zeros({6, 3});  // columns 2..4 of w, as one tensor-parallel shard
  state_dict part;
  part.add("w", cols, block_spec({6, 3}, {0, 2}), {6, 8});
  const load_stats st = load_state_dict(ckpt, part);
  int failures = 0;
  if (!at::equal(cols, w.narrow(1, 2, 3))) {
    std::fprintf(stderr, "torch consumer: FAILED: the loaded columns differ\n");
    ++failures;
  }
  if (st.unexpected_keys != std::vector<std::string>{"step"}) {
    std::fprintf(stderr, "torch consumer: FAILED: 'step' is not reported as not asked for\n");
    ++failures;
  }
  if (failures) return 1;
  std::printf("torch consumer ok (shardsafe %s)\n", SHARDSAFE_VERSION_STRING);
  return 0;
}
