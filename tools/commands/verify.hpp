// tools/commands/verify.hpp - `shardsafe verify PATH`: every rule of the format checked; one line
// "OK PATH: N tensors valid[; notes]", or exit 1 with one line naming file, tensor and rule
// (docs/FORMAT.md §4).
#pragma once

#include <cstdint>
#include <iostream>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "../input.hpp"
#include "../print.hpp"
#include "shardsafe/checkpoint/hf/folder.hpp"
#include "shardsafe/checkpoint/quant.hpp"
#include "shardsafe/checkpoint/verify.hpp"

namespace shardsafe::tool {

/// "; 3 quantized weights (fp8_block), their scales checked", or "" for none.
inline std::string quantized_note(const std::vector<quantized_tensor>& qs) {
  if (qs.empty()) return {};
  std::map<std::string_view, std::size_t> by;
  for (const auto& q : qs) ++by[to_string(q.scheme)];
  std::string schemes;
  for (const auto& [k, n] : by)
    schemes += (schemes.empty() ? "" : ", ") + std::string(k) + (by.size() > 1 ? " " + std::to_string(n) : "");
  return "; " + std::to_string(qs.size()) + " quantized weight" + (qs.size() > 1 ? "s" : "") + " (" + schemes +
         "), their scales checked";
}

/// A checkpoint's parts verified: what was read besides headers (checksums where the layout
/// records them, replicas) in the notes of the OK line.
template <ReadableDirectory D>
int verify_parts(const input<D>& in) {
  std::size_t n = 0;
  std::uint64_t blocks = 0, hashed = 0, replicated = 0;
  std::size_t sharded = 0, unchecked = 0;
  std::vector<quantized_tensor> quantized;
  // the optimizer's pickles (an optim/ part) are checked as every command opens the parts
  for (auto& p : open_checkpoint(in, reads::verified)) {
    const checkpoint_report rep = verify_checkpoint(*p.reader);
    n += rep.tensors;
    quantized.insert(quantized.end(), rep.quantized.begin(), rep.quantized.end());
    replicated += rep.replicated_tensors;
    if (!p.reader->layout().records_checksums) continue;
    ++sharded;
    if (!rep.checksums) ++unchecked;
    blocks += rep.checksum_blocks;
    hashed += rep.bytes_hashed;
  }
  std::string notes;
  if (sharded > 0 && unchecked < sharded)
    notes += "; checksums match (" + std::to_string(blocks) + " blocks, " + std::to_string(hashed) + " bytes)";
  if (unchecked > 0)
    notes += unchecked == sharded ? "; no checksums recorded (tensor data not checked)"
                                  : "; no checksums recorded in " + std::to_string(unchecked) + " of " +
                                        std::to_string(sharded) + " parts (their tensor data not checked)";
  if (replicated > 0)
    notes += "; " + std::to_string(replicated) + " tensors held by several files, identical (replicas)";
  notes += quantized_note(quantized);
  std::cout << "OK " << one_line(in.path) << ": " << n << " tensors valid" << one_line(notes) << "\n";
  return 0;
}

template <ReadableDirectory D>
int cmd_verify(const input<D>& in) {
  std::size_t n = 0;
  std::string notes;
  if (in.k == kind::file) {
    const auto s = open_file(in);
    n = index_file(s).header.tensors.size();
  } else if (in.k == kind::whole_files) {
    const auto h = open_hf(in);
    check_unlisted_hf_files(in.dir, h);
    n = h.tensors.size();
    notes = quantized_note(check_folder_quantized(in, h));  // its quantized weights and their scales
  } else {
    return verify_parts(in);
  }
  std::cout << "OK " << one_line(in.path) << ": " << n << " tensors valid" << one_line(notes) << "\n";
  return 0;
}

}  // namespace shardsafe::tool
