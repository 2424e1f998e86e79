// smollm2_eval — SmolLM2-135M on the CPU with a kvq KV cache.
//
//   smollm2_eval eval --text wiki.test.raw --tokens 8192 --ctx 1024 --policies fp32,K4V2,K4V2_H
//   smollm2_eval eval --text wiki.test.raw --policies K2V2_R@a,K2V2_R@b --artifact a=A.safetensors
//                     --artifact b=B.safetensors --layer-policies layers.csv   (kvq_calib outputs)
//   smollm2_eval generate --prompt "What is the capital of France?" --chat --policy K4V2_H
//   smollm2_eval generate --prompt "..." --policy K2V2_R --artifact optr.safetensors
//   smollm2_eval passkey --lengths 2048,4096,8192 --trials 20 --policies K4V2_HC,K2V2_R --artifact optr.safetensors
//   smollm2_eval capture --text wiki.test.raw --seq-len 448 --seqs 2 --layers 0,14,29 --out acts.safetensors
//   smollm2_eval logits --prompt "The capital of France is" --out logits.f32
//
// Perplexity scores every token of a chunk but its first, or from --score-from on
// (non-overlapping chunks of --ctx tokens, each with a fresh cache). KL(p_fp32 ‖ p_policy) and top-1 agreement are
// measured against the fp32 cache on the same positions, and so is each run's log-ppl gap,
// with its standard error over the chunks (--baseline adds the share of one run's gap that
// each other run closes: the figure of OptR against its base). Tokens go through the model in
// blocks of --block (appended to the cache, then attended as the last --block queries),
// so the sink/recent windows behave as in block-wise decoding.
#include <CLI/CLI.hpp>
#include <fmt/core.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <system_error>
#include <thread>

#include "cache_config.hpp"
#include "common.hpp"
#include "generate.hpp"
#include "kvq/calib/activation_file.hpp"
#include "kvq/calib/artifact.hpp"
#include "gguf.hpp"
#include "kvq/io/safetensors.hpp"
#include "model.hpp"
#include "tokenizer.hpp"

