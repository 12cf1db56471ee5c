#pragma once
// KvchanPolicy: the ChannelSelector (include/kvkit/channel/kvchan.hpp) hosted by the
// example engine.
//
// Storage. The engine's per-layer pools are shared by all heads and its page ids by all
// layers, so a page can only go back to the engine when every (layer, head) of its tokens
// is packed. The policy therefore packs a whole sequence at once, after every head is
// stable: the engine keeps the most recent tokens at full width (between W and W +
// page_size - 1 of them), the policy keeps the older ones in its own PackedPagePool
// (pages of [page_size, Hkv, rK] K rows and [page_size, Hkv, rV] V rows per layer,
// registered with Engine::register_pool as "kvchan"). Packing takes whole pages: the
// oldest full-width pages are gathered into packed pages, the remaining window pages
// are copied down (copy_pages, all layers; notify_rewrite) and truncate_kv gives the
// freed pages back to the engine's allocator. So kv_bytes_in_use() really drops: the
// engine holds ceil(window / page_size) full-width pages per sequence, the policy
// rK/D and rV/D of the bytes of every older page, plus its metadata (statistics, sets,
// page lists, compensation means), all of which memory_bytes() counts.
//
// Attention (set_attention): for a batch with old tokens, channel_attention merges the
// old part (channel-restricted kernel over the policy's pool) with the engine's window
// (dense) by LSE; otherwise the dense kernel runs unchanged. With k_compensation the
// policy keeps, per sequence, the float64 running sum of every K dim over its packed tokens
// (the pack step sees full-width K) and the mean of each dropped dim; channel_attention adds
// sm_scale * q·mean to the old part's lse, i.e. the dropped K dims read as their mean.
// With residual_bits (4 or 8) the packed pool also keeps every dropped dim as a b-bit code
// with one scale per (token, head) (channel/residual.hpp), counted in its page bytes, and
// the old part is read by residual_channel_attention instead.
//
// Control (step hook, after each step): observe the new tokens' K/V (and decode queries
// for ThinK; tokens prefilled without a step are caught up from the views), tick the
// selector; while packed, every check_every steps compare this step's logits with a
// full-width baseline (a fresh engine on the same checkpoint prefilled with the
// sequence's processed tokens: full-width recomputation) and on failure unpack every
// sequence's old tokens to full width (a full-width pool of the policy), overwrite them and
// the window with the recomputation's K/V (restore_on_backoff, default; without it the
// old tokens keep their selected dims, dropped K dims 0 (their mean with k_compensation),
// dropped V dims 0 or their mean with compensation, or their residual), reset the
// stability counters and probe again; when stable again the old tokens are re-packed with
// the new sets. Then pack whatever left the window.
//
// Page types: float32, float16 and bfloat16 pages (EngineOptions::kv_dtype). The policy's
// pools hold the engine's type, so packing and unpacking stay copies; the selector's
// statistics and the compensation sums read the rows widened exactly to float / double.
//
// Limits: a sequence with old tokens in the policy's pool is not self-contained, and the
// engine knows it (Engine::set_external_tokens): fork_sequence and a conversation
// host's finish_turn throw for it instead of continuing without those tokens.
// Sequences are assumed not to be truncated by another policy.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "engine/engine.hpp"
#include "engine/policy.hpp"
#include "kvkit/channel/kvchan.hpp"
#include "kvkit/channel/pack_pages.hpp"
#include "kvkit/channel/packed_store.hpp"

namespace kvkit {
namespace engine {

/// Settings of the hosted ChannelSelector.
struct KvchanOptions {
  channel::ChannelParams params;
  std::string jsonl_path;  // one JSON record per fidelity check ("" : none)
  /// On a failed check, replace every sequence's K/V (old tokens and window) with the
  /// full-width recomputation the check ran, so the back-off loses nothing; false: the old
  /// tokens are unpacked from their packed rows (dropped dims 0 / mean).
  bool restore_on_backoff = true;
};

/// One fidelity check (also a line of the --jsonl file).
struct KvchanCheck {
  std::int64_t step = 0;
  SeqId seq = -1;
  std::int64_t kv_bytes = 0;       // engine kv_bytes_in_use() at the check
  std::int64_t full_kv_bytes = 0;  // what the full-width cache of the same tokens would hold
  channel::FidelityMetrics metrics;
};

class KvchanPolicy : public EnginePolicy {
 public:
  explicit KvchanPolicy(KvchanOptions o) : opt_(std::move(o)) {}
  ~KvchanPolicy() override = default;

  std::string name() const override { return "kvchan"; }
  /// Moves old tokens to its packed pool and (in dynamic mode) replaces the attention call.
  PolicyRole role() const override { return {opt_.params.mode == channel::ChannelMode::kDynamic, true}; }
  /// Pools of the engine's own page type (every engine page type).
  bool supports_kv_dtype(DType) const override { return true; }

