// Paged attention for the CPU engine: decode and short extend rows read K/V where they lie.
//
// torch_native gathers each request's whole context through the page table (or pads a
// strided view to the longest row) before one SDPA call per step; this kernel reads every
// key and value row in place, through the page table or the contiguous row stride, once per
// GQA group (all query heads of a KV head and all query tokens of a request share each load),
// and runs the (request, KV head) items of a step in parallel on torch's own OpenMP team.
// Scores use a two-pass softmax in fp32 (exp of the score minus the row's max, divided by the
// sum), as SDPA's math; an int8 cache carries one fp32 scale per (slot, KV head). A
// sliding-window layer (`window` > 0) reads only each query's window: keys
// `pos - window < t <= pos`, transformers' meaning; the rows before it are never loaded.
// Attention sinks (GPT-OSS: one learned logit per query head) join each softmax's
// denominator as a column no value stands behind.
//
// Registered as torch.ops.astrai_cpu.paged_attention; astrai/extension/cpu_kernels.py builds
// and loads it (`make setup`), and astrai/extension/backend/cpu_paged.py calls it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

// Dot products as four independent 8-lane accumulators: one accumulator would be one chain of
// dependent FMAs (latency-bound at about a third of the core's FMA rate); GCC's vector
// extensions compile to AVX2 under -march=native and to SSE pairs elsewhere.
typedef float v8f __attribute__((vector_size(32)));
typedef int8_t v8i8 __attribute__((vector_size(8)));

inline v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// int8 -> fp32: GCC turns the generic conversion into 8 scalar conversions, so AVX2 gets
// its sign-extend and convert instructions (4x faster int8 decode attention than without).
inline v8f load8(const int8_t* p) {
#ifdef __AVX2__
  return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#else
  v8i8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return __builtin_convertvector(v, v8f);
#endif
}

inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

template <typename KV>
inline float dot(const float* a, const KV* b, int64_t n) {
  int64_t d = 0;
  float tail = 0.f;
  if (n >= 32) {
    v8f s0 = {}, s1 = {}, s2 = {}, s3 = {};
    for (; d + 32 <= n; d += 32) {
      s0 += load8(a + d) * load8(b + d);
      s1 += load8(a + d + 8) * load8(b + d + 8);
      s2 += load8(a + d + 16) * load8(b + d + 16);
      s3 += load8(a + d + 24) * load8(b + d + 24);
    }
    tail = hsum((s0 + s1) + (s2 + s3));
  }
  for (; d < n; ++d) tail += a[d] * static_cast<float>(b[d]);
  return tail;
}

struct Layout {
  int64_t n_heads, n_kv_heads, group, head_dim;
  int64_t slot_stride;  // elements between consecutive slots of a K/V buffer
  int64_t head_stride;  // elements between KV heads of one slot (head-major storage: large)
  int64_t row_stride;   // > 0: request row r owns slots r * row_stride + position
  const int32_t* table;  // else: req_to_token, `table_cols` entries per row
  int64_t table_cols;
  float scale;
  int64_t window;  // > 0: a query at position p sees keys p - window < t <= p; 0: all t <= p
  const float* sinks;  // [n_heads] sink logits, or nullptr
};

// The first key a query at position `pos` sees.
inline int64_t first_key(const Layout& lay, int64_t pos) {
  return lay.window > 0 ? std::max<int64_t>(0, pos - lay.window + 1) : 0;
}

inline int64_t slot_of(const Layout& lay, int64_t row, int64_t pos) {
  return lay.row_stride > 0 ? row * lay.row_stride + pos : lay.table[row * lay.table_cols + pos];
}

// out = sum over lo <= t < seen of p[t - lo] * V[t] (an int8 row times its scale), `NC`
// 8-lane chunks of the head held in registers for the whole sum.
template <typename KV, int NC>
void weighted_sum(const Layout& lay, const float* p, int64_t lo, int64_t seen, int64_t row,
                  int64_t kv_head, const KV* v_buf, const float* v_scale, float* out) {
  v8f acc[NC] = {};
  for (int64_t t = lo; t < seen; ++t) {
    const int64_t slot = slot_of(lay, row, t);
    const KV* vp = v_buf + slot * lay.slot_stride + kv_head * lay.head_stride;
    float w = p[t - lo];
    if constexpr (std::is_same_v<KV, int8_t>) w *= v_scale[slot * lay.n_kv_heads + kv_head];
    for (int c = 0; c < NC; ++c) acc[c] += w * load8(vp + 8 * c);
  }
  __builtin_memcpy(out, acc, sizeof(acc));
}

