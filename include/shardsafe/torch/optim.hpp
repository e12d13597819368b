// shardsafe/torch/optim.hpp - LibTorch optimizer state as named tensors (docs/FORMAT.md §2, optim/).
//
// Flattened as OLMo-core does, so Python reads what C++ writes and the other way round:
//   num_param_groups           I64 scalar
//   param_group{i}             U8: pickle of the group's hyper-parameters, "params" (ids) and
//                              "_param_names" (the parameters' names, in group order)
//   state_keys                 U8: pickle of the sorted list of state keys
//   state.{name}.__{key}       each per-parameter state tensor, sharded like its parameter
//                              when it has the parameter's shape; "step" is a scalar of its own
//                              per parameter (F32, as PyTorch keeps it; F64 past 2^24)
// Parameters are matched by name, never by position: the optimizer's parameters are named
// by the model's state dict (the tensors are the same objects), so a model built in another
// order or sharded over another world size still gets its own state back.
//
// Supported: Adam, AdamW, SGD (momentum), Adagrad, RMSprop, each described once in
// torch/optim_families.hpp. Before saving, state LibTorch creates lazily on the first step
// (Adam's, AdamW's and RMSprop's zero moments) is created now with the same values, so every
// rank saves the same keys; SGD's momentum buffer is left absent until the first step, since
// LibTorch starts it from the first gradient, not zeros.
//
// This umbrella includes the parts:
//   optim_families.hpp  the five optimizer families, each described once (hyper-parameters, state tensors)
//   optim_flatten.hpp   name_optimizer_params, init_optimizer_state, flatten_optimizer_state (saving)
//   optim_load.hpp      load_optimizer_state (restoring, in place)
//   optim_unshard.hpp   unshard_optim_state (the whole state in one process)
#pragma once

#include "shardsafe/torch/optim_families.hpp"
#include "shardsafe/torch/optim_flatten.hpp"
#include "shardsafe/torch/optim_load.hpp"
#include "shardsafe/torch/optim_unshard.hpp"
