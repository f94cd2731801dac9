// prefixgate's CPU ops: for one row (batch-1 decode), AVX2/FMA GEMVs over panel-packed weights
// (fp32; int8 with fp32, int16 or int8 activations, the last on AVX-VNNI where the CPU has it)
// and a whole decoder layer in one call (decode_layer); for one row or many, fused small ops
// (residual add + RMSNorm, rotary + KV write + paged decode attention, SiLU * mul). Built lazily by
// prefixgate/kernels/cpu_ext.py (torch.utils.cpp_extension.load, -O3 -mavx2 -mfma) and
// registered as torch.ops.prefixgate_cpu.*; threads through at::parallel_for (torch's own pool).
// Shapes, dtypes and tolerances are documented in cpu_ext.py.
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kPanel = 8;  // output rows per packed panel (one ymm register)

inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// One panel's 8 weights of input column k as fp32: the fp32 panel as it is; an int8 panel's 8
// bytes widened (vpmovsxbd + vcvtdq2ps). The GEMV loops below are one template over both.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// int8 panels: 8 weights of one input column (one per output row) are 8 bytes; four columns
// (32 bytes) are widened to fp32 (vpmovsxbd + vcvtdq2ps) and multiplied by the broadcast x[k].
inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 load8(const int8_t* p) { return widen8(p); }

// One panel's 8 outputs: four accumulators (k, k+1, k+2, k+3) hide the FMA latency, summed
// (a0 + a1) + (a2 + a3) at the end. One panel at a time reads the weight as one forward stream:
// two panels side by side (one x[k] broadcast feeding both) measured 10-35 % slower at one
// thread on a Zen 5 (memory-bound shapes).
template <typename W>
inline __m256 gemv_one_panel(const W* w0, const float* x, int64_t k_len) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 4 <= k_len; k += 4) {
    const W* p0 = w0 + k * kPanel;
    a0 = _mm256_fmadd_ps(load8(p0), _mm256_broadcast_ss(x + k), a0);
    a1 = _mm256_fmadd_ps(load8(p0 + 8), _mm256_broadcast_ss(x + k + 1), a1);
    a2 = _mm256_fmadd_ps(load8(p0 + 16), _mm256_broadcast_ss(x + k + 2), a2);
    a3 = _mm256_fmadd_ps(load8(p0 + 24), _mm256_broadcast_ss(x + k + 3), a3);
  }
  for (; k < k_len; ++k) {
    a0 = _mm256_fmadd_ps(load8(w0 + k * kPanel), _mm256_broadcast_ss(x + k), a0);
  }
  return _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
}

// The bias's data, checked fp32 [N] (nullptr without a bias); ``holder`` keeps its contiguous
// copy alive while the op runs.
inline const float* bias_data(const c10::optional<at::Tensor>& bias, int64_t n_out,
                              at::Tensor& holder, const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  holder = bias->contiguous();
  TORCH_CHECK(holder.scalar_type() == at::kFloat && holder.numel() == n_out, op, ": bias [N]");
  return holder.data_ptr<float>();
}

inline void store_panel(__m256 acc, const float* bias, float* y, int64_t row0, int64_t n_out) {
  alignas(32) float tmp[kPanel];
  if (bias != nullptr && row0 + kPanel <= n_out) {
    acc = _mm256_add_ps(acc, _mm256_loadu_ps(bias + row0));
  }
  if (row0 + kPanel <= n_out) {
    _mm256_storeu_ps(y + row0, acc);
    return;
  }
  _mm256_store_ps(tmp, acc);
  for (int64_t r = row0; r < n_out; ++r) {
    y[r] = tmp[r - row0] + (bias != nullptr ? bias[r] : 0.0f);
  }
}


// An int8 panel GEMV's output rows: n_out fits the panels, one fp32 scale per panel row.
inline void check_rows(int64_t panels, int64_t n_out, const at::Tensor& scale, const char* op) {
  TORCH_CHECK(n_out > (panels - 1) * kPanel && n_out <= panels * kPanel, op, ": n_out ", n_out,
              " does not fit ", panels, " panels");
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == panels * kPanel, op,
              ": scale must hold 8 * P values");
}

// What both int8 panel GEMVs set up before their panels: x and scale fp32 and packed a
// contiguous int8 [P, *, 8, ``inner``] (``layout`` names it in the error), n_out fitting the P
// panels (``check_rows``), then the bias, the output y [1, N] and the pointers the panels read.
struct Int8Gemv {
  at::Tensor bias_holder;  // the bias's contiguous copy, alive while the op runs
  const float* bias;       // nullptr without a bias
  at::Tensor y;
  const int8_t* w;
  const float* scale;
  float* out;
};

inline Int8Gemv int8_gemv_setup(const at::Tensor& x, const at::Tensor& packed,
                                const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                                int64_t n_out, int64_t inner, const char* layout,
                                const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kChar &&
                  scale.scalar_type() == at::kFloat,
              op, ": float32 x and scale, int8 packed weight");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanel && packed.size(3) == inner &&
                  packed.is_contiguous(),
              op, ": packed must be a contiguous ", layout, " tensor");
  check_rows(packed.size(0), n_out, scale, op);
  Int8Gemv g;
  g.bias = bias_data(bias, n_out, g.bias_holder, op);
  g.y = at::empty({1, n_out}, x.options());
  g.w = packed.data_ptr<int8_t>();
  g.scale = scale.data_ptr<float>();
  g.out = g.y.data_ptr<float>();
  return g;
}

// int16-activation int8 GEMV: x quantized per row to int16 (absmax -> 32767), weights in pair
// panels [P, K2 / 2, 8, 2] (rows r of panel p, columns 2j and 2j+1 adjacent), so vpmaddwd
// multiplies 16 weights by two activations and sums the pairs exactly into int32; the int32
// sums are moved into fp32 every 128 column pairs (|sum| < 128 * 2 * 127 * 32767 < 2^31).
at::Tensor gemv_int8w16_packed(const at::Tensor& x, const at::Tensor& packed,
                               const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                               int64_t n_out) {
  const Int8Gemv g = int8_gemv_setup(x, packed, scale, bias, n_out, 2, "[P, K2 / 2, 8, 2]",
                                     "gemv_int8w16_packed");
  const int64_t panels = packed.size(0);
  const int64_t pairs = packed.size(1);
  const int64_t k_len = x.numel();
  TORCH_CHECK((k_len + 1) / 2 == pairs, "gemv_int8w16_packed: x has ", k_len,
              " values for ", pairs, " column pairs");
  at::Tensor xc = x.contiguous();
  const float* xf = xc.data_ptr<float>();
  float amax = 0.0f;
  for (int64_t k = 0; k < k_len; ++k) amax = std::max(amax, std::fabs(xf[k]));
  const float xs = amax > 0.0f ? 32767.0f / amax : 1.0f;
  std::vector<int32_t> xpair(pairs);
  for (int64_t j = 0; j < pairs; ++j) {
    const int32_t lo = static_cast<int32_t>(std::nearbyint(xf[2 * j] * xs));
    const int32_t hi =
        2 * j + 1 < k_len ? static_cast<int32_t>(std::nearbyint(xf[2 * j + 1] * xs)) : 0;
    xpair[j] = static_cast<int32_t>((static_cast<uint32_t>(hi) << 16) |
                                    (static_cast<uint32_t>(lo) & 0xffffu));
  }
  const int32_t* xq = xpair.data();
  const float inv_xs = 1.0f / xs;
  const int64_t grain = std::max<int64_t>(1, (128 * 1024) / (kPanel * 2 * pairs));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int8_t* w = g.w + p * pairs * 2 * kPanel;
      __m256 accf = _mm256_setzero_ps();
      for (int64_t j0 = 0; j0 < pairs; j0 += 128) {
        const int64_t j1 = std::min<int64_t>(pairs, j0 + 128);
        __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
        int64_t j = j0;
        for (; j + 2 <= j1; j += 2) {
          const __m256i w0 = _mm256_cvtepi8_epi16(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * 2 * kPanel)));
          const __m256i w1 = _mm256_cvtepi8_epi16(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (j + 1) * 2 * kPanel)));
          a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(w0, _mm256_set1_epi32(xq[j])));
          a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(w1, _mm256_set1_epi32(xq[j + 1])));
        }
        if (j < j1) {
          const __m256i w0 = _mm256_cvtepi8_epi16(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * 2 * kPanel)));
          a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(w0, _mm256_set1_epi32(xq[j])));
        }
        accf = _mm256_add_ps(accf, _mm256_cvtepi32_ps(_mm256_add_epi32(a0, a1)));
      }
      const __m256 sc =
          _mm256_mul_ps(_mm256_loadu_ps(g.scale + p * kPanel), _mm256_set1_ps(inv_xs));
      store_panel(_mm256_mul_ps(accf, sc), g.bias, g.out, p * kPanel, n_out);
    }
  });
  return g.y;
}

// int8-activation int8 GEMV ("gemv8"): x quantized per block of 32 columns to int8 (absmax ->
// 127, one fp32 scale a block, as ggml's quantize_row_q8_0), weights in quad panels
// [P, K32 / 4, 8, 4] (rows r of panel p, columns 4j .. 4j+3 adjacent; K padded to a multiple
// of 32 with zeros). A quad of 32 weights (8 rows x 4 columns) meets the broadcast 4 activations
// in one multiply-add: vpmaddubsw(|x|, sign(w, x)) + vpmaddwd(1) (AVX2; |pair sum| <= 2 * 127 *
// 127 < 2^15, no saturation since both sides are in [-127, 127]) or one vpdpbusd (AVX-VNNI). The
// int32 sums of a block (<= 32 * 127^2) are exact and equal on both paths; each block's sum is
// moved into fp32 times its activation scale, the row's weight scale applied at the end.
constexpr int64_t kBlock = 32;           // activation columns per int8 scale
constexpr int64_t kQuads = kBlock / 4;   // quads (4 columns) per block

struct QuantizedRow {
  std::vector<int32_t> quad;      // 4 int8 activations packed per int32 (K32 / 4)
  std::vector<int32_t> abs_quad;  // their absolute values (u8), packed the same way
  std::vector<float> scale;       // per block: absmax / 127
};

inline QuantizedRow quantize_row_int8(const float* x, int64_t k_len, int64_t blocks) {
  QuantizedRow q;
  q.quad.assign(blocks * kQuads, 0);
  q.abs_quad.assign(blocks * kQuads, 0);
  q.scale.assign(blocks, 0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k0 = b * kBlock, k1 = std::min(k_len, k0 + kBlock);
    float amax = 0.0f;
    for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(x[k]));
    q.scale[b] = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int8_t* qb = reinterpret_cast<int8_t*>(q.quad.data() + b * kQuads);
    uint8_t* ab = reinterpret_cast<uint8_t*>(q.abs_quad.data() + b * kQuads);
    for (int64_t k = k0; k < k1; ++k) {
      const int v = std::clamp(static_cast<int>(std::nearbyint(x[k] * inv)), -127, 127);
      qb[k - k0] = static_cast<int8_t>(v);
      ab[k - k0] = static_cast<uint8_t>(v < 0 ? -v : v);
    }
  }
  return q;
}

// One quad: 8 rows' int32 sums of 4 products, added to acc. VNNI: one AVX-VNNI vpdpbusd,
// written as inline assembly so the file still compiles for plain AVX2 (the caller checks
// the CPU); otherwise vpmaddubsw + vpmaddwd.
template <bool VNNI>
inline __m256i quad(__m256i acc, __m256i w, __m256i xs, __m256i xa) {
  const __m256i sw = _mm256_sign_epi8(w, xs);
  if constexpr (VNNI) {
    asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(xa), "x"(sw));
    return acc;
  } else {
    const __m256i p16 = _mm256_maddubs_epi16(xa, sw);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
  }
}

