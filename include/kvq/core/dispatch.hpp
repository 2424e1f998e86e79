// kvq/core/dispatch.hpp — map run-time values to instantiated templates.
//
//   kvq::dispatch_head_dim<64, 128>(d, [&]<int D>() { ... });
//   kvq::dispatch_preset<128>("K4V2_H", [&]<kvq::Policy P>() { ... });
//   kvq::dispatch_preset<128, kShipped>("K2V2_R:vclip=1000", ...);   // an engine's own list
//
// The default branch returns StatusCode::unsupported (also for a spelling parse_policy
// rejects, with its message) naming the value and what *is*
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

// Calls f.template operator()<P>() with P = the policy spelled `spelling` (a preset name
// with optional modifiers, parse_policy) at head_dim D, if it is one of Instantiated
// (an array of presets::NamedPolicy; default: every preset) at head_dim D. Only the
// policies of Instantiated are instantiated, so an engine lists what it ships:
//   inline constexpr kvq::presets::NamedPolicy kShipped[] = {
//       {"K4V2", kvq::presets::K4V2}, {"K2V2_R:vclip=1000", kvq::presets::K2V2_R.with_clip(960, 1000)}};
//   kvq::dispatch_preset<128, kShipped>(config_string, f);
// A valid spelling that is not instantiated returns unsupported naming what is.
template <int D, const auto& Instantiated = presets::all, class F>
Status dispatch_preset(std::string_view spelling, F&& f) {
  constexpr std::size_t N = std::size(Instantiated);
  Policy wanted{};
  if (Status parsed = parse_policy(spelling, wanted); !parsed.ok()) return {StatusCode::unsupported, parsed.message()};
  wanted = wanted.with_head_dim(D);
  Status result;
  bool found = false;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    auto try_one = [&]<std::size_t K>() {
      constexpr Policy P = Instantiated[K].policy.with_head_dim(D);
      if (found || !(P == wanted)) return;
      found = true;
      if constexpr (std::is_same_v<decltype(f.template operator()<P>()), void>) {
        f.template operator()<P>();
      } else {
        result = f.template operator()<P>();
      }
    };
    (try_one.template operator()<I>(), ...);
  }(std::make_index_sequence<N>{});
  if (!found)
    return {StatusCode::unsupported, "policy '" + std::string(spelling) + "' is not instantiated (available: " +
                                         presets::names(Instantiated) + ")"};
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
