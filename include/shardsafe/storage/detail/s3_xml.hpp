// shardsafe/storage/detail/s3_xml.hpp - what the s3 backend reads out of S3's XML answers
// (no XML library: S3's documents are flat, and only named elements are read) and the
// multipart ETag rule. No network library.
#pragma once

#include <openssl/evp.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/hex.hpp"
#include "shardsafe/storage/detail/s3_sigv4.hpp"

namespace shardsafe::detail {

/// The text of the first <tag>...</tag> in xml at or after `from`, entities decoded.
SHARDSAFE_DECL std::optional<std::string> xml_text(std::string_view xml, std::string_view tag, std::size_t from = 0,
                                                   std::size_t* end = nullptr);

/// The ETag S3 gives the object of a completed multipart upload: "hex(md5(concatenation of
/// the binary MD5s of the parts))-N" for N parts, quotes included. Each part's ETag is the MD5
/// of its bytes when the bucket does not encrypt with SSE-KMS (and in moto); nothing when one
/// of part_etags is not a quoted (or bare) 32-digit hex MD5, for then the rule does not apply.
SHARDSAFE_DECL std::optional<std::string> multipart_etag(const std::vector<std::string>& part_etags);

}  // namespace shardsafe::detail

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/storage/detail/impl/s3_xml.ipp"
#endif
