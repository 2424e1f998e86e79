// Greedy generation on SmolLM2 with every kind of preset: in process (fp32 vs K8V8 token
// agreement) and through `smollm2_eval generate` as a user runs it (plain, _H, _HC with
// each key-mean source, _R with an OptR artifact written here).
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "cache_config.hpp"
#include "generate.hpp"
#include "model_env.hpp"

namespace {

namespace fs = std::filesystem;

const std::string kQuestion = "Name three primary colors.";

// Small windows, so that a short chat quantizes most of its context.
smollm2::CacheArgs small_windows() {
  smollm2::CacheArgs ca;
  ca.sink = 4;
  ca.recent = 16;
  ca.flush = 4;
  ca.block = 16;
  return ca;
}

TEST(SmolLM2Generate, K8V8AgreesWithFp32OnTheFirstTokens) {
  KVQ_REQUIRE_SMOLLM2(m);
  const auto prompt = m->tok.encode(smollm2::chat_prompt(kQuestion), /*parse_special=*/true);
  const auto ca = small_windows();
  auto generate = [&](const std::string& policy) {
    auto caches = m->model.make_caches(policy, ca.options());
    auto ids = smollm2::greedy_generate(m->model, prompt, caches, 12, ca.block, smollm2::stop_ids(m->tok));
    if (policy != "fp32") {
      EXPECT_GT(caches.front()->quantized_tokens(), 0) << policy << " quantized nothing";
    }
    return ids;
  };
  const auto fp = generate("fp32"), k8 = generate("K8V8");
  ASSERT_GE(fp.size(), 8u) << "fp32 reply: " << m->tok.decode(fp);
  ASSERT_GE(k8.size(), 8u);
  EXPECT_EQ(std::vector<int>(fp.begin(), fp.begin() + 8), std::vector<int>(k8.begin(), k8.begin() + 8))
      << "fp32: " << m->tok.decode(fp) << "\nK8V8: " << m->tok.decode(k8);
  // The comparison can see quantization: on the fp32 reply (teacher-forced), K8V8 moves
  // the logits a little and K2V2 much more.
  std::vector<int> seq = prompt;
  seq.insert(seq.end(), fp.begin(), fp.end());
  auto logits = [&](const std::string& policy) {
    auto caches = m->model.make_caches(policy, ca.options());
    smollm2::RowMat out;
    smollm2::run_sequence(m->model, seq, caches, ca.block, &out);
    return out;
  };
  const auto l32 = logits("fp32");
  const double d8 = (logits("K8V8") - l32).cwiseAbs().maxCoeff(), d2 = (logits("K2V2") - l32).cwiseAbs().maxCoeff();
  std::printf("max |logit - fp32| over %zu positions: K8V8 %.3g, K2V2 %.3g\n", seq.size(), d8, d2);
  EXPECT_GT(d8, 0.0) << "K8V8 logits equal fp32's bit for bit; the cache is not quantizing";
  EXPECT_GT(d2, 5 * d8);
}

#ifdef KVQ_SMOLLM2_EVAL

bool valid_utf8(const std::string& s) {
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const int n = c < 0x80 ? 0 : (c >> 5) == 6 ? 1 : (c >> 4) == 14 ? 2 : (c >> 3) == 30 ? 3 : -1;
    if (n < 0 || i + n >= s.size()) return false;
    for (int k = 1; k <= n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 2) return false;
    i += n + 1;
  }
  return true;
}

struct Result {
  int status = -1;
  std::string out, err;
};

