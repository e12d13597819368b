// shardsafe - inspect, verify, digest and unshard safetensors files, Hugging Face folders and
// sharded checkpoints (docs/FORMAT.md §4). Any input ends in exit 0 or 1 with a message.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/detail/sha256.hpp"
#include "shardsafe/format/hf_index.hpp"
#include "shardsafe/format/metadata.hpp"
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
  void add(std::uint64_t n) {
    done_ += n;
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

enum class kind { file, hf_single, hf_index, checkpoint, checkpoint_pair };

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
  if (fs::exists(path / "metadata.json")) return {kind::checkpoint, path, {}};
  if (fs::is_directory(path / "model") || fs::is_directory(path / "optim")) {
    input in{kind::checkpoint_pair, path, {}};
    for (const char* part : {"model", "optim"})
      if (fs::is_directory(path / part)) in.parts.emplace_back(part, path / part);
    return in;
  }
  if (fs::exists(path / std::string(hf_index_file))) return {kind::hf_index, path, {}};
  if (fs::exists(path / std::string(hf_single_file))) return {kind::hf_single, path, {}};
  fail(errc::not_found, p + ": a directory with neither metadata.json, model/ and optim/, " + std::string(hf_index_file) +
                            " nor " + std::string(hf_single_file));
}

// ---------------------------------------------------------------------------------------
// Hugging Face folders: the files and which tensor lives where, validated

struct hf_folder {
  std::vector<std::pair<std::string, std::unique_ptr<file_storage>>> files;
  std::vector<safetensors_header> headers;
  std::map<std::string, std::pair<std::size_t, const tensor_entry*>> tensors;  // name -> file index, entry
};

hf_folder open_hf(const input& in) {
  hf_folder h;
  if (in.k == kind::hf_single) {
    auto s = std::make_unique<file_storage>(in.path / std::string(hf_single_file));
    h.headers.push_back(read_safetensors_header(*s));
    h.files.emplace_back(std::string(hf_single_file), std::move(s));
  } else {
    file_storage idx_file(in.path / std::string(hf_index_file));
    hf_index idx = read_hf_index(idx_file);
    for (const auto& f : idx.files()) {
      const fs::path fp = in.path / f;
      if (!fs::exists(fp))
        fail(errc::not_found, fp.string() + ": listed in " + std::string(hf_index_file) + " but missing");
      auto s = std::make_unique<file_storage>(fp);
      h.headers.push_back(read_safetensors_header(*s));
      h.files.emplace_back(f, std::move(s));
    }
    std::uint64_t total = 0;
    for (const auto& [tensor, file] : idx.weight_map) {
      std::size_t i = 0;
      while (h.files[i].first != file) ++i;
      const tensor_entry* e = h.headers[i].find(tensor);
      if (!e)
        fail(errc::not_found, (in.path / file).string() + ": tensor '" + tensor + "': listed in " +
                                  std::string(hf_index_file) + " but absent from the file");
      total += e->nbytes();
    }
    for (std::size_t i = 0; i < h.headers.size(); ++i)
      for (const auto& t : h.headers[i].tensors) {
        auto it = idx.weight_map.find(t.name);
        if (it == idx.weight_map.end())
          fail(errc::invalid_metadata, h.headers[i].file + ": tensor '" + t.name + "': not listed in " +
                                           std::string(hf_index_file));
        if (it->second != h.files[i].first)
          fail(errc::invalid_metadata, h.headers[i].file + ": tensor '" + t.name + "': the index places it in " +
                                           it->second);
      }
    if (idx.total_size && *idx.total_size != total)
      fail(errc::invalid_metadata, (in.path / std::string(hf_index_file)).string() + ": metadata.total_size is " +
                                       std::to_string(*idx.total_size) + " but the tensors hold " +
                                       std::to_string(total) + " bytes");
  }
  for (std::size_t i = 0; i < h.headers.size(); ++i)
    for (const auto& t : h.headers[i].tensors)
      if (!h.tensors.emplace(t.name, std::pair{i, &t}).second)
        fail(errc::invalid_metadata, h.headers[i].file + ": tensor '" + t.name + "' also appears in " +
                                         h.headers[h.tensors[t.name].first].file);
  return h;
}

// ---------------------------------------------------------------------------------------
// checkpoints

struct ckpt_part {
  std::string prefix;  // "" or "model/" / "optim/"
  std::unique_ptr<checkpoint_reader<file_directory>> reader;
};

