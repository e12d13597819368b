// shardsafe/checkpoint/layouts/deepspeed_tp.hpp - a DeepSpeed ZeRO-1/2 checkpoint's TP ranks
// joined where the checkpoint says how (docs/layouts-notes/deepspeed.md §5): a client's
// `universal_checkpoint_info` (Megatron-DeepSpeed writes it; ds_to_universal reads it) names, by
// regular expressions matched at the start of a parameter's name, the parameters replicated on
// every TP rank and those split on dim 1 (row parallel); every other parameter is split on dim 0.
//
// Only that much is applied, and only when it is all the info says: a non-empty rule of another
// kind (vocabulary padding, averaged parameters, sub-parameters, ...) or a pattern beyond the plain
// subset read here (literals, `.`, `\.`-style escapes, \d \w \s, the quantifiers * + ?, `^`, a
// final `$`) leaves every TP rank presented on its own (`tp{T}/<name>`), with the reason in
// deepspeed.layout. Joined, a split parameter's pieces are the same bytes of the same files as
// before, each placed at its rank's offset of the joined tensor (dim 1: one element range per
// row); a replicated parameter is TP rank 0's. Tensors the info does not cover (buffers, frozen
// parameters) stay per TP rank.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/checkpoint/layouts/deepspeed_files.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/pickle_value.hpp"

