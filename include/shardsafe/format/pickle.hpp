// shardsafe/format/pickle.hpp - the plain-data subset of Python's pickle, both ways.
//
// OLMo-core stores each optimizer param group (hyper-parameters and parameter names) and the
// list of state keys as pickled bytes in U8 tensors. To share optimizer checkpoints with
// Python, shardsafe writes such pickles (protocol 2, which every Python 3 reads) and reads
// the ones Python writes (protocols 2 to 5). Only plain data is accepted: None, bool, int
// (64-bit), float, str, list, tuple and dict. Every opcode that could name a class or call a
// function (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ, ...) is refused by name,
// so reading untrusted bytes runs no code; sizes, nesting and memo references are bounded.
//
// This umbrella includes the three parts:
//   pickle_value.hpp   the value (a std::variant of the eight Python types)
//   pickle_repr.hpp    pickle_repr: a value as Python's repr() writes it
//   pickle_writer.hpp  pickle_dumps (protocol 2)
//   pickle_reader.hpp  pickle_loads, basic_pickle_reader and its opcode policy hook
#pragma once

#include "shardsafe/format/pickle_reader.hpp"
#include "shardsafe/format/pickle_repr.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/format/pickle_writer.hpp"
