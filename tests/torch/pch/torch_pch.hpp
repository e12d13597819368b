// Precompiled header of the torch tests: the expensive LibTorch headers, parsed once.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#include <simdjson.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/rmsprop.h>
#include <torch/nn/module.h>
#include <doctest/doctest.h>
