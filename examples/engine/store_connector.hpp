#pragma once
// StoreConnector: the example engine's side of kvkit::store::BlockStore (the PikiwiDB
// seed's connector, Scheduler and Worker roles in one object).
//
//   start(prompt)   match the prompt's full blocks in the store, allocate pages, load the
//                   matched blocks into them and start the sequence on the prefix-page path
//                   (Engine::add_sequence(tokens, pages, cached_len, position)); the rest of
//                   the prompt is left pending for prefill / steps.
//   finish(id)      save the sequence's full blocks (prompt and generated tokens) that the
//                   store does not hold yet; the caller then frees the sequence.
//
// Never a wrong block: at most (prompt - 1) / page_size blocks are matched (the last prompt
// token must be computed to give logits), loading stops at the first missing, corrupt or
// unanswered block (the engine recomputes it and everything after), and pages of blocks
// that did not load go back to the allocator.
//
// Page-event contract (what keeps a rewritten page out of the store). A block is saved
// under the hash of tokens [i * P, (i + 1) * P) only while page i of the sequence still
// holds exactly the K/V the model computed for those tokens. The connector listens to the
// engine's page events and marks a page tainted when
//   - it gets an in-place kRewrite (source_page = -1): Engine::notify_rewrite, which a
//     compaction policy (a Compressor moving kept tokens to the front) must call, or
//     truncate_kv's cut of a partly kept last page;
// a copy (kRewrite with source_page set: copy-on-write, fork) inherits the source's state,
// and a page is clean again when it is freed (kRelease to refcount 0) and reallocated. A
// step hook also notes the first step after which a sequence's kv_len differs from its
// position (tokens were dropped, even at a page boundary with no rewrite): from then on
// only the full pages it had at that moment can be saved. finish() saves the leading run
// of full, untainted pages within that limit, so after a compaction only the untouched
// prefix is stored. A policy that rewrites K/V in place without notify_rewrite breaks the
// host contract, and the connector cannot see it.
//
// Pages of any element type (EngineOptions::kv_dtype): blocks are stored in the pages'
// type (BlockStore<T>, its header names the dtype), so 16-bit pages move half the bytes, and
// an engine of another dtype reading the same namespace finds a mismatch, that is a miss.
//
// Timing (load_ms, save_ms) is wall time of the store calls, for reports.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/engine.hpp"
#include "kvkit/core/block_hash.hpp"
#include "kvkit/store/block_store.hpp"

namespace kvkit {
namespace engine {

/// Settings of a StoreConnector.
struct StoreConnectorOptions {
  std::string ns;                  // store namespace: kvkit::store::make_namespace(model id, salt)
  store::KeyStyle key_style = store::KeyStyle::kPlain;  // kClusterTagged for Redis Cluster
  store::EncodeOptions encode;     // codec of saved payloads
  std::int32_t blocks_per_batch = 64;
  bool lookup = true;              // false: never match/load (a cold run that only saves)
};

/// What start() did for one request.
struct StoreStart {
  SeqId id = -1;
  std::int32_t matched_blocks = 0;  // complete in the store (every layer's K and V present)
  std::int32_t loaded_blocks = 0;   // loaded bit-exact: their tokens are not recomputed
  Status load_status;               // why loading stopped early (ok for a plain miss)
  double load_ms = 0;               // match + load
};

/// What finish() did for one sequence.
struct StoreFinish {
  std::int32_t saveable_blocks = 0;  // full, untainted leading blocks
  std::int32_t saved_blocks = 0;     // written now (the others were already stored)
  Status status;
  double save_ms = 0;                // existence probe + save
};

class StoreConnector {
 public:
  /// Connects `backend` to `engine` (both must outlive the connector; the engine's step
  /// hook it adds becomes a no-op when the connector is destroyed). Throws kvkit::Error
  /// for a bad namespace or batch size.
  StoreConnector(Engine& engine, store::BlockBackend& backend, StoreConnectorOptions options)
      : eng_(engine), opt_(std::move(options)), state_(std::make_shared<State>()) {
    const ModelConfig& c = eng_.config();
    store::BlockStoreConfig sc;
    sc.ns = opt_.ns;
    sc.num_layers = c.n_layers;
    sc.page_size = eng_.options().page_size;
    sc.num_kv_heads = c.n_kv_heads;
    sc.head_dim = c.head_dim();
    sc.key_style = opt_.key_style;
    sc.encode = opt_.encode;
    sc.blocks_per_batch = opt_.blocks_per_batch;
    store_ = eng_.with_kv_type([&](auto tag) -> std::unique_ptr<TypedStore> {
      return std::make_unique<Typed<decltype(tag)>>(eng_, backend, sc);
    });
    std::shared_ptr<State> st = state_;
    listener_ = eng_.add_page_listener([st](const PageEvent& e) { st->on_event(e); });
    eng_.add_step_hook([st](Engine& eng, const StepInfo&) { st->after_step(eng); });
  }
  ~StoreConnector() {
    state_->alive = false;
    eng_.remove_page_listener(listener_);
  }
  StoreConnector(const StoreConnector&) = delete;
  StoreConnector& operator=(const StoreConnector&) = delete;

