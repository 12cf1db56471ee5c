#pragma once
// Model: the llama forward pass for one new token per sequence, over a batch, reading
// and writing K/V through kvkit's paged views.
//
// Per layer: RMSNorm (eps 1e-5) -> q, k, v projections -> RoPE (theta 10000, rotating
// the pairs (2i, 2i+1) inside each head, as llama2.c does) -> kvkit::write_kv stores the
// new k, v at each sequence's slot -> kvkit::paged_decode_attention (GQA, softmax scale
// 1/sqrt(head_dim)) -> output projection + residual -> RMSNorm -> SwiGLU FFN + residual.
// Finally RMSNorm and the classifier. The projections are matrix-vector products per
// sequence: on the checkpoint's quantized blocks with 8-bit activations when it has them
// (GGUF files; engine/quant_matvec.hpp, split over the threads in row chunks fixed by the
// shape, so results do not depend on the thread count), else Eigen float32 products.
//
// The caller (Engine) owns the KV memory and the page tables; the model only sees one
// PagedKVView per layer whose page table already includes the new token.

// First: simd.hpp (through quant_matvec.hpp) includes <immintrin.h> with GCC 12's false
// AVX-512 "uninitialized" warnings silenced, which only works if nobody (Eigen) included it before.
#include "engine/quant_matvec.hpp"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "engine/checkpoint.hpp"
#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/core/thread_pool.hpp"
#include "kvkit/core/workspace.hpp"
#include "kvkit/kernels/cpu.hpp"
#include "kvkit/kernels/params.hpp"

