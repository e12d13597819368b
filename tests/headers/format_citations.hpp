// tests/headers/format_citations.hpp - citations of the format contract, docs/FORMAT.md.
//
// The headers, tools, tests, fuzz targets and the README cite the contract in their comments,
// often by section ("docs/FORMAT.md §2"). citation_problems() checks one file's text: every
// "FORMAT.md" in a comment (the text after `//` on a line; the whole line for Markdown) is
// written "docs/FORMAT.md", and a "§N" right after it names a section that exists ("## N."
// headings of docs/FORMAT.md). Strings outside comments (test names, for instance) are not
// looked at.
#pragma once

#include <cctype>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace shardsafe_test {

/// The section numbers of a Markdown text: N for each line that starts "## N.".
inline std::set<int> format_sections(const std::string& markdown) {
  std::set<int> out;
  std::istringstream in(markdown);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("## ", 0) != 0) continue;
    std::size_t i = 3, n = 0;
    int v = 0;
    while (i < line.size() && std::isdigit(static_cast<unsigned char>(line[i]))) v = v * 10 + (line[i++] - '0'), ++n;
    if (n > 0 && i < line.size() && line[i] == '.') out.insert(v);
  }
  return out;
}

/// One line per broken rule in TEXT (the contents of the file NAME), as "NAME:LINE: what".
inline std::vector<std::string> citation_problems(const std::string& name, const std::string& text, bool markdown,
                                                  const std::set<int>& sections) {
  static const std::string doc = "FORMAT.md", dir = "docs/", sect = "\xC2\xA7";  // § in UTF-8
  std::vector<std::string> out;
  std::istringstream in(text);
  int lineno = 0;
  for (std::string line; std::getline(in, line);) {
    ++lineno;
    std::size_t from = 0;
    if (!markdown) {
      from = line.find("//");
      if (from == std::string::npos) continue;
    }
    const std::string where = name + ":" + std::to_string(lineno) + ": ";
    for (std::size_t at = line.find(doc, from); at != std::string::npos; at = line.find(doc, at + doc.size())) {
      if (at < dir.size() || line.compare(at - dir.size(), dir.size(), dir) != 0) {
        out.push_back(where + "cites FORMAT.md, not docs/FORMAT.md");
        continue;
      }
      std::size_t i = at + doc.size();
      while (i < line.size() && line[i] == ' ') ++i;
      if (line.compare(i, 8, "section ") == 0) {
        out.push_back(where + "names a section of docs/FORMAT.md as \"section N\"; write \xC2\xA7N");
        continue;
      }
      if (line.compare(i, sect.size(), sect) != 0) continue;
      i += sect.size();
      int v = 0;
      std::size_t n = 0;
      while (i < line.size() && std::isdigit(static_cast<unsigned char>(line[i]))) v = v * 10 + (line[i++] - '0'), ++n;
      if (n == 0 || !sections.contains(v))
        out.push_back(where + "cites a section of docs/FORMAT.md that does not exist");
    }
  }
  return out;
}

/// citation_problems() of a file.
inline std::vector<std::string> file_citation_problems(const std::string& path, const std::string& shown_as,
                                                       const std::set<int>& sections) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  const bool markdown = path.size() >= 3 && path.compare(path.size() - 3, 3, ".md") == 0;
  return citation_problems(shown_as, text.str(), markdown, sections);
}

}  // namespace shardsafe_test
