// shardsafe - inspect, verify, digest and unshard safetensors files, Hugging Face folders,
// sharded checkpoints and torch's DCP-sharded HF files, and export any of them to a Hugging Face
// folder (docs/FORMAT.md §4). A thin command line over the library: validation lives in
// checkpoint/hf_folder.hpp and checkpoint/verify.hpp, the export in checkpoint/hf_export.hpp,
// the arguments are parsed by CLI11. Any input ends in exit 0 or 1 with a message; a usage
// error exits 2 with one line.
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "sha256.hpp"
#include "shardsafe/checkpoint/hf_export.hpp"
#include "shardsafe/checkpoint/hf_folder.hpp"
#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/checkpoint/verify.hpp"
#include "shardsafe/format/hf_export.hpp"
#include "shardsafe/format/hf_index.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/rename.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/version.hpp"

namespace fs = std::filesystem;
using namespace shardsafe;

namespace {

constexpr std::uint64_t chunk_bytes = std::uint64_t(64) << 20;

/// A message as one line of text: control characters (a newline or an escape sequence in a
/// tensor or file name read from the input) are written as \n, \r, \t or \xHH.
std::string one_line(std::string_view s) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string r;
  for (unsigned char c : s) {
    if (c == '\n') r += "\\n";
    else if (c == '\r') r += "\\r";
    else if (c == '\t') r += "\\t";
    else if (c < 0x20 || c == 0x7f) r += std::string("\\x") + hex[c >> 4] + hex[c & 15];
    else r += static_cast<char>(c);
  }
  return r;
}

