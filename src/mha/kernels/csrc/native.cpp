// mha's native attention kernel: exact attention under the whole contract (mha.kernels.Contract),
// in tiles, with float32 accumulation (float64 for float64), forward and backward.
//
//   forward(q, k, v, terms, for_backward)                  -> out (B, H, L, Dv) laid out as q is,
//                                                             row max, row sum (B, H, L)
//   backward(q, k, v, dout, row max, row sum, delta, terms) -> dq, dk, dv, d_slopes
//   paged_forward(q, k_pages, v_pages, block_table, cu_seqlens_q, seqlens_k, terms)
//                                                          -> out (Tq, H, Dv), row max, row sum (Tq, H)
//     (keys and values read in place from a pool of KV-cache pages, 8-bit ones with their scales: the
//     "paged" section below; plain_pages, a batch of one length over 8-bit rows in one call)
//   quantize_rows(x)                                       -> 8-bit rows as a cache keeps them (mha.kernels.storage)
//
// A row's softmax is kept as its max m and its sum l of e^(s - m) (log-sum-exp = m + log l, made
// by the caller): the backward's P = e^(s - m) / l is then as exact as the forward's, where
// e^(s - lse) would carry lse's rounding, |m| eps, into every weight at large logits.
//
// q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), each row's values contiguous (rows anywhere:
// the heads of a projection's (B, T, H, D) output seen as (B, H, T, D), a KV cache's first S of more
// slots, are read where they lie; the backward's inputs are contiguous); out laid out as q is, as
// torch's CPU kernels lay theirs: (B, L, H, Dv) for such heads, so that merging them is a view, else
// contiguous. Hkv divides H (GQA: query
// head h reads key/value head h / G, G = H / Hkv). The G query heads that share a key/value head
// are one task's rows, stacked (row r = g * L + i), so K and V are read once for all of them: a
// decoding step (L = 1) of GQA reads the cache once per kv head, not G times.
//
// The scores of a tile, as the contract defines them (written once, in shape_tile):
//   s = (q * scale) . k                       the query is scaled once, when packed
//   s = softcap * tanh(s / softcap)           softcap > 0
//   s = s - slope_h * |rel|                   ALiBi, rel = key position - query position
//   s = s + mask  /  -inf where a bool mask is false, a key is padding, or the band hides rel
// Positions: query i at i + offset and key j at j, or given per sequence (B|1, L) and (B|1, S).
// The band is -left <= rel <= right (kUnbounded: no bound on that side), read in one place, a
// query's reach (Terms::reach: the key positions it sees); tiles it hides entirely are never
// computed. Sinks start each row's running softmax (max = sink, sum = 1). A row that sees
// no key gives zeros (max -inf, sum 0); a row with a NaN or +inf score (or sink) gives NaN.
//
// Builds (mha.kernels.native picks one for the CPU): avx512bf16 (MHA_AVX512 and MHA_AVX512_BF16:
// bfloat16 dot products), avx512 (MHA_AVX512), avx2 (AVX2 and FMA: the compiler's vector extensions
// at 32 bytes), portable (plain C++); the avx512bf16 build also carries AMX tile code (MHA_AMX), which
// runs where the CPU has the tiles (amx_usable). Tile products run on torch's brgemm (oneDNN, which picks
// its own instructions) for float32 and bfloat16 pairs, bfloat16's on the kernel's own AMX tiles where
// they run ("AMX" below), and on plain loops otherwise; the exponentials are
// vectorised in every build (exp16 with AVX-512 intrinsics, the same reduction and polynomial in
// vector extensions elsewhere), and a decoding step's few rows run on the run loops (run_scores,
// run_values) in every build.

// The headers are the few this file uses, not <torch/extension.h> (all of torch's C++ API and its
// Python bindings): parsing that took half of every build (35 s of ~72 on a Zen 3 core).
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's casters for at::Tensor
#include <torch/csrc/Exceptions.h>  // HANDLE_TH_ERRORS: C++ errors as Python's (plain_sdpa's own binding)
#include <torch/csrc/DynamicTypes.h>  // torch.dtype objects (the fast path's crossovers are keyed by them)
#include <torch/csrc/autograd/python_variable.h>  // a Tensor object's class and its at::Tensor

namespace at::autocast {  // as <ATen/autocast_mode.h> declares it (that header alone parses in ~10 s)
TORCH_API bool is_autocast_enabled(at::DeviceType device_type);
}

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(MHA_AVX512) || defined(MHA_AVX512_BF16)
#include <immintrin.h>
#endif
#if defined(MHA_AMX)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mha_native {

using at::Tensor;
constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max();
constexpr int64_t kLowest = std::numeric_limits<int64_t>::min();
constexpr int64_t kBlockQ = 64;   // query rows per task block
constexpr int64_t kBlockK = 256;  // keys per tile

struct Shape {
  int64_t B, H, Hkv, G, L, S, D, Dv;
  int64_t rows() const { return G * L; }  // the stacked query rows of one key/value head
};

// The key positions a query sees: lowest <= position <= highest, one run (mirrors
// mha.positions.Band.reach's [lowest, stop), highest = stop - 1). Saturated to int64's range: an
// unbounded side, or one past it, reaches int64's end.
struct Reach {
  int64_t lowest = kLowest, highest = kUnbounded;
  bool holds(int64_t key_position) const { return lowest <= key_position && key_position <= highest; }
};

template <typename acc_t>
struct Terms {
  acc_t scale = 1, softcap = 0;
  bool has_band = false;
  int64_t left = kUnbounded, right = kUnbounded;
  int64_t offset = 0;
  const int64_t* q_pos = nullptr; int64_t q_pos_b = 0;  // (B|1, L), batch stride 0 or L
  const int64_t* k_pos = nullptr; int64_t k_pos_b = 0;  // (B|1, S)
  bool k_sorted = true;  // the keys' positions never decrease along a sequence: bands skip tiles
  const bool* key_valid = nullptr; int64_t key_valid_b = 0;  // (B|1, S)
  const acc_t* mask = nullptr;  // additive, strides (b, h, i, j), 0 where broadcast
  const bool* bool_mask = nullptr;  // True = attend, same strides
  int64_t mb = 0, mh = 0, ml = 0, ms = 0;
  const acc_t* slopes = nullptr;  // (H,)
  const acc_t* sinks = nullptr;  // (H,)

  int64_t query_position(int64_t b, int64_t i) const { return q_pos ? q_pos[b * q_pos_b + i] : i + offset; }
  int64_t key_position(int64_t b, int64_t j) const { return k_pos ? k_pos[b * k_pos_b + j] : j; }
  // The band's rule, the only place its bounds are read: a query at q_position sees the keys at
  // positions [q_position - left, q_position + right] (-left <= rel <= right). The key interval
  // (key_interval) and the per-key test (Reach::holds, for keys out of order) both follow from it.
  Reach reach(int64_t q_position) const {
    Reach r;
    if (left != kUnbounded && __builtin_sub_overflow(q_position, left, &r.lowest)) r.lowest = left > 0 ? kLowest : kUnbounded;
    if (right != kUnbounded && __builtin_add_overflow(q_position, right, &r.highest)) r.highest = right > 0 ? kUnbounded : kLowest;
    return r;
  }
  bool has_mask() const { return mask != nullptr || bool_mask != nullptr; }
};

// The rows of one block (at most kBlockQ): their head, query index and position, in arrays of a
// block's largest size, so that making a block's rows (twice a block a call) allocates nothing.
struct Rows {
  int64_t b = 0, count = 0;
  std::array<int64_t, kBlockQ> head, index, position;  // the first ``count`` of each
};

template <typename acc_t>
Rows block_rows(const Shape& sh, const Terms<acc_t>& t, int64_t b, int64_t kv_head, int64_t r0, int64_t r1) {
  TORCH_CHECK(r1 - r0 <= kBlockQ, "mha native: a block of more than kBlockQ rows");
  Rows rows;
  rows.b = b;
  rows.count = r1 - r0;
  for (int64_t r = 0; r < rows.count; ++r) {
    const int64_t g = (r0 + r) / sh.L, i = (r0 + r) % sh.L;
    rows.head[r] = kv_head * sh.G + g;
    rows.index[r] = i;
    rows.position[r] = t.query_position(b, i);
  }
  return rows;
}

// The first of keys 0..S-1 whose position is >= p (S if none): keys in position order, the default
// positions or given ones that never decrease along a sequence (Terms::k_sorted).
template <typename acc_t>
int64_t first_key_from(const Terms<acc_t>& t, int64_t b, int64_t S, int64_t p) {
  if (t.k_pos == nullptr) return std::clamp<int64_t>(p, 0, S);
  const int64_t* kp = t.k_pos + b * t.k_pos_b;
  return std::lower_bound(kp, kp + S, p) - kp;
}

// The keys each row of a block sees, first[r] .. stop[r] - 1 (its key interval, key_interval below).
struct RowKeys {
  std::array<int64_t, kBlockQ> first, stop;
};

// The key-interval rule (mirrors mha.positions.Band.interval; a test checks the two agree on random
// bands and positions): [first, stop), the keys 0..S-1 whose positions the query's reach holds,
// keys in position order. Every query's keys are one interval; a block's and a tile's follow from it.
template <typename acc_t>
std::pair<int64_t, int64_t> key_interval(const Terms<acc_t>& t, int64_t b, int64_t S, int64_t q_position) {
  if (!t.has_band) return {0, S};
  const Reach reach = t.reach(q_position);
  const int64_t first = reach.lowest == kLowest ? 0 : first_key_from(t, b, S, reach.lowest);
  const int64_t stop = reach.highest == kUnbounded ? S : first_key_from(t, b, S, reach.highest + 1);
  return {first, std::max(first, stop)};
}

// [lo, hi): the keys some row of the block may see (all of them when the keys' positions are given
// out of order). The first and stop of a query's interval never decrease with its position.
template <typename acc_t>
std::pair<int64_t, int64_t> key_range(const Terms<acc_t>& t, const Rows& rows, int64_t S) {
  if (!t.has_band || (t.k_pos != nullptr && !t.k_sorted)) return {0, S};
  const auto [first, last] = std::minmax_element(rows.position.begin(), rows.position.begin() + rows.count);
  const int64_t lo = key_interval(t, rows.b, S, *first).first;
  return {lo, std::max(lo, key_interval(t, rows.b, S, *last).second)};
}

// Whether the band hides nothing in the tile of keys j0..j0+n-1 (keys in position order): the
// interval of the block's last query starts at or before j0, its first query's ends at or after.
template <typename acc_t>
bool band_covers(const Terms<acc_t>& t, const Rows& rows, int64_t j0, int64_t n) {
  if (!t.has_band) return true;
  if (t.k_pos != nullptr && !t.k_sorted) return false;
  const auto [first, last] = std::minmax_element(rows.position.begin(), rows.position.begin() + rows.count);
  return key_interval(t, rows.b, j0 + n, *last).first <= j0 && key_interval(t, rows.b, j0 + n, *first).second >= j0 + n;
}

// ---- tile products: C (M x N) (+)= A . B, three layouts ------------------------------------------

template <typename acc_t>
void gemm_nn(int64_t M, int64_t N, int64_t K, const acc_t* A, int64_t lda, const acc_t* B, int64_t ldb,
             acc_t* C, int64_t ldc, bool accumulate) {  // C = A (M x K) B (K x N)
  for (int64_t i = 0; i < M; ++i) {
    acc_t* c = C + i * ldc;
    if (!accumulate) std::fill(c, c + N, acc_t(0));
    for (int64_t kk = 0; kk < K; ++kk) {
      const acc_t a = A[i * lda + kk];
      const acc_t* b = B + kk * ldb;
      for (int64_t j = 0; j < N; ++j) c[j] += a * b[j];
    }
  }
}

template <>
void gemm_nn<float>(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                    float* C, int64_t ldc, bool accumulate) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!accumulate) for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, 0.0f);
    return;
  }
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B, C, false);
}

// After a thread's last product of a call: bfloat16 products in VNNI pairs (kAlign 2) run on
// oneDNN's brgemm ukernel, which on a CPU with AMX configures the thread's tiles and must be told
// when a run of products ends (the contract of its hardware context, as torch's own CPU flash
// kernel keeps it); float32 products hold no such context. Elsewhere a cheap no-op.
// Products with a release() of their own (AMX tiles) say when their tiles are done themselves.
template <typename Products, typename = void>
struct ReleasesItself : std::false_type {};
template <typename Products>
struct ReleasesItself<Products, std::void_t<decltype(std::declval<Products&>().release())>> : std::true_type {};

template <typename Products>
void release_products(Products& products) {
  if constexpr (ReleasesItself<Products>::value) products.release();
  else if constexpr (Products::kAlign == 2) at::native::cpublas::brgemm_release(true);
}

// A thread's copy of the call's products, released when its run ends however it ends (an exception left
// the tiles configured, and the thread's tile state stale for its next run).
template <typename Products>
struct ThreadProducts {
  Products products;
  explicit ThreadProducts(const Products& shared) : products(shared) {}
  ThreadProducts(const ThreadProducts&) = delete;
  ThreadProducts& operator=(const ThreadProducts&) = delete;
  ~ThreadProducts() { release_products(products); }
};

// The rows a block's buffers hold: its rows rounded up to the products' kRowAlign (1 where they have none).
template <typename Products, typename = void>
struct RowAlign : std::integral_constant<int64_t, 1> {};
template <typename Products>
struct RowAlign<Products, std::void_t<decltype(Products::kRowAlign)>> : std::integral_constant<int64_t, Products::kRowAlign> {};

template <typename Products>
int64_t buffer_rows(int64_t rows) {
  constexpr int64_t align = RowAlign<Products>::value;
  return (rows + align - 1) / align * align;
}

// Vectors of acc_t with the compiler's vector extensions: a register's width (64 bytes in the
// AVX-512 builds, 32 in the others), in the build's instructions.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // vectors passed between inline functions, never across the ABI
#if defined(MHA_AVX512)
constexpr int64_t kLaneBytes = 64;  // a zmm register
#else
constexpr int64_t kLaneBytes = 32;  // a ymm register (two xmm in the portable build)
#endif
// The sum of a vector's N lanes, its halves added pairwise (log2(N) steps, not N dependent ones; the
// same order at every width): lane u += lane u + N / 2, and so on down to two lanes.
template <typename acc_t, int64_t N>
struct Halves {
  typedef acc_t vec __attribute__((vector_size(N * sizeof(acc_t))));
  typedef acc_t half __attribute__((vector_size(N / 2 * sizeof(acc_t))));
  static acc_t sum(vec v) {
    half low, high;
    std::memcpy(&low, &v, sizeof(half));
    std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof(half), sizeof(half));
    return Halves<acc_t, N / 2>::sum(low + high);
  }
};
template <typename acc_t>
struct Halves<acc_t, 2> {
  typedef acc_t vec __attribute__((vector_size(2 * sizeof(acc_t))));
  static acc_t sum(vec v) { return v[0] + v[1]; }
};

// load and store are typed accesses of an unaligned vector of acc_t (GCC's vector types alias their
// element type only): a memcpy's store may alias anything, so the run loops reloaded every pointer and
// count their lambdas hold by reference after each store of an output vector.
template <typename acc_t>
struct Lanes {
  typedef acc_t vec __attribute__((vector_size(kLaneBytes)));
  typedef acc_t unaligned __attribute__((vector_size(kLaneBytes), aligned(alignof(acc_t))));
  static constexpr int64_t kCount = kLaneBytes / sizeof(acc_t);
  static vec load(const acc_t* p) { return *reinterpret_cast<const unaligned*>(p); }
  static void store(acc_t* p, vec v) { *reinterpret_cast<unaligned*>(p) = v; }
  static acc_t sum(vec v) { return Halves<acc_t, kCount>::sum(v); }
};

#pragma GCC diagnostic pop

// ---- exponentials --------------------------------------------------------------------------------

// The exponent scale x - shift is one fused operation in every exp_shifted and exp_times: the exact
// product less the shift, whose own error cancels (a row's exponents share it). Past logits of 2^27 (a
// float's; 2^56 a double's) it does not: the shift's rounding is more than a weight's range (at 4e9 a float's ulp is
// 512: the row's largest weight was e^-256 or e^+256, the row zeros or NaN in every dtype but float64,
// found by a test at a scale of 1e8). Those rows take the product rounded first, then the shift
// (exp_shifted_apart, exp_times_apart: the row's largest gives 0 exactly). Below the bound the fused
// exponent exceeds 0 by at most half an ulp of the shift (8 at 2^27: a weight of e^8, far from float's
// range).
template <typename acc_t>
bool fused_exponent(acc_t scale, acc_t shift) {
  return scale == acc_t(1) || std::abs(shift) < std::ldexp(acc_t(1), std::numeric_limits<acc_t>::digits + 3);
}

template <typename acc_t>
acc_t rounded_product(acc_t a, acc_t b) {
  volatile acc_t product = a * b;  // (never fused with what follows)
  return product;
}

// exp_shifted and exp_times of a row past fused_exponent's bound, one value at a time (rows of logits past 1e8).
template <typename acc_t, typename W>
acc_t exp_shifted_apart(int64_t n, const acc_t* x, acc_t scale, acc_t shift, W* w) {
  acc_t sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    w[j] = static_cast<W>(std::exp(rounded_product(scale, x[j]) - shift));
    sum += static_cast<acc_t>(w[j]);
  }
  return sum;
}

template <typename acc_t>
void exp_times_apart(int64_t n, const acc_t* x, acc_t scale, acc_t shift, acc_t factor, acc_t* w) {
  for (int64_t j = 0; j < n; ++j) w[j] = std::exp(rounded_product(scale, x[j]) - shift) * factor;
}

// w[j] = exp(scale * x[j] - shift) (0 where x is -inf), in the weights' type W; returns their sum
// (of the weights as stored: rounded ones sum to what the product with V will use).
template <typename acc_t, typename W>
acc_t exp_shifted(int64_t n, const acc_t* x, acc_t scale, acc_t shift, W* w) {
  acc_t sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    w[j] = static_cast<W>(std::exp(scale * x[j] - shift));
    sum += static_cast<acc_t>(w[j]);
  }
  return sum;
}

#if defined(MHA_AVX512)
// e^x of 16 floats to about 2 ulp, the lanes of ``kept`` only (0 elsewhere), for x that is not NaN
// and at most 88.7: x = n ln2 + r, |r| <= ln2 / 2, with n ln2 taken off in two parts (ln2's float
// and the rest: r stays exact where x is large, as a softmax's exponents are when its logits are),
// e^r a degree-6 polynomial (near-minimax on [-ln2/2, ln2/2], 1.6 ulp), times 2^n. A lane left out
// may compute a NaN (x = -inf): the mask, not a clamp, makes it 0.
static inline __m512 exp16_kept(__m512 x, __mmask16 kept) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // x - n ln2 (ln2's first 16 bits: exact)
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.4286068202862268e-06f), r);   // the rest of ln2
  __m512 p = _mm512_set1_ps(1.3948580815544224e-3f);  // e^r
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.375128890169071e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666218274417265e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666415477239332e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.000000107749400e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0000000377274472f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.9999999999595482f));
  return _mm512_maskz_scalef_ps(kept, p, n);  // p 2^n
}

// Below -87.3 e^x is 0 (e^-87 is float32's smallest normal).
static inline __mmask16 exp_kept(__m512 x) { return _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ); }

// exp of any 16 floats: 0 below -87.3, e^88.7 (3.3e38) above 88.7, NaN stays NaN.
static inline __m512 exp16(__m512 x) {
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512 c = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
  return _mm512_mask_mov_ps(exp16_kept(c, exp_kept(c)), nan, x);
}

static inline __mmask16 tail_mask(int64_t count) { return static_cast<__mmask16>((1u << count) - 1u); }

// A softmax's exponentials: scale x - shift is at most about 0 or -inf, never NaN (absorb and
// softmax_row take a row with a NaN or +inf score apart before), so only the underflow is masked.
template <>
float exp_shifted<float, float>(int64_t n, const float* x, float scale, float shift, float* w) {
  const __m512 a = _mm512_set1_ps(scale), b = _mm512_set1_ps(shift);
  __m512 total = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 y = _mm512_fmsub_ps(_mm512_loadu_ps(x + j), a, b);
    const __m512 e = exp16_kept(y, exp_kept(y));
    _mm512_storeu_ps(w + j, e);
    total = _mm512_add_ps(total, e);
  }
  if (j < n) {
    const __mmask16 m = tail_mask(n - j);
    const __m512 y = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, x + j), a, b);
    const __m512 e = exp16_kept(y, m & exp_kept(y));
    _mm512_mask_storeu_ps(w + j, m, e);
    total = _mm512_add_ps(total, e);
  }
  return _mm512_reduce_add_ps(total);
}
#endif

// w[j] = exp(scale * x[j] - shift) * factor (the backward's P = e^(s - m) / l).
template <typename acc_t>
void exp_times(int64_t n, const acc_t* x, acc_t scale, acc_t shift, acc_t factor, acc_t* w) {
  for (int64_t j = 0; j < n; ++j) w[j] = std::exp(scale * x[j] - shift) * factor;
}

#if !defined(MHA_AVX512)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
// The AVX2 and portable builds: exp of a vector of floats as exp16 computes it (the same reduction
// and polynomial, in the compiler's vector extensions; std::exp one value at a time was most of a
// decoding step's time there): about 2 ulp; 0 below -87.3, +inf above 88.3, NaN kept.
using FloatLanes = Lanes<float>;
inline FloatLanes::vec exp_lanes(FloatLanes::vec x) {
  using vec = FloatLanes::vec;
  typedef int32_t ivec __attribute__((vector_size(kLaneBytes)));
  const vec c = x < -87.3f ? vec{} - 87.3f : (x > 88.3f ? vec{} + 88.3f : x);
  const vec magic = vec{} + 12582912.0f;  // 1.5 2^23: adding it rounds to an integer
  const vec n = (c * 1.44269504088896341f + magic) - magic;
  vec r = c - n * 0.693145751953125f;  // c - n ln2, ln2's first 16 bits: exact
  r = r - n * 1.4286068202862268e-06f;  // the rest of ln2
  vec p = vec{} + 1.3948580815544224e-3f;  // e^r
  p = p * r + 8.375128890169071e-3f;
  p = p * r + 4.1666218274417265e-2f;
  p = p * r + 1.6666415477239332e-1f;
  p = p * r + 5.000000107749400e-1f;
  p = p * r + 1.0000000377274472f;
  p = p * r + 0.9999999999595482f;
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;  // 2^n, n in -126 .. 127
  vec power;
  std::memcpy(&power, &bits, sizeof(vec));
  const vec result = p * power;
  const vec limited = x < -87.3f ? vec{} : (x > 88.3f ? vec{} + std::numeric_limits<float>::infinity() : result);
  return x != x ? x : limited;
}

// exp(scale * x[j] - shift) (times factor) for n values: whole vectors, then the tail through the same
// code (a padded copy), so that a weight is the same wherever it lies in a tile.
template <typename Store>
inline void exp_each(int64_t n, const float* x, float scale, float shift, float factor, Store store) {
  using V = FloatLanes;
  int64_t j = 0;
  for (; j + V::kCount <= n; j += V::kCount) store(j, V::kCount, exp_lanes(V::load(x + j) * scale - shift) * factor);
  if (j < n) {
    float tail[V::kCount];
    for (int64_t i = 0; i < V::kCount; ++i) tail[i] = j + i < n ? x[j + i] : -std::numeric_limits<float>::infinity();
    store(j, n - j, exp_lanes(V::load(tail) * scale - shift) * factor);
  }
}

// The first ``count`` lanes of e to w: a whole vector stored as one (copied through a buffer, a
// vector's store and reload cost more than its exponential).
inline void store_lanes(float* w, int64_t count, FloatLanes::vec e) {
  if (count == FloatLanes::kCount) return FloatLanes::store(w, e);
  float values[FloatLanes::kCount];
  FloatLanes::store(values, e);
  std::copy(values, values + count, w);
}

template <>
float exp_shifted<float, float>(int64_t n, const float* x, float scale, float shift, float* w) {
  FloatLanes::vec total = {};
  exp_each(n, x, scale, shift, 1.0f, [&](int64_t j, int64_t count, FloatLanes::vec e) {
    store_lanes(w + j, count, e);
    total += e;  // the padding's weights are 0
  });
  return FloatLanes::sum(total);
}

template <>
void exp_times<float>(int64_t n, const float* x, float scale, float shift, float factor, float* w) {
  exp_each(n, x, scale, shift, factor, [&](int64_t j, int64_t count, FloatLanes::vec e) { store_lanes(w + j, count, e); });
}

#pragma GCC diagnostic pop
#endif

#if defined(MHA_AVX512)
template <>
void exp_times<float>(int64_t n, const float* x, float scale, float shift, float factor, float* w) {
  const __m512 a = _mm512_set1_ps(scale), b = _mm512_set1_ps(shift), f = _mm512_set1_ps(factor);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(n - j);
    _mm512_mask_storeu_ps(w + j, m, _mm512_mul_ps(exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, x + j), a, b)), f));
  }
}
#endif

// The exponent's units folded into its fused multiply-subtract, x scale log2(e) - shift log2(e), where
// |shift| is at most this (the AVX-512-BF16 build's bfloat16 weights, bf16_weights): each product's
// rounding errs by |shift| eps in log2 units, a factor its whole tile shares but for its keys' own
// rounding (|s scale - shift| eps) -- a tile's weights against another tile's of a new max up to
// 2^(2 |shift| eps) apart, 1.2e-4 here, a twentieth of bfloat16's rounding of a weight (past it two
// operations: at logits of 1e4 one FMA's tiles were 1.2e-3 apart, at 2^22 0.27).
constexpr float kFoldedShift = 1024.0f;
inline bool folded_exponent(float shift) { return std::abs(shift) <= kFoldedShift; }

#if defined(MHA_AVX512_BF16)
// 2^x of 16 floats for weights that are rounded to bfloat16 next, x in log2 units (at most about 0 or
// -inf, never NaN), the lanes of ``kept`` only (0 elsewhere): f = x - floor(x) in [0, 1) (vreduceps
// rounding down, one operation), 2^f a degree-3 polynomial (near-minimax on [0, 1), relative error
// 7.5e-5 against bfloat16's 3.9e-3), scaled by 2^floor(x) by vscalefps, which floors its exponent
// itself (rounding to nearest took x - f as the exponent, one operation more). Below -125 (and -inf)
// the weight is 0 by the mask, not computed: a result below float's normal range takes a microcode
// assist on Intel (a clamp at -200 instead ran a causal tile's hidden scores at 2.3 ns each, ten times
// the rest). Six operations a vector (and exp_shifted's one or two before it); the earlier degree-4
// polynomial in natural units with n added to the exponent's bits took eleven (and its one).
static inline __m512 exp2_16_for_bf16(__m512 x, __mmask16 kept) {
  kept &= _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.0f), _CMP_GE_OQ);
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // x - floor(x), one operation
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(7.802452892065048e-2f), f, _mm512_set1_ps(2.2606714069843292e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.958335638046265e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999251961708069e-1f));
  return _mm512_maskz_scalef_ps(kept, p, x);
}


// The weights rounded to bfloat16 as they are made (the product with V takes them so), 64 at a time
// (pairs of vectors rounded into one), their sum taken by vdpbf16ps against ones: the weights as
// rounded, added in pairs, in float32, in two chains (one chain's latency bounded a row of 256 keys).
// The exponent in log2 units, (scale x - shift) log2(e): one FMA where |shift| <= kFoldedShift, else the
// difference first, exact where it matters (a fused multiply-subtract, small near the row's max), then
// its units (a product apart: folded, the shift's rounding overflowed past 2e38).
template <bool kFolded>
float bf16_weights(int64_t n, const float* x, float scale, float shift, at::BFloat16* w) {
  constexpr float kLog2e = 1.44269504088896341f;
  const __m512 a = _mm512_set1_ps(kFolded ? scale * kLog2e : scale), b = _mm512_set1_ps(kFolded ? shift * kLog2e : shift);
  const __m512 log2e = _mm512_set1_ps(kLog2e);
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);  // bfloat16's 1
  __m512 total0 = _mm512_setzero_ps(), total1 = _mm512_setzero_ps();
  const auto weights = [&](const float* p, __mmask16 m) {
    const __m512 units = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, p), a, b);
    return exp2_16_for_bf16(kFolded ? units : _mm512_mul_ps(units, log2e), m);
  };
  const auto pair_at = [&](int64_t j) { return _mm512_cvtne2ps_pbh(weights(x + j + 16, 0xFFFF), weights(x + j, 0xFFFF)); };
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    const __m512bh first = pair_at(j), second = pair_at(j + 32);
    _mm512_storeu_si512(w + j, (__m512i)first);
    _mm512_storeu_si512(w + j + 32, (__m512i)second);
    total0 = _mm512_dpbf16_ps(total0, first, ones);
    total1 = _mm512_dpbf16_ps(total1, second, ones);
  }
  if (j + 32 <= n) {
    const __m512bh pair = pair_at(j);
    _mm512_storeu_si512(w + j, (__m512i)pair);
    total0 = _mm512_dpbf16_ps(total0, pair, ones);
    j += 32;
  }
  if (j < n) {  // 1 to 31 more
    const int64_t rest = n - j;
    const __mmask16 low = tail_mask(std::min<int64_t>(rest, 16)), high = rest > 16 ? tail_mask(rest - 16) : 0;
    const __m512bh pair = _mm512_cvtne2ps_pbh(weights(x + j + 16, high), weights(x + j, low));
    _mm512_mask_storeu_epi16(w + j, static_cast<__mmask32>((uint64_t(1) << rest) - 1), (__m512i)pair);
    total1 = _mm512_dpbf16_ps(total1, pair, ones);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(total0, total1));
}

template <>
float exp_shifted<float, at::BFloat16>(int64_t n, const float* x, float scale, float shift, at::BFloat16* w) {
  return folded_exponent(shift) ? bf16_weights<true>(n, x, scale, shift, w) : bf16_weights<false>(n, x, scale, shift, w);
}
#endif

// The largest of x[0..n), NaN if any is NaN (a NaN score makes its row NaN, as in torch).
template <typename acc_t>
acc_t row_max(int64_t n, const acc_t* x) {
  acc_t best = -std::numeric_limits<acc_t>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(x[j])) return x[j];
    best = std::max(best, x[j]);
  }
  return best;
}

#if !defined(MHA_AVX512)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
// row_max on whole vectors (one value at a time it cost a tile as much as its exponentials): the
// lanes' maxima, any NaN remembered, then the last values one at a time.
template <>
float row_max<float>(int64_t n, const float* x) {
  using V = FloatLanes;
  typedef int32_t ivec __attribute__((vector_size(kLaneBytes)));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  V::vec best = V::vec{} + neg_inf;
  ivec nan = {};
  int64_t j = 0;
  for (; j + V::kCount <= n; j += V::kCount) {
    const V::vec v = V::load(x + j);
    nan |= v != v;
    best = v > best ? v : best;
  }
  float top = neg_inf;
  for (int64_t i = 0; i < V::kCount; ++i) {
    if (nan[i]) return std::numeric_limits<float>::quiet_NaN();
    top = std::max(top, best[i]);
  }
  for (; j < n; ++j) {
    if (std::isnan(x[j])) return x[j];
    top = std::max(top, x[j]);
  }
  return top;
}
#pragma GCC diagnostic pop
#endif

#if defined(MHA_AVX512)
// Four chains of maxima, 64 values a step (one chain's latency, 4 cycles a vector, bounded a row of
// 256 scores: 0.09 ns a score against the exponentials' 0.15, Xeon with AMX), NaNs found in pairs.
template <>
float row_max<float>(int64_t n, const float* x) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best0 = neg_inf, best1 = neg_inf, best2 = neg_inf, best3 = neg_inf;
  __mmask16 nan = 0;
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    const __m512 v0 = _mm512_loadu_ps(x + j), v1 = _mm512_loadu_ps(x + j + 16);
    const __m512 v2 = _mm512_loadu_ps(x + j + 32), v3 = _mm512_loadu_ps(x + j + 48);
    best0 = _mm512_max_ps(best0, v0);
    best1 = _mm512_max_ps(best1, v1);
    best2 = _mm512_max_ps(best2, v2);
    best3 = _mm512_max_ps(best3, v3);
    nan |= _mm512_cmp_ps_mask(v0, v1, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v2, v3, _CMP_UNORD_Q);
  }
  for (; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(n - j);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + j);
    best0 = _mm512_mask_max_ps(best0, m, best0, v);
    nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
  }
  const __m512 best = _mm512_max_ps(_mm512_max_ps(best0, best1), _mm512_max_ps(best2, best3));
  return nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(best);
}
#endif

// Whether a running max or a tile's max is NaN or +inf: the row's softmax is NaN (torch's is:
// e^(inf - inf)), and so are its output and log-sum-exp.
template <typename acc_t>
bool poisons(acc_t max) { return !(max < std::numeric_limits<acc_t>::infinity()); }

// Merge a tile's scores ``row`` (n of them, times ``scale``) into a row's running softmax (max m,
// sum l), write the tile's weights to ``w`` and rescale the row's accumulated output ``acc`` (Dv
// values) to the new max. A tile with no visible key, before any was seen, adds nothing (its
// weights are zeros). A NaN or +inf score (or sink) makes the row NaN: m, l and acc. scale > 0.
template <typename acc_t, typename W>
void absorb(int64_t n, const acc_t* row, acc_t scale, acc_t& m, acc_t& l, acc_t* acc, int64_t Dv, W* w) {
  const acc_t top = scale * row_max(n, row);
  if (poisons(m) || poisons(top)) {
    m = l = std::numeric_limits<acc_t>::quiet_NaN();
    std::fill(acc, acc + Dv, m);
    std::fill(w, w + n, static_cast<W>(0.0f));
    return;
  }
  const acc_t m_new = std::max(m, top);
  if (m_new == -std::numeric_limits<acc_t>::infinity()) {
    std::fill(w, w + n, static_cast<W>(0.0f));
    return;
  }
  const acc_t alpha = m_new == m ? acc_t(1) : std::exp(m - m_new);  // 0 when m was -inf
  l = l * alpha + (fused_exponent(scale, m_new) ? exp_shifted(n, row, scale, m_new, w)
                                               : exp_shifted_apart(n, row, scale, m_new, w));
  m = m_new;
  if (alpha != acc_t(1))
    for (int64_t d = 0; d < Dv; ++d) acc[d] *= alpha;
}

// Where a kernel leaves each row's softmax: its max m and its sum l (B, H, L) each.
template <typename acc_t>
struct RowStats {
  acc_t* max;
  acc_t* sum;
};

// A row's output acc / l (Dv values) and its (m, l): zeros, -inf and 0 for a row that saw nothing,
// NaN for a row made NaN (see absorb).
template <typename scalar_t, typename acc_t>
void finish_row(acc_t m, acc_t l, const acc_t* acc, int64_t Dv, scalar_t* out, const RowStats<acc_t>& stats,
                int64_t row) {
  if (poisons(m) || std::isnan(l)) {
    std::fill(out, out + Dv, static_cast<scalar_t>(std::numeric_limits<acc_t>::quiet_NaN()));
    stats.max[row] = stats.sum[row] = std::numeric_limits<acc_t>::quiet_NaN();
    return;
  }
  const acc_t inv = l > 0 ? acc_t(1) / l : acc_t(0);
  for (int64_t d = 0; d < Dv; ++d) out[d] = static_cast<scalar_t>(acc[d] * inv);
  stats.max[row] = l > 0 ? m : -std::numeric_limits<acc_t>::infinity();
  stats.sum[row] = l;
}

// p (n scores) -> their softmax in place, with the row's sink logit (when given) in the sum and not
// kept: zeros where every score is -inf (and no sink), NaN where a score or the sink is NaN or +inf.
template <typename acc_t>
void softmax_row(int64_t n, acc_t* p, const acc_t* sink) {
  acc_t m = row_max(n, p);
  if (sink != nullptr && !std::isnan(m)) m = std::isnan(*sink) ? *sink : std::max(m, *sink);
  if (poisons(m) || m == -std::numeric_limits<acc_t>::infinity()) {
    std::fill(p, p + n, poisons(m) ? std::numeric_limits<acc_t>::quiet_NaN() : acc_t(0));
    return;
  }
  const acc_t l = exp_shifted(n, p, acc_t(1), m, p) + (sink != nullptr ? std::exp(*sink - m) : acc_t(0));
  const acc_t inv = acc_t(1) / l;
  for (int64_t j = 0; j < n; ++j) p[j] *= inv;
}

// row[j] = c tanh(row[j] / c), and th[j] = tanh(row[j] / c) when th is given (the backward's).
template <typename acc_t>
void softcap_row(int64_t n, acc_t* row, acc_t c, acc_t* th) {
  for (int64_t j = 0; j < n; ++j) {
    const acc_t h = std::tanh(row[j] / c);
    if (th) th[j] = h;
    row[j] = c * h;
  }
}

#if defined(MHA_AVX512)
// tanh of 16 floats to about 2 ulp: y + y^3 Q(y^2) below |y| = 0.5 (Q near-minimax, degree 4: no
// cancellation where tanh(y) ~ y, which is where a large cap puts every score), else
// sign(y) (1 - 2 / (e^(2|y|) + 1)); +-1 past |y| = 44; NaN stays NaN.
static inline __m512 tanh16(__m512 y) {
  const __m512 a = _mm512_abs_ps(y), u = _mm512_mul_ps(y, y), one = _mm512_set1_ps(1.0f);
  __m512 q = _mm512_set1_ps(-6.9470273608254005e-3f);
  q = _mm512_fmadd_ps(q, u, _mm512_set1_ps(2.147273461642313e-2f));
  q = _mm512_fmadd_ps(q, u, _mm512_set1_ps(-5.3933791806369494e-2f));
  q = _mm512_fmadd_ps(q, u, _mm512_set1_ps(1.3333227407799145e-1f));
  q = _mm512_fmadd_ps(q, u, _mm512_set1_ps(-3.3333332809864824e-1f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(y, u), q, y);
  const __m512 e = exp16(_mm512_add_ps(a, a));  // e^(2|y|)
  const __m512 large = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
  const __m512 sign = _mm512_and_ps(y, _mm512_set1_ps(-0.0f));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.5f), _CMP_LT_OQ), _mm512_or_ps(large, sign), small);
}

