// tools/output.hpp - where the shardsafe tool may write: an output that would overwrite what is
// being read is refused before anything is opened for writing, and so is a URL the tool cannot
// write (HTTP is read-only; without the remote backends, any URL).
#pragma once

#include <filesystem>
#include <string>
#include <system_error>
#include <type_traits>

#include "input.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/storage/file.hpp"

namespace shardsafe::tool {

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
inline void check_output_url(const std::string& out_path, const char* what) {
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

}  // namespace shardsafe::tool
