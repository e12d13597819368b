// shardsafe/checkpoint/layouts/deepspeed.hpp - DeepSpeed ZeRO-1/2/3 checkpoints (DeepSpeed's
// save_checkpoint; docs/FORMAT.md §6, docs/layouts-notes/deepspeed.md): a folder whose `latest`
// names the tag folder, or the tag folder itself, holding
//
//   mp_rank_MM_model_states.pt                         ZeRO-1/2: the module, whole, per TP rank MM
//   zero_pp_rank_D_mp_rank_MM_model_states.pt          ZeRO-3: per DP rank D (frozen pieces, buffers)
//   [bf16_|fp16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt   the optimizer's flat partitions per DP rank
//
// Presented (names as the trainer's own tensors are named):
//   <param>, <buffer>                      ZeRO-1/2: the module's tensors, whole, in its dtype.
//                                          ZeRO-3 holds no low-precision weights: a trainable
//                                          parameter is its fp32 master (float32, sharded as the
//                                          optimizer's); a frozen one its pieces
//                                          (frozen_param_fragments); buffers whole from the module
//   optimizer.state.<param>.fp32 / .exp_avg / .exp_avg_sq   the parameter's full shape, sharded
//                                          across the DP ranks' optim files as flat element ranges
//                                          where they lie (ZeRO-1/2: the group's flat partitions,
//                                          param_shapes in order, padded to 2 x dp and cut in dp
//                                          equal parts, param_slice_mappings checked against it;
//                                          ZeRO-3: ceil(numel / dp) per parameter per rank);
//                                          padding is never shown
//   optimizer.state.<param>.step           the group's step (DP rank 0's)
//   non-tensor items                       the model-states file's plain values (global_steps, ds_config,
//                                          client state), optimizer.param_groups..., and
//                                          deepspeed.layout saying what was presented
// With TP (mp_world_size > 1), ZeRO-1/2 parameters and their state are joined where a client's
// universal_checkpoint_info says how and says nothing more (layouts/deepspeed_tp.hpp); anything
// else is presented per TP rank, `tp{T}/<name>`: DeepSpeed records no join rule of its own.
//
// Refused (naming the file, the parameter and the rule): `latest` naming no tag folder, a missing
// partition file, partitions that disagree with param_shapes on sizes or padding
// (group_paddings, partition_count, param_slice_mappings, flat lengths), a global outside the
// torch.save allowlist and deepspeed_records.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/layouts/deepspeed_files.hpp"
#include "shardsafe/checkpoint/layouts/deepspeed_tp.hpp"
#include "shardsafe/checkpoint/layouts/deepspeed_zero.hpp"
#include "shardsafe/checkpoint/layouts/layout.hpp"
#include "shardsafe/checkpoint/layouts/single_file.hpp"
#include "shardsafe/checkpoint/source.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/format/torch_save.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

struct deepspeed_layout : torch_save_values {
  static constexpr layout_info info{.id = "deepspeed",
                                    .name = "DeepSpeed ZeRO checkpoint",
                                    .commit_mark = "",
                                    .permuted_files = true,
                                    .trainer_state = true};
  /// The file naming the tag folder.
  static constexpr std::string_view latest_file = "latest";

  template <ReadableDirectory D>
  static bool recognise(const D& dir, folder_listing<D>& ls) {
    if (!ls.listed())
      return dir.exists(latest_file) || dir.exists(detail::ds_model_name(0)) ||
             dir.exists(detail::ds_zero3_model_name(0, 0));
    for (const auto& n : ls.names())
      if (n == latest_file || detail::ds_is_model_states_name(n)) return true;
    return false;
  }

  template <ReadableDirectory D>
  static std::optional<checkpoint_source<D>> open(const D& dir, folder_listing<D>& ls) {
    return open_pointed<deepspeed_layout>(dir, ls, latest_file, [](const D& d) {
      return detail::ds_tag_folder(
          d, latest_file,
          [](const D& tf) {
            return tf.exists(detail::ds_model_name(0)) || tf.exists(detail::ds_zero3_model_name(0, 0));
          },
          detail::ds_model_name(0) + " nor " + detail::ds_zero3_model_name(0, 0));
    });
  }

