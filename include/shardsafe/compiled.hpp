// shardsafe/compiled.hpp - the compiled part of a separately compiled shardsafe (core/config.hpp).
//
// A program built with SHARDSAFE_SEPARATE_COMPILATION defined for every translation unit
// compiles, once, a .cpp that holds only
//
//   #include <shardsafe/compiled.hpp>
//
// (with the same flags as the rest), and links it in; the Meson build's shardsafe_compiled
// library is that unit (dependency `shardsafe-compiled`). It holds the definitions of the
// functions the headers only declare in that mode (the impl/*.ipp files listed below), and the
// explicit instantiations of the shared templates (shardsafe/impl/instantiations.hpp), for
// everything in the torch-free umbrella shardsafe/shardsafe.hpp. The
// remote backends have a unit of their own (shardsafe/compiled_remote.hpp); the LibTorch parts
// (shardsafe/torch.hpp) stay header-only.
#pragma once

#if !defined(SHARDSAFE_SEPARATE_COMPILATION)
#error \
    "shardsafe/compiled.hpp is the compiled part of a separately compiled shardsafe: define SHARDSAFE_SEPARATE_COMPILATION for every translation unit of the program (core/config.hpp)"
#endif
#if defined(SHARDSAFE_DECL)
#error "shardsafe/compiled.hpp must be the first shardsafe header of its translation unit"
#endif
#define SHARDSAFE_COMPILING_LIBRARY 1

#include "shardsafe/shardsafe.hpp"

// the bodies of the functions the headers of the umbrella declare SHARDSAFE_DECL, one
// implementation file per header (each in this list or in compiled_remote.hpp's, never both)
#include "shardsafe/checkpoint/hf/impl/experts.ipp"
#include "shardsafe/checkpoint/hf/impl/export.ipp"
#include "shardsafe/checkpoint/hf/impl/import_keys.ipp"
#include "shardsafe/checkpoint/impl/checksums.ipp"
#include "shardsafe/checkpoint/impl/dcp_save.ipp"
#include "shardsafe/checkpoint/impl/description_message.ipp"
#include "shardsafe/checkpoint/impl/description_tree.ipp"
#include "shardsafe/checkpoint/impl/load_plan.ipp"
#include "shardsafe/checkpoint/impl/save_agree.ipp"
#include "shardsafe/detail/impl/json_dom.ipp"
#include "shardsafe/detail/impl/json_error.ipp"
#include "shardsafe/format/impl/dcp_metadata.ipp"
#include "shardsafe/format/impl/dcp_metadata_writer.ipp"
#include "shardsafe/format/impl/dcp_sharding.ipp"
#include "shardsafe/format/impl/hf_export.ipp"
#include "shardsafe/format/impl/hf_index.ipp"
#include "shardsafe/format/impl/metadata.ipp"
#include "shardsafe/format/impl/metadata_writer.ipp"
#include "shardsafe/format/impl/pickle_writer.ipp"
#include "shardsafe/format/impl/rename.ipp"
#include "shardsafe/format/impl/safetensors.ipp"
#include "shardsafe/format/impl/safetensors_writer.ipp"
#include "shardsafe/format/impl/torch_state_dict.ipp"
#include "shardsafe/format/impl/torch_tensor_pickle.ipp"
#include "shardsafe/format/impl/torch_zip_writer.ipp"
#include "shardsafe/shard/impl/mesh.ipp"
#include "shardsafe/shard/impl/read_plan.ipp"
#include "shardsafe/shard/impl/shard_grid.ipp"
#include "shardsafe/storage/impl/aws.ipp"
#include "shardsafe/storage/impl/url.ipp"

// the shared template instantiations, as definitions
#include "shardsafe/impl/instantiations.hpp"
