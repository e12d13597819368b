// The LibTorch headers as a program built against a LibTorch without Gloo's headers (Python's
// torch wheels) compiles them: USE_C10D_GLOO undefined, so torch/c10d.hpp offers the store world
// only (c10d_transport::store). The rest of this suite compiles them with Gloo.
#undef USE_C10D_GLOO
#include "shardsafe/torch.hpp"
#include "shardsafe/torch/c10d.hpp"
