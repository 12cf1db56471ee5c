#pragma once
// Batched prefill: the llama forward pass over T prompt tokens of ONE sequence in one pass
// per layer, instead of T engine steps.
//
// Per layer the projections run over the T tokens at once. When the model decodes on
// quantized weights (Model::quantized(), the default for GGUF files) they are quant_matmul
// calls: each token's activation is quantized to 8-bit blocks exactly as a decode step
// does and multiplied with the same row dots (quant_matvec.hpp), one pass over the
// weights per block of tokens, so the prompt's K/V are what token-by-token decode (and
// llama.cpp, which also runs prompts on quantized activations) computes, and no float copy
// of the weights is needed. Otherwise they are Eigen float GEMMs (columns split over the
// engine's threads). The T new K/V rows go into the sequence's pages
// with one kvkit::write_kv, and attention is causal through kvkit's paged decode kernel:
// one view whose batch rows are the T query tokens of the same sequence, row i listing the
// sequence's pages up to cached token start+i (rows share pages; the kernel only reads).
// Long prompts run in chunks of `chunk` tokens, each chunk attending to the cache the
// earlier chunks wrote. RMSNorm, RoPE and SwiGLU are Model's formulas, so the result equals
// token-by-token teacher forcing up to float rounding (the attention's summation order;
// on the float path also GEMM vs matrix-vector order).
//
// Engine::prefill(id) runs it over a sequence's pending prompt (all but its last token,
// which the next step() processes to give logits and the first generated token).

// First: quant_matvec.hpp includes <immintrin.h> before Eigen (see model.hpp).
#include "engine/quant_matvec.hpp"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "engine/model.hpp"
#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/kernels/cpu.hpp"
#include "kvkit/kernels/cpu/parallel.hpp"

namespace kvkit {
namespace engine {

/// Scratch of batched prefill, reusable across calls (grows to the largest chunk).
class Prefiller {
 public:
  /// Tokens per pass; longer inputs run in several chunks (bounds the scratch memory and
  /// the page-table size of the attention view).
  static constexpr std::int32_t kDefaultChunk = 512;

  explicit Prefiller(std::int32_t chunk = kDefaultChunk) : chunk_(chunk) {
    KVKIT_CHECK(chunk > 0, "kvkit: prefill chunk must be > 0, got ", chunk);
  }

  /// Attention of the batched pass: tiled (default; a block of query tokens shares each
  /// K/V tile it reads, flash-attention style) or kvkit's paged decode kernel with one
  /// view row per query token (reads the K/V once per query token: O(T^2) traffic).
  void set_tiled_attention(bool on) { tiled_ = on; }

  /// Projections on the model's quantized weights when it has them (default; see the file
  /// comment), or always on the float weights (false).
  void set_quantized(bool on) { quantized_ = on; }

  /// Runs tokens[0, n) of one sequence through `model`: token i at RoPE position
  /// pos_start + i, its K/V written at cache index cache_start + i of `pages` (the
  /// sequence's page list, which must cover cache_start + n tokens, exclusively owned
  /// from cache index cache_start on), attending to cache indices [0, cache_start + i].
  /// `pools` holds one view per layer over that layer's K/V pools (their page tables are
  /// ignored: only storage, geometry and strides are used). Writes the last token's logits
  /// to `last_logits` [vocab] when not null. T is the pages' element type (float, half_t,
  /// bfloat16_t), as in Model::forward. Returns the first failing kernel's Status;
  /// throws kvkit::Error on bad arguments.
  template <class T>
  Status run(Model& model, const PagedKVView<T>* pools /* [n_layers] */,
             const std::vector<std::int32_t>& pages, const std::int32_t* tokens /* [n] */,
             std::int32_t n, std::int32_t cache_start, std::int32_t pos_start,
             float* last_logits /* [vocab] or null */);

 private:
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using W = Eigen::Map<const RowMat>;
  using M = Eigen::Map<Eigen::MatrixXf>;

  // y = w * x over the columns (tokens), split over the engine's threads.
  static void gemm(exec::Host ex, const W& w, const M& x, M& y) {
    kvkit::detail::parallel_for(ex, x.cols(), [&](std::int64_t b, std::int64_t e, int) {
      y.middleCols(b, e - b).noalias() = w * x.middleCols(b, e - b);
    });
  }


