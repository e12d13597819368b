// tools/commands/inspect.hpp - `shardsafe inspect PATH`: the tensors of a file, a folder of whole
// files or a checkpoint, a row each (name, dtype, shape, bytes, where stored, how sharded) under
// a title line that says what PATH is (docs/FORMAT.md §4).
#pragma once

#include <cstdint>
#include <exception>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "../input.hpp"
#include "../print.hpp"
#include "shardsafe/checkpoint/quant.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/format/pickle_value.hpp"

namespace shardsafe::tool {

/// The rows of each quantized weight's tensors (checkpoint/quant.hpp) say so in their last column:
/// the weight with its scheme, logical shape and scale; a scale with its weight and block. What
/// the title adds (", N quantized weights", or why none could be listed).
template <ReadableDirectory D>
std::string annotate_quantized(std::vector<row>& rows, const checkpoint_reader<D>& r, const std::string& prefix,
                               std::size_t first_row) {
  std::vector<quantized_tensor> qs;
  try {
    qs = quantized_tensors(r);
  } catch (const std::exception& e) {
    return "; quantized weights not listed: " + std::string(e.what()) + " (verify refuses it)";
  }
  if (qs.empty()) return {};
  std::map<std::string, std::string> notes;
  for (const auto& q : qs) {
    const std::string block =
        (row_blocked(q.scheme) ? std::to_string(q.block_rows) + " x " : std::string()) + std::to_string(q.block_cols);
    notes[prefix + q.data] = "quantized " + std::string(to_string(q.scheme)) + " weight '" + prefix + q.name + "' " +
                             shape_str(q.shape) + ", scales '" + prefix + q.scale + "' per block of " + block +
                             (q.tensor_scale.empty() ? std::string() : " and '" + prefix + q.tensor_scale + "'");
    notes[prefix + q.scale] =
        std::string(to_string(q.scheme)) + " scales of '" + prefix + q.name + "', one per block of " + block;
    if (!q.tensor_scale.empty())
      notes[prefix + q.tensor_scale] =
          std::string(to_string(q.scheme)) + " per-tensor scale of '" + prefix + q.name + "'";
  }
  for (std::size_t i = first_row; i < rows.size(); ++i)
    if (auto it = notes.find(rows[i].name); it != notes.end())
      rows[i].sharding = rows[i].sharding == "-" ? it->second : rows[i].sharding + "; " + it->second;
  return ", " + std::to_string(qs.size()) + " quantized weight" + (qs.size() > 1 ? "s" : "");
}

/// One file's tensors (and a torch.save file's values that are not tensors), where each starts.
template <ReadableDirectory D>
int inspect_file(const input<D>& in) {
  std::vector<row> rows;
  const auto s = open_file(in);
  const bool torch_save = is_torch_save_file(s);
  const torch_save_index x = index_file(s);
  const safetensors_header& h = x.header;
  std::uint64_t total = 0;
  for (const auto& t : h.tensors) {
    total += t.nbytes();
    const auto order = h.stored_order(t);
    rows.push_back(
        {t.name, std::string(to_string(t.type)), shape_str(t.shape), std::to_string(t.nbytes()),
         "@" + std::to_string(h.offset_of(t)),
         order.empty() ? "-" : "dimensions stored in the order " + shape_str(shape_t(order.begin(), order.end()))});
  }
  for (const auto& v : x.values)
    rows.push_back({v.name, "-", "-", "-", "pickle", "value: " + one_line(torch_value_repr(v.value, 60))});
  for (const auto& u : x.unread)
    rows.push_back({u.name, std::string(to_string(u.type)), shape_str(u.shape), "-", "not read", u.why});
  std::string title =
      "# " + in.path + (torch_save ? ": torch.save file, " : ": safetensors file, ") +
      std::to_string(h.tensors.size()) + " tensors, " + std::to_string(total) + " bytes of data" +
      (x.values.empty() ? std::string() : ", " + std::to_string(x.values.size()) + " value(s) that are not tensors") +
      (x.unread.empty() ? std::string()
                        : ", " + std::to_string(x.unread.size()) + " tensor(s) not read (views that are not dense)") +
      (torch_save ? std::string() : ", header " + std::to_string(h.header_size) + " bytes");
  for (const auto& [k, v] : h.metadata) title += "\n# __metadata__ " + one_line(k) + " = " + one_line(v);
  print_rows(title, std::move(rows));  // moved, not copied: a million rows are held once
  return 0;
}

/// A folder of whole files (a Hugging Face folder): each tensor and the file that holds it.
template <ReadableDirectory D>
int inspect_whole_files(const input<D>& in) {
  std::vector<row> rows;
  const auto h = open_hf(in);
  for (const auto& [n, at] : h.tensors) {
    const tensor_entry& t = h.entry(at);
    rows.push_back({n, std::string(to_string(t.type)), shape_str(t.shape), std::to_string(t.nbytes()),
                    h.files[at.file].name, "-"});
  }
  std::string quantized;
  try {
    const checkpoint_reader<D> r(in.dir);
    quantized = annotate_quantized(rows, r, "", 0);
  } catch (const std::exception& e) {
    quantized = "; quantized weights not listed: " + std::string(e.what());
  }
  print_rows("# " + in.path + ": Hugging Face " + (h.sharded() ? "sharded checkpoint, " : "checkpoint, ") +
                 (h.torch_bin ? "torch.save files (" + h.described_by + "), " : std::string()) +
                 std::to_string(h.files.size()) + " file(s), " + std::to_string(h.tensors.size()) + " tensors, " +
                 std::to_string(h.tensor_bytes()) + " bytes" + quantized,
             std::move(rows));
  return 0;
}

template <ReadableDirectory D>
int cmd_inspect(const input<D>& in) {
  if (in.k == kind::file) return inspect_file(in);
  if (in.k == kind::whole_files) return inspect_whole_files(in);
  std::vector<row> rows;
  auto parts = open_checkpoint(in, reads::headers);  // lists what verify would refuse, reading no tensor data
  std::uint64_t total = 0;
  std::string writer;
  const std::string what(parts.front().reader->layout().name);
  std::string quantized;
  for (auto& p : parts) {
    const std::size_t first_row = rows.size();
    const auto& md = p.reader->metadata();
    if (!md.extras.writer.empty()) writer = md.extras.writer;
    for (const auto& [key, tm] : md.tensors) {
      const std::uint64_t bytes = tm.numel() * bit_size(tm.type) / 8;
      total += bytes;
      const stored_files files = files_of(tm, *p.reader, 4);
      std::string stored;
      for (std::size_t i = 0; i < files.first.size(); ++i) stored += (i ? "," : "") + files.first[i];
      if (files.count > 4) stored += ",...";
      rows.push_back({p.prefix + key, std::string(to_string(tm.type)), shape_str(tm.shape), std::to_string(bytes),
                      stored, describe_sharding(tm, files.count)});
    }
    quantized += annotate_quantized(rows, *p.reader, p.prefix, first_row);
  }
  const std::size_t tensors = rows.size();
  for (auto& p : parts)
    for (const auto& t : p.reader->foreign_tensors())
      rows.push_back({p.prefix + t.key, t.dtype, shape_str(t.shape), "-", p.reader->described_by(),
                      t.why.empty()
                          ? std::to_string(t.chunks) + " chunk(s); a dtype shardsafe has no type for (not read)"
                          : t.why});
  const std::size_t foreign = rows.size() - tensors;
  for (auto& p : parts)
    for (const auto& item : p.reader->non_tensors())
      rows.push_back(
          {p.prefix + item.key, "-", "-", std::to_string(item.bytes), item.file, "non-tensor item (not loaded)"});
  const std::size_t others = rows.size() - tensors - foreign;
  print_rows("# " + in.path + ": " + what + ", " + std::to_string(tensors) + " tensors, " + std::to_string(total) +
                 " bytes" +
                 (foreign ? ", " + std::to_string(foreign) + " tensor(s) of a dtype shardsafe has no type for" : "") +
                 (others ? ", " + std::to_string(others) + " non-tensor item" + (others > 1 ? "s" : "") : "") +
                 (writer.empty() ? "" : ", written by " + writer) + quantized,
             std::move(rows));
  return 0;
}

}  // namespace shardsafe::tool
