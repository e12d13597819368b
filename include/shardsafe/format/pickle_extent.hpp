// shardsafe/format/pickle_extent.hpp - where a pickle ends, found from its opcodes' lengths alone
// (nothing is made), so that a file holding one pickle is read only up to its STOP, as Python's
// unpickler reads it: bytes after STOP are never read, whatever their number (a DCP `.metadata`
// followed by a gigabyte of anything is read in the memory its pickle needs).
//
// pickle_scanner walks the opcodes of protocols 0 to 5 by the length of their arguments (fixed,
// length-prefixed, or a text line up to '\n'), as pickletools lists them, a window at a time: it
// says either where the pickle ends (STOP, its byte included) or up to which byte it needs the
// input before it can go on. It checks nothing else: the pickle reader (format/pickle_reader.hpp)
// then reads the bytes up to that end with all its rules. Where the reader would refuse anyway
// the scanner ends early, so that no refused pickle is read further than needed: an opcode byte
// no protocol has, a text line longer than max_pickle_line (the reader's lines are at most 256
// bytes), and a STOP inside a FRAME that runs on past it (the reader's rule, said here).
// read_pickle_bytes reads one pickle from a ReadableStorage so.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "shardsafe/core/error.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// The longest text line (a protocol-0 opcode's argument up to '\n') the scanner looks for its
/// end in; a longer one ends the scan there (the reader then refuses the opcode).
inline constexpr std::uint64_t max_pickle_line = std::uint64_t(64) << 10;

/// Finds where a pickle ends (see the top of this header). Feed it the input's first bytes,
/// then the same bytes with more after them, until it says `ends`.
class pickle_scanner {
 public:
  struct result {
    bool ends = false;  ///< true: the pickle is bytes [0, at); false: scan again with `at` bytes or more
    std::uint64_t at = 0;
  };

  /// Scans `in` (the input's first in.size() bytes, the same as before and maybe more) from
  /// where the last call stopped; `what` names the input in messages (errc::invalid_metadata).
  result scan(std::string_view in, std::string_view what) {
    while (true) {
      if (pos_ >= in.size()) return {false, pos_ + 1};
      const std::uint64_t at = pos_;
      const auto op = static_cast<unsigned char>(in[at]);
      const std::uint64_t left = in.size() - at - 1;  // bytes after the opcode
      auto needs = [&](std::uint64_t n) { return n > left; };
      std::uint64_t arg = 0;  // bytes of the argument after the opcode byte
      switch (op) {
        case '.':  // STOP
          if (frame_end_ > at + 1)
            fail(errc::invalid_metadata,
                 std::string(what) + ": pickle STOP at byte " + std::to_string(at) +
                     " lies inside a FRAME that runs to byte " + std::to_string(frame_end_) +
                     " (Python reads a frame whole, so what follows STOP there is not where it would be)");
          return {true, at + 1};
        case '(':
        case '0':
        case '1':
        case '2':
        case 'N':
        case 'R':
        case 'a':
        case 'b':
        case 'd':
        case '}':
        case 'e':
        case 'l':
        case ']':
        case 'o':
        case 's':
        case 't':
        case ')':
        case 'u':
        case 'Q':
        case 0x81:
        case 0x85:
        case 0x86:
        case 0x87:
        case 0x88:
        case 0x89:
        case 0x8f:
        case 0x90:
        case 0x91:
        case 0x92:
        case 0x93:
        case 0x94:
        case 0x97:
        case 0x98: break;
        case 'K':
        case 'h':
        case 'q':
        case 0x80:
        case 0x82: arg = 1; break;
        case 'M':
        case 0x83: arg = 2; break;
        case 'J':
        case 'j':
        case 'r':
        case 0x84: arg = 4; break;
        case 'G': arg = 8; break;
        case 0x95:  // FRAME: its length, then opcodes as usual
          if (needs(8)) return {false, at + 9};
          frame_end_ = at + 9 + le(in, at + 1, 8);
          if (frame_end_ < at + 9) frame_end_ = UINT64_MAX;
          arg = 8;
          break;
        case 0x8a:
        case 'U':
        case 0x8c:
        case 'C': arg = prefixed(in, at, 1); break;
        case 0x8b:
        case 'T':
        case 'X':
        case 'B': arg = prefixed(in, at, 4); break;
        case 0x8d:
        case 0x8e:
        case 0x96: arg = prefixed(in, at, 8); break;
        case 'I':
        case 'L':
        case 'F':
        case 'S':
        case 'V':
        case 'P':
        case 'g':
        case 'p':
        case 'c':
        case 'i': {
          // one line ('c' GLOBAL and 'i' INST: two), each up to '\n'
          const int lines = (op == 'c' || op == 'i') ? 2 : 1;
          std::uint64_t q = at + 1;
          for (int k = 0; k < lines; ++k) {
            const std::uint64_t from = q;
            const auto nl = in.find('\n', static_cast<std::size_t>(q));
            if (nl == std::string_view::npos) {
              if (in.size() - from > max_pickle_line) return {true, from + max_pickle_line};
              return {false, in.size() + 1};
            }
            if (nl - from > max_pickle_line) return {true, from + max_pickle_line};
            q = nl + 1;
          }
          pos_ = q;
          continue;
        }
        default: return {true, at + 1};  // no protocol has it: the reader refuses it, naming it
      }
      if (arg == UINT64_MAX) return {false, UINT64_MAX};
      if (needs(arg)) return {false, at + 1 + arg};
      pos_ = at + 1 + arg;
    }
  }

