// shardsafe - inspect, verify, digest and unshard safetensors files, Hugging Face folders,
// sharded checkpoints, torch DCP folders and torch's DCP-sharded HF files, and export any of them
// to a Hugging Face folder or a torch DCP folder (docs/FORMAT.md §4). A thin command line over the library: validation lives in
// checkpoint/hf/folder.hpp and checkpoint/verify.hpp, the export in checkpoint/hf/export.hpp,
// the arguments are parsed by CLI11. Any input ends in exit 0 or 1 with a message; a usage
// error exits 2 with one line.
//
// This file is main() and the command line; each command is a header of commands/ (cmd_X), what
// they share is input.hpp (what PATH is), output.hpp (where an output may go) and print.hpp (how
// results are written). One translation unit: the headers are included here.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <exception>
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "commands/digest.hpp"
#include "commands/inspect.hpp"
#include "commands/to_dcp.hpp"
#include "commands/to_hf.hpp"
#include "commands/unshard.hpp"
#include "commands/verify.hpp"
#include "input.hpp"
#include "print.hpp"
#include "shardsafe/checkpoint/dcp_export.hpp"
#include "shardsafe/checkpoint/hf/experts.hpp"
#include "shardsafe/format/hf_export.hpp"
#include "shardsafe/format/rename.hpp"
#include "shardsafe/version.hpp"

using namespace shardsafe;
using namespace shardsafe::tool;

