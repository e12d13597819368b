// shardsafe/torch.hpp - shardsafe for LibTorch in one include: state dicts of at::Tensor,
// torch::nn::Module parameters, optimizer state, model + optimizer checkpoints, and the Comm
// over a c10d::ProcessGroup (with Gloo's world from the environment when USE_C10D_GLOO is
// defined, as the shardsafe-torch dependency, .pc file and CMake target do).
//
// Includes shardsafe/shardsafe.hpp and every public header under torch/. These include
// LibTorch (ATen, torch/nn, torch/optim, c10d): expect seconds per translation unit, and link
// LibTorch (see the README, "Using it from another project"). tests/headers/ checks that each
// header under torch/ is reachable from here and not from shardsafe.hpp.
#pragma once

#include "shardsafe/shardsafe.hpp"

#include "shardsafe/torch/async_checkpointer.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "shardsafe/torch/c10d_comm.hpp"
#include "shardsafe/torch/device_copy.hpp"
#include "shardsafe/torch/hf_state_dict.hpp"
#include "shardsafe/torch/mapped_state.hpp"
#include "shardsafe/torch/model_and_optim.hpp"
#include "shardsafe/torch/module.hpp"
#include "shardsafe/torch/optim.hpp"
#include "shardsafe/torch/state_dict.hpp"
#include "shardsafe/torch/tensor_memory.hpp"
#include "shardsafe/torch/tensor_view.hpp"
#include "shardsafe/torch/train_layouts.hpp"