  // Quantizes the n columns of x [n, width] (token-major) into Q8 blocks, as Model's
  // decode step quantizes each token's activation; acts_[i] describes token i.
  void quantize_columns(const float* x /* [n, width] */, int width, std::int32_t n) {
    const std::size_t nb = static_cast<std::size_t>(width / 32), N = static_cast<std::size_t>(n);
    if (qa_.size() < N * nb) qa_.resize(N * nb);
    acts_.resize(N);
    for (std::size_t i = 0; i < N; ++i) {
      quantize_activation(x + i * width, width, qa_.data() + i * nb);
      acts_[i] = QActivation{x + i * width, qa_.data() + i * nb, width};
    }
  }

  template <class T>
  Status run_chunk(Model& model, const PagedKVView<T>* pools, const std::vector<std::int32_t>& pages,
                   const std::int32_t* tokens, std::int32_t n, std::int32_t cache_start,
                   std::int32_t pos_start, float* last_logits) {
    const ModelConfig& c = model.config();
    const Checkpoint& ck = model.checkpoint();
    const exec::Host ex = model.exec();
    const DecodeAttentionParams ap = model.attention_params();
    const int dim = c.dim, kv = c.kv_dim(), hid = c.hidden_dim;
    const std::int32_t ps = pools[0].page_size;
    const QuantWeights* qw = quantized_ ? model.quant_weights() : nullptr;
    KVKIT_CHECK(qw != nullptr || ck.has_float_projections(), "kvkit: prefill on float weights, but checkpoint ",
                ck.source(), " has only quantized projections");
    const std::size_t N = static_cast<std::size_t>(n);
    x_.resize(N * dim);
    xb_.resize(N * dim);
    att_.resize(N * dim);
    q_.resize(N * dim);
    k_.resize(N * kv);
    v_.resize(N * kv);
    h1_.resize(N * hid);
    h3_.resize(N * hid);
    M x(x_.data(), dim, n), xb(xb_.data(), dim, n), att(att_.data(), dim, n), q(q_.data(), dim, n);
    M k(k_.data(), kv, n), v(v_.data(), kv, n), h1(h1_.data(), hid, n), h3(h3_.data(), hid, n);

    // Slots of the new tokens and the causal page table: row i sees cache_start + i + 1 tokens.
    slots_.resize(N);
    indptr_.assign(1, 0);
    indices_.clear();
    last_len_.clear();
    for (std::int32_t i = 0; i < n; ++i) {
      const std::int64_t idx = static_cast<std::int64_t>(cache_start) + i;
      slots_[static_cast<std::size_t>(i)] =
          static_cast<std::int64_t>(pages[static_cast<std::size_t>(idx / ps)]) * ps + idx % ps;
      const std::int64_t len = idx + 1, np = (len + ps - 1) / ps;
      indices_.insert(indices_.end(), pages.begin(), pages.begin() + np);
      indptr_.push_back(static_cast<std::int32_t>(indices_.size()));
      last_len_.push_back(static_cast<std::int32_t>(len - (np - 1) * ps));
    }

    for (std::int32_t i = 0; i < n; ++i)
      x.col(i) = Eigen::Map<const Eigen::VectorXf>(
          ck.token_embedding() + static_cast<std::size_t>(tokens[i]) * dim, dim);
    for (int l = 0; l < c.n_layers; ++l) {
      PagedKVView<T> view = pools[l];  // the layer's storage, this chunk's causal table
      view.table_kind = PageTableKind::kCsr;
      view.batch_size = n;
      view.indptr = indptr_.data();
      view.indices = indices_.data();
      view.last_page_len = last_len_.data();
      view.block_table = nullptr;
      view.row_stride = 0;
      view.seq_lens = nullptr;
      const QuantLayer* ql = qw ? &qw->layers[static_cast<std::size_t>(l)] : nullptr;
      model.rmsnorm(x, ck.rms_att(l), xb);
      if (ql) {
        quantize_columns(xb_.data(), dim, n);
        const QMatvecOut o[3] = {{&ql->wq, q_.data()}, {&ql->wk, k_.data()}, {&ql->wv, v_.data()}};
        quant_matmul(ex, o, 3, acts_.data(), n);
      } else {
        gemm(ex, W(ck.wq(l), dim, dim), xb, q);
        gemm(ex, W(ck.wk(l), kv, dim), xb, k);
        gemm(ex, W(ck.wv(l), kv, dim), xb, v);
      }
      for (std::int32_t i = 0; i < n; ++i) {
        model.rope(q.col(i).data(), c.n_heads, pos_start + i);
        model.rope(k.col(i).data(), c.n_kv_heads, pos_start + i);
      }
      KVKIT_RETURN_IF_ERROR(write_kv(ex, view, k_.data(), v_.data(), slots_.data(), n,
                                     static_cast<std::int64_t>(kv)));
      if (tiled_) {
        tiled_attention(ex, view, n, cache_start, ap.sm_scale, c.n_heads);
      } else {
        const std::size_t need = paged_decode_attention_workspace_size(ex, view, ap);
        if (ws_.size() < need) ws_.resize(need);
        KVKIT_RETURN_IF_ERROR(decode_attention(ex, view, q_.data(), att_.data(), static_cast<std::int64_t>(N) * dim,
                                               ap, Workspace{ws_.data(), ws_.size()}, q16_));
      }
      if (ql) {
        quantize_columns(att_.data(), dim, n);
        const QMatvecOut o{&ql->wo, xb_.data()};
        quant_matmul(ex, &o, 1, acts_.data(), n);
      } else {
        gemm(ex, W(ck.wo(l), dim, dim), att, xb);
      }
      x += xb;
      model.rmsnorm(x, ck.rms_ffn(l), xb);
      if (ql) {
        quantize_columns(xb_.data(), dim, n);
        const QMatvecOut o[2] = {{&ql->w1, h1_.data()}, {&ql->w3, h3_.data()}};
        quant_matmul(ex, o, 2, acts_.data(), n);
      } else {
        gemm(ex, W(ck.w1(l), hid, dim), xb, h1);
        gemm(ex, W(ck.w3(l), hid, dim), xb, h3);
      }
      h1 = h1.array() / (1.f + (-h1.array()).exp()) * h3.array();  // silu(w1 x) * (w3 x)
      if (ql) {
        quantize_columns(h1_.data(), hid, n);
        const QMatvecOut o{&ql->w2, xb_.data()};
        quant_matmul(ex, &o, 1, acts_.data(), n);
      } else {
        gemm(ex, W(ck.w2(l), dim, hid), h1, xb);
      }
      x += xb;
    }
    if (last_logits != nullptr) {
      M xl(x_.data() + (N - 1) * dim, dim, 1), yl(xb_.data(), dim, 1);
      model.rmsnorm(xl, ck.rms_final(), yl);
      if (qw) {
        quantize_columns(xb_.data(), dim, 1);
        quant_matvec(ex, qw->classifier, acts_[0], last_logits);
      } else {
        Eigen::Map<Eigen::VectorXf> out(last_logits, c.vocab_size);
        out.noalias() = W(ck.classifier(), c.vocab_size, dim) * yl.col(0);
      }
    }
    return Status::ok();
  }