namespace kvkit {
namespace engine {

/// The new tokens of one forward step.
struct ForwardBatch {
  std::int32_t batch = 0;                   // sequences in this step (= view batch_size)
  const std::int32_t* tokens = nullptr;     // [batch] input token ids
  const std::int32_t* positions = nullptr;  // [batch] RoPE positions (tokens seen before)
  const std::int64_t* slots = nullptr;      // [batch] slot (page * page_size + offset) of the new K/V
  const std::int32_t* seq_ids = nullptr;    // [batch] caller's sequence id of each row (or null)
};

/// One layer's attention call handed to an attention hook, for pages of element type T
/// (float, half_t or bfloat16_t: EngineOptions::kv_dtype). Row b of the view, q and out is
/// the caller's sequence seq_ids[b] (never assume rows are sorted by id). The view already
/// holds this step's K/V. With 16-bit pages q holds the queries rounded to T and out is
/// widened back to float after the call, exactly as the dense path does (decode_attention
/// below), so a hook that calls paged_decode_attention on its pages reproduces it bit for
/// bit. `workspace` is caller-owned scratch of at least the hook's AttentionWorkspaceFn
/// bytes (float pages) and of what paged_decode_attention needs for this view, so a hook
/// may fall back to the dense kernel; it is valid during the call only.
template <class T>
struct AttentionCallT {
  int layer = 0;
  PagedKVView<T> view;                     // this layer's K/V, batch rows as in seq_ids
  const std::int32_t* seq_ids = nullptr;   // [batch] sequence id of each row
  const T* q = nullptr;                    // [batch, Hq, D] post-RoPE queries
  T* out = nullptr;                        // [batch, Hq, D] attention output to write
  DecodeAttentionParams params;            // query heads and softmax scale of the model
  exec::Host exec;                         // the engine's host executor settings
  Workspace workspace;                     // scratch, see above
};
/// The attention call of float32 pages (the only one most hooks need).
using AttentionCall = AttentionCallT<float>;

/// Replaces the dense paged attention of one layer (a page-subset or packed-channel
/// attention, for example). Returns a failed Status to fail the whole step: the Engine then
/// leaves every sequence exactly as it was before the step.
template <class T>
using AttentionFnT = std::function<Status(const AttentionCallT<T>& call)>;
using AttentionFn = AttentionFnT<float>;

/// Workspace bytes an AttentionFnT<T> needs for `view` (sized before the call, never inside).
template <class T>
using AttentionWorkspaceFnT = std::function<std::size_t(int layer, const PagedKVView<T>& view)>;
using AttentionWorkspaceFn = AttentionWorkspaceFnT<float>;

/// An attention replacement and its workspace requirement, one function per page type
/// (an empty one: that page type is not supported; all empty: dense attention).
struct AttentionHook {
  AttentionFn run;                      // float32 pages
  AttentionFnT<half_t> run_f16;         // float16 pages
  AttentionFnT<bfloat16_t> run_bf16;    // bfloat16 pages
  // Scratch each page type's function needs; empty: none beyond the dense kernel's.
  AttentionWorkspaceFn workspace_size;                    // float32 pages
  AttentionWorkspaceFnT<half_t> workspace_size_f16;       // float16 pages
  AttentionWorkspaceFnT<bfloat16_t> workspace_size_bf16;  // bfloat16 pages
  /// True when any page type is hooked.
  bool installed() const { return run || run_f16 || run_bf16; }
  /// The function for pages of type T.
  template <class T>
  const AttentionFnT<T>& fn() const {
    if constexpr (std::is_same<T, float>::value) return run;
    else if constexpr (std::is_same<T, half_t>::value) return run_f16;
    else return run_bf16;
  }
  /// The workspace function for pages of type T.
  template <class T>
  const AttentionWorkspaceFnT<T>& workspace_fn() const {
    if constexpr (std::is_same<T, float>::value) return workspace_size;
    else if constexpr (std::is_same<T, half_t>::value) return workspace_size_f16;
    else return workspace_size_bf16;
  }
};

/// Query / output scratch of decode_attention for 16-bit pages (grows once).
struct Scratch16 {
  std::vector<half_t> h;       // [2 * n]
  std::vector<bfloat16_t> b;   // [2 * n]
  template <class T>
  std::vector<T>& of() {
    if constexpr (std::is_same<T, half_t>::value) return h;
    else return b;
  }
};

/// Runs f(q_T, out_T) on float queries and output whatever the pages' type T: the
/// kernels take q and out in T, so 16-bit pages get the queries rounded to T (nearest
/// even, as llama.cpp rounds them for its f16 K products) and the output widened back
/// exactly. n = batch * Hq * D, the elements of q and of out.
template <class T, class F>
Status with_kv_typed_rows(const float* q /* [n] */, float* out /* [n] */, std::int64_t n, Scratch16& scratch,
                          F&& f) {
  if constexpr (std::is_same<T, float>::value) {
    (void)n;
    (void)scratch;
    return f(q, out);
  } else {
    const std::size_t N = static_cast<std::size_t>(n);
    std::vector<T>& buf = scratch.template of<T>();
    if (buf.size() < 2 * N) buf.resize(2 * N);  // grows to the largest batch once
    T* q16 = buf.data();
    T* o16 = q16 + N;
    kvkit::detail::cpu::convert(q, q16, N);
    KVKIT_RETURN_IF_ERROR(f(static_cast<const T*>(q16), o16));
    kvkit::detail::cpu::convert(static_cast<const T*>(o16), out, N);
    return Status::ok();
  }
}

/// paged_decode_attention with float queries and output (with_kv_typed_rows).
template <class T>
Status decode_attention(exec::Host ex, const PagedKVView<T>& view, const float* q /* [n] */,
                        float* out /* [n] */, std::int64_t n, const DecodeAttentionParams& ap, Workspace ws,
                        Scratch16& scratch) {
  return with_kv_typed_rows<T>(q, out, n, scratch, [&](const T* qt, T* ot) {
    return paged_decode_attention(ex, view, qt, ot, ap, ws);
  });
}

/// The hook's function for T-pages on float queries and output (with_kv_typed_rows); a
/// hook without one for T fails the step naming the dtype.
template <class T>
Status hooked_attention(const AttentionHook& hook, AttentionCallT<T> call, const float* q /* [n] */,
                        float* out /* [n] */, std::int64_t n, Scratch16& scratch) {
  const AttentionFnT<T>& fn = hook.template fn<T>();
  KVKIT_CHECK_STATUS(static_cast<bool>(fn), StatusCode::kInvalidArgument,
                     "the installed attention hook does not take ", to_string(dtype_of_v<T>), " K/V pages");
  return with_kv_typed_rows<T>(q, out, n, scratch, [&](const T* qt, T* ot) {
    call.q = qt;
    call.out = ot;
    return fn(call);
  });
}

class Model {
 public:
  static constexpr float kRmsEps = 1e-5f;
  static constexpr double kRopeTheta = 10000.0;

