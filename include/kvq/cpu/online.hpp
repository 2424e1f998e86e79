// kvq/cpu/online.hpp — the CPU online-softmax driver shared by the quantized
// and the full-precision attention, so both have the same engineering (DESIGN §9).
//
// A "part" is a run of `length` keys attended by `rows` query rows (the query heads of
// one KV head × the query tokens of one sequence). Per block of kTokensPerBlock tokens
// the source computes all logits (tile products over fp32 key tiles or rows, or int8
// scoring on the codes), the driver rescales once per row, then the source accumulates
// the values (tile products, or int8 weights on the codes): every token is read once per
// GQA group.
#pragma once

#include <algorithm>

#include "kvq/attention/softmax.hpp"
#include "kvq/core/config.hpp"
#include "kvq/cpu/tile.hpp"

namespace kvq::detail {

// Rows a pass computes: 1, or `rows` rounded up to the 4-row blocks of tile.hpp.
constexpr int padded_rows(int rows) { return rows == 1 ? 1 : (rows + 3) / 4 * 4; }

// Row r's running maximum becomes max(m, block_max) (a NaN block_max keeps m: the NaN
// logits then poison the weights); l and acc are rescaled when it rises. Returns the new
// maximum, the shift of the block's exp.
template <int D>
KVQ_FORCE_INLINE float raise_row_max(int r, float block_max, float* acc, float* m, float* l) {
  const float m_new = std::max(m[r], block_max);
  const float correction = m_new == m[r] ? 1.f : exp_f(m[r] - m_new);  // 0 when m was −∞
  if (correction != 1.f) {
    l[r] *= correction;
    for (int i = 0; i < D; ++i) acc[r * D + i] *= correction;
  }
  m[r] = m_new;
  return m_new;
}

// The softmax step of one block for row r: masks the tokens row r does not see (and
// the tail past n) to −∞, rescales m, l and acc when the block raises the maximum, and
// turns s[r] into the probability weights. Returns whether the row has a nonzero (or
// NaN) weight; a row that sees nothing gets zero weights and keeps m and l.
template <int D>
KVQ_FORCE_INLINE bool softmax_row(float (*s)[kTokensPerBlock], int r, const int* row_limit, int t0, int n, float* acc,
                                  float* m, float* l) {
  float* sr = s[r];
  // Invisible tokens and the block's tail beyond n get −∞, so every row operation
  // below runs over a whole block of fixed length.
  for (int j = std::clamp(row_limit[r] - t0 + 1, 0, n); j < kTokensPerBlock; ++j) sr[j] = neg_inf_f();
  const float block_max = block_max_of(sr);  // NaN when a logit is NaN: it must poison the row
  if (block_max == neg_inf_f()) {            // nothing visible in this block for row r
    std::fill(sr, sr + kTokensPerBlock, 0.f);
    return false;
  }
  const float m_new = raise_row_max<D>(r, block_max, acc, m, l);
  const float block_sum = exp_shifted_block(sr, m_new);  // now the probability weights
  l[r] += block_sum;
  return block_sum != 0.f;
}

#if KVQ_CPU_AVX512
// softmax_row for rows r0 .. r0 + 3 at once, with the same results bit for bit (NaN
// payloads aside): the four rows' maxima and sums are reduced together (fold_rows4, the
// halving order of max_lanes / sum_lanes, after block_max_of's and exp_shifted_block's
// vector-by-vector folds), and their exps are independent. A one-row step is a chain
// of two reductions around an exp (~130 cycles); four rows at once take about the time
// of one (61 → 35 ns per 32-token block of 4 rows). Rows ≥ rows are padding: zero
// weights.
template <int D>
KVQ_FORCE_INLINE bool softmax_rows4(float (*s)[kTokensPerBlock], int r0, int rows, const int* row_limit, int t0, int n,
                                    float* acc, float* m, float* l) {
  constexpr int V = kTokensPerBlock / 16;  // vectors per row
  static_assert(kTokensPerBlock % 16 == 0 && kTokensPerBlock <= 64);
  const __m512 neg_inf = _mm512_set1_ps(neg_inf_f());
  __m512 x[4][V];
  int visible[4];
  // Whether a visible logit may raise its row's running maximum: a NaN counts as one,
  // and so does every visible row whose maximum is still −∞.
  __mmask16 above = 0;
  KVQ_UNROLL for (int q = 0; q < 4; ++q) {
    const int r = r0 + q;
    visible[q] = r < rows ? std::clamp(row_limit[r] - t0 + 1, 0, n) : 0;
    const std::uint64_t live = visible[q] >= 64 ? ~std::uint64_t(0) : (std::uint64_t(1) << visible[q]) - 1u;
    KVQ_UNROLL for (int v = 0; v < V; ++v) x[q][v] = _mm512_mask_loadu_ps(neg_inf, __mmask16(live >> (16 * v)), s[r] + 16 * v);
    if (visible[q] > 0) {
      const __m512 running = _mm512_set1_ps(m[r]);
      KVQ_UNROLL for (int v = 0; v < V; ++v) above |= _mm512_cmp_ps_mask(x[q][v], running, _CMP_NLE_UQ);
      if (m[r] == neg_inf_f()) above |= 1;
    }
  }
  float shift[4];
  bool seen[4];
  if (above == 0) {
    // No row's maximum rises (most blocks once a row has seen a few): block_max ≤ m, so
    // the branch below would find the rescale the identity and shift by m. Skipping its
    // max reduction shortens the chain from the logits to the exps (K4V2 fastest decode,
    // 4K warm: 107.5 → 105 µs, Zen 4); the weights are the same bits.
    KVQ_UNROLL for (int q = 0; q < 4; ++q) {
      seen[q] = visible[q] > 0;  // all-−∞ rows add exp(−∞) = 0 either way
      shift[q] = seen[q] ? m[r0 + q] : 0.f;
    }
  } else {
    __m512 top[4];
    bool nan[4];
    KVQ_UNROLL for (int q = 0; q < 4; ++q) {
      __mmask16 unordered = 0;
      top[q] = x[q][0];
      KVQ_UNROLL for (int v = 0; v < V; ++v) {
        unordered |= _mm512_cmp_ps_mask(x[q][v], x[q][v], _CMP_UNORD_Q);
        if (v > 0) top[q] = fold_op(top[q], x[q][v], true);
      }
      nan[q] = unordered != 0;
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, fold_rows4(top[0], top[1], top[2], top[3], true));
    KVQ_UNROLL for (int q = 0; q < 4; ++q) {
      const int r = r0 + q;
      const float block_max = nan[q] ? __builtin_nanf("") : lanes[4 * q];
      seen[q] = block_max != neg_inf_f();
      shift[q] = 0.f;  // rows that see nothing: exp(−∞ − 0) = 0 everywhere
      if (seen[q]) shift[q] = raise_row_max<D>(r, block_max, acc, m, l);
    }
  }
  using Bits = GnuVec<std::uint32_t, 16>::type;
  __m512 partial[4];
  KVQ_UNROLL for (int q = 0; q < 4; ++q) {
    KVQ_UNROLL for (int v = 0; v < V; ++v) {
      const __m512 e = exp_approx<FloatVec<16>, Bits>(FloatVec<16>(x[q][v]) - shift[q]);
      _mm512_storeu_ps(s[r0 + q] + 16 * v, e);
      partial[q] = v == 0 ? e : _mm512_add_ps(partial[q], e);
    }
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, fold_rows4(partial[0], partial[1], partial[2], partial[3], false));
  bool any = false;
  KVQ_UNROLL for (int q = 0; q < 4; ++q) {
    if (!seen[q]) continue;
    l[r0 + q] += lanes[4 * q];
    any = any || lanes[4 * q] != 0.f;
  }
  return any;
}
#endif

// The softmax step of one block for every row (softmax_row); rows_padded ≥ rows get
// zero weights past rows. Returns whether any weight is nonzero (or NaN).
template <int D>
KVQ_FORCE_INLINE bool softmax_block(float (*s)[kTokensPerBlock], int rows, const int* row_limit, int t0, int n,
                                    float* acc, float* m, float* l) {
  bool any = false;
#if KVQ_CPU_AVX512
  if (rows > 1) {
    for (int r0 = 0; r0 < rows; r0 += 4) any = softmax_rows4<D>(s, r0, rows, row_limit, t0, n, acc, m, l) || any;
    return any;
  }
#endif
  for (int r = 0; r < rows; ++r) any = softmax_row<D>(s, r, row_limit, t0, n, acc, m, l) || any;
  if (any)
    for (int r = rows; r < padded_rows(rows); ++r) std::fill(s[r], s[r] + kTokensPerBlock, 0.f);
  return any;
}

// One part's online-softmax state between blocks: attend_begin sets it up and
// attend_block advances it by one block, so that several parts can walk their keys in
// lockstep (dense_decode takes up to 8 KV heads a block at a time) with attend_part's bits.
//   row_limit[r]   : row r sees tokens t ≤ row_limit[r] (causal); < 0 sees none
//   acc  : [padded_rows(rows)][D]; at the end rows < `rows` hold Σ p·v̂ (unnormalized)
//   m, l : [rows] running max (of τ·logits) and sum
//   end  : one past the last token any row sees (≤ the part's length)
struct PartState {
  int rows, rows_padded, end;
  const int* row_limit;
  float* acc;
  float* m;
  float* l;
};

template <int D>
PartState attend_begin(int length, int rows, const int* row_limit, float* acc, float* m, float* l) {
  const int rows_padded = padded_rows(rows);
  for (int r = 0; r < rows; ++r) {
    m[r] = neg_inf_f();
    l[r] = 0.f;
  }
  std::fill(acc, acc + rows_padded * D, 0.f);
  int max_limit = -1;
  for (int r = 0; r < rows; ++r) max_limit = std::max(max_limit, row_limit[r]);
  return {rows, rows_padded, std::min(length, max_limit + 1), row_limit, acc, m, l};
}

// The block of tokens t0 .. min(t0 + kTokensPerBlock, part.end) (t0 < part.end, a
// multiple of kTokensPerBlock). tile [kTileTokens·D] and s [kMaxRowsPerPass][kTokensPerBlock]
// are scratch that does not outlive the call. The source:
//   src.logits(t0, n, tile, s) : s[r][j] = τ·q_r·k̂_{t0+j} for r < rows, j < n (the
//                                source holds the queries; tile is [kTileTokens·D] scratch)
//   src.values(t0, n, tile)    : tile[j·D + i] = v̂_{t0+j}[i] in the value order, j < n ≤
//                                kTileTokens; false unless every element is known to be
//                                finite
//   src.prefetch_keys(t0, n), src.prefetch_values(t0, n) : hints that the keys / values
//                                of tokens t0 .. t0+n come next, given for the next block
//                                before and after this block's logits: one burst of a
//                                whole block's lines would fill the L1 miss buffers and
//                                stall (a source may also queue them and spread them out)
//   src.touch_pages(t0, n) (optional) : a hint, given two blocks ahead, to touch each OS
//                                page of those tokens once (address translations, see
//                                touch_os_page in kvq/cpu/tile.hpp)
//   src.accumulate_values(t0, n, p, rows_padded, acc) (optional): acc += p·V̂ without a
//                                value tile; false leaves acc alone and takes values()
// A non-finite value row reaches only the rows whose weight for it is nonzero.
template <int D, class Source>
KVQ_FORCE_INLINE void attend_block(const PartState& part, int t0, float* tile, float (*s)[kTokensPerBlock],
                                   Source& src) {
  const int rows = part.rows, rows_padded = part.rows_padded, end = part.end;
  float* acc = part.acc;
  const int n = std::min(kTokensPerBlock, end - t0);
  const int next = t0 + kTokensPerBlock, next_n = std::min(kTokensPerBlock, end - next);
  if (next_n > 0) src.prefetch_keys(next, next_n);
  if constexpr (requires { src.touch_pages(t0, n); }) {
    const int after_next = next + kTokensPerBlock;
    if (after_next < end) src.touch_pages(after_next, std::min(kTokensPerBlock, end - after_next));
  }
  src.logits(t0, n, tile, s);
  if (next_n > 0) src.prefetch_values(next, next_n);
  // Mask, then one rescale per block and row.
  if (!softmax_block<D>(s, rows, part.row_limit, t0, n, acc, part.m, part.l)) return;
  if constexpr (requires { src.accumulate_values(t0, n, s, rows_padded, acc); })
    if (src.accumulate_values(t0, n, s, rows_padded, acc)) return;
  // A tile at a time. Zero weight never multiplies a NaN/Inf value: such a token goes
  // to its rows with nonzero weight alone, then leaves the tile.
  for (int first = 0; first < n; first += kTileTokens) {
    const int count = std::min(kTileTokens, n - first);
    if (!src.values(t0 + first, count, tile)) {
      for (int j = 0; j < count; ++j) {
        float* v = tile + j * D;
        if (rows_are_finite<D>(v, 1)) continue;
        for (int r = 0; r < rows; ++r)
          if (s[r][first + j] != 0.f)
            for (int i = 0; i < D; ++i) acc[r * D + i] += s[r][first + j] * v[i];
        std::fill(v, v + D, 0.f);
      }
    }
    tile_accumulate<D>(s, rows_padded, tile, first, count, acc);
  }
}

// Runs the online softmax of one part over tokens [begin, length); begin is a multiple
// of kTokensPerBlock (a split-KV chunk starts on a block). Arguments as PartState's and
// attend_block's. (The next block's logits between a block's softmax and its value sums,
// in a second logit buffer, gave the out-of-order core nothing to overlap: K2V2 / K4V2
// fastest, 4K warm, within noise; Zen 4, 2026-12-06.)
template <int D, class Source>
void attend_part(int begin, int length, int rows, const int* row_limit, float* acc, float* m, float* l, Source& src) {
  const PartState part = attend_begin<D>(length, rows, row_limit, acc, m, l);
  alignas(64) float tile[kTileTokens * D];
  alignas(64) float s[kMaxRowsPerPass][kTokensPerBlock];  // logits, then probability weights
  for (int t0 = begin; t0 < part.end; t0 += kTokensPerBlock) attend_block<D>(part, t0, tile, s, src);
}

// Source::logits for keys that come as fp32 tiles, kTileTokens at a time:
// load_keys(t, count, tile) fills tile[j·D + i] for tokens t .. t + count in the order of
// q, which is [padded_rows(rows)][D], × τ; the last tile is zero-padded to 4 tokens.
template <int D, class LoadKeys>
KVQ_FORCE_INLINE void logits_from_tile(const float* q, int rows_padded, int t0, int n, float* tile,
                                       float (*s)[kTokensPerBlock], LoadKeys&& load_keys) {
  for (int first = 0; first < n; first += kTileTokens) {
    const int count = std::min(kTileTokens, n - first), padded = (count + 3) / 4 * 4;
    load_keys(t0 + first, count, tile);
    std::fill(tile + count * D, tile + padded * D, 0.f);
    tile_logits<D>(q, rows_padded, tile, first, padded, s);
  }
}

}  // namespace kvq::detail
