// tests/torch/odr/store.cpp - torch/c10d.hpp built without USE_C10D_GLOO (see odr_half.hpp).
#undef USE_C10D_GLOO
#include "odr_half.hpp"

std::string odr_store_half() { return what_this_half_resolves(); }