  /// How many leading blocks of `hashes` the store holds complete (BlockStore::match_blocks).
  std::size_t match_blocks(const BlockHash* hashes, std::size_t n) { return store_->match(hashes, n); }
  std::int32_t page_size() const { return eng_.options().page_size; }

  /// Starts a request: matches and loads the longest stored prefix of `prompt` (at most
  /// (prompt.size() - 1) / page_size blocks), then adds the sequence with those tokens
  /// processed and cached. Throws kvkit::Error as Engine::add_sequence does, or "out of KV
  /// pages" (no reclaim is asked here: loading is an optimisation, so on a short pool it
  /// loads fewer blocks).
  StoreStart start(const std::vector<std::int32_t>& prompt) {
    StoreStart r;
    const std::int32_t P = page_size();
    KVKIT_CHECK(!prompt.empty(), "kvkit: StoreConnector::start needs a non-empty prompt");
    const std::size_t usable = (prompt.size() - 1) / static_cast<std::size_t>(P);
    std::vector<std::int32_t> pages;
    if (opt_.lookup && usable > 0) {
      const auto t0 = std::chrono::steady_clock::now();
      const std::vector<BlockHash> hashes = prefix_block_hashes(prompt.data(), usable * P, P);
      r.matched_blocks = static_cast<std::int32_t>(store_->match(hashes.data(), hashes.size()));
      for (std::int32_t i = 0; i < r.matched_blocks; ++i) {
        const std::int32_t p = eng_.allocator().try_allocate();
        if (p < 0) break;
        pages.push_back(p);
      }
      if (!pages.empty()) {
        const store::LoadResult lr = store_->load(hashes.data(), pages.data(), pages.size());
        r.loaded_blocks = static_cast<std::int32_t>(lr.blocks_loaded);
        r.load_status = lr.status;
      }
      // Pages past the loaded prefix may hold partial writes: give them back unused.
      while (static_cast<std::int32_t>(pages.size()) > r.loaded_blocks) {
        eng_.allocator().release(pages.back());
        pages.pop_back();
      }
      r.load_ms = ms_since(t0);
    }
    const std::int32_t cached = r.loaded_blocks * P;
    r.id = eng_.add_sequence(prompt, pages, cached, cached);
    SeqInfo& info = state_->seqs[r.id];
    info.loaded_blocks = r.loaded_blocks;
    info.load_failed = !r.load_status.is_ok();
    return r;
  }

  /// Full blocks of `id` that may be saved now (see the file comment).
  std::int32_t saveable_blocks(SeqId id) const {
    const std::int32_t P = page_size();
    std::int32_t n = std::min(eng_.kv_len(id), eng_.position(id)) / P;
    auto it = state_->seqs.find(id);
    if (eng_.kv_len(id) != eng_.position(id)) {
      // Diverged since the last step hook (or without one): only what is full now.
      if (it == state_->seqs.end() || it->second.limit < 0) n = std::min(n, eng_.kv_len(id) / P);
    }
    if (it != state_->seqs.end() && it->second.limit >= 0) n = std::min(n, it->second.limit);
    const std::vector<std::int32_t>& pages = eng_.pages(id);
    std::int32_t i = 0;
    while (i < n && !state_->tainted(pages[static_cast<std::size_t>(i)])) ++i;
    return i;
  }

