// tests/torch/odr/odr_half.hpp - one half of the one-definition-rule check of the Gloo switch
// (main.cpp): the including file sets USE_C10D_GLOO or not, then this says what the world's
// transport resolves to here (built with Gloo: "gloo"; without: "store") and what asking for
// Gloo does. If the two halves' c10d_world and init_world_from_env shared a name, the linker
// would keep one definition of each inline function, and one half would answer as the other.
#include <string>

#include "shardsafe/torch/c10d.hpp"

namespace {
std::string what_this_half_resolves() {
  std::string said;
  try {
    const auto t = shardsafe::detail::resolve_transport(shardsafe::c10d_transport::automatic);
    said = t == shardsafe::c10d_transport::gloo ? "automatic: gloo" : "automatic: store";
    shardsafe::detail::resolve_transport(shardsafe::c10d_transport::gloo);
    said += "; gloo: accepted";
  } catch (const shardsafe::error& e) {
    said += std::string("; gloo: refused (") + e.what() + ")";
  }
  shardsafe::c10d_world w;  // a default world: its size differs with the switch
  return said + "; sizeof(c10d_world) " + std::to_string(sizeof w);
}
}  // namespace
