// shardsafe/format/torch_state_dict.hpp - a torch.save state dict's pickle (data.pkl, or the
// legacy format's value pickle) made into the tensors and values it holds: read through the
// torch.save allowlist (format/torch_tensor_pickle.hpp's torch_tensor_pickle_policy with
// state_dict), flattened to names as torch.distributed.checkpoint flattens them
// (flatten_torch_state_dict, parse_torch_state_dict_pickle), and each tensor placed in its
// storage's record (index_state_dict_tensors, torch_save_index). The rules are at the top of
// format/torch_save.hpp, which reads whole files (zip and legacy) with these.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/format/pickle_reader.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/format/torch_zip.hpp"

namespace shardsafe {

/// The largest data.pkl of a state dict read (torch pickles a tensor in about 150 bytes: a
/// million tensors fit).
inline constexpr std::uint64_t max_torch_save_pickle = std::uint64_t(64) << 20;

/// What a torch.save file's state dict holds at most, flattened (a tensor or value the memo puts
/// at two places counts twice): its tensors and values, a tensor counting as 4 values (so at
/// most max_torch_save_tensors tensors); their names' bytes; the ints, floats, strs and
/// containers (keys among them) its values hold together, counted as a tree (a container the
/// memo shares, at each place); and the values the reader of its pickle makes in all (a tensor
/// as torch pickles it takes about 25). Files at these limits are read within the tool's 256
/// MiB (docs/FORMAT.md §3: a tensor costs a command up to about 2.8 KiB, a value 0.7 KiB, a
/// name's byte about 14 bytes).
inline constexpr std::size_t max_torch_save_items = std::size_t(1) << 18;
inline constexpr std::size_t max_torch_save_tensors = max_torch_save_items / 4;
inline constexpr std::uint64_t max_torch_save_name_bytes = std::uint64_t(4) << 20;
inline constexpr std::uint64_t max_torch_save_value_contents = std::uint64_t(1) << 19;
inline constexpr std::size_t max_torch_save_pickle_made = std::size_t(1) << 21;

/// A value of a torch.save file that is not a tensor (an epoch counter, an optimizer's
/// hyper-parameters), as torch.distributed.checkpoint would keep it: one value per item.
struct torch_save_value {
  std::string name;    ///< its flattened name
  pickle_value value;  ///< what the pickle holds (a torch global as {"__global__": NAME}, a storage as a sealed dict)
  /// Why it is not pickled again here, or "" when it is (plain data: None, bool, int, float,
  /// str, lists, tuples, dicts): it holds a storage or a torch global (a dtype), or shares
  /// containers that would pickle to over max_torch_save_pickle bytes written out without a memo.
  std::string unwritable;
};

/// How a torch.save file's pickle is read past the torch.save allowlist, where a layout asks
/// (checkpoint/layouts/deepspeed.hpp): the classes it reads as opaque records (nullptr: none, the
/// allowlist alone), and whether the pickle's value itself is kept (its order: a trainer's lists
/// of parameter shapes), its tensors as the allowlist's sealed dicts.
struct torch_save_read_options {
  const pickle_record_classes* records = nullptr;
  bool keep_value = false;
};

/// What a torch.save state dict's data.pkl holds: its tensors by flattened name, in pickle
/// order, and its other values.
struct torch_state_dict_pickle {
  std::vector<std::pair<std::string, torch_zip_tensor>> tensors;
  std::map<std::string, torch_storage_id, std::less<>> storages;  ///< every storage its persistent ids name, by key
  std::vector<torch_save_value> values;                           ///< the values that are not tensors, in pickle order
  /// Where each tensor and value sits in the nested dict (("model", "layers.0.weight"): dict keys
  /// as str, list indices as int), for those whose path is not just (name,).
  std::map<std::string, pickle_value> paths;
  std::optional<pickle_value> value;  ///< the whole value, when torch_save_read_options::keep_value
};

namespace detail {

/// The state dict a torch.save pickle's value `root` holds, flattened (rules at the top of
/// format/torch_save.hpp); `pickle_bytes` is the pickle's size (what bounds the values and
/// names), `w` names it.
SHARDSAFE_DECL torch_state_dict_pickle flatten_torch_state_dict(pickle_view root, std::size_t pickle_bytes,
                                                                const std::string& w);

/// The reader of a state dict's pickle: the values it may make are bounded by its size; every
/// storage it names is recorded in `storages` (torch_tensor_pickle_policy::storages).
inline basic_pickle_reader<torch_tensor_pickle_policy> state_dict_pickle_reader(
    std::string_view bytes, const std::string& w, bool legacy,
    std::map<std::string, torch_storage_id, std::less<>>& storages, const pickle_record_classes* records = nullptr) {
  using reader = basic_pickle_reader<torch_tensor_pickle_policy>;
  return reader(bytes, w, torch_tensor_pickle_policy{true, legacy, &storages, records},
                std::max<std::size_t>(reader::default_max_values, bytes.size()), max_torch_save_pickle_made);
}

}  // namespace detail

/// Reads a torch.save data.pkl holding a state dict (rules at the top of format/torch_save.hpp);
/// `what` names it.
inline torch_state_dict_pickle parse_torch_state_dict_pickle(std::string_view bytes, std::string_view what,
                                                             const torch_save_read_options& o = {}) {
  const std::string w(what);
  std::map<std::string, torch_storage_id, std::less<>> storages;
  auto reader = detail::state_dict_pickle_reader(bytes, w, false, storages, o.records);
  torch_state_dict_pickle out = reader.run([&](pickle_view root) {
    torch_state_dict_pickle sd = detail::flatten_torch_state_dict(root, bytes.size(), w);
    if (o.keep_value) sd.value = root.build();
    return sd;
  });
  out.storages = std::move(storages);
  return out;
}

/// A tensor of a torch.save file that is not read (torch.load reads it): a view whose elements do
/// not fill consecutive elements of its storage (a column slice of a fused weight).
struct torch_save_unread_tensor {
  std::string name;
  dtype type = dtype::U8;
  shape_t shape;
  std::string why;  ///< "is not read: stride [12, 1] is not dense for size [6, 4] ..."
};

/// The index of a torch.save file of a state dict and its values that are not tensors.
struct torch_save_index {
  safetensors_header header;                     ///< every tensor read, at its absolute offset in the file (of_records)
  std::vector<torch_save_value> values;          ///< the values that are not tensors, by name
  std::map<std::string, pickle_value> paths;     ///< torch_state_dict_pickle::paths
  std::vector<torch_save_unread_tensor> unread;  ///< tensors torch.load reads and shardsafe does not, by name
  std::optional<pickle_value> value;             ///< the pickle's value, when torch_save_read_options::keep_value
};

namespace detail {

/// The index of a state dict's tensors, each over the storage record storage_of(key, tbad)
/// gives (tbad throws naming the tensor): the rules of a tensor inside its storage.
template <class StorageOf>
torch_save_index index_state_dict_tensors(const std::string& file, std::uint64_t file_size, torch_state_dict_pickle sd,
                                          StorageOf&& storage_of) {
  std::vector<tensor_entry> entries;
  std::vector<torch_save_unread_tensor> unread;
  std::map<std::string, std::vector<std::size_t>, std::less<>> orders;
  entries.reserve(sd.tensors.size());
  for (auto& [key, t] : sd.tensors) {
    const std::string ctx = "tensor '" + key + "'";
    auto tbad = [&](const std::string& rule) { fail(errc::invalid_metadata, file + ": " + ctx + ": " + rule); };
    const torch_zip_record& rec = storage_of(t.storage_key, tbad);
    if (!t.type && !t.view_type) tbad("an untyped storage without a dtype");
    const dtype type = t.view_type ? *t.view_type : *t.type;
    const std::uint64_t item = item_size(type);
    const auto storage_bytes = detail::checked_mul(t.storage_numel, t.type ? item_size(*t.type) : 1);
    if (!storage_bytes || *storage_bytes != rec.size)
      tbad("storage of " + std::to_string(t.storage_numel) + " elements is not the " + std::to_string(rec.size) +
           " bytes of '" + rec.name + "'");
    const auto n = detail::checked_numel(t.size);
    if (!n) tbad("size " + to_string(t.size) + " overflows");
    if (t.stride.size() != t.size.size())
      tbad("stride " + to_string(t.stride) + " has another rank than size " + to_string(t.size));
    struct not_dense {
      std::string rule;
    };
    std::vector<std::size_t> order;
    try {
      order = dense_stored_order(t, *n, [](const std::string& rule) -> void { throw not_dense{rule}; });
    } catch (const not_dense& nd) {
      // torch.load views its storage so (as_strided) when every element lies inside it: that one
      // tensor is not read here, the others are; past the storage's end, torch refuses the file
      std::optional<std::uint64_t> last = t.storage_offset;
      for (std::size_t d = 0; d < t.size.size() && last; ++d)
        if (const auto step = detail::checked_mul(t.size[d] - 1, t.stride[d]))
          last = detail::checked_add(*last, *step);
        else
          last = std::nullopt;
      if (*n != 0 && (!last || *last >= t.storage_numel))
        tbad("elements up to [" + (last ? std::to_string(*last) : std::string("2^64")) + "] (storage offset " +
             std::to_string(t.storage_offset) + ", size " + to_string(t.size) + ", stride " + to_string(t.stride) +
             ") pass the end of its storage '" + rec.name + "' (" + std::to_string(t.storage_numel) + " elements)");
      unread.push_back({key, type, t.size,
                        "is not read: " + nd.rule +
                            "; torch.load reads such a view, shardsafe reads the file's other tensors only"});
      continue;
    }
    const auto at = detail::checked_mul(t.storage_offset, item);
    const auto bytes = detail::checked_mul(*n, item);
    const auto end = at && bytes ? detail::checked_add(*at, *bytes) : std::nullopt;
    if (!end || (*n != 0 && *end > rec.size))
      tbad("elements [" + std::to_string(t.storage_offset) + ", +" + std::to_string(*n) + ") of " +
           std::string(to_string(type)) + " pass the end of its storage '" + rec.name + "' (" +
           std::to_string(rec.size) + " bytes)");
    tensor_entry e;
    e.name = key;
    e.type = type;
    e.shape = t.size;
    e.begin = rec.data_offset + (*n == 0 ? 0 : *at);
    e.end = e.begin + *bytes;
    if (!order.empty()) orders.emplace(key, std::move(order));
    entries.push_back(std::move(e));
  }
  torch_save_index x{safetensors_header::of_records(file, file_size, std::move(entries), std::move(orders)),
                     std::move(sd.values), std::move(sd.paths), std::move(unread), std::move(sd.value)};
  std::sort(x.unread.begin(), x.unread.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (std::size_t i = 0; i < x.unread.size(); ++i)
    if ((i > 0 && x.unread[i - 1].name == x.unread[i].name) || x.header.find(x.unread[i].name))
      fail(errc::invalid_metadata, file + ": the flattened name '" + x.unread[i].name + "' is given twice");
  // a value's name is no tensor's or other value's either (torch.distributed.checkpoint refuses
  // such a dict: "duplicated flatten key")
  std::sort(x.values.begin(), x.values.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  std::vector<std::string_view> unread_names;
  for (const auto& u : x.unread) unread_names.push_back(u.name);
  for (std::size_t i = 0; i < x.values.size(); ++i)
    if ((i > 0 && x.values[i - 1].name == x.values[i].name) || x.header.find(x.values[i].name) ||
        std::binary_search(unread_names.begin(), unread_names.end(), std::string_view(x.values[i].name)))
      fail(errc::invalid_metadata, file + ": the flattened name '" + x.values[i].name + "' is given twice");
  return x;
}

}  // namespace detail

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/format/impl/torch_state_dict.ipp"
#endif
