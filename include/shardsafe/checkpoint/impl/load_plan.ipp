// shardsafe/checkpoint/impl/load_plan.ipp - load_plan.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/checkpoint/load_plan.hpp"

namespace shardsafe {
namespace detail {

SHARDSAFE_DECL const tensor_entry& checked_entry(const safetensors_header& h, std::string_view file,
                                                 const std::string& key, const tensor_metadata& tm,
                                                 const shard_spec& spec, std::string_view described_by) {
  const std::string ctx = std::string(file) + ": tensor '" + key + "'";
  const tensor_entry* e = h.find(key);
  if (!e) fail(errc::not_found, ctx + ": listed in " + std::string(described_by) + " but absent from the file");
  if (e->type != tm.type)
    fail(errc::dtype_mismatch, ctx + ": file has dtype " + std::string(to_string(e->type)) + ", " +
                                   std::string(described_by) + " says " + std::string(to_string(tm.type)));
  if (e->numel() != spec.local_numel())
    fail(errc::shape_mismatch, ctx + ": file holds " + std::to_string(e->numel()) + " elements (shape " +
                                   to_string(e->shape) + ") but its shard spec (" + to_string(spec) + ") holds " +
                                   std::to_string(spec.local_numel()));
  return *e;
}

SHARDSAFE_DECL copy_plan permuted_runs(std::string_view file, const std::string& key, const shard_spec& mine,
                                       const shard_spec& fspec, std::span<const std::size_t> order,
                                       std::span<const std::uint64_t> full, std::uint64_t planned) {
  const std::string ctx = std::string(file) + ": tensor '" + key + "'";
  const std::string stored = "stores its dimensions in the order " + to_string(shape_t(order.begin(), order.end()));
  if (!fspec.is_block()) fail(errc::invalid_metadata, ctx + ": a flat shard (" + to_string(fspec) + ") " + stored);
  copy_plan runs = permuted_copy_plan(mine, fspec.block(), order, full);
  if (plan_numel(runs) != planned)
    fail(errc::invalid_metadata,
         ctx + ": its chunk " + to_string(fspec) + " " + stored +
             " and shares elements with another file's chunk; a load reads such a chunk only where no "
             "other file holds its elements (torch's planner writes each element once)");
  return runs;
}

SHARDSAFE_DECL std::vector<std::size_t> files_to_compare(const std::string& key, const tensor_metadata& tm,
                                                         const shard_spec& mine, const load_plan& lp,
                                                         const checkpoint_checksums* cs) {
  std::uint64_t held = 0;
  for (const auto& [n, spec] : tm.files) held += spec.local_numel();
  if (held <= tm.numel()) return {};
  const std::span<const std::uint64_t> full(tm.shape);
  auto same_checksums = [&](const std::string& a, const std::string& b) {
    if (!cs) return false;
    const auto fa = cs->files.find(a), fb = cs->files.find(b);
    if (fa == cs->files.end() || fb == cs->files.end()) return false;
    const auto ta = fa->second.find(key), tb = fb->second.find(key);
    return ta != fa->second.end() && tb != fb->second.end() && ta->second == tb->second;
  };
  std::vector<bool> involved(tm.files.size(), false);
  for (std::size_t a = 0; a < tm.files.size(); ++a)
    for (std::size_t b = a + 1; b < tm.files.size(); ++b) {
      if (overlap_numel(tm.files[a].second, tm.files[b].second, full) == 0) continue;
      if (tm.files[a].second == tm.files[b].second && same_checksums(tm.files[a].first, tm.files[b].first)) continue;
      involved[a] = involved[b] = true;
    }
  std::vector<std::uint64_t> supplied(tm.files.size(), 0);
  for (const auto& fp : lp.files) supplied[fp.file] += fp.numel;
  std::vector<std::size_t> out;
  for (std::size_t j = 0; j < tm.files.size(); ++j)
    if (involved[j] && overlap_numel(mine, tm.files[j].second, full) > supplied[j]) out.push_back(j);
  return out;
}

}  // namespace detail

SHARDSAFE_DECL view_plans plan_views(const checkpoint_metadata& md,
                                     const std::function<const tensor_metadata*(std::string_view)>& find,
                                     std::span<const flat_view> views, const load_options& opt, std::string_view where,
                                     bool memory_later) {
  view_plans out;
  load_schedule& s = out.partial;
  s.views = views.size();
  std::map<std::string_view, bool> asked;
  auto need = [&](const std::string& fname) {
    if (out.file_index.emplace(fname, out.files.size()).second) out.files.push_back(fname);
  };
  for (std::size_t vi = 0; vi < views.size(); ++vi) {
    const flat_view& v = views[vi];
    const std::string ctx = std::string(where) + ": tensor '" + v.key + "'";
    v.validate(where, memory_later);
    detail::require_view_dtype(v, opt, where);
    asked[v.key] = true;
    const tensor_metadata* tm = find(v.key);
    if (!tm) {
      if (opt.strict) fail(errc::not_found, ctx + ": not in the checkpoint");
      s.stats.missing_keys.push_back(v.key);
      continue;
    }
    if (tm->shape != v.full_shape)
      fail(errc::shape_mismatch, ctx + ": checkpoint has shape " + to_string(tm->shape) + ", the tensor to load has " +
                                     to_string(v.full_shape));
    if (tm->type != v.type) {
      if (!opt.convert_dtypes || !is_convertible_float(tm->type) || !is_convertible_float(v.type))
        fail(errc::dtype_mismatch, ctx + ": checkpoint has dtype " + std::string(to_string(tm->type)) +
                                       ", the tensor to load has " + std::string(to_string(v.type)) +
                                       (opt.convert_dtypes ? " (only F16, BF16, F32 and F64 convert)"
                                                           : " (load_options::convert_dtypes is off)"));
      s.converted.emplace_back(vi, tm->type);
    }
    const shard_spec mine = v.effective_spec();
    view_plans::one p{vi, tm, {}, {}, {}};
    if (tm->grid) p.grid_parts = tm->overlapping_files(mine);  // by division, not a walk of every file
    std::vector<shard_spec> specs;
    specs.reserve(p.files().size());
    for (const auto& f : p.files()) specs.push_back(f.second);
    p.lp = plan_load(mine, std::span<const shard_spec>(specs), tm->shape);
    if (tm->grid) {  // keep only the parts it reads from (the rest met the bounding box only)
      std::vector<std::pair<std::string, shard_spec>> kept;
      kept.reserve(p.lp.files.size());
      for (auto& fp : p.lp.files) {
        kept.push_back(std::move(p.grid_parts[fp.file]));
        fp.file = kept.size() - 1;
      }
      p.grid_parts = std::move(kept);
    }
    if (!p.lp.missing.empty()) {
      const element_range m = p.lp.missing.front();
      auto g = global_index_of(mine, tm->shape, m.begin);
      std::uint64_t total = 0;
      for (const auto& r : p.lp.missing) total += r.size();
      fail(errc::missing_coverage,
           ctx + ": " + std::to_string(total) + " of this shard's " + std::to_string(mine.local_numel()) +
               " elements are in no file; the first gap is local elements " + to_string(m) +
               (g ? " (global element " + std::to_string(*g) + ", index " + multi_index_string(tm->shape, *g) + ")"
                  : std::string()));
    }
    ++s.stats.tensors;
    if (opt.validate_nan && has_nan(v.type)) s.nan_checked.push_back(vi);
    for (const auto& fp : p.lp.files) need(p.files()[fp.file].first);
    if (!tm->grid)  // a grid's parts never overlap
      p.compare =
          detail::files_to_compare(v.key, *tm, mine, p.lp, md.extras.checksums ? &*md.extras.checksums : nullptr);
    for (const std::size_t j : p.compare) need(p.files()[j].first);
    out.views.push_back(std::move(p));
  }
  if (opt.list_unexpected)
    for (const auto& [k, t] : md.tensors)
      if (!asked.count(k)) s.stats.unexpected_keys.push_back(k);
  return out;
}

SHARDSAFE_DECL load_schedule schedule_reads(view_plans vp, std::span<const flat_view> views,
                                            std::span<const planned_file> files, const load_options& opt,
                                            unsigned threads, std::string_view described_by) {
  if (files.size() != vp.files.size())
    fail(errc::invalid_argument, "schedule_reads: " + std::to_string(files.size()) + " files given for the " +
                                     std::to_string(vp.files.size()) + " the views need");
  load_schedule s = std::move(vp.partial);
  s.threads = threads;
  s.verify_checksums = opt.verify_checksums;
  s.files.resize(files.size());
  for (std::size_t i = 0; i < files.size(); ++i) {
    s.files[i].name = vp.files[i];
    s.files[i].settings = files[i].settings;
  }
  for (const auto& p : vp.views) {
    const flat_view& v = views[p.view];
    // stored elements: a converted view's pieces count bytes as stored, and its reads are cut
    // at whole elements
    const std::uint64_t item = item_size(p.tm->type);
    const bool convert = p.tm->type != v.type;
    const shard_spec mine = v.effective_spec();
    // the reads of runs out of file j of the tensor's files, with that file's settings; a
    // compare's reads are cut to what one batch may stage
    auto reads_of = [&](std::size_t j, const copy_plan& runs, bool compare, auto&& add) {
      const auto& [fname, fspec] = p.files()[j];
      const std::size_t fi = vp.file_index.find(fname)->second;
      const planned_file& f = files[fi];
      read_options ro = s.files[fi].settings;
      if (compare) ro.max_read_bytes = std::min<std::uint64_t>(ro.max_read_bytes, batch_staging_bytes);
      if (compare || convert) ro.max_read_bytes = std::max(item, ro.max_read_bytes / item * item);
      const tensor_entry& e = detail::checked_entry(*f.header, f.name, v.key, *p.tm, fspec, described_by);
      const auto order = f.header->stored_order(e);
      read_plan rp = make_read_plan(
          order.empty() ? runs
                        : detail::permuted_runs(f.name, v.key, mine, fspec, order, p.tm->shape, plan_numel(runs)),
          f.header->offset_of(e), item, ro);
      s.stats.bytes_read += rp.bytes_read;
      s.stats.read_ops += rp.ops.size();
      for (auto& op : rp.ops) add(fi, std::move(op));
      return rp.bytes_needed;
    };
    for (const auto& fp : p.lp.files)
      s.stats.bytes_needed += reads_of(fp.file, fp.runs, false, [&](std::size_t fi, read_op op) {
        s.files[fi].reads.push_back({p.view, std::move(op)});
      });
    for (const std::size_t j : p.compare) {
      const shard_spec& fspec = p.files()[j].second;
      for (const auto& fp : plan_load(mine, std::span<const shard_spec>(&fspec, 1), p.tm->shape).files)
        reads_of(j, fp.runs, true,
                 [&](std::size_t fi, read_op op) { s.compares.push_back({fi, {p.view, std::move(op)}}); });
    }
  }
  for (auto& f : s.files)
    std::stable_sort(f.reads.begin(), f.reads.end(),
                     [](const load_schedule::file_read& a, const load_schedule::file_read& b) {
                       return a.op.file_offset < b.op.file_offset;
                     });
  return s;
}

}  // namespace shardsafe