template <>
void softcap_row<float>(int64_t n, float* row, float c, float* th) {
  const __m512 inv = _mm512_set1_ps(1.0f / c), cap = _mm512_set1_ps(c);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(n - j);
    const __m512 h = tanh16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + j), inv));
    if (th) _mm512_mask_storeu_ps(th + j, m, h);
    _mm512_mask_storeu_ps(row + j, m, _mm512_mul_ps(cap, h));
  }
}
#endif

// ---- the scores of a tile ------------------------------------------------------------------------

// A row's n scores beside its mask's n values ``stride`` apart: an additive mask added, a bool one's False
// keys hidden (-inf; a hidden NaN score is -inf too). A bool mask's contiguous keys a vector at a time: a
// branch a key (what gcc makes of a select, too) ran a bfloat16 forward under a random bool mask at 4.3x
// the unmasked time (Xeon with AMX), the branch mispredicted at one key in five.
template <typename acc_t>
void mask_row(int64_t n, acc_t* row, const acc_t* add, int64_t stride) {
  if (stride == 1)
    for (int64_t j = 0; j < n; ++j) row[j] += add[j];
  else
    for (int64_t j = 0; j < n; ++j) row[j] += add[j * stride];
}

template <typename acc_t>
void mask_row(int64_t n, acc_t* row, const bool* keep, int64_t stride) {
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  int64_t j = 0;
  if constexpr (std::is_same_v<acc_t, float>) {
    if (stride == 1) {
#if defined(MHA_AVX512)
      for (; j + 16 <= n; j += 16) {  // the keys whose byte is 0 hidden
        const __mmask16 hidden = _mm_cmpeq_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(keep + j)), _mm_setzero_si128());
        _mm512_mask_storeu_ps(row + j, hidden, _mm512_set1_ps(neg_inf));
      }
#elif defined(__AVX2__)
      for (; j + 8 <= n; j += 8) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(keep + j)));
        const __m256 hidden = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bytes, _mm256_setzero_si256()));
        _mm256_storeu_ps(row + j, _mm256_blendv_ps(_mm256_loadu_ps(row + j), _mm256_set1_ps(neg_inf), hidden));
      }
#endif
    }
  }
  for (; j < n; ++j)
    if (!keep[j * stride]) row[j] = neg_inf;
}

// Shape the scores s (rows x n, leading dim lds) of keys j0.. as the contract says; with softcap,
// ``capped`` (same layout) receives tanh(raw / softcap) for the backward. ``covered``: the band
// hides no key of the tile.
template <typename acc_t>
void shape_tile(const Terms<acc_t>& t, const Rows& rows, int64_t j0, int64_t n, acc_t* s, int64_t lds,
                acc_t* capped, bool covered) {
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const int64_t b = rows.b;
  for (int64_t r = 0; r < rows.count; ++r) {
    acc_t* row = s + r * lds;
    if (t.softcap > 0) softcap_row(n, row, t.softcap, capped ? capped + r * lds : nullptr);
    const int64_t h = rows.head[r], i = rows.index[r], q_position = rows.position[r];
    if (t.slopes == nullptr && !covered && (t.k_pos == nullptr || t.k_sorted)) {  // the band is one run of columns
      const auto [first_key, stop_key] = key_interval(t, b, j0 + n, q_position);
      const int64_t first = std::clamp<int64_t>(first_key - j0, 0, n), last = std::clamp<int64_t>(stop_key - j0, 0, n);
      std::fill(row, row + first, neg_inf);
      std::fill(row + last, row + n, neg_inf);
    } else if (t.slopes != nullptr || !covered) {
      const acc_t slope = t.slopes ? t.slopes[h] : acc_t(0);
      const Reach seen = t.reach(q_position);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t key_position = t.key_position(b, j0 + j), rel = key_position - q_position;
        if (t.slopes) row[j] -= slope * static_cast<acc_t>(rel < 0 ? -rel : rel);
        if (!covered && !seen.holds(key_position)) row[j] = neg_inf;
      }
    }
    if (t.has_mask()) {
      const int64_t base = b * t.mb + h * t.mh + i * t.ml + j0 * t.ms;
      if (t.mask) mask_row(n, row, t.mask + base, t.ms);
      else mask_row(n, row, t.bool_mask + base, t.ms);
    }
    if (t.key_valid) mask_row(n, row, t.key_valid + b * t.key_valid_b + j0, 1);
  }
}

template <typename acc_t>
bool plain_tile(const Terms<acc_t>& t, bool covered) {
  return covered && t.softcap == 0 && t.slopes == nullptr && !t.has_mask() && t.key_valid == nullptr;
}

// ---- forward ---------------------------------------------------------------------------------------

// The operands every tile product reads, laid out so that each is a plain A (M x K) . B (K x N)
// over contiguous memory: q rows are packed per block (scaled); K^T is kept tile by tile,
// (B, Hkv, S / kBlockK, D, kBlockK) (a tile's D rows of kBlockK keys side by side, so that no
// product strides across the whole sequence), and V is (B, Hkv, S, Dv); all in acc_t.
inline int64_t tiles_of(int64_t S) { return (S + kBlockK - 1) / kBlockK; }

// Memory of at least ``count`` values of a trivial type, uninitialised, on a cache line's edge: a tile
// register's rows are loaded from (and stored to) whole 64-byte lines, and AMX products on buffers 16
// bytes off a line (what malloc gives) took 1.6x the time (Xeon with AMX, one core).
struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
constexpr int64_t kLine = 64;
template <typename T>
std::unique_ptr<T[], AlignedFree> aligned_values(int64_t count) {
  static_assert(std::is_trivially_default_constructible_v<T> && std::is_trivially_destructible_v<T>);
  const auto bytes = static_cast<size_t>((std::max<int64_t>(count, 1) * int64_t(sizeof(T)) + kLine - 1) / kLine * kLine);
  void* p = std::aligned_alloc(kLine, bytes);
  if (p == nullptr) throw std::bad_alloc();
  return std::unique_ptr<T[], AlignedFree>(static_cast<T*>(p));
}

// A thread's buffer of values that each use writes before it reads: grown uninitialised (a std::vector's
// zeros were a memset of every thread's buffers on every call: bfloat16 forward B1 H8 T64 0.79-0.83x the
// time without them, Zen 4), on a line's edge (aligned_values), and a copy starts empty (each thread
// copies the call's products, to have buffers of its own).
template <typename T>
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) {}
  Scratch& operator=(const Scratch&) = delete;
  T* at_least(int64_t count) {
    if (count > size_) data_ = aligned_values<T>(count), size_ = count;
    return data_.get();
  }
  T* data() const { return data_.get(); }

 private:
  std::unique_ptr<T[], AlignedFree> data_;
  int64_t size_ = 0;
};

// Buffers kept from call to call (per thread, type and slot), so that packing writes into memory
// already paged in rather than faulting in fresh pages on every call. Grown as Scratch is: what a
// call packs it writes before it reads.
template <typename T>
T* workspace(int slot, int64_t count) {
  thread_local Scratch<T> buffers[3];
  return buffers[slot].at_least(count);
}

// dst[d * kBlockK + j] = src[j * lds + d] for the n <= kBlockK keys j of a tile and d < X, and zeros in
// the column past an odd n (padded_keys): kPackKeys keys at a time, whose rows stay in L1 while each
// column's run of them is written (key by key, each key wrote one value into X lines a kBlockK apart). A function of its own
// with its pointers __restrict: inlined into the parallel loop's lambda, the compiler kept its
// counters on the stack (a store and a load per value), and the pass took a fifth of a 64-row
// weights call over 1024 keys (perf, AVX2).
constexpr int64_t kPackKeys = 16;

// The keys of a tile of n keys (from S) that products read: n rounded up to the bfloat16 products' pairs
// (kAlign <= 2; block_keys ends a block's keys there). Packing writes these alone: a tile's columns
// further on are never read, and zeroing them (K^T's 192 of 256 at T = 64) cost 6 % of a forward's
// samples there (perf, B1 H8 T64, Zen 4).
inline int64_t padded_keys(int64_t n) { return std::min(kBlockK, n + n % 2); }

#if defined(__AVX2__)
// dst[c * ldd + r] = src[r * lds + c] for an 8 x 8 block of floats, in registers.
inline void transpose8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
}
#endif

template <typename scalar_t, typename acc_t>
__attribute__((noinline)) void pack_tile(const scalar_t* __restrict src, int64_t lds, int64_t n, int64_t X,
                                         acc_t* __restrict dst) {
  int64_t whole = 0;  // keys done in 8 x 8 blocks (float32 in AVX2 builds: 0.6x the loop's time, standalone)
#if defined(__AVX2__)
  if constexpr (std::is_same_v<scalar_t, float> && std::is_same_v<acc_t, float>) {
    if (X % 8 == 0) {
      whole = n / 8 * 8;
      for (int64_t j = 0; j < whole; j += 8)
        for (int64_t d = 0; d < X; d += 8) transpose8(src + j * lds + d, lds, dst + d * kBlockK + j, kBlockK);
    }
  }
#endif
  for (int64_t j0 = whole; j0 < n; j0 += kPackKeys) {
    const int64_t j1 = std::min(n, j0 + kPackKeys);
    for (int64_t d = 0; d < X; ++d) {
      acc_t* __restrict column = dst + d * kBlockK;
      const scalar_t* __restrict values = src + d;
      for (int64_t j = j0; j < j1; ++j) column[j] = static_cast<acc_t>(values[j * lds]);
    }
  }
  for (int64_t d = 0; d < X; ++d) std::fill(dst + d * kBlockK + n, dst + d * kBlockK + padded_keys(n), acc_t(0));
}

// Where the rows of a 4-D tensor (B, heads, T, X) lie, its last dim contiguous: row i of head h of
// batch b at b * batch + h * head + i * row (elements from its start).
struct RowStrides {
  int64_t batch, head, row;
  int64_t at(int64_t b, int64_t h, int64_t i) const { return b * batch + h * head + i * row; }
};

inline RowStrides contiguous_rows(int64_t heads, int64_t T, int64_t X) { return {heads * T * X, T * X, X}; }

// x (B, Hkv, S, X), its rows where xs says -> out (B * Hkv, tiles, X, kBlockK) in acc_t, the last
// tile padded with zeros: one pass.
template <typename scalar_t, typename acc_t>
void pack_tile_major(const scalar_t* x, RowStrides xs, const Shape& sh, int64_t X, acc_t* out) {
  const int64_t tiles = tiles_of(sh.S);
  at::parallel_for(0, sh.B * sh.Hkv * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / tiles, tile = task % tiles, j0 = tile * kBlockK;
      pack_tile(x + xs.at(bh / sh.Hkv, bh % sh.Hkv, j0), xs.row, std::min(kBlockK, sh.S - j0), X, out + task * X * kBlockK);
    }
  });
}

// A tile of the tile-major layout, X x kBlockK, back to its n keys' rows (n x X): the transpose,
// 8 x 8 blocks in registers where they fit (float32), as pack_tile packs.
template <typename acc_t>
void unpack_tile(const acc_t* __restrict src, int64_t n, int64_t X, acc_t* __restrict dst) {
  int64_t whole = 0;
#if defined(__AVX2__)
  if constexpr (std::is_same_v<acc_t, float>) {
    if (X % 8 == 0) {
      whole = n / 8 * 8;
      for (int64_t j = 0; j < whole; j += 8)
        for (int64_t d = 0; d < X; d += 8) transpose8(src + d * kBlockK + j, kBlockK, dst + j * X + d, X);
    }
  }
#endif
  for (int64_t j = whole; j < n; ++j)
    for (int64_t d = 0; d < X; ++d) dst[j * X + d] = src[d * kBlockK + j];
}

// The tile-major layout (B, Hkv, tiles, X, kBlockK) back to (B, Hkv, S, X): one pass.
inline Tensor from_tile_major(const Tensor& y, int64_t S) {
  const int64_t tiles = y.size(2), X = y.size(3);
  Tensor x = at::empty({y.size(0), y.size(1), S, X}, y.options());
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "mha_native_from_tile_major", [&] {
    const scalar_t* src = y.data_ptr<scalar_t>();
    scalar_t* dst = x.data_ptr<scalar_t>();
    at::parallel_for(0, y.size(0) * y.size(1) * tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t bh = task / tiles, j0 = task % tiles * kBlockK;
        unpack_tile(src + task * X * kBlockK, std::min(kBlockK, S - j0), X, dst + (bh * S + j0) * X);
      }
    });
  });
  return x;
}

template <typename acc_t>
struct Operands {
  const acc_t* kt_ptr;  // (B, Hkv, tiles, D, kBlockK)
  const acc_t* v_ptr;  // (B, Hkv, S, Dv), rows where v_rows says
  RowStrides v_rows;

  const acc_t* v_head(int64_t bh, int64_t Hkv) const { return v_ptr + v_rows.at(bh / Hkv, bh % Hkv, 0); }
};

// K^T tile-major and V in acc_t (V read in place when it is acc_t already), from k and v whose rows
// lie where ks and vs say.
template <typename scalar_t, typename acc_t>
Operands<acc_t> operands(const Shape& sh, const scalar_t* k, RowStrides ks, const scalar_t* v, RowStrides vs) {
  acc_t* kt = workspace<acc_t>(0, sh.B * sh.Hkv * tiles_of(sh.S) * sh.D * kBlockK);
  pack_tile_major(k, ks, sh, sh.D, kt);
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return {kt, v, vs};
  } else {
    acc_t* converted = workspace<acc_t>(1, sh.B * sh.Hkv * sh.S * sh.Dv);
    at::parallel_for(0, sh.B * sh.Hkv * sh.S, 1 << 10, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const scalar_t* src = v + vs.at(row / sh.S / sh.Hkv, row / sh.S % sh.Hkv, row % sh.S);
        std::transform(src, src + sh.Dv, converted + row * sh.Dv, [](scalar_t x) { return static_cast<acc_t>(x); });
      }
    });
    return {kt, converted, contiguous_rows(sh.Hkv, sh.S, sh.Dv)};
  }
}

// The D x n block of K^T for keys j0.. (within one tile), leading dimension kBlockK.
template <typename pointer>
pointer kt_block(pointer kt_head, int64_t D, int64_t j0) {
  return kt_head + (j0 / kBlockK) * D * kBlockK + j0 % kBlockK;
}

// The two tile products of the forward, on operands packed once per call:
//   scores      s (R x n) = scale * (q rows) . K^T (keys j0 .. j0 + n)
//   add_values  acc (R x Dv) += p (R x n) . V (keys j0 .. j0 + n)
// PlainProducts work in acc_t (float32 on brgemm, float64 on loops). kAlign: the key offsets and
// counts a product takes come in multiples of it.
template <typename scalar_t, typename acc_t>
struct PlainProducts {
  static constexpr int64_t kAlign = 1;
  static constexpr bool kScaled = true;  // the scores come scaled (the queries are packed scaled)
  const Shape& sh;
  acc_t scale;
  Operands<acc_t> ops;
  Scratch<acc_t> qp;  // the block's scaled queries

  PlainProducts(const Shape& shape, acc_t scale_, const scalar_t* k, RowStrides ks, const scalar_t* v, RowStrides vs)
      : sh(shape), scale(scale_), ops(operands<scalar_t, acc_t>(shape, k, ks, v, vs)) {}

  void pack_row(int64_t r, int64_t, const scalar_t* src) {
    acc_t* row = qp.at_least(kBlockQ * sh.D) + r * sh.D;
    for (int64_t d = 0; d < sh.D; ++d) row[d] = static_cast<acc_t>(src[d]) * scale;
  }
  void scores(int64_t bh, int64_t R, int64_t j0, int64_t n, acc_t* s) {
    const acc_t* kt_head = ops.kt_ptr + bh * tiles_of(sh.S) * sh.D * kBlockK;
    gemm_nn(R, n, sh.D, qp.data(), sh.D, kt_block(kt_head, sh.D, j0), kBlockK, s, n, false);
  }
  acc_t* weights(acc_t* s) { return s; }  // in place of the scores
  void add_values(int64_t bh, int64_t R, int64_t j0, int64_t n, const acc_t* s, acc_t* acc) {
    gemm_nn(R, sh.Dv, n, s, n, ops.v_head(bh, sh.Hkv) + j0 * ops.v_rows.row, ops.v_rows.row, acc, sh.Dv, true);
  }
};

#if defined(MHA_AVX512_BF16)
// VNNI pairs, tile by tile, of x (B, Hkv, S, X) in bfloat16, its rows where xs says, zero-padded (a key
// past an odd S, and to an even width; the keys past S to a multiple of key_align, which the AMX tiles
// read in steps of 32; a tile's keys further on are never read, nor written):
//   transposed: (BH, tiles, X2 / 2, kBlockK, 2), pairs along X (K^T, V^T: the B of products over X)
//   by rows:    (BH, tiles, kBlockK / 2, X, 2), pairs of keys (V, K: the B of products over keys)
inline void pack_pairs(const at::BFloat16* x, RowStrides xs, const Shape& sh, int64_t X, bool transposed,
                       at::BFloat16* out, int64_t key_align = 2) {
  const int64_t S = sh.S, Hkv = sh.Hkv, BH = sh.B * Hkv, tiles = tiles_of(S), X2 = X + X % 2;
  // a pair is one 32-bit word, its first value in the low half (x86 is little-endian)
  const auto pair = [](uint16_t first, uint16_t second) { return uint32_t(first) | uint32_t(second) << 16; };
  at::parallel_for(0, BH * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / tiles, first = (task % tiles) * kBlockK, n = std::min(kBlockK, S - first);
      uint32_t* dst = reinterpret_cast<uint32_t*>(out + task * (transposed ? X2 : X) * kBlockK);
      const at::BFloat16* head = x + xs.at(bh / Hkv, bh % Hkv, 0);
      const auto row = [&](int64_t j) { return first + j < S ? head + (first + j) * xs.row : nullptr; };
      if (transposed && X % 2 == 0 && xs.row % 2 == 0 && reinterpret_cast<uintptr_t>(head) % 4 == 0) {
        // the words' transpose, moved as floats are (8 x 8 in registers; whole floats apart)
        const float* words = reinterpret_cast<const float*>(head + first * xs.row);
        pack_tile(words, xs.row / 2, n, X / 2, reinterpret_cast<float*>(dst));
      } else if (transposed) {  // word (d / 2, j) of a (X2 / 2, kBlockK) matrix: values d and d + 1 of key j
        for (int64_t j = 0; j < padded_keys(n); ++j) {
          const at::BFloat16* r = row(j);
          for (int64_t d = 0; d < X2; d += 2) dst[(d / 2) * kBlockK + j] = !r ? 0 : pair(r[d].x, d + 1 < X ? r[d + 1].x : 0);
        }
      }
      // zeros to a multiple of key_align keys, which a product over whole steps of keys reads
      const int64_t padded = std::min(kBlockK, (n + key_align - 1) / key_align * key_align);
      if (transposed) {
        for (int64_t d = 0; d < X2 / 2; ++d) std::fill(dst + d * kBlockK + padded_keys(n), dst + d * kBlockK + padded, 0u);
      } else {  // word (j / 2, d) of a (kBlockK / 2, X) matrix: value d of keys j and j + 1
        for (int64_t j = 0; j < padded; j += 2) {
          const at::BFloat16 *a = row(j), *b = row(j + 1);
          uint32_t* words = dst + (j / 2) * X;
          if (b)
            for (int64_t d = 0; d < X; ++d) words[d] = pair(a[d].x, b[d].x);
          else if (a)  // the key past an odd S: a's values beside zeros
            for (int64_t d = 0; d < X; ++d) words[d] = pair(a[d].x, 0);
          else
            std::fill(words, words + X, 0u);
        }
      }
    }
  });
}

// ---- fused steps: scores, softmax and values of a few rows and keys at a time, in registers -------
//
// brgemm's products of a block run at the dot peak, but around them a tile's scores (64 x 256 floats,
// past the first-level cache) were written, read for their maxima, read again for the weights, and the
// weights written and read back: the bfloat16 forward took 1.22-1.40x its products' time (Zen 5). Where
// no term but the band shapes the scores (key positions in order), every tile runs here instead,
// kFusedRows rows by kFusedKeys keys a step: the scores in 16 registers (vdpbf16ps over the VNNI pairs
// Bf16Products packs), each row's keys past its interval (the band's) masked, the weights made there and
// rounded to bfloat16, then added times V into the rows' accumulators. The same products and weights as
// the tiles', in another order.
//
// A lazy shift: a row's weights are 2^((s scale - m) log2 e) against its running max m as long as no
// score of the step exceeds m by more than kLazyShift in log2 units (weights up to 2^kLazyShift, far
// from float's range; bfloat16's rounding is relative, the same at any size), so that the step neither
// takes its maxima nor rescales the row's accumulator. Any other row -- m still -inf, a score past the
// shift, a NaN or an infinity, m past kFoldedShift or fused_exponent's bound -- takes absorb (the exact
// path of every other tile) for the step. m is then a reference at most kLazyShift / log2 e below the
// row's max, and m + log l its log-sum-exp, which is all the backward and a split block's merge take
// of them; l then sums rounded weights above 1 too (a row's largest weight was 1, exact), its
// log-sum-exp within bfloat16's rounding of a weight (4e-3). A shift of 0 (the exact max whenever a
// score passes it) took absorb so often that the forward was slower than the tiles (1.02-1.08x).
constexpr int64_t kFusedKeys = 64;  // four vectors of keys
static_assert(kBlockK == 4 * kFusedKeys, "amx_fused_run: a tile's four steps, a chain of sums each");
constexpr int kFusedRows = 4;
constexpr float kLazyShift = 8.0f;

// One step's operands: ``count`` keys (1..kFusedKeys), key pair p of dimension pair d at kt[d * ldk + 2 p
// (+1)], V's key pair p at vv + p * 2 Dv, the step's first key key0 (its index in the sequence), and the
// scores of a group's rows that take absorb (kFusedRows x kFusedKeys).
struct FusedStep {
  int64_t D2, Dv, count, ldk, key0;
  const at::BFloat16* kt;
  const at::BFloat16* vv;
  float scale;
  float* raw;
  __mmask16 lanes[4];  // the keys of each vector that lie in the step
  void lanes_of_count() {  // lanes: the step's first ``count`` keys
    for (int c = 0; c < 4; ++c) lanes[c] = tail_mask(std::clamp<int64_t>(count - 16 * c, 0, 16));
  }
};

// The lanes of the step's keys that a row sees: of each vector, keys key0 + 16 c + lane in [first, stop).
inline void row_lanes(const FusedStep& f, int64_t first, int64_t stop, __mmask16 (&lanes)[4]) {
  const int64_t lo = std::clamp<int64_t>(first - f.key0, 0, f.count), hi = std::clamp<int64_t>(stop - f.key0, lo, f.count);
  const auto below = [](int64_t n) { return n >= 64 ? ~uint64_t(0) : (uint64_t(1) << n) - 1; };
  const uint64_t seen = below(hi) & ~below(lo);
  for (int c = 0; c < 4; ++c) lanes[c] = static_cast<__mmask16>(seen >> (16 * c));
}

// s[r][c] = q_r . k for the keys of vector c (zero past count). A whole step's keys are read by plain
// loads: masked ones took 1.08x the forward's time (Zen 5).
template <int kRows, bool kWhole>
[[gnu::always_inline]] inline void scores_of(const FusedStep& f, const at::BFloat16* q, __m512 (&s)[kRows][4]) {
  #pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r)
    #pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) s[r][c] = _mm512_setzero_ps();
  const int32_t* words = reinterpret_cast<const int32_t*>(q);  // a row's dimension pairs
  for (int64_t d = 0; d < f.D2 / 2; ++d) {
    __m512bh k[4];
    #pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const at::BFloat16* keys = f.kt + d * f.ldk + 32 * c;
      k[c] = (__m512bh)(kWhole ? _mm512_loadu_si512(keys) : _mm512_maskz_loadu_epi32(f.lanes[c], keys));
    }
    #pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(words[r * f.D2 / 2 + d]);
      #pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) s[r][c] = _mm512_dpbf16_ps(s[r][c], pair, k[c]);
    }
  }
}

template <int kRows>
[[gnu::always_inline]] inline void fused_scores(const FusedStep& f, const at::BFloat16* q, __m512 (&s)[kRows][4]) {
  if (f.count == kFusedKeys) scores_of<kRows, true>(f, q, s);
  else scores_of<kRows, false>(f, q, s);
}

// Whether a row of running max m may take its weights lazily (above): m finite, within kFoldedShift and
// fused_exponent's bound.
inline bool lazy_shift_takes(float scale, float m) {
  return m > -std::numeric_limits<float>::infinity() && folded_exponent(m) && fused_exponent(scale, m);
}

// One step's lazy weights of a row (scores s, the keys it sees lanes; 0 elsewhere) into w, their sum into
// the chain ``sum``, at 2^(s a - b) (a = scale log2 e, b = m log2 e); false, with nothing added, where some
// score passes the shift or is NaN (absorb then makes the row's weights).
[[gnu::always_inline]] inline bool lazy_step(const __m512 (&s)[4], const __mmask16 (&lanes)[4], __m512 a, __m512 b, at::BFloat16* w,
                                             __m512& sum) {
  __m512 u[4];
  __mmask16 past = 0;  // a score past the shift, or NaN
  #pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    u[c] = _mm512_fmsub_ps(s[c], a, b);
    past |= _mm512_mask_cmp_ps_mask(lanes[c], u[c], _mm512_set1_ps(kLazyShift), _CMP_NLE_UQ);
  }
  if (past) return false;
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);
  const __m512bh low = _mm512_cvtne2ps_pbh(exp2_16_for_bf16(u[1], lanes[1]), exp2_16_for_bf16(u[0], lanes[0]));
  const __m512bh high = _mm512_cvtne2ps_pbh(exp2_16_for_bf16(u[3], lanes[3]), exp2_16_for_bf16(u[2], lanes[2]));
  _mm512_storeu_si512(w, (__m512i)low);
  _mm512_storeu_si512(w + 32, (__m512i)high);
  sum = _mm512_dpbf16_ps(_mm512_dpbf16_ps(sum, low, ones), high, ones);
  return true;
}

inline __m512 lazy_factor(float x) { return _mm512_set1_ps(x * 1.44269504088896341f); }  // x log2 e

// A row's weights of the keys it sees (lanes; 0 elsewhere) into w, lazily where it may (above), else not
// (false: absorb makes them); their sum into the row's vector of sums.
[[gnu::always_inline]] inline bool lazy_weights(const FusedStep& f, const __m512 (&s)[4], const __mmask16 (&lanes)[4], float m,
                                                at::BFloat16* w, float* sums) {
  if (!lazy_shift_takes(f.scale, m)) return false;
  __m512 sum = _mm512_loadu_ps(sums);
  if (!lazy_step(s, lanes, lazy_factor(f.scale), lazy_factor(m), w, sum)) return false;
  _mm512_storeu_ps(sums, sum);
  return true;
}

// The step's weights of kRows rows (m, l, acc, keys theirs), in w (kRows x kFusedKeys).
// sums: the rows' vector sums of their lazy weights (16 floats a row), which join l before absorb and at
// the run's end. The rows that take absorb do after the others, their scores stored (a call with the
// scores live in registers spilled them all: no vector register survives a call).
// kMasked: each row's keys masked to its interval, where the band hides some key of the tile from some
// row (its rows' masks, apart, took 1.02-1.04x a plain tile's time).
template <int kRows, bool kMasked>
[[gnu::always_inline]] inline void fused_weights(const FusedStep& f, const __m512 (&s)[kRows][4], float* m, float* l, float* acc, float* sums,
                                                  const int64_t* first, const int64_t* stop, at::BFloat16* w) {
  const __m512 hidden = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  unsigned exact = 0;  // the rows that take absorb
  #pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
    __mmask16 lanes[4] = {f.lanes[0], f.lanes[1], f.lanes[2], f.lanes[3]};
    if constexpr (kMasked) row_lanes(f, first[r], stop[r], lanes);
    if (lazy_weights(f, s[r], lanes, m[r], w + r * kFusedKeys, sums + 16 * r)) continue;
    exact |= 1u << r;
    #pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(f.raw + r * kFusedKeys + 16 * c, _mm512_mask_blend_ps(lanes[c], hidden, s[r][c]));
  }
  for (int r = 0; r < kRows; ++r) {
    if (!(exact >> r & 1u)) continue;
    at::BFloat16* row = w + r * kFusedKeys;
    l[r] += _mm512_reduce_add_ps(_mm512_loadu_ps(sums + 16 * r));
    _mm512_storeu_ps(sums + 16 * r, _mm512_setzero_ps());
    absorb(f.count, f.raw + r * kFusedKeys, f.scale, m[r], l[r], acc + r * f.Dv, f.Dv, row);
    std::fill(row + f.count, row + kFusedKeys, at::BFloat16(0.0f));  // (the pair past an odd count reads one)
  }
}

// acc[r][c0 .. c0 + 16 kCols) += w_r . V over the step's keys.
template <int kRows, int kCols>
[[gnu::always_inline]] inline void fused_values(const FusedStep& f, const at::BFloat16* w, int64_t c0, float* acc) {
  __m512 o[kRows][kCols];
  #pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r)
    #pragma GCC unroll 4
    for (int c = 0; c < kCols; ++c) o[r][c] = _mm512_loadu_ps(acc + r * f.Dv + c0 + 16 * c);
  const int32_t* pairs = reinterpret_cast<const int32_t*>(w);  // a row's weights, two keys a word
  for (int64_t p = 0; p < (f.count + 1) / 2; ++p) {
    __m512bh v[kCols];
    #pragma GCC unroll 4
    for (int c = 0; c < kCols; ++c) v[c] = (__m512bh)_mm512_loadu_si512(f.vv + p * 2 * f.Dv + 2 * c0 + 32 * c);
    #pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m512bh weight = (__m512bh)_mm512_set1_epi32(pairs[r * kFusedKeys / 2 + p]);
      #pragma GCC unroll 4
      for (int c = 0; c < kCols; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], weight, v[c]);
    }
  }
  #pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r)
    #pragma GCC unroll 4
    for (int c = 0; c < kCols; ++c) _mm512_storeu_ps(acc + r * f.Dv + c0 + 16 * c, o[r][c]);
}

// A group's scores and weights (w), and its values (acc): a group's values are added after the next
// group's weights are made, so that the softmax's operations, which wait on the scores, run beside
// products that do not wait on them (and the weights' stores are long done when they are read).
template <int kRows, bool kMasked>
void group_weights(const FusedStep& f, const at::BFloat16* q, float* m, float* l, float* acc, float* sums, const int64_t* first,
                   const int64_t* stop, at::BFloat16* w) {
  __m512 s[kRows][4];
  fused_scores<kRows>(f, q, s);
  fused_weights<kRows, kMasked>(f, s, m, l, acc, sums, first, stop, w);
}

template <int kRows>
void group_values(const FusedStep& f, const at::BFloat16* w, float* acc) {
  for (int64_t c0 = 0; c0 < f.Dv; c0 += 64) {
    switch (std::min<int64_t>(4, (f.Dv - c0) / 16)) {
      case 4: fused_values<kRows, 4>(f, w, c0, acc); break;
      case 3: fused_values<kRows, 3>(f, w, c0, acc); break;
      case 2: fused_values<kRows, 2>(f, w, c0, acc); break;
      default: fused_values<kRows, 1>(f, w, c0, acc);
    }
  }
}

// call(std::integral_constant<int, rows>) for a group of 1..kFusedRows rows
template <typename Call>
inline void with_group_rows(int64_t rows, Call&& call) {
  switch (rows) {
    case 4: call(std::integral_constant<int, 4>{}); break;
    case 3: call(std::integral_constant<int, 3>{}); break;
    case 2: call(std::integral_constant<int, 2>{}); break;
    default: call(std::integral_constant<int, 1>{});
  }
}

#if defined(MHA_AMX)
bool amx_present();  // (the AMX section's)
#endif

// Whether fused steps take a block's bfloat16 products: Dv in whole vectors (the accumulators' columns),
// on a CPU without AMX tiles (where brgemm's products, and AmxProducts', run on them, far past vdpbf16ps).
inline bool fused_steps_take(int64_t Dv) {
#if defined(MHA_AMX)
  if (amx_present()) return false;
#endif
  return Dv % 16 == 0;
}

// A run's operands in Bf16Products' layouts: the block's queries q (rows of D2), and the run's first key
// in a tile's K^T (its dimension pairs 2 kBlockK apart) and V (key pairs of Dv words); a thread's buffers.
struct FusedOperands {
  const at::BFloat16* q;
  int64_t D2, Dv;
  const at::BFloat16* kt;
  const at::BFloat16* vv;
};

struct FusedBuffers {
  Scratch<float> sums, raw, scores;
  Scratch<at::BFloat16> weights;
};

// A tile's ``keys`` keys from j0 (those before S) for the block's R rows, each seeing those of its
// interval (``seen``; every row all of them where ``covered``), kFusedKeys a step, kFusedRows rows a
// group; their weights' lazy sums join l at the tile's end.
inline void fused_run(FusedBuffers& buffers, const FusedOperands& x, const RowKeys& seen, bool covered, int64_t R, int64_t j0,
                      int64_t keys, float scale, float* m, float* l, float* acc) {
  float* sums = buffers.sums.at_least(kBlockQ * 16);
  std::fill_n(sums, R * 16, 0.0f);
  FusedStep f{x.D2, x.Dv, 0, 2 * kBlockK, 0, nullptr, nullptr, scale, buffers.raw.at_least(kFusedRows * kFusedKeys), {}};
  constexpr int64_t kGroupWeights = kFusedRows * kFusedKeys;
  at::BFloat16* weights = buffers.weights.at_least(2 * kGroupWeights);  // two groups': one's values wait on the next's weights
  const auto weights_of = [&](int64_t g) { return weights + g / kFusedRows % 2 * kGroupWeights; };
  for (int64_t k0 = 0; k0 < keys; k0 += kFusedKeys) {
    f.count = std::min(kFusedKeys, keys - k0);
    f.key0 = j0 + k0;
    f.kt = x.kt + 2 * k0;
    f.vv = x.vv + k0 * x.Dv;
    f.lanes_of_count();
    int64_t waiting = -1;  // the group whose values are added next
    for (int64_t g = 0; g < R; g += kFusedRows) {
      with_group_rows(std::min<int64_t>(kFusedRows, R - g), [&](auto rows) {
        const auto weights = covered ? group_weights<rows, false> : group_weights<rows, true>;
        weights(f, x.q + g * x.D2, m + g, l + g, acc + g * x.Dv, sums + 16 * g, seen.first.data() + g, seen.stop.data() + g,
                weights_of(g));
      });
      if (waiting >= 0) group_values<kFusedRows>(f, weights_of(waiting), acc + waiting * x.Dv);  // (a whole group)
      waiting = g;
    }
    with_group_rows(R - waiting, [&](auto rows) { group_values<rows>(f, weights_of(waiting), acc + waiting * x.Dv); });
  }
  for (int64_t r = 0; r < R; ++r) l[r] += _mm512_reduce_add_ps(_mm512_loadu_ps(sums + 16 * r));
}

// bfloat16 operands in VNNI pairs (two consecutive values of the product's inner dim side by side)
// for brgemm's vdpbf16ps products, accumulated in float32: no score is rounded to bfloat16 (the
// queries and keys are the inputs' own values); the weights p are rounded to bfloat16 for P . V.
//   K^T (B, Hkv, tiles, D2 / 2, kBlockK, 2)   V (B, Hkv, tiles, kBlockK / 2, Dv, 2)   D2 = D rounded up to even
struct Bf16Products {
  static constexpr int64_t kAlign = 2;
  static constexpr bool kScaled = false;
  using bf16 = at::BFloat16;
  const Shape& sh;
  float scale;
  int64_t D2;
  const bf16* kt;
  const bf16* vv;
  Scratch<bf16> qb;  // the block's queries, their pad column (D odd) zero
  Scratch<bf16> pb;            // the tile's weights

  Bf16Products(const Shape& shape, float scale_, const bf16* k, RowStrides ks, const bf16* v, RowStrides vs,
               int64_t key_align = 2)
      : sh(shape), scale(scale_), D2(shape.D + shape.D % 2) {
    const int64_t tiles = tiles_of(sh.S), BH = sh.B * sh.Hkv;
    bf16* kt_ = workspace<bf16>(0, BH * tiles * D2 * kBlockK);
    bf16* vv_ = workspace<bf16>(1, BH * tiles * kBlockK * sh.Dv);
    pack_pairs(k, ks, sh, sh.D, true, kt_, key_align);
    pack_pairs(v, vs, sh, sh.Dv, false, vv_, key_align);
    kt = kt_;
    vv = vv_;
  }