  void attach(Engine& eng) override {
    KVKIT_CHECK(eng_ == nullptr, "kvchan: attach() called twice");
    KVKIT_CHECK(eng.num_sequences() == 0, "kvchan: attach before adding sequences");
    const ModelConfig& c = eng.config();
    const std::int32_t D = c.head_dim();
    opt_.params.validate(D);
    KVKIT_CHECK(!eng.options().contiguous, "kvchan: needs a paged engine (not --contiguous)");
    eng_ = &eng;
    sel_ = std::make_unique<channel::ChannelSelector>(opt_.params, c.n_layers, c.n_kv_heads, D,
                                                      c.n_heads / c.n_kv_heads);
    eng.with_kv_type([&](auto tag) {
      using T = decltype(tag);
      Pools<T>& p = pools<T>();
      p.packed = std::make_unique<channel::PackedPagePool<T>>(c.n_layers, c.n_kv_heads, sel_->r_k(), sel_->r_v(),
                                                              eng.options().page_size, opt_.params.residual_bits, D, D);
      p.full = std::make_unique<channel::PackedPagePool<T>>(c.n_layers, c.n_kv_heads, D, D, eng.options().page_size);
    });
    if (!opt_.jsonl_path.empty()) {
      jsonl_ = std::make_unique<std::ofstream>(opt_.jsonl_path);
      KVKIT_CHECK(jsonl_->good(), "kvchan: cannot write --jsonl file ", opt_.jsonl_path);
    }
    if (opt_.params.mode == channel::ChannelMode::kFull) return;  // dense engine, nothing hooked
    eng.register_pool(
        "kvchan", [this] { return pool_bytes(); },
        [this] { return std::max(peak_pool_bytes_, pool_bytes()); });
    eng.add_step_hook([this](Engine& e, const StepInfo& info) { on_step(e, info); });
    if (opt_.params.mode == channel::ChannelMode::kDynamic)
      eng.set_typed_attention([this](const auto& call) { return attention(call); },
                              [this](int layer, const auto& v) { return workspace_bytes(layer, v); });
  }

  PolicyStats stats() const override {
    PolicyStats s;
    const bool packed = sel_ && sel_->phase() == channel::ChannelPhase::kPacked;
    std::int64_t old = 0;
    for (const auto& kv : seqs_) old += kv.second.n_old;
    s.emplace_back("packed_heads", packed ? sel_->n_layers() * sel_->n_kv_heads() : 0);
    s.emplace_back("stable_heads", sel_ ? sel_->stable_heads() : 0);
    s.emplace_back("backoffs", sel_ ? static_cast<double>(sel_->backoffs()) : 0);
    s.emplace_back("checks", static_cast<double>(checks_.size()));
    s.emplace_back("checks_failed", static_cast<double>(checks_failed_));
    s.emplace_back("selection_updates", sel_ ? static_cast<double>(sel_->updates()) : 0);
    s.emplace_back("old_tokens", static_cast<double>(old));
    s.emplace_back("restored_tokens", static_cast<double>(restored_tokens_));
    s.emplace_back("kvchan_pool_bytes", static_cast<double>(pool_bytes()));
    s.emplace_back("kvchan_packed_bytes", static_cast<double>(packed_bytes()));
    s.emplace_back("kvchan_metadata_bytes", sel_ ? static_cast<double>(metadata_bytes()) : 0);
    double mx = 0, sum = 0;
    for (const auto& ch : checks_) {
      mx = std::max(mx, ch.metrics.kl);
      sum += ch.metrics.kl;
    }
    s.emplace_back("check_max_kl", mx);
    s.emplace_back("check_mean_kl", checks_.empty() ? 0.0 : sum / static_cast<double>(checks_.size()));
    // The settings the run used, so a JSON record says what produced it (kvchan_score is
    // ChannelScore: 0 ema, 1 think, 2 centered; flags are 0/1).
    const channel::ChannelParams& p = opt_.params;
    s.emplace_back("kvchan_window", p.window);
    s.emplace_back("kvchan_r_k", sel_ ? sel_->r_k() : p.r_k);
    s.emplace_back("kvchan_r_v", sel_ ? sel_->r_v() : p.r_v);
    s.emplace_back("kvchan_compress_k", p.compress_k ? 1 : 0);
    s.emplace_back("kvchan_score", static_cast<double>(static_cast<int>(p.score)));
    s.emplace_back("kvchan_v_compensation", p.mean_compensation ? 1 : 0);
    s.emplace_back("kvchan_k_compensation", p.k_compensation ? 1 : 0);
    s.emplace_back("kvchan_residual_bits", p.residual_bits);
    return s;
  }

  // ---- inspection (tests, bench) ----
  const channel::ChannelSelector& selector() const { return *sel_; }
  channel::ChannelSelector& selector() { return *sel_; }
  const std::vector<KvchanCheck>& checks() const { return checks_; }
  /// The pools of rK / rV pages and of unpacked full-width pages (T: the engine's page type).
  template <class T = float>
  const channel::PackedPagePool<T>& packed_pool() const {
    return *checked(pools<T>().packed);
  }
  template <class T = float>
  const channel::PackedPagePool<T>& full_pool() const {
    return *checked(pools<T>().full);
  }
  /// Tokens of `id` held by the policy (the oldest ones), packed or unpacked.
  std::int32_t old_tokens(SeqId id) const {
    auto it = seqs_.find(id);
    return it == seqs_.end() ? 0 : it->second.n_old;
  }
  bool old_tokens_packed(SeqId id) const {
    auto it = seqs_.find(id);
    return it != seqs_.end() && it->second.packed;
  }
  /// Bytes of the policy's own storage: pages in use in both pools plus metadata.
  std::int64_t pool_bytes() const {
    if (eng_ == nullptr || opt_.params.mode == channel::ChannelMode::kFull) return 0;
    return eng_->with_kv_type([&](auto tag) {
      const Pools<decltype(tag)>& p = pools<decltype(tag)>();
      return p.packed->bytes_in_use() + p.full->bytes_in_use();
    }) + metadata_bytes();
  }
  /// Bytes of the packed pages in use.
  std::int64_t packed_bytes() const {
    if (eng_ == nullptr) return 0;
    return eng_->with_kv_type([&](auto tag) { return pools<decltype(tag)>().packed->bytes_in_use(); });
  }
  /// Every KV byte of the run: the engine's full-width pages in use (all layers, K and V)
  /// plus pool_bytes(); equals eng.kv_bytes_in_use().
  std::int64_t memory_bytes() const {
    return eng_->pages_bytes(eng_->pages_in_use()) + pool_bytes();
  }
  std::int64_t metadata_bytes() const {
    std::int64_t b = sel_ ? sel_->metadata_bytes() : 0;
    for (const auto& kv : seqs_)
      b += static_cast<std::int64_t>(sizeof(std::int32_t) * kv.second.pages.size() +
                                     sizeof(float) * (kv.second.v_mean.size() + kv.second.k_mean.size()) +
                                     sizeof(double) * (kv.second.v_sum.size() + kv.second.k_sum.size()));
    return b;
  }

