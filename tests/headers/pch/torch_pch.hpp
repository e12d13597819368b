// Precompiled header of the torch headers' checks: LibTorch's own headers, parsed once instead
// of once per shardsafe/torch header (16 translation units of 15-27 s each on 2 cores; CI's
// budget). What this check still catches in a torch header: a missing include of shardsafe's
// own headers, or of the standard library beyond what LibTorch brings (which every torch
// header includes first anyway). What it no longer catches: a torch header that uses a part of
// LibTorch listed here without including it.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