namespace shardsafe {
namespace detail {

/// A regular expression of the plain subset (top of this file), matched as Python's re.match
/// does (at the start of the name); nullopt when the pattern is outside the subset.
inline std::optional<bool> ds_pattern_match(std::string_view pat, std::string_view s) {
  struct atom {
    char k;  // 'c' a character, '.' any, 'd' digit, 'w' word, 's' space
    char c;
    char q;  // '1', '*', '+', '?'
  };
  std::vector<atom> atoms;
  bool end = false;
  std::size_t i = pat.starts_with('^') ? 1 : 0;
  for (; i < pat.size(); ++i) {
    const char x = pat[i];
    if (x == '$' && i + 1 == pat.size()) {
      end = true;
      break;
    }
    atom a{'c', x, '1'};
    if (x == '.') {
      a.k = '.';
    } else if (x == '\\') {
      if (++i == pat.size()) return std::nullopt;
      const char e = pat[i];
      if (e == 'd' || e == 'w' || e == 's')
        a.k = e;
      else if (std::string_view(".\\^$*+?()[]{}|/-_").find(e) != std::string_view::npos)
        a.c = e;
      else
        return std::nullopt;
    } else if (std::string_view("()[]{}|^$*+?").find(x) != std::string_view::npos) {
      return std::nullopt;
    }
    if (i + 1 < pat.size() && (pat[i + 1] == '*' || pat[i + 1] == '+' || pat[i + 1] == '?')) a.q = pat[++i];
    atoms.push_back(a);
    if (atoms.size() > 512) return std::nullopt;
  }
  auto one = [](const atom& a, char ch) {
    const auto u = static_cast<unsigned char>(ch);
    switch (a.k) {
      case '.': return ch != '\n';
      case 'd': return u >= '0' && u <= '9';
      case 'w': return (u >= '0' && u <= '9') || (u >= 'a' && u <= 'z') || (u >= 'A' && u <= 'Z') || ch == '_';
      case 's': return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\f' || ch == '\v';
      default: return ch == a.c;
    }
  };
  // ok[j][p]: atoms from j on match s from p on; filled backwards, O(atoms x name)
  const std::size_t n = s.size(), m = atoms.size();
  std::vector<char> ok((m + 1) * (n + 1), 0);
  auto at = [&](std::size_t j, std::size_t p) -> char& { return ok[j * (n + 1) + p]; };
  for (std::size_t p = 0; p <= n; ++p) at(m, p) = !end || p == n;
  for (std::size_t j = m; j-- > 0;)
    for (std::size_t p = n + 1; p-- > 0;) {
      const atom& a = atoms[j];
      const bool here = p < n && one(a, s[p]);
      switch (a.q) {
        case '1': at(j, p) = here && at(j + 1, p + 1); break;
        case '?': at(j, p) = at(j + 1, p) || (here && at(j + 1, p + 1)); break;
        case '*': at(j, p) = at(j + 1, p) || (here && at(j, p + 1)); break;
        default: at(j, p) = here && (at(j + 1, p + 1) || at(j, p + 1)); break;  // '+'
      }
    }
  return at(0, 0) != 0;
}

/// Joins the TP ranks of builder b (its tensors named tp{T}/...) where `info` (the model file's
/// universal_checkpoint_info) says how, for the parameters of `groups` (per TP rank, in
/// param_shapes order); "" when joined, else why not (b is then left as it was).
template <class R>
std::string ds_join_tp(ds_builder<R>& b, const pickle_value* info, const std::vector<std::vector<ds_group>>& groups) {
  if (!info || info->type() != pickle_value::kind::dict) return "no universal_checkpoint_info says how to join them";
  std::vector<std::string> replicated, row;
  for (std::size_t i = 0; i < info->dict_size(); ++i) {
    const pickle_value& k = info->dict_key(i);
    const pickle_value& v = info->dict_value(i);
    const std::string key = k.type() == pickle_value::kind::string ? k.as_string("") : std::string("?");
    const bool empty =
        v.is_none() || ((v.type() == pickle_value::kind::list || v.type() == pickle_value::kind::tuple ||
                         v.type() == pickle_value::kind::dict) &&
                        (v.type() == pickle_value::kind::dict ? v.dict_size() == 0 : v.as_sequence("").empty()));
    std::vector<std::string>* into = key == "tp_replicated_parameter_patterns"          ? &replicated
                                     : key == "parameter_with_row_parallelism_patterns" ? &row
                                                                                        : nullptr;
    if (!into) {
      if (key == "universal_checkpoint_version" || key == "pipeline_replicated_parameter_patterns" || empty) continue;
      return "universal_checkpoint_info's '" + key + "' asks for a join not done here";
    }
    if (v.type() != pickle_value::kind::list && v.type() != pickle_value::kind::tuple)
      return "universal_checkpoint_info's '" + key + "' is not a list of patterns";
    for (const auto& p : v.as_sequence("")) {
      if (p.type() != pickle_value::kind::string || !ds_pattern_match(p.as_string(""), ""))
        return "universal_checkpoint_info's '" + key + "' holds a pattern beyond the plain regular expressions read";
      into->push_back(p.as_string(""));
    }
  }
  auto any = [](const std::vector<std::string>& ps, const std::string& name) {
    for (const auto& p : ps)
      if (*ds_pattern_match(p, name)) return true;
    return false;
  };
  const std::size_t tp = groups.size();
  struct plan {
    std::string name;
    int dim;  // -1 replicated, else the dim joined on
    std::vector<shape_t> shapes;
  };
  std::vector<plan> plans;
  for (std::size_t g = 0; g < groups[0].size(); ++g)
    for (std::size_t i = 0; i < groups[0][g].size(); ++i) {
      plan p{groups[0][g][i].first, any(replicated, groups[0][g][i].first) ? -1 : any(row, groups[0][g][i].first), {}};
      for (std::size_t t = 0; t < tp; ++t) {
        if (g >= groups[t].size() || i >= groups[t][g].size() || groups[t][g][i].first != p.name)
          return "the TP ranks' param_shapes do not list the same parameters in the same order";
        const shape_t& s = groups[t][g][i].second;
        const shape_t& s0 = groups[0][g][i].second;
        bool same = s.size() == s0.size() && (p.dim < 0 || static_cast<std::size_t>(p.dim) < s.size());
        for (std::size_t d = 0; same && d < s.size(); ++d) same = s[d] == s0[d] || static_cast<int>(d) == p.dim;
        if (!same)
          return "parameter '" + p.name + "' has shapes " + to_string(s0) + " and " + to_string(s) +
                 " on TP ranks 0 and " + std::to_string(t) + ", which its rule does not join";
        p.shapes.push_back(s);
        const auto it = b.tensors.find("tp" + std::to_string(t) + "/" + p.name);
        if (it != b.tensors.end())
          for (const auto& [fname, spec] : it->second.files)
            if (!spec.is_flat()) return "parameter '" + p.name + "' is stored transposed in " + fname;
      }
      plans.push_back(std::move(p));
    }
  // every check passed: rename and place
  auto rename_in_files = [&](const tensor_metadata& tm, const std::string& from, const std::string& to) {
    for (const auto& [fname, spec] : tm.files)
      for (auto& e : b.entries[fname])
        if (e.name == from) e.name = to;
  };
  for (const plan& p : plans)
    for (const std::string suffix : {"", ".fp32", ".exp_avg", ".exp_avg_sq", ".step"}) {
      const std::string key = suffix.empty() ? p.name : "optimizer.state." + p.name + suffix;
      const bool whole = p.dim < 0 || suffix == ".step";
      tensor_metadata joined;
      for (std::size_t t = 0; t < tp; ++t) {
        const std::string from = "tp" + std::to_string(t) + "/" + key;
        auto it = b.tensors.find(from);
        if (it == b.tensors.end()) continue;
        tensor_metadata tm = std::move(it->second);
        b.tensors.erase(it);
        if (whole) {
          if (t == 0) {
            rename_in_files(tm, from, key);
            joined = std::move(tm);
          }
          continue;
        }
        // local shape L of rank t into the joined shape G along dim c, at offset o
        const auto c = static_cast<std::size_t>(p.dim);
        std::uint64_t o = 0, rest = 1;
        for (std::size_t u = 0; u < t; ++u) o += p.shapes[u][c];
        for (std::size_t d = c + 1; d < tm.shape.size(); ++d) rest *= tm.shape[d];
        shape_t g = tm.shape;
        g[c] = 0;
        for (std::size_t u = 0; u < tp; ++u) g[c] += p.shapes[u][c];
        const std::uint64_t lblock = tm.shape[c] * rest, gblock = g[c] * rest;
        joined.shape = g;
        joined.type = tm.type;
        for (const auto& [fname, spec] : tm.files) {
          rename_in_files(tm, from, key);
          joined.files.emplace_back(
              fname, shard_spec(flat_spec(ds_joined_ranges(spec.flat().ranges(), lblock, gblock, o * rest))));
        }
      }
      if (!joined.files.empty()) b.tensors[key] = std::move(joined);
    }
  return {};
}

}  // namespace detail
}  // namespace shardsafe