namespace {

/// What --help prints after the commands.
constexpr const char* path_help =
    "PATH is a safetensors file, a torch.save file (pytorch_model.bin, or a training checkpoint's\n"
    ".pt with its epoch and optimizer values; read without running its pickle), a Hugging Face folder "
    "(model.safetensors, pytorch_model.bin or an index), a\n"
    "checkpoint folder (with metadata.json, or with model/ and optim/) or a folder of torch's\n"
    "DCP-sharded Hugging Face files (safetensors with DCP_SHARDING_INFO), a DeepSpeed ZeRO or\n"
    "universal checkpoint (the folder with latest or latest_universal, or its tag folder), or a\n"
    "Megatron checkpoint, torch_dist or legacy torch (the folder with\n"
    "latest_checkpointed_iteration.txt, or its iter_NNNNNNN/). Any of these may be a\n"
    "URL: http(s)://HOST/PATH (read only) or s3://BUCKET/PREFIX (settings from the AWS_*\n"
    "environment variables); unshard and to-hf also write to s3://.";

/// A CLI11 check that runs `parse` on the value: its exception's message is the error, none is
/// success (one validator for --max-shard-size, --rename and --stack-experts).
template <class Parse>
CLI::Validator parsed_by(Parse parse, const char* what) {
  return CLI::Validator(
      [parse](std::string& s) -> std::string {
        try {
          parse(s);
          return {};
        } catch (const std::exception& e) {
          return e.what();
        }
      },
      what);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app(
      "Inspect, verify, digest and unshard safetensors files, Hugging Face folders and sharded\n"
      "checkpoints, and export them to Hugging Face folders or torch DCP folders (docs/FORMAT.md §4).",
      "shardsafe");
  app.footer(path_help);
  app.set_version_flag("--version", "shardsafe " + std::string(library_version));
  app.require_subcommand(1);
  std::string path, out_path;
  bool follow_links = false;
  auto command = [&](const char* name, const char* what, const char* path_name, const char* path_what) {
    CLI::App* c = app.add_subcommand(name, what);
    c->add_option(path_name, path, path_what)->required();
    c->add_flag("--follow-links", follow_links,
                "follow symbolic links that leave the checkpoint's folder (refused "
                "by default; links inside it, and the Hugging Face cache's, are followed)");
    return c;
  };
  const char* any_path =
      "a safetensors file, a Hugging Face folder, a checkpoint folder or torch's DCP-sharded HF files";
  CLI::App* inspect =
      command("inspect", "list the tensors: name, dtype, shape, bytes, where stored, how sharded", "PATH", any_path);
  CLI::App* verify = command(
      "verify", "check every rule of the format; exit 1 with one line naming file, tensor and rule", "PATH", any_path);
  CLI::App* digest = command("digest", "one line per tensor, sorted by name: NAME DTYPE [SHAPE] SHA256 of its bytes",
                             "PATH", any_path);
  CLI::App* unshard = command("unshard", "write the full tensors of a checkpoint into one safetensors file", "CKPT",
                              "a checkpoint folder (with metadata.json, or with model/ and optim/), a Hugging Face "
                              "folder or torch's DCP-sharded HF files");
  unshard->add_option("OUT", out_path, "the safetensors file to write")->required();
  CLI::App* to_hf = command("to-hf",
                            "export to a Hugging Face folder: model.safetensors, or model-0000K-of-0000N "
                            "files of at most SIZE tensor bytes and model.safetensors.index.json",
                            "SRC", any_path);
  to_hf->add_option("OUTDIR", out_path, "the folder to write; it must not exist or be empty")->required();
  std::string max_size = "5GB", to_dtype, preset;
  std::vector<std::string> renames, stack_experts;
  bool model_only = false;
  to_hf
      ->add_option("--max-shard-size", max_size,
                   "tensor bytes per file: 5GB, 500MB, 4KB (decimal), 4GiB (binary) or "
                   "a plain number of bytes")
      ->check(parsed_by([](const std::string& v) { parse_size(v); }, "SIZE"))
      ->capture_default_str();
  to_hf
      ->add_option("--dtype", to_dtype,
                   "convert F16/BF16/F32/F64 tensors to this dtype (round to nearest even); "
                   "integer, BOOL and F8 tensors are never converted")
      ->check(CLI::IsMember({"bf16", "f16", "f32"}, CLI::ignore_case));
  to_hf
      ->add_option("--rename", renames,
                   "REGEX=REPL: rename tensors (rules in order, the first that matches wins; "
                   "REPL as Python's re.sub: \\1 for a group; a name renamed to nothing is dropped)")
      ->allow_extra_args(false)
      ->check(parsed_by([](const std::string& v) { parse_rename_rule(v); }, "REGEX=REPL"));
  to_hf
      ->add_option("--preset", preset,
                   "dcp-to-hf: after the --rename rules, name a torch DCP model's keys as Hugging "
                   "Face does: wrapper names (_orig_mod., _fsdp_wrapped_module., "
                   "_checkpoint_wrapped_module.) removed, then model.model.X -> model.X, "
                   "model.lm_head.weight -> lm_head.weight, other model.X -> X (a warning), other "
                   "keys dropped (a warning)")
      ->check(CLI::IsMember({"dcp-to-hf"}));
  to_hf
      ->add_option("--stack-experts", stack_experts,
                   "REGEX=REPL: write each stacked expert tensor [E, ...] whose name REGEX matches as E tensors "
                   "[...] named by REPL, where {i} stands for the expert's index (as --rename; applied before "
                   "the --rename rules), e.g. '^(.*\\.experts)\\.([^.]+\\.weight)$=\\1.{i}.\\2'")
      ->allow_extra_args(false)
      ->check(parsed_by([](const std::string& v) { expert_stacking().add(v); }, "REGEX=REPL"));
  to_hf->add_flag("--model-only", model_only, "for a model + optimizer checkpoint, export model/ only (the default)");
  bool dequantize = false;
  to_hf->add_flag(
      "--dequantize", dequantize,
      "write each quantized weight (FP8 with block, channel or tensor scales, MXFP8, MXFP4, NVFP4) as its values, "
      "of --dtype (bf16 if not given), its scales left out; without it they are written as stored");
  CLI::App* to_dcp = command("to-dcp",
                             "export to a torch.distributed.checkpoint folder (.metadata and __0_0.distcp) "
                             "that torch 2.x's dcp.load reads; a model + optimizer pair keyed as get_state_dict does "
                             "(model.*, optim.state.*, optim.param_groups.*)",
                             "SRC", any_path);
  to_dcp->add_option("OUTDIR", out_path, "the folder to write; it must not exist or be empty")->required();
  std::vector<std::string> dcp_renames;
  bool dcp_model_only = false;
  to_dcp->add_option("--rename", dcp_renames, "REGEX=REPL: rename keys (as to-hf's --rename)")
      ->allow_extra_args(false)
      ->check(parsed_by([](const std::string& v) { parse_rename_rule(v); }, "REGEX=REPL"));
  to_dcp->add_flag("--model-only", dcp_model_only,
                   "only the model: model/ of a model + optimizer pair, model.* keys of a "
                   "DCP folder");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version: printed on stdout, exit 0; anything else is a usage error
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e, std::cout, std::cerr);
    std::string why = e.what();
    const std::string first = argc > 1 ? argv[1] : "";
    if (!first.empty() && first[0] != '-' &&
        app.get_subcommands([&](const CLI::App* c) { return c->get_name() == first; }).empty())
      why = "unknown command '" + first + "': the commands are inspect, verify, digest, unshard, to-hf and to-dcp";
    std::cerr << "shardsafe: " << one_line(why) << " (shardsafe --help lists the commands)\n";
    return 2;
  }
  const std::string cmd = app.get_subcommands().front()->get_name();
  if (follow_links) g_links = link_policy::follow;
  try {
    if (inspect->parsed()) return with_input(path, [](const auto& in) { return cmd_inspect(in); });
    if (verify->parsed()) return with_input(path, [](const auto& in) { return cmd_verify(in); });
    if (digest->parsed()) return with_input(path, [](const auto& in) { return cmd_digest(in); });
    if (unshard->parsed()) return with_input(path, [&](const auto& in) { return cmd_unshard(in, out_path); });
    if (to_hf->parsed()) {
      hf_export_options opt;
      opt.max_shard_size = parse_size(max_size);
      if (!to_dtype.empty()) {  // bf16, f16 or f32 in any case (checked above): the dtype names in capitals
        std::transform(to_dtype.begin(), to_dtype.end(), to_dtype.begin(),
                       [](unsigned char c) { return std::toupper(c); });
        opt.convert_to = dtype_from_name(to_dtype, "--dtype");
      }
      for (const auto& r : renames) opt.rename.add(r);
      if (!preset.empty()) add_preset(opt.rename, preset);
      for (const auto& r : stack_experts) opt.experts.add(r);
      opt.model_only = true;  // --model-only or not: HF folders hold model weights
      opt.dequantize = dequantize;
      return with_input(path, [&](const auto& in) { return cmd_to_hf(in, out_path, opt); });
    }
    if (to_dcp->parsed()) {
      dcp_export_options opt;
      for (const auto& r : dcp_renames) opt.rename.add(r);
      opt.model_only = dcp_model_only;
      return with_input(path, [&](const auto& in) { return cmd_to_dcp(in, out_path, opt); });
    }
  } catch (const std::bad_alloc&) {
    std::cerr << "shardsafe: " << cmd << ": out of memory\n";
  } catch (const std::exception& e) {
    std::cerr << "shardsafe: " << one_line(e.what()) << "\n";
  }
  return 1;
}
