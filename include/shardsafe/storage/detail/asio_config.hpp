// shardsafe/storage/detail/asio_config.hpp - what Boost.Asio must know before its first include in
// a translation unit that uses the remote backends.
//
// The HTTP client's exchanges are C++20 coroutines (boost::asio::awaitable). Boost's Asio before
// 1.81 turns on `co_await` support for clang only when <experimental/coroutine> exists, which
// libstdc++ (the standard library clang uses on Linux) does not have: with clang and libstdc++,
// Boost 1.74's `boost::asio::awaitable` is then missing ("no template named 'awaitable'"). Clang
// has C++20 coroutines (<coroutine>, __cpp_impl_coroutine), so this header says so before Asio's
// configuration is read. Every remote header includes it before any Boost header; a translation
// unit that includes Boost.Asio itself before shardsafe's remote headers must define
// BOOST_ASIO_HAS_CO_AWAIT=1 itself (the check below names the fix).
#pragma once

#if defined(__clang__) && !defined(BOOST_ASIO_HAS_CO_AWAIT) && !defined(BOOST_ASIO_DISABLE_CO_AWAIT) && \
    defined(__cpp_impl_coroutine) && __cplusplus >= 202002L
#if __has_include(<coroutine>)
#if defined(BOOST_ASIO_DETAIL_CONFIG_HPP)
#error \
    "shardsafe: Boost.Asio was included before shardsafe's remote headers without coroutine support for clang: include shardsafe/storage/http.hpp or s3.hpp first, or define BOOST_ASIO_HAS_CO_AWAIT=1"
#endif
#define BOOST_ASIO_HAS_CO_AWAIT 1
#endif
#endif