  void pack_row(int64_t r, int64_t, const bf16* src) {
    if (qb.data() == nullptr) std::fill_n(qb.at_least(kBlockQ * D2), kBlockQ * D2, bf16(0.0f));
    std::copy(src, src + sh.D, qb.data() + r * D2);
  }
  void scores(int64_t bh, int64_t R, int64_t j0, int64_t n, float* s) {  // unscaled: the softmax scales them
    const bf16* tile = kt + (bh * tiles_of(sh.S) + j0 / kBlockK) * D2 * kBlockK;
    at::native::cpublas::brgemm(R, n, D2, D2, kBlockK, n, false, qb.data(), tile + 2 * (j0 % kBlockK), s, true);
  }
  bf16* weights(float*) {
    return pb.at_least(kBlockQ * kBlockK);
  }
  void add_values(int64_t bh, int64_t R, int64_t j0, int64_t n, const float*, float* acc) {
    const bf16* tile = vv + (bh * tiles_of(sh.S) + j0 / kBlockK) * kBlockK * sh.Dv;
    at::native::cpublas::brgemm(R, sh.Dv, n, n, sh.Dv, sh.Dv, true, pb.data(), tile + (j0 % kBlockK) * sh.Dv, acc, true);
  }
  // A tile's keys j0 .. j0 + keys - 1 (before S; j0 even) for the block's R rows on fused steps
  // (fused_run), their scores times ``scale`` in the softmax; where fuses(R).
  bool fuses(int64_t) const { return fused_steps_take(sh.Dv); }
  void fused_keys(const RowKeys& seen, bool covered, int64_t bh, int64_t R, int64_t j0, int64_t keys, float scale, float* m,
                  float* l, float* acc) {
    const int64_t tile = bh * tiles_of(sh.S) + j0 / kBlockK, first = j0 % kBlockK;  // (even: pairs of keys)
    const FusedOperands x{qb.data(), D2, sh.Dv, kt + tile * D2 * kBlockK + 2 * first, vv + (tile * kBlockK + first) * sh.Dv};
    fused_run(fused, x, seen, covered, R, j0, keys, scale, m, l, acc);
  }

 private:
  FusedBuffers fused;
};
#endif

#if defined(MHA_AMX)
// ---- AMX: bfloat16 tile products on the CPU's tile registers -------------------------------------
//
// On a CPU with AMX (amx_tile, amx_bf16; Intel Xeon from Sapphire Rapids on) a tile register holds 16
// rows of 64 bytes, and one tdpbf16ps adds A (16 x 32 bfloat16) times B (32 x 16, in VNNI pairs: 16 rows
// of 16 pairs) to C (16 x 16 float32): 8192 products in about 16 cycles, four times what torch's
// brgemm calls delivered to this kernel's tiles (measured: 3.5-3.7 TFLOP/s a core against brgemm's
// ~0.9 at the forward's shapes, Xeon with AMX). The forward's products are two such grids over the
// operands Bf16Products packs (K^T and V in VNNI pairs): S = Q K^T over D in steps of 32, and
// acc += P V over the keys in steps of 32. The instructions are written as their bytes (VEX-encoded,
// the address in rax + rcx, as the assembler encodes the same mnemonics: checked with objdump), so that
// an assembler older than AMX (binutils before 2.34) still builds the kernel; each states that it
// reads and writes memory ("memory"), so that the compiler keeps the weights' stores before the tile
// loads that read them (the compiler's own _tile_loadd states no memory it reads).
//   tileloadd (%rax,%rcx,1), %tmmT    C4 E2 7B 4B 04+8T 08     tilezero %tmmT     C4 E2 7B 49 C0+8T
//   tilestored %tmmT, (%rax,%rcx,1)   C4 E2 7A 4B 04+8T 08     ldtilecfg (%rax)   C4 E2 78 49 00
//   tdpbf16ps %tmmB, %tmmA, %tmmC     C4 E2 02+8(15-B) 5C C0+8C+A                tilerelease        C4 E2 78 49 C0
#define MHA_TILE_LOAD(t, p, ld) \
  __asm__ volatile(".byte 0xc4, 0xe2, 0x7b, 0x4b, 0x04 + ((" #t ") << 3), 0x08" ::"a"(p), "c"(static_cast<long>(ld)) : "memory")
#define MHA_TILE_STORE(t, p, ld) \
  __asm__ volatile(".byte 0xc4, 0xe2, 0x7a, 0x4b, 0x04 + ((" #t ") << 3), 0x08" ::"a"(p), "c"(static_cast<long>(ld)) : "memory")
#define MHA_TILE_ZERO(t) __asm__ volatile(".byte 0xc4, 0xe2, 0x7b, 0x49, 0xc0 + ((" #t ") << 3)" ::)
#define MHA_TILE_DP(c, a, b) \
  __asm__ volatile(".byte 0xc4, 0xe2, 0x02 + ((15 - (" #b ")) << 3), 0x5c, 0xc0 + ((" #c ") << 3) + (" #a ")" ::)
// tdpbssd (signed A, signed B) and tdpbsud (signed A, unsigned B): C (int32) += the dot products of A's
// and B's groups of 4 bytes
#define MHA_TILE_DP_SS(c, a, b) \
  __asm__ volatile(".byte 0xc4, 0xe2, 0x03 + ((15 - (" #b ")) << 3), 0x5e, 0xc0 + ((" #c ") << 3) + (" #a ")" ::)
#define MHA_TILE_DP_SU(c, a, b) \
  __asm__ volatile(".byte 0xc4, 0xe2, 0x02 + ((15 - (" #b ")) << 3), 0x5e, 0xc0 + ((" #c ") << 3) + (" #a ")" ::)

std::atomic<bool> amx_wanted{true};  // set_amx (tests, A/B runs): whether bfloat16 products may use AMX

// Whether this CPU has AMX's bfloat16 tiles and the OS lets this process use them (Linux grants the
// tile data state on request: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); asked once.
// CPUID leaf 7's EDX (AMX-BF16 bit 22, AMX-TILE 24, AMX-INT8 25), read once; 0 where the leaf is absent.
unsigned leaf7_edx() {
  static const unsigned edx = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) ? d : 0u;
  }();
  return edx;
}

bool amx_present() {
  static const bool present =
      ((leaf7_edx() >> 22) & 1u) && ((leaf7_edx() >> 24) & 1u) && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return present;
}

bool amx_usable() { return amx_wanted.load(std::memory_order_relaxed) && amx_present(); }

// amx_usable, and the tiles' 8-bit products (AMX-INT8) are there too.
bool amx_int8_usable() { return ((leaf7_edx() >> 25) & 1u) && amx_usable(); }

// The head dims the tile products take: whole steps of 32 of D (a tile's 64 bytes of bfloat16) and whole
// tiles of 16 values of Dv (one tile's float32 columns); others run on Bf16Products (brgemm).
bool amx_fits(int64_t D, int64_t Dv) { return D > 0 && Dv > 0 && D % 32 == 0 && Dv % 16 == 0; }

// Tile (i, j) of a grid of 16-row tiles at p + i * di + j * dj (bytes), its rows ld bytes apart.
struct TileGrid {
  const char* p;
  int64_t ld, di, dj;
  const char* at(int64_t i, int64_t j) const { return p + i * di + j * dj; }
};

// C tiles (i..i+kM, j..j+kN) (+)= sum over k < steps of A (i, k) B (k, j): C in tmm0-3 (tmm 2 i' + j'),
// A in tmm4-5, B in tmm6-7; each A and B tile loaded once for kM x kN products.
template <int kM, int kN>
inline void tile_block(int64_t i, int64_t j, int64_t steps, bool accumulate, const TileGrid& a, const TileGrid& b,
                       const TileGrid& c) {
  if (accumulate) {
    MHA_TILE_LOAD(0, c.at(i, j), c.ld);
    if constexpr (kN > 1) MHA_TILE_LOAD(1, c.at(i, j + 1), c.ld);
    if constexpr (kM > 1) MHA_TILE_LOAD(2, c.at(i + 1, j), c.ld);
    if constexpr (kM > 1 && kN > 1) MHA_TILE_LOAD(3, c.at(i + 1, j + 1), c.ld);
  } else {
    MHA_TILE_ZERO(0);
    if constexpr (kN > 1) MHA_TILE_ZERO(1);
    if constexpr (kM > 1) MHA_TILE_ZERO(2);
    if constexpr (kM > 1 && kN > 1) MHA_TILE_ZERO(3);
  }
  for (int64_t k = 0; k < steps; ++k) {
    MHA_TILE_LOAD(4, a.at(i, k), a.ld);
    if constexpr (kM > 1) MHA_TILE_LOAD(5, a.at(i + 1, k), a.ld);
    MHA_TILE_LOAD(6, b.at(k, j), b.ld);
    if constexpr (kN > 1) MHA_TILE_LOAD(7, b.at(k, j + 1), b.ld);
    MHA_TILE_DP(0, 4, 6);
    if constexpr (kN > 1) MHA_TILE_DP(1, 4, 7);
    if constexpr (kM > 1) MHA_TILE_DP(2, 5, 6);
    if constexpr (kM > 1 && kN > 1) MHA_TILE_DP(3, 5, 7);
  }
  MHA_TILE_STORE(0, c.at(i, j), c.ld);
  if constexpr (kN > 1) MHA_TILE_STORE(1, c.at(i, j + 1), c.ld);
  if constexpr (kM > 1) MHA_TILE_STORE(2, c.at(i + 1, j), c.ld);
  if constexpr (kM > 1 && kN > 1) MHA_TILE_STORE(3, c.at(i + 1, j + 1), c.ld);
}

// C (M x N tiles) (+)= A (M x steps tiles) B (steps x N tiles), in blocks of 2 x 2 tiles (and the edges'),
// a column of blocks at a time: B's tiles, read from the second-level cache, are read again from the first.
inline void tile_product(int64_t M, int64_t N, int64_t steps, bool accumulate, const TileGrid& a, const TileGrid& b,
                         const TileGrid& c) {
  for (int64_t j = 0; j < N; j += 2)
    for (int64_t i = 0; i < M; i += 2) {
      const bool two_i = i + 1 < M, two_j = j + 1 < N;
      if (two_i && two_j) tile_block<2, 2>(i, j, steps, accumulate, a, b, c);
      else if (two_i) tile_block<2, 1>(i, j, steps, accumulate, a, b, c);
      else if (two_j) tile_block<1, 2>(i, j, steps, accumulate, a, b, c);
      else tile_block<1, 1>(i, j, steps, accumulate, a, b, c);
    }
}

// C (M x N tiles) = A (M x 2 tiles) B (2 x N tiles), two steps (D = 64): A's tiles of two rows of tiles
// loaded once (tmm4-7) for all N columns, B's two a column (tmm2-3), C's two (tmm0-1): two loads a column
// of two products where tile_product's blocks load four (the scores' product took 0.94x the time).
template <int kM>
inline void rows_resident(int64_t i, int64_t N, const TileGrid& a, const TileGrid& b, const TileGrid& c) {
  MHA_TILE_LOAD(4, a.at(i, 0), a.ld);
  MHA_TILE_LOAD(5, a.at(i, 1), a.ld);
  if constexpr (kM > 1) {
    MHA_TILE_LOAD(6, a.at(i + 1, 0), a.ld);
    MHA_TILE_LOAD(7, a.at(i + 1, 1), a.ld);
  }
  for (int64_t j = 0; j < N; ++j) {
    MHA_TILE_LOAD(2, b.at(0, j), b.ld);
    MHA_TILE_LOAD(3, b.at(1, j), b.ld);
    MHA_TILE_ZERO(0);
    MHA_TILE_DP(0, 4, 2);
    if constexpr (kM > 1) {
      MHA_TILE_ZERO(1);
      MHA_TILE_DP(1, 6, 2);
    }
    MHA_TILE_DP(0, 5, 3);
    if constexpr (kM > 1) MHA_TILE_DP(1, 7, 3);
    MHA_TILE_STORE(0, c.at(i, j), c.ld);
    if constexpr (kM > 1) MHA_TILE_STORE(1, c.at(i + 1, j), c.ld);
  }
}

inline void two_step_product(int64_t M, int64_t N, const TileGrid& a, const TileGrid& b, const TileGrid& c) {
  for (int64_t i = 0; i < M; i += 2)
    if (i + 1 < M) rows_resident<2>(i, N, a, b, c);
    else rows_resident<1>(i, N, a, b, c);
}

// The shapes this thread's tile registers take (palette 1): the products'
// (tile_product, amx_scores, amx_add_values: rows of 64 bytes), or a decoding step's scores
// (tile_score_block: tmm1 16 keys x 32 of D, 64 bytes; tmm0 16 keys x 4 query rows of float32 and
// tmm2-7 4 rows' query pairs, 16 bytes), or its values' (tile_value_block: tmm0-4 8 rows, tmm5-7 16, all
// of 64 bytes). Which one is loaded is the thread's own (tile_shape), so that
// a step's scores inside a prompt's run (a paged batch's decoding rows beside its prompt) put the
// products' shape back. torch's brgemm remembers per thread which of its kernels last set the tiles
// (Brgemm::get_current) and skips setting them again for that one: brgemm_release first clears it (and
// releases oneDNN's context); each run of tiles ends released (release_tiles), as torch's runs end.
enum class TileShape : uint8_t { none, products, step_scores, step_values };
inline thread_local TileShape tile_shape = TileShape::none;

// Loads ``shape`` where another (or none) is loaded; returns the one before.
inline TileShape use_tiles(TileShape shape) {
  const TileShape before = tile_shape;
  if (before == shape) return before;
  if (before == TileShape::none) at::native::cpublas::brgemm_release(true);
  alignas(64) uint8_t config[64] = {};
  config[0] = 1;  // palette 1
  for (int t = 0; t < 8; ++t) {
    const bool narrow = shape == TileShape::step_scores && t != 1;
    config[16 + 2 * t] = narrow ? 16 : 64;                          // bytes a row (colsb, little-endian 16 bits)
    config[48 + t] = shape == TileShape::step_values && t < 5 ? 8 : 16;  // rows
  }
  __asm__ volatile(".byte 0xc4, 0xe2, 0x78, 0x49, 0x00" ::"a"(config), "m"(*reinterpret_cast<const uint8_t(*)[64]>(config)));  // ldtilecfg (%rax)
  tile_shape = shape;
  return before;
}

inline void release_tiles() {
  if (tile_shape == TileShape::none) return;
  __asm__ volatile(".byte 0xc4, 0xe2, 0x78, 0x49, 0xc0" ::);  // tilerelease
  tile_shape = TileShape::none;
}

inline void restore_tiles(TileShape before) {
  if (before == TileShape::none) release_tiles();
  else use_tiles(before);
}

// The two products of a block's tile on AMX tiles, over operands in Bf16Products' layouts: R rows (in
// whole tiles of 16: the caller's buffers hold that many, and the rows past R are computed and never
// read), n keys (a multiple of 32), D2 (a multiple of 32) and Dv (of 16).
//   scores      s (R x n, float32)      = q (R x D2, bf16, rows D2 apart) . K^T at kt (D2 / 2 rows of kBlockK pairs)
//   add_values  acc (R x Dv, float32) += p (R x n, bf16) . V at vv (n / 2 rows of Dv pairs)
// (lds, ldp: the rows of s and p that many values apart, where not n)
inline void amx_scores(int64_t R, int64_t n, int64_t D2, const at::BFloat16* q, const at::BFloat16* kt, float* s,
                       int64_t lds = 0) {
  lds = lds ? lds : n;
  const TileGrid a{reinterpret_cast<const char*>(q), D2 * 2, 16 * D2 * 2, 64};  // 16 rows x 32 of D
  const TileGrid b{reinterpret_cast<const char*>(kt), kBlockK * 4, 16 * kBlockK * 4, 64};  // 16 pairs of D x 16 keys
  const TileGrid c{reinterpret_cast<const char*>(s), lds * 4, 16 * lds * 4, 64};
  if (D2 == 64) two_step_product((R + 15) / 16, n / 16, a, b, c);
  else tile_product((R + 15) / 16, n / 16, D2 / 32, false, a, b, c);
}

inline void amx_add_values(int64_t R, int64_t n, int64_t Dv, const at::BFloat16* p, const at::BFloat16* vv, float* acc,
                           int64_t ldp = 0) {
  ldp = ldp ? ldp : n;
  const TileGrid a{reinterpret_cast<const char*>(p), ldp * 2, 16 * ldp * 2, 64};  // 16 rows x 32 keys
  const TileGrid b{reinterpret_cast<const char*>(vv), Dv * 4, 16 * Dv * 4, 64};  // 16 pairs of keys x 16 of Dv
  const TileGrid c{reinterpret_cast<const char*>(acc), Dv * 4, 16 * Dv * 4, 64};
  tile_product((R + 15) / 16, Dv / 16, n / 32, true, a, b, c);
}


// A tile's ``keys`` keys from j0 for the block's R rows (fused_run's contract) on AMX tiles: the tile's
// scores of every row on the tiles, then each row's weights in one pass over them with fused_run's lazy
// shift, decided for the row's whole tile (a weight made against m before a later key raised it would be
// too large), else absorb's exact pass (its max, the accumulator rescaled), then every row's weights
// times V on the tiles. (The tiles' own path takes the row maxima in a pass of their own and rescales
// each row's accumulator every tile.) The products span the keys rounded up to 32 (the
// tiles' step; V holds zeros from S to the next 32, the weights of keys past ``keys`` are 0); the rows
// of s and w are ``ld`` apart, the keys rounded up to kFusedKeys (a lazy step's four vectors).
inline void amx_fused_run(FusedBuffers& buffers, const FusedOperands& x, const RowKeys& seen, bool covered, int64_t R,
                          int64_t j0, int64_t keys, float scale, float* m, float* l, float* acc) {
  const int64_t n = (keys + 31) / 32 * 32, ld = (keys + kFusedKeys - 1) / kFusedKeys * kFusedKeys;
  const int64_t R16 = (R + 15) / 16 * 16;  // (the tiles' rows: those past R are computed and never read)
  float* s = buffers.scores.at_least(kBlockQ * kBlockK);
  at::BFloat16* w = buffers.weights.at_least(kBlockQ * kBlockK);
  std::fill(w + R * ld, w + R16 * ld, at::BFloat16(0.0f));
  use_tiles(TileShape::products);
  amx_scores(R, n, x.D2, x.q, x.kt, s, ld);
  constexpr int kSteps = kBlockK / kFusedKeys;
  const int64_t steps = ld / kFusedKeys;
  FusedStep step[kSteps];  // the tile's steps, their lanes the keys that lie in them (every row's, where covered)
  for (int64_t k = 0; k < steps; ++k) {
    step[k] = FusedStep{x.D2, x.Dv, std::min(kFusedKeys, keys - k * kFusedKeys), 0, j0 + k * kFusedKeys, nullptr, nullptr, scale,
                        nullptr, {}};
    step[k].lanes_of_count();
  }
  const auto lanes_of = [&](int64_t r, int64_t k, __mmask16 (&lanes)[4]) {  // the keys of step k row r sees
    for (int c = 0; c < 4; ++c) lanes[c] = step[k].lanes[c];
    if (!covered) row_lanes(step[k], seen.first[r], seen.stop[r], lanes);
  };
  const __m512 hidden = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 a = lazy_factor(scale);
  for (int64_t r = 0; r < R; ++r) {
    float* row = s + r * ld;
    at::BFloat16* weights = w + r * ld;
    if (lazy_shift_takes(scale, m[r])) {  // the row's steps, each a chain of sums (vdpbf16ps' latency)
      const __m512 b = lazy_factor(m[r]);
      __m512 sums[kSteps] = {};
      bool lazy = true;
      #pragma GCC unroll 4
      for (int64_t k = 0; k < kSteps; ++k) {
        if (k >= steps) break;
        __mmask16 lanes[4];
        lanes_of(r, k, lanes);
        const float* v0 = row + k * kFusedKeys;
        const __m512 v[4] = {_mm512_load_ps(v0), _mm512_load_ps(v0 + 16), _mm512_load_ps(v0 + 32), _mm512_load_ps(v0 + 48)};
        if (!lazy_step(v, lanes, a, b, weights + k * kFusedKeys, sums[k])) {
          lazy = false;
          break;
        }
      }
      if (lazy) {
        static_assert(kSteps == 4, "the row's four chains of sums");
        l[r] += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3])));
        continue;
      }
    }
    for (int64_t k = 0; !covered && k < steps; ++k) {  // each key outside the row's interval hidden
      __mmask16 lanes[4];
      lanes_of(r, k, lanes);
      float* v0 = row + k * kFusedKeys;
      for (int c = 0; c < 4; ++c) _mm512_store_ps(v0 + 16 * c, _mm512_mask_blend_ps(lanes[c], hidden, _mm512_load_ps(v0 + 16 * c)));
    }
    absorb(keys, row, scale, m[r], l[r], acc + r * x.Dv, x.Dv, weights);
    std::fill(weights + keys, weights + ld, at::BFloat16(0.0f));
  }
  amx_add_values(R, n, x.Dv, w, x.vv, acc, ld);
}

// The forward's bfloat16 products on AMX tiles (run_forward picks them where amx_usable() and D is a
// multiple of 32 and Dv of 16): Bf16Products' packed operands and interface on amx_scores and
// amx_add_values. Its keys come in steps of 32 (kAlign: block_keys widens a block's keys to them; V's
// padding keys are zeros) and its rows in tiles of 16 (kRowAlign).
struct AmxProducts : Bf16Products {
  static constexpr int64_t kAlign = 32;
  static constexpr int64_t kRowAlign = 16;
  static_assert(kRowAlign % 16 == 0 && kAlign % 32 == 0, "a tile's 16 rows, a product's 32 keys a step");
  AmxProducts(const Shape& shape, float scale_, const bf16* k, RowStrides ks, const bf16* v, RowStrides vs)
      : Bf16Products(shape, scale_, k, ks, v, vs, kAlign) {}

  static bool takes(const Shape& sh) { return amx_usable() && amx_fits(sh.D, sh.Dv); }

  void scores(int64_t bh, int64_t R, int64_t j0, int64_t n, float* s) {
    use_tiles(TileShape::products);
    amx_scores(R, n, D2, qb.data(), kt + (bh * tiles_of(sh.S) + j0 / kBlockK) * D2 * kBlockK + 2 * (j0 % kBlockK), s);
  }
  void add_values(int64_t bh, int64_t R, int64_t j0, int64_t n, const float*, float* acc) {
    use_tiles(TileShape::products);  // (the scores' shape: a compare)
    amx_add_values(R, n, sh.Dv, pb.data(), vv + (bh * tiles_of(sh.S) + j0 / kBlockK) * kBlockK * sh.Dv + (j0 % kBlockK) * sh.Dv,
                   acc);
  }
  void release() { release_tiles(); }

  // A tile's keys in one lazy pass (amx_fused_run), where whole_tiles finds only the band shaping them.
  bool fuses(int64_t) const { return true; }
  void fused_keys(const RowKeys& seen, bool covered, int64_t bh, int64_t R, int64_t j0, int64_t keys, float scale, float* m,
                  float* l, float* acc) {
    const int64_t tile = bh * tiles_of(sh.S) + j0 / kBlockK, first = j0 % kBlockK;  // (a multiple of 32: kAlign)
    const FusedOperands x{qb.data(), D2, sh.Dv, kt + tile * D2 * kBlockK + 2 * first, vv + (tile * kBlockK + first) * sh.Dv};
    amx_fused_run(fused, x, seen, covered, R, j0, keys, scale, m, l, acc);
  }

 private:
  FusedBuffers fused;
};
#endif

// A tile of n keys from j0 whose last n - keys lie past S (the zero padding of the last tile, of an odd
// count for the bf16 pairs, or to the AMX tiles' 32 keys a step): their scores are -inf, whatever the
// products made of them. Only the first ``keys`` columns are
// ever shaped (a position, a mask or a padding flag exists for those alone).
template <typename acc_t>
void hide_padding(int64_t R, int64_t n, int64_t keys, acc_t* s) {
  if (keys < n)
    for (int64_t r = 0; r < R; ++r) std::fill(s + r * n + keys, s + (r + 1) * n, -std::numeric_limits<acc_t>::infinity());
}

// [lo, hi): the keys a block of rows computes within [c0, c1) (whole tiles, at most the padded
// length): the keys some row may see (key_range), widened to whole pairs of the products'
// alignment (the band hides the keys added at either end, or they lie beyond S and are hidden as
// padding); empty when no row sees a key.
template <typename acc_t>
std::pair<int64_t, int64_t> block_keys(const Terms<acc_t>& t, const Rows& rows, int64_t S, int64_t align, int64_t c0,
                                       int64_t c1) {
  auto [lo, hi] = key_range(t, rows, S);
  if (hi <= lo) return {c0, c0};
  lo = std::max(c0, lo - lo % align);
  hi = std::min(c1, (hi + align - 1) / align * align);
  return {lo, std::max(lo, hi)};
}

// Whether a block of R rows gets its scores scaled from the products: kScaled, or the products' own
// scaled(R) where they scale some blocks and not others (PagedBf16Products: its run loops do, its tiles of
// bfloat16 pages leave the scale to the softmax).
template <typename Products, typename = void>
struct ScalesByRows : std::false_type {};
template <typename Products>
struct ScalesByRows<Products, std::void_t<decltype(std::declval<const Products&>().scaled(int64_t(0)))>> : std::true_type {};

template <typename Products>
bool scores_scaled(const Products& products, int64_t R) {
  if constexpr (ScalesByRows<Products>::value) return products.scaled(R);
  else return Products::kScaled;
}

// The walk of the forward and the backward over a block's key tiles: for each tile of [lo, hi) (whole
// tiles of kBlockK, but at the ends), s (rows x n) receives the tile's scores from the products, shaped
// by the contract (shape_tile, ``capped`` its tanh for the backward; skipped for a plain tile, one the
// band covers with no other term), with -inf past S; then ``tile(j0, n, keys, scale)``: the tile's
// first key, its width, how many of its keys lie before S, and the scale the exponential still
// applies (1 when the products or s carry it). Where ``whole.active`` (the forward's products fuse, no
// term but the band shapes the scores), every tile goes to ``whole(j0, keys, covered)`` instead
// (fused_keys, its scores never made here).
struct NoWholeTiles {
  bool active = false;
  void operator()(int64_t, int64_t, bool) const {}
};

template <typename acc_t, typename Products, typename Tile, typename Whole = NoWholeTiles>
void for_each_key_tile(const Shape& sh, const Terms<acc_t>& t, const Rows& rows, Products& products, int64_t bh,
                       int64_t lo, int64_t hi, acc_t* s, acc_t* capped, Tile&& tile, Whole&& whole = {}) {
  const int64_t R = rows.count;
  for (int64_t j0 = lo; j0 < hi; j0 = (j0 / kBlockK + 1) * kBlockK) {
    const int64_t n = std::min((j0 / kBlockK + 1) * kBlockK, hi) - j0;
    const int64_t keys = std::min(n, sh.S - j0);
    const bool covered = band_covers(t, rows, j0, keys), plain = plain_tile(t, covered);
    if (whole.active) {
      whole(j0, keys, covered);
      continue;
    }
    products.scores(bh, R, j0, n, s);
    acc_t scale = 1;
    if (!scores_scaled(products, R)) {
      if (plain && t.scale > 0) scale = t.scale;
      else for (int64_t x = 0; x < R * n; ++x) s[x] *= t.scale;
    }
    hide_padding(R, n, keys, s);  // after the scale: -inf times a scale <= 0 is NaN or +inf
    if (!plain) shape_tile(t, rows, j0, keys, s, n, capped, covered);
    tile(j0, n, keys, scale);
  }
}

// Products whose weights are a float tile for some blocks and rounded to bfloat16 as they are made for
// others (PagedBf16Products: its run loops' and 8-bit values' weights are floats): rounded_weights(R),
// the bfloat16 buffer a block of R rows takes its weights in, or nullptr for weights(s)'s floats.
template <typename Products, typename = void>
struct RoundsWeights : std::false_type {};
template <typename Products>
struct RoundsWeights<Products, std::void_t<decltype(std::declval<Products&>().rounded_weights(int64_t(0)))>> : std::true_type {};

// Products that may take a tile whole: fuses(R), fused_keys (Bf16Products, PagedBf16Products).
template <typename Products, typename = void>
struct FusesKeys : std::false_type {};
template <typename Products>
struct FusesKeys<Products, std::void_t<decltype(&Products::fused_keys)>> : std::true_type {};

// for_each_key_tile's whole tiles for absorb_keys: the products' fused_keys, where they fuse and nothing
// but the band shapes the scores (with key positions in order: each row's keys are its interval), the
// scale the softmax's to apply (> 0); ``seen``, each row's interval.
template <typename acc_t, typename Products>
struct WholeTiles {
  bool active = false;
  Products& products;
  int64_t bh, R;
  acc_t scale, *m, *l, *acc;
  RowKeys seen;
  void operator()(int64_t j0, int64_t keys, bool covered) const {
    if constexpr (FusesKeys<Products>::value) products.fused_keys(seen, covered, bh, R, j0, keys, scale, m, l, acc);
  }
};

template <typename acc_t, typename Products>
WholeTiles<acc_t, Products> whole_tiles(const Shape& sh, const Terms<acc_t>& t, const Rows& rows, Products& products,
                                        int64_t bh, acc_t* m, acc_t* l, acc_t* acc) {
  WholeTiles<acc_t, Products> whole{false, products, bh, rows.count, t.scale, m, l, acc, {}};
  if constexpr (FusesKeys<Products>::value)
    whole.active = products.fuses(rows.count) && plain_tile(t, true) && t.scale > 0 && !scores_scaled(products, rows.count) &&
                   (t.k_pos == nullptr || t.k_sorted);
  for (int64_t r = 0; whole.active && r < rows.count; ++r)
    std::tie(whole.seen.first[r], whole.seen.stop[r]) = key_interval(t, rows.b, sh.S, rows.position[r]);
  return whole;
}

// The forward's online softmax of a block of rows over the keys [lo, hi) (the tiled kernel's and the
// paged kernel's): each row's running max m and sum l and its output accumulator acc (R x Dv, from
// the caller: a sink, or nothing) absorb the tiles' shaped scores, and the products add the tiles'
// values; s holds a tile's scores (R x kBlockK).
template <typename acc_t, typename Products>
void absorb_keys(const Shape& sh, const Terms<acc_t>& t, const Rows& rows, Products& products, int64_t bh, int64_t lo,
                 int64_t hi, acc_t* s, acc_t* m, acc_t* l, acc_t* acc) {
  const auto absorb_tile = [&](int64_t n, acc_t scale, auto* w) {
    for (int64_t r = 0; r < rows.count; ++r) absorb(n, s + r * n, scale, m[r], l[r], acc + r * sh.Dv, sh.Dv, w + r * n);
  };
  for_each_key_tile(sh, t, rows, products, bh, lo, hi, s, static_cast<acc_t*>(nullptr),
                    [&](int64_t j0, int64_t n, int64_t, acc_t scale) {
    bool rounded = false;  // the weights went to the products' bfloat16 buffer
    if constexpr (RoundsWeights<Products>::value) {
      if (auto* w = products.rounded_weights(rows.count)) {
        absorb_tile(n, scale, w);
        rounded = true;
      }
    }
    if (!rounded) absorb_tile(n, scale, products.weights(s));
    products.add_values(bh, rows.count, j0, n, s, acc);
  }, whole_tiles(sh, t, rows, products, bh, m, l, acc));
}

// ---- the forward's work over the threads --------------------------------------------------------
//
// A forward is blocks of up to kBlockQ stacked query rows of one key/value head, each over the keys
// its rows see (block_keys). Their costs differ (a causal call's blocks see 1 to T / kBlockQ blocks'
// keys; a varlen batch's sequences differ in length), so the threads share them by cost (in_shares;
// split into equal counts, a causal call of one head ran 1.36-1.39x faster on 2 threads than on 1,
// Zen 4), and a block that costs more than a quarter of a thread's share is split into key ranges of
// whole tiles, their softmaxes merged by log-sum-exp (flash-decoding), so that a few long blocks keep
// every thread busy. The backward's tasks are shared the same way.

// A unit of work: the rows r0..r1 of kv head kv_head of batch entry (or sequence) b, over the keys
// [k0, k1); a whole block (group -1) or the split-th key range of a split one.
struct WorkItem {
  int64_t b, kv_head, r0, r1, k0, k1;
  int64_t group, split;
  double cost;
};

// A split block: its rows, how many key ranges, and where their parts lie (slot first_slot + split * R + r).
struct SplitGroup {
  int64_t b, kv_head, r0, r1;
  int64_t splits;
  int64_t first_slot;
};

// The cost of a block of R rows over ``keys`` keys: its products (R per key) and what a key costs
// whatever the rows (reading its key and value, the tile's transposes): about kKeyCost rows' worth.
constexpr double kKeyCost = 16;
inline double work_cost(int64_t R, int64_t keys) { return static_cast<double>(keys) * (R + kKeyCost) + R; }

// Tasks 0 .. count - 1 of these costs split among ``threads`` threads: thread i owns the i-th of
// contiguous shares of about equal cost (tasks bounds[i] .. bounds[i + 1] - 1: neighbours, as a static
// split gives them, so that the operands a thread packed in a static split of its own are its
// shares'), each share's tasks in ``order`` the costliest first.
struct Shares {
  std::vector<int64_t> bounds, order;
};

inline Shares split_shares(const std::vector<double>& cost, int64_t threads) {
  const int64_t count = static_cast<int64_t>(cost.size());
  threads = std::max<int64_t>(1, std::min(threads, count));
  const double total = std::accumulate(cost.begin(), cost.end(), 0.0);
  const auto weight = [&](int64_t x) { return total > 0 ? cost[x] : 1.0; };  // no cost at all: equal counts
  const double whole = total > 0 ? total : static_cast<double>(count);
  Shares shares{std::vector<int64_t>(threads + 1, count), std::vector<int64_t>(count)};
  shares.bounds[0] = 0;
  double before = 0;
  for (int64_t x = 0, share = 0; x < count; before += weight(x), ++x) {  // x joins the share its middle falls in
    const auto middle = static_cast<int64_t>((before + weight(x) / 2) / whole * static_cast<double>(threads));
    while (share < std::min(threads - 1, middle)) shares.bounds[++share] = x;
  }
  std::iota(shares.order.begin(), shares.order.end(), int64_t(0));
  for (int64_t i = 0; i < threads; ++i)  // (equal costs in their order: std::stable_sort's buffer, without it)
    std::sort(shares.order.begin() + shares.bounds[i], shares.order.begin() + shares.bounds[i + 1],
              [&](int64_t a, int64_t b) { return cost[a] > cost[b] || (cost[a] == cost[b] && a < b); });
  return shares;
}

// thread(next) on each thread, where next() gives a task not taken yet (-1 when none is left): its own
// share's (split_shares), the costliest first, then what is left of the others', the cheapest first.
// (Taken in turn by every thread from one list instead, a forward of B1 H8 T64 took 1.13-1.21x the
// time on 2 threads, Zen 4: each thread read the operands the other had packed.)
template <typename Thread>
void in_shares(const std::vector<double>& cost, Thread&& thread) {
  const int64_t count = static_cast<int64_t>(cost.size());
  if (count == 0) return;
  TORCH_CHECK(count < (int64_t(1) << 31), "mha native: too many tasks for one call");
  const Shares shares = split_shares(cost, at::get_num_threads());
  const int64_t threads = static_cast<int64_t>(shares.bounds.size()) - 1;
  const auto pack = [](uint64_t front, uint64_t back) { return front << 32 | back; };
  std::vector<std::atomic<uint64_t>> left(threads);  // share i's tasks not taken: order[front .. back - 1]
  for (int64_t i = 0; i < threads; ++i) left[i] = pack(shares.bounds[i], shares.bounds[i + 1]);
  const auto take = [&](int64_t i, bool front) -> int64_t {  // the front (or back) task of share i, or -1
    uint64_t now = left[i].load();
    for (;;) {
      const uint64_t first = now >> 32, end = now & 0xffffffffu;
      if (first >= end) return -1;
      if (left[i].compare_exchange_weak(now, front ? pack(first + 1, end) : pack(first, end - 1)))
        return shares.order[front ? first : end - 1];
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t own = begin; own < end; ++own)
      thread([&, own]() -> int64_t {
        int64_t x = take(own, true);
        for (int64_t i = 1; x < 0 && i < threads; ++i) x = take((own + i) % threads, false);
        return x;
      });
  });
}

// The items of a forward's blocks for ``threads`` threads: the blocks in their order, a split one's key
// ranges in its place (neighbours still).
struct WorkPlan {
  std::vector<WorkItem> items;
  std::vector<SplitGroup> groups;
  int64_t slots = 0;      // the split blocks' rows, times their splits
  int64_t most_rows = 0;  // the largest block's rows: the size of each thread's buffers
};

// Whether the blocks' own shares (split_shares) give no thread more than kBalanced above the mean: then
// none is split, for a split costs its merge and its ranges' starts (4 blocks of a decoding step over
// 1024 keys, split in two on 2 threads, took 1.035-1.06x the time, Zen 4).
constexpr double kBalanced = 1.0 / 16;

inline std::vector<double> costs_of(const std::vector<WorkItem>& items) {
  std::vector<double> cost(items.size());
  std::transform(items.begin(), items.end(), cost.begin(), [](const WorkItem& item) { return item.cost; });
  return cost;
}

inline bool balanced(const std::vector<WorkItem>& blocks, int64_t threads, double total) {
  const std::vector<double> cost = costs_of(blocks);
  const std::vector<int64_t> bounds = split_shares(cost, threads).bounds;
  double most = 0;
  for (size_t i = 0; i + 1 < bounds.size(); ++i)
    most = std::max(most, std::accumulate(cost.begin() + bounds[i], cost.begin() + bounds[i + 1], 0.0));
  return most <= (1 + kBalanced) * total / static_cast<double>(threads);
}