 private:
  static std::uint64_t le(std::string_view b, std::uint64_t at, unsigned n) {
    std::uint64_t x = 0;
    for (unsigned i = n; i-- > 0;) x = (x << 8) | static_cast<unsigned char>(b[static_cast<std::size_t>(at + i)]);
    return x;
  }
  // the length field of n bytes after the opcode and the bytes it counts (UINT64_MAX: past 2^64)
  std::uint64_t prefixed(std::string_view in, std::uint64_t at, unsigned n) const {
    if (in.size() - at - 1 < n) return n;  // the length itself is not there yet
    const std::uint64_t len = le(in, at + 1, n);
    return len > UINT64_MAX - n - at - 1 ? UINT64_MAX : n + len;
  }

  std::uint64_t pos_ = 0;        // the next opcode
  std::uint64_t frame_end_ = 0;  // where the last FRAME ends
};

/// The bytes of the one pickle st holds, up to and with its STOP (pickle_scanner): what follows
/// is never read. Read in windows of 1 MiB, larger as the pickle needs; the pickle may take at
/// most `limit` bytes (errc::invalid_metadata naming st and the limit). It must be of protocol 2
/// or newer: a file whose first byte is not PROTO is refused at once. Where the file ends
/// before the pickle does, its bytes so far are returned (the reader says it is truncated).
template <ReadableStorage S>
std::string read_pickle_bytes(const S& st, std::uint64_t limit) {
  const std::string name(st.name());
  const std::uint64_t size = st.size();
  constexpr std::uint64_t window = std::uint64_t(1) << 20, padding = 64;
  pickle_scanner scanner;
  std::string bytes;
  // room for all the pickle may take, once (growing by doubling held up to twice the text at its
  // end); a size that lies costs address space only, no page of it is touched unread
  bytes.reserve(static_cast<std::size_t>(std::min(size, limit) + padding));
  std::uint64_t want = std::min({size, limit, window});
  bool from_start = true;
  while (true) {
    if (want > bytes.size()) {
      const std::uint64_t from = bytes.size();
      if (bytes.capacity() < want + padding)
        bytes.reserve(static_cast<std::size_t>(std::max<std::uint64_t>(want + padding, 2 * bytes.capacity())));
      bytes.resize(static_cast<std::size_t>(want));
      st.read_into(from, std::as_writable_bytes(std::span(bytes)).subspan(static_cast<std::size_t>(from)));
    }
    if (from_start && !bytes.empty() && static_cast<unsigned char>(bytes[0]) != 0x80)
      fail(errc::invalid_metadata, name + ": does not start with a pickle's PROTO opcode (byte 0 is " +
                                       std::to_string(static_cast<unsigned char>(bytes[0])) + ")");
    from_start = false;
    const auto r = scanner.scan(bytes, name);
    if (r.ends) {
      bytes.resize(static_cast<std::size_t>(std::min<std::uint64_t>(r.at, bytes.size())));
      break;
    }
    if (r.at > size) break;  // the file ends first: the reader says where
    if (r.at > limit)
      fail(errc::invalid_metadata, name + ": pickle does not end within its first " + std::to_string(limit) +
                                       " bytes, the limit of a pickle read here (it needs bytes up to " +
                                       std::to_string(r.at) + ")");
    const std::uint64_t grown = std::min(limit, bytes.size() + std::max<std::uint64_t>(window, bytes.size() / 2));
    want = std::min(size, std::max(r.at, grown));
  }
  if (bytes.capacity() < bytes.size() + padding) bytes.reserve(bytes.size() + padding);
  return bytes;
}

}  // namespace shardsafe