std::vector<ckpt_part> open_checkpoint(const input& in) {
  std::vector<ckpt_part> parts;
  if (in.k == kind::checkpoint) {
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

/// Every check docs/FORMAT.md §2 and §4 (verify) ask of a checkpoint: metadata, files, entries, coverage.
void verify_checkpoint(checkpoint_reader<file_directory>& r) {
  const std::string dname(r.directory().name());
  for (const auto& [key, tm] : r.metadata().tensors) {
    std::vector<shard_spec> specs;
    for (const auto& [fname, spec] : tm.files) {
      const auto& f = r.file(fname);
      r.entry_in(f, key, tm, spec);
      specs.push_back(spec);
    }
    if (!is_byte_sized(tm.type) && tm.is_sharded)
      fail(errc::unsupported_dtype, dname + ": tensor '" + key + "': sub-byte dtype " + std::string(name(tm.type)) +
                                        " cannot be sharded by elements");
    const shard_spec whole = flat_spec{{0, tm.numel()}};
    auto missing = missing_elements(whole, std::span<const shard_spec>(specs), tm.shape);
    if (!missing.empty())
      fail(errc::missing_coverage, dname + ": tensor '" + key + "' " + shape_str(tm.shape) + ": elements " +
                                       shardsafe::to_string(missing.front()) + " (from index " +
                                       multi_index_string(tm.shape, missing.front().begin) + ") are in no file");
  }
  // every rank file the writer recorded must be there with its size
  for (const auto& [fname, size] : r.metadata().extras.file_sizes) r.file(fname);
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
  if (in.k == kind::hf_single || in.k == kind::hf_index) {
    hf_folder h = open_hf(in);
    std::uint64_t total = 0;
    for (const auto& [n, where] : h.tensors) {
      const tensor_entry& t = *where.second;
      total += t.nbytes();
      rows.push_back({n, std::string(name(t.type)), shape_str(t.shape), std::to_string(t.nbytes()),
                      h.files[where.first].first, "-"});
    }
    print_rows("# " + in.path.string() + ": Hugging Face " + (in.k == kind::hf_index ? "sharded checkpoint, " : "checkpoint, ") +
                   std::to_string(h.files.size()) + " file(s), " + std::to_string(h.tensors.size()) + " tensors, " +
                   std::to_string(total) + " bytes",
               rows);
    return 0;
  }
  auto parts = open_checkpoint(in);
  std::uint64_t total = 0;
  std::string writer;
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
  print_rows("# " + in.path.string() + ": sharded checkpoint, " + std::to_string(rows.size()) + " tensors, " +
                 std::to_string(total) + " bytes" + (writer.empty() ? "" : ", written by " + writer),
             rows);
  return 0;
}

int cmd_verify(const input& in) {
  std::size_t n = 0;
  if (in.k == kind::file) {
    file_storage s(in.path);
    n = read_safetensors_header(s).tensors.size();
  } else if (in.k == kind::hf_single || in.k == kind::hf_index) {
    n = open_hf(in).tensors.size();
  } else {
    for (auto& p : open_checkpoint(in)) {
      verify_checkpoint(*p.reader);
      n += p.reader->metadata().tensors.size();
    }
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
    detail::sha256 h;
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
  } else if (in.k == kind::hf_single || in.k == kind::hf_index) {
    hf_folder h = open_hf(in);
    std::uint64_t total = 0;
    for (const auto& hd : h.headers) total += hd.data_size;
    progress pr("digest", total);
    for (const auto& [n, where] : h.tensors) {
      const tensor_entry& t = *where.second;
      out.push_back({n, t.type, t.shape,
                     hash_range(*h.files[where.first].second, h.headers[where.first].offset_of(t), t.nbytes(), pr)});
    }
  } else {
    auto parts = open_checkpoint(in);
    std::uint64_t total = 0;
    for (auto& p : parts)
      for (const auto& [k, tm] : p.reader->metadata().tensors) total += tm.numel() * bit_size(tm.type) / 8;
    progress pr("digest", total);
    for (auto& p : parts)
      for (const auto& [key, tm] : p.reader->metadata().tensors) {
        detail::sha256 h;
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
  if (in.k != kind::checkpoint && in.k != kind::checkpoint_pair)
    fail(errc::invalid_argument, in.path.string() + ": unshard needs a checkpoint directory");
  auto parts = open_checkpoint(in);
  std::vector<unshard_source<file_directory>> sources;
  for (auto& p : parts) sources.push_back({p.reader.get(), p.prefix});
  file_writer w(out_path);
  const std::uint64_t size = unshard_to_safetensors(std::span<const unshard_source<file_directory>>(sources), w);
  std::cout << "wrote " << out_path << ": " << size << " bytes\n";
  return 0;
}

int usage() {
  std::cerr << "usage: shardsafe inspect PATH\n"
               "       shardsafe verify PATH\n"
               "       shardsafe digest PATH\n"
               "       shardsafe unshard CKPT OUT.safetensors\n"
               "       shardsafe --version\n"
               "PATH is a safetensors file, a Hugging Face folder (model.safetensors or an index) or a\n"
               "checkpoint folder (with metadata.json, or with model/ and optim/).\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "-h" || args[0] == "--help") return usage();
  if (args.size() == 1 && args[0] == "--version") {
    std::cout << "shardsafe " << library_version << "\n";
    return 0;
  }
  const std::string& cmd = args[0];
  try {
    if (cmd == "inspect" && args.size() == 2) return cmd_inspect(classify(args[1]));
    if (cmd == "verify" && args.size() == 2) return cmd_verify(classify(args[1]));
    if (cmd == "digest" && args.size() == 2) return cmd_digest(classify(args[1]));
    if (cmd == "unshard" && args.size() == 3) return cmd_unshard(classify(args[1]), args[2]);
    return usage();
  } catch (const std::bad_alloc&) {
    std::cerr << "shardsafe: " << cmd << ": out of memory\n";
  } catch (const std::exception& e) {
    std::cerr << "shardsafe: " << one_line(e.what()) << "\n";
  }
  return 1;
}
