#pragma once
// The example engine as a ConversationCache host (kvkit/conversation/conversation_cache.hpp):
// EngineConversationHost implements PageHost over the engine's allocator and K/V pools,
// AllocatorPageHost over a bare BlockAllocator (benchmarks and tests on synthetic pages),
// and start_turn / finish_turn run one chat turn's request through the cache.
//
// Typical turn loop (T: the engine's page type, EngineOptions::kv_dtype; float by default):
//   EngineConversationHostT<T> host(eng);
//   ConversationCache<T> cache(host, params);
//   eng.set_reclaim([&](std::int32_t n) { return cache.reclaim(n); });
//   SeqId s = start_turn(eng, cache, "c1", prompt);    // create or resume
//   eng.prefill(s); ... eng.step() ...                   // the turn
//   finish_turn(eng, cache, "c1", s);                    // suspend + free the request
//
// A compressed turn (kv_len < position, e.g. with R1KV attached) is suspended as a
// compressed conversation (see conversation_cache.hpp) and resumed with its position. Pass
// the compressor as the `keeper` of both calls so the resumed sequence gets its window of
// recent queries back (sequence_state.hpp): the turns then decode exactly what one
// uninterrupted sequence decodes.

#include <cstdint>
#include <string>
#include <vector>

#include "engine/block_allocator.hpp"
#include "engine/engine.hpp"
#include "engine/sequence_state.hpp"
#include "kvkit/conversation/conversation_cache.hpp"

namespace kvkit {
namespace engine {

/// PageHost over an Engine whose pages hold T: pages of its allocator, copies of all
/// layers' K and V (bit for bit), and per-layer pool views for a BlockStore<T>. Throws
/// kvkit::Error naming both dtypes when the engine stores another type.
template <class T>
class EngineConversationHostT final : public conversation::PageHost<T> {
 public:
  explicit EngineConversationHostT(Engine& eng) : eng_(&eng) {
    for (int l = 0; l < eng.config().n_layers; ++l)
      views_.push_back(eng.pool_view<T>(l));
  }
  std::int32_t page_size() const override { return eng_->options().page_size; }
  std::int32_t try_allocate() override { return eng_->allocator().try_allocate(); }
  void retain(std::int32_t page) override { eng_->allocator().retain(page); }
  std::int32_t release(std::int32_t page) override {
    eng_->allocator().release(page);
    return eng_->allocator().refcount(page);
  }
  std::int32_t refcount(std::int32_t page) const override { return eng_->allocator().refcount(page); }
  void copy_page(std::int32_t src, std::int32_t dst) override {
    for (const PagedKVView<T>& v : views_) {
      const Status st = copy_pages(eng_->model().exec(), v, &src, &dst, 1);
      if (!st.is_ok()) fail("kvkit: copying page ", src, " to ", dst, " failed: ", st.to_string());
    }
  }
  const PagedKVView<T>* pool_views() override { return views_.data(); }

 private:
  Engine* eng_;
  std::vector<PagedKVView<T>> views_;  // [n_layers]
};
/// The host of float32 pages (the engine's default).
using EngineConversationHost = EngineConversationHostT<float>;

/// PageHost over a bare BlockAllocator (no K/V storage: no copies, no spill).
class AllocatorPageHost final : public conversation::PageHost<float> {
 public:
  AllocatorPageHost(BlockAllocator& alloc, std::int32_t page_size) : a_(&alloc), ps_(page_size) {}
  std::int32_t page_size() const override { return ps_; }
  std::int32_t try_allocate() override { return a_->try_allocate(); }
  void retain(std::int32_t page) override { a_->retain(page); }
  std::int32_t release(std::int32_t page) override {
    a_->release(page);
    return a_->refcount(page);
  }
  std::int32_t refcount(std::int32_t page) const override { return a_->refcount(page); }
  void copy_page(std::int32_t, std::int32_t) override {}
  const PagedKVView<float>* pool_views() override { return nullptr; }

 private:
  BlockAllocator* a_;
  std::int32_t ps_;
};

/// Adds the request of conversation `id`'s next turn, whose full prompt is `prompt`
/// (history + new tokens): creates the conversation when the cache does not know it (and
/// it was not ended; with Params::share_prefixes its prompt's full pages found in the
/// cache's prefix index are handed over), else resumes it with its cached pages (a
/// compressed conversation: at its position, Resume::position). With a `keeper`, the state
/// the previous finish_turn saved is restored into the new sequence when the resume
/// continues the whole history. On failure (a bad prompt) the
/// handed pages are released and the turn aborted, then the error propagates.
template <class T>
SeqId start_turn(Engine& eng, conversation::ConversationCache<T>& cache,
                        const std::string& id, const std::vector<std::int32_t>& prompt,
                        conversation::Resume* info = nullptr, SequenceStateKeeper* keeper = nullptr) {
  conversation::Resume r;
  if (!cache.contains(id) && !cache.ended(id)) {
    r = cache.create(id, prompt);
  } else {
    r = cache.resume(id, prompt);
  }
  SeqId s = -1;
#if KVKIT_HAS_EXCEPTIONS
  try {
#endif
    s = eng.add_sequence(prompt, r.pages, r.cached_len, r.position);
    if (keeper != nullptr && r.state.has_value()) keeper->restore_sequence(s, r.state);
#if KVKIT_HAS_EXCEPTIONS
  } catch (...) {
    if (s >= 0) {
      eng.free_sequence(s);  // it owns the handed pages now
    } else {
      for (std::int32_t p : r.pages) eng.allocator().release(p);
    }
    cache.abort_turn(id);
    throw;
  }
#endif
  if (info != nullptr) *info = std::move(r);
  return s;
}

/// Ends the turn of request `seq` of conversation `id`: the cache keeps the K/V of its
/// processed tokens (the pending last generated token is the next turn's first new
/// token), then the request is freed. A sequence that caches fewer than its processed
/// tokens (compressed) is suspended as a compressed conversation. With a `keeper`, its
/// state of `seq` is stored with the conversation for the next start_turn. A sequence with
/// tokens held outside the engine's pages (Engine::set_external_tokens: kvchan) throws
/// kvkit::Error, changing nothing: the turn stays open and the sequence live.
template <class T>
void finish_turn(Engine& eng, conversation::ConversationCache<T>& cache,
                        const std::string& id, SeqId seq, const SequenceStateKeeper* keeper = nullptr) {
  eng.check_self_contained(seq, "suspended in a conversation cache");  // kvchan: its pool is per sequence
  const std::vector<std::int32_t> done = eng.processed_tokens(seq);
  const std::vector<std::int32_t>& pages = eng.pages(seq);
  std::any state = keeper != nullptr ? keeper->save_sequence(seq) : std::any();
  const std::int64_t state_bytes = keeper != nullptr ? keeper->state_bytes(state) : 0;
  cache.suspend(id, done.data(), done.size(), static_cast<std::size_t>(eng.kv_len(seq)), pages.data(),
                pages.size(), std::move(state), state_bytes);
  eng.free_sequence(seq);
}

}  // namespace engine
}  // namespace kvkit
