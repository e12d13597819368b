// Tests of the repository's header structure: each public header is reachable from exactly the
// right umbrella (shardsafe.hpp or torch.hpp), every header in include/ was compiled on its
// own by this build (see meson.build here), the version has one source, and comments cite the
// format contract as docs/FORMAT.md with sections that exist.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include "format_citations.hpp"
#include "umbrella_check.hpp"

#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "shardsafe/version.hpp"

namespace {

using namespace shardsafe_test;

std::string join(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += "\n  " + l;
  return out;
}

/// A scratch include folder, removed at the end of the test.
struct scratch_tree {
  fs::path root;
  explicit scratch_tree(const std::string& name)
      : root(fs::temp_directory_path() / ("shardsafe-umbrella-" + std::to_string(::getpid()) + "-" + name)) {
    fs::remove_all(root);
    fs::create_directories(root);
  }
  ~scratch_tree() { fs::remove_all(root); }
  void write(const std::string& include_path, const std::string& text) const {
    fs::create_directories((root / include_path).parent_path());
    std::ofstream(root / include_path) << "#pragma once\n" << text;
  }
};

bool has_line_with(const std::vector<std::string>& problems, const std::string& a, const std::string& b) {
  for (const std::string& p : problems)
    if (p.find(a) != std::string::npos && p.find(b) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST_CASE("every public header is reachable from exactly the right umbrella header") {
  const std::vector<std::string> problems = check_umbrellas({SHARDSAFE_SOURCE_INCLUDE, SHARDSAFE_BUILD_INCLUDE});
  INFO("include/shardsafe/shardsafe.hpp and torch.hpp need updating:" << join(problems));
  CHECK(problems.empty());
  // the check saw the real tree: both umbrellas, and the generated version.hpp
  const auto headers = find_headers({SHARDSAFE_SOURCE_INCLUDE, SHARDSAFE_BUILD_INCLUDE});
  CHECK(headers.contains("shardsafe/version.hpp"));
  CHECK(headers.contains("shardsafe/torch/state_dict.hpp"));
  CHECK(headers.size() > 30);
}

TEST_CASE("the umbrella check finds each kind of mistake in a made-up tree") {
  scratch_tree t("src");
  t.write("shardsafe/shardsafe.hpp", "#include \"shardsafe/a/x.hpp\"\n  #  include <shardsafe/a/angle.hpp>\n");
  t.write("shardsafe/a/x.hpp", "#include \"shardsafe/a/w.hpp\"\n#include \"shardsafe/detail/d.hpp\"\n");
  t.write("shardsafe/a/w.hpp", "");         // reached through x.hpp: fine
  t.write("shardsafe/a/angle.hpp", "");     // reached through <...> with spaces: fine
  t.write("shardsafe/detail/d.hpp", "");    // private: no umbrella needed
  t.write("shardsafe/b/detail/e.hpp", "");  // private too
  t.write("shardsafe/torch/t.hpp", "");
  SUBCASE("a correct tree has no problems") {
    t.write("shardsafe/torch.hpp", "#include \"shardsafe/shardsafe.hpp\"\n#include \"shardsafe/torch/t.hpp\"\n");
    const auto problems = check_umbrellas({t.root});
    INFO(join(problems));
    CHECK(problems.empty());
  }
  SUBCASE("a new torch-free header missing from shardsafe.hpp") {
    t.write("shardsafe/torch.hpp", "#include \"shardsafe/shardsafe.hpp\"\n#include \"shardsafe/torch/t.hpp\"\n");
    t.write("shardsafe/dist/agree.hpp", "");
    const auto problems = check_umbrellas({t.root});
    REQUIRE(problems.size() == 1);
    CHECK(has_line_with(problems, "shardsafe/dist/agree.hpp", "shardsafe/shardsafe.hpp does not reach"));
  }
  SUBCASE("the remote backends (Boost) stay out of the umbrellas, and need not be in them") {
    t.write("shardsafe/torch.hpp", "#include \"shardsafe/shardsafe.hpp\"\n#include \"shardsafe/torch/t.hpp\"\n");
    t.write("shardsafe/storage/http.hpp", "#include \"shardsafe/storage/detail/http_client.hpp\"\n");
    t.write("shardsafe/storage/detail/http_client.hpp", "");
    t.write("shardsafe/storage/s3.hpp", "");
    CHECK(check_umbrellas({t.root}).empty());
    t.write("shardsafe/a/w.hpp", "#include \"shardsafe/storage/s3.hpp\"\n");
    const auto problems = check_umbrellas({t.root});
    REQUIRE(problems.size() == 2);  // reached from both umbrellas (torch.hpp includes shardsafe.hpp)
    CHECK(has_line_with(problems, "shardsafe/storage/s3.hpp", "needs Boost, reached from shardsafe/shardsafe.hpp"));
    CHECK(is_remote_header("shardsafe/storage/detail/s3_sigv4.hpp"));
    CHECK_FALSE(is_remote_header("shardsafe/storage/url.hpp"));
    CHECK_FALSE(is_remote_header("shardsafe/format/http.hpp"));
  }
  SUBCASE("the units of separate compilation: outside the umbrellas, each reaching what it compiles") {
    t.write("shardsafe/torch.hpp", "#include \"shardsafe/shardsafe.hpp\"\n#include \"shardsafe/torch/t.hpp\"\n");
    t.write("shardsafe/storage/http.hpp", "");
    t.write("shardsafe/storage/s3.hpp", "#include \"shardsafe/storage/http.hpp\"\n");
    t.write("shardsafe/compiled.hpp", "#include \"shardsafe/shardsafe.hpp\"\n");
    t.write("shardsafe/compiled_remote.hpp", "#include \"shardsafe/storage/s3.hpp\"\n");
    CHECK(check_umbrellas({t.root}).empty());
    t.write("shardsafe/compiled_remote.hpp", "#include \"shardsafe/storage/http.hpp\"\n");  // s3 left out
    auto problems = check_umbrellas({t.root});
    REQUIRE(problems.size() == 1);
    CHECK(has_line_with(problems, "shardsafe/compiled_remote.hpp", "does not include shardsafe/storage/s3.hpp"));
    t.write("shardsafe/compiled_remote.hpp", "#include \"shardsafe/storage/s3.hpp\"\n");
    t.write("shardsafe/a/w.hpp", "#include \"shardsafe/compiled_remote.hpp\"\n");  // an umbrella reaches it
    problems = check_umbrellas({t.root});
    CHECK(has_line_with(problems, "shardsafe/compiled_remote.hpp",
                        "the unit of separate compilation, reached from shardsafe/shardsafe.hpp"));
  }
  SUBCASE("a header named only in a comment is not reached") {
    t.write("shardsafe/torch.hpp", "#include \"shardsafe/shardsafe.hpp\"\n#include \"shardsafe/torch/t.hpp\"\n");
    t.write("shardsafe/a/w.hpp", "// #include \"shardsafe/a/v.hpp\"\n");
    t.write("shardsafe/a/v.hpp", "");
    CHECK(has_line_with(check_umbrellas({t.root}), "shardsafe/a/v.hpp", "does not reach"));
  }
  SUBCASE("a torch header missing from torch.hpp") {
    t.write("shardsafe/torch.hpp", "#include \"shardsafe/shardsafe.hpp\"\n#include \"shardsafe/torch/t.hpp\"\n");
    t.write("shardsafe/torch/optim_load.hpp", "");
    const auto problems = check_umbrellas({t.root});
    REQUIRE(problems.size() == 1);
    CHECK(has_line_with(problems, "shardsafe/torch/optim_load.hpp", "shardsafe/torch.hpp does not reach"));
  }
  SUBCASE("a torch header reached from shardsafe.hpp, even through another header") {
    t.write("shardsafe/torch.hpp", "#include \"shardsafe/shardsafe.hpp\"\n");
    t.write("shardsafe/a/w.hpp", "#include \"shardsafe/torch/t.hpp\"\n");
    const auto problems = check_umbrellas({t.root});
    REQUIRE(problems.size() == 1);
    CHECK(has_line_with(problems, "shardsafe/torch/t.hpp", "reached from shardsafe/shardsafe.hpp"));
  }
  SUBCASE("torch.hpp without shardsafe.hpp, and an include of a header that is gone") {
    t.write("shardsafe/torch.hpp", "#include \"shardsafe/torch/t.hpp\"\n#include \"shardsafe/torch/old.hpp\"\n");
    const auto problems = check_umbrellas({t.root});
    CHECK(problems.size() == 2);
    CHECK(has_line_with(problems, "shardsafe/torch.hpp does not include", "shardsafe/shardsafe.hpp"));
    CHECK(has_line_with(problems, "includes shardsafe/torch/old.hpp", "in no include folder"));
  }
  SUBCASE("the generated header lives in a second include folder") {
    t.write("shardsafe/torch.hpp", "#include \"shardsafe/shardsafe.hpp\"\n#include \"shardsafe/torch/t.hpp\"\n");
    scratch_tree build("build");
    build.write("shardsafe/version.hpp", "");
    CHECK(has_line_with(check_umbrellas({t.root, build.root}), "shardsafe/version.hpp", "does not reach"));
    t.write("shardsafe/shardsafe.hpp",
            "#include \"shardsafe/a/x.hpp\"\n#include <shardsafe/a/angle.hpp>\n"
            "#include \"shardsafe/version.hpp\"\n");
    CHECK(check_umbrellas({t.root, build.root}).empty());
    CHECK(has_line_with(check_umbrellas({t.root}), "includes shardsafe/version.hpp", "in no include folder"));
  }
}

TEST_CASE("every header in include/ was compiled on its own by this build") {
  // SHARDSAFE_COMPILED_HEADERS lists the headers tests/headers/meson.build generated a
  // translation unit for when Meson configured the build; a header added since then is only
  // compiled on its own after `meson setup --reconfigure`.
  std::set<std::string> compiled;
  std::ifstream in(SHARDSAFE_COMPILED_HEADERS);
  REQUIRE(in.good());
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) compiled.insert(line);
  for (const auto& [h, file] : find_headers({SHARDSAFE_SOURCE_INCLUDE, SHARDSAFE_BUILD_INCLUDE})) {
    if (is_torch_header(h) || h == torch_umbrella) {
      if (!SHARDSAFE_HEADERS_WITH_TORCH) continue;  // LibTorch not found: its headers are not compiled
    }
    if (is_remote_header(h) && !SHARDSAFE_HEADERS_WITH_REMOTE) continue;  // Boost not found
    if (is_compiled_unit_header(h)) continue;                             // compiled as the shardsafe_compiled library
    if (is_implementation_file(h)) continue;  // impl/*.ipp: compiled through its header, or in a compiled unit
    INFO(h << " is not compiled on its own by this build; it was added after Meson configured it: "
              "run `meson setup --reconfigure` on the build folder");
    CHECK(compiled.contains(h));
  }
  CHECK(compiled.contains("shardsafe/version.hpp"));
}

TEST_CASE("the version has one source: the project version of meson.build") {
  const std::string v = SHARDSAFE_PROJECT_VERSION;  // meson.project_version(), passed by meson
  CHECK(shardsafe::library_version == v);
  CHECK(std::string(SHARDSAFE_VERSION_STRING) == v);
  // MAJOR.MINOR.PATCH, read back from the string independently of the generator
  int major = -1, minor = -1, patch = -1;
  REQUIRE(std::sscanf(v.c_str(), "%d.%d.%d", &major, &minor, &patch) == 3);
  CHECK(SHARDSAFE_VERSION_MAJOR == major);
  CHECK(SHARDSAFE_VERSION_MINOR == minor);
  CHECK(SHARDSAFE_VERSION_PATCH == patch);
  CHECK(SHARDSAFE_VERSION == major * 10000 + minor * 100 + patch);

  const std::string tool = SHARDSAFE_TOOL;
  if (tool.empty()) {
    MESSAGE("the shardsafe tool is not built (-Dtools=false): its --version is not checked");
    return;
  }
  FILE* p = ::popen((tool + " --version").c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[256];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  const int status = ::pclose(p);
  CHECK(status == 0);
  CHECK(out == "shardsafe " + v + "\n");
}

TEST_CASE("format citations: a comment cites docs/FORMAT.md, by a section that exists") {
  const std::set<int> sections{1, 2, 3, 4};
  auto problems = [&](const std::string& text, bool md = false) { return citation_problems("f", text, md, sections); };
  CHECK(format_sections("# t\n## 1. a\n## 2. b\n### 3. not a section\n## x. no\n## 12. c\n") ==
        std::set<int>{1, 2, 12});
  CHECK(problems("int a;  // docs/FORMAT.md \xC2\xA7"
                 "2, optim/\n/// see docs/FORMAT.md\n")
            .empty());
  CHECK(problems("TEST_CASE(\"FORMAT.md in a string is not a comment\") {}\n").empty());
  CHECK(problems("See [`docs/FORMAT.md`](docs/FORMAT.md) \xC2\xA7"
                 "2.\n",
                 true)
            .empty());
  CHECK(has_line_with(problems("x\n// the contract (FORMAT.md \xC2\xA7"
                               "1)\n"),
                      "f:2:", "not docs/FORMAT.md"));
  CHECK(has_line_with(problems("// ../shared/FORMAT.md\n"), "f:1:", "not docs/FORMAT.md"));
  CHECK(has_line_with(problems("The contract is in `FORMAT.md`.\n", true), "f:1:", "not docs/FORMAT.md"));
  CHECK(has_line_with(problems("// docs/FORMAT.md section 1\n"), "f:1:", "write \xC2\xA7N"));
  CHECK(has_line_with(problems("// docs/FORMAT.md \xC2\xA7"
                               "7\n"),
                      "f:1:", "does not exist"));
  CHECK(problems("// docs/FORMAT.md \xC2\xA7"
                 "7 and FORMAT.md\n")
            .size() == 2);
}

TEST_CASE("format citations in the repository: include/, tools/, tests/, fuzz/, examples/, bench/, README.md") {
  const fs::path src = fs::path(SHARDSAFE_SOURCE_INCLUDE).parent_path();
  std::ifstream doc(src / "docs" / "FORMAT.md");
  REQUIRE_MESSAGE(doc.good(), "docs/FORMAT.md is missing");
  std::ostringstream text;
  text << doc.rdbuf();
  const std::set<int> sections = format_sections(text.str());
  CHECK(sections == std::set<int>{1, 2, 3, 4, 5, 6, 7, 8});
  std::vector<std::string> problems;
  int files = 0;
  auto scan = [&](const fs::path& p) {
    ++files;
    for (std::string& s : file_citation_problems(p.string(), p.lexically_relative(src).generic_string(), sections))
      problems.push_back(std::move(s));
  };
  for (const char* d : {"include", "tools", "tests", "fuzz", "examples", "bench"}) {
    if (!fs::is_directory(src / d)) continue;
    for (const auto& e : fs::recursive_directory_iterator(src / d)) {
      const auto ext = e.path().extension();
      // tests/headers/ itself holds the made-up citations of the test above
      if (e.path().parent_path() == src / "tests" / "headers") continue;
      if (e.is_regular_file() && (ext == ".hpp" || ext == ".cpp" || ext == ".h" || ext == ".in")) scan(e.path());
    }
  }
  scan(src / "README.md");
  INFO("citations of the format contract to fix:" << join(problems));
  CHECK(problems.empty());
  CHECK(files > 40);
}
