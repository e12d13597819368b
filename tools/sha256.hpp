// tools/sha256.hpp - SHA-256 through OpenSSL's libcrypto, for the shardsafe tool's digests.
//
// Not part of the installed library: only the tool hashes, so only the tool links libcrypto
// (the library's pkg-config file and CMake package need no OpenSSL).
#pragma once

#include <openssl/evp.h>

#include <array>
#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/hex.hpp"

namespace shardsafe::tool {

/// An incremental SHA-256: update() with the bytes in order, then hex() once.
class sha256 {
 public:
  sha256() : ctx_(EVP_MD_CTX_new(), &EVP_MD_CTX_free) {
    if (!ctx_ || EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) != 1)
      fail(errc::invalid_argument, "SHA-256: OpenSSL initialisation failed");
  }
  void update(std::span<const std::byte> b) {
    if (!b.empty() && EVP_DigestUpdate(ctx_.get(), b.data(), b.size()) != 1)
      fail(errc::invalid_argument, "SHA-256: update failed");
  }
  /// The digest as 64 lowercase hex digits; the object is spent afterwards.
  std::string hex() {
    std::array<unsigned char, EVP_MAX_MD_SIZE> md{};
    unsigned int len = 0;
    if (EVP_DigestFinal_ex(ctx_.get(), md.data(), &len) != 1) fail(errc::invalid_argument, "SHA-256: final failed");
    return shardsafe::detail::to_hex(md.data(), len);
  }

 private:
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx_;
};

}  // namespace shardsafe::tool