  /// Full-width K and V (head_dim floats each) of token `t` of sequence `id`, layer,
  /// kv head, as attention reads it: the engine's row for window tokens; for old tokens
  /// the selected dims of the packed row scattered to full width (dropped dims 0 for K,
  /// 0 or the compensation mean for V), or the unpacked row.
  void read_token(SeqId id, std::int32_t layer, std::int32_t t, std::int32_t head, float* k,
                  float* v) {  // [head_dim] each
    eng_->with_kv_type([&](auto tag) { read_token_as<decltype(tag)>(id, layer, t, head, k, v); });
  }

  /// Key compensation of (id, layer, head): the mean over the packed tokens of each dropped
  /// K dim, 0 on kept dims ([head_dim]); nullptr unless k_compensation and packed.
  const float* k_mean(SeqId id, std::int32_t layer, std::int32_t head) const {
    auto it = seqs_.find(id);
    return it == seqs_.end() ? nullptr : k_fill_of(it->second, layer, head);
  }

  /// Backs off now, as a failed check does: every sequence's old tokens to full width,
  /// counters reset, probing again.
  void back_off() {
    eng_->with_kv_type([&](auto tag) {
      for (auto& kv : seqs_) unpack<decltype(tag)>(kv.second);
    });
    sel_->back_off();
  }

 private:
  // The policy's two pools, for pages of type T (only the engine's type is allocated).
  template <class T>
  struct Pools {
    std::unique_ptr<channel::PackedPagePool<T>> packed;  // rK / rV pages
    std::unique_ptr<channel::PackedPagePool<T>> full;    // full-width pages (after a back-off)
  };
  template <class T>
  Pools<T>& pools() { return std::get<Pools<T>>(pools_); }
  template <class T>
  const Pools<T>& pools() const { return std::get<Pools<T>>(pools_); }
  template <class Pool>
  const Pool* checked(const std::unique_ptr<Pool>& p) const {
    KVKIT_CHECK(p != nullptr, "kvchan: no pool of that page type (the engine stores ",
                eng_ ? to_string(eng_->kv_dtype()) : "nothing: not attached", ")");
    return p.get();
  }

  template <class T>
  void read_token_as(SeqId id, std::int32_t layer, std::int32_t t, std::int32_t head, float* k, float* v) {
    const std::int32_t D = sel_->head_dim();
    const SeqState* st = find(id);
    const std::int32_t n_old = st ? st->n_old : 0;
    const std::int32_t P = eng_->options().page_size;
    const std::size_t n = static_cast<std::size_t>(D);
    if (t >= n_old) {
      const auto ids = eng_->sequences();
      const std::int32_t b = static_cast<std::int32_t>(std::find(ids.begin(), ids.end(), id) - ids.begin());
      const PagedKVView<T>& view = eng_->layer_views<T>()[static_cast<std::size_t>(layer)];
      kvkit::detail::cpu::convert(view.k_ptr(b, t - n_old, head), k, n);
      kvkit::detail::cpu::convert(view.v_ptr(b, t - n_old, head), v, n);
      return;
    }
    Pools<T>& p = pools<T>();
    const std::int32_t page = st->pages[static_cast<std::size_t>(t / P)], slot = t % P;
    if (!st->packed) {
      kvkit::detail::cpu::convert(p.full->k_row(layer, page, slot, head), k, n);
      kvkit::detail::cpu::convert(p.full->v_row(layer, page, slot, head), v, n);
      return;
    }
    const std::int32_t rk = sel_->r_k(), rv = sel_->r_v();
    kbuf_.resize(n);  // rK, rV <= head_dim; no allocation once observe has run
    vbuf_.resize(n);
    kvkit::detail::cpu::convert(p.packed->k_row(layer, page, slot, head), kbuf_.data(), static_cast<std::size_t>(rk));
    kvkit::detail::cpu::convert(p.packed->v_row(layer, page, slot, head), vbuf_.data(), static_cast<std::size_t>(rv));
    channel::unpack_channels(kbuf_.data(), 0, sel_->packed_k(layer) + head * rk, rk, D, 1, k_fill_of(*st, layer, head),
                             k, 0);
    channel::unpack_channels(vbuf_.data(), 0, sel_->packed_v(layer) + head * rv, rv, D, 1, v_fill_of(*st, layer, head),
                             v, 0);
    if (opt_.params.residual_bits == 0) return;
    // The dropped dims as the residual attention reads them: scale * code.
    const channel::ResidualView res = p.packed->residual(layer);
    channel::read_residual(res, page, slot, head, /*values=*/false, sel_->packed_k(layer) + head * rk, rk, D, k);
    channel::read_residual(res, page, slot, head, /*values=*/true, sel_->packed_v(layer) + head * rv, rv, D, v);
  }