// The same for any head_dim, through a scratch row.
template <typename KV>
void weighted_sum_any(const Layout& lay, const float* p, int64_t lo, int64_t seen, int64_t row,
                      int64_t kv_head, const KV* v_buf, const float* v_scale, float* scratch,
                      float* out) {
  const int64_t D = lay.head_dim;
  std::fill(scratch, scratch + D, 0.f);
  for (int64_t t = lo; t < seen; ++t) {
    const int64_t slot = slot_of(lay, row, t);
    const KV* vp = v_buf + slot * lay.slot_stride + kv_head * lay.head_stride;
    float w = p[t - lo];
    if constexpr (std::is_same_v<KV, int8_t>) w *= v_scale[slot * lay.n_kv_heads + kv_head];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) scratch[d] += w * static_cast<float>(vp[d]);
  }
  std::copy(scratch, scratch + D, out);
}

// One (request, KV head) item: `q_len` query tokens x `group` heads over `kv_len` keys.
template <typename KV>
void attend_item(const Layout& lay, const float* q, const KV* k_buf, const KV* v_buf,
                 const float* k_scale, const float* v_scale, float* out, int64_t row,
                 int64_t q_start, int64_t q_len, int64_t kv_len, int64_t kv_head,
                 std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t D = lay.head_dim, G = lay.group, H = lay.n_heads;
  const int64_t n_rows = q_len * G;  // query rows of this item: token-major, head-minor
  const int64_t first_pos = kv_len - q_len;  // query j sits at first_pos + j
  const int64_t base = first_key(lay, first_pos);  // no query of the item sees a key before it
  const int64_t cols = kv_len - base;              // score columns: keys base .. kv_len - 1
  scores.assign(n_rows * cols, 0.f);
  acc.resize(D);
  // Pass 1: scores, each key row read once for every query row of the item that sees it.
  for (int64_t t = base; t < kv_len; ++t) {
    const int64_t slot = slot_of(lay, row, t);
    const KV* kp = k_buf + slot * lay.slot_stride + kv_head * lay.head_stride;
    float ks = lay.scale;
    if constexpr (std::is_same_v<KV, int8_t>) ks *= k_scale[slot * lay.n_kv_heads + kv_head];
    const int64_t j0 = std::max<int64_t>(0, t - first_pos);  // queries that see key t
    // ... up to the last query whose window still holds it
    const int64_t j1 = lay.window > 0 ? std::min<int64_t>(q_len, t - first_pos + lay.window) : q_len;
    for (int64_t j = j0; j < j1; ++j) {
      const float* qrow = q + (q_start + j) * H * D + kv_head * G * D;
      float* srow = scores.data() + (j * G) * cols + (t - base);
      for (int64_t g = 0; g < G; ++g) {
        srow[g * cols] = dot<KV>(qrow + g * D, kp, D) * ks;
      }
    }
  }
  // Pass 2: softmax per query row over the keys it sees (columns lo - base .. seen - base).
  for (int64_t j = 0; j < q_len; ++j) {
    const int64_t lo = first_key(lay, first_pos + j) - base, seen = first_pos + j + 1 - base;
    for (int64_t g = 0; g < G; ++g) {
      float* srow = scores.data() + (j * G + g) * cols;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t t = lo; t < seen; ++t) mx = std::max(mx, srow[t]);
      const float sink = lay.sinks ? lay.sinks[kv_head * G + g] : 0.f;
      if (lay.sinks) mx = std::max(mx, sink);
      // vectorised through glibc's libmvec (-fno-math-errno, omp simd): expf 8 lanes at a time
#pragma omp simd
      for (int64_t t = lo; t < seen; ++t) srow[t] = std::exp(srow[t] - mx);
      float sum = lay.sinks ? std::exp(sink - mx) : 0.f;
      for (int64_t t = lo; t < seen; ++t) sum += srow[t];
      const float inv = 1.f / sum;
      for (int64_t t = lo; t < seen; ++t) srow[t] *= inv;
    }
  }
  // Pass 3: per query row, the weighted sum of the values it sees, accumulated in registers
  // (a head_dim of 64 or 128 fits; the value rows stay in cache across the group's rows).
  for (int64_t j = 0; j < q_len; ++j) {
    const int64_t lo = first_key(lay, first_pos + j), seen = first_pos + j + 1;
    for (int64_t g = 0; g < G; ++g) {
      const float* prow = scores.data() + (j * G + g) * cols + (lo - base);
      float* orow = out + (q_start + j) * H * D + (kv_head * G + g) * D;
      if (D == 64) weighted_sum<KV, 8>(lay, prow, lo, seen, row, kv_head, v_buf, v_scale, orow);
      else if (D == 128)
        weighted_sum<KV, 16>(lay, prow, lo, seen, row, kv_head, v_buf, v_scale, orow);
      else
        weighted_sum_any<KV>(lay, prow, lo, seen, row, kv_head, v_buf, v_scale, acc.data(), orow);
    }
  }
}

