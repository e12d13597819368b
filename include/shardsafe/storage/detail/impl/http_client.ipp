// shardsafe/storage/detail/impl/http_client.ipp - http_client.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/storage/detail/http_client.hpp"
#include "shardsafe/storage/detail/http_engine.hpp"

namespace shardsafe {
namespace detail {
inline namespace SHARDSAFE_HTTP_ABI {

SHARDSAFE_DECL http_client::http_client(http_options o)
    : opt_(normalized(std::move(o))), engine_(std::make_unique<http_engine>(opt_, stats_)) {}

SHARDSAFE_DECL http_client::~http_client() = default;

SHARDSAFE_DECL http_response http_client::send(http_request req, request_signer sign) {
  return engine_->send(std::move(req), sign);
}

SHARDSAFE_DECL void http_client::read_range(const url_parts& url, std::uint64_t off, std::span<std::byte> dst,
                                            std::uint64_t total, request_signer sign,
                                            const object_validator& validator) {
  engine_->read_range(url, off, dst, total, sign, validator);
}

SHARDSAFE_DECL void http_client::read_ranges(const url_parts& url, std::span<const read_request> parts,
                                             std::uint64_t total, request_signer sign,
                                             const object_validator& validator) {
  engine_->read_ranges(url, parts, total, sign, validator);
}

}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace detail
}  // namespace shardsafe