  struct SeqState {
    std::int32_t n_old = 0;            // oldest tokens held by the policy
    std::vector<std::int32_t> pages;   // [ceil(n_old / page_size)] policy page ids
    bool packed = false;               // pages are in the packed pool (else the full-width one)
    std::int64_t observed = 0;         // tokens seen by the selector
    std::vector<double> v_sum;         // [L, Hkv, D] sums of packed V rows (compensation)
    std::vector<float> v_mean;         // [L, Hkv, D] mean on dropped dims, 0 on kept dims
    std::vector<double> k_sum;         // [L, Hkv, D] sums of packed K rows (k_compensation)
    std::vector<float> k_mean;         // [L, Hkv, D] mean on dropped K dims, 0 on kept dims
  };

  SeqState* find(SeqId id) {
    auto it = seqs_.find(id);
    return it == seqs_.end() ? nullptr : &it->second;
  }

  const float* v_fill_of(const SeqState& st, std::int32_t layer, std::int32_t head) const {
    if (!opt_.params.mean_compensation || !st.packed || st.v_mean.empty()) return nullptr;
    return st.v_mean.data() +
           (static_cast<std::size_t>(layer) * sel_->n_kv_heads() + static_cast<std::size_t>(head)) * sel_->head_dim();
  }

  const float* k_fill_of(const SeqState& st, std::int32_t layer, std::int32_t head) const {
    if (!opt_.params.k_compensation || !st.packed || st.k_mean.empty()) return nullptr;
    return st.k_mean.data() +
           (static_cast<std::size_t>(layer) * sel_->n_kv_heads() + static_cast<std::size_t>(head)) * sel_->head_dim();
  }

  template <class T>
  std::size_t workspace_bytes(int /*layer*/, const PagedKVView<T>& view) const {
    const exec::Host ex = eng_->model().exec();
    const DecodeAttentionParams dense = eng_->model().attention_params();
    DecodeAttentionParams pk = dense;
    static const std::int32_t dummy = 0;
    pk.k_channels = &dummy;  // only non-null-ness matters for sizing
    pk.v_channels = &dummy;
    pk.q_dim = sel_->head_dim();
    const std::size_t a = channel::channel_attention_workspace_size(
        ex, view, channel::shape_only_view<T>(view.num_kv_heads, sel_->r_k(), sel_->r_v(), view.batch_size),
        dense, pk);
    const std::size_t b = channel::channel_attention_workspace_size(
        ex, view,
        channel::shape_only_view<T>(view.num_kv_heads, sel_->head_dim(), sel_->head_dim(), view.batch_size),
        dense, dense);
    return std::max(a, b);
  }

  template <class T>
  Status attention(const AttentionCallT<T>& call) {
    const PagedKVView<T>& view = call.view;
    const std::int32_t B = view.batch_size;
    bool any = false, packed = false;
    for (std::int32_t b = 0; b < B; ++b) {
      auto it = seqs_.find(call.seq_ids[b]);
      if (it != seqs_.end() && it->second.n_old > 0) {
        any = true;
        packed = it->second.packed;
      }
    }
    if (!any) return paged_decode_attention(call.exec, view, call.q, call.out, call.params, call.workspace);
    const std::int32_t P = eng_->options().page_size, D = sel_->head_dim(), H = sel_->n_kv_heads();
    indptr_.assign(1, 0);
    indices_.clear();
    last_len_.clear();
    if (opt_.params.mean_compensation) fill_.assign(static_cast<std::size_t>(B) * H * D, 0.f);
    if (opt_.params.k_compensation) kfill_.assign(static_cast<std::size_t>(B) * H * D, 0.f);
    for (std::int32_t b = 0; b < B; ++b) {
      const SeqState* st = nullptr;
      auto it = seqs_.find(call.seq_ids[b]);
      if (it != seqs_.end() && it->second.n_old > 0) st = &it->second;
      if (st != nullptr) {
        KVKIT_CHECK_STATUS(st->packed == packed, StatusCode::kInvalidArgument,
                           "kvchan: sequences of one batch in different storage formats");
        indices_.insert(indices_.end(), st->pages.begin(), st->pages.end());
        if (opt_.params.mean_compensation && st->packed && !st->v_mean.empty())
          for (std::int32_t h = 0; h < H; ++h)
            std::copy_n(v_fill_of(*st, call.layer, h), D,
                        fill_.begin() + (static_cast<std::ptrdiff_t>(b) * H + h) * D);
        if (opt_.params.k_compensation && st->packed && !st->k_mean.empty())
          for (std::int32_t h = 0; h < H; ++h)
            std::copy_n(k_fill_of(*st, call.layer, h), D,
                        kfill_.begin() + (static_cast<std::ptrdiff_t>(b) * H + h) * D);
      }
      indptr_.push_back(static_cast<std::int32_t>(indices_.size()));
      last_len_.push_back(st != nullptr ? st->n_old - (static_cast<std::int32_t>(st->pages.size()) - 1) * P : 0);
    }
    channel::PackedPagePool<T>& pool = packed ? *pools<T>().packed : *pools<T>().full;
    const PagedKVView<T> old =
        make_csr_view(pool.geometry(), pool.k(call.layer), pool.k_strides(), pool.v(call.layer), pool.v_strides(),
                      CsrPageTable{indptr_.data(), indices_.data(), last_len_.data(), B});
    DecodeAttentionParams pk = call.params;
    if (packed) {
      if (sel_->compresses_k()) pk.k_channels = sel_->packed_k(call.layer);
      if (sel_->compresses_v()) pk.v_channels = sel_->packed_v(call.layer);
      if (sel_->compresses_k() || sel_->compresses_v()) pk.q_dim = D;
    }
    if (packed && opt_.params.residual_bits != 0)
      return channel::channel_attention(call.exec, view, old, pool.residual(call.layer), call.q, call.out, call.params,
                                        pk, call.workspace);
    const float* fill = opt_.params.mean_compensation && packed ? fill_.data() : nullptr;
    const float* kfill = opt_.params.k_compensation && packed && sel_->compresses_k() ? kfill_.data() : nullptr;
    return channel::channel_attention(call.exec, view, old, call.q, call.out, call.params, pk, fill, kfill,
                                      call.workspace);
  }