// Runs smollm2_eval with `args` (shell-quoted by the caller); stdout and stderr apart.
Result run_cli(const std::string& args, const fs::path& dir) {
  const fs::path err = dir / "stderr.txt";
  const std::string cmd = std::string("'") + KVQ_SMOLLM2_EVAL + "' " + args + " 2>'" + err.string() + "'";
  Result r;
  std::FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  for (std::size_t n; (n = std::fread(buf.data(), 1, buf.size(), p)) > 0;) r.out.append(buf.data(), n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  std::ifstream e(err);
  r.err.assign(std::istreambuf_iterator<char>(e), {});
  return r;
}

class GenerateCli : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = ::kvq_test::smollm2_model();
    if (!model_) GTEST_SKIP() << ::smollm2::kFetchHint;
    dir_ = fs::temp_directory_path() /
           ("kvq_generate_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }

  // The reply of `generate --chat` with small windows and `extra` options; checks that
  // it ran, quantized part of the context, and printed the prompt and a UTF-8 reply.
  Result generate(const std::string& extra) {
    Result r = run_cli("--sink 4 --recent 16 --flush-block 4 --block 16 generate --chat -n 24 --prompt '" + kQuestion +
                           "' " + extra,
                       dir_);
    EXPECT_EQ(r.status, 0) << extra << "\nstderr: " << r.err;
    const std::string prompt = smollm2::chat_prompt(kQuestion);
    EXPECT_EQ(r.out.substr(0, prompt.size()), prompt) << extra;
    const std::string reply = r.out.size() > prompt.size() ? r.out.substr(prompt.size()) : "";
    EXPECT_TRUE(valid_utf8(reply)) << extra << ": " << reply;
    EXPECT_TRUE(std::any_of(reply.begin(), reply.end(), [](char c) { return std::isalpha(static_cast<unsigned char>(c)); }))
        << extra << ": reply has no letters: '" << reply << "'";
    EXPECT_EQ(r.err.find("; 0 of them in quantized pages"), std::string::npos) << extra << ": " << r.err;
    return r;
  }

  const kvq_test::LoadedModel* model_ = nullptr;
  fs::path dir_;
};

TEST_F(GenerateCli, PlainAndHadamardPresets) {
  generate("--policy K4V2");
  generate("--policy K4V2_H");
}

TEST_F(GenerateCli, CenteredPresetTakesKeyMeansFromThePromptOrACalibrationText) {
  const Result own = generate("--policy K2V2_HC");
  EXPECT_NE(own.err.find("key means (centered-key layers): the prompt itself"), std::string::npos) << own.err;
  const fs::path text = dir_ / "calib.txt";
  std::ofstream(text) << "The history of the bridge begins in 1887, when the engineer Ada Mueller drew her first plan.\n"
                         "It carried carts for more than forty years, and the village grew around its two towers.\n"
                         "Colours of the paint changed with each decade: red, then green, then a pale blue.\n";
  const Result calib = generate("--policy K2V2_HC --calib-text '" + text.string() + "' --calib-tokens 64");
  EXPECT_NE(calib.err.find("tokens of " + text.string()), std::string::npos) << calib.err;
}

TEST_F(GenerateCli, LearnedRotationsFromAnArtifact) {
  // An artifact of K2V2_R for all 30 layers: μ_K measured on the prompt, rotations
  // H·diag(±1)/√d (orthogonal, different per head), as kvq_calib optr would write it.
  const auto& m = model_->model;
  const int d = m.cfg.head_dim, hkv = m.cfg.n_kv_heads;
  const auto prompt = model_->tok.encode(smollm2::chat_prompt(kQuestion), true);
  const auto means = smollm2::key_means(m, prompt, 1024, small_windows());
  kvq::calib::Artifact art;
  art.policy = kvq::presets::K2V2_R.with_head_dim(d);
  art.info = {{"source", "test_generate"}};
  std::mt19937 rng(20261130);
  for (int l = 0; l < m.cfg.n_layers; ++l) {
    kvq::calib::ArtifactLayer L;
    L.layer = l;
    L.hkv = hkv;
    L.head_dim = d;
    L.mu_k = means[l].key_mean;
    L.nu_v.assign(hkv * d, 0.f);
    for (auto* R : {&L.r_k, &L.r_v})
      for (int h = 0; h < hkv; ++h) {
        std::vector<float> sign(d);
        for (float& s : sign) s = (rng() & 1) ? 1.f : -1.f;
        for (int i = 0; i < d; ++i)
          for (int j = 0; j < d; ++j)
            R->push_back((std::popcount(unsigned(i & j)) & 1 ? -1.f : 1.f) * sign[j] / std::sqrt(float(d)));
      }
    L.kept_k.assign(hkv, 1);
    L.kept_v.assign(hkv, 1);
    L.loss_k.assign(2 * hkv, 0.0);
    L.loss_v.assign(2 * hkv, 0.0);
    art.layers.push_back(std::move(L));
  }
  const fs::path path = dir_ / "k2v2_r.safetensors";
  kvq::calib::write_artifact(art, path);

  const Result r = generate("--policy K2V2_R --artifact '" + path.string() + "'");
  EXPECT_NE(r.err.find("μ_K, R_K, R_V from " + path.string()), std::string::npos) << r.err;
  // The same artifact's μ_K serves a Hadamard + centering preset.
  const Result hc = generate("--policy K2V2_HC --artifact '" + path.string() + "'");
  EXPECT_NE(hc.err.find("the key means μ_K of artifact " + path.string()), std::string::npos) << hc.err;
  // Without an artifact the learned preset says what to pass.
  const Result missing = run_cli("generate --prompt hi -n 2 --policy K2V2_R", dir_);
  EXPECT_NE(missing.status, 0);
  EXPECT_NE(missing.err.find("pass --artifact"), std::string::npos) << missing.err;
}

TEST_F(GenerateCli, PerLayerPolicyTable) {
  const fs::path table = dir_ / "layers.csv";
  {
    std::ofstream t(table);
    t << "layer,policy\n";
    for (int l = 0; l < model_->model.cfg.n_layers; ++l) t << l << "," << (l % 2 ? "K4V2_HC" : "K2V2_H") << "\n";
  }
  const Result r = generate("--layer-policies '" + table.string() + "'");
  EXPECT_NE(r.err.find("policies: per layer from " + table.string()), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("key means (centered-key layers): the prompt itself"), std::string::npos) << r.err;
}

// eval's log-ppl gaps are ln(ppl/ppl_fp32) (every chunk scores the same positions), and
// --baseline's share is (gap_base − gap)/gap_base, each with a standard error over chunks.
TEST_F(GenerateCli, EvalReportsGapsAndTheShareOfTheBaselinesGap) {
  const fs::path text = dir_ / "text.txt";
  {
    std::ofstream t(text);
    for (int i = 0; i < 12; ++i)
      t << "In " << 1850 + 7 * i << " the river town of Elmsford built its " << (i % 2 ? "second" : "first")
        << " stone bridge; the council paid " << 300 + 41 * i << " pounds, and the mason, a man named Harlow, "
        << "carved the date above the middle arch where the water runs fastest.\n";
  }
  const fs::path csv = dir_ / "eval.csv";
  const std::string common = "--sink 4 --recent 16 --block 16 eval --text '" + text.string() +
                             "' --tokens 256 --ctx 64 --calib-tokens 0 --policies fp32,K2V2,K4V2 ";
  const Result r = run_cli(common + "--baseline K2V2 --csv '" + csv.string() + "'", dir_);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("closes of K2V2's gap"), std::string::npos) << r.out;
  std::ifstream in(csv);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "policy,bits_per_element,cache_bytes_per_token,ppl,kl,kl_far,top1,log_ppl_gap,log_ppl_gap_se,"
                  "gap_closed,gap_closed_se");
  std::map<std::string, std::vector<std::string>> rows;
  while (std::getline(in, line)) {
    std::vector<std::string> f;
    std::stringstream ss(line);
    for (std::string x; std::getline(ss, x, ',');) f.push_back(x);
    f.resize(11);  // trailing empty fields
    rows[f[0]] = f;
  }
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows["fp32"][7], "");
  const double ppl_fp = std::stod(rows["fp32"][3]);
  double gap[2];
  for (int i = 0; const char* p : {"K2V2", "K4V2"}) {
    const auto& f = rows[p];
    gap[i] = std::stod(f[7]);
    EXPECT_NEAR(gap[i], std::log(std::stod(f[3]) / ppl_fp), 1e-5) << p;  // ppl is printed to 5 decimals
    EXPECT_GT(std::stod(f[8]), 0.0) << p;  // the chunks differ
    ++i;
  }
  ASSERT_GT(std::abs(gap[0]), 1e-6) << "the windows must leave quantized tokens";
  EXPECT_EQ(rows["K2V2"][9], "");  // the baseline itself
  EXPECT_NEAR(std::stod(rows["K4V2"][9]), (gap[0] - gap[1]) / gap[0], 1e-4 / std::abs(gap[0]));
  EXPECT_GT(std::stod(rows["K4V2"][10]), 0.0);
  // The baseline must be one of the quantized runs (fp32 is always run: KL needs it).
  const Result fp = run_cli(common + "--baseline fp32", dir_);
  EXPECT_NE(fp.status, 0);
  EXPECT_NE(fp.err.find("--baseline 'fp32' is not one of the quantized --policies runs"), std::string::npos) << fp.err;
}

