// tools/commands/to_hf.hpp - `shardsafe to-hf SRC OUTDIR`: any checkpoint exported to a Hugging
// Face folder (model.safetensors, or shards and their index), local or s3://, through
// checkpoint/hf/export.hpp; the rename rules' warnings on stderr once it succeeded (docs/FORMAT.md §4).
#pragma once

#include <algorithm>
#include <iostream>
#include <span>
#include <string>
#include <vector>

#include "../input.hpp"
#include "../output.hpp"
#include "../print.hpp"
#include "shardsafe/checkpoint/hf/export.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/format/hf_export.hpp"
#include "shardsafe/storage/file.hpp"

namespace shardsafe::tool {

template <ReadableDirectory D>
int cmd_to_hf(const input<D>& in, const std::string& out_path, hf_export_options opt) {
  if (is_url(out_path)) check_output_url(out_path, "a Hugging Face folder");
  refuse_output_over_input(in, out_path, "a Hugging Face folder");
  // the parts opened once, for the rename warnings' keys and the export (as export_to(dir) takes
  // them: a pair's model/, and its optim/ unless model_only, which also drops the prefixes)
  auto parts = open_checkpoint(in);
  const bool pair = in.k == kind::checkpoint_pair;
  if (pair && std::none_of(parts.begin(), parts.end(),
                           [](const auto& p) { return p.prefix == std::string(model_folder_name) + "/"; }))
    fail(errc::not_found, in.path + ": a model + optimizer checkpoint without model/; nothing to export");
  std::vector<std::string> keys;
  std::vector<unshard_source<D>> sources;
  for (auto& p : parts) {
    const bool model = p.prefix.empty() || p.prefix == std::string(model_folder_name) + "/";
    if (model)
      for (const auto& [k, tm] : p.reader->metadata().tensors) keys.push_back(k);
    if (model || !opt.model_only) sources.push_back({p.reader.get(), pair && !opt.model_only ? p.prefix : ""});
  }
  const std::span<const unshard_source<D>> src(sources);
  const std::string warnings = rename_warnings(keys, opt.rename);
  progress pr("to-hf", 0);
  opt.progress = [&](std::uint64_t done, std::uint64_t total) { pr.set(done, total); };
  hf_export_stats st;
  if (!is_url(out_path)) {
    st = export_to(src, file_directory(out_path), opt);
  } else {
#if SHARDSAFE_TOOL_REMOTE
    st = export_to(src, s3_directory(out_path), opt);  // "must be empty" holds for the prefix: it is listed
#endif
  }
  std::cerr << warnings;
  std::cout << "wrote " << one_line(out_path) << ": " << st.files << " file(s)"
            << (st.indexed ? " and " + std::string(hf_index_file) : "") << ", " << st.tensors << " tensors, "
            << st.bytes << " bytes" << left_out(parts) << "\n";
  return 0;
}

}  // namespace shardsafe::tool