  /// Saves the full, untainted leading blocks of `id` that the store lacks: blocks this
  /// request loaded are known to be there; after a load that failed on a corrupt or
  /// unanswered block everything from that block on is written again (repairing it);
  /// otherwise the store is asked which leading blocks it already holds. Does not free the
  /// sequence. A failed save is reported in the result, never thrown.
  StoreFinish finish(SeqId id) {
    StoreFinish r;
    const std::int32_t P = page_size();
    r.saveable_blocks = saveable_blocks(id);
    if (r.saveable_blocks == 0) return r;
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<std::int32_t>& toks = eng_.tokens(id);
    const std::vector<BlockHash> hashes =
        prefix_block_hashes(toks.data(), static_cast<std::size_t>(r.saveable_blocks) * P, P);
    const SeqInfo info = state_->seqs[id];
    std::size_t first = static_cast<std::size_t>(std::min(info.loaded_blocks, r.saveable_blocks));
    if (!info.load_failed && first < hashes.size())
      first += store_->match(hashes.data() + first, hashes.size() - first);
    const std::vector<std::int32_t>& pages = eng_.pages(id);
    std::size_t saved = 0;
    if (first < hashes.size())
      r.status = store_->save(hashes.data() + first, pages.data() + first, hashes.size() - first, &saved);
    r.saved_blocks = static_cast<std::int32_t>(saved);
    r.save_ms = ms_since(t0);
    return r;
  }

  /// True when a page event marked `page` as rewritten in place since it was allocated.
  bool tainted(std::int32_t page) const { return state_->tainted(page); }

 private:
  struct SeqInfo {
    std::int32_t loaded_blocks = 0;
    bool load_failed = false;
    std::int32_t limit = -1;  // blocks saveable at most (set once kv_len != position); -1: none
  };
  // Shared with the engine's listener and step hook, which may outlive the connector.
  struct State {
    bool alive = true;
    std::vector<char> taint;  // [num_pages] 1: rewritten in place since allocated
    std::unordered_map<SeqId, SeqInfo> seqs;

    bool tainted(std::int32_t p) const {
      return p >= 0 && static_cast<std::size_t>(p) < taint.size() && taint[static_cast<std::size_t>(p)] != 0;
    }
    void set(std::int32_t p, bool v) {
      if (p < 0) return;
      if (static_cast<std::size_t>(p) >= taint.size()) taint.resize(static_cast<std::size_t>(p) + 1, 0);
      taint[static_cast<std::size_t>(p)] = v ? 1 : 0;
    }
    void on_event(const PageEvent& e) {
      if (!alive) return;
      switch (e.kind) {
        case PageEventKind::kAllocate: set(e.page, false); break;
        case PageEventKind::kRelease:
          if (e.refcount == 0) set(e.page, false);
          break;
        case PageEventKind::kRewrite: set(e.page, e.source_page >= 0 ? tainted(e.source_page) : true); break;
        default: break;
      }
    }
    void after_step(Engine& eng) {
      if (!alive) return;
      const std::int32_t P = eng.options().page_size;
      for (auto& kv : seqs) {
        if (kv.second.limit >= 0 || !eng.has_sequence(kv.first)) continue;
        if (eng.kv_len(kv.first) != eng.position(kv.first)) kv.second.limit = eng.kv_len(kv.first) / P;
      }
    }
  };

  static double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }

  // The BlockStore of the pages' element type and the engine's storage views for it.
  struct TypedStore {
    virtual ~TypedStore() = default;
    virtual std::size_t match(const BlockHash* hashes, std::size_t n) = 0;
    virtual store::LoadResult load(const BlockHash* hashes, const std::int32_t* pages, std::size_t n) = 0;
    virtual Status save(const BlockHash* hashes, const std::int32_t* pages, std::size_t n, std::size_t* saved) = 0;
  };
  template <class T>
  struct Typed final : TypedStore {
    store::BlockStore<T> store;
    std::vector<PagedKVView<T>> pools;  // [n_layers] storage views (page ids are physical)
    Typed(Engine& eng, store::BlockBackend& backend, const store::BlockStoreConfig& sc) : store(backend, sc) {
      for (int l = 0; l < eng.config().n_layers; ++l) pools.push_back(eng.pool_view<T>(l));
    }
    std::size_t match(const BlockHash* hashes, std::size_t n) override { return store.match_blocks(hashes, n); }
    store::LoadResult load(const BlockHash* hashes, const std::int32_t* pages, std::size_t n) override {
      return store.load(hashes, pages, n, pools.data());
    }
    Status save(const BlockHash* hashes, const std::int32_t* pages, std::size_t n, std::size_t* saved) override {
      return store.save(hashes, pages, n, pools.data(), saved);
    }
  };

  Engine& eng_;
  StoreConnectorOptions opt_;
  std::shared_ptr<State> state_;
  std::unique_ptr<TypedStore> store_;
  int listener_ = -1;
};

}  // namespace engine
}  // namespace kvkit