// passkey runs its (prompt, policy) jobs on --threads workers; the prompts are drawn
// before any job starts, so the table, the CSV and every answer are the same at any
// thread count (only the order of the stderr lines may change). --no-fp32 drops the fp32
// jobs and changes nothing else.
TEST_F(GenerateCli, PasskeyDoesNotDependOnTheThreadCount) {
  auto run = [&](int threads, const std::string& extra = "") {
    const fs::path csv = dir_ / ("passkey_" + std::to_string(threads) + extra + ".csv");
    Result r = run_cli("--sink 4 --recent 16 --flush-block 4 --block 16 passkey --lengths 192 --trials 2 --policies K4V2 "
                       "--threads " + std::to_string(threads) + " " + extra + " --csv '" + csv.string() + "'",
                       dir_);
    EXPECT_EQ(r.status, 0) << r.err;
    std::ifstream in(csv);
    std::string table((std::istreambuf_iterator<char>(in)), {});
    std::vector<std::string> answers;  // "[192 tokens, trial …] K4V2 key … answer … ok", without the clock
    std::istringstream lines(r.err);
    for (std::string line; std::getline(lines, line);)
      if (line.rfind("[", 0) == 0) answers.push_back(line.substr(0, line.rfind(" (")));
    std::sort(answers.begin(), answers.end());
    return std::tuple{r.out, table, answers};
  };
  const auto [out1, csv1, answers1] = run(1);
  const auto [out4, csv4, answers4] = run(4);
  ASSERT_EQ(answers1.size(), 4u) << "2 trials × (fp32, K4V2)";
  EXPECT_EQ(answers1, answers4);
  EXPECT_EQ(out1, out4);
  EXPECT_EQ(csv1, csv4);
  EXPECT_NE(csv1.find("K4V2,3.7500,192,2,"), std::string::npos) << csv1;
  const auto [out_q, csv_q, answers_q] = run(2, "--no-fp32");
  std::vector<std::string> quantized;  // answers1's K4V2 lines
  for (const auto& a : answers1)
    if (a.find("] K4V2 ") != std::string::npos) quantized.push_back(a);
  ASSERT_EQ(quantized.size(), 2u);
  EXPECT_EQ(answers_q, quantized);
  EXPECT_EQ(csv_q.find("fp32"), std::string::npos) << csv_q;
  EXPECT_NE(csv1.find(csv_q.substr(csv_q.find('\n') + 1)), std::string::npos) << csv_q << " not in " << csv1;
}

#else
TEST(GenerateCli, Skipped) { GTEST_SKIP() << "smollm2_eval is not built (it needs fmt and CLI11)"; }
#endif

}  // namespace
