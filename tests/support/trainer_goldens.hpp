// tests/support/trainer_goldens.hpp - what the trainers' goldens (tests/fixtures/peers/: DeepSpeed's
// and Megatron-Core's own checkpoints, with the trainers' tensors in expected/) are checked with:
// the expected safetensors files read by the plain parser, and the collective load of a checkpoint
// into worlds of other sizes and shardings, each rank's bytes compared with its slice of the
// trainer's tensor.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <cctype>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "support/test_util.hpp"
#include "support/thread_world.hpp"

namespace testing {

/// A tensor of a golden's expected/ file: what a reader must present.
struct golden_tensor {
  shardsafe::dtype type;
  shardsafe::shape_t shape;
  std::string bytes;
};

/// The tensors of an expected/ safetensors file, by name.
inline std::map<std::string, golden_tensor> read_golden_tensors(const std::filesystem::path& p) {
  const std::string b = slurp(p);
  const shardsafe::safetensors_header h =
      shardsafe::parse_safetensors(std::as_bytes(std::span(b.data(), b.size())), p.string());
  std::map<std::string, golden_tensor> out;
  for (const auto& e : h.tensors)
    out[e.name] = {e.type, e.shape,
                   b.substr(static_cast<std::size_t>(h.offset_of(e)), static_cast<std::size_t>(e.nbytes()))};
  return out;
}

/// Every tensor of `want` as reader presents it: listed with its dtype and shape, and unshard's
/// bytes the trainer's.
template <shardsafe::ReadableDirectory D>
void check_golden_tensors(shardsafe::checkpoint_reader<D>& r, const std::map<std::string, golden_tensor>& want) {
  for (const auto& [key, w] : want) {
    CAPTURE(key);
    const shardsafe::tensor_metadata* tm = r.find(key);
    REQUIRE(tm != nullptr);
    CHECK(tm->type == w.type);
    CHECK(tm->shape == w.shape);
    std::string got(w.bytes.size(), '\0');
    shardsafe::unshard_tensor(r, key, std::as_writable_bytes(std::span(got.data(), got.size())));
    CHECK(got == w.bytes);
  }
}

/// Every tensor of `want` loaded from the checkpoint in dir by a collective load of 3 ranks each
/// holding a block of rows (dim 0 cut in ceil(rows / 3)), then of 4 ranks each a flat element
/// range (numel cut in ceil(numel / 4)); 0-d tensors whole on every rank. Each rank's bytes must
/// be its slice of the trainer's tensor. The views loaded and compared.
template <shardsafe::ReadableDirectory D>
std::size_t load_golden_in_other_worlds(const D& dir, const std::map<std::string, golden_tensor>& want) {
  using namespace shardsafe;
  std::size_t compared = 0;
  for (const int world : {3, 4}) {
    CAPTURE(world);
    std::vector<std::map<std::string, std::pair<std::string, std::string>>> got(world);  // key -> (got, want)
    const auto thrown = run_ranks(world, [&](thread_comm& comm) {
      const auto r = static_cast<std::uint64_t>(comm.rank()), n = static_cast<std::uint64_t>(world);
      auto& mine = got[r];
      std::vector<flat_view> views;
      for (const auto& [key, w] : want) {
        flat_view v;
        v.key = key;
        v.type = w.type;
        v.full_shape = w.shape;
        const std::uint64_t isz = item_size(w.type);
        std::uint64_t first = 0, count = numel(w.shape);  // the slice of w.bytes, in elements
        if (!w.shape.empty() && world == 3) {
          const std::uint64_t rows = w.shape[0], per = (rows + n - 1) / n, a = std::min(rows, r * per),
                              e = std::min(rows, (r + 1) * per), row = rows ? numel(w.shape) / rows : 0;
          shape_t local = w.shape, off(w.shape.size(), 0);
          local[0] = e - a;
          off[0] = a;
          v.spec = shard_spec(block_spec(local, off));
          first = a * row;
          count = (e - a) * row;
        } else if (!w.shape.empty()) {
          const std::uint64_t all = numel(w.shape), per = (all + n - 1) / n, a = std::min(all, r * per),
                              e = std::min(all, (r + 1) * per);
          v.spec = shard_spec(flat_spec{{a, e}});
          first = a;
          count = e - a;
        }
        auto& [buf, expect] = mine[key];
        buf.assign(static_cast<std::size_t>(count * isz), '\x5a');
        expect = w.bytes.substr(static_cast<std::size_t>(first * isz), static_cast<std::size_t>(count * isz));
        v.data = reinterpret_cast<std::byte*>(buf.data());
        v.nbytes = buf.size();
        views.push_back(std::move(v));
      }
      load(dir, std::span<const flat_view>(views), comm);
    });
    for (const auto& e : thrown) CHECK(error_message_of(e) == "");
    for (const auto& rank : got)
      for (const auto& [key, pair] : rank) {
        CAPTURE(key);
        CHECK(pair.first == pair.second);
        ++compared;
      }
  }
  return compared;
}

/// The number after `marker` in s ("3" of "decoder.layers.3.mlp" after "layers."), or "".
inline std::string mc_number_after(std::string_view s, std::string_view marker) {
  const auto at = s.find(marker);
  if (at == std::string_view::npos) return {};
  std::size_t e = at + marker.size();
  while (e < s.size() && s[e] >= '0' && s[e] <= '9') ++e;
  return std::string(s.substr(at + marker.size(), e - at - marker.size()));
}

/// The name a Megatron module tensor is presented by in a torch_dist checkpoint (docs/FORMAT.md
/// §7): its checkpoint key (expected/full/checkpoint_keys.json), a stacked one per layer and expert.
inline std::string mc_name_of(const std::string& module, const std::string& key) {
  const std::string stack = "decoder.layers.", experts = "mlp.experts.experts.";
  if (!key.starts_with(stack) || std::isdigit(static_cast<unsigned char>(key[stack.size()]))) return key;
  const std::string rest = key.substr(stack.size()), layer = mc_number_after(module, stack);
  if (layer.empty()) throw std::runtime_error(module + ": a stacked key's module name has no layer number");
  if (!rest.starts_with(experts)) return stack + layer + "." + rest;
  const std::string expert = mc_number_after(module, ".local_experts.");
  if (expert.empty()) throw std::runtime_error(module + ": a stacked expert key's module name has no expert number");
  return stack + layer + ".mlp.experts.local_experts." + expert + "." + rest.substr(experts.size());
}

}  // namespace testing
