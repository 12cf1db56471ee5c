#pragma once
// CompressorPolicy: the Compressor (R1KV, SnapKV, StreamingLLM of <kvkit/compressor/>)
// hosted by the example engine, as the seed's vLLM v0 plan runs R1KV after decode steps.
//
// Per sequence it keeps, for every layer, a window of the last `window` post-RoPE queries
// (StepInfo::queries, one row per step). After each completed step, a sequence whose
// kv_len reached budget + buffer is compressed to budget:
//   1. per layer, Compressor::select reads the sequence's keys straight from its pages and
//      the layer's query window (oldest first) and picks budget slots per kv head;
//   2. make_exclusive(id) copies any page the sequence shares (a fork, a cached prefix),
//      so the compaction below never changes another sequence's K/V;
//   3. per layer, compact_tokens moves the kept K/V rows of each head to slots
//      0..budget-1 of the sequence's own pages (a one-sequence view, so no other row of
//      the batch is even addressed);
//   4. notify_rewrite(id, the rewritten pages) so other policies' page summaries learn,
//      then truncate_kv(id, budget): the pages past the new length go back to the
//      allocator; the position keeps counting, and the policy counts the dropped tokens.
// The step's attention and logits were computed before the hook runs, so the current
// step is unaffected; the next step attends over the compacted cache.
//
// Queries of prefilled tokens: Engine::prefill runs the prompt (but its last token) in
// batched passes that step hooks do not see, so right after a prefill a sequence's window
// holds only the queries of the steps since. A scorer that reads queries (R1KV, SnapKV)
// then waits until the window holds `window` rows (at most window - 1 steps past the
// threshold) instead of scoring with fewer rows; StreamingLLM needs none and never waits.
// With `compress_prompt`, a sequence that caches more than budget tokens when its prompt
// is consumed (at most the pending token left to feed: right after Engine::prefill's
// first step, or after the second-to-last teacher-forced prompt step) is compressed to
// budget as soon as its window is full, instead of waiting for budget + buffer (the
// "prefill compression" option of the spec).
//
// Suspend / resume (SequenceStateKeeper): a conversation resumed as a new sequence
// (Engine::add_sequence with cached_len < position, conversation_host.hpp) would start with
// an empty query window and a zero drop count. save_sequence() copies the sequence's state
// (window ring, drop count, prompt flags) and restore_sequence() gives it to the new
// sequence before its first step, so it compresses exactly when, and keeps exactly what,
// an uninterrupted sequence would. The window is host memory outside the KV pools
// (layers x window x Hq x D floats per suspended conversation).
//
// Run path: no allocation after a sequence's first step (its query window is allocated
// then); the workspaces (select's for the model's largest S, compact_tokens') and the
// keep lists are sized once in attach(). Failures inside the hook (out of pages in
// make_exclusive, non-finite scores) throw kvkit::Error out of the step call; the step
// itself has completed.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "engine/engine.hpp"
#include "engine/policy.hpp"
#include "engine/sequence_state.hpp"
#include "kvkit/compressor/r1kv.hpp"
#include "kvkit/compressor/scorers.hpp"
#include "kvkit/kernels/cpu/gather.hpp"

namespace kvkit {
namespace engine {

/// Options of a CompressorPolicy: the Compressor's Params (budget, buffer, window, ...)
/// and the engine-side choices.
struct CompressorPolicyOptions {
  compressor::Params params;
  /// Compress a sequence to budget once its prompt is consumed (at most the pending token
  /// left) if it caches more than budget tokens (prefill compression), instead of waiting
  /// for budget + buffer.
  bool compress_prompt = false;
};

/// Counters of a CompressorPolicy run.
struct CompressorPolicyCounters {
  std::int64_t compressions = 0;         // sequence compressions (all layers at once)
  std::int64_t prompt_compressions = 0;  // of which triggered by compress_prompt
  std::int64_t pages_freed = 0;          // pages truncate_kv returned to the allocator
  std::int64_t pages_copied = 0;         // shared pages make_exclusive copied first
  std::int64_t tokens_dropped = 0;       // cached tokens evicted, all sequences
  std::int64_t deferred_steps = 0;       // steps a due sequence waited for a full query window
  double compress_seconds = 0;           // wall time inside compressions
};

/// The Compressor<Scorer> as an EnginePolicy (see the file comment). One object per engine.
template <class Scorer>
class CompressorPolicy : public EnginePolicy, public SequenceStateKeeper {
 public:
  /// Validates the options (kvkit::Error naming the bad value).
  explicit CompressorPolicy(const CompressorPolicyOptions& o) : opt_(o), comp_(o.params) {}

