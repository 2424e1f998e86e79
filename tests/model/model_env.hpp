// Shared by the model tests: the SmolLM2 file loaded once per process, or a skip.
#pragma once

#include <gtest/gtest.h>

#include <memory>

#include "common.hpp"
#include "model.hpp"
#include "tokenizer.hpp"

namespace kvq_test {

struct LoadedModel {
  smollm2::GGUFFile file;
  smollm2::Model model;
  smollm2::Tokenizer tok;
};

// nullptr when the model file is absent.
inline const LoadedModel* smollm2_model() {
  static std::unique_ptr<LoadedModel> m = []() -> std::unique_ptr<LoadedModel> {
    auto path = smollm2::find_model();
    if (!path) return nullptr;
    auto f = smollm2::GGUFFile::open(*path);
    auto model = smollm2::Model::load(f);
    smollm2::Tokenizer tok(f);
    return std::unique_ptr<LoadedModel>(new LoadedModel{std::move(f), std::move(model), std::move(tok)});
  }();
  return m.get();
}

}  // namespace kvq_test

#define KVQ_REQUIRE_SMOLLM2(var)                         \
  const auto* var = ::kvq_test::smollm2_model();         \
  if (!var) GTEST_SKIP() << ::smollm2::kFetchHint
