// The main of the torch tests: doctest, or (with SHARDSAFE_WORKER set) one rank of a world.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <exception>

#include "world.hpp"

int main(int argc, char** argv) {
  if (const char* w = std::getenv("SHARDSAFE_WORKER")) {
    auto it = testing::scenarios().find(w);
    if (it == testing::scenarios().end()) {
      std::fprintf(stderr, "no worker scenario '%s'\n", w);
      return 99;
    }
    try {
      return it->second(testing::split_args(std::getenv("SHARDSAFE_WORKER_ARGS")));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "worker '%s' rank %s: %s\n", w, std::getenv("RANK"), e.what());
      return 98;
    }
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