inline WorkPlan plan_work(std::vector<WorkItem> blocks, int64_t threads) {
  WorkPlan plan;
  double total = 0, most = 0;
  for (const WorkItem& block : blocks) {
    total += block.cost;
    most = std::max(most, block.cost);
    plan.most_rows = std::max(plan.most_rows, block.r1 - block.r0);
  }
  const double share = threads > 1 ? total / (4.0 * threads) : std::numeric_limits<double>::infinity();
  if (!(most > share) || balanced(blocks, threads, total)) {  // no block split: the blocks as they are
    plan.items = std::move(blocks);
    return plan;
  }
  for (const WorkItem& block : blocks) {
    const int64_t keys = block.k1 - block.k0, R = block.r1 - block.r0;
    const int64_t splits = block.cost > share ? std::min<int64_t>(static_cast<int64_t>(std::ceil(block.cost / share)),
                                                                  (keys + kBlockK - 1) / kBlockK)
                                              : 1;
    if (splits <= 1) {
      plan.items.push_back(block);
      continue;
    }
    const int64_t chunk = ((keys + splits - 1) / splits + kBlockK - 1) / kBlockK * kBlockK;
    const int64_t group = static_cast<int64_t>(plan.groups.size());
    int64_t split = 0;
    for (int64_t k0 = block.k0; k0 < block.k1; ++split) {
      const int64_t k1 = std::min(block.k1, k0 / kBlockK * kBlockK + chunk);  // ends on a tile's edge
      plan.items.push_back({block.b, block.kv_head, block.r0, block.r1, k0, k1, group, split, work_cost(R, k1 - k0)});
      k0 = k1;
    }
    plan.groups.push_back({block.b, block.kv_head, block.r0, block.r1, split, plan.slots});
    plan.slots += split * R;
  }
  return plan;
}

// One row's softmax computed in ``splits`` parts over disjoint keys (max m, sum l, accumulator acc
// of part p at m[p * stride], l[p * stride], acc[p * stride * Dv ..]) merged by log-sum-exp:
// returns the row's (max, sum) and leaves its accumulator in ``merged`` (Dv values), finish_row's
// inputs. A part made NaN (or +inf) makes the row NaN; parts that saw nothing add nothing.
template <typename acc_t>
std::pair<acc_t, acc_t> merge_splits(int64_t splits, const acc_t* m, const acc_t* l, const acc_t* acc, int64_t stride,
                                     int64_t Dv, acc_t* merged) {
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  acc_t top = neg_inf, total = 0;
  for (int64_t p = 0; p < splits && !poisons(top); ++p)  // a split made NaN makes the row NaN (finish_row)
    top = poisons(m[p * stride]) ? m[p * stride] : std::max(top, m[p * stride]);
  std::fill(merged, merged + Dv, acc_t(0));
  if (top != neg_inf && !poisons(top)) {
    for (int64_t p = 0; p < splits; ++p) {
      const acc_t w = std::exp(m[p * stride] - top);
      total += l[p * stride] * w;
      for (int64_t d = 0; d < Dv; ++d) merged[d] += acc[p * stride * Dv + d] * w;
    }
  }
  return {top, total};
}

// The forward of a call's blocks, for the rows a layout describes:
//   batch(), kv_heads()            batch entries (or sequences) b, key/value heads
//   shape(b), terms(b)             b's Shape and Terms
//   rows(b, kv_head, r0, r1)       the stacked rows r0..r1 of a kv head (block_rows)
//   row(b, rows, r)                the index of rows' r-th row in the row statistics
//   q_at(b, rows, r), out_at(...)  where that row lies in q and out (elements from their starts)
//   bind(products, b, kv_head)     the products made to read b's kv head: the head index they take
//   D, Dv
template <typename scalar_t, typename acc_t, typename Products, typename Layout>
void forward_blocks(const Layout& layout, const scalar_t* q, const Products& shared, scalar_t* out,
                    const RowStats<acc_t>& stats) {
  const int64_t D = layout.D, Dv = layout.Dv;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  std::vector<WorkItem> blocks;
  blocks.reserve(layout.batch() * layout.kv_heads());  // (a few blocks per head in most calls)
  for (int64_t b = 0; b < layout.batch(); ++b) {
    const Shape sh = layout.shape(b);
    const auto& t = layout.terms(b);  // (a paged sequence's: a temporary, kept alive)
    for (int64_t kv_head = 0; kv_head < sh.Hkv; ++kv_head)
      for (int64_t r0 = 0; r0 < sh.rows(); r0 += kBlockQ) {
        const int64_t r1 = std::min(sh.rows(), r0 + kBlockQ);
        const auto [lo, hi] = block_keys(t, layout.rows(b, kv_head, r0, r1), sh.S, Products::kAlign, 0,
                                         tiles_of(sh.S) * kBlockK);
        blocks.push_back({b, kv_head, r0, r1, lo, hi, -1, 0, work_cost(r1 - r0, hi - lo)});
      }
  }
  const WorkPlan plan = plan_work(std::move(blocks), at::get_num_threads());
  std::vector<acc_t> part_m(plan.slots), part_l(plan.slots), part_acc(plan.slots * Dv);
  // a split block's rows are merged by the thread that finishes its last range (a parallel pass of its
  // own after the others cost a decoding step over 1024 keys 1.06-1.13x the time, 2 threads, Zen 4)
  std::vector<std::atomic<int64_t>> unfinished(plan.groups.size());
  for (size_t g = 0; g < plan.groups.size(); ++g) unfinished[g] = plan.groups[g].splits;
  const auto merge_group = [&](const SplitGroup& group, acc_t* merged) {
    const Rows rows = layout.rows(group.b, group.kv_head, group.r0, group.r1);
    for (int64_t r = 0; r < rows.count; ++r) {
      const int64_t first = group.first_slot + r;
      const auto [top, sum] = merge_splits(group.splits, part_m.data() + first, part_l.data() + first,
                                           part_acc.data() + first * Dv, rows.count, Dv, merged);
      finish_row(top, sum, merged, Dv, out + layout.out_at(group.b, rows, r), stats, layout.row(group.b, rows, r));
    }
  };
  in_shares(costs_of(plan.items), [&](auto&& next) {
    ThreadProducts<Products> own(shared);  // its per-thread buffers, released at the run's end
    Products& products = own.products;
    const int64_t most = buffer_rows<Products>(plan.most_rows);
    // a tile's scores s (rows x kBlockK), the rows' accumulators, maxima m and sums l (apart: with acc
    // 4 KiB after s in one buffer, a float32 decoding step took 1.07-1.11x the time on 2 threads, Zen 4)
    Scratch<acc_t> scores, accumulators, maxima, sums;
    acc_t *s = scores.at_least(most * kBlockK), *acc = accumulators.at_least(most * Dv);
    acc_t *m = maxima.at_least(most), *l = sums.at_least(most);
    for (int64_t x = next(); x >= 0; x = next()) {
      const WorkItem& item = plan.items[x];
      const auto& t = layout.terms(item.b);
      const Rows rows = layout.rows(item.b, item.kv_head, item.r0, item.r1);
      const int64_t R = rows.count, bh = layout.bind(products, item.b, item.kv_head);
      for (int64_t r = 0; r < R; ++r) {  // pack the queries; start each row's running softmax
        products.pack_row(r, R, q + layout.q_at(item.b, rows, r));
        const bool sink = t.sinks != nullptr && item.split == 0;  // the sink joins once, in the first range
        m[r] = sink ? t.sinks[rows.head[r]] : neg_inf;
        l[r] = sink ? acc_t(1) : acc_t(0);
      }
      std::fill(acc, acc + R * Dv, acc_t(0));
      absorb_keys(layout.shape(item.b), t, rows, products, bh, item.k0, item.k1, s, m, l, acc);
      if (item.group < 0) {
        for (int64_t r = 0; r < R; ++r)
          finish_row(m[r], l[r], acc + r * Dv, Dv, out + layout.out_at(item.b, rows, r), stats, layout.row(item.b, rows, r));
      } else {
        const int64_t slot = plan.groups[item.group].first_slot + item.split * R;
        std::copy(m, m + R, part_m.begin() + slot);
        std::copy(l, l + R, part_l.begin() + slot);
        std::copy(acc, acc + R * Dv, part_acc.begin() + slot * Dv);
        if (unfinished[item.group].fetch_sub(1, std::memory_order_acq_rel) == 1)  // (the others' parts seen)
          merge_group(plan.groups[item.group], acc);
      }
    }
  });
}

// The forward's rows: B batch entries of one Shape, q (B, H, L, D) and out (B, H, L, Dv) with their
// rows where qs and os say, the row statistics (B, H, L).
template <typename acc_t>
struct DenseLayout {
  const Shape& sh;
  const Terms<acc_t>& t;
  RowStrides qs, os;
  int64_t D = sh.D, Dv = sh.Dv;
  int64_t batch() const { return sh.B; }
  int64_t kv_heads() const { return sh.Hkv; }
  const Shape& shape(int64_t) const { return sh; }
  const Terms<acc_t>& terms(int64_t) const { return t; }
  Rows rows(int64_t b, int64_t kv_head, int64_t r0, int64_t r1) const { return block_rows(sh, t, b, kv_head, r0, r1); }
  int64_t row(int64_t b, const Rows& rows, int64_t r) const { return (b * sh.H + rows.head[r]) * sh.L + rows.index[r]; }
  int64_t q_at(int64_t b, const Rows& rows, int64_t r) const { return qs.at(b, rows.head[r], rows.index[r]); }
  int64_t out_at(int64_t b, const Rows& rows, int64_t r) const { return os.at(b, rows.head[r], rows.index[r]); }
  template <typename Products>
  int64_t bind(Products&, int64_t b, int64_t kv_head) const { return b * sh.Hkv + kv_head; }
};

// ---- backward --------------------------------------------------------------------------------------

// The five tile products of the backward, on operands packed once per call (K^T, K, V^T) and per
// query block (q and dO, and their transposes):
//   scores     s = q . K^T             dvalues   dV^T += dO^T . P      dprobs  dP = dO . V^T
//   dqueries   dQ += dS . K            dkeys     dK^T += q^T . dS
// weights(P) and gradients(dS) let a products object prepare its own forms of them. kScaled: q is
// packed scaled (the scores come scaled and dK^T needs no scaling), else the caller scales both.
template <typename scalar_t, typename acc_t>
struct PlainBackward {
  static constexpr int64_t kAlign = 1;
  static constexpr bool kScaled = true;
  const Shape& sh;
  acc_t scale;
  Tensor k_;  // K in acc_t, (BH, S, D)
  const acc_t *kt, *k, *vt;  // K^T and V^T tile-major in the workspace, (BH, tiles, D | Dv, kBlockK); k_'s
  std::vector<acc_t> qp = {}, qpt = {}, dop = {}, dopt = {};

  PlainBackward(const Shape& shape, acc_t scale_, const Tensor& keys, const Tensor& values)
      : sh(shape), scale(scale_) {
    const int64_t tiled = sh.B * sh.Hkv * tiles_of(sh.S) * kBlockK;
    acc_t* kt_ = workspace<acc_t>(0, tiled * sh.D);
    acc_t* vt_ = workspace<acc_t>(2, tiled * sh.Dv);
    pack_tile_major(keys.data_ptr<scalar_t>(), contiguous_rows(sh.Hkv, sh.S, sh.D), sh, sh.D, kt_);
    pack_tile_major(values.data_ptr<scalar_t>(), contiguous_rows(sh.Hkv, sh.S, sh.Dv), sh, sh.Dv, vt_);
    k_ = keys.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
    kt = kt_, k = k_.data_ptr<acc_t>(), vt = vt_;
  }

  void pack_row(int64_t r, int64_t R, const scalar_t* q, const scalar_t* dout) {  // and the transposes
    if (qp.empty()) qp.resize(kBlockQ * sh.D), qpt.resize(sh.D * kBlockQ), dop.resize(kBlockQ * sh.Dv), dopt.resize(sh.Dv * kBlockQ);
    for (int64_t d = 0; d < sh.D; ++d) qpt[d * R + r] = qp[r * sh.D + d] = static_cast<acc_t>(q[d]) * scale;
    for (int64_t d = 0; d < sh.Dv; ++d) dopt[d * R + r] = dop[r * sh.Dv + d] = static_cast<acc_t>(dout[d]);
  }
  const acc_t* head(const acc_t* base, int64_t bh, int64_t width) const { return base + bh * tiles_of(sh.S) * width * kBlockK; }
  void scores(int64_t bh, int64_t R, int64_t j0, int64_t n, acc_t* s) {
    gemm_nn(R, n, sh.D, qp.data(), sh.D, kt_block(head(kt, bh, sh.D), sh.D, j0), kBlockK, s, n, false);
  }
  void weights(int64_t, int64_t, const acc_t*) {}
  void gradients(int64_t, int64_t, const acc_t*) {}
  void dvalues(int64_t R, int64_t n, const acc_t* p, acc_t* dvt) {
    gemm_nn(sh.Dv, n, R, dopt.data(), R, p, n, dvt, kBlockK, true);
  }
  void dprobs(int64_t bh, int64_t R, int64_t j0, int64_t n, acc_t* dp) {
    gemm_nn(R, n, sh.Dv, dop.data(), sh.Dv, kt_block(head(vt, bh, sh.Dv), sh.Dv, j0), kBlockK, dp, n, false);
  }
  void dqueries(int64_t bh, int64_t R, int64_t j0, int64_t n, const acc_t* ds, acc_t* dq) {
    gemm_nn(R, sh.D, n, ds, n, k + (bh * sh.S + j0) * sh.D, sh.D, dq, sh.D, true);
  }
  void dkeys(int64_t R, int64_t n, const acc_t* ds, acc_t* dkt) {
    gemm_nn(sh.D, n, R, qpt.data(), R, ds, n, dkt, kBlockK, true);
  }
};

#if defined(MHA_AVX512_BF16)
// The backward's products on bfloat16 operands in VNNI pairs (brgemm's vdpbf16ps, float32
// accumulation): the inputs' own q, k, v and dO; P and dS rounded to bfloat16 for the products
// that take them (as torch's bfloat16 backward does). Rows of P and dS pair up for dV^T and dK^T.
//   K^T (BH, tiles, D2 / 2, kBlockK, 2)   K (BH, tiles, kBlockK / 2, D, 2)   V^T (BH, tiles, Dv2 / 2, kBlockK, 2)
struct Bf16Backward {
  static constexpr int64_t kAlign = 2;
  static constexpr bool kScaled = false;
  using bf16 = at::BFloat16;
  const Shape& sh;
  float scale;
  int64_t D2, Dv2;
  const bf16 *kt, *k, *vt;
  std::vector<bf16> qb = {}, qt = {}, db = {}, dt = {}, pv = {}, sb = {}, sv = {};
  int64_t rows2 = 0;

  Bf16Backward(const Shape& shape, float scale_, const Tensor& keys, const Tensor& values)
      : sh(shape), scale(scale_), D2(shape.D + shape.D % 2), Dv2(shape.Dv + shape.Dv % 2) {
    const int64_t tiles = tiles_of(sh.S), BH = sh.B * sh.Hkv;
    bf16* kt_ = workspace<bf16>(0, BH * tiles * D2 * kBlockK);
    bf16* k_ = workspace<bf16>(1, BH * tiles * kBlockK * sh.D);
    bf16* vt_ = workspace<bf16>(2, BH * tiles * Dv2 * kBlockK);
    const RowStrides key_rows = contiguous_rows(sh.Hkv, sh.S, sh.D);
    pack_pairs(keys.data_ptr<bf16>(), key_rows, sh, sh.D, true, kt_);
    pack_pairs(keys.data_ptr<bf16>(), key_rows, sh, sh.D, false, k_);
    pack_pairs(values.data_ptr<bf16>(), contiguous_rows(sh.Hkv, sh.S, sh.Dv), sh, sh.Dv, true, vt_);
    kt = kt_, k = k_, vt = vt_;
  }

  // A buffer for a tile's P or dS, grown once to a whole tile's (resized to each tile's size, as a
  // causal block's last tile is narrower, it wrote every new element one at a time)
  static void at_least(int64_t count, std::vector<bf16>& buffer) {
    if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(std::max(count, kBlockQ * kBlockK));
  }
  // Rows r and r + 1 of a (R x n) float block side by side, rounded to bfloat16:
  // out[(r / 2) n 2 + j 2 + r % 2] (R rounded up to even, the padding row zero). 16 columns at a
  // time: each 32-bit lane takes row r's value in its low half and row r + 1's in its high half.
  static void pair_rows(int64_t R, int64_t n, const float* in, std::vector<bf16>& out) {
    at_least((R + R % 2) * n, out);
    for (int64_t r = 0; r < R; r += 2) {
      const float* a = in + r * n;
      const float* b = r + 1 < R ? in + (r + 1) * n : nullptr;
      int32_t* dst = reinterpret_cast<int32_t*>(out.data() + r * n);
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(n - j);
        const __m512i low = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, a + j)));
        const __m512i high = b ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, b + j)))
                               : _mm512_setzero_si512();
        _mm512_mask_storeu_epi32(dst + j, m, _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
      }
    }
  }
  // A float block rounded to bfloat16, in place of its layout.
  static void round_all(int64_t count, const float* in, std::vector<bf16>& out) {
    at_least(count, out);
    for (int64_t j = 0; j < count; j += 16) {
      const __mmask16 m = count - j >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(count - j);
      _mm256_mask_storeu_epi16(out.data() + j, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, in + j)));
    }
  }

  void pack_row(int64_t r, int64_t R, const bf16* q, const bf16* dout) {  // the transposes: zero-padded to even R
    rows2 = R + R % 2;
    if (qb.empty()) {
      qb.assign(kBlockQ * D2, bf16(0.0f)), db.assign(kBlockQ * Dv2, bf16(0.0f));
      qt.assign(sh.D * (kBlockQ + 1), bf16(0.0f)), dt.assign(sh.Dv * (kBlockQ + 1), bf16(0.0f));
    }
    std::copy(q, q + sh.D, qb.data() + r * D2);
    std::copy(dout, dout + sh.Dv, db.data() + r * Dv2);
    for (int64_t d = 0; d < sh.D; ++d) qt[d * rows2 + r] = q[d];
    for (int64_t d = 0; d < sh.Dv; ++d) dt[d * rows2 + r] = dout[d];
    if (r == R - 1 && R % 2) {  // the padding column of the transposes
      for (int64_t d = 0; d < sh.D; ++d) qt[d * rows2 + R] = bf16(0.0f);
      for (int64_t d = 0; d < sh.Dv; ++d) dt[d * rows2 + R] = bf16(0.0f);
    }
  }
  const bf16* tile(const bf16* base, int64_t bh, int64_t j0, int64_t size) const {
    return base + (bh * tiles_of(sh.S) + j0 / kBlockK) * size * kBlockK;
  }
  void scores(int64_t bh, int64_t R, int64_t j0, int64_t n, float* s) {  // unscaled
    at::native::cpublas::brgemm(R, n, D2, D2, kBlockK, n, false, qb.data(), tile(kt, bh, j0, D2) + 2 * (j0 % kBlockK), s, true);
  }
  void weights(int64_t R, int64_t n, const float* p) { pair_rows(R, n, p, pv); }
  void gradients(int64_t R, int64_t n, const float* ds) {
    round_all(R * n, ds, sb);
    pair_rows(R, n, ds, sv);
  }
  void dvalues(int64_t, int64_t n, const float*, float* dvt) {
    at::native::cpublas::brgemm(sh.Dv, n, rows2, rows2, n, kBlockK, true, dt.data(), pv.data(), dvt, true);
  }
  void dprobs(int64_t bh, int64_t R, int64_t j0, int64_t n, float* dp) {
    at::native::cpublas::brgemm(R, n, Dv2, Dv2, kBlockK, n, false, db.data(), tile(vt, bh, j0, Dv2) + 2 * (j0 % kBlockK), dp, true);
  }
  void dqueries(int64_t bh, int64_t R, int64_t j0, int64_t n, const float*, float* dq) {
    at::native::cpublas::brgemm(R, sh.D, n, n, sh.D, sh.D, true, sb.data(), tile(k, bh, j0, sh.D) + (j0 % kBlockK) * sh.D, dq, true);
  }
  void dkeys(int64_t, int64_t n, const float*, float* dkt) {
    at::native::cpublas::brgemm(sh.D, n, rows2, rows2, n, kBlockK, true, qt.data(), sv.data(), dkt, true);
  }
};
#endif

// A row's dS = P (dP - delta) in place of its dP, g (n values): on whole vectors (the compiler's, as
// the pointers do not alias); in a one-hot row (see backward_kernel) the key of weight 1 gets 0.
template <typename acc_t>
void probs_gradient(int64_t n, const acc_t* __restrict p, acc_t* __restrict g, acc_t delta, bool one_hot) {
  if (one_hot)
    for (int64_t j = 0; j < n; ++j) g[j] = p[j] == acc_t(1) ? acc_t(0) : p[j] * (g[j] - delta);
  else
    for (int64_t j = 0; j < n; ++j) g[j] = p[j] * (g[j] - delta);
}

// The costs of the backward's tasks (batch, key/value head, key chunk of chunk_len keys): a chunk's
// cost is its keys' share of each block that sees them (a causal call's first chunk is seen
// by every row, its last by the last rows only).
template <typename acc_t>
std::vector<double> backward_costs(const Shape& sh, const Terms<acc_t>& t, int64_t align, int64_t chunks,
                                    int64_t chunk_len) {
  const int64_t blocks = (sh.rows() + kBlockQ - 1) / kBlockQ, padded = tiles_of(sh.S) * kBlockK;
  std::vector<double> cost(sh.B * sh.Hkv * chunks, 0.0);
  for (int64_t bh = 0; bh < sh.B * sh.Hkv; ++bh)
    for (int64_t block = 0; block < blocks; ++block) {
      const int64_t r0 = block * kBlockQ, r1 = std::min(sh.rows(), r0 + kBlockQ);
      const auto [lo, hi] = block_keys(t, block_rows(sh, t, bh / sh.Hkv, bh % sh.Hkv, r0, r1), sh.S, align, 0, padded);
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {  // the block's keys within the chunk (block_keys over it)
        const int64_t keys = std::min(hi, (chunk + 1) * chunk_len) - std::max(lo, chunk * chunk_len);
        if (keys > 0) cost[bh * chunks + chunk] += work_cost(r1 - r0, keys);
      }
    }
  return cost;
}

// One task per (batch, key/value head, key chunk): it owns dK and dV of its keys (accumulated
// transposed and tile-major, like K^T, so that every product is a plain A . B), adds to dQ of every
// query row of its heads (in its chunk's dq buffer), and to its heads' slope gradients. Chunks are
// whole tiles.
template <typename scalar_t, typename acc_t, typename Products>
void backward_kernel(const Shape& sh, const Terms<acc_t>& t, const scalar_t* q, const Products& shared,
                     const scalar_t* dout, const RowStats<const acc_t>& stats, const acc_t* delta,
                     acc_t* dq_parts, int64_t chunks, acc_t* dkt, acc_t* dvt, acc_t* d_slopes_parts) {
  const int64_t blocks = (sh.rows() + kBlockQ - 1) / kBlockQ;
  const int64_t chunk_len = (tiles_of(sh.S) + chunks - 1) / chunks * kBlockK;
  const int64_t padded = tiles_of(sh.S) * kBlockK;
  const acc_t inf = std::numeric_limits<acc_t>::infinity();
  in_shares(backward_costs(sh, t, Products::kAlign, chunks, chunk_len), [&](auto&& next) {
    ThreadProducts<Products> own(shared);  // its per-thread buffers, released at the run's end
    Products& products = own.products;
    Scratch<acc_t> p, ds, capped;  // a tile's P, dS and tanh (softcap)
    for (auto* tile : {&p, &ds, &capped}) tile->at_least(kBlockQ * kBlockK);
    std::vector<acc_t> dqb(kBlockQ * sh.D), shift(kBlockQ), inv_sum(kBlockQ), row_delta(kBlockQ);
    std::vector<char> one_hot(kBlockQ);
    for (int64_t task = next(); task >= 0; task = next()) {
      const int64_t chunk = task % chunks, bh = task / chunks, b = bh / sh.Hkv, kv_head = bh % sh.Hkv;
      const int64_t c0 = chunk * chunk_len, c1 = std::min(padded, c0 + chunk_len);
      acc_t* dq_chunk = dq_parts + chunk * sh.B * sh.H * sh.L * sh.D;
      acc_t* slopes_grad = d_slopes_parts + task * sh.G;
      acc_t* dkt_head = dkt + bh * tiles_of(sh.S) * sh.D * kBlockK;
      acc_t* dvt_head = dvt + bh * tiles_of(sh.S) * sh.Dv * kBlockK;
      for (int64_t block = 0; block < blocks; ++block) {
        const int64_t r0 = block * kBlockQ, r1 = std::min(sh.rows(), r0 + kBlockQ), R = r1 - r0;
        const Rows rows = block_rows(sh, t, b, kv_head, r0, r1);
        const auto [lo, hi] = block_keys(t, rows, sh.S, Products::kAlign, c0, c1);
        if (hi <= lo) continue;
        for (int64_t r = 0; r < R; ++r) {  // the block's rows
          const int64_t row_index = (b * sh.H + rows.head[r]) * sh.L + rows.index[r];
          products.pack_row(r, R, q + row_index * sh.D, dout + row_index * sh.Dv);
          const bool empty = stats.sum[row_index] == acc_t(0);  // a row that saw nothing: P = 0
          shift[r] = empty ? inf : stats.max[row_index];
          inv_sum[r] = empty ? acc_t(1) : acc_t(1) / stats.sum[row_index];
          row_delta[r] = delta[row_index];
          // a row whose softmax sum (a sink's weight included) is 1 to working precision (one visible
          // key, or the other weights below its rounding): its key of weight 1 gets dS = 0, within
          // the other weights of the true dS = 1 (dP - delta) = sum_j P_j (dP - dP_j), where delta,
          // summed in another order than dP, would leave its rounding in dq and dk; the other keys'
          // dS = P (dP - delta) as everywhere (tiny, and all of a one-hot row's d_slopes)
          one_hot[r] = stats.sum[row_index] == acc_t(1);
        }
        std::fill(dqb.begin(), dqb.begin() + R * sh.D, acc_t(0));
        for_each_key_tile(sh, t, rows, products, bh, lo, hi, p.data(), capped.data(),
                          [&](int64_t j0, int64_t n, int64_t keys, acc_t scale) {
          for (int64_t r = 0; r < R; ++r) {  // P = e^(S - m) / l
            acc_t* row = p.data() + r * n;
            if (fused_exponent(scale, shift[r])) exp_times(n, row, scale, shift[r], inv_sum[r], row);
            else exp_times_apart(n, row, scale, shift[r], inv_sum[r], row);
          }
          products.weights(R, n, p.data());
          products.dvalues(R, n, p.data(), kt_block(dvt_head, sh.Dv, j0));  // dV^T += dO^T P
          products.dprobs(bh, R, j0, n, ds.data());  // dP = dO V^T
          for (int64_t r = 0; r < R; ++r) {  // dS = P (dP - delta), in place of dP
            acc_t* g = ds.data() + r * n;
            probs_gradient(n, p.data() + r * n, g, row_delta[r], one_hot[r]);
            if (t.slopes) {  // d slope_h = -sum dS |rel|
              acc_t total = 0;
              for (int64_t j = 0; j < keys; ++j) {
                const int64_t rel = t.key_position(b, j0 + j) - rows.position[r];
                total += g[j] * static_cast<acc_t>(rel < 0 ? -rel : rel);
              }
              slopes_grad[rows.head[r] - kv_head * sh.G] -= total;
            }
            if (t.softcap > 0) {  // d/ds of c tanh(s / c)
              const acc_t* th = capped.data() + r * n;
              for (int64_t j = 0; j < keys; ++j) g[j] *= acc_t(1) - th[j] * th[j];
            }
          }
          products.gradients(R, n, ds.data());
          products.dqueries(bh, R, j0, n, ds.data(), dqb.data());  // dQ += dS K
          products.dkeys(R, n, ds.data(), kt_block(dkt_head, sh.D, j0));  // dK^T += q^T dS
        });
        for (int64_t r = 0; r < R; ++r) {
          acc_t* dst = dq_chunk + ((b * sh.H + rows.head[r]) * sh.L + rows.index[r]) * sh.D;
          for (int64_t d = 0; d < sh.D; ++d) dst[d] += dqb[r * sh.D + d] * t.scale;
        }
      }
    }
  });
}

// ---- run loops: the products of a few rows, in vector extensions -----------------------------------

// The products of a few query rows (a decoding step's, or a block's of at most kRunLoopRows) with one
// run of keys, where brgemm's fixed cost per call and its half-empty vectors (N = R) cost more than
// the products (measured: 1.4x the time of a decoding batch at R = 4, pages of 16 keys, on AVX2):
// written with the compiler's vector extensions (a register of acc_t: 64 bytes in the AVX-512 builds,
// 32 in the others, in the build's instructions). Keys and values are read as they are stored
// (float32, bfloat16, float16 or int8) and widened in registers, once for a block of up to four rows
// (widen): a decoding step reads each byte of the cache once and converts it once. A block holds
// rows x keys accumulators (8 for 1 row, 4 x 3 for 4: as many independent sums as two FMA units keep
// busy, with the rows' and keys' vectors, in 16 registers). Each key's score is the same sum whichever
// position it has in a run (its own accumulator, the same order). An 8-bit key's or value's (token,
// head) scale multiplies its score or its weight, not its D values.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
template <typename acc_t, typename T>
inline typename Lanes<acc_t>::vec widen(const T* p) {
  using V = Lanes<acc_t>;
  typename V::vec out;
  if constexpr (std::is_same_v<T, acc_t>) {
    return V::load(p);
#if defined(__AVX2__)
  } else if constexpr (std::is_same_v<T, at::BFloat16> && sizeof(acc_t) == 4) {  // a bfloat16 is a float's top half
#if defined(MHA_AVX512)
    const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
    const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#endif
    std::memcpy(&out, &wide, sizeof(out));
  } else if constexpr (std::is_same_v<T, int8_t> && sizeof(acc_t) == 4) {
#if defined(MHA_AVX512)
    const __m512 wide = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
    const __m256 wide = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
    std::memcpy(&out, &wide, sizeof(out));
  } else if constexpr (std::is_same_v<T, at::Half> && sizeof(acc_t) == 4) {
#if defined(MHA_AVX512)
    const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
    const __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
    std::memcpy(&out, &wide, sizeof(out));
#endif
  } else {  // one value at a time: the portable build, and 8-bit or 16-bit values under float64 queries
    acc_t values[V::kCount];
    for (int64_t i = 0; i < V::kCount; ++i) values[i] = static_cast<acc_t>(p[i]);
    out = V::load(values);
  }
  return out;
}

// The first ``count`` (< a vector's) values at p widened as widen does, the other lanes zero: a row's
// last values join its vector sums (summed pairwise as the rest are, not one by one after them).
template <typename acc_t, typename T>
inline typename Lanes<acc_t>::vec widen_tail(const T* p, int64_t count) {
  T values[Lanes<acc_t>::kCount] = {};
  std::copy(p, p + count, values);
  return widen<acc_t>(values);
}

// How a decoding step reads a 16-bit (bfloat16, float16) or 8-bit cache, the one place that chooses
// (set_step_reading: tests, scripts/decode_reading.py):
//   tiles   scores and values on AMX tiles (tile_score_block, tile_value_block) where AMX is usable and the
//           call fits them, the rest as strips;
//   strips  scores on vdpbf16ps (bfloat16 queries over bfloat16 keys) or widened, values in chunks of
//           kValueChunk keys strip by strip of the output's columns, the sums in registers (value_strips);
//   rows    the same scores, values read as whole rows and added to the output once a block (value_rows,
//           as float32 values are: 16-bit ones in streams; 8-bit ones widened in float32, a bfloat16
//           call's too, where strips take its weights as 16-bit integers: word_value_chunk).
// (8-bit values as rows, against strips: 0.95-0.96x a step's time over 16384 and 65536 keys, float32 and
// bfloat16 queries, the same Xeon, 2 threads, kernel_ab.py --read; in streams, or with their keys asked
// for line by line into the second-level cache as 16-bit ones are, 0.98-1.03x: not kept.)
// The read is a long step's limit where the arithmetic is not. On the Xeon with AMX of issue 44's sixth
// stop (2 threads, Hq 32 / Hkv 8, D 128, each call's cache read from memory: `python
// scripts/decode_reading.py --threads 2`, the readings alternated round by round in one process), a
// bfloat16 step over 256-65536 keys took of the float32 step's time: tiles 0.75-0.80, strips 0.66-0.71,
// rows 0.58-0.65; the tiles' scores with rows' values 0.65-0.69. Rows keep more lines in flight (three
// streams, every line of a row); the tiles wait on their loads. With the same small cache every call
// (1-4 MiB a thread, in the caches) the tiles won (0.50-0.64 against rows' 0.56-0.81), but a model reads
// each layer's cache from memory once a token. On Zen 4 the values' widening and products, at half width
// there, are the limit: strips in streams took 1.04-1.09x the strips' time (rows not measured there). So
// rows where AMX is present, strips elsewhere.
enum class StepReading : int { tiles, strips, rows };
inline StepReading default_step_reading() {
#if defined(MHA_AMX)
  if (amx_present()) return StepReading::rows;
#endif
  return StepReading::strips;
}

inline std::atomic<int>& step_reading_choice() {
  static std::atomic<int> choice{static_cast<int>(default_step_reading())};
  return choice;
}
inline StepReading step_reading() { return static_cast<StepReading>(step_reading_choice().load(std::memory_order_relaxed)); }

// Rows of keys (or values) are asked for ahead of the ones being read: the hardware's prefetcher stops
// at each 4 KiB page, which a cache's rows cross every few keys. Rows of 16 or 32 bits, whose reading
// is the limit, are asked for 8 KiB ahead into the second-level cache: a core has few first-level
// misses in flight, and rows asked into the first level capped its read rate (Zen 4, float32 at
// D = 128: 10 GB/s a core where a sum reads 25; into the second, a decoding step over 16384 keys took
// 0.54-0.60x the time in float32 and, with the values', 0.70x in bfloat16: the machine's read rate).
// 8-bit rows, which their widening limits, 4 KiB ahead into the first (into the second, 1.1x the time).
// Every line is asked for (every other one: 2.2x the time in float32; 16 KiB ahead: no faster; none, the
// hardware's prefetcher alone, 2.2-2.4x on a dense float32 cache). Rows of 16 or 32 bits are asked for
// line by line as the loops read them (a line of each of a block's rows at each step that starts one,
// written out in each loop: through an always_inline helper the float32 step took 1.09-1.14x the time);
// a block's lines at its start stalled the core on a full queue of misses (perf: 17 % of the bfloat16
// scores' samples on the instruction after the fourth prefetch), most where a block is all reading and
// little arithmetic: one query row a key/value head (Hq 8 / Hkv 8), float32, S 16384 and 65536 took
// 0.91-0.94x the time (AVX2 build 0.84x), with GQA 32 / 8 0.93-0.98x, bfloat16 0.96-1.03x (2 Zen 4
// threads, kernel_ab --read). 8-bit rows a block's at once (prefetch_row), as before.
template <typename T>
constexpr bool kReadBound = sizeof(T) > 1;
template <typename T>
constexpr int64_t kAheadBytes = kReadBound<T> ? 8192 : 4096;
template <typename T>
inline void prefetch_line(const void* p) {
  __builtin_prefetch(p, 0, kReadBound<T> ? 2 : 3);
}
// How many rows ld apart lie kAheadBytes ahead (at least one); made once a call (score_blocks, value_rows).
template <typename T>
inline int64_t rows_ahead(int64_t ld) {
  const int64_t ld_bytes = std::max<int64_t>(1, ld * static_cast<int64_t>(sizeof(T)));
  return (kAheadBytes<T> + ld_bytes - 1) / ld_bytes;
}
template <typename T>
inline void prefetch_row(const T* row, int64_t width) {
  const int64_t row_bytes = width * static_cast<int64_t>(sizeof(T));
  for (int64_t byte = 0; byte < row_bytes; byte += 64) prefetch_line<T>(reinterpret_cast<const char*>(row) + byte);
}

// out[n] = the sum of a[n]'s lanes, n < N, each in one fixed order whether a vector is reduced alone
// or among others (so a key's score does not depend on its place in a block). On AVX2 floats:
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), eight vectors at a time by horizontal adds
// (nine instructions for eight sums; one at a time, a reduction cost a third of a decoding step's
// products); elsewhere Lanes::sum.
#if defined(__AVX2__) && !defined(MHA_AVX512)
inline float lane_sum(__m256 v) {
  const __m256 pairs = _mm256_hadd_ps(v, v), quads = _mm256_hadd_ps(pairs, pairs);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
}
inline __m256 lane_sums8(const __m256* a) {
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  // each 128-bit half's sums
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}
#endif
#if defined(MHA_AVX512)
// The sums of 16 vectors' lanes, one per lane of the result, by transposing adds (45 instructions for
// 16 sums, where one at a time takes 8 each); a lane's order: in each 128-bit quarter (e0 + e2) +
// (e1 + e3), then (q0 + q1) + (q2 + q3). Fewer vectors are padded with zeros (the same order).
inline __m512 pair_sums(__m512 a, __m512 b) { return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); }
inline __m512 quad_sums(__m512 ab, __m512 cd) {
  const __m512d x = _mm512_castps_pd(ab), y = _mm512_castps_pd(cd);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
inline __m512 quarter_sums(__m512 a, __m512 b) {  // [a: q0+q1, q2+q3 | b: q0+q1, q2+q3]
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
__attribute__((always_inline)) inline __m512 lane_sums16(const __m512* v) {
  __m512 quads[4];
  for (int g = 0; g < 4; ++g)
    quads[g] = quad_sums(pair_sums(v[4 * g], v[4 * g + 1]), pair_sums(v[4 * g + 2], v[4 * g + 3]));
  const __m512 low = quarter_sums(quads[0], quads[1]), high = quarter_sums(quads[2], quads[3]);
  return quarter_sums(low, high);
}
#endif
template <typename acc_t, int N>
__attribute__((always_inline)) inline void lane_sums(const typename Lanes<acc_t>::vec* a, acc_t* out) {
#if defined(__AVX2__) && !defined(MHA_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    __m256 wide[N];
    std::memcpy(wide, a, sizeof(wide));
    int n = 0;
    for (; n + 8 <= N; n += 8) _mm256_storeu_ps(out + n, lane_sums8(wide + n));
    for (; n < N; ++n) out[n] = lane_sum(wide[n]);
    return;
  }
#endif
#if defined(MHA_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
#pragma GCC unroll 2
    for (int n = 0; n < N; n += 16) {
      __m512 group[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) group[i] = n + i < N ? reinterpret_cast<const __m512*>(a)[n + i] : _mm512_setzero_ps();
      alignas(64) float sums[16];
      _mm512_store_ps(sums, lane_sums16(group));
      std::copy(sums, sums + std::min(16, N - n), out + n);
    }
    return;
  }
#endif
  for (int n = 0; n < N; ++n) out[n] = Lanes<acc_t>::sum(a[n]);
}

