// shardsafe/format/impl/hf_export.ipp - hf_export.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/format/hf_export.hpp"

namespace shardsafe {

SHARDSAFE_DECL std::uint64_t parse_size(std::string_view text) {
  auto bad = [&](const std::string& why) -> void {
    fail(errc::invalid_argument, "size '" + std::string(text) + "': " + why);
  };
  std::size_t i = 0;
  std::uint64_t n = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
    const auto m = detail::checked_mul(n, 10);
    const auto a = m ? detail::checked_add(*m, static_cast<std::uint64_t>(text[i] - '0')) : std::nullopt;
    if (!a) bad("too large");
    n = *a;
    ++i;
  }
  if (i == 0) bad("expected digits, then optionally KB, MB, GB, KiB, MiB or GiB");
  const std::string_view unit = text.substr(i);
  static constexpr std::pair<std::string_view, std::uint64_t> units[] = {
      {"", 1},
      {"KB", 1'000},
      {"MB", 1'000'000},
      {"GB", 1'000'000'000},
      {"KiB", std::uint64_t{1} << 10},
      {"MiB", std::uint64_t{1} << 20},
      {"GiB", std::uint64_t{1} << 30},
  };
  for (const auto& [u, mult] : units) {
    if (u != unit) continue;
    const auto r = detail::checked_mul(n, mult);
    if (!r) bad("too large");
    return *r;
  }
  bad("unknown unit '" + std::string(unit) + "' (KB, MB, GB, KiB, MiB or GiB, or none for bytes)");
  return 0;  // not reached
}

SHARDSAFE_DECL hf_export_plan plan_hf_export(std::vector<hf_tensor_info> tensors, std::uint64_t max_shard_size) {
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  hf_export_plan plan;
  plan.bytes.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    const std::string ctx = "hf export: tensor '" + t.name + "'";
    if (t.name.empty()) fail(errc::invalid_argument, "hf export: a tensor has an empty name");
    if (i > 0 && tensors[i - 1].name == t.name) fail(errc::invalid_argument, ctx + " is listed twice");
    require_byte_sized(t.type, ctx);
    const auto n = detail::checked_numel(t.shape);
    const auto b = n ? detail::checked_mul(*n, item_size(t.type)) : std::nullopt;
    const auto total = b ? detail::checked_add(plan.total_size, *b) : std::nullopt;
    if (!total)
      fail(errc::invalid_shape, ctx + ": shape " + to_string(t.shape) + " " + std::string(to_string(t.type)) +
                                    " has more than 2^64 - 1 bytes, or the total does");
    plan.bytes.push_back(*b);
    plan.total_size = *total;
    plan.total_parameters += *n;  // no overflow: at most total_size
  }
  std::vector<hf_export_file> files(1);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    auto& cur = files.back();
    // no overflow: every partial sum is at most total_size, checked above
    if (!cur.tensors.empty() && (plan.bytes[i] > max_shard_size || cur.bytes + plan.bytes[i] > max_shard_size))
      files.emplace_back();
    files.back().tensors.push_back(i);
    files.back().bytes += plan.bytes[i];
  }
  for (std::size_t f = 0; f < files.size(); ++f) files[f].name = hf_shard_file_name(f, files.size());
  plan.tensors = std::move(tensors);
  plan.files = std::move(files);
  return plan;
}

}  // namespace shardsafe
