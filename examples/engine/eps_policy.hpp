#pragma once
// EpsPolicy: the Sketcher (kvkit/sketch/eps.hpp) hosted by the example engine.
//
// attach() builds the summary store for the engine's pool (all layers, every page may
// start a group), installs
//  - a page listener: kAllocate / kRewrite bump the page's version (its groups are
//    re-summarised when next used), a freeing kRelease drops the groups it keys;
//  - the attention hook: per layer, sync the summaries with the view (new tokens are
//    added as they land; groups the hooks never saw, such as prefilled prompt pages, or
//    that changed, are read once), run the pre-pass and call the page-subset variant of
//    paged_decode_attention on the chosen pages;
//  - a registered pool "eps_summaries" (summary bytes count as KV memory).
// Pages of any element type (float32, float16, bfloat16: set_typed_attention): summaries
// are kept in float from the pages' keys widened exactly, so a bound certified on a page's
// stored keys holds for what the kernel reads; the selector scores the queries as the
// kernel gets them (rounded to the pages' type).
// The hook never allocates: the selector's buffers are sized for max_batch sequences of
// seq_len tokens at attach(). A step that fails after some layers ran leaves those layers'
// newest token summarised; the engine retries the same token at the same slot (same K),
// and a record holding more tokens than the sequence is rebuilt, so summaries stay exact.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "engine/engine.hpp"
#include "engine/policy.hpp"
#include "kvkit/kernels/cpu.hpp"
#include "kvkit/sketch/eps.hpp"

namespace kvkit {
namespace engine {

class EpsPolicy : public EnginePolicy {
 public:
  explicit EpsPolicy(const sketch::SketchParams& p, std::string name = "eps") : p_(p), name_(std::move(name)) {
    p_.validate();
  }

  std::string name() const override { return name_; }
  /// Replaces the attention call (page-subset attention); moves no token.
  PolicyRole role() const override { return {true, false}; }
  /// Summaries and selection read the pages' own type (every engine page type).
  bool supports_kv_dtype(DType) const override { return true; }

  void attach(Engine& eng) override {
    KVKIT_CHECK(store_ == nullptr, "kvkit: eps policy is already attached to an engine");
    const ModelConfig& c = eng.config();
    const EngineOptions& o = eng.options();
    store_ = std::make_unique<sketch::SketchStore>(p_, c.n_layers, c.n_kv_heads, c.head_dim(), o.page_size,
                                                   o.num_pages);
    sel_ = std::make_unique<sketch::SketchSelector>(*store_);
    const std::int32_t max_pages = (c.seq_len + o.page_size - 1) / o.page_size;
    sel_->reserve(o.max_batch, c.n_heads, max_pages);
    sketch::SketchStore* st = store_.get();
    eng.add_page_listener([st](const PageEvent& e) {
      if (e.kind == PageEventKind::kAllocate || e.kind == PageEventKind::kRewrite) st->page_changed(e.page);
      if (e.kind == PageEventKind::kRelease && e.refcount == 0) st->page_freed(e.page);
    });
    // The page-subset variant needs the dense kernel's workspace, which the engine always
    // provides, so no extra workspace function.
    eng.set_typed_attention([this](const auto& call) { return run(call); });
    eng.register_pool("eps_summaries", [st] { return st->memory_bytes(); },
                      [this] { return peak_bytes_; });
  }

  PolicyStats stats() const override {
    return {{"pages_total", static_cast<double>(total_.pages_total)},
            {"pages_visited", static_cast<double>(total_.pages_visited)},
            {"pages_visited_fraction",
             total_.pages_total > 0 ? static_cast<double>(total_.pages_visited) / total_.pages_total : 1.0},
            {"bytes_kv_read_est", static_cast<double>(total_.bytes_kv_read_est)},
            {"prepass_ms", total_.prepass_seconds * 1e3},
            {"attention_ms", attention_seconds_ * 1e3},
            {"certified_omitted_max", total_.certified_omitted_max},
            {"summaries_rebuilt", static_cast<double>(total_.summaries_rebuilt)},
            {"summary_bytes", store_ ? static_cast<double>(store_->memory_bytes()) : 0.0},
            {"summary_bytes_peak", static_cast<double>(peak_bytes_)}};
  }

  /// Counters summed over every attention call so far (certified_omitted_max: the max).
  const sketch::SketchTelemetry& telemetry() const { return total_; }
  /// Counters of the last attention call (one layer of one step).
  const sketch::SketchTelemetry& last() const { return last_; }
  const sketch::SketchStore* store() const { return store_.get(); }

 private:
  template <class T>
  Status run(const AttentionCallT<T>& call) {
    const std::int64_t rebuilt = store_->sync(call.layer, call.view);
    sketch::SketchTelemetry t;
    KVKIT_RETURN_IF_ERROR(sel_->select(call.layer, call.view, call.q, call.params.num_qo_heads,
                                       call.params.sm_scale, &t));
    t.summaries_rebuilt = rebuilt;
    DecodeAttentionParams ap = call.params;
    ap.page_subset_indptr = sel_->indptr();
    ap.page_subset = sel_->subset();
    const auto t0 = std::chrono::steady_clock::now();
    const Status st = paged_decode_attention(call.exec, call.view, call.q, call.out, ap, call.workspace);
    attention_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    KVKIT_RETURN_IF_ERROR(st);
    last_ = t;
    total_.add(t);
    peak_bytes_ = std::max(peak_bytes_, store_->memory_bytes());
    return Status::ok();
  }

  sketch::SketchParams p_;
  std::string name_;
  std::unique_ptr<sketch::SketchStore> store_;
  std::unique_ptr<sketch::SketchSelector> sel_;
  sketch::SketchTelemetry total_, last_;
  double attention_seconds_ = 0;
  std::int64_t peak_bytes_ = 0;
};

}  // namespace engine
}  // namespace kvkit
