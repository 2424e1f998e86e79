// kvq/core/dispatch.hpp — map run-time values to instantiated templates.
//
//   kvq::dispatch_head_dim<64, 128>(d, [&]<int D>() { ... });
//   kvq::dispatch_preset<128>("K4V2_H", [&]<kvq::Policy P>() { ... });
//
// The default branch returns Status::unsupported naming the value and what *is*
// instantiated; nothing outside the listed set is ever instantiated. The macros
// KVQ_DISPATCH_HEAD_DIM / KVQ_DISPATCH_PRESET wrap these for C-style call sites.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "kvq/core/policy.hpp"
#include "kvq/core/status.hpp"

namespace kvq {

// Calls f.template operator()<D>() for the D in Dims equal to head_dim.
// f returns void or Status.
template <int... Dims, class F>
Status dispatch_head_dim(int head_dim, F&& f) {
  Status result(StatusCode::unsupported, "");
  bool found = false;
  auto try_one = [&]<int D>() {
    if (found || head_dim != D) return;
    found = true;
    if constexpr (std::is_same_v<decltype(f.template operator()<D>()), void>) {
      f.template operator()<D>();
      (void)(result = Status{});
    } else {
      result = f.template operator()<D>();
    }
  };
  (try_one.template operator()<Dims>(), ...);
  if (!found) {
    std::string list;
    ((list += (list.empty() ? "" : ", ") + std::to_string(Dims)), ...);
    return {StatusCode::unsupported,
            "head_dim " + std::to_string(head_dim) + " is not instantiated (available: " + list + ")"};
  }
  return result;
}

// Calls f.template operator()<P>() with P = the named preset at head_dim D.
template <int D, class F>
Status dispatch_preset(std::string_view name, F&& f) {
  constexpr std::size_t N = std::size(presets::all);
  Status result;
  bool found = false;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    auto try_one = [&]<std::size_t K>() {
      if (found || presets::all[K].name != name) return;
      found = true;
      constexpr Policy P = presets::all[K].policy.with_head_dim(D);
      if constexpr (std::is_same_v<decltype(f.template operator()<P>()), void>) {
        f.template operator()<P>();
      } else {
        result = f.template operator()<P>();
      }
    };
    (try_one.template operator()<I>(), ...);
  }(std::make_index_sequence<N>{});
  if (!found) {
    std::string list;
    for (const auto& p : presets::all) list += (list.empty() ? "" : ", ") + std::string(p.name);
    return {StatusCode::unsupported, "unknown policy '" + std::string(name) + "' (available: " + list + ")"};
  }
  return result;
}

}  // namespace kvq

// KVQ_DISPATCH_HEAD_DIM(head_dim, D, (64, 128), { body using constexpr int D; })
#define KVQ_DISPATCH_HEAD_DIM(value, NAME, DIMS, ...) \
  ::kvq::dispatch_head_dim<KVQ_UNPAREN DIMS>((value), [&]<int NAME>() __VA_ARGS__)
// KVQ_DISPATCH_PRESET(name, D, P, { body using constexpr kvq::Policy P; })
#define KVQ_DISPATCH_PRESET(name, D, NAME, ...) \
  ::kvq::dispatch_preset<D>((name), [&]<::kvq::Policy NAME>() __VA_ARGS__)
#define KVQ_UNPAREN(...) __VA_ARGS__
