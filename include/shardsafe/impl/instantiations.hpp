// shardsafe/impl/instantiations.hpp - the shared template instantiations of a separately
// compiled shardsafe (core/config.hpp), in one list: the templates most programs use, for the
// local backends and the single-process and in-process worlds. This is the only header that
// includes concrete backends for them. In the unit of shardsafe/compiled.hpp each line is an
// explicit instantiation definition (`template ...;`); in any other separately compiled unit
// that includes the umbrella shardsafe/shardsafe.hpp, an explicit instantiation declaration
// (`extern template ...;`), so that the unit uses the compiled ones. Header-only, it is empty.
#pragma once

#include "shardsafe/core/config.hpp"

#if defined(SHARDSAFE_SEPARATE_COMPILATION)

#include <cstdint>
#include <span>

#include "shardsafe/checkpoint/checkpoint_reader.hpp"
#include "shardsafe/checkpoint/load.hpp"
#include "shardsafe/checkpoint/reader.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/checkpoint/verify.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/dist/threads.hpp"
#include "shardsafe/shard/copy_plan.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/memory.hpp"
#include "shardsafe/storage/mmap.hpp"

#if defined(SHARDSAFE_COMPILING_LIBRARY)
#define SHARDSAFE_INSTANTIATE(...) template __VA_ARGS__;
#else
#define SHARDSAFE_INSTANTIATE(...) extern template __VA_ARGS__;
#endif

namespace shardsafe {

// the copy plans of the variant spec, which every load plans with
SHARDSAFE_INSTANTIATE(copy_plan compute_copy_plan(const shard_spec&, const shard_spec&, std::span<const std::uint64_t>))
SHARDSAFE_INSTANTIATE(load_plan plan_load(const shard_spec&, std::span<const shard_spec>,
                                          std::span<const std::uint64_t>))

// the files and readers of the local backends
SHARDSAFE_INSTANTIATE(class checkpoint_files<file_directory>)
SHARDSAFE_INSTANTIATE(class checkpoint_files<mmap_directory>)
SHARDSAFE_INSTANTIATE(class checkpoint_files<memory_directory>)
SHARDSAFE_INSTANTIATE(class checkpoint_reader<file_directory>)
SHARDSAFE_INSTANTIATE(class checkpoint_reader<mmap_directory>)
SHARDSAFE_INSTANTIATE(class checkpoint_reader<memory_directory>)

// the per-rank loads through a reader of the local backends
SHARDSAFE_INSTANTIATE(load_stats load(checkpoint_reader<file_directory>&, std::span<const flat_view>,
                                      const load_options&))
SHARDSAFE_INSTANTIATE(load_stats load(checkpoint_reader<mmap_directory>&, std::span<const flat_view>,
                                      const load_options&))
SHARDSAFE_INSTANTIATE(load_stats load(checkpoint_reader<memory_directory>&, std::span<const flat_view>,
                                      const load_options&))

// the verification of local folders
SHARDSAFE_INSTANTIATE(checkpoint_report verify_checkpoint(checkpoint_reader<file_directory>&, const verify_options&))
SHARDSAFE_INSTANTIATE(checkpoint_report verify_checkpoint(checkpoint_reader<memory_directory>&, const verify_options&))

// the saves most programs make (local folders or memory; one process, or ranks as threads)
SHARDSAFE_INSTANTIATE(save_stats save(const file_directory&, std::span<const flat_view>, single_process&,
                                      const save_options&))
SHARDSAFE_INSTANTIATE(save_stats save(const file_directory&, std::span<const flat_view>, thread_comm&,
                                      const save_options&))
SHARDSAFE_INSTANTIATE(save_stats save(const memory_directory&, std::span<const flat_view>, single_process&,
                                      const save_options&))
SHARDSAFE_INSTANTIATE(save_stats save(const memory_directory&, std::span<const flat_view>, thread_comm&,
                                      const save_options&))

}  // namespace shardsafe

#undef SHARDSAFE_INSTANTIATE

#endif  // SHARDSAFE_SEPARATE_COMPILATION
