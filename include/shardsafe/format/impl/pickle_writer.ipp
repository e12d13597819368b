// shardsafe/format/impl/pickle_writer.ipp - pickle_writer.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/format/pickle_writer.hpp"

namespace shardsafe {

SHARDSAFE_DECL std::string pickle_dumps(const pickle_value& v) {
  std::string out = "\x80\x02";
  detail::pickle_put(out, v);
  out += '.';
  return out;
}

}  // namespace shardsafe