  /// Shares the checkpoint (many engines may run one model). `threads` > 1 starts a
  /// kvkit::ThreadPool that runs the projections and the KV kernels (exec()). `quantized`
  /// uses the checkpoint's quantized weights for the projections when it has them.
  explicit Model(std::shared_ptr<const Checkpoint> ckpt, int threads = 1, bool quantized = true)
      : ck_(std::move(ckpt)), threads_(threads) {
    KVKIT_CHECK(ck_ != nullptr, "kvkit: Model needs a checkpoint");
    const ModelConfig& c = ck_->config();
    validate_config(c, ck_->source());
    if (quantized && ck_->quantized()) {
      quant_ = ck_->quantized().get();
      KVKIT_CHECK(static_cast<int>(quant_->layers.size()) == c.n_layers && c.dim % 32 == 0 &&
                      c.hidden_dim % 32 == 0,
                  "kvkit: checkpoint ", ck_->source(), ": quantized weights do not match the config");
      qa_.resize(static_cast<std::size_t>(std::max(c.dim, c.hidden_dim) / 32));
    }
    KVKIT_CHECK(quant_ != nullptr || ck_->has_float_projections(), "kvkit: checkpoint ", ck_->source(),
                " has only quantized projections (loaded without float weights), so the model must run "
                "quantized (quantized_matvec = true)");
    if (threads_ > 1) pool_ = std::make_shared<ThreadPool>(threads_);
    const int half = c.head_dim() / 2;
    rope_cos_.resize(static_cast<std::size_t>(c.seq_len) * half);
    rope_sin_.resize(rope_cos_.size());
    for (int pos = 0; pos < c.seq_len; ++pos)
      for (int j = 0; j < half; ++j) {
        const double freq = std::pow(c.rope_theta, -2.0 * j / c.head_dim());
        const double angle = pos * freq;
        rope_cos_[static_cast<std::size_t>(pos) * half + j] = static_cast<float>(std::cos(angle));
        rope_sin_[static_cast<std::size_t>(pos) * half + j] = static_cast<float>(std::sin(angle));
      }
    q_.resize(static_cast<std::size_t>(c.n_layers));
  }

  const ModelConfig& config() const { return ck_->config(); }
  const Checkpoint& checkpoint() const { return *ck_; }
  std::shared_ptr<const Checkpoint> checkpoint_ptr() const { return ck_; }
  /// The host executor of the projections and KV kernels: threads() tasks on the model's
  /// pool (no pool: one thread).
  exec::Host exec() const {
    return pool_ ? exec::Host{threads_, pool_->executor()} : exec::Host{threads_};
  }
  /// Whether forward() runs the projections on quantized weights.
  bool quantized() const { return quant_ != nullptr; }
  /// The quantized projections forward() runs on, or null (float path).
  const QuantWeights* quant_weights() const { return quant_; }
  DecodeAttentionParams attention_params() const {
    return DecodeAttentionParams{config().n_heads,
                                 1.f / std::sqrt(static_cast<float>(config().head_dim()))};
  }

  /// Sizes the scratch buffers for batches up to `max_batch` (forward grows them otherwise).
  void reserve(std::int32_t max_batch) { ensure_scratch(max_batch); }

  /// Runs one step. `views` holds one view per layer, each with batch_size == in.batch and
  /// a page table whose sequence b already counts the new token (its slot is in.slots[b]).
  /// Writes logits [batch, vocab]; `attention`, when set, replaces the dense attention.
  /// T is the element type of the K/V pages (float, half_t, bfloat16_t): write_kv rounds
  /// the new float K/V rows into it and the decode kernel reads it. An attention hook runs
  /// its function for T (AttentionHook::fn); one without it fails the step (kInvalidArgument).
  /// Returns the first failing kernel's (or hook's) Status.
  template <class T>
  Status forward(const ForwardBatch& in, const PagedKVView<T>* views /* [n_layers] */,
                 float* logits /* [batch, vocab] */, const AttentionHook* attention = nullptr);

