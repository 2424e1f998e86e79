// Shared helpers of the CUDA tests: device detection and skip, RAII device buffers,
// seeded case generators (ragged page tables, rows, rotation parameters) used for the
// CPU reference and the GPU launchers alike.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "common/orthogonal.hpp"
#include "kvq/cuda/config.cuh"
#include "kvq/cuda/launch/api.hpp"
#include "kvq/kvq.hpp"

#define KVQ_REQUIRE_CUDA_DEVICE()                                          \
  do {                                                                     \
    if (::kvq::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device found"; \
  } while (0)

#define KVQ_EXPECT_OK(expr)                       \
  do {                                            \
    const ::kvq::Status s_ = (expr);              \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_.to_string(); \
  } while (0)

namespace kvq::test {

template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n) : n_(n) {  // zero-filled (decode workspaces need it)
    if (n_ && (cudaMalloc(&ptr_, n_ * sizeof(T)) != cudaSuccess || cudaMemset(ptr_, 0, n_ * sizeof(T)) != cudaSuccess))
      throw std::bad_alloc();
  }
  explicit DeviceBuffer(const std::vector<T>& h) : DeviceBuffer(h.size()) { upload(h); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), n_(o.n_) { o.ptr_ = nullptr, o.n_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  void upload(const std::vector<T>& h) {
    if (n_) {
      ASSERT_EQ(cudaMemcpy(ptr_, h.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    if (n_) {
      EXPECT_EQ(cudaMemcpy(h.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return h;
  }
  void fill_bytes(int byte) {
    if (n_) {
      ASSERT_EQ(cudaMemset(ptr_, byte, n_ * sizeof(T)), cudaSuccess);
    }
  }
  T* get() const { return ptr_; }
  std::size_t size() const { return n_; }

 private:
  T* ptr_ = nullptr;
  std::size_t n_ = 0;
};

template <ActivationType T>
std::vector<T> convert(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = from_float<T>(v[i]);
  return out;
}

template <ActivationType T>
std::uint32_t bits_of(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return float_bits(x);
  } else {
    return x.bits;
  }
}

// Bit-identical, except that any two NaNs match (x86 and the GPU propagate different
// NaN payloads through arithmetic; DESIGN §2 only requires that NaN stays NaN).
template <ActivationType T>
bool same_value(T a, T b) {
  return bits_of(a) == bits_of(b) || (std::isnan(to_float(a)) && std::isnan(to_float(b)));
}

// A CSR page table of a ragged batch with shuffled, non-contiguous pages and spare
// pages that no sequence owns (they must stay untouched).
struct RaggedTable {
  int page_size = 16;
  int num_pages = 0;
  std::vector<int> lens;
  std::vector<std::int32_t> indptr, indices, last;

  PageTableView host() const {
    return {indptr.data(), indices.data(), last.data(), static_cast<int>(lens.size()), page_size,
            static_cast<int>(indices.size())};
  }
  int total_tokens() const { return std::accumulate(lens.begin(), lens.end(), 0); }
};

inline RaggedTable make_table(const std::vector<int>& lens, int page_size, std::uint32_t seed, int spare = 3) {
  RaggedTable t;
  t.page_size = page_size;
  t.lens = lens;
  t.indptr.push_back(0);
  for (int len : lens) {
    const int pages = (len + page_size - 1) / page_size;
    t.indptr.push_back(t.indptr.back() + pages);
    t.last.push_back(len == 0 ? 0 : len - (pages - 1) * page_size);
  }
  t.num_pages = t.indptr.back() + spare;
  std::vector<std::int32_t> perm(t.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(seed));
  t.indices.assign(perm.begin(), perm.begin() + t.indptr.back());
  if (t.indices.empty()) t.indices.push_back(0);  // never read; keeps the pointer valid
  return t;
}

struct DeviceTable {
  DeviceBuffer<std::int32_t> indptr, indices, last;
  int batch = 0, page_size = 16, num_indices = -1;
  explicit DeviceTable(const RaggedTable& t)
      : indptr(t.indptr), indices(t.indices), last(t.last.empty() ? std::vector<std::int32_t>{0} : t.last),
        batch(static_cast<int>(t.lens.size())), page_size(t.page_size),
        num_indices(static_cast<int>(t.indices.size())) {}
  PageTableView view() const { return {indptr.get(), indices.get(), last.get(), batch, page_size, num_indices}; }
};

// Every (sequence, position) of the table in shuffled order.
struct TokenList {
  std::vector<std::int32_t> batch, pos;
  int size() const { return static_cast<int>(batch.size()); }
};
inline TokenList all_tokens(const RaggedTable& t, std::uint32_t seed) {
  std::vector<std::pair<int, int>> v;
  for (int b = 0; b < static_cast<int>(t.lens.size()); ++b)
    for (int p = 0; p < t.lens[b]; ++p) v.emplace_back(b, p);
  std::shuffle(v.begin(), v.end(), std::mt19937(seed));
  TokenList out;
  for (auto [b, p] : v) out.batch.push_back(b), out.pos.push_back(p);
  return out;
}

// vLLM's slot_mapping of the tokens: pool slot page·P + pos mod P (cuda::AppendArgs).
inline std::vector<std::int64_t> slot_mapping(const RaggedTable& t, const TokenList& tok) {
  std::vector<std::int64_t> slots;
  for (int i = 0; i < tok.size(); ++i)
    slots.push_back(std::int64_t(t.host().page_of(tok.batch[i], tok.pos[i])) * t.page_size + tok.pos[i] % t.page_size);
  return slots;
}

// Run-time rotation parameters a policy needs (host and device copies).
struct Rotations {
  std::vector<float> key_mean, key_rot, value_mean, value_rot;
  DeviceBuffer<float> d_key_mean, d_key_rot, d_value_mean, d_value_rot;
  RotationParams host() const {
    auto p = [](const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
    return {p(key_mean), p(key_rot), p(value_mean), p(value_rot)};
  }
  RotationParams device() const {
    auto p = [](const DeviceBuffer<float>& v) -> const float* { return v.size() ? v.get() : nullptr; };
    return {p(d_key_mean), p(d_key_rot), p(d_value_mean), p(d_value_rot)};
  }
};

template <Policy P>
void make_rotations_host(Rotations& r, int hkv, std::uint32_t seed) {
  constexpr int D = P.head_dim;
  auto rots = [&](std::uint32_t s) { return random_orthogonal(hkv, D, s); };
  if (P.key.centered) r.key_mean = random_normal(std::size_t(hkv) * D, seed + 1, 2.f);
  if (P.key.rotation == Rotation::dense) r.key_rot = rots(seed + 2);
  if (P.value.centered) r.value_mean = random_normal(std::size_t(hkv) * D, seed + 3, 2.f);
  if (P.value.rotation == Rotation::dense) r.value_rot = rots(seed + 4);
}

template <Policy P>
void make_rotations(Rotations& r, int hkv, std::uint32_t seed) {
  make_rotations_host<P>(r, hkv, seed);
  r.d_key_mean = DeviceBuffer<float>(r.key_mean);
  r.d_key_rot = DeviceBuffer<float>(r.key_rot);
  r.d_value_mean = DeviceBuffer<float>(r.value_mean);
  r.d_value_rot = DeviceBuffer<float>(r.value_rot);
}

// Relative L2 error of one row, with a floor for rows near zero.
inline double row_error(const float* a, const float* ref, int n) {
  double num = 0, den = 0;
  for (int i = 0; i < n; ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-3 * std::sqrt(double(n)));
}

// Unit roundoff of an output type: rounding an fp32 result to T to nearest moves every
// element by at most this fraction of its magnitude (8, 11 and 24 significand bits), so
// a row by at most this fraction of its norm.
template <ActivationType T>
constexpr double unit_roundoff() {
  if constexpr (std::is_same_v<T, bfloat16_t>) return 0x1p-8;
  else if constexpr (std::is_same_v<T, half_t>) return 0x1p-11;
  else return 0.0;
}

// The worst relative row and LSE errors that compare_decode_rows has measured, per output
// type, over the finite, non-empty rows it checked. The device tests print them at the
// end (test_attention.cu), so that kDeviceTolerance can be sized from measurement; with
// fp16/bf16 outputs one rounding of o (u = 2^-11 / 2^-8) is part of the row error.
struct DecodeErrorRecord {
  double row = 0, lse = 0;
  long rows = 0;
};
inline std::map<std::string, DecodeErrorRecord> decode_error_record;

// Registered by a test binary (::testing::AddGlobalTestEnvironment): prints
// decode_error_record once all its tests have run.
class DecodeErrorReport : public ::testing::Environment {
 public:
  DecodeErrorReport(std::string what, double tol) : what_(std::move(what)), tol_(tol) {}
  void TearDown() override {
    for (const auto& [type, worst] : decode_error_record)
      std::printf("%s, %s outputs: worst row error %.3g, worst LSE error %.3g over %ld rows (tolerance %g)\n",
                  what_.c_str(), type.c_str(), worst.row, worst.lse, worst.rows, tol_);
  }

 private:
  std::string what_;
  double tol_;
};

// Decode outputs of type T against an fp32-output reference of the same attention:
//   rows the reference leaves empty (LSE −∞): o exactly 0 and LSE −∞;
//   rows with NaN (a visible NaN logit, a weighted NaN value group): NaN exactly where
//     the reference has NaN, and an LSE that is NaN exactly when the reference's is;
//   other rows: LSE within tol (relative, floor 1) and a row error within
//     tol + u_T·(1 + tol): the fp32 results differ by tol, then one rounding to T
//     (‖round(x) − x‖ ≤ u_T·‖x‖) — the output type's tolerance follows from its rounding.
// Returns the number of NaN rows, which tests that poison rows check.
template <ActivationType T>
int compare_decode_rows(const std::vector<T>& out, const std::vector<float>& lse, const std::vector<float>& ref,
                        const std::vector<float>& lse_ref, int D, const std::string& what, double tol) {
  const double row_tol = tol + unit_roundoff<T>() * (1 + tol);
  int bad = 0, nan_rows = 0;
  std::vector<float> a(D);
  auto fail = [&](const std::string& msg) {
    if (++bad <= 5) ADD_FAILURE() << what << ": " << msg;
  };
  for (std::size_t row = 0; row < lse_ref.size(); ++row) {
    const float* r = ref.data() + row * D;
    for (int d = 0; d < D; ++d) a[d] = to_float(out[row * D + d]);
    const std::string at = "row " + std::to_string(row) + " lse " + std::to_string(lse[row]) + " vs " +
                           std::to_string(lse_ref[row]);
    if (std::isinf(lse_ref[row]) && lse_ref[row] < 0) {
      if (!(lse[row] == lse_ref[row]) || !std::all_of(a.begin(), a.end(), [](float x) { return x == 0.f; }))
        fail("empty " + at);
      continue;
    }
    if (std::isnan(lse_ref[row]) || std::any_of(r, r + D, [](float x) { return std::isnan(x); })) {
      ++nan_rows;
      bool same = std::isnan(lse[row]) == std::isnan(lse_ref[row]);
      for (int d = 0; d < D; ++d) same = same && std::isnan(a[d]) == std::isnan(r[d]);
      if (!same) fail("NaN pattern differs, " + at);
      continue;
    }
    const double err = row_error(a.data(), r, D);
    const double lerr = std::abs(double(lse[row]) - lse_ref[row]) / std::max(1.0, std::abs(double(lse_ref[row])));
    DecodeErrorRecord& worst =
        decode_error_record[std::is_same_v<T, float> ? "fp32" : std::is_same_v<T, half_t> ? "fp16" : "bf16"];
    worst.row = std::max(worst.row, err), worst.lse = std::max(worst.lse, lerr), ++worst.rows;
    if (!(err <= row_tol) || !(lerr <= tol))
      fail(at + " row error " + std::to_string(err) + " (bound " + std::to_string(row_tol) + ")");
  }
  EXPECT_EQ(bad, 0) << what;
  return nan_rows;
}

// DecodePrecision::fast against fp64 attention over the dequantized cache, in the stored
// basis (the kernels run with rotated_output, which needs un-centered values): every
// non-empty row within the bound stated in kvq/cuda/kernel/decode_mma.cuh,
//   |Δo_d| ≤ u·Σ_t p_t·(ln2·a_t·|ŵ_{t,d} − o_d| + |ŵ_{t,d} − lo_{t,d}|)·2^{2u·max a},
//   a_t = Σ_i |q'_i·(k̂_{t,i} − lo_{t,i})|,
// u = 2⁻¹¹ (2⁻⁸ for bf16 pages, whose operands are bf16), in L2 over d, plus 1e-5·‖o‖ for
// the fp32 parts and one rounding of o to T.
// key_row / value_row(b, t, h, x, lo) write token t's dequantized stored-basis row and
// each element's group minimum (0 for 16-bit pages); to_stored(q, h) turns a
// query row into q·R_K. Returns the largest error/bound ratio (< 1 passes); empty rows
// must be 0. Rows whose reference has NaN (a visible NaN logit, a weighted NaN value
// group) must have NaN in exactly the same elements; nan_rows counts them.
// With lse given, each row's LSE against the CPU reference's (exact operands): NaN and −∞
// where it has them, else within ln2·u·max a·2^{2u·max a} (a logit moves by at most u·a_t
// log₂ units, and the LSE by at most the largest move) plus slack·max(1, |lse|) for the
// fp32 parts (the emulator's 1e-5; on the device, the exact mode's device tolerance).
struct LseCheck {
  const std::vector<float>* got = nullptr;
  const std::vector<float>* ref = nullptr;
  double slack = 1e-5;
};
template <int D, ActivationType T, class ToStored, class KeyRow, class ValueRow>
double check_fast_bound(const PageTableView& table, const std::vector<T>& q, const std::vector<std::int32_t>& q_indptr,
                        int hq, int hkv, const std::int32_t* causal_offset, ToStored&& to_stored, KeyRow&& key_row,
                        ValueRow&& value_row, const std::vector<T>& out, const std::string& what,
                        double u = 0x1p-11, int* nan_rows = nullptr, LseCheck lse = {}) {
  const int group = hq / hkv;
  const double tau_log2e = 1.0 / std::sqrt(double(D)) / std::log(2.0);
  double worst = 0;
  int bad = 0;
  std::vector<float> qrow(D), x(D), lo(D);
  std::vector<double> o(D), logit, code_part, vrow, vcode;  // per visible token (rows: [t][D])
  for (int b = 0; b < table.batch_size; ++b) {
    const int len = table.seq_len(b), nq = q_indptr[b + 1] - q_indptr[b];
    for (int i = 0; i < nq; ++i)
      for (int j = 0; j < hq; ++j) {
        const int h = j / group;
        const std::size_t row = std::size_t(q_indptr[b] + i) * hq + j;
        for (int d = 0; d < D; ++d) qrow[d] = to_float(q[row * D + d]);
        to_stored(qrow.data(), h);
        const long long limit = (causal_offset ? causal_offset[b] : len - nq) + i;
        const int visible = int(std::min<long long>(len, std::max<long long>(limit + 1, 0)));
        logit.assign(visible, 0.0), code_part.assign(visible, 0.0);
        vrow.assign(std::size_t(visible) * D, 0.0), vcode.assign(std::size_t(visible) * D, 0.0);
        double max_a = 0, m = -INFINITY, l = 0;
        for (int t = 0; t < visible; ++t) {
          key_row(b, t, h, x.data(), lo.data());
          for (int d = 0; d < D; ++d)
            logit[t] += double(qrow[d]) * x[d],
                code_part[t] += std::abs(double(qrow[d]) * (x[d] - lo[d]));
          logit[t] *= tau_log2e, code_part[t] *= tau_log2e;
          max_a = std::max(max_a, code_part[t]), m = std::max(m, logit[t]);
          value_row(b, t, h, x.data(), lo.data());
          for (int d = 0; d < D; ++d) vrow[std::size_t(t) * D + d] = x[d], vcode[std::size_t(t) * D + d] = std::abs(double(x[d]) - lo[d]);
        }
        std::fill(o.begin(), o.end(), 0.0);
        for (int t = 0; t < visible; ++t) {
          logit[t] = std::exp2(logit[t] - m);  // now the unnormalized weight
          l += logit[t];
          for (int d = 0; d < D; ++d) o[d] += logit[t] * vrow[std::size_t(t) * D + d];
        }
        if (visible)
          for (int d = 0; d < D; ++d) o[d] /= l;
        if (lse.got && lse.ref) {
          const double got = (*lse.got)[row], ref = (*lse.ref)[row];
          const double tol = std::log(2.0) * u * max_a * std::exp2(2 * u * max_a) + lse.slack * std::max(1.0, std::abs(ref));
          const bool ok = std::isnan(ref) ? std::isnan(got) : std::isinf(ref) ? got == ref : std::abs(got - ref) <= tol;
          if (!ok && ++bad <= 5)
            ADD_FAILURE() << what << ": row " << row << " lse " << got << " vs " << ref << " (bound " << tol << ")";
        }
        if (std::any_of(o.begin(), o.end(), [](double x) { return std::isnan(x); })) {
          if (nan_rows) ++*nan_rows;
          bool same = true;
          for (int d = 0; d < D; ++d) same = same && std::isnan(to_float(out[row * D + d])) == std::isnan(o[d]);
          if (!same && ++bad <= 5) ADD_FAILURE() << what << ": row " << row << " NaN pattern differs";
          continue;
        }
        double err = 0, norm = 0, bound = 0;
        for (int d = 0; d < D; ++d) {
          double bd = 0;
          for (int t = 0; t < visible; ++t)
            bd += logit[t] / l * (std::log(2.0) * code_part[t] * std::abs(vrow[std::size_t(t) * D + d] - o[d]) + vcode[std::size_t(t) * D + d]);
          const double got = to_float(out[row * D + d]);
          err += (got - o[d]) * (got - o[d]), norm += o[d] * o[d], bound += bd * bd;
        }
        err = std::sqrt(err), norm = std::sqrt(norm);
        if (visible == 0) {
          if (!(err == 0) && ++bad <= 5) ADD_FAILURE() << what << ": empty row " << row << " is not 0";
          continue;
        }
        bound = u * std::sqrt(bound) * std::exp2(2 * u * max_a) + (1e-5 + unit_roundoff<T>() * 1.01) * norm + 1e-7;
        worst = std::max(worst, err / bound);
        if (!(err <= bound) && ++bad <= 5)
          ADD_FAILURE() << what << ": row " << row << " error " << err << " > bound " << bound << " (max a " << max_a
                        << ", |o| " << norm << ")";
      }
  }
  EXPECT_EQ(bad, 0) << what;
  return worst;
}

// check_fast_bound for a quantized cache: rows and group minima from the stored codes.
template <Policy P, ActivationType T>
double check_fast_bound(const std::byte* pool, const PageLayout<P>& layout, const PageTableView& table,
                        const std::vector<T>& q, const std::vector<std::int32_t>& q_indptr, int hq,
                        const std::int32_t* causal_offset, const RotationParams& rot, const std::vector<T>& out,
                        const std::string& what, int* nan_rows = nullptr, LseCheck lse = {}) {
  static_assert(!P.value.centered, "stored-basis outputs need un-centered values");
  constexpr int D = P.head_dim;
  std::vector<float> scratch(D);
  auto page = [&](int b, int t) { return pool + layout.page_bytes() * table.page_of(b, t); };
  auto row = [&]<QuantSpec S>(const std::byte* codes, const std::byte* meta_bytes, float* x, float* lo) {
    const auto* meta = reinterpret_cast<const meta_storage_t<S.meta>*>(meta_bytes);
    dequantize_row<S, D>(reinterpret_cast<const std::uint8_t*>(codes), meta, x);
    for (int d = 0; d < D; ++d) lo[d] = MetaTraits<S.meta>::decode(meta[2 * (d / S.group) + 1]);
  };
  return check_fast_bound<D>(
      table, q, q_indptr, hq, layout.num_kv_heads, causal_offset,
      [&](float* x, int h) { transform_query<P>(x, h, rot, scratch.data()); },
      [&](int b, int t, int h, float* x, float* lo) {
        const int slot = t % table.page_size;
        row.template operator()<P.key>(layout.key_codes(page(b, t), h, slot), layout.key_meta_bytes(page(b, t), h, slot), x,
                                       lo);
      },
      [&](int b, int t, int h, float* x, float* lo) {
        const int slot = t % table.page_size;
        row.template operator()<P.value>(layout.value_codes(page(b, t), h, slot),
                                         layout.value_meta_bytes(page(b, t), h, slot), x, lo);
      },
      out, what, 0x1p-11, nan_rows, lse);
}

// check_fast_bound for 16-bit pages (lo = 0, no rotation).
template <ActivationType PT, int D, ActivationType T>
double check_fast_bound(const std::byte* pool, const DensePageLayout<PT, D>& layout, const PageTableView& table,
                        const std::vector<T>& q, const std::vector<std::int32_t>& q_indptr, int hq,
                        const std::int32_t* causal_offset, const std::vector<T>& out, const std::string& what,
                        LseCheck lse = {}) {
  auto copy = [](const PT* r, float* x, float* lo) {
    for (int d = 0; d < D; ++d) x[d] = to_float(r[d]), lo[d] = 0.f;
  };
  auto page = [&](int b, int t) { return pool + layout.page_bytes() * table.page_of(b, t); };
  return check_fast_bound<D>(
      table, q, q_indptr, hq, layout.num_kv_heads, causal_offset, [](float*, int) {},
      [&](int b, int t, int h, float* x, float* lo) { copy(layout.key_row(page(b, t), h, t % table.page_size), x, lo); },
      [&](int b, int t, int h, float* x, float* lo) {
        copy(layout.value_row(page(b, t), h, t % table.page_size), x, lo);
      },
      out, what, std::is_same_v<PT, bfloat16_t> ? 0x1p-8 : 0x1p-11, nullptr, lse);
}

// Tokens (sequence, position) whose key or value rows carry a NaN: the group that holds
// it is stored as NaN (DESIGN §2), so the token's logit or value group is NaN.
struct NanTokens {
  std::vector<std::pair<int, int>> keys, values;
};
template <ActivationType T>
void poison_rows(std::vector<T>& rows, const TokenList& tok, int hkv, int D,
                 const std::vector<std::pair<int, int>>& where) {
  for (auto [b, p] : where)
    for (int i = 0; i < tok.size(); ++i)
      if (tok.batch[i] == b && tok.pos[i] == p)
        for (int h = 0; h < hkv; ++h) rows[(std::size_t(i) * hkv + h) * D + 3] = from_float<T>(std::nanf(""));
}

// A pool of 16-bit (or fp32) pages holding every token of `tab`: keys N(0, 4), values
// N(0, 1) from `seed`, the pages' unused rows zero.
template <ActivationType T, int D>
std::vector<std::byte> random_dense_pool(const RaggedTable& tab, const DensePageLayout<T, D>& layout,
                                         const std::vector<int>& lens, std::uint32_t seed) {
  const int hkv = layout.num_kv_heads, page_size = layout.page_size;
  std::vector<std::byte> pool(layout.page_bytes() * tab.num_pages, std::byte{0});
  const auto kv = random_normal(std::size_t(tab.total_tokens()) * hkv * D * 2, seed);
  std::size_t next = 0;
  for (int b = 0; b < static_cast<int>(lens.size()); ++b)
    for (int t = 0; t < lens[b]; ++t)
      for (int h = 0; h < hkv; ++h) {
        std::byte* page = pool.data() + layout.page_bytes() * tab.host().page_of(b, t);
        T* k = layout.key_row(page, h, t % page_size);
        T* v = layout.value_row(page, h, t % page_size);
        for (int d = 0; d < D; ++d) k[d] = from_float<T>(kv[next++] * 2.f), v[d] = from_float<T>(kv[next++]);
      }
  return pool;
}

}  // namespace kvq::test
