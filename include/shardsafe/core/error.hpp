// shardsafe/core/error.hpp - the error codes and the exception family users catch.
//
// Every failure a user can cause (bad input, a missing file, a mismatched shape) is reported
// as a shardsafe::error: a std::system_error whose code is a shardsafe::errc in the
// shardsafe category (or, for operating-system failures, the errno value in the generic
// category), and whose message names the file, the tensor and the rule involved.
//
// errc is an error condition: `e.code() == errc::shape_mismatch` tests a code without caring
// how it was made, and `e.code() == errc::io_error` holds both for shardsafe's own io_error and
// for any errno value in the generic or system category (a failed open, mkdir, fsync...), so
// one comparison catches every operating-system failure. To build a code from an errc, call
// make_error_code (shardsafe::error's constructor does).
#pragma once

#include <string>
#include <string_view>
#include <system_error>
#include <utility>

namespace shardsafe {

/// What went wrong, independent of the message text.
enum class errc {
  ok = 0,
  io_error = 1,       ///< an operating-system call failed (errno is in the message)
  not_found,          ///< a file, tensor or key does not exist
  already_exists,     ///< a target exists and overwriting was not asked for
  invalid_header,     ///< a safetensors header breaks a rule of docs/FORMAT.md §1
  invalid_json,       ///< bytes that are not UTF-8 JSON, or JSON of the wrong shape
  unknown_dtype,      ///< a dtype name this library does not know
  unsupported_dtype,  ///< a known dtype that this operation cannot handle
  invalid_shape,      ///< a negative, non-integer or overflowing shape
  invalid_offsets,    ///< data offsets that are out of order, overlap, leave holes or overflow
  truncated,          ///< the file ends before its data does, or has trailing bytes
  invalid_spec,       ///< a shard spec that does not fit its tensor
  invalid_metadata,   ///< a checkpoint metadata.json or HF index that breaks a rule
  shape_mismatch,     ///< the caller's tensor and the checkpoint disagree on shape
  dtype_mismatch,     ///< the caller's tensor and the checkpoint disagree on dtype
  missing_coverage,   ///< no file holds some elements the caller asked for
  invalid_argument,   ///< the caller passed something that cannot work
  comm_error,         ///< a collective failed or ranks disagreed
  foreign_exception,  ///< an exception that is not a shardsafe::error, carried to other
                      ///< ranks (its what() is in the message)
  checksum_mismatch,  ///< stored bytes that do not match the checksum recorded for them
  unsafe_link,        ///< a symbolic link that leaves the checkpoint's folder
};
}  // namespace shardsafe

template <>
struct std::is_error_condition_enum<shardsafe::errc> : std::true_type {};

namespace shardsafe {

namespace detail {
class error_category_impl final : public std::error_category {
 public:
  const char* name() const noexcept override { return "shardsafe"; }
  std::string message(int c) const override {
    switch (static_cast<errc>(c)) {
      case errc::ok: return "ok";
      case errc::io_error: return "I/O error";
      case errc::not_found: return "not found";
      case errc::already_exists: return "already exists";
      case errc::invalid_header: return "invalid safetensors header";
      case errc::invalid_json: return "invalid JSON";
      case errc::unknown_dtype: return "unknown dtype";
      case errc::unsupported_dtype: return "unsupported dtype";
      case errc::invalid_shape: return "invalid shape";
      case errc::invalid_offsets: return "invalid data offsets";
      case errc::truncated: return "truncated or trailing data";
      case errc::invalid_spec: return "invalid shard spec";
      case errc::invalid_metadata: return "invalid checkpoint metadata";
      case errc::shape_mismatch: return "shape mismatch";
      case errc::dtype_mismatch: return "dtype mismatch";
      case errc::missing_coverage: return "missing coverage";
      case errc::invalid_argument: return "invalid argument";
      case errc::comm_error: return "communication error";
      case errc::foreign_exception: return "exception from outside shardsafe";
      case errc::checksum_mismatch: return "checksum mismatch";
      case errc::unsafe_link: return "link leaves the folder";
    }
    return "unknown shardsafe error";
  }
  using std::error_category::equivalent;
  /// A code is equivalent to a shardsafe condition when it is that errc in this category, or,
  /// for errc::io_error, when it is any errno value in the generic or system category.
  bool equivalent(const std::error_code& code, int condition) const noexcept override {
    if (code.category() == *this) return code.value() == condition;
    if (condition == static_cast<int>(errc::io_error))
      return code.value() != 0 &&
             (code.category() == std::generic_category() || code.category() == std::system_category());
    return false;
  }
};
}  // namespace detail

/// The category of shardsafe::errc values.
inline const std::error_category& error_category() noexcept {
  static const detail::error_category_impl category;
  return category;
}

/// The code shardsafe throws for e (what shardsafe::error carries).
inline std::error_code make_error_code(errc e) noexcept { return {static_cast<int>(e), error_category()}; }

/// The condition e, which codes compare equal to (see error_category_impl::equivalent).
inline std::error_condition make_error_condition(errc e) noexcept { return {static_cast<int>(e), error_category()}; }

namespace detail {
/// A message with every NUL byte written `\x00`: what() is a C string, and a name that holds a NUL
/// (a tensor's, read from a file) would otherwise cut the message short there.
inline std::string without_nul(const std::string& m) {
  if (m.find('\0') == std::string::npos) return m;
  std::string out;
  out.reserve(m.size() + 8);
  for (char c : m)
    if (c == '\0')
      out += "\\x00";
    else
      out += c;
  return out;
}

/// A name (a tensor's, a file's, read from input) as messages quote it: whole up to 256 bytes, a
/// longer one cut to its first 192 and its length. A context string built for each of many
/// entries then costs a bounded amount, whatever names a hostile file holds.
inline std::string shown_name(std::string_view n) {
  if (n.size() <= 256) return std::string(n);
  return std::string(n.substr(0, 192)) + "...(" + std::to_string(n.size()) + " bytes)";
}
}  // namespace detail

/// The exception every shardsafe function throws for bad input or failed I/O.
/// what() is the full message (NUL bytes written `\x00`); code() compares equal to an errc (and,
/// for operating-system failures, to errc::io_error and to the std::errc of its errno value).
class error : public std::system_error {
 public:
  error(errc code, const std::string& message)
      : std::system_error(make_error_code(code), detail::without_nul(message)),
        message_(detail::without_nul(message)) {}
  error(std::error_code code, const std::string& message)
      : std::system_error(code, detail::without_nul(message)), message_(detail::without_nul(message)) {}
  /// The message alone, without the ": category message" suffix std::system_error appends.
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

/// Throw a shardsafe::error. Marked cold: the compiler treats paths that call it as unlikely
/// and places them away from the hot code.
[[noreturn, gnu::cold]] inline void fail(errc code, const std::string& message) { throw error(code, message); }

/// Throw for a failed system call: the message gets ": strerror(errno)" appended.
[[noreturn, gnu::cold]] inline void fail_errno(int err, const std::string& message) {
  throw error(std::error_code(err, std::generic_category()), message + ": " + std::generic_category().message(err));
}

}  // namespace shardsafe