  std::string name() const override { return Scorer::kName; }
  /// Compacts and truncates cached tokens; attention stays the engine's.
  PolicyRole role() const override { return {false, true}; }

  /// Sizes the workspaces and keep lists for `eng`'s model and installs the step hook.
  /// Throws kvkit::Error when the model cannot host the policy (budget past seq_len).
  void attach(Engine& eng) override {
    KVKIT_CHECK(eng_ == nullptr, "kvkit: policy ", name(), " is already attached to an engine");
    const ModelConfig& c = eng.config();
    const compressor::Params& p = comp_.params();
    KVKIT_CHECK(p.budget < c.seq_len, "kvkit: ", name(), " budget ", p.budget,
                " must be below the model's seq_len ", c.seq_len);
    eng_ = &eng;
    layers_ = c.n_layers;
    hkv_ = c.n_kv_heads;
    hq_ = c.n_heads;
    dim_ = c.head_dim();
    const exec::Host ex = eng.model().exec();
    const compressor::Shape max_shape{hkv_, hq_, dim_, c.seq_len, p.window};
    const KVGeometry g = eng.geometry();
    const std::int32_t zero_indptr[2] = {0, 0};
    const std::size_t nq = static_cast<std::size_t>(hq_) * p.window * dim_;
    const std::size_t ws = eng.with_kv_type([&](auto tag) {
      using T = decltype(tag);
      const PagedKVView<T> pv = eng.pool_view<T>(0);
      const PagedKVView<T> one = make_csr_view(g, pv.k_data, eng.strides(), pv.v_data, eng.strides(),
                                               CsrPageTable{zero_indptr, nullptr, nullptr, 1});
      if constexpr (!std::is_same<T, float>::value) qwin16_.of<T>().assign(nq, T{});
      return std::max(comp_.workspace_size(ex, max_shape), compact_tokens_workspace_size(ex, one, p.budget));
    });
    workspace_.assign(ws + kWorkspaceAlign, 0);
    keep_.assign(static_cast<std::size_t>(layers_) * hkv_ * p.budget, 0);
    qwin_.assign(nq, 0.f);
    rewrite_.reserve(static_cast<std::size_t>(p.budget / g.page_size + 2));
    before_.reserve(static_cast<std::size_t>(c.seq_len / g.page_size + 2));
    eng.add_step_hook([this](Engine& e, const StepInfo& info) { on_step(e, info); });
  }

  /// Any page type: select reads the keys in the pages' type (queries rounded to it),
  /// compaction moves rows bit for bit.
  bool supports_kv_dtype(DType) const override { return true; }

  PolicyStats stats() const override {
    return {{"compressions", static_cast<double>(n_.compressions)},
            {"prompt_compressions", static_cast<double>(n_.prompt_compressions)},
            {"pages_freed", static_cast<double>(n_.pages_freed)},
            {"pages_copied", static_cast<double>(n_.pages_copied)},
            {"tokens_dropped", static_cast<double>(n_.tokens_dropped)},
            {"deferred_steps", static_cast<double>(n_.deferred_steps)},
            {"compress_seconds", n_.compress_seconds}};
  }

  const CompressorPolicyCounters& counters() const { return n_; }

