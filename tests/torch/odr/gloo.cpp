// tests/torch/odr/gloo.cpp - torch/c10d.hpp built with USE_C10D_GLOO (see odr_half.hpp).
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#include "odr_half.hpp"

std::string odr_gloo_half() { return what_this_half_resolves(); }