// One panel's 8 outputs: fp32 sums of its block int32 sums times their activation scale. Two
// int32 accumulators (even and odd quads) halve the dependency chain of vpdpbusd's latency;
// one panel at a time reads the weight as one forward stream (two panels side by side
// measured 20-40 % slower here at the memory-bound shapes).
template <bool VNNI>
inline __m256 gemv8_panel(const int8_t* w, const QuantizedRow& xq, int64_t blocks) {
  __m256 f = _mm256_setzero_ps();
  const int32_t* xs = xq.quad.data();
  const int32_t* xa = xq.abs_quad.data();
  auto load = [w](int64_t j) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * 4 * kPanel));
  };
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i a = _mm256_setzero_si256(), c = _mm256_setzero_si256();
    for (int64_t j = b * kQuads; j < (b + 1) * kQuads; j += 2) {
      a = quad<VNNI>(a, load(j), _mm256_set1_epi32(xs[j]), _mm256_set1_epi32(xa[j]));
      c = quad<VNNI>(c, load(j + 1), _mm256_set1_epi32(xs[j + 1]), _mm256_set1_epi32(xa[j + 1]));
    }
    const __m256 d = _mm256_set1_ps(xq.scale[b]);
    f = _mm256_add_ps(f, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(a, c)), d));
  }
  return f;
}

// x [1, K] fp32; packed [P, K32 / 4, 8, 4] int8; scale [8P] fp32; bias [N] or none ->
// y [1, N] = scale * (x_q8 . q) + bias. ``vnni``: use AVX-VNNI where the CPU has it (False
// forces the AVX2 path; both give the same int32 sums, so the same result bit for bit).
at::Tensor gemv_int8x8_packed(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                              int64_t n_out, bool vnni) {
  const Int8Gemv g = int8_gemv_setup(x, packed, scale, bias, n_out, 4, "[P, K32 / 4, 8, 4]",
                                     "gemv_int8x8_packed");
  TORCH_CHECK(packed.size(1) % kQuads == 0,
              "gemv_int8x8_packed: packed must be a contiguous [P, K32 / 4, 8, 4] tensor");
  const int64_t panels = packed.size(0);
  const int64_t blocks = packed.size(1) / kQuads;
  const int64_t k_len = x.numel();
  TORCH_CHECK((k_len + kBlock - 1) / kBlock == blocks, "gemv_int8x8_packed: x has ", k_len,
              " values for ", blocks, " blocks of 32 columns");
  at::Tensor xc = x.contiguous();
  const QuantizedRow xq = quantize_row_int8(xc.data_ptr<float>(), k_len, blocks);
  const bool use_vnni = vnni && __builtin_cpu_supports("avxvnni");
  const int64_t panel_bytes = blocks * kBlock * kPanel;
  const int64_t grain = std::max<int64_t>(1, (128 * 1024) / panel_bytes);
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int8_t* w = g.w + p * panel_bytes;
      const __m256 acc = use_vnni ? gemv8_panel<true>(w, xq, blocks)
                                  : gemv8_panel<false>(w, xq, blocks);
      store_panel(_mm256_mul_ps(acc, _mm256_loadu_ps(g.scale + p * kPanel)), g.bias, g.out,
                  p * kPanel, n_out);
    }
  });
  return g.y;
}

// The panel GEMV's common body, fp32 or int8 panels [P, K, 8] (output row p*8+j of the weight in
// packed[p, :, j]; rows past N zero): checks, bias, panels over at::parallel_for (a
// thread's share at least ``grain_bytes`` of weight); ``scale`` (8P fp32 values, one per output
// row) multiplies each panel's sums when given (the int8 weight), before the bias.
template <typename W>
at::Tensor gemv_panels(const at::Tensor& x, const at::Tensor& packed, const float* scale,
                       const c10::optional<at::Tensor>& bias, int64_t n_out, int64_t grain_bytes,
                       const char* op) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(), op,
              ": packed must be a contiguous [P, K, 8] tensor");
  const int64_t k_len = packed.size(1);
  const int64_t panels = packed.size(0);
  TORCH_CHECK(x.numel() == k_len, op, ": x has ", x.numel(), " values, K is ", k_len);
  TORCH_CHECK(n_out > (panels - 1) * kPanel && n_out <= panels * kPanel, op, ": n_out ", n_out,
              " does not fit ", panels, " panels");
  at::Tensor xc = x.contiguous();
  at::Tensor bc;
  const float* bias_ptr = bias_data(bias, n_out, bc, op);
  at::Tensor y = at::empty({1, n_out}, x.options());
  const float* xp = xc.data_ptr<float>();
  const W* wp = packed.data_ptr<W>();
  float* yp = y.data_ptr<float>();
  auto scaled = [&](__m256 acc, int64_t p) {
    return scale == nullptr ? acc : _mm256_mul_ps(acc, _mm256_loadu_ps(scale + p * kPanel));
  };
  const int64_t panel_bytes = kPanel * k_len * static_cast<int64_t>(sizeof(W));
  const int64_t grain = std::max<int64_t>(1, grain_bytes / panel_bytes);
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const W* w = wp + p * k_len * kPanel;
      store_panel(scaled(gemv_one_panel(w, xp, k_len), p), bias_ptr, yp, p * kPanel, n_out);
    }
  });
  return y;
}

// x [1, K] fp32; packed [P, K, 8] int8 (pack as the fp32 panels; rows past N zero); scale [8P]
// fp32 (per output row, padded); bias [N] or none -> y [1, N] = scale * (x . q) + bias.
at::Tensor gemv_int8_packed(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& bias, int64_t n_out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kChar &&
                  scale.scalar_type() == at::kFloat,
              "gemv_int8_packed: float32 x and scale, int8 packed weight");
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == packed.size(0) * kPanel,
              "gemv_int8_packed: scale must hold 8 * P values");
  return gemv_panels<int8_t>(x, packed, scale.data_ptr<float>(), bias, n_out, 128 * 1024,
                             "gemv_int8_packed");
}

// One wide panel's W = 8G outputs (fp32 panels [P, Kp, W], input column k's W weights adjacent):
// G accumulators per unrolled column, U columns unrolled (U = 4 for one group, as
// gemv_one_panel, so an 8-wide panel gives its bits exactly; 8 / G otherwise, so at least eight
// FMAs are in flight), each group's partials summed pairwise at the end. The weight is read as one
// forward stream. oneDNN's packed fp32 linear weight is such a layout (64-wide panels, input
// columns padded to 16, on AVX-512 CPUs), so its buffer serves the one-row GEMV without a copy.
template <int G>
inline void gemv_wide_panel(const float* w0, const float* x, int64_t k_len, __m256* out) {
  constexpr int U = G == 1 ? 4 : (8 / G > 0 ? 8 / G : 1);
  constexpr int64_t W = 8 * G;
  __m256 acc[U][G];
  for (int u = 0; u < U; ++u)
    for (int g = 0; g < G; ++g) acc[u][g] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + U <= k_len; k += U) {
    for (int u = 0; u < U; ++u) {
      const __m256 xb = _mm256_broadcast_ss(x + k + u);
      const float* row = w0 + (k + u) * W;
      for (int g = 0; g < G; ++g) acc[u][g] = _mm256_fmadd_ps(_mm256_loadu_ps(row + 8 * g), xb, acc[u][g]);
    }
  }
  for (; k < k_len; ++k) {
    const __m256 xb = _mm256_broadcast_ss(x + k);
    for (int g = 0; g < G; ++g) acc[0][g] = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k * W + 8 * g), xb, acc[0][g]);
  }
  for (int g = 0; g < G; ++g) {
    if constexpr (U == 4) {
      out[g] = _mm256_add_ps(_mm256_add_ps(acc[0][g], acc[1][g]), _mm256_add_ps(acc[2][g], acc[3][g]));
    } else if constexpr (U == 2) {
      out[g] = _mm256_add_ps(acc[0][g], acc[1][g]);
    } else {
      __m256 s = acc[0][g];
      for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, acc[u][g]);
      out[g] = s;
    }
  }
}

template <int G>
void gemv_wide(const float* xp, const float* wp, const float* bias_ptr, float* yp, int64_t k_len,
               int64_t k_pad, int64_t panels, int64_t n_out, int64_t grain) {
  constexpr int64_t W = 8 * G;
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    __m256 out[G];
    for (int64_t p = begin; p < end; ++p) {
      gemv_wide_panel<G>(wp + p * k_pad * W, xp, k_len, out);
      for (int g = 0; g < G; ++g) {
        const int64_t row0 = p * W + 8 * g;
        if (row0 >= n_out) break;
        store_panel(out[g], bias_ptr, yp, row0, n_out);
      }
    }
  });
}

// x [1, K] (or [K]) fp32 contiguous; packed [P, K, W] fp32, W one of 8, 16, .., 64, each panel's
// K x W weights contiguous (strides (S, W, 1), S >= K * W: output row p*W+j of the weight in
// packed[p, :, j]; rows past N never used): pack_panels' layout (W = 8, S = K * W) or a view of
// oneDNN's packed linear weight (its input columns padded, so S > K * W); bias [N] or none ->
// y [1, N]; a thread's share is at least ~256 KiB of weight.
at::Tensor gemv_packed(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias, int64_t n_out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "gemv_packed: float32 tensors only");
  TORCH_CHECK(packed.dim() == 3, "gemv_packed: packed must be [P, K, W] panels");
  const int64_t width = packed.size(2);
  const int64_t k_len = packed.size(1);
  const int64_t panels = packed.size(0);
  // strides of size-1 dimensions say nothing (a contiguous tensor may hold any there)
  const bool panel_ok = width % kPanel == 0 && width >= kPanel && width <= 8 * kPanel &&
                        packed.stride(2) == 1 && (k_len == 1 || packed.stride(1) == width);
  const bool stride_ok = panels == 1 || (packed.stride(0) >= k_len * width &&
                                         packed.stride(0) % width == 0);
  TORCH_CHECK(panel_ok && stride_ok,
              "gemv_packed: packed must be [P, K, W] panels (W a multiple of 8 up to 64), each "
              "panel contiguous");
  const int64_t k_pad = panels == 1 ? k_len : packed.stride(0) / width;  // panel stride / W
  TORCH_CHECK(x.numel() == k_len, "gemv_packed: x has ", x.numel(), " values, K is ", k_len);
  TORCH_CHECK(n_out > (panels - 1) * width && n_out <= panels * width, "gemv_packed: n_out ",
              n_out, " does not fit ", panels, " panels of ", width);
  at::Tensor xc = x.contiguous();
  at::Tensor bc;
  const float* bias_ptr = bias_data(bias, n_out, bc, "gemv_packed");
  at::Tensor y = at::empty({1, n_out}, x.options());
  const int64_t panel_bytes = width * k_pad * static_cast<int64_t>(sizeof(float));
  const int64_t grain = std::max<int64_t>(1, (256 * 1024) / panel_bytes);
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (width / kPanel) {
    case 1: gemv_wide<1>(xp, wp, bias_ptr, yp, k_len, k_pad, panels, n_out, grain); break;
    case 2: gemv_wide<2>(xp, wp, bias_ptr, yp, k_len, k_pad, panels, n_out, grain); break;
    case 3: gemv_wide<3>(xp, wp, bias_ptr, yp, k_len, k_pad, panels, n_out, grain); break;
    case 4: gemv_wide<4>(xp, wp, bias_ptr, yp, k_len, k_pad, panels, n_out, grain); break;
    case 5: gemv_wide<5>(xp, wp, bias_ptr, yp, k_len, k_pad, panels, n_out, grain); break;
    case 6: gemv_wide<6>(xp, wp, bias_ptr, yp, k_len, k_pad, panels, n_out, grain); break;
    case 7: gemv_wide<7>(xp, wp, bias_ptr, yp, k_len, k_pad, panels, n_out, grain); break;
    default: gemv_wide<8>(xp, wp, bias_ptr, yp, k_len, k_pad, panels, n_out, grain); break;
  }
  return y;
}

