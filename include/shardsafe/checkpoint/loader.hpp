// shardsafe/checkpoint/loader.hpp - loading a checkpoint: checkpoint_reader (the reader that
// plans and executes loads, checkpoint/checkpoint_reader.hpp) and the loads of flat views on it,
// per rank and collective (checkpoint/load.hpp).
#pragma once

#include "shardsafe/checkpoint/checkpoint_reader.hpp"
#include "shardsafe/checkpoint/load.hpp"
