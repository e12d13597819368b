// Snippets that must not compile (tests/compile_fail/run.py compiles this file once per CASE
// with the flags the build gives the core tests, and checks the compiler's message). CASE 0
// is the correct use and must compile: it shows the harness itself works.
#include "shardsafe/checkpoint/configured.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/memory.hpp"

using namespace shardsafe;

struct not_a_comm {
  int rank() const { return 0; }
};

void use() {
  single_process comm;
  memory_directory dir;
#if CASE == 0
  auto l = make_configured_loader<load_policy{.validate_nan = true, .views = only(dtype::F32)}>(dir, comm);
  (void)l;
#elif CASE == 1  // expect: Dir must model shardsafe::ReadableDirectory
  configured_loader<int, single_process> l(0, comm);
#elif CASE == 2  // expect: C must model shardsafe::Comm
  not_a_comm nc;
  configured_loader<memory_directory, not_a_comm> l(dir, nc);
#elif CASE == 3  // expect: asks for validate_nan, but its views' dtype
  auto l = make_configured_loader<load_policy{.validate_nan = true, .views = only(dtype::I32)}>(dir, comm);
#elif CASE == 4  // expect: asks for convert_dtypes, but its views' dtype
  configured_loader<memory_directory, single_process, load_policy{.convert_dtypes = true, .views = only(dtype::U8)}> l(
      dir, comm);
#elif CASE == 5  // expect: pass configured_load_settings, not load_options
  load_options o;
  auto l = make_configured_loader(dir, comm, o);
#elif CASE == 6  // expect: pass configured_load_settings, not load_options
  configured_loader<memory_directory, single_process> l(dir, comm, load_options{});
#endif
}