  // A row as decode_attention sees it with pages of type T: 16-bit pages round the queries
  // and the attention output to T (model.hpp), so prefill does too; float rows unchanged.
  // Returns an expression (no temporary row): float rows pass through untouched.
  template <class T, class Row>
  static auto as_stored(const Row& x) {
    if constexpr (std::is_same<T, float>::value) {
      return x;
    } else {
      return x.unaryExpr([](float e) { return to_float(from_float<T>(e)); });
    }
  }

  // Row `dst` = the D elements at `src` as floats (16-bit pages widen exactly).
  template <class T, class Row>
  static void load_row(const T* src /* [D] */, int D, Row&& dst) {
    if constexpr (std::is_same<T, float>::value) {
      dst = Eigen::Map<const Eigen::RowVectorXf>(src, D);
    } else {
      for (int d = 0; d < D; ++d) dst(d) = to_float(src[d]);
    }
  }

  // Per-worker scratch of the tiled attention.
  struct TileScratch {
    Eigen::MatrixXf q, k, v, s, o;  // [rows, D], [KT, D], [KT, D], [rows, KT], [rows, D]
    Eigen::VectorXf m, l;           // [rows] running max and sum
  };

  static constexpr std::int32_t kQueryBlock = 32;  // query tokens sharing each K/V tile
  static constexpr std::int32_t kKeyTile = 128;    // keys per tile

