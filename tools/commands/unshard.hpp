// tools/commands/unshard.hpp - `shardsafe unshard CKPT OUT`: the full tensors of a checkpoint (or
// of a pair's model/ and optim/, prefixed) in one safetensors file, local or s3:// (docs/FORMAT.md §4).
#pragma once

#include <cstdint>
#include <iostream>
#include <span>
#include <string>
#include <vector>

#include "../input.hpp"
#include "../output.hpp"
#include "../print.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/storage/file.hpp"

namespace shardsafe::tool {

template <ReadableDirectory D>
int cmd_unshard(const input<D>& in, const std::string& out_path) {
  if (in.k == kind::file)
    fail(errc::invalid_argument, in.path + ": unshard needs a folder (a checkpoint or a Hugging Face folder)");
  if (is_url(out_path)) check_output_url(out_path, "the unsharded file");
  refuse_output_over_input(in, out_path, "the unsharded file");
  auto parts = open_checkpoint(in);
  std::vector<unshard_source<D>> sources;
  for (auto& p : parts) sources.push_back({p.reader.get(), p.prefix});
  const std::span<const unshard_source<D>> all(sources);
  std::uint64_t size = 0;
  if (!is_url(out_path)) {
    file_writer w(out_path);
    size = unshard_to_safetensors(all, w);
  } else {
#if SHARDSAFE_TOOL_REMOTE
    const auto [folder, name] = split_url(out_path);
    auto w = s3_directory(folder).create(name);  // one PUT, or a multipart upload aborted on failure
    size = unshard_to_safetensors(all, w);
#endif
  }
  std::cout << "wrote " << one_line(out_path) << ": " << size << " bytes" << left_out(parts) << "\n";
  return 0;
}

}  // namespace shardsafe::tool