  void on_step(Engine& eng, const StepInfo& info) {
    const ModelConfig& c = eng.config();
    const std::int32_t D = c.head_dim(), H = c.n_kv_heads, G = c.n_heads / c.n_kv_heads;
    // Forget sequences the engine no longer has.
    const std::vector<SeqId> ids = eng.sequences();
    for (auto it = seqs_.begin(); it != seqs_.end();) {
      if (!eng.has_sequence(it->first)) {
        release_pages(it->second);
        it = seqs_.erase(it);
      } else {
        ++it;
      }
    }
    // Observe new tokens (prefilled ones included) and this step's queries.
    const std::int64_t fresh = eng.with_kv_type([&](auto tag) { return observe<decltype(tag)>(eng, ids); });
    if (opt_.params.score == channel::ChannelScore::kThink || opt_.params.score == channel::ChannelScore::kCentered)
      for (std::int32_t b = 0; b < info.batch; ++b)
        for (std::int32_t l = 0; l < c.n_layers; ++l)
          for (std::int32_t h = 0; h < H; ++h)
            sel_->observe_q(l, h, info.queries[l] + (static_cast<std::size_t>(b) * c.n_heads + static_cast<std::size_t>(h) * G) * D);
    const bool to_packed = sel_->tick(fresh);
    if (opt_.params.mode != channel::ChannelMode::kDynamic) return;
    if (to_packed) last_check_step_ = info.step;
    eng.with_kv_type([&](auto tag) { control<decltype(tag)>(eng, info, ids); });
  }

  // Feeds the selector the K/V of every token it has not seen (widened to float); returns
  // the largest count of new tokens of one sequence.
  template <class T>
  std::int64_t observe(Engine& eng, const std::vector<SeqId>& ids) {
    const ModelConfig& c = eng.config();
    const std::int32_t D = c.head_dim(), H = c.n_kv_heads;
    const std::vector<PagedKVView<T>>& views = eng.layer_views<T>();
    kbuf_.resize(static_cast<std::size_t>(D));
    vbuf_.resize(static_cast<std::size_t>(D));
    std::int64_t fresh = 0;
    for (std::size_t b = 0; b < ids.size(); ++b) {
      SeqState& st = seqs_[ids[b]];
      const std::int32_t len = eng.kv_len(ids[b]);
      const std::int64_t total = static_cast<std::int64_t>(st.n_old) + len;
      const std::int64_t from = std::max<std::int64_t>(st.observed, st.n_old);
      for (std::int64_t t = from; t < total; ++t)
        for (std::int32_t l = 0; l < c.n_layers; ++l)
          for (std::int32_t h = 0; h < H; ++h) {
            const std::int32_t e = static_cast<std::int32_t>(t - st.n_old);
            const PagedKVView<T>& v = views[static_cast<std::size_t>(l)];
            const T* kr = v.k_ptr(static_cast<std::int32_t>(b), e, h);
            const T* vr = v.v_ptr(static_cast<std::int32_t>(b), e, h);
            if constexpr (std::is_same<T, float>::value) {
              sel_->observe_kv(l, h, kr, vr);  // float pages: the rows themselves, no copy
            } else {
              kvkit::detail::cpu::convert(kr, kbuf_.data(), static_cast<std::size_t>(D));
              kvkit::detail::cpu::convert(vr, vbuf_.data(), static_cast<std::size_t>(D));
              sel_->observe_kv(l, h, kbuf_.data(), vbuf_.data());
            }
          }
      fresh = std::max(fresh, total - st.observed);
      st.observed = std::max(st.observed, total);
    }
    return fresh;
  }

  // Dynamic mode after the selector's tick: the fidelity guard, then packing.
  template <class T>
  void control(Engine& eng, const StepInfo& info, const std::vector<SeqId>& ids) {
    const ModelConfig& c = eng.config();
    // Fidelity guard (this step's logits were computed with the packed old tokens).
    if (sel_->phase() == channel::ChannelPhase::kPacked && opt_.params.check_every > 0 &&
        info.step - last_check_step_ >= opt_.params.check_every) {
      last_check_step_ = info.step;
      bool failed = false;
      std::map<SeqId, std::unique_ptr<Engine>> bases;  // full-width recomputations
      for (std::int32_t b = 0; b < info.batch; ++b) {
        const SeqId id = info.seq_ids[b];
        const SeqState* st = find(id);
        if (st == nullptr || st->n_old == 0) continue;
        KvchanCheck ch;
        ch.step = info.step;
        ch.seq = id;
        ch.kv_bytes = eng.kv_bytes_in_use();
        ch.full_kv_bytes = full_width_bytes(eng);
        std::unique_ptr<Engine> base = baseline(eng, id);
        const std::vector<float>& bl = base->last_logits(base->sequences().front());
        bases[id] = std::move(base);
        ch.metrics = channel::compare_logits(bl.data(), info.logits + static_cast<std::size_t>(b) * c.vocab_size,
                                             c.vocab_size, opt_.params.thresholds);
        failed = failed || !ch.metrics.passed;
        checks_failed_ += ch.metrics.passed ? 0 : 1;
        checks_.push_back(ch);
        write_jsonl(ch, !ch.metrics.passed);
      }
      if (failed) {
        back_off();
        if (opt_.restore_on_backoff) restore<T>(eng, bases);
      }
    }
    if (sel_->phase() != channel::ChannelPhase::kPacked) return;
    for (SeqId id : ids) {
      SeqState& st = seqs_[id];
      if (!st.packed && st.n_old > 0) repack<T>(st);
      pack_overflow<T>(eng, id, st);
    }
    peak_pool_bytes_ = std::max(peak_pool_bytes_, pool_bytes());
  }