template <typename KV>
void run(const Layout& lay, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
         const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& rows,
         const at::Tensor& q_starts, const at::Tensor& q_lens, const at::Tensor& kv_lens,
         at::Tensor& out) {
  const int64_t B = rows.size(0), Hkv = lay.n_kv_heads;
  const int64_t* row_p = rows.data_ptr<int64_t>();
  const int64_t* qs_p = q_starts.data_ptr<int64_t>();
  const int64_t* ql_p = q_lens.data_ptr<int64_t>();
  const int64_t* kl_p = kv_lens.data_ptr<int64_t>();
  const float* q_p = q.data_ptr<float>();
  const KV* k_p = k_buf.data_ptr<KV>();
  const KV* v_p = v_buf.data_ptr<KV>();
  const float* ks_p = k_scale.defined() && k_scale.numel() ? k_scale.data_ptr<float>() : nullptr;
  const float* vs_p = v_scale.defined() && v_scale.numel() ? v_scale.data_ptr<float>() : nullptr;
  float* o_p = out.data_ptr<float>();
  // grain 1: items are few (batch x KV heads) and uneven (context lengths differ)
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv;
      if (ql_p[b] == 0) continue;
      attend_item<KV>(lay, q_p, k_p, v_p, ks_p, vs_p, o_p, row_p[b], qs_p[b], ql_p[b], kl_p[b], h,
                      scores, acc);
    }
  });
}

// q [T, H, D] fp32; k_buf/v_buf [S, Hkv, D] fp32 or int8 (one layer, token- or head-major); k_scale/v_scale [S, Hkv]
// fp32 for an int8 cache (empty otherwise); req_to_token [R, M] int32 (unused when
// row_stride > 0); rows/q_starts/q_lens/kv_lens [B] int64; window > 0 for a sliding-window
// layer (0: full causal); sinks [H] fp32 sink logits (empty: none). Returns out [T, H, D] fp32;
// rows of q no request covers are left zero.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                           const at::Tensor& k_scale, const at::Tensor& v_scale,
                           const at::Tensor& req_to_token, int64_t row_stride,
                           const at::Tensor& rows, const at::Tensor& q_starts,
                           const at::Tensor& q_lens, const at::Tensor& kv_lens, double scale,
                           int64_t window, const at::Tensor& sinks) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 &&
                  q.is_contiguous(),
              "paged_attention: q must be a contiguous fp32 CPU tensor [tokens, heads, head_dim]");
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.sizes() == v_buf.sizes() &&
                  k_buf.strides() == v_buf.strides() && k_buf.stride(2) == 1 &&
                  k_buf.scalar_type() == v_buf.scalar_type(),
              "paged_attention: k_buf/v_buf must be [slots, kv_heads, head_dim] with equal "
              "strides and a dense last dimension");
  for (const at::Tensor* t : {&rows, &q_starts, &q_lens, &kv_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1 &&
                    t->size(0) == rows.size(0),
                "paged_attention: rows, q_starts, q_lens and kv_lens must be int64 [batch]");
  }
  TORCH_CHECK(window >= 0, "paged_attention: window must be >= 0 (0: no sliding window)");
  Layout lay{q.size(1),       k_buf.size(1),   q.size(1) / k_buf.size(1),  q.size(2),
             k_buf.stride(0), k_buf.stride(1), row_stride,                 nullptr,
             0,               static_cast<float>(scale), window,
             nullptr};
  if (sinks.defined() && sinks.numel() > 0) {
    TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.is_contiguous() &&
                    sinks.numel() == lay.n_heads,
                "paged_attention: sinks must be a contiguous fp32 [heads] tensor (or empty)");
    lay.sinks = sinks.data_ptr<float>();
  }
  TORCH_CHECK(lay.n_heads % lay.n_kv_heads == 0 && k_buf.size(2) == lay.head_dim,
              "paged_attention: query heads/head_dim do not fit the cache");
  if (row_stride <= 0) {
    TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.dim() == 2 &&
                    req_to_token.is_contiguous(),
                "paged_attention: req_to_token must be contiguous int32 [rows, max_len]");
    lay.table = req_to_token.data_ptr<int32_t>();
    lay.table_cols = req_to_token.size(1);
  }
  at::Tensor out = at::zeros_like(q);
  if (k_buf.scalar_type() == at::kFloat) {
    run<float>(lay, q, k_buf, v_buf, k_scale, v_scale, rows, q_starts, q_lens, kv_lens, out);
  } else {
    TORCH_CHECK(k_buf.scalar_type() == at::kChar && k_scale.numel() == k_buf.size(0) * lay.n_kv_heads &&
                    k_scale.is_contiguous() && v_scale.is_contiguous() &&
                    v_scale.numel() == v_buf.size(0) * lay.n_kv_heads &&
                    k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat,
                "paged_attention: the cache must be fp32, or int8 with fp32 scales [slots, kv_heads]");
    run<int8_t>(lay, q, k_buf, v_buf, k_scale, v_scale, rows, q_starts, q_lens, kv_lens, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(astrai_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor k_scale, Tensor v_scale, "
      "Tensor req_to_token, int row_stride, Tensor rows, Tensor q_starts, Tensor q_lens, "
      "Tensor kv_lens, float scale, int window, Tensor sinks) -> Tensor");
}

TORCH_LIBRARY_IMPL(astrai_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
