// shardsafe/dist/message.hpp - the one encoding of what ranks send each other: a sequence of
// fields, each a 64-bit count (little-endian) or a string (its length, then its bytes), read back
// in the same order with every length checked against what is left. Its users (issue 52):
//   - every step's outcome, success or error (dist/agree.hpp: step_outcome::encode / decode);
//   - a save's plan: each rank's description of its views and their replica roles
//     (checkpoint/description_message.hpp, checkpoint/save_agree.hpp: agree_on_metadata);
//   - a rank file written: its size and checksum table (checkpoint/save_write.hpp: encode_written);
//   - a DCP save's chunk places (checkpoint/dcp_save.hpp: encode_dcp_places);
//   - the HF import's tensor table, broadcast by rank 0 (checkpoint/hf/import.hpp).
// Nothing else that travels between ranks is JSON or text lines.
//
// A malformed message (a length past the end, bytes left over, a count out of the range the
// reader asks for) is errc::comm_error naming the sender ("the message from rank 2's plan is
// malformed: ..."): it means a rank of another build, or memory damage, never user input.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/error.hpp"

namespace shardsafe {

/// Builds a message field by field.
class message_writer {
 public:
  message_writer& count(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xff);
    return *this;
  }
  message_writer& text(std::string_view s) {
    count(s.size());
    out_.append(s);
    return *this;
  }
  message_writer& counts(const std::vector<std::uint64_t>& v) {
    count(v.size());
    for (auto x : v) count(x);
    return *this;
  }
  message_writer& flag(bool b) { return count(b ? 1 : 0); }
  const std::string& str() const& noexcept { return out_; }
  std::string str() && noexcept { return std::move(out_); }

 private:
  std::string out_;
};

/// Reads a message written by message_writer, in the same order.
class message_reader {
 public:
  message_reader(std::string_view bytes, std::string from) : rest_(bytes), from_(std::move(from)) {}

  std::uint64_t count(std::uint64_t max = UINT64_MAX) {
    if (rest_.size() < 8) malformed("it ends inside a number");
    std::uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(rest_[static_cast<std::size_t>(i)]);
    rest_.remove_prefix(8);
    if (v > max) malformed("a count of " + std::to_string(v) + " passes " + std::to_string(max));
    return v;
  }
  /// A count at most max; what names it in the error ("tensor 'w''s dtype is 99, past 21").
  std::uint64_t count(std::uint64_t max, std::string_view what) {
    const std::uint64_t v = count();
    if (v > max) malformed(std::string(what) + " is " + std::to_string(v) + ", past " + std::to_string(max));
    return v;
  }
  /// How many items follow, each at least min_bytes long: a count bounded by what is left, so
  /// that a reader may reserve that many.
  std::uint64_t items(std::size_t min_bytes, std::string_view what) {
    const std::uint64_t v = count();
    if (min_bytes == 0) min_bytes = 1;
    if (v > rest_.size() / min_bytes)
      malformed(std::to_string(v) + " " + std::string(what) + " cannot fit in the " + std::to_string(rest_.size()) +
                " bytes left");
    return v;
  }
  /// A flag written by message_writer::flag (a count of 0 or 1).
  bool flag(std::string_view what) { return count(1, what) != 0; }
  std::string text() {
    const std::uint64_t n = count();
    if (n > rest_.size()) malformed("a string of " + std::to_string(n) + " bytes runs past its end");
    std::string s(rest_.substr(0, static_cast<std::size_t>(n)));
    rest_.remove_prefix(static_cast<std::size_t>(n));
    return s;
  }
  std::vector<std::uint64_t> counts() {
    const std::uint64_t n = count(rest_.size() / 8);
    std::vector<std::uint64_t> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = count();
    return v;
  }
  bool done() const noexcept { return rest_.empty(); }
  /// Fails unless every byte was read.
  void finish() const {
    if (!rest_.empty()) malformed(std::to_string(rest_.size()) + " bytes are left over");
  }
  [[noreturn]] void malformed(const std::string& why) const {
    fail(errc::comm_error, "the message from " + from_ + " is malformed: " + why);
  }

 private:
  std::string_view rest_;
  std::string from_;
};

}  // namespace shardsafe