  // Full-width bytes the same tokens would take in the engine's own pages.
  std::int64_t full_width_bytes(const Engine& eng) const {
    std::int64_t pages = 0;
    const std::int32_t P = eng.options().page_size;
    for (SeqId id : eng.sequences()) pages += (old_tokens(id) + eng.kv_len(id) + P - 1) / P;
    return eng.pages_bytes(pages);
  }

  // A fresh full-width engine on the same checkpoint that processed the tokens of `id`
  // (prefill, then one step: its last_logits are the baseline's next-token logits).
  static std::unique_ptr<Engine> baseline(Engine& eng, SeqId id) {
    const std::vector<std::int32_t> toks = eng.processed_tokens(id);
    // The run's own options (page size, layout, threads, projections: the same arithmetic as
    // the run it checks), sized for one sequence.
    EngineOptions bo = eng.options();
    bo.max_batch = 1;
    bo.num_pages = static_cast<std::int32_t>((toks.size() + static_cast<std::size_t>(bo.page_size)) / bo.page_size + 1);
    auto base = std::make_unique<Engine>(eng.model().checkpoint_ptr(), bo);
    const SeqId b = base->add_sequence(toks);
    base->prefill(b);
    base->step();
    return base;
  }

  // After back_off(): every sequence's tokens (old ones in the full-width pool, the
  // engine's window) get the K/V of its full-width recomputation (computed here for a
  // sequence the check did not recompute).
  template <class T>
  void restore(Engine& eng, std::map<SeqId, std::unique_ptr<Engine>>& bases) {
    channel::PackedPagePool<T>& full = *pools<T>().full;
    const ModelConfig& c = eng.config();
    const std::int32_t D = c.head_dim(), P = eng.options().page_size;
    for (SeqId id : eng.sequences()) {
      SeqState* st = find(id);
      if (st == nullptr || st->n_old == 0) continue;
      if (!bases.count(id)) bases[id] = baseline(eng, id);
      Engine& base = *bases[id];
      const PagedKVView<T>* bv = base.layer_views<T>().data();
      KVKIT_CHECK(base.kv_len(base.sequences().front()) == st->n_old + eng.kv_len(id),
                  "kvchan: internal: recomputation of sequence ", id, " has ", base.kv_len(base.sequences().front()),
                  " tokens, the policy holds ", st->n_old + eng.kv_len(id));
      for (std::int32_t t = 0; t < st->n_old; ++t)
        for (std::int32_t l = 0; l < c.n_layers; ++l)
          for (std::int32_t h = 0; h < c.n_kv_heads; ++h) {
            const std::int32_t page = st->pages[static_cast<std::size_t>(t / P)];
            std::copy_n(bv[l].k_ptr(0, t, h), D, full.k_row(l, page, t % P, h));
            std::copy_n(bv[l].v_ptr(0, t, h), D, full.v_row(l, page, t % P, h));
          }
      eng.make_exclusive(id);
      const std::vector<SeqId> ids = eng.sequences();
      const std::int32_t b = static_cast<std::int32_t>(std::find(ids.begin(), ids.end(), id) - ids.begin());
      const std::vector<PagedKVView<T>>& views = eng.layer_views<T>();
      for (std::int32_t e = 0; e < eng.kv_len(id); ++e)
        for (std::int32_t l = 0; l < c.n_layers; ++l)
          for (std::int32_t h = 0; h < c.n_kv_heads; ++h) {
            std::copy_n(bv[l].k_ptr(0, st->n_old + e, h), D, views[static_cast<std::size_t>(l)].k_ptr(b, e, h));
            std::copy_n(bv[l].v_ptr(0, st->n_old + e, h), D, views[static_cast<std::size_t>(l)].v_ptr(b, e, h));
          }
      if (!eng.pages(id).empty()) eng.notify_rewrite(id, eng.pages(id));
      restored_tokens_ += st->n_old + eng.kv_len(id);
    }
  }

  void write_jsonl(const KvchanCheck& ch, bool backoff) {
    if (!jsonl_) return;
    std::ostringstream o;
    o.precision(9);
    o << "{\"step\":" << ch.step << ",\"seq\":" << ch.seq << ",\"mode\":\"" << channel::to_string(opt_.params.mode)
      << "\",\"phase\":\"packed\",\"kv_bytes\":" << ch.kv_bytes << ",\"full_kv_bytes\":" << ch.full_kv_bytes
      << ",\"kl\":" << ch.metrics.kl << ",\"overlap\":" << ch.metrics.overlap
      << ",\"margin_drift\":" << ch.metrics.margin_drift << ",\"passed\":" << (ch.metrics.passed ? "true" : "false")
      << ",\"backoff\":" << (backoff ? "true" : "false") << "}\n";
    *jsonl_ << o.str();
    jsonl_->flush();
  }