  /// The state of sequence `seq` (see the file comment); empty before its first step.
  std::any save_sequence(SeqId seq) const override {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return {};
    return Saved{this, it->second};
  }
  /// Gives `seq` (no step run yet) the state save_sequence() returned for the sequence it
  /// continues. Throws kvkit::Error naming the sequence for another policy's state or a
  /// sequence that already ran a step.
  void restore_sequence(SeqId seq, const std::any& state) override {
    if (!state.has_value()) return;
    const Saved* s = std::any_cast<Saved>(&state);
    KVKIT_CHECK(s != nullptr && s->owner == this, "kvkit: ", name(), ": restore_sequence of sequence ",
                seq, " with a state this policy did not save");
    KVKIT_CHECK(eng_ != nullptr && eng_->has_sequence(seq), "kvkit: ", name(),
                ": restore_sequence of sequence ", seq, " which is not live in the attached engine");
    KVKIT_CHECK(seqs_.count(seq) == 0, "kvkit: ", name(), ": restore_sequence of sequence ", seq,
                " which already ran a step");
    seqs_.emplace(seq, s->state);
  }
  /// The query window of a saved state (its float ring plus the fixed fields).
  std::int64_t state_bytes(const std::any& state) const override {
    const Saved* s = std::any_cast<Saved>(&state);
    if (s == nullptr) return 0;
    return static_cast<std::int64_t>(sizeof(Saved) + s->state.ring.capacity() * sizeof(float));
  }
  const compressor::Compressor<Scorer>& compressor() const { return comp_; }
  /// Tokens of sequence `id` evicted so far (its position minus its kv_len, for a
  /// sequence that had all its tokens cached before); 0 for an unknown id.
  std::int64_t dropped_tokens(SeqId id) const {
    auto it = seqs_.find(id);
    return it == seqs_.end() ? 0 : it->second.dropped;
  }
  /// The sequence compressed last (-1 before any) and its kept slots of the last
  /// compression: keep[(layer * Hkv + h) * budget + i] = old slot of new slot i.
  SeqId last_compressed() const { return last_id_; }
  const std::vector<std::int32_t>& last_keep() const { return keep_; }

 private:
  struct SeqState {
    std::vector<float> ring;  // [layers, window, Hq*D] queries of the last steps
    std::int32_t next = 0;    // ring row the next step writes
    std::int32_t count = 0;   // valid rows (<= window)
    std::int64_t dropped = 0;
    bool prompt_seen_done = false;  // the prompt-done check ran
    bool prompt_due = false;        // compress_prompt: waiting for a full window
  };
  // What save_sequence() hands out (owner: the policy that saved it).
  struct Saved {
    const CompressorPolicy* owner = nullptr;
    SeqState state;
  };

  void on_step(Engine& eng, const StepInfo& info) {
    const compressor::Params& p = comp_.params();
    const std::size_t row = static_cast<std::size_t>(hq_) * dim_;
    // 1. Record this step's queries of every sequence in the batch.
    for (std::int32_t b = 0; b < info.batch; ++b) {
      SeqState& s = state(info.seq_ids[b]);
      for (std::int32_t l = 0; l < layers_; ++l) {
        const float* q = info.queries[l] + static_cast<std::size_t>(b) * row;
        std::memcpy(s.ring.data() + (static_cast<std::size_t>(l) * p.window + s.next) * row, q,
                    row * sizeof(float));
      }
      s.next = (s.next + 1) % p.window;
      s.count = std::min(s.count + 1, p.window);
    }
    if (seqs_.size() > static_cast<std::size_t>(eng.num_sequences())) forget_gone(eng);
    // 2. Compress the sequences that are due, one at a time (batch order).
    for (std::int32_t b = 0; b < info.batch; ++b) {
      const SeqId id = info.seq_ids[b];
      if (!eng.has_sequence(id)) continue;  // an earlier hook freed it
      SeqState& s = seqs_.at(id);
      const std::int32_t kv = eng.kv_len(id);
      if (opt_.compress_prompt && !s.prompt_seen_done &&
          static_cast<std::size_t>(eng.position(id)) + 1 >= eng.tokens(id).size()) {
        s.prompt_seen_done = true;
        s.prompt_due = kv > p.budget;
      }
      const bool due = comp_.should_compress(kv) || (s.prompt_due && kv > p.budget);
      if (!due) continue;
      if (Scorer::kUsesAttention && s.count < p.window) {
        ++n_.deferred_steps;
        continue;
      }
      if (s.prompt_due && !comp_.should_compress(kv)) ++n_.prompt_compressions;
      s.prompt_due = false;
      compress(eng, id, s);
    }
  }

