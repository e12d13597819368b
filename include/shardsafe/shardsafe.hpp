// shardsafe/shardsafe.hpp - the whole torch-free library in one include: formats, shard
// arithmetic, storage backends, communication, and sharded checkpoints of raw memory.
//
// Every public header outside torch/ and detail/ is included here, and nothing that includes
// LibTorch: this compiles in seconds. For LibTorch tensors, modules, optimizers and c10d,
// include shardsafe/torch.hpp instead (it includes this one). tests/headers/ checks that each
// public header is reachable from the right umbrella, so a new header must be added here.
#pragma once

#include "shardsafe/version.hpp"

// vocabulary
#include "shardsafe/core/byte_range.hpp"
#include "shardsafe/core/convert.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"

// file formats (docs/FORMAT.md)
#include "shardsafe/format/checkpoint_metadata.hpp"
#include "shardsafe/format/dcp_data.hpp"
#include "shardsafe/format/dcp_metadata.hpp"
#include "shardsafe/format/dcp_metadata_writer.hpp"
#include "shardsafe/format/dcp_writer.hpp"
#include "shardsafe/format/dcp_sharding.hpp"
#include "shardsafe/format/dcp_unpickler.hpp"
#include "shardsafe/format/hf_export.hpp"
#include "shardsafe/format/hf_index.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/metadata_parts.hpp"
#include "shardsafe/format/metadata_writer.hpp"
#include "shardsafe/format/pickle.hpp"
#include "shardsafe/format/pickle_extent.hpp"
#include "shardsafe/format/pickle_machine.hpp"
#include "shardsafe/format/pickle_view.hpp"
#include "shardsafe/format/rename.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/format/safetensors_writer.hpp"
#include "shardsafe/format/torch_save.hpp"
#include "shardsafe/format/torch_save_legacy.hpp"
#include "shardsafe/format/torch_state_dict.hpp"
#include "shardsafe/format/torch_tensor_pickle.hpp"
#include "shardsafe/format/torch_zip.hpp"
#include "shardsafe/format/torch_zip_writer.hpp"
#include "shardsafe/format/zip_directory.hpp"

// shard arithmetic: specs, overlaps, copy plans, read plans
#include "shardsafe/shard/copy_plan.hpp"
#include "shardsafe/shard/coverage.hpp"
#include "shardsafe/shard/flat_blocks.hpp"
#include "shardsafe/shard/merged_ranges.hpp"
#include "shardsafe/shard/mesh.hpp"
#include "shardsafe/shard/overlap.hpp"
#include "shardsafe/shard/read_plan.hpp"
#include "shardsafe/shard/shard_spec.hpp"

// storage: the concepts and the backends
#include "shardsafe/storage/aws.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/memory.hpp"
#include "shardsafe/storage/mmap.hpp"
#include "shardsafe/storage/text.hpp"
#include "shardsafe/storage/url.hpp"

// who talks to whom
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/dist/counted.hpp"
#include "shardsafe/dist/message.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/dist/threads.hpp"

// sharded checkpoints of flat views
#include "shardsafe/checkpoint/async_save.hpp"
#include "shardsafe/checkpoint/checkpoint_reader.hpp"
#include "shardsafe/checkpoint/checksums.hpp"
#include "shardsafe/checkpoint/configured.hpp"
#include "shardsafe/checkpoint/dcp_export.hpp"
#include "shardsafe/checkpoint/dcp_save.hpp"
#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/hf/experts.hpp"
#include "shardsafe/checkpoint/hf/export.hpp"
#include "shardsafe/checkpoint/hf/export_views.hpp"
#include "shardsafe/checkpoint/hf/folder.hpp"
#include "shardsafe/checkpoint/hf/import.hpp"
#include "shardsafe/checkpoint/hf/import_keys.hpp"
#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/checkpoint/layouts/dcp.hpp"
#include "shardsafe/checkpoint/layouts/dcp_write.hpp"
#include "shardsafe/checkpoint/layouts/dcp_sharded_hf.hpp"
#include "shardsafe/checkpoint/layouts/hf.hpp"
#include "shardsafe/checkpoint/layouts/layout.hpp"
#include "shardsafe/checkpoint/layouts/registry.hpp"
#include "shardsafe/checkpoint/layouts/shardsafe.hpp"
#include "shardsafe/checkpoint/layouts/shardsafe_write.hpp"
#include "shardsafe/checkpoint/layouts/single_file.hpp"
#include "shardsafe/checkpoint/layouts/writers.hpp"
#include "shardsafe/checkpoint/load.hpp"
#include "shardsafe/checkpoint/load_options.hpp"
#include "shardsafe/checkpoint/load_plan.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/read_executor.hpp"
#include "shardsafe/checkpoint/replica_reads.hpp"
#include "shardsafe/checkpoint/reader.hpp"
#include "shardsafe/checkpoint/rotation.hpp"
#include "shardsafe/checkpoint/save_agree.hpp"
#include "shardsafe/checkpoint/save_options.hpp"
#include "shardsafe/checkpoint/save_write.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/checkpoint/source.hpp"
#include "shardsafe/checkpoint/staged_load.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/checkpoint/verify.hpp"
#include "shardsafe/checkpoint/verify_optim.hpp"
#include "shardsafe/checkpoint/view_pieces.hpp"

// separately compiled (core/config.hpp): the shared template instantiations, declared here so
// that a unit of the umbrella uses the ones compiled once in shardsafe/compiled.hpp's unit
#if defined(SHARDSAFE_SEPARATE_COMPILATION) && !defined(SHARDSAFE_COMPILING_LIBRARY)
#include "shardsafe/impl/instantiations.hpp"
#endif
