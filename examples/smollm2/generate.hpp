// examples/smollm2/generate.hpp — greedy generation through per-layer kvq caches.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model.hpp"
#include "tokenizer.hpp"

namespace smollm2 {

// The prompt in the ChatML template of SmolLM2-Instruct.
inline std::string chat_prompt(const std::string& user) {
  return "<|im_start|>user\n" + user + "<|im_end|>\n<|im_start|>assistant\n";
}

// Ids that end a reply: EOS and <|im_end|> (where the vocabulary has them).
inline std::vector<int> stop_ids(const Tokenizer& tok) {
  std::vector<int> out;
  if (tok.eos() >= 0) out.push_back(tok.eos());
  for (int i = 0; i < tok.vocab_size(); ++i)
    if (tok.token(i) == "<|im_end|>") out.push_back(i);
  return out;
}

// Prefills `prompt` into `caches` (cleared first) in blocks of `block` tokens, then picks
// the most likely token up to `max_new` times, feeding each back as one decode step.
// Stops before emitting a stop id. `on_token` sees each new id as it is chosen.
inline std::vector<int> greedy_generate(const Model& m, const std::vector<int>& prompt,
                                        std::vector<std::unique_ptr<kvq::KVCache>>& caches, int max_new, int block,
                                        const std::vector<int>& stop, const std::function<void(int)>& on_token = {}) {
  if (prompt.empty()) throw kvq::Error(kvq::StatusCode::invalid_argument, "generate: empty prompt");
  if (block < 1 || max_new < 0) throw kvq::Error(kvq::StatusCode::invalid_argument, "generate: block >= 1, max_new >= 0");
  for (auto& c : caches) c->clear();
  RowMat logits;
  const int n_prompt = static_cast<int>(prompt.size());
  int pos = 0;
  for (int p = 0; p < n_prompt; p += block) {
    const int nb = std::min<int>(block, n_prompt - p);
    // Only the last block's logits pick the first token: the [nb, vocab] output product
    // is a quarter of an 8K-token prefill's time.
    m.forward(prompt.data() + p, nb, p, caches, p + nb == n_prompt ? &logits : nullptr);
    pos += nb;
  }
  std::vector<int> out;
  for (int i = 0; i < max_new; ++i) {
    Eigen::Index next;
    logits.row(logits.rows() - 1).maxCoeff(&next);
    const int id = static_cast<int>(next);
    if (std::find(stop.begin(), stop.end(), id) != stop.end()) break;
    out.push_back(id);
    if (on_token) on_token(id);
    if (i + 1 < max_new) m.forward(&id, 1, pos++, caches, &logits);
  }
  return out;
}

}  // namespace smollm2
