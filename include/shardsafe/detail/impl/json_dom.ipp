// shardsafe/detail/impl/json_dom.ipp - json_dom.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/detail/json_dom.hpp"

namespace shardsafe::detail {

SHARDSAFE_DECL void require_unique_keys(simdjson::dom::element root, const std::string& what) {
  // Every object and array met, with its parent and its key in it (or its index): the path of
  // one is built only for a message, so memory stays linear in the document whatever its depth
  // and its keys' lengths.
  constexpr std::size_t none = std::size_t(-1);
  struct container {
    simdjson::dom::element e;
    std::size_t parent;
    std::string_view key;  // in the parent object; empty with index when the parent is an array
    std::size_t index;
  };
  std::vector<container> seen{{root, none, {}, 0}};
  std::vector<std::size_t> todo{0};
  auto path_of = [&](std::size_t at) {
    std::vector<std::size_t> chain;
    for (std::size_t i = at; seen[i].parent != none; i = seen[i].parent) chain.push_back(i);
    std::string path;
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
      const container& c = seen[*it];
      const bool in_array = seen[c.parent].e.type() == simdjson::dom::element_type::ARRAY;
      if (in_array)
        path += "[" + std::to_string(c.index) + "]";
      else
        path += (path.empty() ? "" : ".") + std::string(c.key);
    }
    return path;
  };
  std::vector<std::string_view> keys;
  while (!todo.empty()) {
    const std::size_t at = todo.back();
    todo.pop_back();
    const simdjson::dom::element e = seen[at].e;
    simdjson::dom::object o;
    simdjson::dom::array a;
    if (!e.get_object().get(o)) {
      keys.clear();
      for (auto kv : o) {
        keys.push_back(kv.key);
        const auto t = kv.value.type();
        if (t == simdjson::dom::element_type::OBJECT || t == simdjson::dom::element_type::ARRAY) {
          todo.push_back(seen.size());
          seen.push_back({kv.value, at, kv.key, 0});
        }
      }
      if (const std::string problem = duplicate_key_problem(keys, what, [&] { return path_of(at); }); !problem.empty())
        fail(errc::invalid_json, problem);
    } else if (!e.get_array().get(a)) {
      std::size_t i = 0;
      for (auto v : a) {
        const auto t = v.type();
        if (t == simdjson::dom::element_type::OBJECT || t == simdjson::dom::element_type::ARRAY) {
          todo.push_back(seen.size());
          seen.push_back({v, at, {}, i});
        }
        ++i;
      }
    }
  }
}

}  // namespace shardsafe::detail