// Values per block for a block of kRows rows (value_rows), and keys (score_block): kRows x keys sums
// in registers; AVX-512's 32 registers hold up to 16 of them, which its lane sums reduce at once.
template <int kRows>
constexpr int kBlockKeys = kRows == 1 ? 8 : (kRows == 2 ? 4 : 3);
#if defined(MHA_AVX512)
template <int kRows>
constexpr int kScoreKeys = kRows == 1 ? 8 : (kRows == 2 ? 8 : (kRows == 3 ? 5 : 4));
#else
template <int kRows>
constexpr int kScoreKeys = kBlockKeys<kRows>;
#endif

// The keys of a block of a run: key i is the run's key first + i * apart, and the row to ask for
// ahead of it lies ``reach`` rows further, where its stream reads next (past the stream's end, the
// same stream's of the next run, a run's length further on).
struct KeyBlock {
  int64_t first, apart, reach;
  int64_t key(int i) const { return first + i * apart; }
  int64_t asked(int i) const { return first + i * apart + reach; }
};

// block(first, apart, reach, keys) (a KeyBlock's fields: a struct passed to the block, which is not
// inlined, went through the stack and stalled on its load, an 8-bit step 1.2x the time) for the
// ``count`` keys of a run in blocks of kKeys, then the last count % kKeys keys one at a time (keys: an
// integral_constant, the block's key count), rows asked for ``ahead`` rows ahead (at most a stream's
// length). kStreams: a block takes a key of each of kKeys streams (the run cut in kKeys parts, read
// side by side), else kKeys neighbours. Rows read as streams: those whose reading is a decoding step's
// limit (kReadBound: keys of 16 bits or more, float32 and float64 values in value_rows). A core keeps
// more of the memory's reads in flight over a few streams than along one (benchmarks/read_streams.py:
// 128 KiB runs in 4 streams read 1.14-1.19x torch's one-stream sum, in 8 1.20-1.30x, 2 Zen 4 threads):
// a float32 step over 16384-65536 keys took 0.75-0.96x the time with GQA 32 / 8 (1.01-1.04x in one
// paged run, a slow minute where the old step read the sum's rate) and 0.74-0.79x with 8 / 8 (2 Zen 4
// threads; kernel_ab.py --read, --dense and paged; 1 thread 0.81x), AVX2 build 0.82x at 8 / 8,
// 0.98-1.0x at 32 / 8; a bfloat16 step with its keys in streams 0.91-1.03x (median 0.96; 1.04x on one thread with
// every byte in cache; AVX2 build 0.95-1.02x). Not 16-bit values (value_strips reads them in chunks of
// its own: with them in streams too, a bfloat16 step took 1.04-1.09x the time, its arithmetic being its
// limit on Zen 4), nor 8-bit rows, which their widening bounds (1.07-1.09x in a first version, whose
// blocks' passing had costs of its own).
template <int kKeys, bool kStreams, typename Block>
inline void in_key_blocks(int64_t count, int64_t ahead, Block block) {
  const int64_t apart = count / kKeys, whole = apart * kKeys;
  if constexpr (kStreams) {
    const int64_t near = std::min(ahead, apart);  // further, a stream's rows ahead would lie in the next one's
    for (int64_t j = 0; j < apart; ++j)
      block(j, apart, j + near < apart ? near : near + count - apart, std::integral_constant<int, kKeys>{});
  } else {
    for (int64_t j = 0; j < whole; j += kKeys) block(j, int64_t(1), ahead, std::integral_constant<int, kKeys>{});
  }
  for (int64_t j = whole; j < count; ++j) block(j, int64_t(0), ahead, std::integral_constant<int, 1>{});
}

// The scores of kRows query rows with ``count`` keys, block by block (kScoreKeys keys, in streams where
// kReadBound: in_key_blocks): 8-bit rows asked for ahead a block at a time (add_products asks for wider
// ones as it reads them), kRows x keys zeroed sums, add_products(b, sums) adding q_r . k_(b.key(i)) into
// sums[r][i] lane by lane, the lanes summed (lane_sums) and stored, times the keys' scales where given:
//   s[r * lds + j] = q_r . k_j (times scales[j * scale_ld])
template <int kRows, typename acc_t, typename key_t, typename AddProducts>
inline void score_blocks(int64_t count, int64_t D, const key_t* k, int64_t ld, acc_t* s, int64_t lds,
                         const acc_t* scales, int64_t scale_ld, AddProducts add_products) {
  using vec = typename Lanes<acc_t>::vec;
  const int64_t ahead = rows_ahead<key_t>(ld);
  in_key_blocks<kScoreKeys<kRows>, kReadBound<key_t>>(count, ahead, [&](int64_t first, int64_t apart, int64_t reach,
                                                                        auto keys) {
    const KeyBlock b{first, apart, reach};
    constexpr int kKeys = decltype(keys)::value;
    if constexpr (!kReadBound<key_t>)
      for (int i = 0; i < kKeys; ++i) prefetch_row(k + b.asked(i) * ld, D);
    vec sums[kRows][kKeys];  // every loop over a block's rows and keys unrolled: the sums stay in registers
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
      for (int i = 0; i < kKeys; ++i) sums[r][i] = vec{};
    add_products(b, sums);
    acc_t totals[kRows][kKeys];
    lane_sums<acc_t, kRows * kKeys>(&sums[0][0], &totals[0][0]);
    acc_t factor[kKeys];
#pragma GCC unroll 8
    for (int i = 0; i < kKeys; ++i) factor[i] = scales == nullptr ? acc_t(1) : scales[b.key(i) * scale_ld];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
      for (int i = 0; i < kKeys; ++i) s[r * lds + b.key(i)] = totals[r][i] * factor[i];
  });
}

#if defined(MHA_AVX512_BF16)
// score_block for bfloat16 keys on vdpbf16ps: 32 products a step, the keys as stored (no widening),
// for queries that are bfloat16 values (a bfloat16 call's, unscaled: the products are then exact and
// summed in float32, as widened keys' FMAs sum them; subnormal bfloat16 factors count as zero, as
// vdpbf16ps takes them): the queries as bfloat16_rows made them.
constexpr int64_t kPairRowMax = 512;
template <int kRows>
using QueryWords = uint16_t[kRows][kPairRowMax + 32];

// The rows' float queries as bfloat16 bits (zero to a multiple of 32), where every one is a bfloat16
// value and D <= kPairRowMax; else false (the widening loop takes them). Made once for the tiles' and
// vdpbf16ps' scores of a call.
template <int kRows>
bool bfloat16_rows(int64_t D, const float* q, QueryWords<kRows>& qb) {
  if (D > kPairRowMax) return false;
  const __m512i low_half = _mm512_set1_epi32(0xFFFF);
  for (int r = 0; r < kRows; ++r)
    for (int64_t d = 0; d < (D + 31) / 32 * 32; d += 16) {  // 16 at a time, zero past D
      const __mmask16 m = D - d >= 16 ? static_cast<__mmask16>(0xFFFF) : (D > d ? tail_mask(D - d) : 0);
      const __m512i bits = _mm512_maskz_loadu_epi32(m, q + r * D + d);
      if (_mm512_test_epi32_mask(bits, low_half)) return false;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb[r] + d), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
    }
  return true;
}

template <int kRows>
void pair_score_block(int64_t count, int64_t D, const QueryWords<kRows>& qb, const at::BFloat16* k, int64_t ld, float* s,
                      int64_t lds) {
  const int64_t Dw = D / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t(1) << (D - Dw)) - 1);
  score_blocks<kRows>(count, D, k, ld, s, lds, static_cast<const float*>(nullptr), 0, [&](KeyBlock b, auto& sums) {
    constexpr int kKeys = std::extent_v<std::remove_reference_t<decltype(sums)>, 1>;
    const at::BFloat16* first = k + b.key(0) * ld;
    const at::BFloat16* asked = k + b.asked(0) * ld;
    const int64_t apart = b.apart * ld;
    auto step = [&](int64_t d, __mmask32 mask) {
      __m512bh x[kKeys];
#pragma GCC unroll 8
      for (int i = 0; i < kKeys; ++i) prefetch_line<at::BFloat16>(asked + i * apart + d);  // a line each
#pragma GCC unroll 8
      for (int i = 0; i < kKeys; ++i) x[i] = (__m512bh)_mm512_maskz_loadu_epi16(mask, first + i * apart + d);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const __m512bh y = (__m512bh)_mm512_load_si512(qb[r] + d);
#pragma GCC unroll 8
        for (int i = 0; i < kKeys; ++i) sums[r][i] = _mm512_dpbf16_ps(sums[r][i], y, x[i]);
      }
    };
    for (int64_t d = 0; d < Dw; d += 32) step(d, ~__mmask32(0));
    if (Dw < D) step(Dw, tail);
  });
}
#endif

#if defined(MHA_AMX)
// score_block for bfloat16 keys on AMX tiles, where the CPU has them: S^T (16 keys x 4 query rows) = K
// (16 keys x 32 of D, tile-loaded from the cache's rows where they lie) . Q^T (the rows' pairs), D in
// steps of 32 (at most kStepTiles of them, their query tiles kept in tmm2-7), then each group's 16 x 4
// scores turned into the rows' runs of s by eight permutes. For the queries bfloat16_rows made (a
// bfloat16 call's, unscaled: the products exact, summed in float32, as pair_score_block's), D a whole
// number of steps, at least kStepTileKeys keys; returns the keys done (whole groups of 16: the rest are
// pair_score_block's, as are calls it does not take: 0), counted in tile_step_keys (tests). The tiles' shape before is put back (a prompt's run may hold its own).
// A decoding step's scores took 41% of its time on vdpbf16ps (B1 Hq32/Hkv8 D128, 16384 keys, Xeon with AMX).
constexpr int64_t kStepTiles = 6;
// The least keys a call takes on the tiles: each call packs its queries' pairs and loads and releases the
// tiles' shape, which runs of 16 keys (a paged cache's pages of 16 apart) did not earn back (1.16-1.24x
// the step's time on the tiles there).
constexpr int64_t kStepTileKeys = 64;

// The narrow score tiles' rows (16 bytes apart) as 32-bit scatter offsets, and a group's 16 keys x 4
// query rows as such a tile stores them (4 vectors of 4 keys x 4 rows) turned into each row's 16 keys.
inline __m512i narrow_rows() { return _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240); }
inline void group_rows(const __m512 (&quarter)[4], __m512 (&row)[4]) {
  const __m512i rows01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
  const __m512i rows23 = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
  const __m512i lows = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i highs = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m512 first01 = _mm512_permutex2var_ps(quarter[0], rows01, quarter[1]);
  const __m512 first23 = _mm512_permutex2var_ps(quarter[0], rows23, quarter[1]);
  const __m512 last01 = _mm512_permutex2var_ps(quarter[2], rows01, quarter[3]);
  const __m512 last23 = _mm512_permutex2var_ps(quarter[2], rows23, quarter[3]);
  row[0] = _mm512_permutex2var_ps(first01, lows, last01), row[1] = _mm512_permutex2var_ps(first01, highs, last01);
  row[2] = _mm512_permutex2var_ps(first23, lows, last23), row[3] = _mm512_permutex2var_ps(first23, highs, last23);
}

// A decoding step's tiles read their 16 rows of keys or values (lines 64-byte lines of each, row_bytes
// apart) from the cache where they lie; each group asks for the next group's lines into the first-level
// cache as it starts (past a run's last group, memory it may not read: a prefetch is only a hint). The
// vector loops' way, rows 8 KiB ahead into the second level (prefetch_line), filled the core's queue of
// misses before the tile loads (perf: the samples of both tile loops on the instructions after their
// loads and prefetches) and made the tiles slower than the vector loops from memory; asked for so, a
// step over a bfloat16 cache took 0.68-0.91x the time it took with no prefetch (Xeon with AMX, 2
// threads, S 4096-65536, GQA 32 / 8, D 128, dense and paged: `kernel_ab.py --read`); two groups ahead
// measured the same (0.77-0.94x), both group and line prefetches together 1.13-1.18x the vector loops.
inline void prefetch_next_group(const at::BFloat16* rows, int64_t row_bytes, int64_t lines) {
  const char* next = reinterpret_cast<const char*>(rows) + 16 * row_bytes;
  for (int i = 0; i < 16; ++i)
    for (int64_t line = 0; line < lines; ++line) __builtin_prefetch(next + i * row_bytes + 64 * line, 0, 3);
}

inline thread_local int64_t tile_step_keys = 0;  // the keys this thread scored on tile_score_block

template <int kRows>
int64_t tile_score_block(int64_t count, int64_t D, const QueryWords<kRows>& qb, const at::BFloat16* k, int64_t ld,
                         float* s, int64_t lds) {
  static_assert(kRows >= 1 && kRows <= 4);
  const int64_t steps = D / 32, groups = count / 16;
  if (count < kStepTileKeys || D % 32 != 0 || steps > kStepTiles || step_reading() != StepReading::tiles || !amx_usable())
    return 0;
  alignas(64) uint32_t pairs[kStepTiles][16][4] = {};  // step c, pair row p, query row r: values 32c + 2p, 32c + 2p + 1
  const __m512i pair_rows = narrow_rows();
  for (int r = 0; r < kRows; ++r)  // a row's 16 pairs a step (its words in order) to pair rows 16 bytes apart
    for (int64_t c = 0; c < steps; ++c)
      _mm512_i32scatter_epi32(&pairs[c][0][r], pair_rows, _mm512_load_si512(qb[r] + 32 * c), 1);
  const TileShape before = use_tiles(TileShape::step_scores);
  MHA_TILE_LOAD(2, pairs[0], 16);
  if (steps > 1) MHA_TILE_LOAD(3, pairs[1], 16);
  if (steps > 2) MHA_TILE_LOAD(4, pairs[2], 16);
  if (steps > 3) MHA_TILE_LOAD(5, pairs[3], 16);
  if (steps > 4) MHA_TILE_LOAD(6, pairs[4], 16);
  if (steps > 5) MHA_TILE_LOAD(7, pairs[5], 16);
  alignas(64) float scores[16 * 4];
  const int64_t row_bytes = ld * int64_t(sizeof(at::BFloat16));
  for (int64_t g = 0; g < groups; ++g) {
    const at::BFloat16* keys = k + g * 16 * ld;
    prefetch_next_group(keys, row_bytes, steps);
    MHA_TILE_ZERO(0);
    MHA_TILE_LOAD(1, keys, row_bytes);
    MHA_TILE_DP(0, 1, 2);
    if (steps > 1) { MHA_TILE_LOAD(1, keys + 32, row_bytes); MHA_TILE_DP(0, 1, 3); }
    if (steps > 2) { MHA_TILE_LOAD(1, keys + 64, row_bytes); MHA_TILE_DP(0, 1, 4); }
    if (steps > 3) { MHA_TILE_LOAD(1, keys + 96, row_bytes); MHA_TILE_DP(0, 1, 5); }
    if (steps > 4) { MHA_TILE_LOAD(1, keys + 128, row_bytes); MHA_TILE_DP(0, 1, 6); }
    if (steps > 5) { MHA_TILE_LOAD(1, keys + 160, row_bytes); MHA_TILE_DP(0, 1, 7); }
    MHA_TILE_STORE(0, scores, 16);
    const __m512 quarter[4] = {_mm512_load_ps(scores), _mm512_load_ps(scores + 16), _mm512_load_ps(scores + 32),
                               _mm512_load_ps(scores + 48)};
    __m512 row[4];
    group_rows(quarter, row);
    for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(s + r * lds + g * 16, row[r]);
  }
  restore_tiles(before);
  tile_step_keys += groups * 16;
  return groups * 16;
}
#endif

#if defined(MHA_AVX512_BF16) && defined(__AVX512VNNI__)
// The n floats at x as 16-bit integers times a power of two, written to out (rounded to the nearest,
// 2^15 saturated; whole vectors of 16, zero past n), the largest at 2^14 .. 2^15 (2^-shift, the value
// of an integer 1, in unit; a row of zeros: 1): the rows word_score_block and word_value_chunk
// multiply. False, writing nothing of use, for a NaN or an infinity, or a row whose largest value is
// below 2^-112 (2^shift would not be a normal float): the float loops take those.
inline bool words_of(const float* x, int64_t n, int16_t* out, float& unit) {
  __m512 top = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(n - d >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(n - d), x + d);
    if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) return false;
    top = _mm512_max_ps(top, _mm512_abs_ps(v));
  }
  const float largest = _mm512_reduce_max_ps(top);
  int exponent = 0;
  std::frexp(largest, &exponent);  // largest = m 2^exponent, m in [0.5, 1)
  const int shift = largest > 0.0f ? 15 - exponent : 0;
  if (!std::isfinite(largest) || shift > 126 || shift < -126) return false;
  const auto power = [](int e) {
    const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  };
  const __m512 times = _mm512_set1_ps(power(shift));
  unit = power(-shift);
  for (int64_t d = 0; d < n; d += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(n - d >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(n - d), x + d);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v, times))));
  }
  return true;
}

// score_block for 8-bit keys under a bfloat16 call's queries (bfloat16 values), on vpdpwssd: 32 products of
// 16-bit integers a step, summed exactly in 32-bit lanes, where widened keys take 16 a step and two
// instructions to widen. Each query row becomes 16-bit integers times a power of two (its largest
// value at 2^14 .. 2^15): exact for every value within 2^7 of the row's largest (a bfloat16 value
// has 8 significant bits), the rest rounded to within 2^-15 of that largest, far below the
// bfloat16 rounding the queries carry already (2^-9 of each value): for bfloat16 calls only
// (score_block's bf16_call; float32 calls keep the widening loop's exact products). Returns false,
// computing nothing, where words_of does, or for rows wider than kPairRowMax.
template <int kRows>
bool word_score_block(int64_t count, int64_t D, const float* q, const int8_t* k, int64_t ld, float* s, int64_t lds,
                      const float* scales, int64_t scale_ld) {
  if (D > kPairRowMax) return false;
  alignas(64) int16_t qw[kRows][kPairRowMax + 32];
  float unit[kRows];  // the value of a row's integer 1
  for (int r = 0; r < kRows; ++r) {
    if (!words_of(q + r * D, D, qw[r], unit[r])) return false;
    std::fill(qw[r] + (D + 15) / 16 * 16, qw[r] + (D + 31) / 32 * 32, int16_t(0));
  }
  const int64_t Dw = D / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t(1) << (D - Dw)) - 1);
  score_blocks<kRows>(count, D, k, ld, s, lds, scales, scale_ld, [&](KeyBlock b, auto& sums) {
    constexpr int kKeys = std::extent_v<std::remove_reference_t<decltype(sums)>, 1>;
    const int8_t* first = k + b.key(0) * ld;
    const int64_t apart = b.apart * ld;
    __m512i whole[kRows][kKeys];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
      for (int i = 0; i < kKeys; ++i) whole[r][i] = _mm512_setzero_si512();
    auto step = [&](int64_t d, __mmask32 mask) {
      __m512i x[kKeys];
#pragma GCC unroll 8
      for (int i = 0; i < kKeys; ++i) x[i] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, first + i * apart + d));
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const __m512i y = _mm512_load_si512(qw[r] + d);
#pragma GCC unroll 8
        for (int i = 0; i < kKeys; ++i) whole[r][i] = _mm512_dpwssd_epi32(whole[r][i], y, x[i]);
      }
    };
    for (int64_t d = 0; d < Dw; d += 32) step(d, ~__mmask32(0));
    if (Dw < D) step(Dw, tail);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
      for (int i = 0; i < kKeys; ++i) sums[r][i] = _mm512_mul_ps(_mm512_cvtepi32_ps(whole[r][i]), _mm512_set1_ps(unit[r]));
  });
  return true;
}
#endif

#if defined(MHA_AMX) && defined(__AVX512VNNI__)
// word_score_block on AMX tiles, where the CPU has their 8-bit products: the same 16-bit integer query
// rows (words_of), each split into a signed high byte and an unsigned low one (w = 256 hi + lo), S^T
// (16 keys x 4 query rows) = K (16 keys x 64 of D, tile-loaded from the cache's rows where they lie) .
// hi^T (tdpbssd, tmm0) and . lo^T (tdpbsud, tmm6), D in steps of 64 (at most two: hi in tmm2-3, lo in
// tmm4-5), summed exactly as integers (256 hi + lo: at most 2^30 at D = 128), then once a float, times
// the row's unit and the key's scale. For D 64 or 128, at least kStepTileKeys keys; returns the keys
// done (whole groups of 16: the rest are word_score_block's, as are the calls it does not take: 0),
// counted in tile_step_keys (tests).
template <int kRows>
int64_t tile_word_score_block(int64_t count, int64_t D, const float* q, const int8_t* k, int64_t ld, float* s,
                              int64_t lds, const float* scales, int64_t scale_ld) {
  static_assert(kRows >= 1 && kRows <= 4);
  if (count < kStepTileKeys || (D != 64 && D != 128) || scale_ld > (int64_t(1) << 26) || !amx_int8_usable())
    return 0;  // (the scales' gather takes 32-bit offsets)
  const int64_t steps = D / 64, groups = count / 16;
  alignas(64) int16_t qw[kRows][128 + 32];
  float unit[4] = {0, 0, 0, 0};
  for (int r = 0; r < kRows; ++r)
    if (!words_of(q + r * D, D, qw[r], unit[r])) return 0;
  // step c, quad row p, query row r: the 4 bytes of dims 64c + 4p .. + 3
  alignas(64) uint8_t hi[2][16][4][4] = {}, lo[2][16][4][4] = {};
  const __m512i quads = narrow_rows();
  for (int r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < steps; ++c) {  // a row's 16 quads of bytes to quad rows 16 bytes apart
      const __m512i a = _mm512_load_si512(qw[r] + 64 * c), b = _mm512_load_si512(qw[r] + 64 * c + 32);
      const __m512i low = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(a)), _mm512_cvtepi16_epi8(b), 1);
      const __m512i high = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(a, 8))),
                                              _mm512_cvtepi16_epi8(_mm512_srai_epi16(b, 8)), 1);
      _mm512_i32scatter_epi32(&lo[c][0][r][0], quads, low, 1);
      _mm512_i32scatter_epi32(&hi[c][0][r][0], quads, high, 1);
    }
  const TileShape before = use_tiles(TileShape::step_scores);
  MHA_TILE_LOAD(2, hi[0], 16);
  MHA_TILE_LOAD(4, lo[0], 16);
  if (steps > 1) {
    MHA_TILE_LOAD(3, hi[1], 16);
    MHA_TILE_LOAD(5, lo[1], 16);
  }
  const __m512i scale_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(static_cast<int>(scale_ld)));
  alignas(64) int32_t high[16 * 4], low[16 * 4];
  const int64_t ahead = rows_ahead<int8_t>(ld);
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* keys = k + g * 16 * ld;
    for (int i = 0; i < 16; ++i) prefetch_row(keys + (ahead + i) * ld, D);  // as score_blocks asks for 8-bit rows
    MHA_TILE_ZERO(0);
    MHA_TILE_ZERO(6);
    MHA_TILE_LOAD(1, keys, ld);
    MHA_TILE_DP_SS(0, 1, 2);
    MHA_TILE_DP_SU(6, 1, 4);
    if (steps > 1) {
      MHA_TILE_LOAD(1, keys + 64, ld);
      MHA_TILE_DP_SS(0, 1, 3);
      MHA_TILE_DP_SU(6, 1, 5);
    }
    MHA_TILE_STORE(0, high, 16);
    MHA_TILE_STORE(6, low, 16);
    __m512 quarter[4];  // keys 4i .. 4i + 3 x rows 0 .. 3
    for (int i = 0; i < 4; ++i)
      quarter[i] = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(high + 16 * i), 8),
                                                       _mm512_load_si512(low + 16 * i)));
    __m512 row[4];
    group_rows(quarter, row);
    const __m512 key_scales = _mm512_i32gather_ps(scale_at, scales + g * 16 * scale_ld, 4);
    for (int r = 0; r < kRows; ++r)
      _mm512_storeu_ps(s + r * lds + g * 16, _mm512_mul_ps(_mm512_mul_ps(row[r], _mm512_set1_ps(unit[r])), key_scales));
  }
  restore_tiles(before);
  tile_step_keys += groups * 16;
  return groups * 16;
}
#endif

//   s[r * lds + j] = q_r . k_j (times scales[j * scale_ld] where given)   q: kRows rows of D, k: ``count`` rows ld apart
// bf16_call: the queries are a bfloat16 call's, whose rounding is the call's own (8-bit keys may then
// be scored on 16-bit integers: word_score_block).
template <int kRows, typename acc_t, typename key_t>
void score_block(int64_t count, int64_t D, const acc_t* q, const key_t* k, int64_t ld, acc_t* s, int64_t lds,
                 const acc_t* scales, int64_t scale_ld, bool bf16_call) {
#if defined(MHA_AVX512_BF16)
  if constexpr (std::is_same_v<key_t, at::BFloat16> && std::is_same_v<acc_t, float>) {
    alignas(64) QueryWords<kRows> qb;
    if (scales == nullptr && bfloat16_rows<kRows>(D, q, qb)) {
#if defined(MHA_AMX)
      const int64_t done = tile_score_block<kRows>(count, D, qb, k, ld, s, lds);  // whole groups of 16 keys
      count -= done, k += done * ld, s += done;
#endif
      if (count > 0) pair_score_block<kRows>(count, D, qb, k, ld, s, lds);  // the rest on vdpbf16ps
      return;
    }
  }
#endif
#if defined(MHA_AVX512_BF16) && defined(__AVX512VNNI__)
  if constexpr (std::is_same_v<key_t, int8_t> && std::is_same_v<acc_t, float>)
    if (bf16_call) {
#if defined(MHA_AMX)
      const int64_t done = scales == nullptr ? 0 : tile_word_score_block<kRows>(count, D, q, k, ld, s, lds, scales, scale_ld);
      count -= done, k += done * ld, s += done, scales += done * scale_ld;
      if (count == 0) return;
#endif
      if (word_score_block<kRows>(count, D, q, k, ld, s, lds, scales, scale_ld)) return;
    }
#endif
  using V = Lanes<acc_t>;
  using vec = typename V::vec;
  const int64_t Dw = D / V::kCount * V::kCount;
  // each row's sums over whole vectors, then the last values as one more vector (zero-padded)
  score_blocks<kRows>(count, D, k, ld, s, lds, scales, scale_ld, [&](KeyBlock b, auto& sums) {
    constexpr int kKeys = std::extent_v<std::remove_reference_t<decltype(sums)>, 1>;
    const key_t* first = k + b.key(0) * ld;
    const key_t* asked = k + b.asked(0) * ld;
    const int64_t apart = b.apart * ld;
    auto step = [&](auto vector_at, int64_t d) {  // vector_at(row): the vector of the row's values at column d
      if (kReadBound<key_t> && (d * static_cast<int64_t>(sizeof(key_t))) % 64 == 0)  // rows ahead, a line each
        for (int i = 0; i < kKeys; ++i) prefetch_line<key_t>(asked + i * apart + d);
      vec x[kKeys];
#pragma GCC unroll 8
      for (int i = 0; i < kKeys; ++i) x[i] = vector_at(first + i * apart);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const vec y = vector_at(q + r * D);
#pragma GCC unroll 8
        for (int i = 0; i < kKeys; ++i) sums[r][i] += y * x[i];
      }
    };
    for (int64_t d = 0; d < Dw; d += V::kCount) step([&](const auto* row) { return widen<acc_t>(row + d); }, d);
    if (Dw < D) step([&](const auto* row) { return widen_tail<acc_t>(row + Dw, D - Dw); }, Dw);
  });
}

// Value columns per strip for a block of kRows rows: kRows x kValueStrip accumulators stay in
// registers while a chunk of kValueChunk keys is added in (their weights gathered at once, their rows
// read once a strip), so the output is read and written once a chunk. In 16 registers: 8 for 1 row,
// 4 x 2 for 4, with one broadcast weight a row and one value vector. In AVX-512's 32: 16 (2 x 8,
// 4 x 4) over chunks of 32 keys, for a strip's fixed cost (its accumulators loaded and stored, its
// chains of FMAs filled) is a share of more products: a decoding step with 8-bit or bfloat16 values
// (4 rows a kv head, Zen 4, one thread, S 1024 and 8192) took 0.94-0.96x the time of 4 x 2 over 8 keys.
#if defined(MHA_AVX512)
template <int kRows>
constexpr int kValueStrip = kRows <= 2 ? 8 : 4;
constexpr int64_t kValueChunk = 32;
#else
template <int kRows>
constexpr int kValueStrip = kRows == 1 ? 8 : (kRows == 2 ? 4 : (kRows == 3 ? 3 : 2));
constexpr int64_t kValueChunk = 8;
#endif

// acc[r * Dv + d ..] for kStrip vectors from d += sum_i w[r * ldw + i] v_i[d ..], i < count; the same
// columns of rows ahead (every line of the strip's width) asked for as each key is read (kAheadBytes
// ahead, at least the next chunk's; spread over the strips: a burst of a chunk's lines at once outruns
// the cache's queue of misses).
template <int kRows, int kStrip, typename acc_t, typename value_t>
inline void value_strip(int64_t d, int64_t count, const acc_t* w, int64_t ldw, const value_t* v, int64_t ld, acc_t* acc,
                        int64_t Dv) {
  using V = Lanes<acc_t>;
  using vec = typename V::vec;
  vec a[kRows][kStrip];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
    for (int s = 0; s < kStrip; ++s) a[r][s] = V::load(acc + r * Dv + d + s * V::kCount);
  constexpr int64_t kStripBytes = kStrip * V::kCount * static_cast<int64_t>(sizeof(value_t));
  const int64_t ld_bytes = ld * static_cast<int64_t>(sizeof(value_t));
  const int64_t ahead = kReadBound<value_t> ? std::max(count, kAheadBytes<value_t> / ld_bytes) : count;
  for (int64_t i = 0; i < count; ++i) {
    const value_t* row = v + i * ld + d;
    for (int64_t byte = 0; byte < kStripBytes; byte += 64) prefetch_line<value_t>(reinterpret_cast<const char*>(row + ahead * ld) + byte);
    acc_t b[kRows];  // each broadcast once a key
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) b[r] = w[r * ldw + i];
#pragma GCC unroll 8
    for (int s = 0; s < kStrip; ++s) {
      const vec x = widen<acc_t>(row + s * V::kCount);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) a[r][s] += b[r] * x;
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
    for (int s = 0; s < kStrip; ++s) V::store(acc + r * Dv + d + s * V::kCount, a[r][s]);
}

#if defined(MHA_AVX512_BF16) && defined(__AVX512VNNI__)
// The columns 0 .. Dv / 32 * 32 of a chunk of n (<= kValueChunk) 8-bit value rows for a bfloat16 call
// (value_strips' bf16_call), on vpdpwssd: each row's chunk of weights as 16-bit integers times a power
// of two (its largest at 2^14 .. 2^15: each within 2^-15 of it, a chunk's 32 within 2^-10 of it at
// worst, below the bfloat16 rounding of the call's output, 2^-9), keys in pairs (each pair's two rows widened and interleaved value by value,
// 32 products an instruction where widened rows take 16 and two instructions to widen), summed exactly
// in 32-bit lanes and added to acc once a chunk. Returns the columns done: 0 where words_of refuses a
// row of weights (a NaN row's: the float loop carries it).
template <int kRows>
int64_t word_value_chunk(int64_t n, int64_t Dv, const float* w, int64_t ldw, const int8_t* v, int64_t ld, float* acc) {
  const int64_t columns = Dv / 32 * 32;
  if (columns == 0) return 0;
  alignas(64) int16_t words[kRows][kValueChunk];  // a pair of keys' weights is one 32-bit word
  float unit[kRows];
  for (int r = 0; r < kRows; ++r) {
    if (!words_of(w + r * ldw, n, words[r], unit[r])) return 0;
    std::fill(words[r] + (n + 15) / 16 * 16, words[r] + kValueChunk, int16_t(0));
  }
  // an interleaved pair's sums lie in lanes of columns 0-3, 8-11, .. (lo) and 4-7, 12-15, .. (hi):
  // column c of 0 .. 15 (in_order[0]) and 16 .. 31 (in_order[1]) is lane c % 8 of lo or hi's 128-bit part c / 8
  const __m512i in_order[2] = {_mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
                                _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31)};
  for (int64_t d = 0; d < columns; d += 32) {
    __m512i lo[kRows], hi[kRows];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
    for (int64_t i = 0; i < n; i += 2) {
      const int8_t* a = v + i * ld + d;
      prefetch_line<int8_t>(a + n * ld);  // the next chunk's rows (as value_strip asks)
      const __m512i first = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
      __m512i second = _mm512_setzero_si512();
      if (i + 1 < n) {
        prefetch_line<int8_t>(a + (n + 1) * ld);
        second = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + ld)));
      }
      const __m512i low = _mm512_unpacklo_epi16(first, second), high = _mm512_unpackhi_epi16(first, second);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        int32_t pair;
        std::memcpy(&pair, words[r] + i, sizeof(pair));  // (past n: zero weights, written above)
        const __m512i y = _mm512_set1_epi32(pair);
        lo[r] = _mm512_dpwssd_epi32(lo[r], low, y);
        hi[r] = _mm512_dpwssd_epi32(hi[r], high, y);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r)
      for (int half = 0; half < 2; ++half) {
        float* out = acc + r * Dv + d + 16 * half;
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo[r], in_order[half], hi[r]));
        _mm512_storeu_ps(out, _mm512_fmadd_ps(sum, _mm512_set1_ps(unit[r]), _mm512_loadu_ps(out)));
      }
  }
  return columns;
}
#endif

#if defined(MHA_AMX)
// value_block's bfloat16 values on AMX tiles, where the CPU has them: acc (kRows x Dv) += P (kRows x 16
// keys a group, rounded to bfloat16: the call's own rounding, its values and output being bfloat16, as
// the prompts' tiles and torch's SDPA round their weights) . V (16 keys x 32 columns a tile, loaded from
// the cache's rows where they lie). V's rows are not repacked into pairs of keys: a row as the B tile pairs
// neighbouring columns, so A's rows 0..3 are the weights paired with zeros, (w, 0), and rows 4..7 the
// same as (0, w): a product's rows 0..3 are the even columns of its 32, rows 4..7 the odd, put back in
// order (two permutes a row) when added to acc. Up to 4 column tiles (tmm0-3, 8 rows) a pass, their
// weights' tile in tmm4, V's in tmm5-7. For Dv a whole number of 32 up to 256 and at least kStepTileKeys
// keys, at most kBlockK of them (the caller calls again for the rest); returns the keys done (whole
// groups of 16: the rest are value_strips', as are calls it does not take and sums not all finite: 0),
// counted in tile_step_values (tests). A weight below
// 2^-126 would be zero on the tiles (they take no subnormal input); the exponentials make those zero
// already. Against the widening loop (Xeon with AMX, 1 thread, B1 Hq32/Hkv8 D128, kernel_ab.py): 0.87x a
// step's time with its cache in the second-level cache (S 256), 0.95-0.98x from memory (S 1024-16384).
inline thread_local int64_t tile_step_values = 0;  // the keys this thread added on tile_value_block