  void release_pages(SeqState& st) {
    eng_->with_kv_type([&](auto tag) {
      Pools<decltype(tag)>& pl = pools<decltype(tag)>();
      for (std::int32_t p : st.pages) (st.packed ? *pl.packed : *pl.full).release(p);
    });
    st.pages.clear();
    st.n_old = 0;
  }

  std::size_t vidx(std::int32_t l, std::int32_t h) const {
    return (static_cast<std::size_t>(l) * sel_->n_kv_heads() + static_cast<std::size_t>(h)) * sel_->head_dim();
  }

  // Mean of each dropped V dim over the packed tokens (0 on kept dims).
  void refresh_means(SeqState& st) {
    if (opt_.params.k_compensation) refresh_k_means(st);
    if (!opt_.params.mean_compensation) return;
    const std::int32_t D = sel_->head_dim();
    st.v_mean.assign(st.v_sum.size(), 0.f);
    if (st.n_old == 0) return;
    for (std::int32_t l = 0; l < sel_->n_layers(); ++l)
      for (std::int32_t h = 0; h < sel_->n_kv_heads(); ++h) {
        std::vector<char> kept(static_cast<std::size_t>(D), 0);
        const std::int32_t* s = sel_->packed_v(l) + h * sel_->r_v();
        for (std::int32_t c = 0; c < sel_->r_v(); ++c) kept[static_cast<std::size_t>(s[c])] = 1;
        for (std::int32_t d = 0; d < D; ++d)
          if (!kept[static_cast<std::size_t>(d)])
            st.v_mean[vidx(l, h) + d] = static_cast<float>(st.v_sum[vidx(l, h) + d] / st.n_old);
      }
  }

  // Mean of each dropped K dim over the packed tokens (0 on kept dims).
  void refresh_k_means(SeqState& st) {
    const std::int32_t D = sel_->head_dim();
    st.k_mean.assign(st.k_sum.size(), 0.f);
    if (st.n_old == 0 || !sel_->compresses_k()) return;
    std::vector<char> kept(static_cast<std::size_t>(D));
    for (std::int32_t l = 0; l < sel_->n_layers(); ++l)
      for (std::int32_t h = 0; h < sel_->n_kv_heads(); ++h) {
        std::fill(kept.begin(), kept.end(), 0);
        const std::int32_t* s = sel_->packed_k(l) + h * sel_->r_k();
        for (std::int32_t c = 0; c < sel_->r_k(); ++c) kept[static_cast<std::size_t>(s[c])] = 1;
        for (std::int32_t d = 0; d < D; ++d)
          if (!kept[static_cast<std::size_t>(d)])
            st.k_mean[vidx(l, h) + d] = static_cast<float>(st.k_sum[vidx(l, h) + d] / st.n_old);
      }
  }

  // Storage-only view of layer l of a policy pool (page table empty).
  template <class T>
  static PagedKVView<T> pool_view(channel::PackedPagePool<T>& pool, std::int32_t l) {
    static const std::int32_t kZero[1] = {0};
    return make_csr_view(pool.geometry(), pool.k(l), pool.k_strides(), pool.v(l), pool.v_strides(),
                         CsrPageTable{kZero, nullptr, nullptr, 0});
  }

  // Packs n tokens of full-width pages src (layer l's storage: full_of(l)) into packed
  // pages dst with the frozen sets, all layers (pack_channel_pages); with compensation,
  // adds their V (and K) rows to the sums first, token by token.
  template <class T, class FullOf>
  void pack_pages(SeqState& st, FullOf&& full_of, const std::vector<std::int32_t>& src,
                  const std::vector<std::int32_t>& dst, std::int32_t n) {
    channel::PackedPagePool<T>& packed = *pools<T>().packed;
    const std::int32_t D = sel_->head_dim(), P = packed.page_size();
    for (std::int32_t l = 0; l < sel_->n_layers(); ++l) {
      const PagedKVView<T> full = full_of(l);
      if (opt_.params.mean_compensation || opt_.params.k_compensation)
        for (std::int32_t t = 0; t < n; ++t)
          for (std::int32_t h = 0; h < sel_->n_kv_heads(); ++h) {
            const std::int32_t page = src[static_cast<std::size_t>(t / P)];
            if (opt_.params.mean_compensation) {
              const T* v = full.v_data + full.v_offset(page, t % P, h);
              for (std::int32_t d = 0; d < D; ++d) st.v_sum[vidx(l, h) + d] += to_float(v[d]);
            }
            if (opt_.params.k_compensation) {
              const T* kr = full.k_data + full.k_offset(page, t % P, h);
              for (std::int32_t d = 0; d < D; ++d) st.k_sum[vidx(l, h) + d] += to_float(kr[d]);
            }
          }
      Status s = channel::pack_channel_pages(eng_->model().exec(), full, pool_view(packed, l), sel_->packed_k(l),
                                             sel_->packed_v(l), src.data(), dst.data(),
                                             static_cast<std::int32_t>(src.size()), n);
      if (s.is_ok() && opt_.params.residual_bits != 0)
        s = channel::pack_residual_pages(eng_->model().exec(), full, packed.residual(l), sel_->packed_k(l),
                                         sel_->packed_v(l), sel_->r_k(), sel_->r_v(), src.data(), dst.data(),
                                         static_cast<std::int32_t>(src.size()), n);
      if (!s.is_ok()) fail("kvchan: packing pages failed: ", s.to_string());
    }
  }

  void ensure_sums(SeqState& st) {
    const std::size_t n = static_cast<std::size_t>(sel_->n_layers()) * sel_->n_kv_heads() * sel_->head_dim();
    if (opt_.params.mean_compensation && st.v_sum.empty()) st.v_sum.assign(n, 0.0);
    if (opt_.params.k_compensation && st.k_sum.empty()) st.k_sum.assign(n, 0.0);
  }