  /// Post-RoPE queries of layer `layer` from the last forward, [last_batch(), Hq, D].
  const float* queries(int layer) const { return q_.at(static_cast<std::size_t>(layer)).data(); }
  std::int32_t last_batch() const { return last_batch_; }

  /// RMSNorm of every column of x into y (the config's epsilon). Public so batched prefill
  /// normalises exactly as a step does.
  template <class In, class Out>
  void rmsnorm(const In& x, const float* weight /* [dim] */, Out& y) const {
    const int dim = config().dim;
    Eigen::Map<const Eigen::VectorXf> w(weight, dim);
    for (Eigen::Index b = 0; b < x.cols(); ++b) {
      const float ss = x.col(b).squaredNorm() / static_cast<float>(dim) + config().norm_eps;
      y.col(b) = x.col(b).cwiseProduct(w) * (1.f / std::sqrt(ss));
    }
  }

  /// Rotates pairs (2j, 2j+1) of each head of `vec` ([heads, head_dim]) by pos * freq_j,
  /// from the table built once at construction (shared with batched prefill).
  void rope(float* vec /* [heads, head_dim] */, int heads, std::int32_t pos) const {
    const int hd = config().head_dim(), half = hd / 2;
    const float* cs = rope_cos_.data() + static_cast<std::size_t>(pos) * half;
    const float* sn = rope_sin_.data() + static_cast<std::size_t>(pos) * half;
    for (int h = 0; h < heads; ++h) {
      float* p = vec + static_cast<std::size_t>(h) * hd;
      for (int j = 0; j < half; ++j) {
        const float a = p[2 * j], b = p[2 * j + 1];
        p[2 * j] = a * cs[j] - b * sn[j];
        p[2 * j + 1] = a * sn[j] + b * cs[j];
      }
    }
  }

 private:
  void ensure_scratch(std::int32_t B) {
    if (B <= capacity_) return;
    const ModelConfig& c = config();
    const std::size_t nb = static_cast<std::size_t>(B);
    x_.resize(nb * c.dim);
    xb_.resize(nb * c.dim);
    att_.resize(nb * c.dim);
    k_.resize(nb * c.kv_dim());
    v_.resize(nb * c.kv_dim());
    h1_.resize(nb * c.hidden_dim);
    h3_.resize(nb * c.hidden_dim);
    for (auto& q : q_) q.resize(nb * c.dim);
    capacity_ = B;
  }

  // y.col(b) = w * x.col(b), one matrix-vector product per sequence: a GEMM over the batch
  // would round differently for different batch sizes, and a sequence's tokens must not
  // depend on what it is batched with.
  template <class Mat, class In, class Out>
  static void matvec(const Mat& w, const In& x, Out& y) {
    for (Eigen::Index b = 0; b < x.cols(); ++b) y.col(b).noalias() = w * x.col(b);
  }

  // y.col(b) = w * x.col(b) for a projection with one output (wo, w2): on its quantized
  // matrix `qw` when the layer has one, else on the float weights `w`.
  template <class Mat, class In, class Out>
  void project(const QMatrix* qw, const Mat& w, In& x, Out& y) {
    if (qw == nullptr) return matvec(w, x, y);
    for (Eigen::Index b = 0; b < x.cols(); ++b) {
      const QMatvecOut o{qw, y.col(b).data()};
      qmatvec(x.col(b).data(), static_cast<std::int32_t>(x.rows()), &o, 1);
    }
  }

  // Quantizes x [n] once and runs the k products sharing it as one job on the pool.
  void qmatvec(const float* x /* [n] */, std::int32_t n, const QMatvecOut* outs /* [k] */, int k) {
    quantize_activation(x, n, qa_.data());
    quant_matvec(exec(), outs, k, QActivation{x, qa_.data(), n});
  }