template <int kRows>
int64_t tile_value_block(int64_t count, int64_t Dv, const float* p, int64_t ldp, const at::BFloat16* v, int64_t ld,
                         float* acc) {
  static_assert(kRows >= 1 && kRows <= 4);
  constexpr int64_t kGroups = kBlockK / 16, kTiles = 8;
  const int64_t groups = std::min(count / 16, kGroups), blocks = Dv / 32;
  if (count < kStepTileKeys || Dv % 32 != 0 || blocks > kTiles || step_reading() != StepReading::tiles || !amx_usable())
    return 0;
  alignas(64) uint32_t a[kGroups][8][16];  // group g: rows r (w, 0) and 4 + r (0, w), rows past kRows zero
  alignas(64) float c[kTiles][8][16];
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < kRows; ++r) {
      const __m512i w = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + r * ldp + g * 16)));
      _mm512_store_si512(a[g][r], w);
      _mm512_store_si512(a[g][4 + r], _mm512_slli_epi32(w, 16));
    }
    for (int r = kRows; r < 4; ++r) {  // (the groups used only: a whole zeroing was 8 KiB a call)
      _mm512_store_si512(a[g][r], _mm512_setzero_si512());
      _mm512_store_si512(a[g][4 + r], _mm512_setzero_si512());
    }
  }
  const int64_t row_bytes = ld * int64_t(sizeof(at::BFloat16));
  const TileShape before = use_tiles(TileShape::step_values);
  for (int64_t c0 = 0; c0 < blocks; c0 += 4) {
    const int64_t tiles = std::min<int64_t>(4, blocks - c0);
    MHA_TILE_ZERO(0);
    if (tiles > 1) MHA_TILE_ZERO(1);
    if (tiles > 2) MHA_TILE_ZERO(2);
    if (tiles > 3) MHA_TILE_ZERO(3);
    for (int64_t g = 0; g < groups; ++g) {
      const at::BFloat16* rows = v + g * 16 * ld + 32 * c0;
      prefetch_next_group(rows, row_bytes, tiles);
      MHA_TILE_LOAD(4, a[g], 64);
      MHA_TILE_LOAD(5, rows, row_bytes);
      MHA_TILE_DP(0, 4, 5);
      if (tiles > 1) { MHA_TILE_LOAD(6, rows + 32, row_bytes); MHA_TILE_DP(1, 4, 6); }
      if (tiles > 2) { MHA_TILE_LOAD(7, rows + 64, row_bytes); MHA_TILE_DP(2, 4, 7); }
      if (tiles > 3) { MHA_TILE_LOAD(5, rows + 96, row_bytes); MHA_TILE_DP(3, 4, 5); }
    }
    MHA_TILE_STORE(0, c[c0], 64);
    if (tiles > 1) MHA_TILE_STORE(1, c[c0 + 1], 64);
    if (tiles > 2) MHA_TILE_STORE(2, c[c0 + 2], 64);
    if (tiles > 3) MHA_TILE_STORE(3, c[c0 + 3], 64);
  }
  restore_tiles(before);
  // an infinite or NaN value reaches its neighbouring column here (times the zero beside its weight):
  // such sums go to the widening loop, which keeps each column its own (the rows read: the zero rows past
  // kRows turn NaN only where the rows read do too, an infinite or NaN value times a weight or its zero)
  __mmask16 finite = 0xFFFF;
  for (int64_t t = 0; t < blocks; ++t)
    for (int r = 0; r < kRows; ++r) {
      const __m512 even = _mm512_load_ps(c[t][r]), odd = _mm512_load_ps(c[t][4 + r]);
      finite &= _mm512_cmp_ps_mask(_mm512_sub_ps(even, even), _mm512_setzero_ps(), _CMP_EQ_OQ) &
                _mm512_cmp_ps_mask(_mm512_sub_ps(odd, odd), _mm512_setzero_ps(), _CMP_EQ_OQ);
    }
  if (finite != 0xFFFF) return 0;
  const __m512i evens = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i odds = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t t = 0; t < blocks; ++t)
    for (int r = 0; r < kRows; ++r) {
      const __m512 even = _mm512_load_ps(c[t][r]), odd = _mm512_load_ps(c[t][4 + r]);
      float* out = acc + r * Dv + 32 * t;
      _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), _mm512_permutex2var_ps(even, evens, odd)));
      _mm512_storeu_ps(out + 16, _mm512_add_ps(_mm512_loadu_ps(out + 16), _mm512_permutex2var_ps(even, odds, odd)));
    }
  tile_step_values += groups * 16;
  return groups * 16;
}
#endif

// value_block for values widened as they are read (bfloat16, float16, 8-bit), whose conversion, not
// their read, is the limit: in chunks of kValueChunk keys, each chunk strip by strip of the output's
// columns (value_strip); each output value adds its keys one at a time, in order.
template <int kRows, typename acc_t, typename value_t>
void value_strips(int64_t count, int64_t Dv, const acc_t* p, int64_t ldp, const value_t* v, int64_t ld, acc_t* acc,
                  const acc_t* scales, int64_t scale_ld, bool bf16_call) {
  using V = Lanes<acc_t>;
  constexpr int kStrip = kValueStrip<kRows>;
  const int64_t Dw = Dv / V::kCount * V::kCount;
#if defined(MHA_AMX)
  if constexpr (std::is_same_v<value_t, at::BFloat16> && std::is_same_v<acc_t, float>) {
    if (scales == nullptr)  // whole groups of 16 keys, at most kBlockK a call
      for (int64_t done; count > 0 && (done = tile_value_block<kRows>(count, Dv, p, ldp, v, ld, acc)) > 0;)
        count -= done, p += done, v += done * ld;
  }
#endif
  acc_t scaled[kRows * kValueChunk];  // 8-bit values' weights times their rows' scales
  for (int64_t j0 = 0; j0 < count; j0 += kValueChunk) {
    const int64_t n = std::min(kValueChunk, count - j0);
    const value_t* chunk = v + j0 * ld;
    const acc_t* w = p + j0;
    int64_t ldw = ldp;
    if (scales != nullptr) {
      for (int r = 0; r < kRows; ++r)
        for (int64_t i = 0; i < n; ++i) scaled[r * kValueChunk + i] = p[r * ldp + j0 + i] * scales[(j0 + i) * scale_ld];
      w = scaled, ldw = kValueChunk;
    }
    int64_t d = 0;
#if defined(MHA_AVX512_BF16) && defined(__AVX512VNNI__)
    if constexpr (std::is_same_v<value_t, int8_t> && std::is_same_v<acc_t, float>)
      if (bf16_call) d = word_value_chunk<kRows>(n, Dv, w, ldw, chunk, ld, acc);
#endif
    for (; d + kStrip * V::kCount <= Dw; d += kStrip * V::kCount) value_strip<kRows, kStrip>(d, n, w, ldw, chunk, ld, acc, Dv);
    if constexpr (kStrip > 4)
      if (d + 4 * V::kCount <= Dw) value_strip<kRows, 4>(d, n, w, ldw, chunk, ld, acc, Dv), d += 4 * V::kCount;
    if constexpr (kStrip > 2)
      if (d + 2 * V::kCount <= Dw) value_strip<kRows, 2>(d, n, w, ldw, chunk, ld, acc, Dv), d += 2 * V::kCount;
    for (; d < Dw; d += V::kCount) value_strip<kRows, 1>(d, n, w, ldw, chunk, ld, acc, Dv);
    for (; d < Dv; ++d)
      for (int r = 0; r < kRows; ++r)
        for (int64_t i = 0; i < n; ++i) acc[r * Dv + d] += w[r * ldw + i] * static_cast<acc_t>(chunk[i * ld + d]);
  }
}

// value_block for values stored as acc_t (and narrower ones where step_reading() says rows, widened as
// read), read row by row, whole (kBlockKeys at a time, in streams:
// in_key_blocks; the output read and added to once a block): a long cache's float32 values are
// read-bound, and reading rows whole keeps the memory busiest (measured, AVX2 at 1 and 2 threads: this
// loop took 0.85-0.92x the strips' time over 16384 keys; the strips 0.88x this loop's where the values
// were in the cache). The distance ahead is made once a call: made a block (a division) before the
// streams, for a register the AVX2 build's loop had spilled (float32 decoding 1.14-1.18x the time
// then); with the streams the AVX2 build's step took 0.98-1.0x (GQA 32 / 8) and 0.82x (8 / 8) the
// time of before.
template <int kRows, typename acc_t, typename value_t>
void value_rows(int64_t count, int64_t Dv, const acc_t* p, int64_t ldp, const value_t* v, int64_t ld, acc_t* acc,
                 const acc_t* scales, int64_t scale_ld) {
  using V = Lanes<acc_t>;
  using vec = typename V::vec;
  const int64_t Dw = Dv / V::kCount * V::kCount;
  in_key_blocks<kBlockKeys<kRows>, kReadBound<value_t>>(count, rows_ahead<value_t>(ld), [&](int64_t first, int64_t apart,
                                                                                           int64_t reach, auto keys) {
    const KeyBlock b{first, apart, reach};
    constexpr int kKeys = decltype(keys)::value;
    acc_t w[kRows][kKeys];
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < kKeys; ++i) w[r][i] = scales == nullptr ? p[r * ldp + b.key(i)] : p[r * ldp + b.key(i)] * scales[b.key(i) * scale_ld];
    for (int64_t d = 0; d < Dw; d += V::kCount) {
      vec x[kKeys];
      if ((d * static_cast<int64_t>(sizeof(value_t))) % 64 == 0)  // rows ahead, a line each (kAheadBytes)
        for (int i = 0; i < kKeys; ++i) prefetch_line<value_t>(v + b.asked(i) * ld + d);
#pragma GCC unroll 8
      for (int i = 0; i < kKeys; ++i) x[i] = widen<acc_t>(v + b.key(i) * ld + d);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        vec t = w[r][0] * x[0];
#pragma GCC unroll 8
        for (int i = 1; i < kKeys; ++i) t += w[r][i] * x[i];
        V::store(acc + r * Dv + d, V::load(acc + r * Dv + d) + t);
      }
    }
    if (Dw < Dv && (Dw * static_cast<int64_t>(sizeof(value_t))) % 64 == 0)  // the rows' last line
      for (int i = 0; i < kKeys; ++i) prefetch_line<value_t>(v + b.asked(i) * ld + Dw);
    for (int64_t d = Dw; d < Dv; ++d)
      for (int r = 0; r < kRows; ++r) {
        acc_t t = w[r][0] * static_cast<acc_t>(v[b.key(0) * ld + d]);
        for (int i = 1; i < kKeys; ++i) t += w[r][i] * static_cast<acc_t>(v[b.key(i) * ld + d]);
        acc[r * Dv + d] += t;
      }
  });
}

//   acc_r += sum_j w_rj v_j, w_rj = p[r * ldp + j] (times scales[j * scale_ld] where given)   v: ``count`` rows of Dv, ld apart
template <int kRows, typename acc_t, typename value_t>
void value_block(int64_t count, int64_t Dv, const acc_t* p, int64_t ldp, const value_t* v, int64_t ld, acc_t* acc,
                 const acc_t* scales, int64_t scale_ld, bool bf16_call) {
  if constexpr (std::is_same_v<value_t, acc_t>) {
    value_rows<kRows>(count, Dv, p, ldp, v, ld, acc, scales, scale_ld);
  } else {
    if (step_reading() == StepReading::rows)  // bfloat16, float16 and 8-bit values: as step_reading says
      return value_rows<kRows>(count, Dv, p, ldp, v, ld, acc, scales, scale_ld);
    value_strips<kRows>(count, Dv, p, ldp, v, ld, acc, scales, scale_ld, bf16_call);
  }
}

// The R rows in blocks of up to kRowBlock: each block's call of score_block or value_block (a block
// reads each key and value row once).
constexpr int64_t kRowBlock = 4;
template <typename Call>
inline void in_row_blocks(int64_t R, Call call) {
  for (int64_t r0 = 0; r0 < R; r0 += kRowBlock) {
    switch (std::min<int64_t>(kRowBlock, R - r0)) {
      case 1: call(r0, std::integral_constant<int, 1>{}); break;
      case 2: call(r0, std::integral_constant<int, 2>{}); break;
      case 3: call(r0, std::integral_constant<int, 3>{}); break;
      default: call(r0, std::integral_constant<int, 4>{}); break;
    }
  }
}

//   s[r * lds + j] = q_r . k_j (times the keys' scales, for 8-bit keys)   q: R rows of D, k: ``count`` rows ld apart
template <typename acc_t, typename key_t>
void run_scores(int64_t R, int64_t count, int64_t D, const acc_t* q, const key_t* k, int64_t ld, acc_t* s, int64_t lds,
                const acc_t* scales = nullptr, int64_t scale_ld = 0, bool bf16_call = false) {
  in_row_blocks(R, [&](int64_t r0, auto rows) {
    score_block<decltype(rows)::value>(count, D, q + r0 * D, k, ld, s + r0 * lds, lds, scales, scale_ld, bf16_call);
  });
}

//   acc_r += sum_j p[r * ldp + j] v_j (times the values' scales, for 8-bit values)   v: ``count`` rows of Dv, ld apart
// bf16_call: as run_scores'.
template <typename acc_t, typename value_t>
void run_values(int64_t R, int64_t count, int64_t Dv, const acc_t* p, int64_t ldp, const value_t* v, int64_t ld,
                acc_t* acc, const acc_t* scales = nullptr, int64_t scale_ld = 0, bool bf16_call = false) {
  in_row_blocks(R, [&](int64_t r0, auto rows) {
    value_block<decltype(rows)::value>(count, Dv, p + r0 * ldp, ldp, v, ld, acc + r0 * Dv, scales, scale_ld, bf16_call);
  });
}
#pragma GCC diagnostic pop
constexpr int64_t kRunLoopRows = 8;  // at most this many rows: run_scores and run_values, else brgemm

// ---- decoding: a few query rows against many keys -------------------------------------------------
//
// With G * L <= kDecodeRows rows per key/value head (a decoding step), the keys are read straight
// from the cache's rows, once for the G heads that share them (run_scores, run_values), and never
// repacked: the forward's blocks and plan (forward_blocks; a head's keys split among the threads when
// there are fewer heads than threads, merged by log-sum-exp: flash-decoding) on StepProducts.

constexpr int64_t kDecodeRows = 16;

// A decoding step's products on the cache as it lies, (B, Hkv, S, D) with its rows where ks and vs
// say (a KV cache's first S of more slots, a projection's heads): the rows' queries unscaled in acc_t (a bfloat16 call's stay
// bfloat16 values: pair_score_block), the keys and values widened in registers. A tile of kBlockK keys
// a chunk: run_scores makes its queries' forms once a chunk (bfloat16 pairs); at 64 keys a chunk a
// step over 16384 keys took 1.2-1.3x the time in bfloat16, 1.05-1.1x in float32 (Zen 4, 2 threads).
template <typename scalar_t, typename acc_t>
struct StepProducts {
  static constexpr int64_t kAlign = 1;
  static constexpr bool kScaled = false;
  const Shape& sh;
  const scalar_t* k;
  RowStrides ks;
  const scalar_t* v;
  RowStrides vs;
  Scratch<acc_t> qr;

  void pack_row(int64_t r, int64_t R, const scalar_t* src) {
    std::transform(src, src + sh.D, qr.at_least(R * sh.D) + r * sh.D, [](scalar_t x) { return static_cast<acc_t>(x); });
  }
  void scores(int64_t bh, int64_t R, int64_t j0, int64_t n, acc_t* s) {
    run_scores(R, n, sh.D, qr.data(), k + ks.at(bh / sh.Hkv, bh % sh.Hkv, j0), ks.row, s, n);
  }
  acc_t* weights(acc_t* s) { return s; }  // in place of the scores
  void add_values(int64_t bh, int64_t R, int64_t j0, int64_t n, const acc_t* p, acc_t* acc) {
    run_values(R, n, sh.Dv, p, n, v + vs.at(bh / sh.Hkv, bh % sh.Hkv, j0), vs.row, acc);
  }
};

// ---- the weights: a call that asks for them (need_weights) ---------------------------------------
//
// Each row's scores over all S keys, written where its weights go ((B, H, L, S) in acc_t: the G * L
// rows of one key/value head are consecutive there), shaped by the terms; then one softmax per row
// (its max, the exponentials in place, divided by their sum with the sink's share) and the weights
// times V. The math backend's computation, with none of its tensors' per-call costs; for calls that
// hold the L x S weights anyway. Rows in blocks of a key/value head, the blocks spread over the
// threads. A row whose every key is hidden gets zeros (weights and output); a NaN or +inf score (or
// sink) makes its row NaN. The products (weights_tiled): a decoding step's few rows (at most
// kDecodeRows per key/value head) or a small call on the run loops, reading k and v as stored; the
// rest in float32 on brgemm, key tile by key tile of the forward's operands (K^T tile-major and V in
// float32, packed once per call). Measured on AVX2, 2 threads, against the run loops: 0.66-0.85x the
// time from 24 rows over 256 keys up; about even at 17 x 64 and 32 x 32 rows x keys; 1.2-1.3x below
// (17 x 32, 32 x 17), where packing a tile of kBlockK keys costs more than its products.
constexpr int64_t kWeightsTiledWork = 1024;  // rows x keys (per key/value head) from which brgemm runs

bool weights_tiled(int64_t rows, int64_t keys, bool float32) {
  return float32 && rows > kDecodeRows && rows * keys >= kWeightsTiledWork;
}

template <typename scalar_t, typename acc_t>
void weights_kernel(const Shape& sh, const Terms<acc_t>& t, const scalar_t* q, RowStrides qs, const scalar_t* k,
                    RowStrides ks, const scalar_t* v, RowStrides vs, scalar_t* out, RowStrides os, acc_t* weights) {
  const int64_t R = sh.rows();
  const bool tiled = weights_tiled(R, sh.S, std::is_same_v<acc_t, float>);
  const int64_t block = tiled ? kBlockQ : kDecodeRows, blocks = (R + block - 1) / block;
  const Operands<acc_t> ops = tiled ? operands<scalar_t, acc_t>(sh, k, ks, v, vs) : Operands<acc_t>{nullptr, nullptr, {}};
  at::parallel_for(0, sh.B * sh.Hkv * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> q_rows(block * sh.D), acc(block * sh.Dv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, b = bh / sh.Hkv, kv_head = bh % sh.Hkv;
      const int64_t r0 = task % blocks * block, n = std::min(R, r0 + block) - r0;
      const Rows rows = block_rows(sh, t, b, kv_head, r0, r0 + n);
      for (int64_t r = 0; r < n; ++r) {
        const scalar_t* row = q + qs.at(b, rows.head[r], rows.index[r]);
        std::transform(row, row + sh.D, q_rows.begin() + r * sh.D, [&](scalar_t x) { return static_cast<acc_t>(x) * t.scale; });
      }
      acc_t* s = weights + ((b * sh.H + kv_head * sh.G) * sh.L + r0) * sh.S;  // the block's rows, S apart
      const acc_t* kt_head = tiled ? ops.kt_ptr + bh * tiles_of(sh.S) * sh.D * kBlockK : nullptr;
      if (tiled) {
        for (int64_t j0 = 0; j0 < sh.S; j0 += kBlockK)
          gemm_nn(n, std::min(kBlockK, sh.S - j0), sh.D, q_rows.data(), sh.D, kt_block(kt_head, sh.D, j0), kBlockK,
                  s + j0, sh.S, false);
      } else {
        run_scores(n, sh.S, sh.D, q_rows.data(), k + ks.at(b, kv_head, 0), ks.row, s, sh.S);
      }
      const bool covered = band_covers(t, rows, 0, sh.S);
      if (!plain_tile(t, covered)) shape_tile(t, rows, 0, sh.S, s, sh.S, static_cast<acc_t*>(nullptr), covered);
      for (int64_t r = 0; r < n; ++r) softmax_row(sh.S, s + r * sh.S, t.sinks ? &t.sinks[rows.head[r]] : nullptr);
      std::fill(acc.begin(), acc.begin() + n * sh.Dv, acc_t(0));
      if (tiled) {
        for (int64_t j0 = 0; j0 < sh.S; j0 += kBlockK)
          gemm_nn(n, sh.Dv, std::min(kBlockK, sh.S - j0), s + j0, sh.S, ops.v_head(bh, sh.Hkv) + j0 * ops.v_rows.row,
                  ops.v_rows.row, acc.data(), sh.Dv, true);
      } else {
        run_values(n, sh.S, sh.Dv, s, sh.S, v + vs.at(b, kv_head, 0), vs.row, acc.data());
      }
      for (int64_t r = 0; r < n; ++r) {
        scalar_t* o = out + os.at(b, rows.head[r], rows.index[r]);
        std::transform(acc.begin() + r * sh.Dv, acc.begin() + (r + 1) * sh.Dv, o, [](acc_t x) { return static_cast<scalar_t>(x); });
      }
    }
  });
}

// q, k, v and out of one call, each 4-D (B, heads, T, X) with its rows where its RowStrides say.
template <typename scalar_t>
struct CallRows {
  const scalar_t *q, *k, *v;
  scalar_t* out;
  RowStrides qs, ks, vs, os;
};

// The forward of one call: the decoding path for a few rows per key/value head, else the tiled
// kernel on the products for the dtype. A forward whose log-sum-exp the backward will use
// (``for_backward``) takes the tiled kernel always: the backward recomputes the scores with the
// tiled kernel's products, and P = e^(s - m) / l is exact only when s is the same float both times
// (at large logits one rounding apart is a relative error of |s| eps in P).
template <typename scalar_t, typename acc_t>
void run_forward(const Shape& sh, const Terms<acc_t>& t, const CallRows<scalar_t>& x, const RowStats<acc_t>& stats,
                 bool for_backward) {
  const DenseLayout<acc_t> layout{sh, t, x.qs, x.os};
  if (sh.rows() <= kDecodeRows && !for_backward) {  // a decoding step: the cache is read as it is
    forward_blocks(layout, x.q, StepProducts<scalar_t, acc_t>{sh, x.k, x.ks, x.v, x.vs}, x.out, stats);
    return;
  }
#if defined(MHA_AVX512_BF16)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
#if defined(MHA_AMX)
    // (not for the backward's log-sum-exp: its scores are recomputed on Bf16Backward's products)
    if (!for_backward && AmxProducts::takes(sh)) {
      forward_blocks(layout, x.q, AmxProducts(sh, t.scale, x.k, x.ks, x.v, x.vs), x.out, stats);
      return;
    }
#endif
    forward_blocks(layout, x.q, Bf16Products(sh, t.scale, x.k, x.ks, x.v, x.vs), x.out, stats);
    return;
  }
#endif
  forward_blocks(layout, x.q, PlainProducts<scalar_t, acc_t>(sh, t.scale, x.k, x.ks, x.v, x.vs), x.out, stats);
}

// The backward of one call, on the products for the dtype; dK^T comes out scaled either way.
template <typename scalar_t, typename acc_t>
void run_backward(const Shape& sh, const Terms<acc_t>& t, const scalar_t* q, const Tensor& k, const Tensor& v,
                  const scalar_t* dout, const RowStats<const acc_t>& stats, const acc_t* delta, acc_t* dq_parts, int64_t chunks,
                  Tensor& dkt, Tensor& dvt, acc_t* d_slopes_parts) {
#if defined(MHA_AVX512_BF16)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    backward_kernel<scalar_t, acc_t>(sh, t, q, Bf16Backward(sh, t.scale, k, v), dout, stats, delta, dq_parts, chunks,
                                     dkt.data_ptr<acc_t>(), dvt.data_ptr<acc_t>(), d_slopes_parts);
    dkt.mul_(t.scale);  // q entered the products unscaled
    return;
  }
#endif
  backward_kernel<scalar_t, acc_t>(sh, t, q, PlainBackward<scalar_t, acc_t>(sh, t.scale, k, v), dout, stats, delta,
                                   dq_parts, chunks, dkt.data_ptr<acc_t>(), dvt.data_ptr<acc_t>(), d_slopes_parts);
}

// ---- paged: keys and values read where they lie in a pool of KV-cache pages ------------------------
//
//   paged_forward(q (Tq, H, D), k_pages (N, Hkv, P, D), v_pages (N, Hkv, P, Dv), block_table (B, M),
//                 cu_seqlens_q (B + 1,), seqlens_k (B,), terms) -> out (Tq, H, Dv), row max, row sum (Tq, H)
//   (8-bit pages: int8 with k_scales, v_scales (N, Hkv, P) apart, or kept (N, Hkv, P, D|Dv + 4), each row
//   then its float32 scale, mha.kernels.storage's layout)
//
// Sequence b owns the query rows cu[b]:cu[b + 1] (L_b of them) and S_b keys: key j lies in page
// block_table[b, j / P], slot j % P. Query r sits at position S_b - L_b + r (bottom-right), key j
// at j. Each sequence is a call of the forward's own machinery: its G query heads per kv head
// stacked in blocks of kBlockQ rows (block_rows, the terms' offset S_b - L_b), the band's key range
// (block_keys), the key tiles walked by for_each_key_tile, shaped by shape_tile and absorbed by the
// online softmax (absorb_keys), on products that read the pages in place (PagedProducts). The work
// items are (sequence, kv head, query block, key range); a block whose keys cost more than a
// thread's share is split into key ranges merged by log-sum-exp (merge_splits, flash-decoding), so
// a batch of decoding rows over long caches keeps every thread busy. Every index the kernel reads
// (the pages of each sequence's used blocks, its rows of q) is checked before it starts.

// Where the pool's elements lie: key slot i of kv head h in page p at p * page + h * head + i * slot.
struct PagePool {
  int64_t block;  // P, key slots per page
  int64_t k_page, k_head, k_slot, v_page, v_head, v_slot;
};

// An 8-bit pool's scales (N, Hkv, P), one float per (token, head), each pool's with strides of its own
// (kept after each row, mha.kernels.storage: a float view of the pages, (D + 4) / 4 floats a slot for
// keys, (Dv + 4) / 4 for values): slot i of kv head h in page p holds its key row times
// k[p * k_page + h * k_head + i * k_slot], its value row times v[... v strides]; null for a float pool.
struct PageScales {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t k_page = 0, k_head = 0, k_slot = 0, v_page = 0, v_head = 0, v_slot = 0;
};
constexpr int64_t kScaleBytes = sizeof(float);  // storage.SCALE_BYTES: a row's scale after it


// The forward's two products on keys and values read in place from their pages. A tile's keys
// j0 .. j0 + n come in runs, each contiguous in memory (the part of one page, or pages that follow
// each other in the pool); per run:
//   scores      S^T (run x R) = K (run x D, in place, ld = slot stride) . (scale q)^T (D x R)
//   add_values  acc (R x Dv) += P (R x run) . V (run x Dv, in place)
// and S^T is turned to the tile's s (R x n). float32 runs on brgemm, float64 on plain loops;
// bfloat16 and float16 keys and values are converted to float32 run by run (a run at most kBlockK
// keys, kept in a thread's buffer), never gathered; so are 8-bit ones (pool_t int8_t), each row
// times its (token, head) scale as it is converted.
template <typename scalar_t, typename acc_t, typename pool_t = scalar_t>
struct PagedProducts {
  static constexpr int64_t kAlign = 1;
  static constexpr bool kScaled = true;  // the scores come scaled (see pack_row)
  static constexpr bool kQuantized = std::is_same_v<pool_t, int8_t>;
  // keys first.. of the tile, at these offsets in the pools (and in the scales, for an 8-bit pool)
  struct Run { int64_t first, count, k_at, v_at, k_scale_at, v_scale_at; };

  const pool_t* k;
  const pool_t* v;
  PagePool pool;
  PageScales scales;
  int64_t D, Dv;
  acc_t scale;
  const int64_t* pages = nullptr;  // the bound sequence's block table row (checked)
  int64_t kv_head = 0, keys_total = 0;  // and its S_b
  std::vector<Run> runs = {};
  Scratch<acc_t> qt, qr, st, converted;

  PagedProducts(const pool_t* k_, const pool_t* v_, const PagePool& pool_, const PageScales& scales_, int64_t D_,
                int64_t Dv_, acc_t scale_)
      : k(k_), v(v_), pool(pool_), scales(scales_), D(D_), Dv(Dv_), scale(scale_) {}

  void bind(const int64_t* table_row, int64_t head, int64_t S) {
    pages = table_row;
    kv_head = head;
    keys_total = S;
  }
  // q: row r of R, scaled as (D x kBlockQ) for brgemm (R > kRunLoopRows), else as rows for run_scores,
  // unscaled (the scores are scaled: a bfloat16 call's queries stay bfloat16 values, which the run
  // loops' bfloat16 dot products take whole)
  // (each buffer made at its first use by a thread, only where used)
  void pack_row(int64_t r, int64_t R, const scalar_t* src) {
    if (R > kRunLoopRows) {
      acc_t* rows = qt.at_least(D * kBlockQ);
      for (int64_t d = 0; d < D; ++d) rows[d * kBlockQ + r] = static_cast<acc_t>(src[d]) * scale;
    } else {
      acc_t* row = qr.at_least(R * D) + r * D;
      for (int64_t d = 0; d < D; ++d) row[d] = static_cast<acc_t>(src[d]);  // unscaled, as StepProducts'
    }
  }
  // The runs of keys j0 .. j0 + n (all below the sequence's S_b: their pages are checked).
  void find_runs(int64_t j0, int64_t n) {
    runs.clear();
    for (int64_t j = j0; j < j0 + n;) {
      const int64_t page = pages[j / pool.block], slot = j % pool.block;
      const int64_t count = std::min(j0 + n, j - slot + pool.block) - j;
      const int64_t k_at = page * pool.k_page + kv_head * pool.k_head + slot * pool.k_slot;
      const int64_t v_at = page * pool.v_page + kv_head * pool.v_head + slot * pool.v_slot;
      const int64_t k_scale_at = page * scales.k_page + kv_head * scales.k_head + slot * scales.k_slot;
      const int64_t v_scale_at = page * scales.v_page + kv_head * scales.v_head + slot * scales.v_slot;
      Run* last = runs.empty() ? nullptr : &runs.back();
      // one run while the keys, the values and (8-bit) both scale pools all continue where the last one ends
      if (last && last->k_at + last->count * pool.k_slot == k_at && last->v_at + last->count * pool.v_slot == v_at &&
          last->k_scale_at + last->count * scales.k_slot == k_scale_at &&
          last->v_scale_at + last->count * scales.v_slot == v_scale_at)
        last->count += count;  // the next page follows this one in the pool
      else
        runs.push_back({j - j0, count, k_at, v_at, k_scale_at, v_scale_at});
      j += count;
    }
  }
  // ``count`` rows of width X from base + at (row stride ld) as acc_t: in place, or converted (8-bit
  // rows times their scales, from row_scales, scale_ld apart).
  std::pair<const acc_t*, int64_t> rows_of(const pool_t* base, int64_t at, int64_t count, int64_t X, int64_t ld,
                                           const acc_t* row_scales, int64_t scale_ld) {
    if constexpr (std::is_same_v<pool_t, acc_t>) {
      return {base + at, ld};
    } else {
      acc_t* rows = converted.at_least(count * X);
      for (int64_t i = 0; i < count; ++i) {
        const pool_t* src = base + at + i * ld;
        acc_t* dst = rows + i * X;
        if constexpr (kQuantized) {
          const acc_t factor = row_scales[i * scale_ld];
          for (int64_t d = 0; d < X; ++d) dst[d] = static_cast<acc_t>(src[d]) * factor;
        } else {
          for (int64_t d = 0; d < X; ++d) dst[d] = static_cast<acc_t>(src[d]);
        }
      }
      return {converted.data(), X};
    }
  }
  const acc_t* scales_of(const void* base, int64_t at) const {
    return kQuantized ? static_cast<const acc_t*>(base) + at : nullptr;
  }
  // Ask for the rows of keys [a, b) (below S_b) ahead of their use, into the second-level cache: pages lie
  // anywhere in the pool, where the hardware's prefetcher, which follows steadily rising addresses, does not go.
  void prefetch(int64_t a, int64_t b) const {
    const int64_t k_row = D * static_cast<int64_t>(sizeof(pool_t)), v_row = Dv * static_cast<int64_t>(sizeof(pool_t));
    for (int64_t j = a; j < b;) {
      const int64_t page = pages[j / pool.block], slot = j % pool.block, count = std::min(b, j - slot + pool.block) - j;
      const char* keys = reinterpret_cast<const char*>(k + page * pool.k_page + kv_head * pool.k_head + slot * pool.k_slot);
      const char* values = reinterpret_cast<const char*>(v + page * pool.v_page + kv_head * pool.v_head + slot * pool.v_slot);
      for (int64_t i = 0; i < count; ++i) {
        for (int64_t byte = 0; byte < k_row; byte += 64) __builtin_prefetch(keys + i * pool.k_slot * sizeof(pool_t) + byte, 0, 2);
        for (int64_t byte = 0; byte < v_row; byte += 64) __builtin_prefetch(values + i * pool.v_slot * sizeof(pool_t) + byte, 0, 2);
      }
      j += count;
    }
  }
  void scores(int64_t, int64_t R, int64_t j0, int64_t n, acc_t* s) {
    find_runs(j0, std::min(n, keys_total - j0));  // (a tile widened to whole pairs ends past S_b: padding)
    prefetch(j0 + n, std::min(keys_total, j0 + n + kBlockK));  // the next tile's, while this one is computed
    if (R > kRunLoopRows) st.at_least(kBlockK * kBlockQ);
    for (size_t x = 0; x < runs.size(); ++x) {
      const Run& run = runs[x];
      if (R <= kRunLoopRows) {  // the pool's rows as they are, widened in registers
        run_scores(R, run.count, D, qr.data(), k + run.k_at, pool.k_slot, s + run.first, n,
                   scales_of(scales.k, run.k_scale_at), scales.k_slot, std::is_same_v<scalar_t, at::BFloat16>);
        for (int64_t r = 0; r < R; ++r)
          for (int64_t j = 0; j < run.count; ++j) s[r * n + run.first + j] *= scale;
        continue;
      }
      const auto [keys, ld] = rows_of(k, run.k_at, run.count, D, pool.k_slot, scales_of(scales.k, run.k_scale_at),
                                      scales.k_slot);
      gemm_nn(run.count, R, D, keys, ld, qt.data(), kBlockQ, st.data() + run.first * R, R, false);
    }
    if (R > kRunLoopRows)  // S^T (n x R) -> s (R x n), in blocks of 8 x 8 (in the first-level cache)
      for (int64_t j0b = 0; j0b < n; j0b += 8)
        for (int64_t r0b = 0; r0b < R; r0b += 8)
          for (int64_t r = r0b; r < std::min(R, r0b + 8); ++r)
            for (int64_t j = j0b; j < std::min(n, j0b + 8); ++j) s[r * n + j] = st.data()[j * R + r];
  }
  acc_t* weights(acc_t* s) { return s; }  // in place of the scores
  void add_values(int64_t, int64_t R, int64_t, int64_t n, const acc_t* p, acc_t* acc) {  // the runs of scores()
    for (const Run& run : runs) {
      if (R <= kRunLoopRows) {
        run_values(R, run.count, Dv, p + run.first, n, v + run.v_at, pool.v_slot, acc,
                   scales_of(scales.v, run.v_scale_at), scales.v_slot, std::is_same_v<scalar_t, at::BFloat16>);
        continue;
      }
      const auto [values, ld] = rows_of(v, run.v_at, run.count, Dv, pool.v_slot, scales_of(scales.v, run.v_scale_at),
                                        scales.v_slot);
      gemm_nn(R, Dv, run.count, p + run.first, n, values, ld, acc, Dv, true);
    }
  }
};

// A thread's tiles of the kv head it works on, for products that pack each tile of keys once for every
// block of its rows (PagedFloatTiles, PagedBf16Products): up to kTileCacheBytes of them, a tile's
// slot at its index modulo their count; which tile each slot holds, for which sequence and kv head.
constexpr int64_t kTileCacheBytes = int64_t(8) << 20;

struct TileSlots {
  std::vector<int64_t> held;  // the tile each slot holds (-1: none)
  const int64_t* pages = nullptr;  // for this sequence's table row and kv head
  int64_t head = -1;
  // (tile t's slot among as many as tiles of tile_bytes fit, whether it must be packed there now)
  std::pair<int64_t, bool> find(const int64_t* table, int64_t kv_head, int64_t keys, int64_t tile_bytes, int64_t t) {
    const int64_t slots = std::max<int64_t>(1, std::min(tiles_of(keys), kTileCacheBytes / tile_bytes));
    if (pages != table || head != kv_head || static_cast<int64_t>(held.size()) != slots) {
      held.assign(slots, -1);  // another sequence or kv head: nothing held
      pages = table, head = kv_head;
    }
    const int64_t slot = t % slots;
    const bool pack = held[slot] != t;
    held[slot] = t;
    return {slot, pack};
  }
  int64_t count() const { return static_cast<int64_t>(held.size()); }
};

// PagedProducts for float32 queries over float32 or 8-bit pages, for blocks of more rows than the run
// loops take (a prompt's, a chunk's): each tile's keys packed once as K^T (8-bit rows dequantized, each
// times its scale, as PagedProducts converts them) and its values gathered into rows, kept for the
// next blocks (TileSlots); the scores as the dense forward's PlainProducts makes them, the queries
// packed scaled, on brgemm. (Run by run, the products of a prompt of 1024 rows over pages of 16 keys
// took 1.25x the dense forward's time.) Blocks of at most kRunLoopRows rows run on PagedProducts' loops.
template <typename pool_t>
struct PagedFloatTiles : PagedProducts<float, float, pool_t> {
  using Base = PagedProducts<float, float, pool_t>;
  static constexpr int64_t kAlign = 1;
  using Base::Base;
  Scratch<float> qp, rows, k_tiles, v_tiles;  // the block's scaled queries, a tile's keys, the tiles held
  TileSlots slots;

  void pack_row(int64_t r, int64_t R, const float* src) {
    if (R <= kRunLoopRows) return Base::pack_row(r, R, src);
    float* row = qp.at_least(kBlockQ * this->D) + r * this->D;
    for (int64_t d = 0; d < this->D; ++d) row[d] = src[d] * this->scale;
  }
  // tile t's keys (keys of them, from j0) as rows of X floats at out, each row's scale applied (8-bit)
  template <typename At, typename ScaleAt>
  void gather(const pool_t* base, int64_t X, int64_t ld, At at, const void* scales, int64_t scale_ld, ScaleAt scale_at,
              float* out) {
    for (const auto& run : this->runs) {
      const float* factor = this->scales_of(scales, scale_at(run));
      const auto [src, src_ld] = this->rows_of(base, at(run), run.count, X, ld, factor, scale_ld);
      for (int64_t i = 0; i < run.count; ++i) std::copy(src + i * src_ld, src + i * src_ld + X, out + (run.first + i) * X);
    }
  }
  int64_t slot_of(int64_t t) {
    const int64_t D = this->D, Dv = this->Dv, tile_bytes = kBlockK * (D + Dv) * int64_t(sizeof(float));
    const auto [slot, pack] = slots.find(this->pages, this->kv_head, this->keys_total, tile_bytes, t);
    if (!pack) return slot;
    const int64_t j0 = t * kBlockK, keys = std::min(kBlockK, this->keys_total - j0);
    this->find_runs(j0, keys);
    this->prefetch(j0 + kBlockK, std::min(this->keys_total, j0 + 2 * kBlockK));
    float* key_rows = rows.at_least(kBlockK * D);
    gather(this->k, D, this->pool.k_slot, [](const auto& run) { return run.k_at; }, this->scales.k, this->scales.k_slot,
           [](const auto& run) { return run.k_scale_at; }, key_rows);
    pack_tile<float, float>(key_rows, D, keys, D, k_tiles.at_least(slots.count() * D * kBlockK) + slot * D * kBlockK);
    gather(this->v, Dv, this->pool.v_slot, [](const auto& run) { return run.v_at; }, this->scales.v, this->scales.v_slot,
           [](const auto& run) { return run.v_scale_at; }, v_tiles.at_least(slots.count() * kBlockK * Dv) + slot * kBlockK * Dv);
    return slot;
  }
  void scores(int64_t bh, int64_t R, int64_t j0, int64_t n, float* s) {  // keys j0 .. j0 + n: within one tile
    if (R <= kRunLoopRows) return Base::scores(bh, R, j0, n, s);
    const int64_t slot = slot_of(j0 / kBlockK), D = this->D;
    gemm_nn(R, n, D, qp.data(), D, k_tiles.data() + slot * D * kBlockK + j0 % kBlockK, kBlockK, s, n, false);
  }
  void add_values(int64_t bh, int64_t R, int64_t j0, int64_t n, const float* p, float* acc) {  // the tile of scores()
    if (R <= kRunLoopRows) return Base::add_values(bh, R, j0, n, p, acc);
    const int64_t slot = slot_of(j0 / kBlockK), Dv = this->Dv;
    gemm_nn(R, Dv, n, p, n, v_tiles.data() + (slot * kBlockK + j0 % kBlockK) * Dv, Dv, acc, Dv, true);
  }
};

