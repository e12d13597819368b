// tests/torch/odr/main.cpp - issue 52's "the Gloo switch cannot break the one-definition rule
// between translation units": gloo.cpp (USE_C10D_GLOO) and store.cpp (without) include
// torch/c10d.hpp into one program, and each must still behave as built: with Gloo the
// automatic transport is Gloo, without it the store, and Gloo asked for is refused. Run with
// SHARDSAFE_C10D_TRANSPORT unset. Exit status 0 when both halves do; otherwise what each said.
#include <cstdio>
#include <cstdlib>
#include <string>

std::string odr_gloo_half();
std::string odr_store_half();

int main() {
  ::unsetenv("SHARDSAFE_C10D_TRANSPORT");
  const std::string gloo = odr_gloo_half(), store = odr_store_half();
  const bool gloo_ok = gloo.find("automatic: gloo; gloo: accepted") == 0;
  const bool store_ok =
      store.find("automatic: store; gloo: refused") == 0 && store.find("USE_C10D_GLOO") != std::string::npos;
  std::printf("built with USE_C10D_GLOO: %s\n  -> %s\nbuilt without: %s\n  -> %s\n", gloo.c_str(),
              gloo_ok ? "right" : "WRONG (expected: automatic is gloo, gloo accepted)", store.c_str(),
              store_ok ? "right" : "WRONG (expected: automatic is store, gloo refused)");
  return gloo_ok && store_ok ? 0 : 1;
}
