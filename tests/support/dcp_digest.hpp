// tests/support/dcp_digest.hpp - what torch wrote beside its DCP fixtures (tests/dcp_fixture*.py):
// digest.txt's lines `NAME DTYPE [SHAPE] SHA256` and raw/NAME.bin, each full tensor's bytes.
// Torch-free: the core tests compare bytes, the torch tests wrap them in tensors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/shape.hpp"
#include "test_util.hpp"

namespace testing {

struct torch_digest_entry {
  std::string key;
  shardsafe::dtype type;
  shardsafe::shape_t shape;
  std::string sha256;
  std::string raw;  ///< the full tensor's bytes, as torch wrote them
};

/// The entries of DIR/digest.txt, in its order, with their raw bytes. Throws (rather than a
/// doctest assertion: torch workers read it too) when a raw file's size disagrees.
inline std::vector<torch_digest_entry> read_torch_digest(const std::filesystem::path& dir) {
  std::vector<torch_digest_entry> out;
  std::istringstream in(slurp(dir / "digest.txt"));
  for (std::string key, type, shape, hash; in >> key >> type >> shape >> hash;) {
    torch_digest_entry e;
    e.key = key;
    e.type = shardsafe::dtype_from_name(type, "digest.txt");
    std::string dims = shape.substr(1, shape.size() - 2);
    std::replace(dims.begin(), dims.end(), ',', ' ');
    std::istringstream ds(dims);
    for (std::uint64_t d; ds >> d;) e.shape.push_back(d);
    e.sha256 = hash;
    e.raw = slurp(dir / "raw" / (key + ".bin"));
    const std::uint64_t want = shardsafe::numel(e.shape) * shardsafe::item_size(e.type);
    if (e.raw.size() != want)
      throw std::runtime_error(key + ": raw/" + key + ".bin holds " + std::to_string(e.raw.size()) +
                               " bytes, the tensor " + std::to_string(want));
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace testing
