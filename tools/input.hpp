// tools/input.hpp - what the shardsafe tool's PATH is and how it is opened: a local path or a
// URL (http(s):// read, s3://), classified as one file, a folder a layout recognises
// (checkpoint/layouts/registry.hpp), or a model + optimizer pair's model/ and optim/; the
// checkpoint's parts opened with one rule set for every command.
#pragma once

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/hf/folder.hpp"
#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/checkpoint/layouts/registry.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/quant.hpp"
#include "shardsafe/checkpoint/verify_optim.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/hf_index.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/format/torch_save.hpp"
#include "shardsafe/storage/file.hpp"
#if SHARDSAFE_TOOL_REMOTE
#include "shardsafe/storage/http.hpp"
#include "shardsafe/storage/s3.hpp"
#endif

namespace shardsafe::tool {

namespace fs = std::filesystem;

/// What PATH is: one file; a folder whose layout keeps every tensor whole in one file
/// (layout_info::folder_of_whole_files: a Hugging Face folder), read file by file; a checkpoint
/// of any other layout; or a model + optimizer pair's model/ and optim/.
enum class kind { file, whole_files, checkpoint, checkpoint_pair };

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
inline bool is_url(std::string_view s) {
  const std::size_t at = s.find("://");
  if (at == std::string_view::npos) return false;
  std::string scheme;
  for (char c : s.substr(0, at)) scheme += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return scheme == "http" || scheme == "https" || scheme == "s3";
}
inline bool is_http_url(std::string_view s) {
  return is_url(s) && std::tolower(static_cast<unsigned char>(s[0])) == 'h';
}

#if SHARDSAFE_TOOL_REMOTE
/// A URL cut at its last '/' into the folder URL and the object name ("s3://b/x/y.st" ->
/// "s3://b/x", "y.st"); a URL with no path below its host is a usage error.
inline std::pair<std::string, std::string> split_url(const std::string& url) {
  const std::size_t host = url.find("://") + 3, slash = url.rfind('/');
  if (slash == std::string::npos || slash < host || slash + 1 == url.size())
    fail(errc::invalid_argument, url + ": a URL of a file needs a name after the last '/'");
  return {url.substr(0, slash), url.substr(slash + 1)};
}
#endif

/// How local folders treat symbolic links (--follow-links: all followed; else links that leave
/// the folder are refused, storage/file.hpp).
inline link_policy g_links = link_policy::inside;

/// Whether D can list a folder (a local one and s3 can; an HTTP server cannot, so its objects
/// are probed by name).
template <class D>
inline constexpr bool lists = true;
#if SHARDSAFE_TOOL_REMOTE
template <>
inline constexpr bool lists<http_directory> = false;
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
    return {layout->folder_of_whole_files ? kind::whole_files : kind::checkpoint, p, dir, {}, {}};
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
inline input<file_directory> classify(const std::string& p) {
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
  return {read_safetensors_header(s), {}, {}, {}, {}};
}

/// The folder of whole files in in.dir (a Hugging Face folder), opened and validated
/// (checkpoint/hf/folder.hpp).
template <ReadableDirectory D>
hf_folder<D> open_hf(const input<D>& in) {
  return open_hf_folder(in.dir);
}

/// The quantized weights of a folder of whole files with their scales checked, as open_checkpoint
/// checks a checkpoint's (check_quantized); none read when no tensor of h may be one
/// (quantized_candidate), so a plain folder is not opened twice.
template <ReadableDirectory D>
std::vector<quantized_tensor> check_folder_quantized(const input<D>& in, const hf_folder<D>& h) {
  if (std::none_of(h.tensors.begin(), h.tensors.end(),
                   [&](const auto& t) { return quantized_candidate(t.first, h.entry(t.second).type).has_value(); }))
    return {};
  checkpoint_reader<D> r(in.dir);
  return check_quantized(r);
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

/// A part of a checkpoint: the checkpoint itself (prefix "") or a pair's model/ or optim/.
template <ReadableDirectory D>
struct ckpt_part {
  std::string prefix;  // "" or "model/" / "optim/"
  std::unique_ptr<checkpoint_reader<D>> reader;
};

/// What a command reads of a checkpoint: its description and headers only (inspect), its tensor
/// data too (digest, unshard and the exports), or its tensor data with verify_checkpoint run on
/// each part by the command itself (verify: the quantized weights' scales are checked there).
enum class reads { headers, data, verified };

/// The checkpoint's parts, opened (a single file: itself, every tensor whole). One rule set for
/// every command: every file the writer recorded (metadata.json's shardsafe.file_sizes) must be
/// there, valid, with its size, as verify requires, whether or not a tensor of it is read; and
/// for a command that reads tensor data, a pair's optim/ must hold the optimizer layout's rules
/// (verify_optimizer_layout: its pickles through the plain-data reader, no global and no call),
/// whether or not the command reads optim/'s tensors; and every quantized weight must have its
/// scales, of the dtype and shape its block asks and finite (check_quantized, checkpoint/quant.hpp),
/// whether or not the command dequantizes: a command that copies weight and scale as stored would
/// otherwise pass on a weight that loads off by its scale. (The tensor bytes a command reads are
/// checked against the checksums the checkpoint records by the library's loads: unshard.hpp,
/// the exports.)
template <ReadableDirectory D>
std::vector<ckpt_part<D>> open_checkpoint(const input<D>& in, reads what = reads::data) {
  std::vector<ckpt_part<D>> parts;
  if (in.k == kind::file) {
    parts.push_back({"", std::make_unique<checkpoint_reader<D>>(in.dir, single_file_source(in.dir, in.file))});
  } else if (in.k == kind::checkpoint || in.k == kind::whole_files) {
    parts.push_back({"", std::make_unique<checkpoint_reader<D>>(in.dir)});
  } else {
    for (const auto& [name, dir] : in.parts) parts.push_back({name + "/", std::make_unique<checkpoint_reader<D>>(dir)});
  }
  for (auto& p : parts)
    for (const auto& [fname, size] : p.reader->metadata().extras.file_sizes) p.reader->file(fname);
  if (what == reads::headers) return parts;
  for (auto& p : parts)
    if (p.prefix == std::string(optim_folder_name) + "/") verify_optimizer_layout(*p.reader);
  if (what == reads::data)
    for (auto& p : parts) check_quantized(*p.reader);
  return parts;
}

}  // namespace shardsafe::tool