// bf16 activations and KV: 8 values are loaded into fp32 lanes (the bits shifted up 16), all
// arithmetic runs in fp32 registers, and results are rounded to bf16 only where the torch
// reference rounds them (its ops' outputs). Stores round to nearest even: AVX512_BF16's
// vcvtneps2bf16 where the CPU has it (inline assembly, so the file still builds for plain AVX2;
// it flushes denormal inputs to zero), otherwise the AVX2 integer form of c10's
// round_to_nearest_even (the same bits for every normal value); scalar tails use c10::BFloat16.
using bf16 = c10::BFloat16;

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return static_cast<float>(x); }
template <typename T>
inline T from_f32(float x);
template <>
inline float from_f32<float>(float x) { return x; }
template <>
inline bf16 from_f32<bf16>(float x) { return bf16(x); }

inline __m256 load8f(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8f(const bf16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// c10's round_to_nearest_even on 8 lanes: the bf16 bits in each lane's low 16 (NaN -> 0x7fc0).
inline __m256i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}

// v rounded to bf16 and back (the reference's intermediate bf16 results)
inline __m256 round8_bf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}

// vcvtneps2bf16 where the CPU has AVX512_BF16, unless PREFIXGATE_CPU_EXT_AVX512BF16=0 (the
// AVX2 rounding then, as on CPUs without it: how the tests reach that path here).
bool use_avx512_bf16() {
  const char* env = std::getenv("PREFIXGATE_CPU_EXT_AVX512BF16");
  return __builtin_cpu_supports("avx512bf16") && !(env != nullptr && std::string(env) == "0");
}
const bool kAvx512Bf16 = use_avx512_bf16();

inline void store8f(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8f(bf16* p, __m256 v) {
  __m128i h;
  if (kAvx512Bf16) {
    asm("vcvtneps2bf16 %1, %0" : "=x"(h) : "x"(v));
  } else {
    const __m256i b = bf16_bits8(v);
    h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08));
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}

// sum_i a[i] * b[i] in fp32 (two accumulators of 8 lanes, then the tail)
template <typename A, typename B>
inline float dot(const A* a, const B* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
  if (n >= 8) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      acc0 = _mm256_fmadd_ps(load8f(a + i), load8f(b + i), acc0);
      acc1 = _mm256_fmadd_ps(load8f(a + i + 8), load8f(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) {
      acc0 = _mm256_fmadd_ps(load8f(a + i), load8f(b + i), acc0);
    }
    s = hsum8(_mm256_add_ps(acc0, acc1));
  }
  for (; i < n; ++i) s += to_f32(a[i]) * to_f32(b[i]);
  return s;
}

// Cephes' expf constants, one table for exp8 and exp16 (the same values on 8 or 16 lanes):
// the clamp, log2(e), ln 2 in two parts, the degree-5 polynomial's coefficients.
namespace cephes_exp {
constexpr float kLo = -87.3f, kHi = 88.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace cephes_exp

// exp(x) for 8 fp32 lanes: Cephes' expf (range reduction by ln 2 in two parts, degree-5
// polynomial, 2^n through the exponent bits); inputs clamped to [-87.3, 88.3] (results within
// fp32's normal range; NaN stays NaN); about 1 ulp from std::exp.
inline __m256 exp8(__m256 x) {
  namespace k = cephes_exp;
  // the constant first: maxps / minps return their second operand when either is NaN, so a
  // NaN comes out NaN (a NaN score makes the attention's row NaN, as SDPA's), not exp(-87.3)
  x = _mm256_min_ps(_mm256_set1_ps(k::kHi), _mm256_max_ps(_mm256_set1_ps(k::kLo), x));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(k::kLog2e)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(k::kLn2Hi), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(k::kLn2Lo), r);
  __m256 y = _mm256_set1_ps(k::kP[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(k::kP[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}


// One row of add + RMSNorm: s = a + b (b may be null: s = a, not written), out = w * (s * inv).
// bf16 rounds where torch_ref.rms_norm does: the sum, the normalized row, the weight's product.
template <typename T>
inline void add_rms_norm_row(const T* a, const T* b, T* s_out, const T* w, T* o, int64_t h,
                             float eps) {
  const T* s = a;
  if constexpr (std::is_same_v<T, float>) {
    if (b != nullptr) {
      for (int64_t i = 0; i < h; ++i) s_out[i] = a[i] + b[i];
      s = s_out;
    }
    const float ms = dot(s, s, h) / static_cast<float>(h);
    const float inv = 1.0f / std::sqrt(ms + eps);
    for (int64_t i = 0; i < h; ++i) o[i] = w[i] * (s[i] * inv);
  } else {
    if (b != nullptr) {
      int64_t i = 0;
      for (; i + 8 <= h; i += 8) store8f(s_out + i, _mm256_add_ps(load8f(a + i), load8f(b + i)));
      for (; i < h; ++i) s_out[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
      s = s_out;
    }
    const float ms = dot(s, s, h) / static_cast<float>(h);
    const float inv = 1.0f / std::sqrt(ms + eps);
    const __m256 iv = _mm256_set1_ps(inv);
    int64_t i = 0;
    for (; i + 8 <= h; i += 8) {
      const __m256 n = round8_bf16(_mm256_mul_ps(load8f(s + i), iv));
      store8f(o + i, _mm256_mul_ps(load8f(w + i), n));
    }
    for (; i < h; ++i) {
      o[i] = from_f32<T>(to_f32(w[i]) * to_f32(from_f32<T>(to_f32(s[i]) * inv)));
    }
  }
}

// x [T, H], residual [T, H] or none, weight [H] (all fp32 or all bf16) ->
// (weight * (x + residual) / rms, x + residual) row by row (rows over at::parallel_for; each
// row's arithmetic the same at any T).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x,
                                                const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && weight.scalar_type() == dtype,
              "add_rms_norm: float32 or bfloat16 tensors, one dtype");
  const int64_t h = weight.numel();
  TORCH_CHECK(h > 0 && x.dim() == 2 && x.size(1) == h, "add_rms_norm: x must be [T, ", h, "]");
  const int64_t rows = x.size(0);
  at::Tensor xc = x.contiguous();
  at::Tensor wc = weight.contiguous();
  at::Tensor sum = xc;
  at::Tensor rc;
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) {
    rc = residual->contiguous();
    TORCH_CHECK(rc.scalar_type() == dtype && rc.sizes() == x.sizes(),
                "add_rms_norm: residual [T, H] as x");
    sum = at::empty({rows, h}, x.options());
  }
  at::Tensor out = at::empty({rows, h}, x.options());
  const float e = static_cast<float>(eps);
  auto body = [&](auto tag) {
    using T = decltype(tag);
    const T* a = xc.data_ptr<T>();
    const T* b = has_res ? rc.data_ptr<T>() : nullptr;
    T* s = sum.data_ptr<T>();
    const T* w = wc.data_ptr<T>();
    T* o = out.data_ptr<T>();
    auto run = [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        add_rms_norm_row<T>(a + r * h, b == nullptr ? nullptr : b + r * h, s + r * h, w,
                            o + r * h, h, e);
      }
    };
    if (rows == 1) {
      run(0, 1);
    } else {
      at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / h), run);
    }
  };
  if (dtype == at::kFloat) {
    body(float{});
  } else {
    body(bf16{});
  }
  return {out, sum};
}

// x [T, 2I] -> silu(x[:, :I]) * x[:, I:]  [T, I], silu(g) = g / (1 + exp(-g)) (exp8); bf16 rounds
// silu(g) before the product, as torch_ref.silu_and_mul (F.silu's bf16 output) does.
template <typename T>
void silu_mul_rows(const T* src, T* dst, int64_t rows, int64_t n) {
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* a = src + r * 2 * n;
      T* o = dst + r * n;
      int64_t i = 0;
      const __m256 one = _mm256_set1_ps(1.0f);
      for (; i + 8 <= n; i += 8) {
        const __m256 g = load8f(a + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        __m256 sg = _mm256_div_ps(g, _mm256_add_ps(one, e));
        if constexpr (!std::is_same_v<T, float>) sg = round8_bf16(sg);
        store8f(o + i, _mm256_mul_ps(sg, load8f(a + n + i)));
      }
      for (; i < n; ++i) {
        const float g = to_f32(a[i]);
        const float sg = to_f32(from_f32<T>(g / (1.0f + std::exp(-g))));
        o[i] = from_f32<T>(sg * to_f32(a[n + i]));
      }
    }
  };
  if (rows == 1) {
    run(0, 1);
  } else {
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), run);
  }
}

at::Tensor silu_mul(const at::Tensor& x) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.dim() == 2 &&
                  x.size(1) % 2 == 0,
              "silu_mul: float32 or bfloat16 [T, 2I]");
  at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0);
  const int64_t n = x.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, x.options());
  if (dtype == at::kFloat) {
    silu_mul_rows(xc.data_ptr<float>(), out.data_ptr<float>(), rows, n);
  } else {
    silu_mul_rows(xc.data_ptr<bf16>(), out.data_ptr<bf16>(), rows, n);
  }
  return out;
}

// Rotary on q and k (half-split layout) of T tokens, k and v written to the paged caches at
// each token's slot (-1: not written, as the reference's reshape_and_cache skips it); the
// rotated q [T, Hq * D] returned. qkv [T, (Hq + 2 Hkv) D] and the caches [N, S, Hkv, D]
// contiguous, fp32 or bf16 (one dtype; the rotary in fp32, rounded once, as the reference);
// positions [T] int64; cos_sin [max_pos, D] fp32; slot [T] int64. Tokens over at::parallel_for
// (each writes its own slot).
at::Tensor rotary_cache(const at::Tensor& qkv, const at::Tensor& positions,
                        const at::Tensor& cos_sin, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& slot, int64_t num_heads,
                        int64_t num_kv_heads) {
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) &&
                  k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype &&
                  cos_sin.scalar_type() == at::kFloat,
              "decode_attention: float32 or bfloat16 qkv and caches (one dtype), float32 "
              "cos/sin");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && cos_sin.is_contiguous(),
              "decode_attention: contiguous caches and cos/sin table");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot.scalar_type() == at::kLong,
              "decode_attention: int64 positions/slot");
  const int64_t d = k_cache.size(3);
  TORCH_CHECK(k_cache.size(2) == num_kv_heads && num_heads % num_kv_heads == 0 &&
                  v_cache.sizes() == k_cache.sizes(),
              "decode_attention: head counts");
  const int64_t width = (num_heads + 2 * num_kv_heads) * d;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == width, "decode_attention: qkv size");
  const int64_t tokens = qkv.size(0);
  TORCH_CHECK(positions.numel() == tokens && slot.numel() == tokens,
              "decode_attention: one position and slot a row");
  TORCH_CHECK(cos_sin.size(1) == d && d % 2 == 0, "decode_attention: cos/sin table [P, D]");
  at::Tensor qc = qkv.contiguous();
  at::Tensor pc = positions.contiguous();
  at::Tensor sc_t = slot.contiguous();
  const int64_t* pos_p = pc.data_ptr<int64_t>();
  const int64_t* slot_p = sc_t.data_ptr<int64_t>();
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t b = 0; b < tokens; ++b) {
    TORCH_CHECK(pos_p[b] >= 0 && pos_p[b] < cos_sin.size(0),
                "decode_attention: position out of range");
    TORCH_CHECK(slot_p[b] >= -1 && slot_p[b] < slots, "decode_attention: slot out of range");
  }
  const int64_t half = d / 2;
  at::Tensor out = at::empty({tokens, num_heads * d}, qkv.options());
  const float* cs_all = cos_sin.data_ptr<float>();
  const int64_t row = num_kv_heads * d;  // values per cache slot
  auto body = [&](auto tag) {
    using T = decltype(tag);
    const T* src_all = qc.data_ptr<T>();
    T* q_all = out.data_ptr<T>();
    T* kc = k_cache.data_ptr<T>();
    T* vc = v_cache.data_ptr<T>();
    auto run = [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const float* cs = cs_all + pos_p[b] * d;
        // rotary: t * [cos, cos] + [t2, t1] * [-sin, sin], the torch reference's products and
        // sums (in fp32, rounded once to bf16 for bf16 rows)
        auto rotate = [&](const T* t, T* dst) {
          for (int64_t i = 0; i < half; ++i) {
            const float c = cs[i], sn = cs[half + i];
            const float a = to_f32(t[i]), bb = to_f32(t[half + i]);
            dst[i] = from_f32<T>(a * c + bb * (-sn));
            dst[half + i] = from_f32<T>(bb * c + a * sn);
          }
        };
        const T* src = src_all + b * width;
        T* q = q_all + b * num_heads * d;
        for (int64_t hh = 0; hh < num_heads; ++hh) rotate(src + hh * d, q + hh * d);
        const T* ksrc = src + num_heads * d;
        const T* vsrc = ksrc + num_kv_heads * d;
        const int64_t s = slot_p[b];
        if (s >= 0) {
          for (int64_t g = 0; g < num_kv_heads; ++g) rotate(ksrc + g * d, kc + s * row + g * d);
          std::copy(vsrc, vsrc + row, vc + s * row);
        }
      }
    };
    if (tokens < 16) {
      run(0, tokens);
    } else {
      at::parallel_for(0, tokens, 16, run);
    }
  };
  if (dtype == at::kFloat) {
    body(float{});
  } else {
    body(bf16{});
  }
  return out;
}