  // Old tokens in the full-width pool -> packed with the current (frozen) sets.
  template <class T>
  void repack(SeqState& st) {
    Pools<T>& pl = pools<T>();
    ensure_sums(st);
    std::fill(st.v_sum.begin(), st.v_sum.end(), 0.0);
    std::fill(st.k_sum.begin(), st.k_sum.end(), 0.0);
    std::vector<std::int32_t> dst(st.pages.size());
    for (std::int32_t& p : dst) p = pl.packed->allocate();
    pack_pages<T>(st, [&](std::int32_t l) { return pool_view(*pl.full, l); }, st.pages, dst, st.n_old);
    for (std::int32_t p : st.pages) pl.full->release(p);
    st.pages = dst;
    st.packed = true;
    refresh_means(st);
  }

  // Packed old tokens -> full width (dropped K dims 0 or their mean; V dims 0 or the mean).
  template <class T>
  void unpack(SeqState& st) {
    if (!st.packed) return;
    Pools<T>& pl = pools<T>();
    std::vector<std::int32_t> dst(st.pages.size());
    for (std::int32_t& p : dst) p = pl.full->allocate();
    for (std::int32_t l = 0; l < sel_->n_layers(); ++l) {
      Status s = channel::unpack_channel_pages(eng_->model().exec(), pool_view(*pl.packed, l), pool_view(*pl.full, l),
                                               sel_->packed_k(l), sel_->packed_v(l), k_fill_of(st, l, 0),
                                               v_fill_of(st, l, 0), st.pages.data(), dst.data(),
                                               static_cast<std::int32_t>(dst.size()), st.n_old);
      if (s.is_ok() && opt_.params.residual_bits != 0)  // dropped dims as their residual reads them
        s = channel::unpack_residual_pages(eng_->model().exec(), pl.packed->residual(l), pool_view(*pl.full, l),
                                           sel_->packed_k(l), sel_->packed_v(l), sel_->r_k(), sel_->r_v(),
                                           st.pages.data(), dst.data(), static_cast<std::int32_t>(dst.size()),
                                           st.n_old);
      if (!s.is_ok()) fail("kvchan: unpacking pages failed: ", s.to_string());
    }
    for (std::int32_t p : st.pages) pl.packed->release(p);
    st.pages = dst;
    st.packed = false;
    st.v_sum.clear();
    st.v_mean.clear();
    st.k_sum.clear();
    st.k_mean.clear();
  }

  // Moves the engine's tokens older than the window (whole pages) into packed pages and
  // gives the engine's pages back.
  template <class T>
  void pack_overflow(Engine& eng, SeqId id, SeqState& st) {
    const std::int32_t P = eng.options().page_size, W = opt_.params.window;
    const std::int32_t len = eng.kv_len(id);
    if (len - W < P) return;
    const std::int32_t n_pack = (len - W) / P * P, shift = n_pack / P;
    KVKIT_CHECK(st.n_old % P == 0, "kvchan: internal: old tokens ", st.n_old, " not page aligned");
    eng.make_exclusive(id);
    ensure_sums(st);
    const std::vector<std::int32_t> pages = eng.pages(id);
    const std::vector<std::int32_t> src(pages.begin(), pages.begin() + shift);
    std::vector<std::int32_t> dst(static_cast<std::size_t>(shift));
    for (std::int32_t& p : dst) p = pools<T>().packed->allocate();
    pack_pages<T>(st, [&](std::int32_t l) { return eng.pool_view<T>(l); }, src, dst, n_pack);
    st.pages.insert(st.pages.end(), dst.begin(), dst.end());
    st.n_old += n_pack;
    st.packed = true;
    refresh_means(st);
    // Window pages down by `shift` (one pair per call: a destination may be a later source).
    const std::int32_t keep = static_cast<std::int32_t>(pages.size()) - shift;
    for (std::int32_t l = 0; l < eng.config().n_layers; ++l) {
      const PagedKVView<T> pv = eng.pool_view<T>(l);
      for (std::int32_t j = 0; j < keep; ++j) {
        const Status s = copy_pages(eng.model().exec(), pv, &pages[static_cast<std::size_t>(j + shift)],
                                    &pages[static_cast<std::size_t>(j)], 1);
        if (!s.is_ok()) fail("kvchan: copying window page failed: ", s.to_string());
      }
    }
    if (keep > 0) eng.notify_rewrite(id, std::vector<std::int32_t>(pages.begin(), pages.begin() + keep));
    eng.truncate_kv(id, len - n_pack);
    eng.set_external_tokens(id, st.n_old, name());
  }

  KvchanOptions opt_;
  Engine* eng_ = nullptr;
  std::unique_ptr<channel::ChannelSelector> sel_;
  std::tuple<Pools<float>, Pools<half_t>, Pools<bfloat16_t>> pools_;  // the engine's page type in use
  std::map<SeqId, SeqState> seqs_;
  std::vector<KvchanCheck> checks_;
  std::int64_t checks_failed_ = 0, last_check_step_ = 0, peak_pool_bytes_ = 0, restored_tokens_ = 0;
  std::unique_ptr<std::ofstream> jsonl_;
  // Attention scratch (grows to the largest batch once).
  std::vector<std::int32_t> indptr_, indices_, last_len_;
  std::vector<float> fill_, kfill_;
  std::vector<float> kbuf_, vbuf_;  // [head_dim] a row widened (16-bit pages; read_token)
};

}  // namespace engine
}  // namespace kvkit