  // Causal attention of the chunk's n query tokens (q_ -> att_) over the cache indices
  // [0, cache_start + i] of each query token i, reading K/V through `view` (row i of its
  // page table lists the pages of query token i, row n-1 all of them). Work items are
  // (kv head, block of kQueryBlock query tokens); each gathers K/V tiles of kKeyTile
  // tokens once for the G * block query rows of its head group, with an online softmax.
  template <class T>
  void tiled_attention(exec::Host ex, const PagedKVView<T>& view, std::int32_t n,
                       std::int32_t cache_start, float sm_scale, int n_heads) {
    const int hkv = view.num_kv_heads, D = view.head_dim, G = n_heads / hkv;
    const std::int32_t blocks = (n + kQueryBlock - 1) / kQueryBlock;
    const int workers = kvkit::detail::host_workers(ex, static_cast<std::int64_t>(hkv) * blocks);
    if (static_cast<int>(tiles_.size()) < workers) tiles_.resize(static_cast<std::size_t>(workers));
    const std::size_t tok_stride = static_cast<std::size_t>(n_heads) * D;  // q_/att_ row of a token
    kvkit::detail::parallel_for(ex, static_cast<std::int64_t>(hkv) * blocks, [&](std::int64_t b0, std::int64_t b1, int w) {
      TileScratch& t = tiles_[static_cast<std::size_t>(w)];
      for (std::int64_t item = b0; item < b1; ++item) {
        const int h = static_cast<int>(item % hkv);
        const std::int32_t i0 = static_cast<std::int32_t>(item / hkv) * kQueryBlock;
        const std::int32_t i1 = std::min(n, i0 + kQueryBlock);
        const int rows = (i1 - i0) * G;
        t.q.resize(rows, D);
        for (std::int32_t i = i0; i < i1; ++i)
          for (int g = 0; g < G; ++g)
            t.q.row((i - i0) * G + g) = as_stored<T>(Eigen::Map<const Eigen::RowVectorXf>(
                q_.data() + static_cast<std::size_t>(i) * tok_stride + static_cast<std::size_t>(h * G + g) * D, D)) * sm_scale;
        t.m.setConstant(rows, -std::numeric_limits<float>::infinity());
        t.l.setZero(rows);
        t.o.setZero(rows, D);
        const std::int32_t keys = cache_start + i1;  // the last query token sees these
        for (std::int32_t k0 = 0; k0 < keys; k0 += kKeyTile) {
          const std::int32_t cnt = std::min(kKeyTile, keys - k0);
          t.k.resize(cnt, D);
          t.v.resize(cnt, D);
          for (std::int32_t j = 0; j < cnt; ++j) {
            // Row n-1 of the view lists every page of the sequence.
            load_row(view.k_ptr(n - 1, k0 + j, h), D, t.k.row(j));
            load_row(view.v_ptr(n - 1, k0 + j, h), D, t.v.row(j));
          }
          t.s.noalias() = t.q * t.k.transpose();
          // Causal mask: query token i sees keys up to cache index cache_start + i.
          if (k0 + cnt > cache_start + i0 + 1)
            for (int r = 0; r < rows; ++r) {
              const std::int32_t last = cache_start + i0 + r / G;  // its last visible key
              for (std::int32_t j = std::max(0, last + 1 - k0); j < cnt; ++j)
                t.s(r, j) = -std::numeric_limits<float>::infinity();
            }
          for (int r = 0; r < rows; ++r) {
            const float mx = std::max(t.m(r), t.s.row(r).maxCoeff());
            if (mx == -std::numeric_limits<float>::infinity()) {  // nothing visible yet
              t.s.row(r).setZero();
              continue;
            }
            const float scale = std::exp(t.m(r) - mx);  // 0 on the first tile (m = -inf)
            t.s.row(r) = (t.s.row(r).array() - mx).exp().matrix();
            t.l(r) = t.l(r) * scale + t.s.row(r).sum();
            t.o.row(r) *= scale;
            t.m(r) = mx;
          }
          t.o.noalias() += t.s * t.v;
        }
        for (std::int32_t i = i0; i < i1; ++i)
          for (int g = 0; g < G; ++g) {
            const int r = (i - i0) * G + g;
            Eigen::Map<Eigen::RowVectorXf>(att_.data() + static_cast<std::size_t>(i) * tok_stride +
                                               static_cast<std::size_t>(h * G + g) * D, D) =
                as_stored<T>(t.o.row(r) / t.l(r));
          }
      }
    });
  }

