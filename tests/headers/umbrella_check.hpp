// tests/headers/umbrella_check.hpp - which public headers each umbrella header reaches.
//
// A header is public unless a folder of its path is detail/. Public headers under torch/
// include LibTorch and belong to shardsafe/torch.hpp; every other public header belongs to
// shardsafe/shardsafe.hpp. check_umbrellas() follows the `#include "shardsafe/..."` lines of
// the headers (text only: preprocessor conditions are not evaluated) from each umbrella and
// returns one line per rule broken:
//   - a torch-free public header that shardsafe/shardsafe.hpp does not reach;
//   - a torch/ header that shardsafe/torch.hpp does not reach, or that shardsafe.hpp reaches;
//   - shardsafe/torch.hpp not reaching shardsafe/shardsafe.hpp;
//   - a remote-storage header (is_remote_header: needs Boost) that either umbrella reaches:
//     those are included on their own (shardsafe/storage/http.hpp, s3.hpp), so that no user of
//     the umbrellas needs Boost;
//   - a process launcher (is_launcher_header: shardsafe/dist/launch.hpp, which starts a world of
//     local processes for examples, tests and benchmarks) that either umbrella reaches: it is not
//     part of the library's API and is included on its own;
//   - the unit of separate compilation (is_compiled_unit_header: shardsafe/compiled.hpp, compiled
//     once in a separately compiled program, core/config.hpp) that either umbrella reaches, or
//     that does not reach shardsafe/shardsafe.hpp (whose definitions it compiles);
//   - an include of a shardsafe/ header that exists in none of the include folders.
#pragma once

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace shardsafe_test {

namespace fs = std::filesystem;

/// The shardsafe/ paths a header's `#include "shardsafe/..."` and `#include <shardsafe/...>`
/// lines name, in order. Lines whose first non-blank character is not `#` are not looked at.
inline std::vector<std::string> shardsafe_includes(const fs::path& file) {
  std::vector<std::string> out;
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    std::size_t i = line.find_first_not_of(" \t");
    if (i == std::string::npos || line[i] != '#') continue;
    i = line.find_first_not_of(" \t", i + 1);
    if (i == std::string::npos || line.compare(i, 7, "include") != 0) continue;
    i = line.find_first_not_of(" \t", i + 7);
    if (i == std::string::npos || (line[i] != '"' && line[i] != '<')) continue;
    const char close = line[i] == '"' ? '"' : '>';
    const std::size_t end = line.find(close, i + 1);
    if (end == std::string::npos) continue;
    std::string name = line.substr(i + 1, end - i - 1);
    if (name.rfind("shardsafe/", 0) == 0) out.push_back(std::move(name));
  }
  return out;
}

/// Every header (*.hpp) under ROOT/shardsafe for each ROOT, and every implementation file
/// (impl/*.ipp, which its header includes header-only: core/config.hpp), by include path
/// ("shardsafe/core/dtype.hpp") to the file.
inline std::map<std::string, fs::path> find_headers(const std::vector<fs::path>& roots) {
  std::map<std::string, fs::path> out;
  for (const fs::path& root : roots) {
    if (!fs::is_directory(root / "shardsafe")) continue;
    for (const auto& e : fs::recursive_directory_iterator(root / "shardsafe")) {
      if (e.is_regular_file() && (e.path().extension() == ".hpp" || e.path().extension() == ".ipp"))
        out.emplace(e.path().lexically_relative(root).generic_string(), e.path());
    }
  }
  return out;
}

/// Whether a file is an implementation file (impl/NAME.ipp): the bodies of its header's functions
/// compiled once, not a header to include or compile on its own.
inline bool is_implementation_file(const std::string& include_path) {
  return include_path.size() > 4 && include_path.compare(include_path.size() - 4, 4, ".ipp") == 0;
}

/// Whether a header is public: no folder on its path is named detail.
inline bool is_public(const std::string& include_path) { return include_path.find("/detail/") == std::string::npos; }

/// Whether a header belongs to the LibTorch umbrella.
inline bool is_torch_header(const std::string& include_path) { return include_path.rfind("shardsafe/torch/", 0) == 0; }

/// Whether a header needs Boost (Asio, Beast): under shardsafe/storage/, a file name starting
/// with "http" or "s3" (detail/ included). tests/headers/meson.build applies the same rule.
inline bool is_remote_header(const std::string& include_path) {
  if (include_path.rfind("shardsafe/storage/", 0) != 0) return false;
  const std::string name = include_path.substr(include_path.rfind('/') + 1);
  return name.rfind("http", 0) == 0 || name.rfind("s3", 0) == 0;
}