  std::shared_ptr<const Checkpoint> ck_;
  int threads_ = 1;
  std::shared_ptr<ThreadPool> pool_;      // threads_ > 1: runs projections and KV kernels
  const QuantWeights* quant_ = nullptr;   // the checkpoint's quantized projections, or null
  std::vector<Q8Act> qa_;                 // [max(dim, hidden) / 32] quantized activation
  std::vector<float> rope_cos_, rope_sin_;  // [seq_len, head_dim / 2]
  std::int32_t capacity_ = 0, last_batch_ = 0;
  std::vector<float> x_, xb_, att_, k_, v_, h1_, h3_;  // [batch, width] each
  std::vector<std::vector<float>> q_;                  // [n_layers][batch, Hq, D]
  std::vector<unsigned char> ws_;                      // attention workspace
  Scratch16 q16_;                                      // 16-bit q / out of decode_attention
};

template <class T>
Status Model::forward(const ForwardBatch& in, const PagedKVView<T>* views /* [n_layers] */,
                      float* logits /* [batch, vocab] */, const AttentionHook* attention) {
  const ModelConfig& c = config();
  const std::int32_t B = in.batch;
  KVKIT_CHECK_STATUS(B > 0, StatusCode::kInvalidArgument, "batch must be > 0, got ", B);
  for (std::int32_t b = 0; b < B; ++b) {
    KVKIT_CHECK_STATUS(in.tokens[b] >= 0 && in.tokens[b] < c.vocab_size, StatusCode::kOutOfRange,
                       "token id ", in.tokens[b], " outside the vocabulary [0, ", c.vocab_size, ")");
    KVKIT_CHECK_STATUS(in.positions[b] >= 0 && in.positions[b] < c.seq_len,
                       StatusCode::kOutOfRange, "position ", in.positions[b],
                       " outside the model's seq_len ", c.seq_len);
  }
  ensure_scratch(B);
  last_batch_ = B;
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using W = Eigen::Map<const RowMat>;
  using M = Eigen::Map<Eigen::MatrixXf>;
  const int dim = c.dim, kv = c.kv_dim(), hid = c.hidden_dim, hd = c.head_dim();
  M x(x_.data(), dim, B), xb(xb_.data(), dim, B), att(att_.data(), dim, B);
  M k(k_.data(), kv, B), v(v_.data(), kv, B), h1(h1_.data(), hid, B), h3(h3_.data(), hid, B);

  for (std::int32_t b = 0; b < B; ++b)
    x.col(b) = Eigen::Map<const Eigen::VectorXf>(
        ck_->token_embedding() + static_cast<std::size_t>(in.tokens[b]) * dim, dim);

  const exec::Host ex = exec();
  const DecodeAttentionParams ap = attention_params();
  for (int l = 0; l < c.n_layers; ++l) {
    const PagedKVView<T>& view = views[l];
    KVKIT_CHECK_STATUS(view.batch_size == B && view.num_kv_heads == c.n_kv_heads &&
                           view.head_dim == hd,
                       StatusCode::kInvalidArgument, "layer ", l, " view (batch ",
                       view.batch_size, ", kv heads ", view.num_kv_heads, ", head_dim ",
                       view.head_dim, ") does not match the step (batch ", B, ", kv heads ",
                       c.n_kv_heads, ", head_dim ", hd, ")");
    M q(q_[static_cast<std::size_t>(l)].data(), dim, B);
    const QuantLayer* ql = quant_ ? &quant_->layers[static_cast<std::size_t>(l)] : nullptr;
    rmsnorm(x, ck_->rms_att(l), xb);
    if (ql) {
      for (std::int32_t b = 0; b < B; ++b) {
        const QMatvecOut o[3] = {{&ql->wq, q.col(b).data()}, {&ql->wk, k.col(b).data()},
                                 {&ql->wv, v.col(b).data()}};
        qmatvec(xb.col(b).data(), dim, o, 3);
      }
    } else {
      matvec(W(ck_->wq(l), dim, dim), xb, q);
      matvec(W(ck_->wk(l), kv, dim), xb, k);
      matvec(W(ck_->wv(l), kv, dim), xb, v);
    }
    for (std::int32_t b = 0; b < B; ++b) {
      rope(q.col(b).data(), c.n_heads, in.positions[b]);
      rope(k.col(b).data(), c.n_kv_heads, in.positions[b]);
    }
    KVKIT_RETURN_IF_ERROR(write_kv(ex, view, k_.data(), v_.data(), in.slots, B,
                                   static_cast<std::int64_t>(kv)));
    std::size_t need = paged_decode_attention_workspace_size(ex, view, ap);
    const bool hooked = attention != nullptr && attention->installed();
    if (hooked && attention->template workspace_fn<T>())
      need = std::max(need, attention->template workspace_fn<T>()(l, view));
    if (ws_.size() < need) ws_.resize(need);  // grows to the largest batch once
    const Workspace ws{ws_.data(), ws_.size()};
    if (hooked) {
      AttentionCallT<T> call;
      call.layer = l;
      call.view = view;
      call.seq_ids = in.seq_ids;
      call.params = ap;
      call.exec = ex;
      call.workspace = ws;
      KVKIT_RETURN_IF_ERROR(hooked_attention(*attention, call, q.data(), att.data(), B * dim, q16_));
    } else {
      KVKIT_RETURN_IF_ERROR(decode_attention(ex, view, q.data(), att.data(), B * dim, ap, ws, q16_));
    }
    project(ql ? &ql->wo : nullptr, W(ck_->wo(l), dim, dim), att, xb);
    x += xb;
    rmsnorm(x, ck_->rms_ffn(l), xb);
    if (ql) {
      for (std::int32_t b = 0; b < B; ++b) {
        const QMatvecOut o[2] = {{&ql->w1, h1.col(b).data()}, {&ql->w3, h3.col(b).data()}};
        qmatvec(xb.col(b).data(), dim, o, 2);
      }
    } else {
      matvec(W(ck_->w1(l), hid, dim), xb, h1);
      matvec(W(ck_->w3(l), hid, dim), xb, h3);
    }
    h1 = h1.array() / (1.f + (-h1.array()).exp()) * h3.array();  // silu(w1 x) * (w3 x)
    project(ql ? &ql->w2 : nullptr, W(ck_->w2(l), dim, hid), h1, xb);
    x += xb;
  }
  rmsnorm(x, ck_->rms_final(), xb);
  M out(logits, c.vocab_size, B);
  if (quant_) {
    for (std::int32_t b = 0; b < B; ++b) {
      const QMatvecOut o{&quant_->classifier, out.col(b).data()};
      qmatvec(xb.col(b).data(), dim, &o, 1);
    }
  } else {
    matvec(W(ck_->classifier(), c.vocab_size, dim), xb, out);
  }
  return Status::ok();
}

// Built once in the kvkit_example_engine library (engine_instances.cpp) rather than in
// every file that runs the engine; without KVKIT_ENGINE_PRECOMPILED (copying the headers
// alone) each user instantiates them. The decode kernel too: the engine, its policies and
// their tests all call it, and its three instantiations cost ~10 s of compile time a file.
#if defined(KVKIT_ENGINE_PRECOMPILED)
extern template Status Model::forward<float>(const ForwardBatch&, const PagedKVView<float>*, float*,
                                             const AttentionHook*);
extern template Status Model::forward<half_t>(const ForwardBatch&, const PagedKVView<half_t>*, float*,
                                              const AttentionHook*);
extern template Status Model::forward<bfloat16_t>(const ForwardBatch&, const PagedKVView<bfloat16_t>*, float*,
                                                  const AttentionHook*);
}  // namespace engine
extern template Status paged_decode_attention<float>(exec::Host, PagedKVView<float>, const float*, float*,
                                                     const DecodeAttentionParams&, Workspace, float*);
extern template Status paged_decode_attention<half_t>(exec::Host, PagedKVView<half_t>, const half_t*, half_t*,
                                                      const DecodeAttentionParams&, Workspace, float*);
extern template Status paged_decode_attention<bfloat16_t>(exec::Host, PagedKVView<bfloat16_t>, const bfloat16_t*,
                                                          bfloat16_t*, const DecodeAttentionParams&, Workspace, float*);
namespace engine {
#endif

}  // namespace engine
}  // namespace kvkit
