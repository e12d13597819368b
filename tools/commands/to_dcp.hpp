// tools/commands/to_dcp.hpp - `shardsafe to-dcp SRC OUTDIR`: any checkpoint exported to a local
// torch.distributed.checkpoint folder (.metadata and __0_0.distcp) through
// checkpoint/dcp_export.hpp; a pair keyed as get_state_dict does (docs/FORMAT.md §4).
#pragma once

#include <iostream>
#include <span>
#include <string>
#include <vector>

#include "../input.hpp"
#include "../output.hpp"
#include "../print.hpp"
#include "shardsafe/checkpoint/dcp_export.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/storage/file.hpp"

namespace shardsafe::tool {

template <ReadableDirectory D>
int cmd_to_dcp(const input<D>& in, const std::string& out_path, const dcp_export_options& opt) {
  if (is_url(out_path))
    fail(errc::invalid_argument, out_path + ": to-dcp writes a local folder (torch's DCP reader reads files)");
  refuse_output_over_input(in, out_path, "a DCP folder");
  auto parts = open_checkpoint(in);  // the export checks every item, and refuses what it cannot write
  std::vector<unshard_source<D>> sources;
  for (auto& p : parts) sources.push_back({p.reader.get(), p.prefix});
  const auto st = export_to(std::span<const unshard_source<D>>(sources), file_directory(out_path), opt);
  std::cout << "wrote " << one_line(out_path) << ": " << st.tensors << " tensors"
            << (st.objects ? " and " + std::to_string(st.objects) + " non-tensor items" : "") << " in "
            << dcp_data_file_name(0) << " (" << st.bytes << " bytes) and " << dcp_metadata_file_name << "\n";
  return 0;
}

}  // namespace shardsafe::tool
