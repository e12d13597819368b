// shardsafe/format/pickle_writer.hpp - pickles a plain value with protocol 2.
//
// OLMo-core stores each optimizer param group and the list of state keys as pickled bytes in
// U8 tensors; shardsafe writes them with protocol 2, which every Python 3 reads. The bytes are
// those of Python's own pickler, less its memo PUTs (pickletools.optimize of pickle.dumps(v, 2)).
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <string>
#include <string_view>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/json_error.hpp"
#include "shardsafe/format/pickle_value.hpp"

namespace shardsafe {

namespace detail {

inline void pickle_put(std::string& out, const pickle_value& v) {
  using k = pickle_value::kind;
  auto le = [&](std::uint64_t x, int n) {
    for (int i = 0; i < n; ++i) out += static_cast<char>((x >> (8 * i)) & 0xff);
  };
  switch (v.type()) {
    case k::none: out += 'N'; break;
    case k::boolean: out += v.as_bool("") ? '\x88' : '\x89'; break;
    case k::integer: {
      const std::int64_t i = v.as_int("");
      if (i >= 0 && i < 256) {
        out += 'K';
        le(static_cast<std::uint64_t>(i), 1);
      } else if (i >= 0 && i < 65536) {
        out += 'M';
        le(static_cast<std::uint64_t>(i), 2);
      } else if (i >= INT32_MIN && i <= INT32_MAX) {
        out += 'J';
        le(static_cast<std::uint32_t>(static_cast<std::int32_t>(i)), 4);
      } else {  // LONG1: minimal little-endian two's complement
        std::string bytes;
        std::int64_t x = i;
        do {
          bytes += static_cast<char>(x & 0xff);
          x >>= 8;
        } while (!((x == 0 && !(bytes.back() & 0x80)) || (x == -1 && (bytes.back() & 0x80))));
        out += '\x8a';
        out += static_cast<char>(bytes.size());
        out += bytes;
      }
      break;
    }
    case k::real: {
      out += 'G';
      const std::uint64_t bits = std::bit_cast<std::uint64_t>(v.as_real(""));
      for (int i = 7; i >= 0; --i) out += static_cast<char>((bits >> (8 * i)) & 0xff);  // big-endian
      break;
    }
    case k::string: {
      const std::string& s = v.as_string("");
      // a BINUNICODE holds UTF-8: Python's unpickler (torch's, and shardsafe's readers) refuse
      // anything else, so a file written with it could not be read back
      if (!is_valid_utf8(s))
        fail(errc::invalid_argument, "a str to pickle is not UTF-8 (Python's unpickler refuses it)");
      out += 'X';
      le(s.size(), 4);
      out += s;
      break;
    }
    // Lists and dicts are filled in batches of 1000, a batch of one with APPEND/SETITEM, as
    // Python's pickler does: the reader then never holds more than 1000 of their items on its
    // stack, and the bytes are Python's own (less its memo PUTs).
    case k::list: {
      out += ']';
      const auto& items = v.as_sequence("");
      for (std::size_t b = 0; b < items.size(); b += 1000) {
        const std::size_t e = std::min(items.size(), b + 1000);
        if (e - b > 1) out += '(';
        for (std::size_t i = b; i < e; ++i) pickle_put(out, items[i]);
        out += e - b > 1 ? 'e' : 'a';
      }
      break;
    }
    case k::tuple: {
      const auto& items = v.as_sequence("");
      if (items.empty()) {
        out += ')';
        break;
      }
      if (items.size() > 3) out += '(';
      for (const auto& x : items) pickle_put(out, x);
      out += items.size() == 1 ? '\x85' : items.size() == 2 ? '\x86' : items.size() == 3 ? '\x87' : 't';
      break;
    }
    // bytes, bytearray, set and frozenset as protocol 2 writes them: a REDUCE of a builtin (its
    // Python 2 name), bytes through codecs.encode(its bytes as a latin-1 str, 'latin1')
    case k::bytes: {
      const pickle_bytes& b = v.as_bytes("");
      auto encoded = [&] {
        std::string utf8;
        for (unsigned char c : b.data) {
          if (c < 0x80) {
            utf8 += char(c);
          } else {
            utf8 += char(0xc0 | (c >> 6));
            utf8 += char(0x80 | (c & 0x3f));
          }
        }
        out += "c_codecs\nencode\nX";
        le(utf8.size(), 4);
        out += utf8;
        out += std::string_view("X\x06\x00\x00\x00latin1\x86R", 13);  // NULs inside: its size given
      };
      if (b.bytearray) {
        out += "c__builtin__\nbytearray\n";
        if (b.data.empty()) {
          out += ")R";
        } else {
          encoded();
          out += "\x85R";
        }
      } else if (b.data.empty()) {
        out += "c__builtin__\nbytes\n)R";
      } else {
        encoded();
      }
      break;
    }
    case k::set: {
      const pickle_set& st = v.as_set("");
      out += st.frozen ? "c__builtin__\nfrozenset\n" : "c__builtin__\nset\n";
      pickle_put(out, pickle_value::list(st.items));
      out += "\x85R";
      break;
    }
    case k::dict: {
      out += '}';
      const std::size_t n = v.dict_size();
      for (std::size_t b = 0; b < n; b += 1000) {
        const std::size_t e = std::min(n, b + 1000);
        if (e - b > 1) out += '(';
        for (std::size_t i = b; i < e; ++i) {
          pickle_put(out, v.dict_key(i));
          pickle_put(out, v.dict_value(i));
        }
        out += e - b > 1 ? 'u' : 's';
      }
      break;
    }
  }
}

}  // namespace detail

/// Pickles a plain value with protocol 2 (strings must be UTF-8).
SHARDSAFE_DECL std::string pickle_dumps(const pickle_value& v);

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/format/impl/pickle_writer.ipp"
#endif