  SeqState& state(SeqId id) {
    auto it = seqs_.find(id);
    if (it != seqs_.end()) return it->second;
    SeqState s;  // first step of this sequence: its window is allocated here, once
    s.ring.assign(static_cast<std::size_t>(layers_) * comp_.params().window * hq_ * dim_, 0.f);
    return seqs_.emplace(id, std::move(s)).first->second;
  }

  void forget_gone(const Engine& eng) {
    for (auto it = seqs_.begin(); it != seqs_.end();)
      it = eng.has_sequence(it->first) ? std::next(it) : seqs_.erase(it);
  }

  // A one-sequence CSR view of `id`'s pages in layer l (kv_len tokens).
  template <class T>
  PagedKVView<T> seq_view(Engine& eng, SeqId id, std::int32_t layer) {
    const std::vector<std::int32_t>& pages = eng.pages(id);
    const std::int32_t ps = eng.options().page_size;
    indptr_[0] = 0;
    indptr_[1] = static_cast<std::int32_t>(pages.size());
    last_len_ = eng.kv_len(id) - (indptr_[1] - 1) * ps;
    const PagedKVView<T> pv = eng.pool_view<T>(layer);
    return make_csr_view(eng.geometry(), pv.k_data, eng.strides(), pv.v_data, eng.strides(),
                         CsrPageTable{indptr_, pages.data(), &last_len_, 1});
  }

  // The window queries in the pages' type T: qwin_ itself, or rounded into qwin16_.
  template <class T>
  const T* window_as(std::int32_t lq) {
    if constexpr (std::is_same<T, float>::value) {
      (void)lq;
      return qwin_.data();
    } else {
      T* out = qwin16_.of<T>().data();
      kvkit::detail::cpu::convert(static_cast<const float*>(qwin_.data()), out,
                                  static_cast<std::size_t>(hq_) * lq * dim_);
      return out;
    }
  }

  // Queries of layer l, oldest first, as [Hq, Lq, D] in qwin_; returns Lq.
  std::int32_t window_queries(const SeqState& s, std::int32_t layer) {
    const std::int32_t w = comp_.params().window, lq = s.count;
    const std::size_t row = static_cast<std::size_t>(hq_) * dim_;
    for (std::int32_t r = 0; r < lq; ++r) {
      const std::int32_t slot = ((s.next - lq + r) % w + w) % w;
      const float* src = s.ring.data() + (static_cast<std::size_t>(layer) * w + slot) * row;
      for (std::int32_t h = 0; h < hq_; ++h)
        std::memcpy(qwin_.data() + (static_cast<std::size_t>(h) * lq + r) * dim_,
                    src + static_cast<std::size_t>(h) * dim_, sizeof(float) * dim_);
    }
    return lq;
  }

  static void check(const Status& st, const char* what, SeqId id) {
    if (!st.is_ok()) fail("kvkit: compressor ", what, " of sequence ", id, " failed: ", st.to_string());
  }

  void compress(Engine& eng, SeqId id, SeqState& s) {
    eng.with_kv_type([&](auto tag) { compress_as<decltype(tag)>(eng, id, s); });
  }