/// "\r[what] done/total" on stderr, at most ten times a second, only on a terminal.
class progress {
 public:
  progress(std::string what, std::uint64_t total) : what_(std::move(what)), total_(total), tty_(::isatty(2) == 1) {}
  ~progress() {
    if (tty_ && shown_) std::fprintf(stderr, "\r\033[K");
  }
  void add(std::uint64_t n) { set(done_ + n, total_); }
  void set(std::uint64_t done, std::uint64_t total) {
    done_ = done;
    total_ = total;
    if (!tty_) return;
    auto now = std::chrono::steady_clock::now();
    if (shown_ && now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    shown_ = true;
    std::fprintf(stderr, "\r\033[K[%s] %.1f / %.1f MB (%.0f%%)", what_.c_str(), double(done_) / 1e6, double(total_) / 1e6,
                 total_ ? 100.0 * double(done_) / double(total_) : 100.0);
  }

 private:
  std::string what_;
  std::uint64_t total_, done_ = 0;
  bool tty_, shown_ = false;
  std::chrono::steady_clock::time_point last_{};
};

std::string shape_str(std::span<const std::uint64_t> s) { return shardsafe::to_string(s); }

// ---------------------------------------------------------------------------------------
// what PATH is

enum class kind { file, hf, checkpoint, checkpoint_pair };

struct input {
  kind k;
  fs::path path;
  std::vector<std::pair<std::string, fs::path>> parts;  // checkpoint_pair: {"model", dir}, {"optim", dir}
};

input classify(const std::string& p) {
  fs::path path(p);
  std::error_code ec;
  auto st = fs::status(path, ec);
  if (ec || !fs::exists(st)) fail(errc::not_found, p + ": no such file or directory");
  if (fs::is_regular_file(st)) return {kind::file, path, {}};
  if (!fs::is_directory(st)) fail(errc::invalid_argument, p + ": not a regular file or directory");
  if (fs::exists(path / std::string(metadata_file_name))) return {kind::checkpoint, path, {}};
  const std::string parts[] = {std::string(model_folder_name), std::string(optim_folder_name)};
  if (fs::is_directory(path / parts[0]) || fs::is_directory(path / parts[1])) {
    input in{kind::checkpoint_pair, path, {}};
    for (const auto& part : parts)
      if (fs::is_directory(path / part)) in.parts.emplace_back(part, path / part);
    return in;
  }
  if (is_hf_folder(file_directory(path))) return {kind::hf, path, {}};
  // torch's DCP-sharded HF files (or rank files without metadata.json, or a torch DCP folder:
  // the checkpoint reader names what it found)
  for (const auto& e : fs::directory_iterator(path, ec)) {
    const std::string n = e.path().filename().string();
    if (n == ".metadata" || n.ends_with(".safetensors") || n.ends_with(".distcp")) return {kind::checkpoint, path, {}};
  }
  fail(errc::not_found, p + ": a directory with neither metadata.json, model/ and optim/, " + std::string(hf_index_file) +
                            " nor " + std::string(hf_single_file));
}

/// The Hugging Face folder at in.path, opened and validated (checkpoint/hf_folder.hpp).
hf_folder<file_directory> open_hf(const input& in) { return open_hf_folder(file_directory(in.path)); }

// ---------------------------------------------------------------------------------------
// checkpoints

struct ckpt_part {
  std::string prefix;  // "" or "model/" / "optim/"
  std::unique_ptr<checkpoint_reader<file_directory>> reader;
};

std::vector<ckpt_part> open_checkpoint(const input& in) {
  std::vector<ckpt_part> parts;
  if (in.k == kind::checkpoint || in.k == kind::hf) {
    parts.push_back({"", std::make_unique<checkpoint_reader<file_directory>>(file_directory(in.path))});
  } else {
    for (const auto& [name, dir] : in.parts)
      parts.push_back({name + "/", std::make_unique<checkpoint_reader<file_directory>>(file_directory(dir))});
  }
  return parts;
}

std::string describe_sharding(const tensor_metadata& tm) {
  if (!tm.is_sharded) return "not sharded";
  bool flat = true, block = true;
  for (const auto& [f, s] : tm.files) {
    flat = flat && s.is_flat();
    block = block && s.is_block();
  }
  std::string how = flat ? "flattened offsets" : block ? "blocks" : "flattened offsets and blocks";
  return how + " over " + std::to_string(tm.files.size()) + " file(s)";
}

// ---------------------------------------------------------------------------------------
// commands

struct row {
  std::string name, dtype, shape, bytes, stored, sharding;
};

void print_rows(const std::string& title, std::vector<row> rows) {
  for (auto& r : rows) r.name = one_line(r.name);
  std::sort(rows.begin(), rows.end(), [](const row& a, const row& b) { return a.name < b.name; });
  std::cout << title << "\n";
  row head{"NAME", "DTYPE", "SHAPE", "BYTES", "STORED", "SHARDING"};
  std::size_t w[5] = {4, 5, 5, 5, 6};
  for (const auto& r : rows) {
    w[0] = std::max(w[0], r.name.size());
    w[1] = std::max(w[1], r.dtype.size());
    w[2] = std::max(w[2], r.shape.size());
    w[3] = std::max(w[3], r.bytes.size());
    w[4] = std::max(w[4], r.stored.size());
  }
  auto line = [&](const row& r) {
    auto pad = [](const std::string& s, std::size_t n) { return s + std::string(n - s.size() + 2, ' '); };
    std::cout << pad(r.name, w[0]) << pad(r.dtype, w[1]) << pad(r.shape, w[2]) << pad(r.bytes, w[3]) << pad(r.stored, w[4])
              << r.sharding << "\n";
  };
  line(head);
  for (const auto& r : rows) line(r);
}

int cmd_inspect(const input& in) {
  std::vector<row> rows;
  if (in.k == kind::file) {
    file_storage s(in.path);
    auto h = read_safetensors_header(s);
    std::uint64_t total = 0;
    for (const auto& t : h.tensors) {
      total += t.nbytes();
      rows.push_back({t.name, std::string(name(t.type)), shape_str(t.shape), std::to_string(t.nbytes()),
                      "@" + std::to_string(h.offset_of(t)), "-"});
    }
    std::string title = "# " + in.path.string() + ": safetensors file, " + std::to_string(h.tensors.size()) +
                        " tensors, " + std::to_string(total) + " bytes of data, header " +
                        std::to_string(h.header_size) + " bytes";
    for (const auto& [k, v] : h.metadata) title += "\n# __metadata__ " + k + " = " + v;
    print_rows(title, rows);
    return 0;
  }
  if (in.k == kind::hf) {
    const auto h = open_hf(in);
    for (const auto& [n, at] : h.tensors) {
      const tensor_entry& t = h.entry(at);
      rows.push_back({n, std::string(name(t.type)), shape_str(t.shape), std::to_string(t.nbytes()), h.files[at.file].name,
                      "-"});
    }
    print_rows("# " + in.path.string() + ": Hugging Face " + (h.sharded() ? "sharded checkpoint, " : "checkpoint, ") +
                   std::to_string(h.files.size()) + " file(s), " + std::to_string(h.tensors.size()) + " tensors, " +
                   std::to_string(h.tensor_bytes()) + " bytes",
               rows);
    return 0;
  }
  auto parts = open_checkpoint(in);
  std::uint64_t total = 0;
  std::string writer;
  const std::string what(name(parts.front().reader->format()));
  for (auto& p : parts) {
    const auto& md = p.reader->metadata();
    if (!md.extras.writer.empty()) writer = md.extras.writer;
    for (const auto& [key, tm] : md.tensors) {
      const std::uint64_t bytes = tm.numel() * bit_size(tm.type) / 8;
      total += bytes;
      std::string stored;
      for (std::size_t i = 0; i < tm.files.size() && i < 4; ++i) stored += (i ? "," : "") + tm.files[i].first;
      if (tm.files.size() > 4) stored += ",...";
      rows.push_back({p.prefix + key, std::string(name(tm.type)), shape_str(tm.shape), std::to_string(bytes), stored,
                      describe_sharding(tm)});
    }
  }
  const std::size_t tensors = rows.size();
  for (auto& p : parts)
    for (const auto& item : p.reader->non_tensors())
      rows.push_back({p.prefix + item.key, "-", "-", std::to_string(item.bytes), item.file, "non-tensor item (not loaded)"});
  const std::size_t others = rows.size() - tensors;
  print_rows("# " + in.path.string() + ": " + what + ", " + std::to_string(tensors) + " tensors, " +
                 std::to_string(total) + " bytes" +
                 (others ? ", " + std::to_string(others) + " non-tensor item" + (others > 1 ? "s" : "") : "") +
                 (writer.empty() ? "" : ", written by " + writer),
             rows);
  return 0;
}

int cmd_verify(const input& in) {
  std::size_t n = 0;
  if (in.k == kind::file) {
    file_storage s(in.path);
    n = read_safetensors_header(s).tensors.size();
  } else if (in.k == kind::hf) {
    n = open_hf(in).tensors.size();
  } else {
    for (auto& p : open_checkpoint(in)) n += verify_checkpoint(*p.reader).tensors;
  }
  std::cout << "OK " << in.path.string() << ": " << n << " tensors valid\n";
  return 0;
}

int cmd_digest(const input& in) {
  struct line {
    std::string name;
    dtype type;
    shape_t shape;
    std::string hex;
  };
  std::vector<line> out;
  auto hash_range = [](const file_storage& s, std::uint64_t off, std::uint64_t len, progress& pr) {
    tool::sha256 h;
    std::vector<std::byte> buf(static_cast<std::size_t>(std::min(len, chunk_bytes)));
    for (std::uint64_t done = 0; done < len;) {
      const std::uint64_t n = std::min<std::uint64_t>(buf.size(), len - done);
      std::span<std::byte> b(buf.data(), static_cast<std::size_t>(n));
      s.read_into(off + done, b);
      h.update(b);
      done += n;
      pr.add(n);
    }
    return h.hex();
  };
  if (in.k == kind::file) {
    file_storage s(in.path);
    auto h = read_safetensors_header(s);
    progress pr("digest", h.data_size);
    for (const auto& t : h.tensors) out.push_back({t.name, t.type, t.shape, hash_range(s, h.offset_of(t), t.nbytes(), pr)});
  } else if (in.k == kind::hf) {
    const auto h = open_hf(in);
    std::uint64_t total = 0;
    for (const auto& f : h.files) total += f.header.data_size;
    progress pr("digest", total);
    for (const auto& [n, at] : h.tensors) {
      const tensor_entry& t = h.entry(at);
      const auto& f = h.files[at.file];
      out.push_back({n, t.type, t.shape, hash_range(f.storage, f.header.offset_of(t), t.nbytes(), pr)});
    }
  } else {
    auto parts = open_checkpoint(in);
    std::uint64_t total = 0;
    for (auto& p : parts)
      for (const auto& [k, tm] : p.reader->metadata().tensors) total += tm.numel() * bit_size(tm.type) / 8;
    progress pr("digest", total);
    for (auto& p : parts)
      for (const auto& [key, tm] : p.reader->metadata().tensors) {
        tool::sha256 h;
        for_each_full_chunk(*p.reader, key, [&](std::span<const std::byte> b, std::uint64_t) {
          h.update(b);
          pr.add(b.size());
        });
        out.push_back({p.prefix + key, tm.type, tm.shape, h.hex()});
      }
  }
  std::sort(out.begin(), out.end(), [](const line& a, const line& b) { return a.name < b.name; });
  for (const auto& l : out) std::cout << one_line(l.name) << ' ' << name(l.type) << ' ' << shape_str(l.shape) << ' ' << l.hex << '\n';
  return 0;
}

int cmd_unshard(const input& in, const std::string& out_path) {
  if (in.k == kind::file)
    fail(errc::invalid_argument, in.path.string() + ": unshard needs a folder (a checkpoint or a Hugging Face folder)");
  auto parts = open_checkpoint(in);
  std::vector<unshard_source<file_directory>> sources;
  for (auto& p : parts) sources.push_back({p.reader.get(), p.prefix});
  file_writer w(out_path);
  const std::uint64_t size = unshard_to_safetensors(std::span<const unshard_source<file_directory>>(sources), w);
  std::cout << "wrote " << out_path << ": " << size << " bytes\n";
  return 0;
}

/// Prints on stderr, for each rule with a warning (a preset's), how many names it decided and
/// the first few of them: `shardsafe: warning: N name(s) WARNING: OLD -> NEW, ...`.
void warn_renames(const std::vector<std::string>& keys, const rename_rules& rules) {
  std::map<const rename_rule*, std::vector<std::string>> hits;
  for (const auto& k : keys) {
    const rename_rule* by = nullptr;
    const std::string n = rules.apply(k, &by);
    if (by && !by->warning.empty()) hits[by].push_back(n.empty() ? k : k + " -> " + n);
  }
  for (const auto& r : rules.rules())
    if (auto it = hits.find(&r); it != hits.end()) {
      std::string list;
      for (std::size_t i = 0; i < it->second.size() && i < 5; ++i) list += (i ? ", " : "") + one_line(it->second[i]);
      if (it->second.size() > 5) list += ", ...";
      std::cerr << "shardsafe: warning: " << it->second.size() << " name(s) " << r.warning << ": " << list << "\n";
    }
}

int cmd_to_hf(const input& in, const std::string& out_path, hf_export_options opt) {
  std::vector<std::string> keys;
  if (in.k == kind::file) {
    for (const auto& t : read_safetensors_header(file_storage(in.path)).tensors) keys.push_back(t.name);
  } else {
    for (auto& p : open_checkpoint(in))
      if (p.prefix.empty() || p.prefix == std::string(model_folder_name) + "/")
        for (const auto& [k, tm] : p.reader->metadata().tensors) keys.push_back(k);
  }
  warn_renames(keys, opt.rename);
  progress pr("to-hf", 0);
  opt.progress = [&](std::uint64_t done, std::uint64_t total) { pr.set(done, total); };
  const file_directory out(out_path);
  hf_export_stats st;
  if (in.k == kind::file) {
    const file_directory dir(in.path.parent_path());
    checkpoint_reader<file_directory> r(dir, single_file_source(dir, in.path.filename().string()));
    const unshard_source<file_directory> src{&r, ""};
    st = export_hf(std::span<const unshard_source<file_directory>>(&src, 1), out, opt);
  } else {
    st = export_hf(file_directory(in.path), out, opt);
  }
  std::cout << "wrote " << out_path << ": " << st.files << " file(s)" << (st.indexed ? " and " + std::string(hf_index_file) : "")
            << ", " << st.tensors << " tensors, " << st.bytes << " bytes\n";
  return 0;
}

/// What --help prints after the commands.
constexpr const char* path_help =
    "PATH is a safetensors file, a Hugging Face folder (model.safetensors or an index), a\n"
    "checkpoint folder (with metadata.json, or with model/ and optim/) or a folder of torch's\n"
    "DCP-sharded Hugging Face files (safetensors with DCP_SHARDING_INFO).";

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Inspect, verify, digest and unshard safetensors files, Hugging Face folders and sharded\n"
               "checkpoints, and export them to Hugging Face folders (docs/FORMAT.md §4).",
               "shardsafe");
  app.footer(path_help);
  app.set_version_flag("--version", "shardsafe " + std::string(library_version));
  app.require_subcommand(1);
  std::string path, out_path;
  auto command = [&](const char* name, const char* what, const char* path_name, const char* path_what) {
    CLI::App* c = app.add_subcommand(name, what);
    c->add_option(path_name, path, path_what)->required();
    return c;
  };
  const char* any_path = "a safetensors file, a Hugging Face folder, a checkpoint folder or torch's DCP-sharded HF files";
  CLI::App* inspect = command("inspect", "list the tensors: name, dtype, shape, bytes, where stored, how sharded", "PATH",
                              any_path);
  CLI::App* verify = command("verify", "check every rule of the format; exit 1 with one line naming file, tensor and rule",
                             "PATH", any_path);
  CLI::App* digest = command("digest", "one line per tensor, sorted by name: NAME DTYPE [SHAPE] SHA256 of its bytes",
                             "PATH", any_path);
  CLI::App* unshard = command("unshard", "write the full tensors of a checkpoint into one safetensors file", "CKPT",
                              "a checkpoint folder (with metadata.json, or with model/ and optim/), a Hugging Face "
                              "folder or torch's DCP-sharded HF files");
  unshard->add_option("OUT", out_path, "the safetensors file to write")->required();
  CLI::App* to_hf = command("to-hf", "export to a Hugging Face folder: model.safetensors, or model-0000K-of-0000N "
                            "files of at most SIZE tensor bytes and model.safetensors.index.json", "SRC", any_path);
  to_hf->add_option("OUTDIR", out_path, "the folder to write; it must not exist or be empty")->required();
  std::string max_size = "5GB", to_dtype, preset;
  std::vector<std::string> renames;
  bool model_only = false;
  to_hf->add_option("--max-shard-size", max_size, "tensor bytes per file: 5GB, 500MB, 4KB (decimal), 4GiB (binary) or "
                                                  "a plain number of bytes")
      ->check(CLI::Validator([](std::string& s) -> std::string {
        try {
          parse_size(s);
          return {};
        } catch (const std::exception& e) {
          return e.what();
        }
      }, "SIZE"))
      ->capture_default_str();
  to_hf->add_option("--dtype", to_dtype, "convert F16/BF16/F32/F64 tensors to this dtype (round to nearest even); "
                                         "integer, BOOL and F8 tensors are never converted")
      ->check(CLI::IsMember({"bf16", "f16", "f32"}, CLI::ignore_case));
  to_hf->add_option("--rename", renames, "REGEX=REPL: rename tensors (rules in order, the first that matches wins; "
                                         "REPL as Python's re.sub: \\1 for a group; a name renamed to nothing is dropped)")
      ->allow_extra_args(false)
      ->check(CLI::Validator([](std::string& s) -> std::string {
        try {
          parse_rename_rule(s);
          return {};
        } catch (const std::exception& e) {
          return e.what();
        }
      }, "REGEX=REPL"));
  to_hf->add_option("--preset", preset, "dcp-to-hf: after the --rename rules, name a torch DCP model's keys as Hugging "
                                        "Face does: wrapper names (_orig_mod., _fsdp_wrapped_module., "
                                        "_checkpoint_wrapped_module.) removed, then model.model.X -> model.X, "
                                        "model.lm_head.weight -> lm_head.weight, other model.X -> X (a warning), other "
                                        "keys dropped (a warning)")
      ->check(CLI::IsMember({"dcp-to-hf"}));
  to_hf->add_flag("--model-only", model_only, "for a model + optimizer checkpoint, export model/ only (the default)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version: printed on stdout, exit 0; anything else is a usage error
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e, std::cout, std::cerr);
    std::string why = e.what();
    const std::string first = argc > 1 ? argv[1] : "";
    if (!first.empty() && first[0] != '-' &&
        app.get_subcommands([&](const CLI::App* c) { return c->get_name() == first; }).empty())
      why = "unknown command '" + first + "': the commands are inspect, verify, digest, unshard and to-hf";
    std::cerr << "shardsafe: " << one_line(why) << " (shardsafe --help lists the commands)\n";
    return 2;
  }
  const std::string cmd = app.get_subcommands().front()->get_name();
  try {
    if (inspect->parsed()) return cmd_inspect(classify(path));
    if (verify->parsed()) return cmd_verify(classify(path));
    if (digest->parsed()) return cmd_digest(classify(path));
    if (unshard->parsed()) return cmd_unshard(classify(path), out_path);
    if (to_hf->parsed()) {
      hf_export_options opt;
      opt.max_shard_size = parse_size(max_size);
      if (!to_dtype.empty()) {  // bf16, f16 or f32 in any case (checked above): the dtype names in capitals
        std::transform(to_dtype.begin(), to_dtype.end(), to_dtype.begin(), [](unsigned char c) { return std::toupper(c); });
        opt.convert_to = dtype_from_name(to_dtype, "--dtype");
      }
      for (const auto& r : renames) opt.rename.add(r);
      if (!preset.empty()) add_preset(opt.rename, preset);
      opt.model_only = true;  // --model-only or not: HF folders hold model weights
      return cmd_to_hf(classify(path), out_path, opt);
    }
  } catch (const std::bad_alloc&) {
    std::cerr << "shardsafe: " << cmd << ": out of memory\n";
  } catch (const std::exception& e) {
    std::cerr << "shardsafe: " << one_line(e.what()) << "\n";
  }
  return 1;
}