namespace {

using namespace smollm2;

struct Loaded {
  smollm2::GGUFFile file;
  Model model;
  smollm2::Tokenizer tok;
};

std::unique_ptr<Loaded> load(const std::string& path_arg) {
  std::filesystem::path path = path_arg.empty() ? smollm2::default_model_path() : std::filesystem::path(path_arg);
  if (!std::filesystem::is_regular_file(path))
    throw kvq::Error(kvq::StatusCode::io_error, "model file '" + path.string() + "' is missing. " + smollm2::kFetchHint);
  auto f = smollm2::GGUFFile::open(path);
  auto m = Model::load(f);
  smollm2::Tokenizer t(f);
  return std::unique_ptr<Loaded>(new Loaded{std::move(f), std::move(m), std::move(t)});
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---- eval -------------------------------------------------------------------------------

struct EvalArgs {
  std::string text, policies = "fp32,K8V8,K4V4,K4V2,K2V4,K2V2", csv;
  std::vector<std::string> artifacts;       // PATH (all *_R policies), POLICY=PATH or TAG=PATH
  std::vector<std::string> layer_policies;  // per-layer tables (kvq_calib allocate)
  int tokens = 8192, ctx = 1024, calib_tokens = 4096;
  int score_from = 0;  // first scored position of each chunk (llama-perplexity: ctx/2)
  std::string baseline;  // a --policies label: report the share of its log-ppl gap each run closes
};

// Paired chunk statistics against the fp32 run: every chunk scores the same positions, so
// the log-ppl gap of a run is the mean over chunks of its per-chunk mean NLL minus fp32's,
// and its standard error is that of the chunk differences (tokens within a chunk are
// correlated; chunks are treated as independent samples). x: per-chunk values.
struct ChunkMean {
  double mean = 0, se = std::nan("");
};
ChunkMean chunk_mean(const std::vector<double>& x) {
  ChunkMean r;
  const double n = double(x.size());
  for (double v : x) r.mean += v / n;
  if (x.size() > 1) {
    double ss = 0;
    for (double v : x) ss += (v - r.mean) * (v - r.mean);
    r.se = std::sqrt(ss / (n - 1) / n);
  }
  return r;
}

int cmd_eval(const std::string& model_path, const EvalArgs& a, const CacheArgs& ca) {
  auto L = load(model_path);
  const Model& m = L->model;
  const int n_layers = m.cfg.n_layers;
  const auto all = encode_prefix(L->tok, smollm2::read_text(a.text), std::size_t(a.tokens) + a.calib_tokens);
  if (static_cast<int>(all.size()) < a.tokens + 2)
    throw kvq::Error(kvq::StatusCode::invalid_argument,
                     fmt::format("text has {} tokens, fewer than --tokens {}", all.size(), a.tokens));
  const std::vector<int> eval(all.begin(), all.begin() + a.tokens);
  if (a.score_from + 1 >= a.ctx)
    throw kvq::Error(kvq::StatusCode::invalid_argument,
                     fmt::format("--score-from {} leaves nothing to score in chunks of {}", a.score_from, a.ctx));

  std::vector<Run> runs = make_runs(a.policies, a.layer_policies, n_layers, m.cfg.head_dim);
  std::ptrdiff_t baseline_run = -1;
  if (!a.baseline.empty()) {
    baseline_run = std::find_if(runs.begin(), runs.end(), [&](const Run& r) { return r.label == a.baseline; }) - runs.begin();
    if (baseline_run == std::ptrdiff_t(runs.size()) || runs[baseline_run].is_fp())
      throw kvq::Error(kvq::StatusCode::invalid_argument,
                       fmt::format("--baseline '{}' is not one of the quantized --policies runs", a.baseline));
  }

  // Key means for centering presets: from the tokens that follow the evaluated ones.
  std::vector<kvq::LayerParams> means;
  if (std::any_of(runs.begin(), runs.end(), [](const Run& r) { return any_centers_keys(r.policy); })) {
    const int n = std::min<int>(a.calib_tokens, static_cast<int>(all.size()) - a.tokens);
    if (n < 1) throw kvq::Error(kvq::StatusCode::invalid_argument, "key means need tokens after the evaluated span: raise --calib-tokens or use a longer text");
    const std::vector<int> calib(all.begin() + a.tokens, all.begin() + a.tokens + n);
    fmt::print(stderr, "key means from {} tokens after the evaluated span\n", calib.size());
    means = key_means(m, calib, a.ctx, ca);
  }
  // Learned rotations: the artifact named by the run's tag, else by the policy, else the bare path.
  Artifacts artifacts(a.artifacts, n_layers, m.cfg.head_dim);
  for (Run& run : runs) run.params = layer_params(run.policy, run.tag, artifacts, means);

  struct Acc {
    std::vector<double> chunk_nll;  // mean NLL of each chunk
    double nll = 0, kl = 0, kl_far = 0;
    long long scored = 0, agree = 0, far = 0;
    double bytes_per_token = 0;
    double secs = 0;
  };
  std::vector<Acc> acc(runs.size());
  const int n_chunks = a.tokens / a.ctx;
  RowMat logits;
  std::vector<std::vector<double>> fp_logp;  // [ctx][vocab] of the fp32 run
  std::vector<int> fp_top;
  std::vector<double> lp;
  const auto t_start = std::chrono::steady_clock::now();
  for (int c = 0; c < n_chunks; ++c) {
    const std::vector<int> chunk(eval.begin() + c * a.ctx, eval.begin() + (c + 1) * a.ctx);
    for (std::size_t r = 0; r < runs.size(); ++r) {
      const Run& run = runs[r];
      const auto t0 = std::chrono::steady_clock::now();
      auto caches = m.make_caches(run.policy, ca.options(), &run.params);
      run_sequence(m, chunk, caches, ca.block, &logits);
      Acc& A = acc[r];
      std::size_t bytes = 0;
      for (const auto& cc : caches) bytes += cc->bytes();
      A.bytes_per_token += double(bytes) / a.ctx / n_chunks;
      if (run.is_fp()) {
        fp_logp.resize(a.ctx);
        fp_top.resize(a.ctx);
      }
      const double nll_before = A.nll;
      for (int t = a.score_from; t + 1 < a.ctx; ++t) {
        smollm2::log_softmax(logits.row(t).data(), m.cfg.vocab, lp);
        A.nll -= lp[chunk[t + 1]];
        ++A.scored;
        const int top = static_cast<int>(std::max_element(lp.begin(), lp.end()) - lp.begin());
        if (run.is_fp()) {
          fp_logp[t] = lp;
          fp_top[t] = top;
          continue;
        }
        double kl = 0;
        const auto& P = fp_logp[t];
        for (int i = 0; i < m.cfg.vocab; ++i) kl += std::exp(P[i]) * (P[i] - lp[i]);
        A.kl += kl;
        A.agree += top == fp_top[t];
        if (t >= ca.sink + ca.recent) {  // positions whose context includes quantized tokens
          A.kl_far += kl;
          ++A.far;
        }
      }
      A.chunk_nll.push_back((A.nll - nll_before) / double(a.ctx - 1 - a.score_from));
      A.secs += seconds_since(t0);
      fmt::print(stderr, "[chunk {}/{}] {:<8} ppl so far {:8.4f}  ({:.1f}s, {:.0f}s total)\n", c + 1, n_chunks,
                 run.label, std::exp(A.nll / double(A.scored)), seconds_since(t0), seconds_since(t_start));
    }
  }

  // Log-ppl gap to fp32 per run, and the share of the baseline's gap each run closes, both
  // with their paired standard errors over chunks (the baseline's gap is taken as exact).
  std::vector<ChunkMean> gap(runs.size()), closed(runs.size());
  const std::size_t fp_run = 0;  // make_runs puts fp32 first
  auto chunk_gaps = [&](std::size_t r) {
    std::vector<double> d(acc[r].chunk_nll.size());
    for (std::size_t c = 0; c < d.size(); ++c) d[c] = acc[r].chunk_nll[c] - acc[fp_run].chunk_nll[c];
    return d;
  };
  for (std::size_t r = 0; r < runs.size(); ++r) gap[r] = chunk_mean(chunk_gaps(r));
  if (baseline_run >= 0 && gap[baseline_run].mean != 0) {  // no gap, no share of it
    const std::vector<double> base = chunk_gaps(baseline_run);
    for (std::size_t r = 0; r < runs.size(); ++r) {
      std::vector<double> gained = chunk_gaps(r);
      for (std::size_t c = 0; c < gained.size(); ++c) gained[c] = (base[c] - gained[c]) / gap[baseline_run].mean;
      closed[r] = chunk_mean(gained);
    }
  }

  std::FILE* csv = a.csv.empty() ? nullptr : std::fopen(a.csv.c_str(), "w");
  if (!a.csv.empty() && !csv) throw kvq::Error(kvq::StatusCode::io_error, "cannot write '" + a.csv + "'");
  if (csv)
    fmt::print(csv, "policy,bits_per_element,cache_bytes_per_token,ppl,kl,kl_far,top1,log_ppl_gap,log_ppl_gap_se,"
                    "gap_closed,gap_closed_se\n");
  fmt::print("SmolLM2-135M, {} tokens of {} in {} chunks of {}, positions >= {} scored (block {}, sink {}, recent {})\n",
             n_chunks * a.ctx, a.text, n_chunks, a.ctx, a.score_from, ca.block, ca.sink, ca.recent);
  const int w = label_width(runs);
  fmt::print("{:<{}} {:>9} {:>12} {:>10} {:>11} {:>11} {:>8} {:>19}{}\n", "policy", w, "bits/elem", "bytes/token", "ppl",
             "KL", "KL(t>=W)", "top1", "ln(ppl/fp32) ± SE", baseline_run >= 0 ? "   closes of " + a.baseline + "'s gap ± SE" : "");
  auto number = [](double x, const char* spec) { return std::isnan(x) ? std::string() : fmt::format(fmt::runtime(spec), x); };
  for (std::size_t r = 0; r < runs.size(); ++r) {
    const Acc& A = acc[r];
    const double ppl = std::exp(A.nll / double(A.scored));
    const bool fp = runs[r].is_fp();
    const double kl = fp ? 0 : A.kl / double(A.scored), klf = fp || !A.far ? 0 : A.kl_far / double(A.far);
    const double top1 = fp ? 1 : double(A.agree) / double(A.scored);
    const bool has_closed = baseline_run >= 0 && !fp && std::ptrdiff_t(r) != baseline_run && !std::isnan(closed[r].mean);
    const std::string gap_text = !fp ? fmt::format("{:+.5f} ± {:.5f}", gap[r].mean, gap[r].se) : "";
    const std::string closed_text =
        has_closed ? fmt::format("   {:+.1f}% ± {:.1f}%", 100 * closed[r].mean, 100 * closed[r].se) : "";
    fmt::print("{:<{}} {:>9.3f} {:>12.0f} {:>10.4f} {:>11.3e} {:>11.3e} {:>8.4f} {:>19}{}\n", runs[r].label, w,
               runs[r].bits, A.bytes_per_token, ppl, kl, klf, top1, gap_text, closed_text);
    if (csv)
      fmt::print(csv, "{},{:.4f},{:.1f},{:.5f},{:.6e},{:.6e},{:.5f},{},{},{},{}\n", runs[r].label, runs[r].bits,
                 A.bytes_per_token, ppl, kl, klf, top1, !fp ? number(gap[r].mean, "{:.6e}") : "",
                 !fp ? number(gap[r].se, "{:.6e}") : "", has_closed ? number(closed[r].mean, "{:.5f}") : "",
                 has_closed ? number(closed[r].se, "{:.5f}") : "");
  }
  if (csv) std::fclose(csv);
  return 0;
}

// ---- generate -----------------------------------------------------------------------------

// Where the caches' run-time parameters come from in subcommands that have no evaluated
// span to take key means after (generate, passkey): learned rotations from artifacts,
// and key means of the centering (_HC) layers from --calib-text, else the artifact's
// μ_K, else the subcommand's own tokens (see resolve_key_means).
struct ParamSources {
  std::vector<std::string> artifacts;
  std::string calib_text;
  int calib_tokens = 4096;

  void add_options(CLI::App* sub) {
    sub->add_option("--artifact", artifacts,
                    "OptR artifact (kvq_calib optr): μ_K, R_K, R_V of learned-rotation presets, and μ_K for _HC "
                    "presets; PATH, POLICY=PATH or TAG=PATH (repeatable)")
        ->check([](const std::string& e) {
          const std::string path = split_artifact_entry(e).second;
          return std::filesystem::is_regular_file(path) ? std::string() : "artifact file '" + path + "' not found";
        });
    sub->add_option("--calib-text", calib_text, "UTF-8 text whose first --calib-tokens tokens give the key means of _HC presets")
        ->check(CLI::ExistingFile);
    sub->add_option("--calib-tokens", calib_tokens, "tokens of --calib-text used for key means")->check(CLI::PositiveNumber);
  }

  // Fills every run's parameters and says on stderr where they came from.
  void resolve(const Loaded& L, std::vector<Run>& runs, const std::vector<int>& fallback,
               const std::string& fallback_name, const CacheArgs& ca) const {
    const Model& m = L.model;
    Artifacts arts(artifacts, m.cfg.n_layers, m.cfg.head_dim);
    std::vector<kvq::LayerParams> means;
    if (std::any_of(runs.begin(), runs.end(), [](const Run& r) { return any_centers_keys(r.policy); })) {
      std::string source;
      means = resolve_key_means(m, L.tok, calib_text, calib_tokens, arts, fallback, fallback_name, ca, source);
      fmt::print(stderr, "key means (centered-key layers): {}\n", source);
    }
    for (Run& run : runs) {
      std::vector<std::string> learned;
      for (const auto& p : run.policy)
        if (policy_needs_artifact(p) && std::find(learned.begin(), learned.end(), p) == learned.end()) {
          learned.push_back(p);
          const std::string path = arts.path_for(p, run.tag);
          fmt::print(stderr, "learned rotations ({}): μ_K, R_K, R_V from {}\n", p, path.empty() ? "(none named)" : path);
        }
      run.params = layer_params(run.policy, run.tag, arts, means);
    }
  }
};

int cmd_generate(const std::string& model_path, const std::string& prompt, bool chat, int max_new,
                 const std::string& policy, const std::string& layer_table, const ParamSources& sources,
                 const CacheArgs& ca) {
  auto L = load(model_path);
  const Model& m = L->model;
  const std::string text = chat ? chat_prompt(prompt) : prompt;
  const std::vector<int> ids = L->tok.encode(text, /*parse_special=*/true);
  if (ids.empty()) throw kvq::Error(kvq::StatusCode::invalid_argument, "empty prompt");
  std::vector<Run> runs;
  if (!layer_table.empty()) {
    runs = make_runs("", {layer_table}, m.cfg.n_layers, m.cfg.head_dim);
    runs.erase(runs.begin());  // the fp32 reference run
    fmt::print(stderr, "policies: per layer from {}\n", layer_table);
  } else {
    runs = make_runs(policy, {}, m.cfg.n_layers, m.cfg.head_dim);
    if (policy != "fp32") runs.erase(runs.begin());
  }
  sources.resolve(*L, runs, ids, "the prompt itself", ca);
  auto caches = m.make_caches(runs[0].policy, ca.options(), &runs[0].params);
  fmt::print("{}", text);
  std::fflush(stdout);
  const auto out = greedy_generate(m, ids, caches, max_new, ca.block, stop_ids(L->tok), [&](int id) {
    fmt::print("{}", L->tok.decode_token(id));
    std::fflush(stdout);
  });
  fmt::print("\n");
  const int quantized = caches.front()->quantized_tokens();
  fmt::print(stderr, "{} prompt + {} generated tokens; {} of them in quantized pages (fp32 sink {} + recent {}){}\n",
             ids.size(), out.size(), quantized, ca.sink, ca.recent,
             quantized == 0 && !runs[0].is_fp()
                 ? ": the whole context fits the fp32 windows, so no token was quantized — lower --sink/--recent to "
                   "quantize short contexts"
                 : "");
  return 0;
}

// ---- passkey ------------------------------------------------------------------------------

struct PasskeyArgs {
  std::string policies = "fp32,K4V2_HC,K2V2_HC", lengths = "2048,4096,8192", csv;
  std::vector<std::string> layer_policies;
  int trials = 20, answer_tokens = 8;
  int threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  unsigned seed = 1;
  bool no_fp32 = false;  // skip the fp32 reference (its answers depend only on seed, lengths, trials)
};

// One retrieval prompt: a 5-digit key at a random depth of repeated filler, then the
// question (the passkey test of Mohtashami & Jaggi 2023, as LongLoRA and others run it).
struct PasskeyPrompt {
  std::vector<int> ids;
  std::string key;
  double depth = 0;
};

PasskeyPrompt make_passkey_prompt(const Tokenizer& tok, int target_tokens, std::mt19937& rng) {
  static const std::string intro =
      "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
      "I will quiz you about the important info there.\n";
  static const std::string filler = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
  static const std::string question = "\nWhat is the pass key? The pass key is";
  PasskeyPrompt p;
  p.key = std::to_string(std::uniform_int_distribution<int>(10000, 99999)(rng));
  p.depth = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
  const std::string needle = "\nThe pass key is " + p.key + ". Remember it. " + p.key + " is the pass key.\n";
  const int fixed = static_cast<int>(tok.encode(intro + needle + question).size());
  const int unit = static_cast<int>(tok.encode(filler).size());
  const int n = std::max(1, (target_tokens - fixed) / unit);
  const int before = static_cast<int>(std::lround(p.depth * n));
  std::string text = intro;
  for (int i = 0; i < before; ++i) text += filler;
  text += needle;
  for (int i = before; i < n; ++i) text += filler;
  text += question;
  p.ids = tok.encode(text);
  return p;
}

// Accuracy of greedy retrieval per policy and length; every policy sees the same prompts.
int cmd_passkey(const std::string& model_path, const PasskeyArgs& a, const ParamSources& sources, const CacheArgs& ca) {
  auto L = load(model_path);
  const Model& m = L->model;
  std::vector<int> lengths;
  for (const auto& s : split_csv(a.lengths)) {
    const int n = std::stoi(s);
    if (n < 64 || n > 32768) throw kvq::Error(kvq::StatusCode::invalid_argument, "--lengths must be in [64, 32768]");
    lengths.push_back(n);
  }
  std::vector<Run> runs = make_runs(a.policies, a.layer_policies, m.cfg.n_layers, m.cfg.head_dim);
  if (a.no_fp32) {
    if (runs.size() == 1) throw kvq::Error(kvq::StatusCode::invalid_argument, "--no-fp32 leaves no policy to run");
    runs.erase(runs.begin());
  }
  std::mt19937 haystack_rng(a.seed);
  const auto haystack = make_passkey_prompt(L->tok, 2048, haystack_rng).ids;
  sources.resolve(*L, runs, haystack, "a 2048-token passkey prompt", ca);

  // Every (length, trial, policy) is an independent job: its own caches, the shared
  // read-only model. Prompts are drawn (and encoded: the tokenizer's encode is not
  // thread-safe, decode is) in order first, so --threads changes only which job
  // finishes first, never a prompt or an answer.
  struct Job {
    std::size_t length, run;
    int trial;
  };
  std::vector<std::vector<PasskeyPrompt>> prompts(lengths.size());
  std::vector<Job> jobs;
  for (std::size_t li = 0; li < lengths.size(); ++li) {
    std::mt19937 rng(a.seed * 1000003u + static_cast<unsigned>(lengths[li]));
    for (int trial = 0; trial < a.trials; ++trial) {
      prompts[li].push_back(make_passkey_prompt(L->tok, lengths[li], rng));
      for (std::size_t r = 0; r < runs.size(); ++r) jobs.push_back({li, r, trial});
    }
  }
  std::vector<std::vector<int>> hits(runs.size(), std::vector<int>(lengths.size(), 0));
  std::atomic<std::size_t> next{0};
  std::mutex mu;  // guards hits, failure and stderr
  std::exception_ptr failure;
  const auto stop = stop_ids(L->tok);
  const auto t_start = std::chrono::steady_clock::now();
  auto worker = [&] {
    for (std::size_t j; (j = next.fetch_add(1)) < jobs.size();) {
      {
        std::lock_guard lock(mu);
        if (failure) return;
      }
      const Job& job = jobs[j];
      const PasskeyPrompt& p = prompts[job.length][job.trial];
      const Run& run = runs[job.run];
      try {
        auto caches = m.make_caches(run.policy, ca.options(), &run.params);
        const std::string answer = L->tok.decode(greedy_generate(m, p.ids, caches, a.answer_tokens, ca.block, stop));
        std::string digits;  // the first run of digits in the answer
        for (char c : answer) {
          if (std::isdigit(static_cast<unsigned char>(c))) digits += c;
          else if (!digits.empty()) break;
        }
        const bool ok = digits == p.key;
        std::lock_guard lock(mu);
        hits[job.run][job.length] += ok;
        fmt::print(stderr, "[{} tokens, trial {}/{}, depth {:.2f}] {:<10} key {} answer {:?} {} ({:.0f}s)\n",
                   p.ids.size(), job.trial + 1, a.trials, p.depth, run.label, p.key, answer, ok ? "ok" : "MISS",
                   seconds_since(t_start));
      } catch (...) {
        std::lock_guard lock(mu);
        if (!failure) failure = std::current_exception();
        return;
      }
    }
  };
  const int n_threads = std::max(1, std::min<int>(a.threads, static_cast<int>(jobs.size())));
  std::vector<std::thread> pool;
  for (int t = 1; t < n_threads; ++t) {
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error&) {
      break;  // no more threads: the started workers (and this one) take every job
    }
  }
  worker();
  for (auto& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
  std::FILE* csv = a.csv.empty() ? nullptr : std::fopen(a.csv.c_str(), "w");
  if (!a.csv.empty() && !csv) throw kvq::Error(kvq::StatusCode::io_error, "cannot write '" + a.csv + "'");
  if (csv) fmt::print(csv, "policy,bits_per_element,length,trials,correct,accuracy\n");
  fmt::print("SmolLM2-135M passkey retrieval, {} trials per length (seed {}, sink {}, recent {}); accuracy\n", a.trials,
             a.seed, ca.sink, ca.recent);
  const int w = label_width(runs);
  fmt::print("{:<{}} {:>9}", "policy", w, "bits/elem");
  for (int n : lengths) fmt::print(" {:>8}", n);
  fmt::print("\n");
  for (std::size_t r = 0; r < runs.size(); ++r) {
    fmt::print("{:<{}} {:>9.3f}", runs[r].label, w, runs[r].bits);
    for (std::size_t li = 0; li < lengths.size(); ++li) {
      fmt::print(" {:>8.2f}", double(hits[r][li]) / a.trials);
      if (csv)
        fmt::print(csv, "{},{:.4f},{},{},{},{:.4f}\n", runs[r].label, runs[r].bits, lengths[li], a.trials, hits[r][li],
                   double(hits[r][li]) / a.trials);
    }
    fmt::print("\n");
  }
  if (csv) std::fclose(csv);
  return 0;
}

// ---- capture ------------------------------------------------------------------------------

struct CaptureArgs {
  std::string text, out, layers = "all", dtype = "f32";
  int seq_len = 1024, seqs = 8, skip = 0;  // the calibration recipe (README): 6 train, 2 held out
  int mean_seqs = 0;  // further sequences whose keys only feed the per-layer key mean (k_mean)
  bool save_ids = false, save_kv_weights = false;
};

int cmd_capture(const std::string& model_path, const CaptureArgs& a, const CacheArgs& ca) {
  auto L = load(model_path);
  const Model& m = L->model;
  const auto& c = m.cfg;
  const long long need =
      static_cast<long long>(a.skip) + static_cast<long long>(a.seq_len) * (a.seqs + std::max(a.mean_seqs, 0));
  const auto all = encode_prefix(L->tok, smollm2::read_text(a.text), static_cast<std::size_t>(std::max(need, 0LL)));
  if (a.seq_len < 1 || a.seqs < 1 || a.mean_seqs < 0 || static_cast<long long>(all.size()) < need)
    throw kvq::Error(kvq::StatusCode::invalid_argument,
                     fmt::format("capture needs {} tokens, the text has {}", need, all.size()));
  smollm2::Capture cap;
  cap.layers.assign(c.n_layers, a.layers == "all");
  std::vector<int> chosen;
  if (a.layers != "all")
    for (const auto& s : split_csv(a.layers)) {
      const int l = std::stoi(s);
      if (l < 0 || l >= c.n_layers) throw kvq::Error(kvq::StatusCode::out_of_range, "layer " + s + " out of range");
      cap.layers[l] = true;
    }
  for (int l = 0; l < c.n_layers; ++l)
    if (cap.layers[l]) chosen.push_back(l);
  cap.q.resize(c.n_layers);
  cap.k.resize(c.n_layers);
  cap.v.resize(c.n_layers);
  auto caches = m.make_caches("fp32", ca.options());
  std::vector<std::int64_t> offsets{0};
  for (int s = 0; s < a.seqs; ++s) {
    const auto b = all.begin() + a.skip + static_cast<std::ptrdiff_t>(s) * a.seq_len;
    run_sequence(m, std::vector<int>(b, b + a.seq_len), caches, ca.block, nullptr, &cap);
    offsets.push_back(offsets.back() + a.seq_len);
    fmt::print(stderr, "captured sequence {}/{}\n", s + 1, a.seqs);
  }
  // Key means over the mean_seqs sequences after the captured ones: summed in fp64 in token
  // order, their K rows dropped after each sequence.   key_sum[l]: [Hkv·d]
  const std::int64_t d = c.head_dim, kv_row = c.n_kv_heads * d;
  std::vector<std::vector<double>> key_sum(c.n_layers);
  smollm2::Capture mcap;
  mcap.layers = cap.layers;
  mcap.q.resize(c.n_layers);
  mcap.k.resize(c.n_layers);
  mcap.v.resize(c.n_layers);
  for (int s = 0; s < a.mean_seqs; ++s) {
    const auto b = all.begin() + a.skip + static_cast<std::ptrdiff_t>(a.seqs + s) * a.seq_len;
    run_sequence(m, std::vector<int>(b, b + a.seq_len), caches, ca.block, nullptr, &mcap);
    for (int l : chosen) {
      key_sum[l].resize(static_cast<std::size_t>(kv_row), 0.0);
      for (std::size_t i = 0; i < mcap.k[l].size(); ++i) key_sum[l][i % kv_row] += mcap.k[l][i];
      mcap.q[l].clear();
      mcap.k[l].clear();
      mcap.v[l].clear();
    }
    fmt::print(stderr, "key-mean sequence {}/{}\n", s + 1, a.mean_seqs);
  }
  const std::int64_t mean_tokens = static_cast<std::int64_t>(a.mean_seqs) * a.seq_len;
  kvq::io::DType dt = kvq::io::DType::F32;
  if (a.dtype == "f16") dt = kvq::io::DType::F16;
  else if (a.dtype == "bf16") dt = kvq::io::DType::BF16;
  else if (a.dtype != "f32") throw kvq::Error(kvq::StatusCode::invalid_argument, "--dtype must be f32, f16 or bf16");
  const std::int64_t Ltot = offsets.back();
  std::vector<kvq::calib::LayerActivations> acts;
  std::string layer_list;
  for (int l : chosen) {
    kvq::calib::LayerActivations la;
    la.layer = l;
    la.n_tokens = static_cast<int>(Ltot);
    la.hq = c.n_heads;
    la.hkv = c.n_kv_heads;
    la.head_dim = c.head_dim;
    la.hidden = c.hidden;
    la.q = std::move(cap.q[l]);
    la.k = std::move(cap.k[l]);
    la.v = std::move(cap.v[l]);
    const RowMat& wo = m.layers[l].wo;  // [D, Hq·d]
    la.w_o.assign(wo.data(), wo.data() + wo.size());
    la.seq_offsets = offsets;
    la.rope = {c.rope_theta, kvq::calib::RopePairs::adjacent, c.context_length};  // model.hpp: (2i, 2i+1)
    if (mean_tokens > 0) {
      la.key_mean.resize(static_cast<std::size_t>(kv_row));
      for (std::int64_t i = 0; i < kv_row; ++i) la.key_mean[i] = static_cast<float>(key_sum[l][i] / mean_tokens);
      la.key_mean_tokens = mean_tokens;
    }
    acts.push_back(std::move(la));
    layer_list += (layer_list.empty() ? "" : ",") + std::to_string(l);
  }
  auto w = kvq::calib::activations_writer(acts, dt);
  if (a.save_kv_weights)  // [Hkv·d, D] (GGUF row order) for the norm-disparity report
    for (int l : chosen) {
      const std::string p = "layers." + std::to_string(l) + ".";
      const RowMat& wk = m.layers[l].wk;
      const RowMat& wv = m.layers[l].wv;
      w.add_f32(p + "w_k", {c.n_kv_heads * d, c.hidden}, {wk.data(), static_cast<std::size_t>(wk.size())}, dt);
      w.add_f32(p + "w_v", {c.n_kv_heads * d, c.hidden}, {wv.data(), static_cast<std::size_t>(wv.size())}, dt);
    }
  if (a.save_ids) {  // off by default: ids reproduce the text, which may not be redistributable
    std::vector<std::int32_t> ids(all.begin() + a.skip, all.begin() + a.skip + Ltot);
    w.add("token_ids", kvq::io::DType::I32, {Ltot}, ids.data());
  }
  w.set_metadata("model", "SmolLM2-135M-Instruct.Q4_1.gguf");
  w.set_metadata("n_layers", std::to_string(c.n_layers));
  w.set_metadata("source", fmt::format("{} tokens [{}, {}) of {}", Ltot, a.skip, a.skip + Ltot,
                                       std::filesystem::path(a.text).filename().string()));
  if (mean_tokens > 0)
    w.set_metadata("key_mean_source", fmt::format("{} tokens [{}, {}) of {}", mean_tokens, a.skip + Ltot,
                                                  a.skip + Ltot + mean_tokens,
                                                  std::filesystem::path(a.text).filename().string()));
  w.write(a.out);
  fmt::print(stderr, "wrote {} (layers {}, {} tokens in {} sequences)\n", a.out, layer_list, Ltot, a.seqs);
  return 0;
}

// ---- logits -------------------------------------------------------------------------------

int cmd_logits(const std::string& model_path, const std::string& prompt, const std::string& ids_arg,
               const std::string& out, const std::string& policy, const CacheArgs& ca) {
  auto L = load(model_path);
  std::vector<int> ids;
  if (!ids_arg.empty()) {
    for (const auto& s : split_csv(ids_arg)) ids.push_back(std::stoi(s));
  } else {
    ids = L->tok.encode(prompt);
  }
  if (ids.empty()) throw kvq::Error(kvq::StatusCode::invalid_argument, "no tokens");
  auto caches = L->model.make_caches(policy, ca.options());
  RowMat logits;
  run_sequence(L->model, ids, caches, ca.block, &logits);
  fmt::print("ids: {}\n", fmt::join(ids, ","));
  Eigen::Index top;
  logits.row(logits.rows() - 1).maxCoeff(&top);
  fmt::print("next token: {} {:?}\n", top, L->tok.decode_token(static_cast<int>(top)));
  if (!out.empty()) {
    std::ofstream f(out, std::ios::binary);
    f.write(reinterpret_cast<const char*>(logits.data()), static_cast<std::streamsize>(logits.size() * sizeof(float)));
    fmt::print("wrote [{}, {}] float32 logits to {}\n", logits.rows(), logits.cols(), out);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"SmolLM2-135M (GGUF) on the CPU with a kvq KV cache: perplexity, KL vs fp32, generation, capture"};
  app.require_subcommand(1);
  std::string model_path;
  CacheArgs ca;
  app.add_option("--model", model_path, "GGUF file (default: $KVQ_SMOLLM2_GGUF or ~/.cache/kvq/...; fetch with examples/smollm2/fetch_model.sh)");
  app.add_option("--sink", ca.sink, "full-precision attention-sink tokens")->check(CLI::NonNegativeNumber);
  app.add_option("--recent", ca.recent, "full-precision recent-window tokens")->check(CLI::NonNegativeNumber);
  app.add_option("--flush-block", ca.flush, "tokens quantized at a time when leaving the recent window")->check(CLI::PositiveNumber);
  app.add_option("--page-size", ca.page, "tokens per quantized page")->check(CLI::PositiveNumber);
  app.add_option("--block", ca.block, "tokens per forward step (append, then attend as the last block)")->check(CLI::Range(1, 512));
  app.add_flag("--int8-keys", ca.int8_keys,
               "score quantized keys with integer dot products on an int8 query (kvq::KeyScoring::int8_query)");
  app.add_flag("--int8-values", ca.int8_values,
               "accumulate quantized values on their codes with int8 weights (kvq::ValueAccumulation::int8_weights)");

  EvalArgs ea;
  auto* eval = app.add_subcommand("eval", "perplexity, KL vs fp32 and top-1 agreement for a list of policies");
  eval->add_option("--text", ea.text, "UTF-8 text file (e.g. wikitext-2-raw/wiki.test.raw)")->required()->check(CLI::ExistingFile);
  eval->add_option("--tokens", ea.tokens, "tokens evaluated (a multiple of --ctx is used)")->check(CLI::PositiveNumber);
  eval->add_option("--ctx", ea.ctx, "context length of each chunk")->check(CLI::Range(2, 8192));
  eval->add_option("--policies", ea.policies,
                   "comma-separated: fp32 and kvq policies (K4V2, K4V2_HC, K2V2_R@TAG, K2V2_R:vclip=1000@TAG, ...: a preset name, or a variant instantiated in caches.cpp)");
  eval->add_option("--score-from", ea.score_from,
                   "score only positions >= N of each chunk (N = ctx/2 scores as llama.cpp's llama-perplexity)")
      ->check(CLI::NonNegativeNumber);
  eval->add_option("--calib-tokens", ea.calib_tokens, "tokens after the evaluated span used for key means (*_HC presets)");
  eval->add_option("--csv", ea.csv, "also write the table as CSV");
  eval->add_option("--baseline", ea.baseline,
                   "a quantized --policies entry (its label, e.g. K2V2_R@base): also report the share of its "
                   "log-ppl gap to fp32 that each other run closes, ± its standard error over chunks");
  eval->add_option("--artifact", ea.artifacts,
                   "OptR artifact (kvq_calib optr) for learned-rotation presets: PATH, POLICY=PATH, or TAG=PATH for "
                   "a --policies entry POLICY@TAG (repeatable)");
  eval->add_option("--layer-policies", ea.layer_policies,
                   "per-layer policy table (CSV from kvq_calib allocate) evaluated as one more run (repeatable)")
      ->check(CLI::ExistingFile);

  std::string prompt, policy = "fp32";
  int n_new = 48;
  bool chat = false;
  std::string layer_table;
  ParamSources gen_sources;
  auto* gen = app.add_subcommand("generate", "greedy generation");
  gen->add_option("--prompt", prompt, "prompt text")->required();
  gen->add_flag("--chat", chat, "wrap the prompt in the ChatML template");
  gen->add_option("-n,--max-new", n_new, "tokens to generate")->check(CLI::PositiveNumber);
  gen->add_option("--policy", policy, "fp32 or a kvq preset name (K4V2, K2V2_HC, K2V2_R, ...)");
  gen->add_option("--layer-policies", layer_table, "per-layer policy table (CSV from kvq_calib allocate) instead of --policy")
      ->check(CLI::ExistingFile);
  gen_sources.add_options(gen);

  PasskeyArgs pa;
  ParamSources pk_sources;
  auto* pk = app.add_subcommand("passkey", "passkey retrieval accuracy at long context, per policy (fp32 first)");
  pk->add_option("--policies", pa.policies, "comma-separated: kvq policies (K4V2_HC, K2V2_R@TAG, K4V2_HC:vclip=1000, ...); fp32 runs first unless --no-fp32");
  pk->add_option("--layer-policies", pa.layer_policies, "per-layer policy table (kvq_calib allocate), one more run (repeatable)")
      ->check(CLI::ExistingFile);
  pk->add_option("--lengths", pa.lengths, "comma-separated prompt lengths in tokens (the model's context is 8192)");
  pk->add_option("--trials", pa.trials, "prompts per length (random key and depth)")->check(CLI::PositiveNumber);
  pk->add_option("--seed", pa.seed, "seed of keys and depths");
  pk->add_option("--threads", pa.threads, "trials run in parallel, one (prompt, policy) per thread (default: all cores)")
      ->check(CLI::PositiveNumber);
  pk->add_option("--csv", pa.csv, "also write the table as CSV");
  pk->add_flag("--no-fp32", pa.no_fp32,
               "skip the fp32 reference run (the same --seed, --lengths and --trials give the same prompts and answers)");
  pk_sources.add_options(pk);

  CaptureArgs cpa;
  auto* capc = app.add_subcommand("capture", "dump per-layer Q, K, V (post-RoPE) and W_O to safetensors (DESIGN §6 input)");
  capc->add_option("--text", cpa.text, "UTF-8 text file")->required()->check(CLI::ExistingFile);
  capc->add_option("--out", cpa.out, "output .safetensors")->required();
  capc->add_option("--layers", cpa.layers, "comma-separated layer indices or 'all'");
  capc->add_option("--seq-len", cpa.seq_len, "tokens per sequence")->check(CLI::PositiveNumber);
  capc->add_option("--seqs", cpa.seqs, "number of sequences")->check(CLI::PositiveNumber);
  capc->add_option("--skip", cpa.skip, "tokens skipped at the start of the text")->check(CLI::NonNegativeNumber);
  capc->add_option("--mean-seqs", cpa.mean_seqs,
                   "further sequences after the captured ones whose keys give each layer's key mean (k_mean)")
      ->check(CLI::NonNegativeNumber);
  capc->add_option("--dtype", cpa.dtype, "storage dtype: f32, f16 or bf16");
  capc->add_flag("--save-ids", cpa.save_ids, "also store the token ids (I32 [L]) as 'token_ids'");
  capc->add_flag("--kv-weights", cpa.save_kv_weights,
                 "also store W_K and W_V ([Hkv·d, D]) for kvq_calib allocate's norm-disparity report");

  std::string ids_arg, out;
  auto* lg = app.add_subcommand("logits", "logits of a prompt (for checking against a reference)");
  lg->add_option("--prompt", prompt, "prompt text");
  lg->add_option("--ids", ids_arg, "comma-separated token ids instead of a prompt");
  lg->add_option("--out", out, "write all logits as raw float32 [n, vocab]");
  lg->add_option("--policy", policy, "fp32 or a kvq preset name");

  CLI11_PARSE(app, argc, argv);
  try {
    if (*eval) return cmd_eval(model_path, ea, ca);
    if (*gen) return cmd_generate(model_path, prompt, chat, n_new, policy, layer_table, gen_sources, ca);
    if (*pk) return cmd_passkey(model_path, pa, pk_sources, ca);
    if (*capc) return cmd_capture(model_path, cpa, ca);
    if (*lg) return cmd_logits(model_path, prompt, ids_arg, out, policy, ca);
  } catch (const kvq::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