#if defined(MHA_AVX512_BF16)
// PagedProducts for bfloat16 queries over bfloat16 or 8-bit pages, for blocks of more rows than the
// run loops take (a prompt's, a chunk's): each tile's keys and values gathered from their runs as
// bfloat16 rows (an 8-bit value is an integer of at most 7 bits: exact in bfloat16), put in VNNI pairs
// and multiplied on brgemm's bfloat16 products, summed in float32, as the dense forward's Bf16Products
// multiplies; the scale and 8-bit keys' scales multiply the scores, and the weights times 8-bit values'
// scales are rounded to bfloat16 for P . V, as that forward rounds its weights. Tiles are whole pairs of
// keys (kAlign); the key past an odd S_b is never read (zeros, its score hidden as padding). A thread
// keeps the tiles it packed for the next blocks of its rows (TileSlots). Blocks of at most
// kRunLoopRows rows run on PagedProducts' own loops. (PagedProducts widens a run to float32 and
// multiplies in float32: a bfloat16 prompt over pages took twice the dense forward's time.)

// kTiles: the same tiles multiplied on AMX (amx_scores, amx_add_values: PagedAmxProducts, which the paged
// kernel picks where amx_usable() and the head dims fit, as the dense forward picks AmxProducts): keys in
// steps of 32 (kAlign; each tile's values zero to the next 32), rows in tiles of 16 (kRowAlign).
template <typename pool_t, bool kTiles = false>
struct PagedBf16Products : PagedProducts<at::BFloat16, float, pool_t> {
  using Base = PagedProducts<at::BFloat16, float, pool_t>;
  using bf16 = at::BFloat16;
  static constexpr int64_t kAlign = kTiles ? 32 : 2;
  static constexpr int64_t kRowAlign = kTiles ? 16 : 1;
  static_assert(!kTiles || (kRowAlign % 16 == 0 && kAlign % 32 == 0), "a tile's 16 rows, a product's 32 keys a step");
  using Base::Base;
  Scratch<bf16> qb, rows, k_tiles, v_tiles, pb;  // the block's queries, a tile's rows, the tiles held, weights
  Scratch<float> k_factors, v_factors;  // per tile: its keys' scale (times 8-bit scales), its values' scales
  TileSlots slots;

  int64_t D2() const { return this->D + this->D % 2; }
  // The run loops' scores come scaled, and 8-bit keys' tiles (times their rows' scales); bfloat16 pages'
  // tiles leave the scale to the softmax, as the dense forward's do (a pass over each tile's scores less).
  bool scaled(int64_t R) const { return R <= kRunLoopRows || Base::kQuantized; }
  void pack_row(int64_t r, int64_t R, const bf16* src) {
    if (R <= kRunLoopRows) return Base::pack_row(r, R, src);
    const int64_t D = this->D;
    bf16* row = qb.at_least(kBlockQ * D2()) + r * D2();
    std::copy(src, src + D, row);
    std::fill(row + D, row + D2(), bf16(0.0f));
  }
  // The tile's ``keys`` rows of width X (at base, each run's offset ``at``, slots ld apart) as bfloat16
  // rows of X2 (>= X; zero-padded) for ``n`` keys (rows past ``keys`` zero); each row's 8-bit scale
  // times ``times`` into ``f`` (zero past ``keys``).
  template <typename At, typename ScaleAt>
  const bf16* gather(const pool_t* base, int64_t X, int64_t X2, int64_t ld, int64_t keys, int64_t n, At at,
                     const float* scales, int64_t scale_ld, ScaleAt scale_at, float times, float* f) {
    bf16* out = rows.at_least(n * X2);
    for (const auto& run : this->runs) {
      for (int64_t i = 0; i < run.count; ++i) {
        const pool_t* src = base + at(run) + i * ld;
        bf16* dst = out + (run.first + i) * X2;
        if constexpr (std::is_same_v<pool_t, int8_t>) {
          for (int64_t d = 0; d < X; d += 16) {
            const __mmask16 m = X - d >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(X - d);
            const __m512 wide = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, src + d)));
            _mm256_mask_storeu_epi16(dst + d, m, (__m256i)_mm512_cvtneps_pbh(wide));
          }
          f[run.first + i] = times * scales[scale_at(run) + i * scale_ld];
        } else {
          std::copy(src, src + X, dst);
          f[run.first + i] = times;
        }
        std::fill(dst + X, dst + X2, bf16(0.0f));
      }
    }
    std::fill(out + keys * X2, out + n * X2, bf16(0.0f));
    std::fill(f + keys, f + n, 0.0f);
    return out;
  }
  // The slot of tile t of the bound sequence's kv head, packed there if it is not yet: K^T in pairs
  // (word (d / 2, j): values d and d + 1 of key j, a row's words transposed as floats), V in pairs
  // (word (j / 2, d): value d of keys j and j + 1), the keys' and values' factors.
  int64_t slot_of(int64_t t) {
    const int64_t D2 = this->D2(), Dv = this->Dv, tile_bytes = kBlockK * (D2 + Dv) * int64_t(sizeof(bf16));
    const auto [slot, pack] = slots.find(this->pages, this->kv_head, this->keys_total, tile_bytes, t);
    if (!pack) return slot;
    const int64_t count = slots.count(), j0 = t * kBlockK, keys = std::min(kBlockK, this->keys_total - j0);
    const int64_t n = std::min(kBlockK, (keys + kAlign - 1) / kAlign * kAlign);  // (kAlign 2: padded_keys)
    this->find_runs(j0, keys);
    this->prefetch(j0 + kBlockK, std::min(this->keys_total, j0 + 2 * kBlockK));
    float* kf = k_factors.at_least(count * kBlockK) + slot * kBlockK;
    const bf16* k_rows = gather(this->k, this->D, D2, this->pool.k_slot, keys, n, [](const auto& run) { return run.k_at; },
                                static_cast<const float*>(this->scales.k), this->scales.k_slot,
                                [](const auto& run) { return run.k_scale_at; }, this->scale, kf);
    float* words = reinterpret_cast<float*>(k_tiles.at_least(count * D2 * kBlockK) + slot * D2 * kBlockK);
    pack_tile<float, float>(reinterpret_cast<const float*>(k_rows), D2 / 2, n, D2 / 2, words);
    float* vf = v_factors.at_least(count * kBlockK) + slot * kBlockK;
    const bf16* v_rows = gather(this->v, Dv, Dv, this->pool.v_slot, keys, n, [](const auto& run) { return run.v_at; },
                                static_cast<const float*>(this->scales.v), this->scales.v_slot,
                                [](const auto& run) { return run.v_scale_at; }, 1.0f, vf);
    uint32_t* pairs = reinterpret_cast<uint32_t*>(v_tiles.at_least(count * kBlockK * Dv) + slot * kBlockK * Dv);
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(v_rows);
    for (int64_t j = 0; j < n; j += 2)
      for (int64_t d = 0; d < Dv; ++d) pairs[(j / 2) * Dv + d] = uint32_t(bits[j * Dv + d]) | uint32_t(bits[(j + 1) * Dv + d]) << 16;
    return slot;
  }
  void scores(int64_t bh, int64_t R, int64_t j0, int64_t n, float* s) {  // keys j0 .. j0 + n: within one tile
    if (R <= kRunLoopRows) return Base::scores(bh, R, j0, n, s);
    const int64_t slot = slot_of(j0 / kBlockK), at = j0 % kBlockK, D2 = this->D2();
    const bf16* kt = k_tiles.data() + slot * D2 * kBlockK + 2 * at;
#if defined(MHA_AMX)
    if constexpr (kTiles) {
      use_tiles(TileShape::products);
      amx_scores(R, n, D2, qb.data(), kt, s);
    } else
#endif
      at::native::cpublas::brgemm(R, n, D2, D2, kBlockK, n, false, qb.data(), kt, s, true);
    if (!Base::kQuantized) return;  // (unscaled: scaled(R); the keys' factors are the scale alone)
    const float* f = k_factors.data() + slot * kBlockK + at;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < n; ++j) s[r * n + j] *= f[j];
  }
  // bfloat16 pages' tiles: the weights rounded to bfloat16 as the softmax makes them, as the dense forward's
  // (a pass of their own, float weights times ones rounded, cost a prompt over pages ~11 %; the
  // dense forward's output bit for bit: tests/kernels/test_paged_native.py); 8-bit values'
  // weights are floats until add_values scales them.
  bf16* rounded_weights(int64_t R) { return R <= kRunLoopRows || Base::kQuantized ? nullptr : weight_tile(); }
  bf16* weight_tile() { return pb.at_least(kBlockQ * kBlockK); }  // (row stride n; AMX reads R rounded up to 16 rows)
  void add_values(int64_t bh, int64_t R, int64_t j0, int64_t n, const float* p, float* acc) {  // the tile of scores()
    if (R <= kRunLoopRows) return Base::add_values(bh, R, j0, n, p, acc);
    const int64_t slot = slot_of(j0 / kBlockK), at = j0 % kBlockK, Dv = this->Dv;
    bf16* weights = weight_tile();  // rounded by the softmax (rounded_weights), or here
    if (Base::kQuantized) {  // the weights times their values' scales, rounded to bfloat16 (zero past S_b)
      const float* f = v_factors.data() + slot * kBlockK + at;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < n; j += 16) {
          const __mmask16 m = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(n - j);
          const __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + r * n + j), _mm512_maskz_loadu_ps(m, f + j));
          _mm256_mask_storeu_epi16(weights + r * n + j, m, (__m256i)_mm512_cvtneps_pbh(w));
        }
    }
    const bf16* vv = v_tiles.data() + slot * kBlockK * Dv + at * Dv;
#if defined(MHA_AMX)
    if constexpr (kTiles) {
      use_tiles(TileShape::products);  // (the scores' shape: a compare)
      amx_add_values(R, n, Dv, weights, vv, acc);
      return;
    }
#endif
    at::native::cpublas::brgemm(R, Dv, n, n, Dv, Dv, true, weights, vv, acc, true);
  }
  // bfloat16 pages' tiles of a block past the run loops' rows, as the dense forward's (Bf16Products'
  // fused_keys): the same steps over the slot's tiles, the dense forward's output bit for bit.
  bool fuses(int64_t R) const {
    return !Base::kQuantized && R > kRunLoopRows && (kTiles || fused_steps_take(this->Dv));
  }
  void fused_keys(const RowKeys& seen, bool covered, int64_t, int64_t R, int64_t j0, int64_t keys, float scale, float* m,
                  float* l, float* acc) {
    const int64_t slot = slot_of(j0 / kBlockK), at = j0 % kBlockK, D2 = this->D2(), Dv = this->Dv;
    const FusedOperands x{qb.data(), D2, Dv, k_tiles.data() + slot * D2 * kBlockK + 2 * at, v_tiles.data() + (slot * kBlockK + at) * Dv};
#if defined(MHA_AMX)
    if constexpr (kTiles) return amx_fused_run(fused, x, seen, covered, R, j0, keys, scale, m, l, acc);
#endif
    fused_run(fused, x, seen, covered, R, j0, keys, scale, m, l, acc);
  }
  FusedBuffers fused;
  void release() {
#if defined(MHA_AMX)
    if constexpr (kTiles) release_tiles();
    else
#endif
      at::native::cpublas::brgemm_release(true);
  }
};

template <typename pool_t>
using PagedAmxProducts = PagedBf16Products<pool_t, true>;
template <typename pool_t>
using PagedBrgemmProducts = PagedBf16Products<pool_t, false>;
#endif

// One sequence's rows of the call, as the forward's machinery takes them: one batch of L_b query
// rows over S_b keys (Shape), the terms with its bottom-right offset.
struct PagedCall {
  int64_t H, Hkv, D, Dv;
  const int64_t* cu;       // (B + 1,) the sequences' first query rows
  const int64_t* seqlens;  // (B,) S_b
  const int64_t* table;    // (B, M) page indices
  int64_t M;
  Shape sequence(int64_t b) const {
    return Shape{1, H, Hkv, H / Hkv, cu[b + 1] - cu[b], seqlens[b], D, Dv};
  }
};

// The paged forward's rows: sequence b is a call of its own (PagedCall::sequence, the terms' offset
// S_b - L_b), its rows of q (Tq, H, D) and out (Tq, H, Dv) from cu[b]; the products bound to its
// block table's row.
template <typename acc_t>
struct PagedLayout {
  const PagedCall& call;
  const Terms<acc_t>& t;
  int64_t B, D = call.D, Dv = call.Dv;
  int64_t batch() const { return B; }
  int64_t kv_heads() const { return call.Hkv; }
  Shape shape(int64_t b) const { return call.sequence(b); }
  Terms<acc_t> terms(int64_t b) const {
    Terms<acc_t> bottom_right = t;
    const Shape sh = call.sequence(b);
    bottom_right.offset = sh.S - sh.L;  // query r at S_b - L_b + r
    return bottom_right;
  }
  Rows rows(int64_t b, int64_t kv_head, int64_t r0, int64_t r1) const {
    return block_rows(shape(b), terms(b), 0, kv_head, r0, r1);
  }
  int64_t row(int64_t b, const Rows& rows, int64_t r) const { return (call.cu[b] + rows.index[r]) * call.H + rows.head[r]; }
  int64_t q_at(int64_t b, const Rows& rows, int64_t r) const { return row(b, rows, r) * D; }
  int64_t out_at(int64_t b, const Rows& rows, int64_t r) const { return row(b, rows, r) * Dv; }
  template <typename Products>
  int64_t bind(Products& products, int64_t b, int64_t kv_head) const {
    products.bind(call.table + b * call.M, kv_head, call.seqlens[b]);
    return 0;
  }
};

template <typename scalar_t, typename acc_t, typename Products>
void paged_kernel(const PagedCall& call, const Terms<acc_t>& terms, int64_t B, const scalar_t* q,
                  const Products& shared, scalar_t* out, const RowStats<acc_t>& stats) {
  forward_blocks(PagedLayout<acc_t>{call, terms, B}, q, shared, out, stats);
}

// ---- the Python-facing functions: each takes the contract as one TermArgs -----------------------------

using Optional = std::optional<Tensor>;

// The contract as Python hands it over, one value for every entry point (mha.kernels.native._terms
// builds it once per call from a mha.kernels.Contract): the scale and softcap (0: none), the band's
// two bounds (kUnbounded: none on that side) and the offset of the default positions, or positions
// per sequence (B|1, L) and (B|1, S) int64; key padding (B|1, S) bool; a mask expanded to (B, H, L,
// S) (bool True = attend, or additive in the accumulation dtype); ALiBi slopes and sinks (H,) in
// the accumulation dtype. terms_of reads it into the kernels' Terms.
struct TermArgs {
  double scale = 1, softcap = 0;
  bool has_band = false;
  int64_t left = kUnbounded, right = kUnbounded, offset = 0;
  Optional q_pos, k_pos, key_valid, mask, slopes, sinks;
};

template <typename acc_t>
Terms<acc_t> terms_of(const TermArgs& a, bool with_sinks = true) {
  Terms<acc_t> t;
  t.scale = static_cast<acc_t>(a.scale);
  t.softcap = static_cast<acc_t>(a.softcap);
  t.has_band = a.has_band;
  t.left = a.left;
  t.right = a.right;
  t.offset = a.offset;
  if (a.q_pos) {
    TORCH_CHECK(a.k_pos.has_value(), "mha native: positions come as a pair (queries', keys')");
    const Tensor &q_pos = *a.q_pos, &k_pos = *a.k_pos;
    TORCH_CHECK(q_pos.dim() == 2 && k_pos.dim() == 2 && q_pos.stride(1) == 1 && k_pos.stride(1) == 1,
                "mha native: positions must be (B|1, length) with unit row stride");
    t.q_pos = q_pos.data_ptr<int64_t>(); t.q_pos_b = q_pos.size(0) == 1 ? 0 : q_pos.stride(0);
    t.k_pos = k_pos.data_ptr<int64_t>(); t.k_pos_b = k_pos.size(0) == 1 ? 0 : k_pos.stride(0);
    for (int64_t b = 0; b < k_pos.size(0) && t.k_sorted; ++b)
      t.k_sorted = std::is_sorted(t.k_pos + b * k_pos.stride(0), t.k_pos + b * k_pos.stride(0) + k_pos.size(1));
  }
  if (a.key_valid) {
    const Tensor& key_valid = *a.key_valid;
    t.key_valid = key_valid.data_ptr<bool>(); t.key_valid_b = key_valid.size(0) == 1 ? 0 : key_valid.stride(0);
  }
  if (a.mask) {  // expanded to (B, H, L, S): broadcast dims have stride 0
    const Tensor& mask = *a.mask;
    if (mask.scalar_type() == at::kBool) t.bool_mask = mask.data_ptr<bool>();
    else t.mask = mask.data_ptr<acc_t>();
    t.mb = mask.stride(0); t.mh = mask.stride(1); t.ml = mask.stride(2); t.ms = mask.stride(3);
  }
  if (a.slopes) t.slopes = a.slopes->data_ptr<acc_t>();
  if (a.sinks && with_sinks) t.sinks = a.sinks->data_ptr<acc_t>();
  return t;
}

// Whether x (B, H, T, X) has its last dim contiguous, rows that do not overlap (a row stride of at
// least X: the run loops' prefetch and brgemm's leading dimensions take no less) and no negative
// stride: rows the forward and the weights read where they lie (RowStrides), whatever the distances
// between them (a broadcast along T, a zero row stride, is copied).
bool rows_readable(const Tensor& x) {
  if (x.numel() == 0) return true;  // nothing is read (torch calls any empty tensor contiguous, whatever its strides)
  return (x.stride(3) == 1 || x.size(3) <= 1) && (x.size(2) <= 1 || x.stride(2) >= x.size(3)) && x.stride(1) >= 0 &&
         x.stride(0) >= 0;
}

// x with the values it stands for in its data: a negative view (torch._neg_view: its data holds the
// other sign, and torch's ops negate what they read) copied out; the kernels read data as it is.
Tensor stored(const Tensor& x) { return x.is_neg() ? x.resolve_neg() : x; }

// What a kernel reads in place: everything contiguous (the backward and its forward), or any rows
// (the forward, the weights: rows_readable).
enum class Layout { kContiguous, kAnyRows };

bool readable(const Tensor& x, Layout layout) {
  return layout == Layout::kAnyRows ? rows_readable(x) : x.is_contiguous();
}

// x as a kernel of that layout reads it: in place where it can, else copied contiguous.
Tensor read_as(const Tensor& x_in, Layout layout) {
  const Tensor x = stored(x_in);
  return readable(x, layout) ? x : x.contiguous();
}

// The call's Shape, its sizes checked (the rows' layout is the caller's: read_as, or the backward's check).
Shape shape_of(const Tensor& q, const Tensor& k, const Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "mha native: q, k, v must be 4-D");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0), "mha native: q, k, v must have one batch size");
  TORCH_CHECK(v.size(1) == k.size(1) && v.size(2) == k.size(2), "mha native: v must have k's heads and length");
  TORCH_CHECK(k.size(3) == q.size(3), "mha native: k must have q's head dim");
  TORCH_CHECK(q.size(3) > 0 && v.size(3) > 0, "mha native: head dims must be at least 1 (mha.kernels.native pads empty ones)");
  TORCH_CHECK(k.size(1) > 0 ? q.size(1) % k.size(1) == 0 : q.size(1) == 0, "mha native: key/value heads must divide query heads");
  return Shape{q.size(0), q.size(1), k.size(1), k.size(1) > 0 ? q.size(1) / k.size(1) : 0, q.size(2), k.size(2),
               q.size(3), v.size(3)};
}

// Where x's rows lie; a single row's stride is its width (torch leaves any stride on a dim of size 1,
// and the run loops prefetch rows a stride apart).
RowStrides row_strides(const Tensor& x) { return {x.stride(0), x.stride(1), x.size(2) > 1 ? x.stride(2) : x.size(3)}; }

// (B, H, L, Dv) laid out as q (B, H, L, D) is, as torch's CPU kernels lay their output: (B, L, H, Dv)
// where q's heads lie closer together than its rows (a projection's heads), else contiguous.
Tensor output_like(const Tensor& q, int64_t Dv) {
  if (q.size(1) > 1 && q.size(2) > 1 && q.stride(1) < q.stride(2))
    return at::empty({q.size(0), q.size(2), q.size(1), Dv}, q.options()).transpose(1, 2);
  return at::empty({q.size(0), q.size(1), q.size(2), Dv}, q.options());
}

std::vector<Tensor> forward(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const TermArgs& terms,
                            bool for_backward) {
  const Layout layout = for_backward ? Layout::kContiguous : Layout::kAnyRows;  // (the backward's: what it saves)
  const Tensor q = read_as(q_in, layout), k = read_as(k_in, layout), v = read_as(v_in, layout);
  const Shape sh = shape_of(q, k, v);
  auto out = output_like(q, sh.Dv);
  const bool wide = q.scalar_type() == at::kDouble;
  const auto stats_options = q.options().dtype(wide ? at::kDouble : at::kFloat);
  auto row_max = at::empty({sh.B, sh.H, sh.L}, stats_options), row_sum = at::empty({sh.B, sh.H, sh.L}, stats_options);
  if (sh.B * sh.H * sh.L == 0) return {out, row_max, row_sum};  // no rows: nothing to compute (and no row to take a band's range of)
  if (sh.S == 0 && !terms.sinks)  // rows that see nothing
    return {out.zero_(), row_max.fill_(-std::numeric_limits<double>::infinity()), row_sum.zero_()};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "mha_native_forward", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const auto t = terms_of<acc_t>(terms);
    const CallRows<scalar_t> rows{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                  out.data_ptr<scalar_t>(), row_strides(q), row_strides(k), row_strides(v),
                                  row_strides(out)};
    run_forward<scalar_t, acc_t>(sh, t, rows, {row_max.data_ptr<acc_t>(), row_sum.data_ptr<acc_t>()}, for_backward);
  });
  return {out, row_max, row_sum};
}

// (output (B, H, L, Dv), weights (B, H, L, S) in float32, float64 for float64 inputs): weights_kernel,
// reading q, k and v where their rows lie (the heads of a projection's (B, T, H, D) output, seen as
// (B, H, T, D), are not copied: measured, three copies and the output's were a quarter of the
// drop-in's weights over torch's at B4 T128 E512), and writing the output laid out as q is
// (output_like: (B, L, H, Dv) for such heads, so that merging them after is a view).
std::vector<Tensor> forward_weights(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const TermArgs& terms) {
  const Tensor q = read_as(q_in, Layout::kAnyRows), k = read_as(k_in, Layout::kAnyRows), v = read_as(v_in, Layout::kAnyRows);
  const Shape sh = shape_of(q, k, v);
  auto out = output_like(q, sh.Dv);
  auto weights = at::empty({sh.B, sh.H, sh.L, sh.S}, q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  if (sh.B * sh.H * sh.L == 0) return {out, weights};
  if (sh.S == 0) return {out.zero_(), weights};  // rows that see nothing (a sink's weight is not kept)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "mha_native_forward_weights", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    weights_kernel<scalar_t, acc_t>(sh, terms_of<acc_t>(terms), q.data_ptr<scalar_t>(), row_strides(q),
                                    k.data_ptr<scalar_t>(), row_strides(k), v.data_ptr<scalar_t>(), row_strides(v),
                                    out.data_ptr<scalar_t>(), row_strides(out), weights.data_ptr<acc_t>());
  });
  return {out, weights};
}

std::vector<Tensor> backward(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const Tensor& dout_in,
                             const Tensor& row_max, const Tensor& row_sum, const Tensor& delta, const TermArgs& terms) {
  const Tensor q = stored(q_in), k = stored(k_in), v = stored(v_in), dout = stored(dout_in);
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && dout.is_contiguous(),
              "mha native: the backward's q, k, v and dout must be contiguous (mha.kernels.native makes them so)");
  const Shape sh = shape_of(q, k, v);
  const int64_t threads = at::get_num_threads();
  const int64_t tasks = std::max<int64_t>(1, sh.B * sh.Hkv);  // split the keys when there are fewer (batch, kv head) tasks than threads
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>((2 * threads + tasks - 1) / tasks, tiles_of(sh.S)));
  const auto acc_options = row_max.options();
  auto dq_parts = at::zeros({chunks, sh.B, sh.H, sh.L, sh.D}, acc_options);
  const int64_t tiles = tiles_of(sh.S);
  auto dkt = at::zeros({sh.B, sh.Hkv, tiles, sh.D, kBlockK}, acc_options);  // tile-major, as K^T
  auto dvt = at::zeros({sh.B, sh.Hkv, tiles, sh.Dv, kBlockK}, acc_options);
  auto d_slopes_parts = at::zeros({sh.B, sh.Hkv, chunks, sh.G}, acc_options);
  if (sh.B * sh.H * sh.L > 0 && sh.S > 0) AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "mha_native_backward", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const auto t = terms_of<acc_t>(terms, /*with_sinks=*/false);  // the sinks' share is in row_sum already
    const RowStats<const acc_t> stats{row_max.data_ptr<acc_t>(), row_sum.data_ptr<acc_t>()};
    run_backward<scalar_t, acc_t>(sh, t, q.data_ptr<scalar_t>(), k, v, dout.data_ptr<scalar_t>(), stats,
                                  delta.data_ptr<acc_t>(), dq_parts.data_ptr<acc_t>(), chunks, dkt, dvt,
                                  d_slopes_parts.data_ptr<acc_t>());
  });
  auto d_slopes = d_slopes_parts.sum(at::IntArrayRef({0, 2})).reshape({sh.H});  // (B, Hkv, chunks, G) -> (Hkv, G) -> (H,)
  auto dk = from_tile_major(dkt, sh.S), dv = from_tile_major(dvt, sh.S);
  return {chunks == 1 ? dq_parts.select(0, 0) : dq_parts.sum(0), dk, dv, d_slopes};  // (one chunk: no copy)
}

// A number in an error message, formatted by std::to_string, never streamed: streaming an integer
// into a message (TORCH_CHECK's) crashed inside the C++ library where the extension's compiler and
// the process's libstdc++ differ (seen: gcc 13 under torch 2.11, an Intel Xeon).
inline std::string text(int64_t x) { return std::to_string(x); }

// An integer tensor (int32 or int64, on the CPU) of ``numel`` values as int64, contiguous.
Tensor paged_integers(const Tensor& x, const char* name, int64_t dims) {
  TORCH_CHECK(x.device().is_cpu(), "mha paged: ", name, " must be a CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kLong || x.scalar_type() == at::kInt, "mha paged: ", name,
              " must be int32 or int64, got ", c10::toString(x.scalar_type()));
  TORCH_CHECK(x.dim() == dims, "mha paged: ", name, " must be ", text(dims), "-D, got ", text(x.dim()), "-D");
  return x.to(at::kLong).contiguous();
}

// The strides (elements) (page, kv head, slot) of a pool (N, Hkv, P, ...) whose slots are
// ``slot_width`` elements apart when contiguous (a row of X for pages, 1 for scales): a dim of size 1
// takes the stride a contiguous tensor would have (torch gives such dims any stride). Pages of one
// slot (keys packed token by token, e.g. (T, Hkv, 1, D)): the slot stride is the page stride, the
// distance from one page's key to the next page's, so that pages that follow each other in the pool
// are read as one run of keys (one product per run, not per key).
std::tuple<int64_t, int64_t, int64_t> pool_strides(const Tensor& x, int64_t slot_width) {
  const int64_t P = x.size(2), slot = P <= 1 ? slot_width : x.stride(2);
  const int64_t head = x.size(1) <= 1 ? P * slot : x.stride(1), page = x.size(0) <= 1 ? x.size(1) * head : x.stride(0);
  return {page, head, P == 1 && x.size(0) > 1 ? page : slot};
}

// A pages tensor (N, Hkv, P, X): its rows of X contiguous, its slots apart by at least a row.
std::tuple<int64_t, int64_t, int64_t> page_strides(const Tensor& x, const char* name) {
  const int64_t X = x.size(3);
  TORCH_CHECK(X <= 1 || x.stride(3) == 1, "mha paged: ", name, "'s rows must be contiguous (stride 1 along the head dim)");
  TORCH_CHECK(x.size(2) <= 1 || x.stride(2) >= X, "mha paged: ", name, "'s slots must not overlap (slot stride >= head dim)");
  return pool_strides(x, X);
}

// An 8-bit pool's scales (N, Hkv, P), floats of the accumulation dtype, one per slot of ``pages``.
std::tuple<int64_t, int64_t, int64_t> scale_strides(const Tensor& x, const Tensor& pages, at::ScalarType acc_type,
                                                    const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == acc_type && x.dim() == 3 && x.size(0) == pages.size(0) &&
                  x.size(1) == pages.size(1) && x.size(2) == pages.size(2),
              "mha paged: ", name, " must be (N, Hkv, P) CPU floats of the accumulation dtype, one per slot of the pool");
  return pool_strides(x, 1);
}

// paged_kernel on the products Products<pool_t> make of a call's pool, pool_t its keys' and values'
// stored type (int8, or q's dtype): the one place the three kinds of paged products are made.
template <typename scalar_t, typename acc_t>
struct PagedProductsOf {
  template <typename pool_t>
  using type = PagedProducts<scalar_t, acc_t, pool_t>;
};

template <typename scalar_t, typename acc_t>
struct PagedRun {
  const PagedCall& call;
  const Terms<acc_t>& t;
  int64_t B;
  const Tensor &q, &k, &v;
  const PagePool& pool;
  const PageScales& scales;
  const Tensor& out;
  const RowStats<acc_t>& stats;

  template <template <typename> class Products>
  void on(bool quantized) const {
    if (quantized)
      with(Products<int8_t>(k.data_ptr<int8_t>(), v.data_ptr<int8_t>(), pool, scales, call.D, call.Dv, t.scale));
    else
      with(Products<scalar_t>(k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), pool, scales, call.D, call.Dv, t.scale));
  }
  template <typename Products>
  void with(const Products& products) const {
    paged_kernel<scalar_t, acc_t>(call, t, B, q.data_ptr<scalar_t>(), products, out.data_ptr<scalar_t>(), stats);
  }
};

// An 8-bit pool as mha.kernels.storage keeps it, (N, Hkv, P, X + 4): (its rows (N, Hkv, P, X), their
// float32 scales (N, Hkv, P)), views of each slot's first X bytes and its last four (copied out where
// those do not lie on whole floats, as storage.split does).
std::pair<Tensor, Tensor> kept_rows(const Tensor& kept) {
  const int64_t X = kept.size(3) - kScaleBytes;
  Tensor bytes = kept.narrow(3, X, kScaleBytes);  // (N, Hkv, P, 4)
  const bool floats = bytes.storage_offset() % kScaleBytes == 0 && bytes.stride(3) == 1 &&  // (torch's rule for a float view)
                      bytes.stride(0) % kScaleBytes == 0 && bytes.stride(1) % kScaleBytes == 0 &&
                      bytes.stride(2) % kScaleBytes == 0;
  if (!floats) bytes = bytes.contiguous();
  return {kept.narrow(3, 0, X), bytes.view(at::kFloat).squeeze(3)};
}

// Whether a kept 8-bit pool's scales can be read where they lie as floats of ``acc_type`` (float32,
// on whole floats): then the kernel reads them in place, with no tensor made (kept_rows otherwise).
bool kept_scales_in_place(const Tensor& kept, at::ScalarType acc_type) {
  if (acc_type != at::kFloat || kept.size(3) <= kScaleBytes || kept.numel() == 0) return false;
  const auto [page, head, slot] = pool_strides(kept, kept.size(3));
  const auto first = reinterpret_cast<uintptr_t>(kept.data_ptr<int8_t>() + kept.size(3) - kScaleBytes);
  return first % alignof(float) == 0 && page % kScaleBytes == 0 && head % kScaleBytes == 0 && slot % kScaleBytes == 0;
}

// paged_forward on its sequences' counts as arrays: cu (B + 1,), seqlens (B,), table (B, M) row-major.
std::vector<Tensor> paged_sequences(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, int64_t B, int64_t M,
                                    const int64_t* cu, const int64_t* seqlens, const int64_t* pages,
                                    const TermArgs& terms, const Optional& k_scales, const Optional& v_scales) {
  const Tensor q = stored(q_in), k_pages = stored(k_in), v_pages = stored(v_in);
  TORCH_CHECK(q.dim() == 3 && k_pages.dim() == 4 && v_pages.dim() == 4,
              "mha paged: q must be (Tq, H, D), k_pages (N, Hkv, P, D), v_pages (N, Hkv, P, Dv)");
  TORCH_CHECK(q.device().is_cpu() && k_pages.device().is_cpu() && v_pages.device().is_cpu(),
              "mha paged: q and the pages must be CPU tensors");
  const bool quantized = k_pages.scalar_type() == at::kChar;
  // 8-bit pages without scales: kept as mha.kernels.storage keeps them, each row then its float32 scale
  const bool kept = quantized && v_pages.scalar_type() == at::kChar && !k_scales && !v_scales;
  TORCH_CHECK(quantized ? v_pages.scalar_type() == at::kChar && (kept || (k_scales && v_scales))
                        : k_pages.scalar_type() == q.scalar_type() && v_pages.scalar_type() == q.scalar_type() &&
                              !k_scales && !v_scales,
              "mha paged: the pages must have q's dtype, or be int8 (keys and values), kept with their scales or given them");
  const auto acc_type = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t trail = kept ? kScaleBytes : 0;  // a kept row's scale, after its values
  TORCH_CHECK(!kept || (k_pages.size(3) > kScaleBytes && v_pages.size(3) > kScaleBytes),
              "mha paged: 8-bit pages without scales are kept as (N, Hkv, P, X + 4), each row then its float32 scale");
  if (kept && !(kept_scales_in_place(k_pages, acc_type) && kept_scales_in_place(v_pages, acc_type))) {
    const auto [k_rows, k_kept] = kept_rows(k_pages);  // apart, as floats of the accumulation dtype
    const auto [v_rows, v_kept] = kept_rows(v_pages);
    return paged_sequences(q, k_rows, v_rows, B, M, cu, seqlens, pages, terms, k_kept.to(acc_type), v_kept.to(acc_type));
  }
  TORCH_CHECK(q.is_contiguous(), "mha paged: q must be contiguous");
  const int64_t Tq = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t N = k_pages.size(0), Hkv = k_pages.size(1), P = k_pages.size(2), Dv = v_pages.size(3) - trail;
  TORCH_CHECK(v_pages.size(0) == N && v_pages.size(1) == Hkv && v_pages.size(2) == P,
              "mha paged: v_pages must have k_pages' pages, heads and block size");
  TORCH_CHECK(k_pages.size(3) - trail == D, "mha paged: k_pages must have q's head dim");
  TORCH_CHECK(P > 0, "mha paged: k_pages must have a block size of at least 1");
  TORCH_CHECK(D > 0 && Dv > 0, "mha paged: head dims must be at least 1");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "mha paged: key/value heads must divide query heads");
  const auto [k_page, k_head, k_slot] = page_strides(k_pages, "k_pages");
  const auto [v_page, v_head, v_slot] = page_strides(v_pages, "v_pages");
  // every index the kernel will read: the sequences' query rows, their keys' pages
  TORCH_CHECK(cu[0] == 0 && cu[B] == Tq, "mha paged: cu_seqlens_q must rise from 0 to q's ", text(Tq), " rows");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = cu[b + 1] - cu[b], S = seqlens[b];
    TORCH_CHECK(L >= 1, "mha paged: cu_seqlens_q must rise, each sequence at least one row (sequence ", text(b), ")");
    TORCH_CHECK(S >= L, "mha paged: sequence ", text(b), " has ", text(L), " query rows but ", text(S),
                " keys (L_b <= S_b)");
    TORCH_CHECK(P > 0 ? (S + P - 1) / P <= M : S == 0, "mha paged: sequence ", text(b), "'s ", text(S),
                " keys need more than the block table's ", text(M), " pages of ", text(P));
    for (int64_t block = 0; P > 0 && block < (S + P - 1) / P; ++block) {
      const int64_t page = pages[b * M + block];
      TORCH_CHECK(page >= 0 && page < N, "mha paged: block_table[", text(b), ", ", text(block), "] = ", text(page),
                  " names no page of the pool (0..", text(N - 1), ")");
    }
  }
  TORCH_CHECK(!terms.q_pos && !terms.key_valid && !terms.mask && terms.offset == 0,
              "mha paged: a sequence's positions come from its pages (bottom-right): no positions, padding, mask or offset");
  for (const auto* term : {&terms.slopes, &terms.sinks})
    if (*term)
      TORCH_CHECK((*term)->device().is_cpu() && (*term)->scalar_type() == acc_type && (*term)->numel() == H &&
                      (*term)->is_contiguous(),
                  "mha paged: ALiBi slopes and sinks must be (H,) contiguous CPU tensors of the accumulation dtype");
  auto out = at::empty({Tq, H, Dv}, q.options());
  const auto stats_options = q.options().dtype(acc_type);
  auto row_max = at::empty({Tq, H}, stats_options), row_sum = at::empty({Tq, H}, stats_options);
  if (Tq * H == 0) return {out, row_max, row_sum};
  const PagePool pool{P, k_page, k_head, k_slot, v_page, v_head, v_slot};
  PageScales page_scales;
  if (kept) {  // each row's scale in its last 4 bytes: a float view of the pool, strides in floats
    page_scales = {k_pages.data_ptr<int8_t>() + D, v_pages.data_ptr<int8_t>() + Dv, k_page / kScaleBytes,
                   k_head / kScaleBytes, k_slot / kScaleBytes, v_page / kScaleBytes, v_head / kScaleBytes,
                   v_slot / kScaleBytes};
  } else if (quantized) {
    const auto [kp, kh, ks] = scale_strides(*k_scales, k_pages, acc_type, "k_scales");
    const auto [vp, vh, vs] = scale_strides(*v_scales, v_pages, acc_type, "v_scales");
    page_scales = {k_scales->data_ptr(), v_scales->data_ptr(), kp, kh, ks, vp, vh, vs};
  }
  const PagedCall call{H, Hkv, D, Dv, cu, seqlens, pages, M};
  bool prefill = false;  // a block of more rows than the run loops take
  for (int64_t b = 0; b < B && !prefill; ++b) prefill = (H / Hkv) * (cu[b + 1] - cu[b]) > kRunLoopRows;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "mha_paged_forward", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const auto t = terms_of<acc_t>(terms);
    const RowStats<acc_t> stats{row_max.data_ptr<acc_t>(), row_sum.data_ptr<acc_t>()};
    const PagedRun<scalar_t, acc_t> run{call, t, B, q, k_pages, v_pages, pool, page_scales, out, stats};