// The grain of a decode-attention call's tasks: all of them (one thread, no parallel region)
// when the call's whole work is under kSerialTokenHeads token x KV-head pairs (a lone decode
// row at a short context: waking the other threads costs more than they save; measured in
// docs/benchmarks/vllm-cpu-peer.md, runs 21-24), else 1.
constexpr int64_t kSerialTokenHeads = 1024;
inline int64_t attention_grain(const int32_t* len_p, int64_t batch, int64_t num_kv_heads,
                               int64_t tasks) {
  int64_t work = 0;
  for (int64_t b = 0; b < batch; ++b) work += static_cast<int64_t>(len_p[b]) * num_kv_heads;
  return work < kSerialTokenHeads ? std::max<int64_t>(1, tasks) : 1;
}

// Decode attention of B rows over their paged contexts (after rotary_cache wrote this step's
// K/V), fp32 or bf16 q / caches / output; scores, softmax and P.V in fp32. ``out`` holds the
// rotated q [B, Hq D] and receives each head's output in place of its q.
template <typename T>
void attend_rows(T* q_all, const T* kc, const T* vc, const int32_t* tables, const int32_t* len_p,
                 int64_t batch, int64_t max_blocks, int64_t block_size, int64_t num_heads,
                 int64_t num_kv_heads, int64_t d, float sc) {
  const int64_t row = num_kv_heads * d;  // values per cache slot
  const int64_t group = num_heads / num_kv_heads;
  int64_t longest = 1;
  for (int64_t b = 0; b < batch; ++b) longest = std::max<int64_t>(longest, len_p[b]);
  // one task a (row, KV head): its G = Hq / Hkv query heads read each cached K row once; the
  // context is walked block by block (no division a token)
  const int64_t tasks = batch * num_kv_heads;
  at::parallel_for(0, tasks, attention_grain(len_p, batch, num_kv_heads, tasks),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * longest);
    std::vector<const T*> vrows(longest);
    std::vector<float> mx(group);
    std::vector<float> qf(std::is_same_v<T, float> ? 0 : group * d);  // bf16 q in fp32
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads;
      const int64_t g = task % num_kv_heads;
      const int64_t length = len_p[b];
      const int32_t* table = tables + b * max_blocks;
      T* q0 = q_all + b * num_heads * d + g * group * d;  // the group's first query head
      const float* qs;
      if constexpr (std::is_same_v<T, float>) {
        qs = q0;
      } else {
        for (int64_t i = 0; i < group * d; ++i) qf[i] = to_f32(q0[i]);
        qs = qf.data();
      }
      std::fill(mx.begin(), mx.end(), -INFINITY);
      for (int64_t t0 = 0; t0 < length; t0 += block_size) {
        const int64_t base = static_cast<int64_t>(table[t0 / block_size]) * block_size;
        const int64_t n = std::min(block_size, length - t0);
        for (int64_t o = 0; o < n; ++o) {
          const T* kt = kc + (base + o) * row + g * d;
          vrows[t0 + o] = vc + (base + o) * row + g * d;
          for (int64_t j = 0; j < group; ++j) {
            const float v = dot(qs + j * d, kt, d) * sc;
            scores[j * longest + t0 + o] = v;
            mx[j] = std::max(mx[j], v);
          }
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        // softmax numerators exp(score - max), eight at a time (exp8)
        float* sj = scores.data() + j * longest;
        int64_t t = 0;
        const __m256 mxv = _mm256_set1_ps(mx[j]);
        for (; t + 8 <= length; t += 8) {
          _mm256_storeu_ps(sj + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(sj + t), mxv)));
        }
        for (; t < length; ++t) sj[t] = std::exp(sj[t] - mx[j]);
        float denom = 0.0f;
        for (t = 0; t < length; ++t) denom += sj[t];
        const float inv = 1.0f / denom;
        T* qh = q0 + j * d;  // the head's output (its q is no longer needed)
        int64_t i = 0;
        for (; i + 32 <= d; i += 32) {  // 4 accumulators in registers, V rows in order
          __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
          for (t = 0; t < length; ++t) {
            const __m256 pv = _mm256_set1_ps(sj[t]);
            const T* vt = vrows[t] + i;
            a0 = _mm256_fmadd_ps(pv, load8f(vt), a0);
            a1 = _mm256_fmadd_ps(pv, load8f(vt + 8), a1);
            a2 = _mm256_fmadd_ps(pv, load8f(vt + 16), a2);
            a3 = _mm256_fmadd_ps(pv, load8f(vt + 24), a3);
          }
          const __m256 iv = _mm256_set1_ps(inv);
          store8f(qh + i, _mm256_mul_ps(a0, iv));
          store8f(qh + i + 8, _mm256_mul_ps(a1, iv));
          store8f(qh + i + 16, _mm256_mul_ps(a2, iv));
          store8f(qh + i + 24, _mm256_mul_ps(a3, iv));
        }
        for (; i + 8 <= d; i += 8) {
          __m256 a0 = _mm256_setzero_ps();
          for (t = 0; t < length; ++t) {
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(sj[t]), load8f(vrows[t] + i), a0);
          }
          store8f(qh + i, _mm256_mul_ps(a0, _mm256_set1_ps(inv)));
        }
        for (; i < d; ++i) {
          float a = 0.0f;
          for (t = 0; t < length; ++t) a += sj[t] * to_f32(vrows[t][i]);
          qh[i] = from_f32<T>(a * inv);
        }
      }
    }
  });
}

// ---- AVX-512 decode attention (runtime dispatch; the file is built for AVX2) ----------------
// The same computation as attend_rows (scores, softmax with the max subtracted, P.V, all in
// fp32) on 16 lanes: a block's 16 scores of one head come from 16 per-token partial sums
// reduced together (a transpose-and-add tree: 45 shuffles and adds for 16 dot products, where
// a horizontal sum each took ~8), and P.V reads each V row once for a chunk of the group's heads
// (their accumulators in registers). The next step's K rows and this step's V rows are
// prefetched while a step's scores are computed (blocks are scattered over the pool: the
// hardware's prefetcher sees a new stream every block). Needs AVX512F/DQ/BW/VL; D 32, 64, 96
// or 128 (avx512_attention).
#define PG_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")))

