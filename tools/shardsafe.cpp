// shardsafe - inspect, verify, digest and unshard safetensors files, Hugging Face folders,
// sharded checkpoints, torch DCP folders and torch's DCP-sharded HF files, and export any of them
// to a Hugging Face folder or a torch DCP folder (docs/FORMAT.md §4). A thin command line over the library: validation lives in
// checkpoint/hf/folder.hpp and checkpoint/verify.hpp, the export in checkpoint/hf/export.hpp,
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
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "sha256.hpp"
#include "shardsafe/checkpoint/dcp_export.hpp"
#include "shardsafe/checkpoint/hf/export.hpp"
#include "shardsafe/checkpoint/hf/folder.hpp"
#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/checkpoint/verify.hpp"
#include "shardsafe/checkpoint/verify_optim.hpp"
#include "shardsafe/format/hf_export.hpp"
#include "shardsafe/format/hf_index.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/rename.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/storage/file.hpp"
#if SHARDSAFE_TOOL_REMOTE
#include "shardsafe/storage/http.hpp"
#include "shardsafe/storage/s3.hpp"
#endif
#include "shardsafe/version.hpp"

namespace fs = std::filesystem;
using namespace shardsafe;

namespace {

constexpr std::uint64_t chunk_bytes = std::uint64_t(64) << 20;

/// A message as one line of text: control characters (a newline or an escape sequence in a
/// tensor or file name read from the input) are written as \n, \r, \t or \xHH.
std::string one_line(std::string_view s) {
  std::string r;
  for (unsigned char c : s) {
    if (c == '\n')
      r += "\\n";
    else if (c == '\r')
      r += "\\r";
    else if (c == '\t')
      r += "\\t";
    else if (c < 0x20 || c == 0x7f) {
      r += "\\x";
      shardsafe::detail::append_hex(r, c, 2);
    } else
      r += static_cast<char>(c);
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
    std::fprintf(stderr, "\r\033[K[%s] %.1f / %.1f MB (%.0f%%)", what_.c_str(), double(done_) / 1e6,
                 double(total_) / 1e6, total_ ? 100.0 * double(done_) / double(total_) : 100.0);
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

/// PATH classified, with the directory type D that reads it: file_directory for a local path,
/// http_directory or s3_directory for a URL.
template <ReadableDirectory D>
struct input {
  kind k;
  std::string path;                              // as given, for messages
  D dir;                                         // the folder; for kind::file the folder that holds the file
  std::string file;                              // kind::file: its name in dir
  std::vector<std::pair<std::string, D>> parts;  // checkpoint_pair: {"model", dir}, {"optim", dir}
};

/// Whether s names a URL the remote backends take (http://, https:// or s3://, any case).
bool is_url(std::string_view s) {
  const std::size_t at = s.find("://");
  if (at == std::string_view::npos) return false;
  std::string scheme;
  for (char c : s.substr(0, at)) scheme += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return scheme == "http" || scheme == "https" || scheme == "s3";
}
bool is_http_url(std::string_view s) { return is_url(s) && std::tolower(static_cast<unsigned char>(s[0])) == 'h'; }

#if SHARDSAFE_TOOL_REMOTE
/// A URL cut at its last '/' into the folder URL and the object name ("s3://b/x/y.st" ->
/// "s3://b/x", "y.st"); a URL with no path below its host is a usage error.
std::pair<std::string, std::string> split_url(const std::string& url) {
  const std::size_t host = url.find("://") + 3, slash = url.rfind('/');
  if (slash == std::string::npos || slash < host || slash + 1 == url.size())
    fail(errc::invalid_argument, url + ": a URL of a file needs a name after the last '/'");
  return {url.substr(0, slash), url.substr(slash + 1)};
}
#endif

/// How local folders treat symbolic links (--follow-links: all followed; else links that leave
/// the folder are refused, storage/file.hpp).
link_policy g_links = link_policy::inside;

/// Whether D can list a folder (a local one and s3 can; an HTTP server cannot, so its objects
/// are probed by name).
template <class D>
constexpr bool lists = true;
#if SHARDSAFE_TOOL_REMOTE
template <>
constexpr bool lists<http_directory> = false;
#endif

/// The folder p names, classified by which objects exist in it (one rule for local folders and
/// URLs: an object store has no folders to stat): a folder a layout recognises
/// (checkpoint/layouts/registry.hpp) is a checkpoint of it (one of whole files, a Hugging Face
/// folder, is read file by file); else model/ or optim/ with a commit mark (or, where the folder
/// lists, anything in it) make a model + optimizer pair; else, where the folder lists, .distcp
/// files make a checkpoint for the reader to name.
template <ReadableDirectory D>
input<D> classify_folder(const std::string& p, D dir) {
  if (const layout_info* layout = recognise_folder(dir))
    return {layout->folder_of_whole_files ? kind::hf : kind::checkpoint, p, dir, {}, {}};
  input<D> in{kind::checkpoint_pair, p, dir, {}, {}};
  for (const std::string_view part : {model_folder_name, optim_folder_name}) {
    D sub = dir.sub(part);
    bool has = false;
    for (std::string_view mark : commit_mark_names) has = has || sub.exists(mark);
    if constexpr (lists<D>) has = has || !sub.list().empty();
    if (has) in.parts.emplace_back(std::string(part), sub);
  }
  if (!in.parts.empty()) return in;
  if constexpr (lists<D>)
    for (const auto& n : dir.list())
      if (n.ends_with(".distcp")) return {kind::checkpoint, p, dir, {}, {}};
  fail(errc::not_found, p + ": no such checkpoint: none of " + std::string(metadata_file_name) + ", model/, optim/, " +
                            std::string(hf_index_file) + ", " + std::string(hf_single_file) + ", " +
                            std::string(hf_bin_index_file) + ", " + std::string(hf_bin_single_file) + ", " +
                            std::string(dcp_metadata_file_name) + ", *.safetensors or *.distcp in it" +
                            (lists<D> ? "" : " (an HTTP server is probed for these names; it cannot list a folder)"));
}

/// A local PATH classified: a regular file is one safetensors (or torch.save) file, a folder as classify_folder.
input<file_directory> classify(const std::string& p) {
  fs::path path(p);
  std::error_code ec;
  auto st = fs::status(path, ec);
  if (ec || !fs::exists(st)) fail(errc::not_found, p + ": no such file or directory");
  if (fs::is_regular_file(st))
    return {kind::file, p, file_directory(path.parent_path(), g_links), path.filename().string(), {}};
  if (!fs::is_directory(st)) fail(errc::invalid_argument, p + ": not a regular file or directory");
  return classify_folder(p, file_directory(path, g_links));
}

#if SHARDSAFE_TOOL_REMOTE
/// A URL classified: a name ending in .safetensors (or a torch.save file's .bin, .pt, .pth) is one file, anything else a folder
/// (classify_folder).
template <ReadableDirectory D>
input<D> classify_url(const std::string& p) {
  const std::string_view url_path = std::string_view(p).substr(0, p.find('?'));
  if (url_path.ends_with(".safetensors") || url_path.ends_with(".bin") || url_path.ends_with(".pt") ||
      url_path.ends_with(".pth")) {
    auto [folder, name] = split_url(std::string(url_path));
    D dir(folder);
    if (!dir.exists(name)) fail(errc::not_found, p + ": no such object");
    return {kind::file, p, std::move(dir), name, {}};
  }
  return classify_folder(p, D(p));
}
#endif

/// Calls f(input<D>) with PATH classified: local paths through file_directory, URLs through
/// the http or s3 backend (when built with them).
template <class F>
int with_input(const std::string& p, F&& f) {
  if (!is_url(p)) return f(classify(p));
#if SHARDSAFE_TOOL_REMOTE
  if (is_http_url(p)) return f(classify_url<http_directory>(p));
  return f(classify_url<s3_directory>(p));
#else
  fail(errc::invalid_argument, p + ": a URL, but this shardsafe was built without remote storage (Boost.Asio and "
                                   "OpenSSL; configure with -Dremote=enabled)");
#endif
}

/// The file of a kind::file input, opened: a local file by the path as given (messages name it
/// so), an object through its folder.
template <ReadableDirectory D>
typename D::reader_type open_file(const input<D>& in) {
  if constexpr (std::is_same_v<D, file_directory>)
    return file_storage(in.path);
  else
    return in.dir.open(in.file);
}

/// The index of a kind::file input: its safetensors header, or a torch.save file's with the
/// values of a training checkpoint that are not tensors (format/torch_save.hpp).
template <ReadableStorage S>
torch_save_index index_file(const S& s) {
  if (is_torch_save_file(s)) return index_torch_save_file(s);
  return {read_safetensors_header(s), {}, {}};
}

/// The Hugging Face folder in in.dir, opened and validated (checkpoint/hf/folder.hpp).
template <ReadableDirectory D>
hf_folder<D> open_hf(const input<D>& in) {
  return open_hf_folder(in.dir);
}

/// Whether a file of h stores a tensor's dimensions in another order than row-major (a
/// torch.save file's transposed tensor), so that its bytes are not the tensor's in order.
template <ReadableDirectory D>
bool stores_permuted(const hf_folder<D>& h) {
  for (const auto& f : h.files)
    for (const auto& t : f.header.tensors)
      if (!f.header.stored_order(t).empty()) return true;
  return false;
}

// ---------------------------------------------------------------------------------------
// checkpoints

template <ReadableDirectory D>
struct ckpt_part {
  std::string prefix;  // "" or "model/" / "optim/"
  std::unique_ptr<checkpoint_reader<D>> reader;
};

/// The checkpoint's parts, opened (a single file: itself, every tensor whole). One rule set for every command: every file the writer
/// recorded (metadata.json's shardsafe.file_sizes) must be there, valid, with its size, as verify
/// requires, whether or not a tensor of it is read.
template <ReadableDirectory D>
std::vector<ckpt_part<D>> open_checkpoint(const input<D>& in) {
  std::vector<ckpt_part<D>> parts;
  if (in.k == kind::file) {
    parts.push_back({"", std::make_unique<checkpoint_reader<D>>(in.dir, single_file_source(in.dir, in.file))});
  } else if (in.k == kind::checkpoint || in.k == kind::hf) {
    parts.push_back({"", std::make_unique<checkpoint_reader<D>>(in.dir)});
  } else {
    for (const auto& [name, dir] : in.parts) parts.push_back({name + "/", std::make_unique<checkpoint_reader<D>>(dir)});
  }
  for (auto& p : parts)
    for (const auto& [fname, size] : p.reader->metadata().extras.file_sizes) p.reader->file(fname);
  return parts;
}

/// The distinct files tm's parts are in, in order (a DCP file holding two chunks of a tensor is
/// listed under two names: checkpoint_reader::path_of).
template <class Reader>
std::vector<std::string> files_of(const tensor_metadata& tm, const Reader& r) {
  std::vector<std::string> out;
  for (const auto& [f, s] : tm.file_specs())
    if (std::find(out.begin(), out.end(), r.path_of(f)) == out.end()) out.push_back(r.path_of(f));
  return out;
}

/// "blocks over 3 file(s)"; "blocks (4) over 3 file(s)" when a file holds two parts.
std::string describe_sharding(const tensor_metadata& tm, std::size_t files) {
  if (!tm.is_sharded) return "not sharded";
  if (tm.grid)
    return std::string(tm.grid->flat ? "flattened offsets" : "blocks") + " over " + std::to_string(files) +
           " file(s), a grid";
  bool flat = true, block = true;
  for (const auto& [f, s] : tm.files) {
    flat = flat && s.is_flat();
    block = block && s.is_block();
  }
  std::string how = flat ? "flattened offsets" : block ? "blocks" : "flattened offsets and blocks";
  if (tm.files.size() != files) how += " (" + std::to_string(tm.files.size()) + ")";
  return how + " over " + std::to_string(files) + " file(s)";
}

// ---------------------------------------------------------------------------------------
// commands

struct row {
  std::string name, dtype, shape, bytes, stored, sharding;
};

void print_rows(const std::string& title, std::vector<row> rows) {
  // every field that came from the input (names, file names) escaped, one way: no control
  // byte from a checkpoint reaches the terminal
  for (auto& r : rows)
    for (std::string* f : {&r.name, &r.dtype, &r.shape, &r.bytes, &r.stored, &r.sharding}) *f = one_line(*f);
  std::sort(rows.begin(), rows.end(), [](const row& a, const row& b) { return a.name < b.name; });
  // the title's lines, each escaped (a __metadata__ value may hold a newline)
  std::size_t start = 0;
  while (true) {
    const std::size_t nl = title.find('\n', start);
    std::cout << one_line(title.substr(start, nl == std::string::npos ? std::string::npos : nl - start)) << "\n";
    if (nl == std::string::npos) break;
    start = nl + 1;
  }
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
    std::cout << pad(r.name, w[0]) << pad(r.dtype, w[1]) << pad(r.shape, w[2]) << pad(r.bytes, w[3])
              << pad(r.stored, w[4]) << r.sharding << "\n";
  };
  line(head);
  for (const auto& r : rows) line(r);
}

template <ReadableDirectory D>
int cmd_inspect(const input<D>& in) {
  std::vector<row> rows;
  if (in.k == kind::file) {
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
      rows.push_back({v.name, "-", "-", "-", "pickle", "value: " + one_line(pickle_repr(v.value, 60))});
    std::string title =
        "# " + in.path + (torch_save ? ": torch.save file, " : ": safetensors file, ") +
        std::to_string(h.tensors.size()) + " tensors, " + std::to_string(total) + " bytes of data" +
        (x.values.empty() ? std::string() : ", " + std::to_string(x.values.size()) + " value(s) that are not tensors") +
        (torch_save ? std::string() : ", header " + std::to_string(h.header_size) + " bytes");
    for (const auto& [k, v] : h.metadata) title += "\n# __metadata__ " + one_line(k) + " = " + one_line(v);
    print_rows(title, rows);
    return 0;
  }
  if (in.k == kind::hf) {
    const auto h = open_hf(in);
    for (const auto& [n, at] : h.tensors) {
      const tensor_entry& t = h.entry(at);
      rows.push_back({n, std::string(to_string(t.type)), shape_str(t.shape), std::to_string(t.nbytes()),
                      h.files[at.file].name, "-"});
    }
    print_rows("# " + in.path + ": Hugging Face " + (h.sharded() ? "sharded checkpoint, " : "checkpoint, ") +
                   (h.torch_bin ? "torch.save files (" + h.described_by + "), " : std::string()) +
                   std::to_string(h.files.size()) + " file(s), " + std::to_string(h.tensors.size()) + " tensors, " +
                   std::to_string(h.tensor_bytes()) + " bytes",
               rows);
    return 0;
  }
  auto parts = open_checkpoint(in);
  std::uint64_t total = 0;
  std::string writer;
  const std::string what(parts.front().reader->layout().name);
  for (auto& p : parts) {
    const auto& md = p.reader->metadata();
    if (!md.extras.writer.empty()) writer = md.extras.writer;
    for (const auto& [key, tm] : md.tensors) {
      const std::uint64_t bytes = tm.numel() * bit_size(tm.type) / 8;
      total += bytes;
      const auto files = files_of(tm, *p.reader);
      std::string stored;
      for (std::size_t i = 0; i < files.size() && i < 4; ++i) stored += (i ? "," : "") + files[i];
      if (files.size() > 4) stored += ",...";
      rows.push_back({p.prefix + key, std::string(to_string(tm.type)), shape_str(tm.shape), std::to_string(bytes),
                      stored, describe_sharding(tm, files.size())});
    }
  }
  const std::size_t tensors = rows.size();
  for (auto& p : parts)
    for (const auto& t : p.reader->foreign_tensors())
      rows.push_back({p.prefix + t.key, t.dtype, shape_str(t.shape), "-", p.reader->described_by(),
                      std::to_string(t.chunks) + " chunk(s); a dtype shardsafe has no type for (not read)"});
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
                 (writer.empty() ? "" : ", written by " + writer),
             rows);
  return 0;
}

template <ReadableDirectory D>
int cmd_verify(const input<D>& in) {
  std::size_t n = 0;
  if (in.k == kind::file) {
    const auto s = open_file(in);
    n = index_file(s).header.tensors.size();
  } else if (in.k == kind::hf) {
    const auto h = open_hf(in);
    check_unlisted_hf_files(in.dir, h);
    n = h.tensors.size();
  } else {
    // what was read besides headers: checksums (sharded checkpoints) and replicas
    std::uint64_t blocks = 0, hashed = 0, replicated = 0;
    std::size_t sharded = 0, unchecked = 0;
    for (auto& p : open_checkpoint(in)) {
      const checkpoint_report rep = verify_checkpoint(*p.reader);
      // the optimizer's pickles through the loader's plain-data reader, and its layout's rules
      if (p.prefix == std::string(optim_folder_name) + "/") verify_optimizer_layout(*p.reader);
      n += rep.tensors;
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
    std::cout << "OK " << one_line(in.path) << ": " << n << " tensors valid" << one_line(notes) << "\n";
    return 0;
  }
  std::cout << "OK " << one_line(in.path) << ": " << n << " tensors valid\n";
  return 0;
}

template <ReadableDirectory D>
int cmd_digest(const input<D>& in) {
  struct line {
    std::string name;
    dtype type;
    shape_t shape;
    std::string hex;
  };
  std::vector<line> out;
  auto hash_range = [](const auto& s, std::uint64_t off, std::uint64_t len, progress& pr) {
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
  // a Hugging Face folder's tensors are hashed as raw ranges, as its files hold each tensor in
  // order; one whose torch.save file holds a transposed tensor goes through the reader below
  std::optional<hf_folder<D>> hf;
  if (in.k == kind::hf)
    if (auto h = open_hf(in); !stores_permuted(h)) hf.emplace(std::move(h));
  if (in.k == kind::file && !is_torch_save_file(open_file(in))) {
    const auto s = open_file(in);
    auto h = read_safetensors_header(s);
    progress pr("digest", h.data_size);
    for (const auto& t : h.tensors)
      out.push_back({t.name, t.type, t.shape, hash_range(s, h.offset_of(t), t.nbytes(), pr)});
  } else if (hf) {
    const auto& h = *hf;
    std::uint64_t total = 0;
    for (const auto& [n, at] : h.tensors) total += h.entry(at).nbytes();
    progress pr("digest", total);
    for (const auto& [n, at] : h.tensors) {
      const tensor_entry& t = h.entry(at);
      const auto& f = h.files[at.file];
      out.push_back({n, t.type, t.shape, hash_range(f.storage, f.header.offset_of(t), t.nbytes(), pr)});
    }
  } else {
    auto parts = open_checkpoint(in);
    // an item whose value holds tensors, or a tensor of a dtype shardsafe has no type for, is
    // refused, not left out of the digest (unshard and the exports check the same in the library)
    for (auto& p : parts) p.reader->check_all_readable();
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
  for (const auto& l : out)
    std::cout << one_line(l.name) << ' ' << to_string(l.type) << ' ' << shape_str(l.shape) << ' ' << l.hex << '\n';
  return 0;
}

/// Refuses a local output that would write over what is being read: the same file as an input
/// (same inode: a link or another name of it), or anything inside the input's folder (a rank
/// file, metadata.json, .metadata, a .distcp or a folder in the checkpoint), before anything is
/// opened for writing.
template <ReadableDirectory D>
void refuse_output_over_input(const input<D>& in, const std::string& out_path, const char* what) {
  if constexpr (std::is_same_v<D, file_directory>) {
    if (is_url(out_path)) return;
    std::error_code ec;
    const fs::path out = fs::weakly_canonical(fs::absolute(out_path), ec);
    if (ec) return;  // cannot say; the writer will report what is wrong with the path
    if (in.k == kind::file) {
      if (fs::exists(out, ec) && fs::equivalent(out, fs::path(in.path), ec))
        fail(errc::invalid_argument,
             out_path + ": is the input file " + in.path + "; refusing to write " + what + " over it");
      return;
    }
    const fs::path folder = fs::weakly_canonical(fs::absolute(in.dir.path()), ec);
    if (ec) return;
    const auto rel = out.lexically_relative(folder);
    if (out == folder || (!rel.empty() && *rel.begin() != ".." && !rel.is_absolute()))
      fail(errc::invalid_argument, out_path + ": lies inside the input folder " + in.path + "; refusing to write " +
                                       what + " there (it could overwrite the checkpoint being read)");
    // another name of one of the input's files (a hard link elsewhere)
    if (fs::exists(out, ec) && fs::is_regular_file(out, ec))
      for (const auto& e : fs::recursive_directory_iterator(folder, fs::directory_options::skip_permission_denied, ec))
        if (e.is_regular_file(ec) && fs::equivalent(e.path(), out, ec))
          fail(errc::invalid_argument, out_path + ": is the input's file " + e.path().string() +
                                           " under another name; refusing to write " + what + " over it");
  } else {
    (void)in, (void)out_path, (void)what;
  }
}

/// Refuses an output URL the tool cannot write: HTTP is read-only; without the remote backends
/// no URL at all.
void check_output_url(const std::string& out_path, const char* what) {
  if (is_http_url(out_path))
    fail(errc::invalid_argument, out_path + ": cannot write " + what +
                                     " over HTTP(S), which is read-only; write to a "
                                     "local path or to s3://BUCKET/PREFIX");
#if !SHARDSAFE_TOOL_REMOTE
  fail(errc::invalid_argument, out_path +
                                   ": a URL, but this shardsafe was built without remote storage (Boost.Asio and "
                                   "OpenSSL; configure with -Dremote=enabled)");
#endif
}

template <ReadableDirectory D>
int cmd_unshard(const input<D>& in, const std::string& out_path) {
  if (in.k == kind::file)
    fail(errc::invalid_argument, in.path + ": unshard needs a folder (a checkpoint or a Hugging Face folder)");
  if (is_url(out_path)) check_output_url(out_path, "the unsharded file");
  refuse_output_over_input(in, out_path, "the unsharded file");
  auto parts = open_checkpoint(in);
  std::vector<unshard_source<D>> sources;
  for (auto& p : parts) sources.push_back({p.reader.get(), p.prefix});
  const std::span<const unshard_source<D>> all(sources);
  std::uint64_t size = 0;
  if (!is_url(out_path)) {
    file_writer w(out_path);
    size = unshard_to_safetensors(all, w);
  } else {
#if SHARDSAFE_TOOL_REMOTE
    const auto [folder, name] = split_url(out_path);
    auto w = s3_directory(folder).create(name);  // one PUT, or a multipart upload aborted on failure
    size = unshard_to_safetensors(all, w);
#endif
  }
  std::cout << "wrote " << one_line(out_path) << ": " << size << " bytes" << left_out(parts) << "\n";
  return 0;
}

/// What a safetensors output leaves out of parts: "; N non-tensor item(s) left out (...)", or "".
template <ReadableDirectory D>
std::string left_out(const std::vector<ckpt_part<D>>& parts) {
  std::size_t n = 0;
  for (const auto& p : parts) n += p.reader->non_tensors().size();
  return n ? "; " + std::to_string(n) + " non-tensor item(s) left out (safetensors holds tensors; to-dcp keeps them)"
           : std::string();
}

/// The warnings of the rules that have one (a preset's): for each, how many names it decided and
/// the first few of them, `shardsafe: warning: N name(s) WARNING: OLD -> NEW, ...`, a line each;
/// printed once the export succeeded (a failed one prints its one error line alone).
std::string rename_warnings(const std::vector<std::string>& keys, const rename_rules& rules) {
  std::string out;
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
      out += "shardsafe: warning: " + std::to_string(it->second.size()) + " name(s) " + r.warning + ": " + list + "\n";
    }
  return out;
}

template <ReadableDirectory D>
int cmd_to_hf(const input<D>& in, const std::string& out_path, hf_export_options opt) {
  if (is_url(out_path)) check_output_url(out_path, "a Hugging Face folder");
  refuse_output_over_input(in, out_path, "a Hugging Face folder");
  // the parts opened once, for the rename warnings' keys and the export (as export_to(dir) takes
  // them: a pair's model/, and its optim/ unless model_only, which also drops the prefixes)
  auto parts = open_checkpoint(in);
  const bool pair = in.k == kind::checkpoint_pair;
  if (pair && std::none_of(parts.begin(), parts.end(),
                           [](const auto& p) { return p.prefix == std::string(model_folder_name) + "/"; }))
    fail(errc::not_found, in.path + ": a model + optimizer checkpoint without model/; nothing to export");
  std::vector<std::string> keys;
  std::vector<unshard_source<D>> sources;
  for (auto& p : parts) {
    const bool model = p.prefix.empty() || p.prefix == std::string(model_folder_name) + "/";
    if (model)
      for (const auto& [k, tm] : p.reader->metadata().tensors) keys.push_back(k);
    if (model || !opt.model_only) sources.push_back({p.reader.get(), pair && !opt.model_only ? p.prefix : ""});
  }
  const std::span<const unshard_source<D>> src(sources);
  const std::string warnings = rename_warnings(keys, opt.rename);
  progress pr("to-hf", 0);
  opt.progress = [&](std::uint64_t done, std::uint64_t total) { pr.set(done, total); };
  hf_export_stats st;
  if (!is_url(out_path)) {
    st = export_to(src, file_directory(out_path), opt);
  } else {
#if SHARDSAFE_TOOL_REMOTE
    st = export_to(src, s3_directory(out_path), opt);  // "must be empty" holds for the prefix: it is listed
#endif
  }
  std::cerr << warnings;
  std::cout << "wrote " << one_line(out_path) << ": " << st.files << " file(s)"
            << (st.indexed ? " and " + std::string(hf_index_file) : "") << ", " << st.tensors << " tensors, "
            << st.bytes << " bytes" << left_out(parts) << "\n";
  return 0;
}

template <ReadableDirectory D>
int cmd_to_dcp(const input<D>& in, const std::string& out_path, const dcp_export_options& opt) {
  if (is_url(out_path))
    fail(errc::invalid_argument, out_path + ": to-dcp writes a local folder (torch's DCP reader reads files)");
  refuse_output_over_input(in, out_path, "a DCP folder");
  auto parts = open_checkpoint(in);  // the export checks every item, and refuses what it cannot write
  std::vector<unshard_source<D>> sources;
  for (auto& p : parts) sources.push_back({p.reader.get(), p.prefix});
  const auto st = export_to(std::span<const unshard_source<D>>(sources), file_directory(out_path), opt);
  std::cout << "wrote " << one_line(out_path) << ": " << st.tensors << " tensors"
            << (st.objects ? " and " + std::to_string(st.objects) + " non-tensor items" : "") << " in "
            << dcp_data_file_name(0) << " (" << st.bytes << " bytes) and " << dcp_metadata_file_name << "\n";
  return 0;
}

/// What --help prints after the commands.
constexpr const char* path_help =
    "PATH is a safetensors file, a torch.save file (pytorch_model.bin, or a training checkpoint's\n"
    ".pt with its epoch and optimizer values; read without running its pickle), a Hugging Face folder "
    "(model.safetensors, pytorch_model.bin or an index), a\n"
    "checkpoint folder (with metadata.json, or with model/ and optim/) or a folder of torch's\n"
    "DCP-sharded Hugging Face files (safetensors with DCP_SHARDING_INFO). Any of these may be a\n"
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
