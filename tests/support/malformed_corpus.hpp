// tests/support/malformed_corpus.hpp - safetensors files built byte by byte: one malformed file per rule
// of docs/FORMAT.md §1's reader-reject list (with the errc and message phrases a reader must give),
// and valid edge cases a reader must accept. Shared by test_safetensors.cpp and test_tool.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/error.hpp"

namespace corpus {

/// n as 8 little-endian bytes, written out by hand (independent of the library).
inline std::string le64(std::uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

/// A whole file: the length prefix, the JSON header exactly as given, then the data bytes.
inline std::string file_bytes(std::string_view json, std::string_view data = {}) {
  return le64(json.size()) + std::string(json) + std::string(data);
}

/// {"NAME":{"dtype":"DT","shape":SHAPE,"data_offsets":OFFS}} - one tensor entry (no braces).
inline std::string entry(std::string_view name, std::string_view dt, std::string_view shape, std::string_view offs) {
  return "\"" + std::string(name) + "\":{\"dtype\":\"" + std::string(dt) + "\",\"shape\":" + std::string(shape) +
         ",\"data_offsets\":" + std::string(offs) + "}";
}

struct malformed_case {
  std::string name;                  ///< file name; every message must contain it (or its path)
  std::string bytes;                 ///< the whole file
  shardsafe::errc code;              ///< the error a reader must give
  std::vector<std::string> phrases;  ///< more substrings the message must contain
};

struct valid_case {
  std::string name;
  std::string bytes;
  std::size_t tensors;  ///< how many tensors a reader finds
};

inline std::vector<malformed_case> malformed() {
  using shardsafe::errc;
  const std::string d4(4, 'x'), d8(8, 'x'), d12(12, 'x');
  const std::string w4 = "{" + entry("w", "U8", "[4]", "[0,4]") + "}";
  std::vector<malformed_case> c = {
      // header shorter than 8 bytes
      {"short_0.safetensors", "", errc::truncated, {"0 bytes", "shorter than the 8-byte header length"}},
      {"short_5.safetensors", std::string("\x02\0\0\0\0", 5), errc::truncated, {"5 bytes", "shorter than the 8-byte"}},
      // N too large, N past the end of the file
      {"n_too_large.safetensors", le64(100'000'001) + "{}", errc::invalid_header, {"100000001", "exceeds the limit"}},
      {"n_max.safetensors",
       le64(~std::uint64_t(0)) + "{}",
       errc::invalid_header,
       {"18446744073709551615", "exceeds the limit"}},
      {"n_past_eof.safetensors", le64(64) + "{}      ", errc::truncated, {"header length 64", "runs past the end"}},
      {"n_past_eof_by_one.safetensors", le64(9) + "{}      ", errc::truncated, {"header length 9", "past the end"}},
      // non-UTF-8, non-JSON, not an object
      {"utf8_bad_byte.safetensors",
       file_bytes("{" + entry("w\xff", "U8", "[4]", "[0,4]") + "}", d4),
       errc::invalid_json,
       {"not valid UTF-8"}},
      {"utf8_surrogate.safetensors",
       file_bytes("{\"__metadata__\":{\"k\":\"\xed\xa0\x80\"}}"),
       errc::invalid_json,
       {"not valid UTF-8"}},
      {"utf8_overlong.safetensors",
       file_bytes("{\"__metadata__\":{\"k\":\"\xc0\xaf\"}}"),
       errc::invalid_json,
       {"not valid UTF-8"}},
      {"json_cut.safetensors", file_bytes("{\"w\":{\"dtype\":\"U8\",", d4), errc::invalid_json, {"not valid JSON"}},
      {"json_garbage_after.safetensors", file_bytes(w4 + " x", d4), errc::invalid_json, {"not valid JSON"}},
      {"json_nul_padding.safetensors",
       file_bytes(w4 + std::string(3, '\0'), d4),
       errc::invalid_json,
       {"not valid JSON"}},
      {"json_bigint_offset.safetensors",
       file_bytes("{" + entry("w", "U8", "[4]", "[0,18446744073709551616]") + "}", d4),
       errc::invalid_json,
       {"not valid JSON", "the number 18446744073709551616", "(w.data_offsets[1])", "64-bit integer"}},
      {"json_bigint_shape.safetensors",
       file_bytes("{" + entry("a", "U8", "[4]", "[0,4]") + "," +
                      entry("b b", "U8", "[1,-99999999999999999999]", "[4,4]") + "}",
                  d4),
       errc::invalid_json,
       {"not valid JSON", "(b b.shape[1])", "below the smallest 64-bit integer"}},
      {"json_huge_double.safetensors",
       file_bytes("{\"__metadata__\":{\"k\":\"v\"},\"w\":{\"x\":[{\"y\":1e999}]}}"),
       errc::invalid_json,
       {"not valid JSON", "the number 1e999", "(w.x[0].y)", "too large for a double"}},
      {"not_object_array.safetensors", file_bytes("[1,2]   "), errc::invalid_header, {"not a JSON object"}},
      {"not_object_string.safetensors", file_bytes("\"{}\""), errc::invalid_header, {"not a JSON object"}},
      {"not_object_null.safetensors", file_bytes("null"), errc::invalid_header, {"not a JSON object"}},
      // unknown dtype
      {"dtype_unknown.safetensors",
       file_bytes("{" + entry("w", "F128", "[2]", "[0,32]") + "}", std::string(32, 'x')),
       errc::unknown_dtype,
       {"tensor 'w'", "unknown dtype 'F128'"}},
      {"dtype_lowercase.safetensors",
       file_bytes("{" + entry("w", "f32", "[1]", "[0,4]") + "}", d4),
       errc::unknown_dtype,
       {"tensor 'w'", "unknown dtype 'f32'"}},
      // negative or non-integer shape
      {"shape_negative.safetensors",
       file_bytes("{" + entry("w", "U8", "[-1,2]", "[0,4]") + "}", d4),
       errc::invalid_shape,
       {"tensor 'w'", "shape[0]", "negative number -1"}},
      {"shape_float.safetensors",
       file_bytes("{" + entry("w", "U8", "[2.5]", "[0,4]") + "}", d4),
       errc::invalid_shape,
       {"tensor 'w'", "shape[0]", "non-integer"}},
      {"shape_float_integral.safetensors",
       file_bytes("{" + entry("w", "U8", "[4.0]", "[0,4]") + "}", d4),
       errc::invalid_shape,
       {"tensor 'w'", "shape[0]", "non-integer"}},
      {"shape_string.safetensors",
       file_bytes("{" + entry("w", "U8", "[2,\"2\"]", "[0,4]") + "}", d4),
       errc::invalid_shape,
       {"tensor 'w'", "shape[1]", "a string"}},
      // negative or non-integer offset
      {"offset_negative.safetensors",
       file_bytes("{" + entry("w", "U8", "[4]", "[-4,0]") + "}", d4),
       errc::invalid_offsets,
       {"tensor 'w'", "data_offsets[0]", "negative number -4"}},
      {"offset_float.safetensors",
       file_bytes("{" + entry("w", "U8", "[4]", "[0,4.5]") + "}", d4),
       errc::invalid_offsets,
       {"tensor 'w'", "data_offsets[1]", "non-integer"}},
      {"offset_null.safetensors",
       file_bytes("{" + entry("w", "U8", "[4]", "[0,null]") + "}", d4),
       errc::invalid_offsets,
       {"tensor 'w'", "data_offsets[1]", "null"}},
      // numel x itemsize overflow
      {"numel_overflow.safetensors",
       file_bytes("{" + entry("w", "U8", "[4294967296,4294967296]", "[0,4]") + "}", d4),
       errc::invalid_shape,
       {"tensor 'w'", "[4294967296,4294967296]", "overflows 64 bits"}},
      {"bytes_overflow.safetensors",
       file_bytes("{" + entry("w", "F64", "[2305843009213693952]", "[0,8]") + "}", d8),
       errc::invalid_shape,
       {"tensor 'w'", "overflows 64 bits"}},
      // span != numel x itemsize
      {"span_mismatch.safetensors",
       file_bytes("{" + entry("w", "F32", "[4,5]", "[0,96]") + "}", std::string(96, 'x')),
       errc::invalid_offsets,
       {"tensor 'w'", "span 96 bytes but shape [4,5] F32 needs 80"}},
      {"span_mismatch_0d.safetensors",
       file_bytes("{" + entry("s", "F64", "[]", "[0,4]") + "}", d4),
       errc::invalid_offsets,
       {"tensor 's'", "span 4 bytes but shape [] F64 needs 8"}},
      {"span_mismatch_empty.safetensors",
       file_bytes("{" + entry("e", "F32", "[0,3]", "[0,4]") + "}", d4),
       errc::invalid_offsets,
       {"tensor 'e'", "needs 0"}},
      {"subbyte_partial.safetensors",
       file_bytes("{" + entry("q", "F4", "[3]", "[0,2]") + "}", "xx"),
       errc::invalid_shape,
       {"tensor 'q'", "12 bits, not a whole number of bytes"}},
      // holes
      {"hole_middle.safetensors",
       file_bytes("{" + entry("a", "U8", "[4]", "[0,4]") + "," + entry("b", "U8", "[4]", "[8,12]") + "}", d12),
       errc::invalid_offsets,
       {"tensor 'b'", "leave a hole", "[4, 8)"}},
      {"hole_start.safetensors",
       file_bytes("{" + entry("w", "U8", "[4]", "[4,8]") + "}", d8),
       errc::invalid_offsets,
       {"tensor 'w'", "leave a hole", "[0, 4)"}},
      // overlaps
      {"overlap.safetensors",
       file_bytes("{" + entry("a", "U8", "[8]", "[0,8]") + "," + entry("b", "U8", "[8]", "[4,12]") + "}", d12),
       errc::invalid_offsets,
       {"tensor 'b'", "overlap tensor 'a'"}},
      {"overlap_same.safetensors",
       file_bytes("{" + entry("b", "U8", "[4]", "[0,4]") + "," + entry("a", "U8", "[4]", "[0,4]") + "}", d4),
       errc::invalid_offsets,
       {"tensor 'b'", "overlap tensor 'a'"}},
      {"overlap_empty_inside.safetensors",
       file_bytes("{" + entry("a", "U8", "[8]", "[0,8]") + "," + entry("e", "U8", "[0]", "[4,4]") + "}", d8),
       errc::invalid_offsets,
       {"tensor 'e'", "overlap tensor 'a'"}},
      // END < BEGIN
      {"end_before_begin.safetensors",
       file_bytes("{" + entry("w", "U8", "[4]", "[8,4]") + "}", d8),
       errc::invalid_offsets,
       {"tensor 'w'", "[8, 4)", "end before they begin"}},
      // trailing bytes, truncation
      {"trailing_bytes.safetensors",
       file_bytes(w4, d4 + "yyy"),
       errc::truncated,
       {"3 trailing bytes after the last tensor"}},
      {"trailing_after_empty.safetensors", file_bytes("{}      ", "z"), errc::truncated, {"1 trailing bytes"}},
      {"truncated.safetensors",
       file_bytes("{" + entry("w", "F32", "[4]", "[0,16]") + "}", std::string(10, 'x')),
       errc::truncated,
       {"truncated", "tensor 'w'", "needs 16 bytes", "the file has"}},
      {"truncated_no_data.safetensors",
       file_bytes("{" + entry("a", "U8", "[4]", "[0,4]") + "," + entry("b", "I32", "[1]", "[4,8]") + "}"),
       errc::truncated,
       {"truncated", "tensor 'b'"}},
      // duplicate names
      {"duplicate_name.safetensors",
       file_bytes("{" + entry("a", "U8", "[4]", "[0,4]") + "," + entry("a", "U8", "[4]", "[4,8]") + "}", d8),
       errc::invalid_header,
       {"'a' appears twice"}},
      {"duplicate_metadata.safetensors",
       file_bytes("{\"__metadata__\":{},\"__metadata__\":{}," + entry("a", "U8", "[4]", "[0,4]") + "}", d4),
       errc::invalid_header,
       {"'__metadata__' appears twice"}},
      {"duplicate_metadata_key.safetensors",
       file_bytes("{\"__metadata__\":{\"k\":\"v\",\"k\":\"w\"}}"),
       errc::invalid_header,
       {"__metadata__", "'k' twice"}},
      // in fields readers ignore, named by where they are
      {"duplicate_key_in_array.safetensors",
       file_bytes(
           "{\"w\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4],\"x\":[{},[{\"a\":1}],{\"a\":1,\"a\":2}]}}",
           d4),
       errc::invalid_json,
       {"key 'a' appears twice in one object (at w.x[2])"}},
      {"duplicate_key_nested.safetensors",
       file_bytes("{\"w\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4],\"x\":[[{\"y\":{\"k\":1,\"k\":2}}]]}}",
                  d4),
       errc::invalid_json,
       {"key 'k' appears twice in one object (at w.x[0][0].y)"}},
      // __metadata__ that is not string -> string
      {"metadata_list.safetensors",
       file_bytes("{\"__metadata__\":[\"a\"]}"),
       errc::invalid_header,
       {"__metadata__ is not an object of strings"}},
      {"metadata_string.safetensors",
       file_bytes("{\"__metadata__\":\"pt\"}"),
       errc::invalid_header,
       {"__metadata__ is not an object of strings"}},
      {"metadata_number.safetensors",
       file_bytes("{\"__metadata__\":{\"format\":\"pt\",\"n\":1}}"),
       errc::invalid_header,
       {"__metadata__ value of 'n' is not a string"}},
      {"metadata_null.safetensors",
       file_bytes("{\"__metadata__\":{\"n\":null}}"),
       errc::invalid_header,
       {"value of 'n' is not a string"}},
      {"metadata_nested.safetensors",
       file_bytes("{\"__metadata__\":{\"n\":{\"a\":\"b\"}}}"),
       errc::invalid_header,
       {"value of 'n' is not a string"}},
      // missing fields and wrong types
      {"missing_dtype.safetensors",
       file_bytes("{\"w\":{\"shape\":[4],\"data_offsets\":[0,4]}}", d4),
       errc::invalid_header,
       {"tensor 'w'", "missing \"dtype\""}},
      {"missing_shape.safetensors",
       file_bytes("{\"w\":{\"dtype\":\"U8\",\"data_offsets\":[0,4]}}", d4),
       errc::invalid_header,
       {"tensor 'w'", "missing \"shape\""}},
      {"missing_offsets.safetensors",
       file_bytes("{\"w\":{\"dtype\":\"U8\",\"shape\":[4]}}", d4),
       errc::invalid_header,
       {"tensor 'w'", "missing \"data_offsets\""}},
      {"entry_not_object.safetensors",
       file_bytes("{\"w\":[1,2]}"),
       errc::invalid_header,
       {"tensor 'w'", "entry is not an object"}},
      {"dtype_not_string.safetensors",
       file_bytes("{\"w\":{\"dtype\":8,\"shape\":[4],\"data_offsets\":[0,4]}}", d4),
       errc::invalid_header,
       {"tensor 'w'", "dtype is not a string"}},
      {"shape_not_array.safetensors",
       file_bytes("{" + entry("w", "U8", "4", "[0,4]") + "}", d4),
       errc::invalid_shape,
       {"tensor 'w'", "shape is not an array"}},
      {"offsets_not_array.safetensors",
       file_bytes("{" + entry("w", "U8", "[4]", "\"0,4\"") + "}", d4),
       errc::invalid_offsets,
       {"tensor 'w'", "data_offsets is not an array"}},
      {"offsets_three.safetensors",
       file_bytes("{" + entry("w", "U8", "[4]", "[0,4,4]") + "}", d4),
       errc::invalid_offsets,
       {"tensor 'w'", "has 3 numbers, not 2"}},
      {"offsets_one.safetensors",
       file_bytes("{" + entry("w", "U8", "[0]", "[0]") + "}"),
       errc::invalid_offsets,
       {"tensor 'w'", "has 1 numbers, not 2"}},
      // a name that would split a one-line message
      {"name_newline.safetensors",
       file_bytes("{" + entry("a\\nb", "Q8", "[4]", "[0,4]") + "}", d4),
       errc::unknown_dtype,
       {"unknown dtype 'Q8'"}},
  };
  return c;
}

/// Valid edge cases a reader must accept.
inline std::vector<valid_case> valid_edges() {
  const std::string w2 = entry("w", "U8", "[2]", "[0,2]");
  return {
      {"leading_whitespace.safetensors", file_bytes(" \t\r\n{" + w2 + "}", "ab"), 1},
      {"empty_header_padded.safetensors", file_bytes("{}      "), 0},
      {"empty_header_unpadded.safetensors", file_bytes("{}"), 0},
      {"metadata_is_null.safetensors", file_bytes("{\"__metadata__\":null," + w2 + "}", "ab"), 1},
      {"trailing_spaces.safetensors", file_bytes("{" + w2 + "}" + std::string(37, ' '), "ab"), 1},
      {"empty_tensors_shared_offset.safetensors",
       file_bytes("{" + entry("a", "U8", "[0]", "[0,0]") + "," + entry("b", "F32", "[3,0]", "[0,0]") + "," +
                      entry("c", "I16", "[2]", "[0,4]") + "," + entry("d", "BOOL", "[0,5]", "[4,4]") + "," +
                      entry("e", "F64", "[0]", "[4,4]") + "}",
                  "abcd"),
       5},
      {"only_empty.safetensors", file_bytes("{" + entry("e", "F32", "[0]", "[0,0]") + "}"), 1},
      {"zero_d.safetensors", file_bytes("{" + entry("s", "F64", "[]", "[0,8]") + "}", "12345678"), 1},
      {"metadata_only.safetensors", file_bytes("{\"__metadata__\":{\"format\":\"pt\"}}"), 0},
      {"offsets_out_of_json_order.safetensors",
       file_bytes("{" + entry("b", "U8", "[2]", "[2,4]") + "," + entry("a", "U8", "[2]", "[0,2]") + "}", "abcd"), 2},
  };
}

}  // namespace corpus