/// The process launcher: public (examples and benchmarks use it) but outside both umbrellas.
inline bool is_launcher_header(const std::string& include_path) { return include_path == "shardsafe/dist/launch.hpp"; }

/// The units of separate compilation: the core's includes the core umbrella, the remote
/// backends' their two headers; neither umbrella includes either.
inline bool is_compiled_unit_header(const std::string& include_path) {
  return include_path == "shardsafe/compiled.hpp" || include_path == "shardsafe/compiled_remote.hpp";
}
/// What a unit of separate compilation must reach: what it compiles.
inline std::vector<std::string> compiled_unit_reaches(const std::string& include_path) {
  if (include_path == "shardsafe/compiled_remote.hpp")
    return {"shardsafe/storage/http.hpp", "shardsafe/storage/s3.hpp"};
  return {"shardsafe/shardsafe.hpp"};
}

inline constexpr const char* core_umbrella = "shardsafe/shardsafe.hpp";
inline constexpr const char* torch_umbrella = "shardsafe/torch.hpp";

/// The headers reached from START through shardsafe/ includes, START included. An include
/// of a header that is in none of HEADERS goes to MISSING as "FROM includes NAME".
inline std::set<std::string> reach(const std::map<std::string, fs::path>& headers, const std::string& start,
                                   std::set<std::string>& missing) {
  std::set<std::string> seen;
  std::vector<std::string> todo{start};
  while (!todo.empty()) {
    const std::string h = todo.back();
    todo.pop_back();
    if (!seen.insert(h).second) continue;
    const auto it = headers.find(h);
    if (it == headers.end()) continue;
    for (std::string& inc : shardsafe_includes(it->second)) {
      if (!headers.contains(inc))
        missing.insert(h + " includes " + inc + ", which is in no include folder");
      else
        todo.push_back(std::move(inc));
    }
  }
  return seen;
}

/// The rules of this header's comment, checked on the headers under ROOTS (the source include/
/// folder, and the build's, which holds the generated version.hpp). Empty when all hold.
inline std::vector<std::string> check_umbrellas(const std::vector<fs::path>& roots) {
  std::vector<std::string> problems;
  const auto headers = find_headers(roots);
  for (const char* u : {core_umbrella, torch_umbrella})
    if (!headers.contains(u)) problems.push_back(std::string(u) + " does not exist");
  if (!problems.empty()) return problems;

  std::set<std::string> missing;
  const std::set<std::string> core = reach(headers, core_umbrella, missing);
  const std::set<std::string> torch = reach(headers, torch_umbrella, missing);
  problems.assign(missing.begin(), missing.end());
  if (!torch.contains(core_umbrella))
    problems.push_back(std::string(torch_umbrella) + " does not include " + core_umbrella);
  for (const auto& [h, file] : headers) {
    if (is_remote_header(h)) {
      for (const auto* u : {&core, &torch})
        if (u->contains(h))
          problems.push_back(h + ": a header that needs Boost, reached from " +
                             (u == &core ? core_umbrella : torch_umbrella) + "; include it on its own");
      continue;
    }
    if (is_launcher_header(h)) {
      for (const auto* u : {&core, &torch})
        if (u->contains(h))
          problems.push_back(h + ": the process launcher, reached from " +
                             (u == &core ? core_umbrella : torch_umbrella) +
                             "; it is not part of the library's API: include it on its own");
      continue;
    }
    if (is_compiled_unit_header(h)) {
      for (const auto* u : {&core, &torch})
        if (u->contains(h))
          problems.push_back(h + ": the unit of separate compilation, reached from " +
                             (u == &core ? core_umbrella : torch_umbrella) + "; it is compiled once, on its own");
      std::set<std::string> unused;
      const std::set<std::string> reached = reach(headers, h, unused);
      for (const std::string& want : compiled_unit_reaches(h))
        if (!reached.contains(want))
          problems.push_back(h + ": the unit of separate compilation does not include " + want);
      continue;
    }
    if (!is_public(h) || h == core_umbrella || h == torch_umbrella) continue;
    if (!is_torch_header(h) && !core.contains(h))
      problems.push_back(h + ": a torch-free public header that " + core_umbrella + " does not reach: add #include \"" +
                         h + "\" to it");
    if (is_torch_header(h) && core.contains(h))
      problems.push_back(h + ": a LibTorch header reached from " + core_umbrella +
                         ", which must compile without LibTorch");
    if (is_torch_header(h) && !torch.contains(h))
      problems.push_back(h + ": a LibTorch public header that " + torch_umbrella + " does not reach: add #include \"" +
                         h + "\" to it");
  }
  return problems;
}

}  // namespace shardsafe_test