  template <class T>
  void compress_as(Engine& eng, SeqId id, SeqState& s) {
    const auto t0 = std::chrono::steady_clock::now();
    const compressor::Params& p = comp_.params();
    const exec::Host ex = eng.model().exec();
    const Workspace ws{workspace_.data(), workspace_.size()};
    const std::int32_t old_len = eng.kv_len(id), budget = p.budget;
    // 1. Kept slots of every layer (reads only: shared pages are fine here).
    std::int32_t first_changed = budget;
    for (std::int32_t l = 0; l < layers_; ++l) {
      const PagedKVView<T> v = seq_view<T>(eng, id, l);
      const std::int32_t lq = Scorer::kUsesAttention ? window_queries(s, l) : 0;
      std::int32_t nk = 0;
      std::int32_t* keep = keep_.data() + static_cast<std::size_t>(l) * hkv_ * budget;
      check(comp_.select(ex, v, 0, Scorer::kUsesAttention ? window_as<T>(lq) : nullptr, hq_, lq, keep,
                         budget, &nk, ws),
            "select", id);
      if (nk != budget) fail("kvkit: compressor kept ", nk, " slots of sequence ", id, ", expected ", budget);
      for (std::int32_t h = 0; h < hkv_; ++h)
        for (std::int32_t i = 0; i < first_changed; ++i)
          if (keep[static_cast<std::size_t>(h) * budget + i] != i) {
            first_changed = i;
            break;
          }
    }
    // 2. Own every page before rewriting (never change a page another sequence reads). The
    // copies are the pages whose id changed (not the pages_in_use delta: the reclaim
    // callback may free pages meanwhile).
    before_.assign(eng.pages(id).begin(), eng.pages(id).end());
    eng.make_exclusive(id);
    KVKIT_CHECK(eng.has_sequence(id), "kvkit: sequence ", id, " was freed while made exclusive");
    const std::vector<std::int32_t>& owned = eng.pages(id);
    for (std::size_t i = 0; i < std::min(before_.size(), owned.size()); ++i)
      n_.pages_copied += owned[i] != before_[i] ? 1 : 0;
    // 3. Compact each layer inside the sequence's own pages.
    for (std::int32_t l = 0; l < layers_; ++l) {
      const PagedKVView<T> v = seq_view<T>(eng, id, l);
      const std::int32_t* keep = keep_.data() + static_cast<std::size_t>(l) * hkv_ * budget;
      check(compact_tokens(ex, v, keep, &budget, budget, ws), "compaction", id);
    }
    // 4. Tell listeners which pages changed, then drop the tail.
    const std::int32_t ps = eng.options().page_size;
    const std::vector<std::int32_t>& pages = eng.pages(id);
    if (first_changed < budget) {
      const std::int32_t first_page = first_changed / ps;
      const std::int32_t end_page = (budget + ps - 1) / ps;
      rewrite_.assign(1, pages[static_cast<std::size_t>(first_page)]);
      eng.notify_rewrite(id, rewrite_, first_changed % ps);
      rewrite_.clear();
      for (std::int32_t i = first_page + 1; i < end_page; ++i) rewrite_.push_back(pages[static_cast<std::size_t>(i)]);
      if (!rewrite_.empty()) eng.notify_rewrite(id, rewrite_, 0);
    }
    const std::int32_t before = eng.pages_in_use();
    eng.truncate_kv(id, budget);
    n_.pages_freed += before - eng.pages_in_use();
    s.dropped += old_len - budget;
    n_.tokens_dropped += old_len - budget;
    ++n_.compressions;
    last_id_ = id;
    n_.compress_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  CompressorPolicyOptions opt_;
  compressor::Compressor<Scorer> comp_;
  Engine* eng_ = nullptr;
  std::int32_t layers_ = 0, hkv_ = 0, hq_ = 0, dim_ = 0;
  std::map<SeqId, SeqState> seqs_;
  std::vector<unsigned char> workspace_;  // select's and compact_tokens' scratch (used in turn)
  std::vector<std::int32_t> keep_;        // [layers, Hkv, budget] kept slots of the last compression
  std::vector<float> qwin_;               // [Hq, window, D] one layer's window, oldest first
  Scratch16 qwin16_;                      // qwin_ rounded to 16-bit pages' type, [Hq, window, D]
  std::vector<std::int32_t> rewrite_;     // pages passed to notify_rewrite
  std::vector<std::int32_t> before_;      // the compressed sequence's pages before make_exclusive
  std::int32_t indptr_[2] = {0, 0};
  std::int32_t last_len_ = 0;
  SeqId last_id_ = -1;
  CompressorPolicyCounters n_;
};

using R1KVPolicy = CompressorPolicy<compressor::R1KV>;
using SnapKVPolicy = CompressorPolicy<compressor::SnapKV>;
using StreamingLLMPolicy = CompressorPolicy<compressor::StreamingLLM>;

}  // namespace engine
}  // namespace kvkit