#if defined(MHA_AVX512_BF16)
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>)
      if (prefill) {  // a block of more rows than the run loops take
#if defined(MHA_AMX)
        if (amx_usable() && amx_fits(D, Dv)) return run.template on<PagedAmxProducts>(quantized);
#endif
        return run.template on<PagedBrgemmProducts>(quantized);
      }
#endif
    if constexpr (std::is_same_v<scalar_t, float>)
      if (prefill) return run.template on<PagedFloatTiles>(quantized);  // (the same: tiles packed once)
    run.template on<PagedProductsOf<scalar_t, acc_t>::template type>(quantized);
  });
  return {out, row_max, row_sum};
}

std::vector<Tensor> paged_forward(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages,
                                  const Tensor& block_table_in, const Tensor& cu_seqlens_q_in,
                                  const Tensor& seqlens_k_in, const TermArgs& terms, const Optional& k_scales,
                                  const Optional& v_scales) {
  const Tensor table = paged_integers(block_table_in, "block_table", 2);
  const Tensor cu_seqlens_q = paged_integers(cu_seqlens_q_in, "cu_seqlens_q", 1);
  const Tensor seqlens_k = paged_integers(seqlens_k_in, "seqlens_k", 1);
  const int64_t B = table.size(0), M = table.size(1);
  TORCH_CHECK(cu_seqlens_q.numel() == B + 1 && seqlens_k.numel() == B, "mha paged: block_table has ", text(B),
              " sequences: cu_seqlens_q needs ", text(B + 1), " offsets and seqlens_k ", text(B), " counts");
  return paged_sequences(q, k_pages, v_pages, B, M, cu_seqlens_q.data_ptr<int64_t>(), seqlens_k.data_ptr<int64_t>(),
                         table.data_ptr<int64_t>(), terms, k_scales, v_scales);
}

// The band's rule as the kernel applies it, for the tests that check it against mha.positions.Band:
// each query's key interval [first, stop) (key_interval; keys in position order) and (L, S) bool,
// whether query i sees key j by its reach (Reach::holds, what a tile of keys out of order or with
// ALiBi reads per key). left, right: kUnbounded for no bound on that side; default positions (query
// i at i + offset, keys 0..S-1) or given ones, q_pos (1, L) and k_pos (1, S).
std::vector<Tensor> key_intervals(const TermArgs& terms, int64_t L, int64_t S) {
  const auto t = terms_of<float>(terms);
  Tensor first = at::empty({L}, at::kLong), stop = at::empty({L}, at::kLong), visible = at::empty({L, S}, at::kBool);
  int64_t *f = first.data_ptr<int64_t>(), *e = stop.data_ptr<int64_t>();
  bool* seen = visible.data_ptr<bool>();
  for (int64_t i = 0; i < L; ++i) {
    const int64_t q_position = t.query_position(0, i);
    std::tie(f[i], e[i]) = key_interval(t, 0, S, q_position);
    const Reach reach = t.reach(q_position);
    for (int64_t j = 0; j < S; ++j) seen[i * S + j] = reach.holds(t.key_position(0, j));
  }
  return {first, stop, visible};
}

// ---- the per-call fast path (mha.kernels.dispatch.plain_sdpa) -----------------------------------

// A plain call's checks and its kernel's call in one step from Python: where Python read each
// shape, dtype and stride through a call into torch (~0.1-0.4 us each, and more with caches cold
// after a kernel), a short call paid more for them than for its attention. The conditions are
// dispatch.plain_call's (it states them; tests hold the two to the same answers), on CPU tensors:
// one floating dtype, 4-D, nothing empty, one batch, Hkv = H (or dividing it with enable_gqa),
// D = Dk = Dv, contiguous rows, no autocast, no forward-mode tangent, plain torch.Tensors, no torch.func
// transform or torch function mode. The caller has checked what only Python can (observers,
// torch.compile). Then the measured crossovers
// (-1 for never) pick the kernel: a call that needs no gradient by ``direct`` (where this kernel,
// called from here, was measured faster: forward's output), one that does by ``full`` (where the
// full path, mha.kernels.native's autograd function, was: None, the caller takes the full path).
// Otherwise torch's output (at::scaled_dot_product_attention, run without the GIL as torch's own
// binding runs it, with the caller's scale: None for torch's 1 / sqrt(D)). None also for a call
// that is not plain.
// A call of at least kPromptRows query rows is a prompt's, whatever its rows per kv head: the tuning's
// prefill grid measured it (from L = S = 16, tuning.PREFILL_LENGTHS; dispatch.NATIVE_PROMPT_ROWS), its
// decoding steps one row per head (an H = Hkv call of L = 16 taken for a step ran native's 16 rows at
// 1.2-1.9x torch's time, Xeon with AMX).
constexpr int64_t kPromptRows = 16;
struct Crossovers {
  int64_t decode_keys, prefill_work;  // a step of at most decode_rows rows per kv head from S keys; L, S >= sqrt(work)
  bool native_faster(int64_t rows, int64_t decode_rows, int64_t L, int64_t S) const {
    if (rows <= decode_rows && L < kPromptRows && decode_keys >= 0 && S >= decode_keys) return true;
    return prefill_work >= 0 && std::min(L, S) * std::min(L, S) >= prefill_work;
  }
};

// Whether q, k, v make a plain call (the conditions above, crossovers aside).
bool plain_inputs(const Tensor& q, const Tensor& k, const Tensor& v, bool enable_gqa) {
  if (q.is_nested() || k.is_nested() || v.is_nested() || q.layout() != at::kStrided || k.layout() != at::kStrided ||
      v.layout() != at::kStrided || !q.device().is_cpu() || !k.device().is_cpu() || !v.device().is_cpu())
    return false;
  const auto dtype = q.scalar_type();
  if ((dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) || k.scalar_type() != dtype ||
      v.scalar_type() != dtype || q.dim() != 4 || k.dim() != 4 || v.dim() != 4)
    return false;
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  if (k.size(0) != B || v.size(0) != B || v.size(1) != Hkv || v.size(2) != S || k.size(3) != D || v.size(3) != D)
    return false;
  if (B == 0 || H == 0 || L == 0 || D == 0 || Hkv == 0 || S == 0 || !(H == Hkv || (enable_gqa && H % Hkv == 0)))
    return false;
  return q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && !at::autocast::is_autocast_enabled(at::kCPU);
}

bool needs_gradient(const Tensor& q, const Tensor& k, const Tensor& v) {
  return at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
}

// Whether key_valid is key padding as the kernel reads it for q (B, ...) over S keys: absent, or bool
// (B or 1, S) on the CPU with unit key stride (a padded call's; else the call takes the full path).
bool plain_padding(const Optional& key_valid, int64_t B, int64_t S) {
  if (!key_valid) return true;
  const Tensor& valid = *key_valid;
  return valid.scalar_type() == at::kBool && valid.device().is_cpu() && valid.dim() == 2 && valid.size(1) == S &&
         (valid.size(0) == B || valid.size(0) == 1) && (S <= 1 || valid.stride(1) == 1) && valid.layout() == at::kStrided;
}

// Whether mask is an attn_mask the full path hands to torch's kernel as it is (masks.from_sdpa, sdpa._masked
// on the CPU): absent, or bool (True = attend) or float32 (added: the dtype masks are added in beside each
// of the fast path's dtypes, masks.additive_dtype), strided on the CPU, of 2 to 4 dims that are each 1 or
// the call's (B, H, L, S) from the right. Else the full path converts it, or names what is wrong.
bool plain_mask(const Optional& mask, const Tensor& q, int64_t S) {
  if (!mask) return true;
  const Tensor& m = *mask;
  if (m.is_nested() || m.layout() != at::kStrided || !m.device().is_cpu() || m.dim() < 2 || m.dim() > 4 ||
      (m.scalar_type() != at::kBool && m.scalar_type() != at::kFloat))
    return false;
  const int64_t call[4] = {q.size(0), q.size(1), q.size(2), S};
  for (int64_t d = 1; d <= m.dim(); ++d)
    if (m.size(-d) != 1 && m.size(-d) != call[4 - d]) return false;
  return true;
}

// The terms of a plain call: the scale (None: 1 / sqrt(D), as Contract.scale_for), top-left causality at
// most, key padding where given.
TermArgs plain_terms(bool is_causal, std::optional<double> scale, int64_t D, const Optional& key_valid) {
  TermArgs terms;
  terms.scale = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(D));
  if (is_causal) {
    terms.has_band = true;
    terms.right = 0;
  }
  if (key_valid) terms.key_valid = key_valid->contiguous();
  return terms;
}

// Whether a torch.func transform (vmap, grad, ...) or a TorchFunctionMode is active on this thread: then a
// call is Python's (a transform wraps the tensors; a mode must see torch's Python call), read here in one
// step where Python's reads of them cost a short call 2 us with its caches cold (Xeon with AMX). The
// transforms' test is the one torch._C._are_functorch_transforms_active makes: functorch's dynamic
// layer keys in the thread's included dispatch keys.
bool transform_or_mode_active() {
  const auto included = c10::impl::tls_local_dispatch_key_set().included_;
  return included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
         included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode) || at::impl::torch_function_mode_enabled();
}

// Whether obj is a torch.Tensor, not a subclass (nor a Parameter): a subclass's call is Python's.
bool plain_tensor(pybind11::handle obj) { return Py_TYPE(obj.ptr()) == reinterpret_cast<PyTypeObject*>(THPVariableClass); }

// Whether any of the tensors carries a forward-mode tangent (forward AD's level 0, the one level torch
// has): then the call is the full path's (native has no forward-mode derivative). A tensor without
// autograd metadata has none; _fw_grad itself is an operator call (through the dispatcher).
bool has_tangent(std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* x : tensors)
    if (x != nullptr && x->defined() && x->unsafeGetTensorImpl()->autograd_meta() != nullptr && x->_fw_grad(0).defined())
      return true;
  return false;
}

// The crossovers of a dtype in ``resolved`` (tuning.resolved_ints: a dict of torch.dtype -> (threads,
// direct, full), each a pair, -1 for never), where resolved for the thread count in use (or threads -1:
// any); nullopt where missing or resolved for another count.
std::optional<std::pair<Crossovers, Crossovers>> resolved_crossovers(pybind11::handle resolved, at::ScalarType dtype) {
  if (!PyDict_Check(resolved.ptr())) throw torch::TypeError("plain_sdpa: resolved must be a dict of crossovers by dtype");
  PyObject* found = PyDict_GetItem(resolved.ptr(), reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype)));  // (borrowed)
  if (found == nullptr) return std::nullopt;
  const auto malformed = []() {
    PyErr_Clear();
    return torch::TypeError("plain_sdpa: a dtype's crossovers must be (threads, (int, int), (int, int))");
  };
  const auto integer = [&](PyObject* x) {
    const long long value = PyLong_Check(x) ? PyLong_AsLongLong(x) : -1;
    if (!PyLong_Check(x) || (value == -1 && PyErr_Occurred())) throw malformed();
    return static_cast<int64_t>(value);
  };
  const auto pair = [&](PyObject* x) {
    if (!PyTuple_Check(x) || PyTuple_GET_SIZE(x) != 2) throw malformed();
    return Crossovers{integer(PyTuple_GET_ITEM(x, 0)), integer(PyTuple_GET_ITEM(x, 1))};
  };
  if (!PyTuple_Check(found) || PyTuple_GET_SIZE(found) != 3) throw malformed();
  const int64_t threads = integer(PyTuple_GET_ITEM(found, 0));
  if (threads >= 0 && threads != at::get_num_threads()) return std::nullopt;
  return std::pair{pair(PyTuple_GET_ITEM(found, 1)), pair(PyTuple_GET_ITEM(found, 2))};
}

// Its answers: the output; None (the full path, or CUDA tensors: the caller's Python decides); the thread
// count now in use, where ``resolved`` holds no crossovers of the call's dtype for it: the caller resolves
// them (tuning.crossover_ints) and asks again; Ellipsis where the call is Python's to decide: q, k, v or
// the mask not plain torch.Tensors (a subclass, a Parameter, anything else), or a transform or a torch
// function mode active. The caller has checked what only Python can (observers, torch.compile).
// An attn_mask (plain_mask's) runs on torch's kernel alone, as the full path runs it there: not beside
// causality or key padding (the full path folds them into a copy), nor where the full path's crossovers
// pick native (it then runs native beside the mask: its bits). The direct ones, measured on plain calls
// of this kernel's own, say nothing of a masked call's, which it never runs.
// (q, k, v and mask come as Python objects, their classes read here: the same checks in Python, and the
// crossovers' lookup and their six arguments, cost a short call 0.1-0.2x torch's time with caches cold.)
pybind11::object plain_sdpa(pybind11::handle q_obj, pybind11::handle k_obj, pybind11::handle v_obj, bool is_causal,
                            bool enable_gqa, int64_t decode_rows, pybind11::handle resolved, std::optional<double> scale,
                            const Optional& key_valid, pybind11::handle mask_obj) {
  const auto none = pybind11::none();
  if (!plain_tensor(q_obj) || !plain_tensor(k_obj) || !plain_tensor(v_obj) || !(mask_obj.is_none() || plain_tensor(mask_obj)) ||
      transform_or_mode_active())
    return pybind11::ellipsis();
  const Tensor &q = THPVariable_Unpack(q_obj.ptr()), &k = THPVariable_Unpack(k_obj.ptr()), &v = THPVariable_Unpack(v_obj.ptr());
  const Optional mask = mask_obj.is_none() ? Optional{} : Optional{THPVariable_Unpack(mask_obj.ptr())};
  if (!plain_inputs(q, k, v, enable_gqa) || !plain_padding(key_valid, q.size(0), k.size(2)) ||
      !plain_mask(mask, q, k.size(2)) || (mask && (is_causal || key_valid)) ||
      has_tangent({&q, &k, &v, mask ? &*mask : nullptr}))
    return none;
  const auto crossovers = resolved_crossovers(resolved, q.scalar_type());
  if (!crossovers) return pybind11::int_(at::get_num_threads());
  const auto& [direct, full_path] = *crossovers;
  const int64_t H = q.size(1), L = q.size(2), Hkv = k.size(1), S = k.size(2), rows = L * (H / Hkv);
  const bool gradient = needs_gradient(q, k, v);
  const bool native = !mask && (gradient ? full_path : direct).native_faster(rows, decode_rows, L, S);
  // the full path: native's autograd function, or torch's kernel beside key padding (its rows that see
  // nothing are NaN there: the full path plans them), or native beside a mask
  if ((native && gradient) || (!native && key_valid) || (mask && full_path.native_faster(rows, decode_rows, L, S)))
    return none;
  Tensor out;
  {
    pybind11::gil_scoped_release no_gil;
    out = native ? forward(q, k, v, plain_terms(is_causal, scale, q.size(3), key_valid), /*for_backward=*/false)[0]
                 : at::scaled_dot_product_attention(q, k, v, mask, 0.0, is_causal, scale, enable_gqa && Hkv != H);
  }
  return pybind11::cast(out);
}

// plain_sdpa's binding in CPython's own calling convention (METH_FASTCALL: 8 to 10 positional
// arguments, read where they lie): pybind's argument loaders took 0.65 us of a call that returned at
// once, a share of a short call (a T16 call looped at 1.08x torch's own binding's time).
PyObject* plain_sdpa_fastcall(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs < 8 || nargs > 10)
    throw torch::TypeError("plain_sdpa(q, k, v, is_causal, enable_gqa, decode_rows, resolved, scale, key_valid=None, "
                           "mask=None) takes 8 to 10 positional arguments (" + std::to_string(nargs) + " given)");
  const auto flag = [](PyObject* x) {
    if (x != Py_True && x != Py_False) throw torch::TypeError("plain_sdpa: is_causal and enable_gqa must be bools");
    return x == Py_True;
  };
  const long long decode_rows = PyLong_AsLongLong(args[5]);
  if (decode_rows == -1 && PyErr_Occurred()) return nullptr;
  std::optional<double> scale;
  if (args[7] != Py_None) {
    scale = PyFloat_AsDouble(args[7]);
    if (*scale == -1.0 && PyErr_Occurred()) return nullptr;
  }
  Optional key_valid;
  if (nargs > 8 && args[8] != Py_None) {
    if (!THPVariable_Check(args[8])) throw torch::TypeError("plain_sdpa: key_valid must be a Tensor or None");
    key_valid = THPVariable_Unpack(args[8]);
  }
  const pybind11::handle mask = nargs > 9 ? args[9] : Py_None;
  return plain_sdpa(args[0], args[1], args[2], flag(args[3]), flag(args[4]), decode_rows, args[6], scale, key_valid, mask)
      .release()
      .ptr();
  END_HANDLE_TH_ERRORS
}

PyMethodDef plain_sdpa_method = {
    "plain_sdpa", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(plain_sdpa_fastcall)), METH_FASTCALL,
    "plain_sdpa(q, k, v, is_causal, enable_gqa, decode_rows, resolved, scale, key_valid=None, mask=None): the per-call "
    "fast path: a plain call's output, native's or torch's SDPA's, or None (mha.kernels.dispatch.plain_sdpa)"};

// The same for a plain call that asks for its weights (dispatch.plain_weights): (output, weights (B, H, L, S)
// in q's dtype) from forward_weights, or None where the call is not plain or needs a gradient.
pybind11::object plain_weights(const Tensor& q, const Tensor& k, const Tensor& v, bool is_causal, bool enable_gqa,
                               std::optional<double> scale, const Optional& key_valid) {
  if (transform_or_mode_active() || !plain_inputs(q, k, v, enable_gqa) || !plain_padding(key_valid, q.size(0), k.size(2)) ||
      needs_gradient(q, k, v))
    return pybind11::none();
  std::vector<Tensor> result;
  {
    pybind11::gil_scoped_release no_gil;
    result = forward_weights(q, k, v, plain_terms(is_causal, scale, q.size(3), key_valid));
    result[1] = result[1].to(q.scalar_type());
  }
  return pybind11::make_tuple(result[0], result[1]);
}

// The per-call fast path of a batch whose sequences share one length over 8-bit rows kept as mha's caches
// keep them (mha.kernels.dispatch.plain_pages: an 8-bit KVCache's or an Int8Cache's step): q (B, H, L, D)
// over k (B, Hkv, S, D + 4) and v (B, Hkv, S, Dv + 4) int8, each sequence's keys one page, its rows the
// last L of its S positions: the output (B, H, L, Dv) of paged_forward, checks and call in one step from
// Python (attend_pages' checks in Python cost a short step as much as its attention). None where the
// call is not one: q not float32, bfloat16 or float16, shapes that do not fit, nothing to attend, rows
// not readable in place, a gradient asked for, a term the pages do not carry (positions, padding, a
// mask, an offset): the caller's full path checks it and names what is wrong.
bool plain_kept_inputs(const Tensor& q, const Tensor& k, const Tensor& v) {
  for (const Tensor* x : {&q, &k, &v})
    if (x->is_nested() || x->layout() != at::kStrided || !x->device().is_cpu() || x->dim() != 4) return false;
  const auto dtype = q.scalar_type();
  if ((dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) || k.scalar_type() != at::kChar ||
      v.scalar_type() != at::kChar)
    return false;
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  if (B < 1 || H < 1 || L < 1 || D < 1 || Hkv < 1 || H % Hkv != 0 || L > S || k.size(0) != B || v.size(0) != B ||
      v.size(1) != Hkv || v.size(2) != S || k.size(3) != D + kScaleBytes || v.size(3) <= kScaleBytes)
    return false;
  for (const Tensor* x : {&k, &v})  // rows read in place (page_strides' conditions)
    if (x->stride(3) != 1 || (S > 1 && x->stride(2) < x->size(3))) return false;
  return true;
}

pybind11::object plain_pages(const Tensor& q, const Tensor& k, const Tensor& v, const TermArgs& terms) {
  if (!plain_kept_inputs(q, k, v) || needs_gradient(q, k, v) || terms.q_pos || terms.k_pos || terms.key_valid ||
      terms.mask || terms.offset != 0)
    return pybind11::none();
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2);
  std::vector<int64_t> cu(B + 1), seqlens(B, k.size(2)), pages(B);  // sequence b: rows b * L.., page b
  for (int64_t b = 0; b <= B; ++b) cu[b] = b * L;
  std::iota(pages.begin(), pages.end(), int64_t(0));
  Tensor out;
  {
    pybind11::gil_scoped_release no_gil;
    const Tensor rows = q.transpose(1, 2).reshape({B * L, H, q.size(3)}).contiguous();  // (B, H, L, D) -> (B*L, H, D)
    out = paged_sequences(rows, k, v, B, 1, cu.data(), seqlens.data(), pages.data(), terms, std::nullopt,
                          std::nullopt)[0];
  }
  return pybind11::cast(out.view({B, L, H, out.size(2)}).transpose(1, 2));  // (B*L, H, Dv) -> (B, H, L, Dv)
}

// ---- peaks: what this build's instructions reach on this CPU (mha bench --sections peaks) -------

// Every thread runs kChains independent chains of one instruction for ``iterations`` steps: more
// chains than an FMA's latency times its ports on any core seen (4 cycles x 2 ports), so the rate is
// the issue rate, not a chain's latency. Returns the floating-point operations done (a product and a
// sum each: 2 per lane and step; a bf16 dot product's lane does 2 pairs: 4) and keeps the chains
// alive through peak_sink (else the compiler drops them). The caller times the call.
constexpr int kChains = 12;
volatile float peak_sink = 0;

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
double fma_peak_work(int64_t iterations) {
  using vec = Lanes<float>::vec;
  std::atomic<int64_t> tasks{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      vec acc[kChains];
      const vec x = vec{} + 0.999999f, y = vec{} + 1e-6f;
      for (int c = 0; c < kChains; ++c) acc[c] = vec{} + static_cast<float>(c);
      for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
        for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * x + y;  // contracted to one FMA where the build has them
      }
      vec total = acc[0];
      for (int c = 1; c < kChains; ++c) total += acc[c];
      peak_sink = Lanes<float>::sum(total);
      tasks.fetch_add(1);
    }
  });
  return 2.0 * Lanes<float>::kCount * kChains * static_cast<double>(iterations) * tasks.load();
}

// The same with bfloat16 dot products (vdpbf16ps: 16 lanes, each adding two products of bf16 pairs);
// -1 in builds without them.
double bf16_dot_peak_work(int64_t iterations) {
#if defined(MHA_AVX512_BF16)
  std::atomic<int64_t> tasks{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      __m512 acc[kChains];
      const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
      const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
      for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
      for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
        for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
      }
      __m512 total = acc[0];
      for (int c = 1; c < kChains; ++c) total = _mm512_add_ps(total, acc[c]);
      peak_sink = _mm512_reduce_add_ps(total);
      tasks.fetch_add(1);
    }
  });
  return 4.0 * 16 * kChains * static_cast<double>(iterations) * tasks.load();
#else
  (void)iterations;
  return -1;
#endif
}
#pragma GCC diagnostic pop

// The same on AMX tiles (tdpbf16ps: 16 x 16 x 32 products and sums a step), four independent chains in
// tmm0-3 over operands loaded once (tmm4-7): the tiles' nominal rate, with no data to move; -1 where
// the products do not run on AMX (no AMX, or set_amx(False)).
double amx_tile_peak_work(int64_t iterations) {
#if defined(MHA_AMX)
  if (!amx_usable()) return -1;
  std::atomic<int64_t> tasks{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
    alignas(64) static const uint16_t operand[16 * 32] = {};  // zeros: the rate is the same for any value
    alignas(64) float result[16 * 16];
    for (int64_t task = begin; task < end; ++task) {
      use_tiles(TileShape::products);
      MHA_TILE_LOAD(4, operand, 64);
      MHA_TILE_LOAD(5, operand, 64);
      MHA_TILE_LOAD(6, operand, 64);
      MHA_TILE_LOAD(7, operand, 64);
      MHA_TILE_ZERO(0);
      MHA_TILE_ZERO(1);
      MHA_TILE_ZERO(2);
      MHA_TILE_ZERO(3);
      for (int64_t it = 0; it < iterations; ++it) {
        MHA_TILE_DP(0, 4, 6);
        MHA_TILE_DP(1, 4, 7);
        MHA_TILE_DP(2, 5, 6);
        MHA_TILE_DP(3, 5, 7);
      }
      MHA_TILE_STORE(0, result, 64);
      peak_sink = result[0];
      release_tiles();
      tasks.fetch_add(1);
    }
  });
  return 2.0 * 16 * 16 * 32 * 4 * static_cast<double>(iterations) * tasks.load();
#else
  (void)iterations;
  return -1;
#endif
}

// ---- 8-bit rows, as a cache keeps them -----------------------------------------------------------

// x (..., X) floating, contiguous -> (..., X + 4) int8: each row's X values quantized, then the 4 bytes
// of its float32 scale (mha.kernels.storage's layout), bitwise what mha.kernels.quantize.quantize_int8
// and storage.store compute in torch ops (a decoding step stores one row per head: a dozen torch calls
// cost ~100 us there, this one call ~1 us). In float32: scale = max |x| / 127 (NaN where the row holds
// NaN or an infinity), data = x / scale rounded half to even (the default rounding mode, as torch.round)
// within +-127; a row whose scale is not positive (zeros, NaN, or too small a max for a float32 scale)
// stores zeros.
constexpr float kLevels = 127.0f;               // quantize.LEVELS: int8's symmetric range

Tensor quantize_rows(const Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() >= 1 && at::isFloatingType(x.scalar_type()),
              "mha quantize_rows: x must be a contiguous floating CPU tensor of at least one dim");
  const int64_t X = x.size(-1), rows = X > 0 ? x.numel() / X : 0;
  auto shape = x.sizes().vec();
  shape.back() = X + kScaleBytes;
  auto out = at::empty(shape, x.options().dtype(at::kChar));
  int8_t* kept = out.data_ptr<int8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mha_quantize_rows", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = in + r * X;
        int8_t* dst = kept + r * (X + kScaleBytes);
        float amax = 0.0f;
        bool finite = true;
        for (int64_t d = 0; d < X; ++d) {
          const float v = static_cast<float>(row[d]);
          finite = finite && std::isfinite(v);
          amax = std::max(amax, std::fabs(v));
        }
        const float scale = finite ? amax / kLevels : std::numeric_limits<float>::quiet_NaN();
        for (int64_t d = 0; d < X; ++d) {
          const float q = scale > 0.0f ? std::nearbyint(static_cast<float>(row[d]) / scale) : 0.0f;
          dst[d] = static_cast<int8_t>(std::min(kLevels, std::max(-kLevels, q)));
        }
        std::memcpy(dst + X, &scale, kScaleBytes);
      }
    });
  });
  return out;
}

// The forward's work plan (plan_work) for blocks (N, 4) int64 rows (r0, r1, k0, k1), for ``threads``
// threads (tests): (M, 5) int64 rows (block, k0, k1, group, split), in the plan's order.
Tensor work_plan(const Tensor& blocks, int64_t threads) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) == 4 && blocks.scalar_type() == at::kLong && blocks.device().is_cpu(),
              "mha work_plan: blocks must be an (N, 4) int64 CPU tensor of (r0, r1, k0, k1) rows");
  TORCH_CHECK(threads >= 1, "mha work_plan: threads must be at least 1, got ", text(threads));
  const Tensor rows = blocks.contiguous();
  const int64_t* x = rows.data_ptr<int64_t>();
  std::vector<WorkItem> items;
  for (int64_t i = 0; i < rows.size(0); ++i, x += 4)
    items.push_back({i, 0, x[0], x[1], x[2], x[3], -1, 0, work_cost(x[1] - x[0], x[3] - x[2])});
  const WorkPlan plan = plan_work(items, threads);
  Tensor out = at::empty({static_cast<int64_t>(plan.items.size()), 5}, at::kLong);
  int64_t* y = out.data_ptr<int64_t>();
  for (const WorkItem& item : plan.items) {
    for (const int64_t value : {item.b, item.k0, item.k1, item.group, item.split}) *y++ = value;
  }
  return out;
}

// split_shares for these costs (float64, (N,)) and ``threads`` threads (tests): (bounds, order).
std::vector<Tensor> work_shares(const Tensor& cost, int64_t threads) {
  TORCH_CHECK(cost.dim() == 1 && cost.scalar_type() == at::kDouble && cost.device().is_cpu(),
              "mha work_shares: cost must be an (N,) float64 CPU tensor");
  TORCH_CHECK(threads >= 1, "mha work_shares: threads must be at least 1, got ", text(threads));
  const Tensor costs = cost.contiguous();
  const Shares shares = split_shares(std::vector<double>(costs.data_ptr<double>(), costs.data_ptr<double>() + costs.numel()),
                                     threads);
  const auto tensor = [](const std::vector<int64_t>& x) {
    Tensor out = at::empty({static_cast<int64_t>(x.size())}, at::kLong);
    std::copy(x.begin(), x.end(), out.data_ptr<int64_t>());
    return out;
  };
  return {tensor(shares.bounds), tensor(shares.order)};
}

// Whether bfloat16 products run on AMX tiles here (the CPU has them, the OS grants them, set_amx allows).
bool amx_active() {
#if defined(MHA_AMX)
  return amx_usable();
#else
  return false;
#endif
}

// How many keys one lazy-shift decision of a bfloat16 forward of head dims D, Dv covers here: a fused
// step's kFusedKeys, an AMX tile's kBlockK (amx_fused_run), or 0 where neither runs (the rule alone; tests).
int64_t lazy_keys(int64_t D, int64_t Dv) {
#if defined(MHA_AMX)
  if (amx_usable() && amx_fits(D, Dv)) return kBlockK;
#endif
#if defined(MHA_AVX512_BF16)
  if (fused_steps_take(Dv)) return kFusedKeys;
#endif
  (void)D, (void)Dv;
  return 0;
}

// Whether the tile products take a call of these head dims where AMX is present (its rule alone, any CPU).
bool amx_takes(int64_t D, int64_t Dv) {
#if defined(MHA_AMX)
  return amx_fits(D, Dv);
#else
  (void)D, (void)Dv;
  return false;
#endif
}

// The keys this thread scored, and the keys whose values it added, on the tiles' decoding path since it
// was last asked (tests: 1 thread).
std::pair<int64_t, int64_t> take_tile_step_keys() {
#if defined(MHA_AMX)
  return {std::exchange(tile_step_keys, 0), std::exchange(tile_step_values, 0)};
#else
  return {0, 0};
#endif
}

// Allow (or forbid) AMX tiles for the bfloat16 products; returns what was set before (tests, A/B runs).
bool set_amx(bool wanted) {
#if defined(MHA_AMX)
  return amx_wanted.exchange(wanted);
#else
  (void)wanted;
  return false;
#endif
}

// Set how a decoding step reads a 16-bit cache (StepReading: "tiles", "strips" or "rows"; "" leaves it);
// returns the reading before (tests, scripts/decode_reading.py).
std::string set_step_reading(const std::string& name) {
  static const char* const names[] = {"tiles", "strips", "rows"};
  const int before = step_reading_choice().load();
  if (!name.empty()) {
    const auto found = std::find(std::begin(names), std::end(names), name);
    if (found == std::end(names))
      throw pybind11::value_error("set_step_reading: reading must be 'tiles', 'strips' or 'rows', got '" + name + "'");
    step_reading_choice().store(static_cast<int>(found - std::begin(names)));
  }
  return names[before];
}

std::string build_info() {
#if defined(MHA_AVX512_BF16)
  return "avx512bf16";
#elif defined(MHA_AVX512)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace mha_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<mha_native::TermArgs>(m, "Terms", "the contract as the kernel takes it (mha.kernels.native._terms)")
      .def(pybind11::init<>())
      .def_readwrite("scale", &mha_native::TermArgs::scale)
      .def_readwrite("softcap", &mha_native::TermArgs::softcap)
      .def_readwrite("has_band", &mha_native::TermArgs::has_band)
      .def_readwrite("left", &mha_native::TermArgs::left)
      .def_readwrite("right", &mha_native::TermArgs::right)
      .def_readwrite("offset", &mha_native::TermArgs::offset)
      .def_readwrite("q_pos", &mha_native::TermArgs::q_pos)
      .def_readwrite("k_pos", &mha_native::TermArgs::k_pos)
      .def_readwrite("key_valid", &mha_native::TermArgs::key_valid)
      .def_readwrite("mask", &mha_native::TermArgs::mask)
      .def_readwrite("slopes", &mha_native::TermArgs::slopes)
      .def_readwrite("sinks", &mha_native::TermArgs::sinks);
  m.def("forward", &mha_native::forward, "attention forward: (out, row max, row sum)");
  m.def("forward_weights", &mha_native::forward_weights, "attention and its weights: (out, weights (B, H, L, S))");
  m.def("backward", &mha_native::backward, "attention backward: (dq, dk, dv, d_slopes)");
  m.def("paged_forward", &mha_native::paged_forward,
        "attention of packed query rows over KV-cache pages read in place: (out (Tq, H, Dv), row max, row sum (Tq, H))");
  m.def("weights_tiled", &mha_native::weights_tiled,
        "whether forward_weights runs brgemm for rows x keys per key/value head (else its run loops; tests)");
  m.def("key_intervals", &mha_native::key_intervals, "each query's key interval [first, stop) and (L, S) visibility under a band (tests)");
  m.def("work_plan", &mha_native::work_plan,
        "the forward's work items for (r0, r1, k0, k1) blocks on so many threads: (block, k0, k1, group, split) rows (tests)");
  m.def("work_shares", &mha_native::work_shares,
        "how tasks of these costs are split among so many threads: (share bounds, each share's order) (tests)");
  m.def("quantize_rows", &mha_native::quantize_rows, "x (..., X) floating -> (..., X + 4) int8 rows, each then its float32 scale");
  m.def("build_info", &mha_native::build_info, "the instruction set this build was compiled for");
  m.attr("PROMPT_ROWS") = mha_native::kPromptRows;  // dispatch.NATIVE_PROMPT_ROWS's C++ twin (a test holds them equal)
  m.def("folded_exponent", &mha_native::folded_exponent,
        "whether bfloat16 weights of a row of this max take their exponent in one FMA (the rule alone, any build; tests)");
  m.def("amx_active", &mha_native::amx_active, "whether bfloat16 products run on AMX tiles on this CPU");
  m.def("lazy_keys", &mha_native::lazy_keys,
        "the keys one lazy-shift decision of a bfloat16 forward of head dims D, Dv covers here: 64, 256 (AMX), 0 (tests)");
  m.def("amx_takes", &mha_native::amx_takes, "whether the AMX tile products take head dims (D, Dv) (the rule alone; tests)");
  m.def("take_tile_step_keys", &mha_native::take_tile_step_keys,
        "(keys scored, keys whose values were added) on the AMX tiles' decoding path by this thread since last asked (tests)");
  m.def("set_step_reading", &mha_native::set_step_reading,
        "how a decoding step reads a 16-bit cache: 'tiles', 'strips' or 'rows' ('' leaves it); returns the reading before",
        pybind11::arg("reading") = std::string());
  m.def("set_amx", &mha_native::set_amx, "allow or forbid AMX tiles for bfloat16 products; returns the previous setting (tests)");
  m.attr("plain_sdpa") = pybind11::reinterpret_steal<pybind11::object>(PyCFunction_New(&mha_native::plain_sdpa_method, nullptr));
  m.def("plain_weights", &mha_native::plain_weights,
        "a plain call's (output, weights) from native, or None (mha.kernels.dispatch.plain_weights)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("is_causal"), pybind11::arg("enable_gqa"),
        pybind11::arg("scale"), pybind11::arg("key_valid") = pybind11::none());
  m.def("plain_pages", &mha_native::plain_pages,
        "a batch's step over 8-bit rows kept with their scales, each sequence one page: (B, H, L, Dv), or None "
        "(mha.kernels.dispatch.plain_pages)");
  m.def("fma_peak_work", &mha_native::fma_peak_work, "floating-point operations of independent FMA chains on every thread (timed by the caller)");
  m.def("bf16_dot_peak_work", &mha_native::bf16_dot_peak_work, "the same with bfloat16 dot products (-1 without them)");
  m.def("amx_tile_peak_work", &mha_native::amx_tile_peak_work, "the same with AMX tile products (-1 without them)");
}