PG_AVX512 inline __m512 load16f(const float* p) { return _mm512_loadu_ps(p); }
PG_AVX512 inline __m512 load16f(const bf16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// exp8's Cephes expf on 16 lanes (the same constants and steps, so the same values).
PG_AVX512 inline __m512 exp16(__m512 x) {
  namespace k = cephes_exp;
  x = _mm512_min_ps(_mm512_set1_ps(k::kHi), _mm512_max_ps(_mm512_set1_ps(k::kLo), x));  // NaN kept
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(k::kLog2e)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(k::kLn2Hi), x);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(k::kLn2Lo), r);
  __m512 y = _mm512_set1_ps(k::kP[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(k::kP[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i n = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}

// v[0..15] (16 lanes each) -> [sum(v[0]), ..., sum(v[15])]: pairs within 128-bit lanes
// (unpack ps, then pd), then across them (shuffle_f32x4 twice). v is overwritten.
PG_AVX512 inline __m512 sum16x16(__m512* v) {
  for (int i = 0; i < 8; ++i) {  // [a0+a2, b0+b2, a1+a3, b1+b3] per 128-bit lane
    v[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // lane L of v[i]: the lane sums of v[4i..4i+3]
    const __m512d a = _mm512_castps_pd(v[2 * i]), b = _mm512_castps_pd(v[2 * i + 1]);
    v[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i) {
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88),
                       _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
}

// _mm_prefetch of ``bytes`` from each of ``n`` rows ``stride`` values apart, into L1 (Level 1:
// _MM_HINT_T0) or L2 (Level 2: _MM_HINT_T1).
template <int Level, typename T>
PG_AVX512 inline void prefetch_rows(const T* base, int64_t n, int64_t stride, int64_t bytes) {
  for (int64_t o = 0; o < n; ++o) {
    const char* p = reinterpret_cast<const char*>(base + o * stride);
    for (int64_t c = 0; c < bytes; c += 64) {
      if constexpr (Level == 1) {
        _mm_prefetch(p + c, _MM_HINT_T0);
      } else {
        _mm_prefetch(p + c, _MM_HINT_T1);
      }
    }
  }
}

// P.V of HP heads over one task's context: each V row read once, the HP * CH accumulators in
// registers; out[j] = sum_t p[j][t] * V[t] / denominators (inv[j]), stored over the head's q.
template <int CH, int HP, typename T>
PG_AVX512 inline void pv_pass(const float* p, int64_t padded, const float* inv, const T* vc,
                              const int64_t* at, int64_t length, T* qh0, int64_t d) {
  __m512 out[HP][CH];
#pragma GCC unroll 8
  for (int j = 0; j < HP; ++j) {
#pragma GCC unroll 8
    for (int c = 0; c < CH; ++c) out[j][c] = _mm512_setzero_ps();
  }
  for (int64_t t = 0; t < length; ++t) {
    const T* vt = vc + at[t];
    __m512 pj[HP];
#pragma GCC unroll 8
    for (int j = 0; j < HP; ++j) pj[j] = _mm512_set1_ps(p[j * padded + t]);
#pragma GCC unroll 8
    for (int c = 0; c < CH; ++c) {
      const __m512 v = load16f(vt + c * 16);
#pragma GCC unroll 8
      for (int j = 0; j < HP; ++j) out[j][c] = _mm512_fmadd_ps(pj[j], v, out[j][c]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < HP; ++j) {
    T* qh = qh0 + j * d;  // the head's output (its q is no longer needed)
    const __m512 iv = _mm512_set1_ps(inv[j]);
#pragma GCC unroll 8
    for (int c = 0; c < CH; ++c) {
      const __m512 o = _mm512_mul_ps(out[j][c], iv);
      store8f(qh + c * 16, _mm512_castps512_ps256(o));
      store8f(qh + c * 16 + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(o), 1)));
    }
  }
}

// attend_rows on 16 lanes for D = 16 * CH: tasks [begin, end), each a row and ``span`` of its
// KV heads (all of them when there are rows enough for the threads: a block's slot rows are
// then read whole, one forward stream), as one at::parallel_for chunk (a function of its own:
// the lambda would not take the target).
template <int CH, typename T>
PG_AVX512 void attend_tasks_avx512(int64_t begin, int64_t end, T* q_all, const T* kc,
                                   const T* vc, const int32_t* tables, const int32_t* len_p,
                                   int64_t max_blocks, int64_t block_size, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t span, float sc,
                                   int64_t padded) {
  constexpr int64_t d = 16 * CH;
  constexpr int kMaxHeads = std::max(1, std::min(4, 24 / CH));  // P.V heads a pass
  const int64_t row = num_kv_heads * d;  // values per cache slot
  const int64_t group = num_heads / num_kv_heads;
  const int64_t heads = span * group;  // query heads a task
  const int64_t span_bytes = span * d * static_cast<int64_t>(sizeof(T));
  const int64_t tasks_a_row = num_kv_heads / span;
  std::vector<float> scores(heads * padded);
  std::vector<float> qf(heads * d);
  std::vector<float> inv(heads);
  std::vector<T> zeros(row, T(0.0f));  // the K row of the padding past a context's end
  std::vector<int64_t> at(padded);  // a token's slot row in the caches (offset)
  const __m512 scv = _mm512_set1_ps(sc);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / tasks_a_row;
    const int64_t g0 = task % tasks_a_row * span;  // the task's first KV head
    const int64_t length = len_p[b];
    const int32_t* table = tables + b * max_blocks;
    T* q0 = q_all + b * num_heads * d + g0 * group * d;  // the task's first query head
    for (int64_t i = 0; i < heads * d; ++i) qf[i] = to_f32(q0[i]);
    // each token's slot row, block by block through the table: no division a token (an idiv
    // cost more than the token's arithmetic)
    for (int64_t t0 = 0, blk = 0; t0 < length; t0 += block_size, ++blk) {
      const int64_t base = static_cast<int64_t>(table[blk]) * block_size * row + g0 * d;
      const int64_t m = std::min(block_size, length - t0);
      for (int64_t o = 0; o < m; ++o) at[t0 + o] = base + o * row;
    }
    prefetch_rows<1>(kc + at[0], std::min<int64_t>(16, length), row, span_bytes);
    // scores, 16 tokens a step: each token's CH partial products summed in registers, the 16
    // sums reduced together (sum16x16)
    for (int64_t t0 = 0; t0 < length; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, length - t0);
      const T* krow[16];
      for (int64_t o = 0; o < 16; ++o) krow[o] = o < n ? kc + at[t0 + o] : zeros.data();
      for (int64_t o = 0; o < 16; ++o) {  // the next step's K rows, this step's V rows
        const int64_t t = t0 + 16 + o;
        if (t < length) prefetch_rows<1>(kc + at[t], 1, row, span_bytes);
        if (o < n) prefetch_rows<2>(vc + at[t0 + o], 1, row, span_bytes);
      }
      for (int64_t h = 0; h < heads; ++h) {
        const float* qh = qf.data() + h * d;
        const int64_t koff = h / group * d;  // the head's KV head within the task's span
        __m512 qv[CH];
#pragma GCC unroll 8
        for (int c = 0; c < CH; ++c) qv[c] = _mm512_loadu_ps(qh + c * 16);
        __m512 acc[16];
#pragma GCC unroll 16
        for (int o = 0; o < 16; ++o) {
          const T* k = krow[o] + koff;
          __m512 a = _mm512_mul_ps(qv[0], load16f(k));
#pragma GCC unroll 8
          for (int c = 1; c < CH; ++c) a = _mm512_fmadd_ps(qv[c], load16f(k + c * 16), a);
          acc[o] = a;
        }
        _mm512_storeu_ps(scores.data() + h * padded + t0, _mm512_mul_ps(sum16x16(acc), scv));
      }
    }
    // softmax numerators exp(score - max) and their sum, 16 lanes at a time (the padding
    // past ``length`` masked out)
    const int64_t steps = (length + 15) / 16;
    const int rest = static_cast<int>(length - (steps - 1) * 16);
    const __mmask16 tail = static_cast<__mmask16>(rest == 16 ? 0xFFFF : (1u << rest) - 1);
    for (int64_t h = 0; h < heads; ++h) {
      float* sh = scores.data() + h * padded;
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int64_t i = 0; i < steps; ++i) {
        const __mmask16 m = i == steps - 1 ? tail : static_cast<__mmask16>(0xFFFF);
        mx = _mm512_mask_max_ps(mx, m, mx, _mm512_loadu_ps(sh + i * 16));
      }
      const __m512 mxv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t i = 0; i < steps; ++i) {
        const __mmask16 m = i == steps - 1 ? tail : static_cast<__mmask16>(0xFFFF);
        const __m512 e =
            _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + i * 16), mxv)));
        _mm512_storeu_ps(sh + i * 16, e);
        sum = _mm512_add_ps(sum, e);
      }
      inv[h] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    // P.V: a KV head's query heads in passes of up to kMaxHeads
    for (int64_t g = 0; g < span; ++g) {
      const T* vg = vc + g * d;
      for (int64_t j0 = 0; j0 < group; j0 += kMaxHeads) {
        const int64_t h = g * group + j0;
        const float* p = scores.data() + h * padded;
        T* out = q0 + h * d;
        switch (std::min<int64_t>(kMaxHeads, group - j0)) {
          case 1:
            pv_pass<CH, 1>(p, padded, &inv[h], vg, at.data(), length, out, d);
            break;
          case 2:
            pv_pass<CH, std::min(2, kMaxHeads)>(p, padded, &inv[h], vg, at.data(), length, out,
                                                 d);
            break;
          case 3:
            pv_pass<CH, std::min(3, kMaxHeads)>(p, padded, &inv[h], vg, at.data(), length, out,
                                                 d);
            break;
          default:
            pv_pass<CH, kMaxHeads>(p, padded, &inv[h], vg, at.data(), length, out, d);
        }
      }
    }
  }
}

template <int CH, typename T>
void attend_rows_avx512(T* q_all, const T* kc, const T* vc, const int32_t* tables,
                        const int32_t* len_p, int64_t batch, int64_t max_blocks,
                        int64_t block_size, int64_t num_heads, int64_t num_kv_heads, float sc) {
  int64_t longest = 1;
  for (int64_t b = 0; b < batch; ++b) longest = std::max<int64_t>(longest, len_p[b]);
  const int64_t padded = (longest + 15) / 16 * 16;
  // whole rows a task when every thread gets several; else a (row, KV head) a task
  const int64_t span = batch >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t tasks = batch * (num_kv_heads / span);
  at::parallel_for(0, tasks, attention_grain(len_p, batch, num_kv_heads, tasks),
                   [&](int64_t begin, int64_t end) {
    attend_tasks_avx512<CH>(begin, end, q_all, kc, vc, tables, len_p, max_blocks, block_size,
                            num_heads, num_kv_heads, span, sc, padded);
  });
}

// Which decode-attention kernel runs: "avx512" where the CPU has AVX512F/DQ/BW/VL, the head size
// is 32, 64, 96 or 128 and PREFIXGATE_CPU_EXT_AVX512 is not "0" (read at each call: how the tests
// and the op benchmark reach the AVX2 kernel on such a CPU), else "avx2".
bool avx512_attention(int64_t d) {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  const char* env = std::getenv("PREFIXGATE_CPU_EXT_AVX512");
  return has && (d == 32 || d == 64 || d == 96 || d == 128) &&
         !(env != nullptr && std::string(env) == "0");
}

// Decode tokens, one per sequence: rotary_cache (rotary on q and k, k and v written to the
// paged caches at each row's slot), then attention of each row's query heads over its own
// whole context (after every row's write, as reshape_and_cache then the attention).
// qkv [B, (Hq + 2 Hkv) D]; positions [B] int64; cos_sin [max_pos, D] fp32; caches
// [N, S, Hkv, D] contiguous (qkv's dtype: fp32 or bf16); block_table [B, max_blocks] int32;
// context_len [B] int32; slot [B] int64.
at::Tensor decode_attention(const at::Tensor& qkv, const at::Tensor& positions,
                            const at::Tensor& cos_sin, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            const at::Tensor& context_len, const at::Tensor& slot,
                            int64_t num_heads, int64_t num_kv_heads, double scale) {
  TORCH_CHECK(block_table.scalar_type() == at::kInt && context_len.scalar_type() == at::kInt,
              "decode_attention: int64 positions/slot, int32 block table/context length");
  const int64_t d = k_cache.size(3);
  const int64_t block_size = k_cache.size(1);
  const int64_t batch = qkv.dim() == 2 ? qkv.size(0) : -1;
  TORCH_CHECK(context_len.numel() == batch && block_table.dim() == 2 &&
                  block_table.size(0) == batch && positions.numel() == batch &&
                  slot.numel() == batch,
              "decode_attention: one position, slot, context length and block table a row");
  at::Tensor bt = block_table.contiguous();
  at::Tensor lc = context_len.contiguous();
  const int32_t* len_p = lc.data_ptr<int32_t>();
  const int64_t max_blocks = bt.size(1);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(len_p[b] >= 1 && (len_p[b] - 1) / block_size < max_blocks,
                "decode_attention: context length past the block table");
  }
  // rotated q lives in out until each head overwrites its own
  at::Tensor out = rotary_cache(qkv, positions, cos_sin, k_cache, v_cache, slot, num_heads,
                                num_kv_heads);
  const float sc = static_cast<float>(scale);
  const int32_t* tables = bt.data_ptr<int32_t>();
  if (avx512_attention(d)) {
    auto wide = [&](auto tag, auto ch) {
      using T = decltype(tag);
      attend_rows_avx512<decltype(ch)::value>(
          out.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), tables, len_p, batch,
          max_blocks, block_size, num_heads, num_kv_heads, sc);
    };
    auto by_width = [&](auto tag) {
      switch (d) {
        case 32: wide(tag, std::integral_constant<int, 2>{}); break;
        case 64: wide(tag, std::integral_constant<int, 4>{}); break;
        case 96: wide(tag, std::integral_constant<int, 6>{}); break;
        default: wide(tag, std::integral_constant<int, 8>{}); break;
      }
    };
    if (out.scalar_type() == at::kFloat) {
      by_width(float{});
    } else {
      by_width(bf16{});
    }
  } else if (out.scalar_type() == at::kFloat) {
    attend_rows(out.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                tables, len_p, batch, max_blocks, block_size, num_heads, num_kv_heads, d, sc);
  } else {
    attend_rows(out.data_ptr<bf16>(), k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(), tables,
                len_p, batch, max_blocks, block_size, num_heads, num_kv_heads, d, sc);
  }
  return out;
}

// ---- AVX-512 causal prefill attention over the paged cache (runtime dispatch) ---------------
// torch_ref.paged_attention_prefill without the gathered copy of K/V: a task is one sequence's
// KV head and up to kPrefillRows of its query rows (M positions x the G = Hq / Hkv heads sharing
// the KV head, row r = position r / G, head r % G), held as the 16 lanes of up to 3 registers.
// The task walks its sequence's keys in tiles of kPrefillTile straight from the cache through
// its block table, up to its last query's position (tiles past the causal diagonal are never
// read), with an online softmax (flash attention: a running max and sum a row, the partial
// output rescaled when the max grows). Rows as lanes make the softmax lane-wise (no horizontal
// sums) and the causal mask one compare a key. Q.K^T: 8 keys x RC row registers of FMAs a
// head-dim column (the key's value broadcast, Q transposed once a task); P.V: 8 head-dim
// columns x RC row registers a key (V's value broadcast, the output transposed, [D][rows]). fp32
// or bf16 q / caches / output (fp32 K/V read in place, bf16 widened to fp32 a tile at a time, the
// next tile prefetched); everything else fp32.
// Tasks are taken largest first from a shared counter by each of torch's threads (causal work
// grows with the position). Needs AVX512F/DQ/BW/VL, D a multiple of 16 up to 256, G <= 48
// (prefill_attention_supported).
constexpr int64_t kPrefillTile = 32;   // keys a tile
constexpr int64_t kPrefillRows = 48;   // query rows (positions x heads) a task at most: 3 zmm
constexpr int kPrefillKeys = 8;        // keys a Q.K^T register block
constexpr int kPrefillCols = 8;        // head-dim columns a P.V register block
constexpr int64_t kPrefillMaxDim = 256;