  bool tiled_ = true;
  bool quantized_ = true;
  std::vector<Q8Act> qa_;           // [n, width / 32] quantized activations of a chunk
  std::vector<QActivation> acts_;   // [n] token i's activation (into the float scratch and qa_)
  std::vector<TileScratch> tiles_;
  std::int32_t chunk_;
  std::vector<float> x_, xb_, att_, q_, k_, v_, h1_, h3_;  // [n, width] each
  std::vector<std::int64_t> slots_;                    // [n]
  std::vector<std::int32_t> indptr_, indices_, last_len_;  // causal CSR table, [n+1], [...], [n]
  std::vector<unsigned char> ws_;                      // attention workspace
  Scratch16 q16_;                                      // 16-bit q / out of decode_attention
};

template <class T>
Status Prefiller::run(Model& model, const PagedKVView<T>* pools /* [n_layers] */,
                      const std::vector<std::int32_t>& pages, const std::int32_t* tokens /* [n] */,
                      std::int32_t n, std::int32_t cache_start, std::int32_t pos_start,
                      float* last_logits /* [vocab] or null */) {
  const ModelConfig& c = model.config();
  KVKIT_CHECK(pools != nullptr, "kvkit: prefill needs the layers' pool views");
  const std::int32_t ps = pools[0].page_size;
  for (int l = 0; l < c.n_layers; ++l)
    KVKIT_CHECK(pools[l].page_size == ps && pools[l].num_kv_heads == c.n_kv_heads &&
                    pools[l].head_dim == c.head_dim() && pools[l].v_head_dim == c.head_dim(),
                "kvkit: prefill: layer ", l, " pool view (page size ", pools[l].page_size,
                ", kv heads ", pools[l].num_kv_heads, ", head_dim ", pools[l].head_dim,
                ") does not match the model (kv heads ", c.n_kv_heads, ", head_dim ",
                c.head_dim(), ") and layer 0 (page size ", ps, ")");
  KVKIT_CHECK(n >= 0 && cache_start >= 0 && pos_start >= 0, "kvkit: prefill of ", n,
              " tokens at cache index ", cache_start, ", position ", pos_start);
  KVKIT_CHECK(static_cast<std::int64_t>(pos_start) + n <= c.seq_len, "kvkit: prefill to position ",
              static_cast<std::int64_t>(pos_start) + n, " exceeds the model's seq_len ", c.seq_len);
  KVKIT_CHECK(static_cast<std::int64_t>(pages.size()) * ps >= static_cast<std::int64_t>(cache_start) + n,
              "kvkit: prefill: ", pages.size(), " pages of ", ps, " tokens cannot hold ",
              static_cast<std::int64_t>(cache_start) + n, " tokens");
  for (std::int32_t i = 0; i < n; ++i)
    KVKIT_CHECK(tokens[i] >= 0 && tokens[i] < c.vocab_size, "kvkit: prefill token ", tokens[i],
                " outside the vocabulary [0, ", c.vocab_size, ")");
  for (std::int32_t done = 0; done < n;) {
    const std::int32_t m = std::min(chunk_, n - done);
    const bool last = done + m == n;
    KVKIT_RETURN_IF_ERROR(run_chunk(model, pools, pages, tokens + done, m, cache_start + done,
                                    pos_start + done, last ? last_logits : nullptr));
    done += m;
  }
  return Status::ok();
}

// Built once in the kvkit_example_engine library (engine_instances.cpp) rather than in
// every file that runs the engine; without KVKIT_ENGINE_PRECOMPILED (copying the headers
// alone) each user instantiates them.
#if defined(KVKIT_ENGINE_PRECOMPILED)
extern template Status Prefiller::run<float>(Model&, const PagedKVView<float>*, const std::vector<std::int32_t>&,
                                             const std::int32_t*, std::int32_t, std::int32_t, std::int32_t, float*);
extern template Status Prefiller::run<half_t>(Model&, const PagedKVView<half_t>*, const std::vector<std::int32_t>&,
                                              const std::int32_t*, std::int32_t, std::int32_t, std::int32_t, float*);
extern template Status Prefiller::run<bfloat16_t>(Model&, const PagedKVView<bfloat16_t>*, const std::vector<std::int32_t>&,
                                                  const std::int32_t*, std::int32_t, std::int32_t, std::int32_t, float*);
#endif

}  // namespace engine
}  // namespace kvkit