  /// The description of tag folder f: every file read and indexed (their pickles, no tensor data).
  template <ReadableDirectory D>
  static checkpoint_source<D> describe(const D& f) {
    using R = typename D::reader_type;
    const bool zero3 = !f.exists(detail::ds_model_name(0));
    std::vector<detail::ds_file<R>> files;
    files.push_back(detail::open_ds_file(f, zero3 ? detail::ds_zero3_model_name(0, 0) : detail::ds_model_name(0),
                                         "the model states of TP rank 0"));
    const pickle_value& m0 = files[0].value();
    const auto dp = detail::ds_uint(detail::ds_get(&m0, "dp_world_size"));
    const auto mp_given = detail::ds_uint(detail::ds_get(&m0, "mp_world_size"));
    const std::uint64_t mp = mp_given ? *mp_given : 1;
    if (!dp || *dp == 0 || *dp > (1u << 20) || mp == 0 || mp > 100)
      files[0].bad("dp_world_size / mp_world_size are not a DP world of 1 to 2^20 ranks and a TP world of 1 to 100");
    std::string prefix;
    bool found = false;
    for (const char* p : {"bf16_", "", "fp16_"})
      if (!found && f.exists(p + detail::ds_optim_name(0, 0))) {
        prefix = p;
        found = true;
      }
    if (!found)
      fail(errc::not_found, std::string(f.name()) + ": no optimizer partitions ([bf16_|fp16_]" +
                                detail::ds_optim_name(0, 0) +
                                "): a ZeRO-0 checkpoint, whose optimizer is in the model states, is not read");
    detail::ds_builder<R> b;
    std::string said;
    std::vector<std::vector<detail::ds_group>> tp_groups;  // ZeRO-1/2: each TP rank's param_shapes
    for (std::uint64_t t = 0; t < mp; ++t) {
      const std::string tp = mp > 1 ? "tp" + std::to_string(t) + "/" : std::string();
      const std::string of_tp = ", TP rank " + std::to_string(t) + " (mp_world_size " + std::to_string(mp) + ")";
      std::vector<std::size_t> models, optims;
      for (std::uint64_t d = 0; d < (zero3 ? *dp : 1); ++d) {
        if (t == 0 && d == 0) {
          models.push_back(0);
          continue;
        }
        files.push_back(detail::open_ds_file(f, zero3 ? detail::ds_zero3_model_name(d, t) : detail::ds_model_name(t),
                                             "the model states of DP rank " + std::to_string(d) + " (dp_world_size " +
                                                 std::to_string(*dp) + ")" + of_tp));
        models.push_back(files.size() - 1);
      }
      for (std::uint64_t d = 0; d < *dp; ++d) {
        files.push_back(detail::open_ds_file(f, prefix + detail::ds_optim_name(d, t),
                                             "the optimizer partition of DP rank " + std::to_string(d) +
                                                 " (dp_world_size " + std::to_string(*dp) + ")" + of_tp));
        optims.push_back(files.size() - 1);
      }
      std::vector<const detail::ds_file<R>*> mf, of;
      for (auto i : models) mf.push_back(&files[i]);
      for (auto i : optims) of.push_back(&files[i]);
      said = zero3 ? detail::ds_zero3(b, mf, of, tp) : detail::ds_zero12(b, *mf[0], of, tp);
      if (!zero3) tp_groups.push_back(detail::ds_param_groups(*mf[0]));
    }
    if (mp > 1) {
      const std::string why =
          zero3 ? std::string("ZeRO-3's TP ranks are not joined here")
                : detail::ds_join_tp(b, detail::ds_get(&files[0].value(), "universal_checkpoint_info"), tp_groups);
      said += "; TP " + std::to_string(mp) +
              (why.empty() ? ": parameters and their optimizer state joined as universal_checkpoint_info says "
                             "(replicated ones from TP rank 0, row-parallel ones on dim 1, the rest on dim 0); "
                             "buffers and frozen parameters per TP rank as tp{T}/<name>"
                           : ": presented per TP rank as tp{T}/<name> (" + why + ")");
    }
    checkpoint_source<D> s = detail::ds_make_source(f, info, b, files);
    detail::ds_items(s, files[0], files[zero3 ? *dp : 1], said);
    return s;
  }
};

}  // namespace shardsafe