struct PrefillTask {
  int64_t b, g, i0, m, cost;  // sequence, KV head, first query index in the chunk, positions
};

template <typename T>
struct PrefillArgs {
  const T* q;  // [T, Hq, D]
  T* out;      // [T, Hq, D]
  const T* kc;
  const T* vc;
  const int32_t* tables;
  const int32_t* qsl;  // [B + 1]
  const int32_t* ctx;  // [B]
  int64_t max_blocks, block_size, num_heads, num_kv_heads, d;
  float sc;
};

// A worker's buffers (fp32): Q^T [D][48], O^T [D][48], scores / probabilities [32][48], the
// tile's K and V widened from bf16 [32][D], a zero row for keys past the tile's end.
struct PrefillScratch {
  std::vector<float> qt, ot, st, kf, vf, zeros;
  explicit PrefillScratch(int64_t d)
      : qt(d * kPrefillRows), ot(d * kPrefillRows), st(kPrefillTile * kPrefillRows),
        kf(kPrefillTile * d), vf(kPrefillTile * d), zeros(d, 0.0f) {}
};

// 16 rows of 16 floats transposed in registers: r[i] lane j -> r[j] lane i (unpack within
// 128-bit lanes, then 128-bit lanes shuffled twice).
PG_AVX512 inline void transpose16x16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xDD);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
  }
}

PG_AVX512 inline void store16f(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
PG_AVX512 inline void store16f(bf16* p, __m512 v) {
  store8f(p, _mm512_castps512_ps256(v));
  store8f(p + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// The cache offsets of keys [first, first + n) of a sequence's KV head (its table walked
// block by block: no division a key).
inline void prefill_offsets(const int32_t* table, int64_t block_size, int64_t row, int64_t head,
                            int64_t first, int64_t n, int64_t* at) {
  int64_t blk = first / block_size, o = first % block_size;
  for (int64_t k = 0; k < n; ++k) {
    at[k] = (static_cast<int64_t>(table[blk]) * block_size + o) * row + head;
    if (++o == block_size) {
      o = 0;
      ++blk;
    }
  }
}

template <int RC, typename T>
PG_AVX512 void prefill_task_avx512(const PrefillArgs<T>& a, const PrefillTask& t,
                                   PrefillScratch& s) {
  constexpr int64_t rp = RC * 16;  // row lanes
  const int64_t d = a.d;
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t row = a.num_kv_heads * d;  // values per cache slot
  const int64_t q_first = a.qsl[t.b];
  const int64_t q_len = a.qsl[t.b + 1] - q_first;
  const int64_t p0 = a.ctx[t.b] - q_len + t.i0;  // the task's first query's position
  const int64_t rows = t.m * group;
  const int32_t* table = a.tables + t.b * a.max_blocks;
  const T* kc = a.kc;
  const T* vc = a.vc;
  float* qt = s.qt.data();
  float* ot = s.ot.data();
  float* st = s.st.data();
  float* kf = s.kf.data();
  float* vf = s.vf.data();
  // each lane's position (padding lanes: the last row's) and Q^T, 16 rows x 16 columns a
  // register transpose (padding lanes: zero queries; their results are never stored)
  alignas(64) int32_t pos[rp];
  const T* qrow[rp];
  for (int64_t r = 0; r < rp; ++r) {
    const int64_t rr = std::min(r, rows - 1);
    const int64_t i = rr / group, j = rr % group;
    pos[r] = static_cast<int32_t>(p0 + i);
    qrow[r] = r < rows ? a.q + ((q_first + t.i0 + i) * a.num_heads + t.g * group + j) * d
                       : nullptr;
  }
  for (int c = 0; c < RC; ++c) {
    for (int64_t e0 = 0; e0 < d; e0 += 16) {
      __m512 blk[16];
      for (int r = 0; r < 16; ++r) {
        const T* qr = qrow[c * 16 + r];
        blk[r] = qr != nullptr ? load16f(qr + e0) : _mm512_setzero_ps();
      }
      transpose16x16(blk);
      for (int e = 0; e < 16; ++e) _mm512_storeu_ps(qt + (e0 + e) * rp + c * 16, blk[e]);
    }
  }
  std::fill(ot, ot + d * rp, 0.0f);
  __m512i posv[RC];
  __m512 mx[RC], lsum[RC], alpha[RC];
  for (int c = 0; c < RC; ++c) {
    posv[c] = _mm512_load_si512(pos + c * 16);
    mx[c] = _mm512_set1_ps(-FLT_MAX);  // finite: the first tile's rescale is exp(-huge) = 0
    lsum[c] = _mm512_setzero_ps();
  }
  const __m512 scv = _mm512_set1_ps(a.sc);
  const int64_t n_keys = p0 + t.m;  // keys 0 .. the last query's position
  const float* kr[kPrefillTile];
  const float* vr[kPrefillTile];
  int64_t offsets[2][kPrefillTile];  // this tile's and the next's slot rows (offsets)
  int64_t* at = offsets[0];
  int64_t* next_at = offsets[1];
  prefill_offsets(table, a.block_size, row, t.g * d, 0, std::min(kPrefillTile, n_keys), at);
  for (int64_t kt0 = 0; kt0 < n_keys; kt0 += kPrefillTile) {
    const int64_t nk = std::min(kPrefillTile, n_keys - kt0);
    const int64_t nk_pad = (nk + kPrefillKeys - 1) / kPrefillKeys * kPrefillKeys;
    // the tile's K and V rows: fp32 read in place, bf16 widened to fp32 rows side by side; the
    // next tile's rows prefetched into L1 meanwhile (blocks lie anywhere in the pool: the
    // hardware's prefetcher sees a new stream every block; a profile showed the reads waiting)
    const int64_t nk_next = std::min(kPrefillTile, n_keys - kt0 - nk);
    prefill_offsets(table, a.block_size, row, t.g * d, kt0 + nk, nk_next, next_at);
    for (int64_t k = 0; k < nk_next; ++k) {
      prefetch_rows<1>(kc + next_at[k], 1, 0, d * static_cast<int64_t>(sizeof(T)));
      prefetch_rows<1>(vc + next_at[k], 1, 0, d * static_cast<int64_t>(sizeof(T)));
    }
    for (int64_t k = 0; k < nk; ++k) {
      if constexpr (std::is_same_v<T, float>) {
        kr[k] = kc + at[k];
        vr[k] = vc + at[k];
      } else {
        const T* __restrict ks = kc + at[k];  // locals: no reload of a.kc after each store
        const T* __restrict vs = vc + at[k];
        float* __restrict kd = kf + k * d;
        float* __restrict vd = vf + k * d;
        for (int64_t e = 0; e < d; e += 16) {
          _mm512_storeu_ps(kd + e, load16f(ks + e));
          _mm512_storeu_ps(vd + e, load16f(vs + e));
        }
        kr[k] = kd;
        vr[k] = vd;
      }
    }
    std::swap(at, next_at);
    for (int64_t k = nk; k < nk_pad; ++k) kr[k] = vr[k] = s.zeros.data();
    // scores S^T [key][row lanes] (unscaled)
    for (int64_t k0 = 0; k0 < nk_pad; k0 += kPrefillKeys) {
      __m512 acc[kPrefillKeys][RC];
#pragma GCC unroll 8
      for (int k = 0; k < kPrefillKeys; ++k) {
#pragma GCC unroll 4
        for (int c = 0; c < RC; ++c) acc[k][c] = _mm512_setzero_ps();
      }
      const float* kp[kPrefillKeys];
      for (int k = 0; k < kPrefillKeys; ++k) kp[k] = kr[k0 + k];
      for (int64_t e = 0; e < d; ++e) {
        __m512 qv[RC];
#pragma GCC unroll 4
        for (int c = 0; c < RC; ++c) qv[c] = _mm512_loadu_ps(qt + e * rp + c * 16);
#pragma GCC unroll 8
        for (int k = 0; k < kPrefillKeys; ++k) {
          const __m512 kb = _mm512_set1_ps(kp[k][e]);
#pragma GCC unroll 4
          for (int c = 0; c < RC; ++c) acc[k][c] = _mm512_fmadd_ps(kb, qv[c], acc[k][c]);
        }
      }
#pragma GCC unroll 8
      for (int k = 0; k < kPrefillKeys; ++k) {
#pragma GCC unroll 4
        for (int c = 0; c < RC; ++c) _mm512_storeu_ps(st + (k0 + k) * rp + c * 16, acc[k][c]);
      }
    }
    // online softmax, lane-wise; keys past a lane's position masked out (diagonal tiles only)
    const bool diag = kt0 + nk - 1 > p0;
    for (int c = 0; c < RC; ++c) {
      __m512 mt = _mm512_set1_ps(-FLT_MAX);
      for (int64_t k = 0; k < nk; ++k) {
        const __m512 v = _mm512_loadu_ps(st + k * rp + c * 16);
        const __mmask16 vis =
            diag ? _mm512_cmp_epi32_mask(posv[c], _mm512_set1_epi32(static_cast<int32_t>(kt0 + k)),
                                         _MM_CMPINT_NLT)
                 : static_cast<__mmask16>(0xFFFF);
        mt = _mm512_mask_max_ps(mt, vis, mt, v);
      }
      const __m512 mnew = _mm512_max_ps(mx[c], mt);
      alpha[c] = exp16(_mm512_mul_ps(_mm512_sub_ps(mx[c], mnew), scv));
      const __m512 shift = _mm512_mul_ps(mnew, _mm512_set1_ps(-a.sc));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = 0; k < nk; ++k) {
        const __m512 v = _mm512_loadu_ps(st + k * rp + c * 16);
        __m512 p = exp16(_mm512_fmadd_ps(v, scv, shift));
        if (diag) {
          const __mmask16 vis = _mm512_cmp_epi32_mask(
              posv[c], _mm512_set1_epi32(static_cast<int32_t>(kt0 + k)), _MM_CMPINT_NLT);
          p = _mm512_maskz_mov_ps(vis, p);
        }
        _mm512_storeu_ps(st + k * rp + c * 16, p);
        sum = _mm512_add_ps(sum, p);
      }
      lsum[c] = _mm512_fmadd_ps(lsum[c], alpha[c], sum);
      mx[c] = mnew;
    }
    // O^T = O^T * alpha + V^T P^T, 8 head-dim columns at a time
    for (int64_t e0 = 0; e0 < d; e0 += kPrefillCols) {
      __m512 acc[kPrefillCols][RC];
#pragma GCC unroll 8
      for (int e = 0; e < kPrefillCols; ++e) {
#pragma GCC unroll 4
        for (int c = 0; c < RC; ++c) {
          acc[e][c] = _mm512_mul_ps(_mm512_loadu_ps(ot + (e0 + e) * rp + c * 16), alpha[c]);
        }
      }
      for (int64_t k = 0; k < nk; ++k) {
        __m512 pv[RC];
#pragma GCC unroll 4
        for (int c = 0; c < RC; ++c) pv[c] = _mm512_loadu_ps(st + k * rp + c * 16);
        const float* v = vr[k] + e0;
#pragma GCC unroll 8
        for (int e = 0; e < kPrefillCols; ++e) {
          const __m512 vb = _mm512_set1_ps(v[e]);
#pragma GCC unroll 4
          for (int c = 0; c < RC; ++c) acc[e][c] = _mm512_fmadd_ps(vb, pv[c], acc[e][c]);
        }
      }
#pragma GCC unroll 8
      for (int e = 0; e < kPrefillCols; ++e) {
#pragma GCC unroll 4
        for (int c = 0; c < RC; ++c) _mm512_storeu_ps(ot + (e0 + e) * rp + c * 16, acc[e][c]);
      }
    }
  }
  // out = O / sum, transposed back to [token, head, D] 16 rows x 16 columns at a time
  for (int c = 0; c < RC; ++c) {
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), lsum[c]);
    for (int64_t e0 = 0; e0 < d; e0 += 16) {
      __m512 blk[16];
      for (int e = 0; e < 16; ++e) {
        blk[e] = _mm512_mul_ps(_mm512_loadu_ps(ot + (e0 + e) * rp + c * 16), inv);
      }
      transpose16x16(blk);
      for (int r = 0; r < 16 && c * 16 + r < rows; ++r) {
        const int64_t rr = c * 16 + r;
        const int64_t i = rr / group, j = rr % group;
        store16f(a.out + ((q_first + t.i0 + i) * a.num_heads + t.g * group + j) * d + e0, blk[r]);
      }
    }
  }
}

// One thread's share: tasks taken from ``next`` (largest first) until none is left.
template <typename T>
PG_AVX512 void prefill_worker_avx512(const PrefillArgs<T>& a, const std::vector<PrefillTask>& tasks,
                                     std::atomic<int64_t>& next) {
  PrefillScratch s(a.d);
  const int64_t group = a.num_heads / a.num_kv_heads;
  for (int64_t i = next.fetch_add(1); i < static_cast<int64_t>(tasks.size());
       i = next.fetch_add(1)) {
    const PrefillTask& t = tasks[i];
    switch ((t.m * group + 15) / 16) {
      case 1: prefill_task_avx512<1>(a, t, s); break;
      case 2: prefill_task_avx512<2>(a, t, s); break;
      default: prefill_task_avx512<3>(a, t, s); break;
    }
  }
}

// Whether prefill_attention runs here for head size ``head_dim`` and ``group`` query heads a KV
// head: a CPU with AVX512F/DQ/BW/VL, PREFIXGATE_CPU_EXT_AVX512 not "0" (read at each call), D a
// multiple of 16 up to 256, 1 <= G <= 48.
bool prefill_attention_supported(int64_t head_dim, int64_t group) {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  const char* env = std::getenv("PREFIXGATE_CPU_EXT_AVX512");
  return has && head_dim % 16 == 0 && head_dim >= 16 && head_dim <= kPrefillMaxDim &&
         group >= 1 && group <= kPrefillRows && !(env != nullptr && std::string(env) == "0");
}

// Below this many (query position x key x KV head) products a call runs on the calling thread.
constexpr int64_t kPrefillSerialWork = 1 << 15;

// Causal attention of a varlen batch of query chunks over paged K/V: torch_ref's
// paged_attention_prefill. q [T, Hq, D]; caches [N, S, Hkv, D] contiguous (q's dtype: fp32 or
// bf16); block_tables [B, max_blocks] int32; query_start_loc [B + 1] int32 (from 0);
// context_lens [B] int32 (each >= its chunk's length). Returns [T, Hq, D] in q's dtype.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                             double scale) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k_cache.scalar_type() == dtype &&
                  v_cache.scalar_type() == dtype,
              "prefill_attention: float32 or bfloat16 q and caches (one dtype)");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "prefill_attention: contiguous caches [N, S, Hkv, D] of one shape");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  context_lens.scalar_type() == at::kInt,
              "prefill_attention: int32 block tables, query_start_loc and context_lens");
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2), d = k_cache.size(3);
  TORCH_CHECK(q.dim() == 3 && q.size(2) == d && q.size(1) % num_kv_heads == 0,
              "prefill_attention: q [T, Hq, D], Hq a multiple of the cache's KV heads");
  const int64_t num_heads = q.size(1);
  TORCH_CHECK(prefill_attention_supported(d, num_heads / num_kv_heads),
              "prefill_attention: no AVX-512 here, or a head size / group it does not take");
  const int64_t batch = context_lens.numel();
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch &&
                  query_start_loc.numel() == batch + 1,
              "prefill_attention: one block table and context length a sequence, B + 1 starts");
  at::Tensor qc = q.contiguous();
  at::Tensor bt = block_tables.contiguous();
  at::Tensor qs = query_start_loc.contiguous();
  at::Tensor lc = context_lens.contiguous();
  const int32_t* qsl = qs.data_ptr<int32_t>();
  const int32_t* ctx = lc.data_ptr<int32_t>();
  const int32_t* tables = bt.data_ptr<int32_t>();
  const int64_t max_blocks = bt.size(1);
  const int64_t tokens = q.size(0);
  TORCH_CHECK(qsl[0] == 0 && qsl[batch] == tokens,
              "prefill_attention: query_start_loc from 0 to the token count");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t per_task = std::max<int64_t>(1, kPrefillRows / group);  // positions a task
  std::vector<PrefillTask> tasks;
  int64_t work = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    TORCH_CHECK(q_len >= 0 && ctx[b] >= q_len && ctx[b] >= 1,
                "prefill_attention: a chunk longer than its context, or an empty context");
    const int64_t used = (ctx[b] + block_size - 1) / block_size;
    TORCH_CHECK(used <= max_blocks, "prefill_attention: context length past the block table");
    for (int64_t i = 0; i < used; ++i) {
      TORCH_CHECK(tables[b * max_blocks + i] >= 0 && tables[b * max_blocks + i] < num_blocks,
                  "prefill_attention: a block id outside the cache");
    }
    const int64_t p0 = ctx[b] - q_len;
    for (int64_t i0 = 0; i0 < q_len; i0 += per_task) {
      const int64_t m = std::min(per_task, q_len - i0);
      const int64_t cost = (p0 + i0 + m) * m;
      for (int64_t g = 0; g < num_kv_heads; ++g) tasks.push_back({b, g, i0, m, cost});
      work += cost * num_kv_heads;
    }
  }
  // the costliest sequences first; within one, a KV head's tasks together (its K/V stay in
  // the caches from one task to the next), costliest first
  std::vector<int64_t> seq_cost(batch, 0);
  for (const PrefillTask& t : tasks) seq_cost[t.b] += t.cost;
  std::stable_sort(tasks.begin(), tasks.end(), [&](const PrefillTask& x, const PrefillTask& y) {
    if (x.b != y.b) {
      return seq_cost[x.b] != seq_cost[y.b] ? seq_cost[x.b] > seq_cost[y.b] : x.b < y.b;
    }
    if (x.g != y.g) return x.g < y.g;
    return x.cost > y.cost;
  });
  at::Tensor out = at::empty(qc.sizes(), qc.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const PrefillArgs<T> args{qc.data_ptr<T>(),   out.data_ptr<T>(), k_cache.data_ptr<T>(),
                              v_cache.data_ptr<T>(), tables,          qsl,
                              ctx,                  max_blocks,        block_size,
                              num_heads,            num_kv_heads,      d,
                              static_cast<float>(scale)};
    std::atomic<int64_t> next{0};
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks.size());
    if (work < kPrefillSerialWork || threads <= 1) {
      prefill_worker_avx512(args, tasks, next);
      return;
    }
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      prefill_worker_avx512(args, tasks, next);
    });
  };
  if (tasks.empty()) return out;
  if (dtype == at::kFloat) {
    run(float{});
  } else {
    run(bf16{});
  }
  return out;
}

// ---- AVX-512 GEMM of a few rows on oneDNN's 64-wide panels (runtime dispatch) ---------------
// y [M, N] = x [M, K] . W^T (+ bias) for the row counts of a decode batch, reading oneDNN's packed
// fp32 weight in place (engine/models/cpu_linear.onednn_panels: panel p holds output columns
// 64p..64p+63, input column k's 64 weights contiguous). A register block is 6 rows x 64 columns
// (24 zmm accumulators, 4 for the weights' row, 1 for x broadcast): 24 FMAs per 4 weight loads
// and 6 broadcasts. A panel's input columns go in chunks of kGemmKc (its 16 KiB of weight stay in
// L1 while every row block of the chunk reads them; partial sums wait in a per-panel buffer), and
// the chunk's row blocks prefetch the weight kGemmPrefetch columns ahead, each a share of its
// lines (the hardware's prefetcher stops at each 4 KiB page; one block prefetching it all put the
// memory reads in a burst, docs/cpu-performance.md). Threads split the panels. Sums run in input
// column order, one FMA each, so a result differs from oneDNN's in the last bits only.
constexpr int64_t kGemmW = 64;          // oneDNN's panel width on AVX-512
constexpr int kGemmR = 6;               // rows per register block
constexpr int64_t kGemmKc = 64;         // input columns per chunk
constexpr int64_t kGemmPrefetch = 256;  // input columns ahead a chunk's row blocks prefetch
constexpr int64_t kGemmMaxRows = 64;    // rows the per-panel buffer holds (gemm_panels' bound)

// One register block of R rows over input columns [k0, k1) of one panel: accumulators from
// ``partial`` (zero when ``first``), back to it, or (``last``) plus the bias into y's valid
// columns (``valid`` of the panel's 64).
template <int R>
PG_AVX512 inline void gemm_block(const float* __restrict w, int64_t k0, int64_t k1,
                                 const float* __restrict x, int64_t ldx, float* __restrict partial,
                                 bool first, bool last, const float* bias, float* y, int64_t ldy,
                                 int64_t valid, const char* pf, int64_t pf_lines) {
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < 4; ++j) {
      acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(partial + i * kGemmW + 16 * j);
    }
  }
  // this block's share of the prefetch (pf_lines cache lines from pf), a few lines an iteration
  const int64_t iters = k1 - k0;
  const int64_t per = iters > 0 ? (pf_lines + iters - 1) / iters : 0;
  int64_t line = 0;
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * kGemmW;
    for (int64_t end = std::min(pf_lines, line + per); line < end; ++line) {
      _mm_prefetch(pf + 64 * line, _MM_HINT_T1);
    }
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
    const __m512 w2 = _mm512_loadu_ps(wk + 32), w3 = _mm512_loadu_ps(wk + 48);
    for (int i = 0; i < R; ++i) {
      const __m512 xb = _mm512_set1_ps(x[i * ldx + k]);
      acc[i][0] = _mm512_fmadd_ps(w0, xb, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(w1, xb, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(w2, xb, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(w3, xb, acc[i][3]);
    }
  }
  if (!last) {
    for (int i = 0; i < R; ++i) {
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(partial + i * kGemmW + 16 * j, acc[i][j]);
    }
    return;
  }
  for (int j = 0; j < 4; ++j) {
    const int64_t n = std::min<int64_t>(16, valid - 16 * j);
    if (n <= 0) break;
    const __mmask16 m = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(m, bias + 16 * j) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) {
      _mm512_mask_storeu_ps(y + i * ldy + 16 * j, m, _mm512_add_ps(acc[i][j], b));
    }
  }
}

// The last 1-5 rows of a chunk (fewer than a register block), as one block of that many.
PG_AVX512 inline void gemm_tail(int64_t n, const float* w, int64_t k0, int64_t k1, const float* x,
                                int64_t ldx, float* partial, bool first, bool last,
                                const float* bias, float* y, int64_t ldy, int64_t valid,
                                const char* pf, int64_t pf_lines) {
  switch (n) {
    case 1: gemm_block<1>(w, k0, k1, x, ldx, partial, first, last, bias, y, ldy, valid, pf, pf_lines); break;
    case 2: gemm_block<2>(w, k0, k1, x, ldx, partial, first, last, bias, y, ldy, valid, pf, pf_lines); break;
    case 3: gemm_block<3>(w, k0, k1, x, ldx, partial, first, last, bias, y, ldy, valid, pf, pf_lines); break;
    case 4: gemm_block<4>(w, k0, k1, x, ldx, partial, first, last, bias, y, ldy, valid, pf, pf_lines); break;
    default: gemm_block<5>(w, k0, k1, x, ldx, partial, first, last, bias, y, ldy, valid, pf, pf_lines); break;
  }
}

// Every row of x through one panel (w: its K x 64 weights; bias and y offset to its columns).
// The weight kGemmPrefetch input columns ahead of each chunk is prefetched, its lines shared
// out over every row block of the chunk, so that the memory reads spread over the chunk's
// whole compute instead of coming in a burst while one block runs.
PG_AVX512 void gemm_panel(const float* w, int64_t k_len, const float* x, int64_t rows,
                          const float* bias, float* y, int64_t n_out, int64_t valid) {
  alignas(64) float partial[kGemmMaxRows * kGemmW];
  const int64_t blocks = (rows + kGemmR - 1) / kGemmR;
  for (int64_t k0 = 0; k0 < k_len; k0 += kGemmKc) {
    const int64_t k1 = std::min(k_len, k0 + kGemmKc);
    const bool first = k0 == 0, last = k1 == k_len;
    // the chunk's columns, ahead: 4 cache lines (64 floats) a column
    const char* pf = reinterpret_cast<const char*>(w + (k0 + kGemmPrefetch) * kGemmW);
    const int64_t lines = (k1 - k0) * 4;
    int64_t r = 0, b = 0;
    for (; r + kGemmR <= rows; r += kGemmR, ++b) {
      const int64_t l0 = lines * b / blocks, l1 = lines * (b + 1) / blocks;
      gemm_block<kGemmR>(w, k0, k1, x + r * k_len, k_len, partial + r * kGemmW, first, last, bias,
                         y + r * n_out, n_out, valid, pf + 64 * l0, l1 - l0);
    }
    if (r < rows) {
      const int64_t l0 = lines * b / blocks, l1 = lines * (b + 1) / blocks;
      gemm_tail(rows - r, w, k0, k1, x + r * k_len, k_len, partial + r * kGemmW, first, last, bias,
                y + r * n_out, n_out, valid, pf + 64 * l0, l1 - l0);
    }
  }
}

bool avx512_gemm() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  const char* env = std::getenv("PREFIXGATE_CPU_EXT_AVX512");
  return has && !(env != nullptr && std::string(env) == "0");
}

// x [M, K] fp32 (1 <= M <= 64); packed [P, K, 64] fp32 with strides (S, 64, 1), S >= 64 K (a view
// of oneDNN's packed weight, engine/models/cpu_linear.onednn_panels); bias [N] or none ->
// y [M, N]. Needs AVX512F/DQ/BW/VL (gemm_rows_available).
at::Tensor gemm_panels(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias, int64_t n_out) {
  TORCH_CHECK(avx512_gemm(), "gemm_panels: needs AVX-512 (AVX512F/DQ/BW/VL)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "gemm_panels: float32 tensors only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kGemmW && packed.stride(2) == 1 &&
                  (packed.size(1) == 1 || packed.stride(1) == kGemmW) &&
                  (packed.size(0) == 1 || (packed.stride(0) >= packed.size(1) * kGemmW &&
                                           packed.stride(0) % kGemmW == 0)),
              "gemm_panels: packed must be [P, K, 64] panels, each panel contiguous");
  const int64_t panels = packed.size(0), k_len = packed.size(1);
  const int64_t k_pad = panels == 1 ? k_len : packed.stride(0) / kGemmW;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k_len, "gemm_panels: x must be [M, K] with K ", k_len);
  const int64_t rows = x.size(0);
  TORCH_CHECK(rows >= 1 && rows <= kGemmMaxRows, "gemm_panels: 1 to ", kGemmMaxRows,
              " rows, got ", rows);
  TORCH_CHECK(n_out > (panels - 1) * kGemmW && n_out <= panels * kGemmW, "gemm_panels: n_out ",
              n_out, " does not fit ", panels, " panels of 64");
  at::Tensor xc = x.contiguous();
  at::Tensor bc;
  const float* bias_ptr = bias_data(bias, n_out, bc, "gemm_panels");
  at::Tensor y = at::empty({rows, n_out}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      gemm_panel(wp + p * k_pad * kGemmW, k_len, xp, rows,
                 bias_ptr != nullptr ? bias_ptr + p * kGemmW : nullptr, yp + p * kGemmW, n_out,
                 std::min(kGemmW, n_out - p * kGemmW));
    }
  });
  return y;
}

// Whether gemm_panels runs here: AVX512F/DQ/BW/VL and PREFIXGATE_CPU_EXT_AVX512 not "0".
bool gemm_rows_available() { return avx512_gemm(); }

// oneDNN's linear on its packed weight (torch.ops.mkldnn._linear_pointwise, registered by torch
// itself; called boxed, as its C++ declaration is not among torch's public headers).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(bias.has_value() && bias->defined() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// One linear of a decoder layer at one row, by the kind its module chose, in the order (0..6)
// of cpu_ext.LINEAR_KINDS: fp32 panels (gemv_packed), "mm_t" ([I, O] weight, at::mm /
// at::addmm), "linear" ([O, I], at::linear), int8 panels with fp32 / int16 / int8 activations,
// oneDNN's packed weight.
enum LinearKind : int64_t { kGemv, kMmT, kLinear, kInt8Gemv, kInt8Gemv16, kInt8Gemv8, kOneDNN };

at::Tensor linear_one_row(int64_t kind, const at::Tensor& x, const at::Tensor& w,
                          const c10::optional<at::Tensor>& scale,
                          const c10::optional<at::Tensor>& bias, int64_t n_out) {
  const bool has_bias = bias.has_value() && bias->defined();
  const bool int8 = kind == kInt8Gemv || kind == kInt8Gemv16 || kind == kInt8Gemv8;
  TORCH_CHECK(!int8 || (scale.has_value() && scale->defined()),
              "decode_layer: an int8 linear needs its scale");
  switch (kind) {
    case kGemv:
      return gemv_packed(x, w, bias, n_out);
    case kMmT:
      return has_bias ? at::addmm(*bias, x, w) : at::mm(x, w);
    case kLinear:
      return at::linear(x, w, bias);
    case kInt8Gemv:
      return gemv_int8_packed(x, w, *scale, bias, n_out);
    case kInt8Gemv16:
      return gemv_int8w16_packed(x, w, *scale, bias, n_out);
    case kInt8Gemv8:
      return gemv_int8x8_packed(x, w, *scale, bias, n_out, true);
    case kOneDNN:
      return onednn_linear(x, w, bias);
    default:
      TORCH_CHECK(false, "decode_layer: unknown linear kind ", kind);
  }
}

// One pre-norm decoder layer for one decode token alone, the ops of the fused one-row path in
// the order DecoderLayer.forward runs them (add + RMSNorm, qkv, rotary + KV write + attention,
// o, add + RMSNorm, gate_up, SiLU * mul, down): one call a layer instead of ~8, the same
// results bit for bit. Linears in the order qkv, o, gate_up, down.
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& hidden, const c10::optional<at::Tensor>& residual,
    const at::Tensor& input_norm, const at::Tensor& post_norm, double eps, at::IntArrayRef kinds,
    at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& scales,
    const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef n_outs,
    const at::Tensor& positions, const at::Tensor& cos_sin, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& context_len,
    const at::Tensor& slot, int64_t num_heads, int64_t num_kv_heads, double scale) {
  TORCH_CHECK(kinds.size() == 4 && weights.size() == 4 && scales.size() == 4 &&
                  biases.size() == 4 && n_outs.size() == 4,
              "decode_layer: four linears (qkv, o, gate_up, down)");
  auto linear = [&](size_t i, const at::Tensor& x) {
    return linear_one_row(kinds[i], x, weights[i], scales.get(i), biases.get(i), n_outs[i]);
  };
  auto [h, res] = add_rms_norm(hidden, residual, input_norm, eps);
  const at::Tensor attn = decode_attention(linear(0, h), positions, cos_sin, k_cache, v_cache,
                                           block_table, context_len, slot, num_heads,
                                           num_kv_heads, scale);
  auto [h2, res2] = add_rms_norm(linear(1, attn), res, post_norm, eps);
  return {linear(3, silu_mul(linear(2, h2))), res2};
}

}  // namespace

// Whether bf16 stores use AVX512_BF16's vcvtneps2bf16 (else the AVX2 integer rounding).
bool bf16_native() { return kAvx512Bf16; }

// How many threads an op's at::parallel_for ran on (1024 tasks of grain 1, each noting its
// thread): torch.get_num_threads() when the library was built with OpenMP, 1 without it.
int64_t op_threads() {
  std::vector<std::atomic<int>> seen(std::max(1, at::get_num_threads()));
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) {
    const int t = at::get_thread_num();
    if (t >= 0 && t < static_cast<int>(seen.size())) seen[t].store(1);
  });
  int64_t n = 0;
  for (const auto& s : seen) n += s.load();
  return n;
}

// The decode-attention kernel a call with head size ``head_dim`` takes now: "avx512" or "avx2".
std::string decode_attention_kernel(int64_t head_dim) {
  return avx512_attention(head_dim) ? "avx512" : "avx2";
}

TORCH_LIBRARY(prefixgate_cpu, m) {
  m.def("bf16_native() -> bool", &bf16_native);
  m.def("decode_attention_kernel(int head_dim) -> str", &decode_attention_kernel);
  m.def("op_threads() -> int", &op_threads);
  m.def("gemv_packed(Tensor x, Tensor packed, Tensor? bias, int n_out) -> Tensor");
  m.def("gemm_rows_available() -> bool", &gemm_rows_available);
  m.def("gemm_panels(Tensor x, Tensor packed, Tensor? bias, int n_out) -> Tensor");
  m.def(
      "gemv_int8_packed(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int n_out) -> "
      "Tensor");
  m.def(
      "gemv_int8w16_packed(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int n_out) -> "
      "Tensor");
  m.def(
      "gemv_int8x8_packed(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int n_out, "
      "bool vnni) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def(
      "rotary_cache(Tensor qkv, Tensor positions, Tensor cos_sin, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor slot, int num_heads, int num_kv_heads) -> Tensor");
  m.def(
      "decode_layer(Tensor hidden, Tensor? residual, Tensor input_norm, Tensor post_norm, "
      "float eps, int[] kinds, Tensor[] weights, Tensor?[] scales, Tensor?[] biases, "
      "int[] n_outs, Tensor positions, Tensor cos_sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor block_table, Tensor context_len, Tensor slot, int num_heads, int num_kv_heads, "
      "float scale) -> (Tensor, Tensor)");
  m.def(
      "decode_attention(Tensor qkv, Tensor positions, Tensor cos_sin, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor block_table, Tensor context_len, Tensor slot, int num_heads, "
      "int num_kv_heads, float scale) -> Tensor");
  m.def("prefill_attention_supported(int head_dim, int group) -> bool",
        &prefill_attention_supported);
  m.def(
      "prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixgate_cpu, CPU, m) {
  m.impl("gemv_packed", gemv_packed);
  m.impl("gemm_panels", gemm_panels);
  m.impl("gemv_int8_packed", gemv_int8_packed);
  m.impl("gemv_int8w16_packed", gemv_int8w16_packed);
  m.impl("gemv_int8x8_packed", gemv_int8x8_packed);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("rotary_cache", rotary_cache);
  m.impl("decode_layer", decode_layer);
  m.impl("decode_attention", decode_attention);
  m.impl("prefill_attention", prefill_attention);
}

// A layer whose linears include oneDNN's packed (opaque) weight dispatches on its MkldnnCPU key.
TORCH_LIBRARY_IMPL(prefixgate_cpu, MkldnnCPU, m) { m.impl("decode_layer", decode_layer); }
