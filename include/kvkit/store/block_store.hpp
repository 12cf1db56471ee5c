#pragma once
// BlockStore: content-addressed KV blocks in an external key-value store (the PikiwiDB
// seed's connector), and the in-memory backend used when no server is configured.
//
// A block is one page of the engine's paged KV, named by its prefix-chained BlockHash
// (core/block_hash.hpp); for L layers it is 2L store values (K and V of every layer,
// block_format.hpp). The connector answers the seed's three questions:
//   - match: how many leading blocks of a request are complete in the store (every
//     layer's K and V present) -> matched tokens = blocks * page_size;
//   - load: copy those blocks into the physical pages the engine allocated for them;
//   - save: store the full blocks of a finished request.
// Logical -> physical mapping (seed §1.2.5): logical block i of a request is whatever
// physical page the engine gave it; callers pass the physical ids in logical order, or a
// sequence of a view whose page table already maps them (page_id(b, i)).
// A block that fails to load (missing piece, corrupt payload, timeout) ends the loaded
// prefix: it and every later block count as misses and the engine recomputes them. Pages
// of such blocks may have been partly written and must be treated as uncomputed.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <list>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvkit/store/block_format.hpp"

namespace kvkit {
namespace store {

/// Per-key outcome of a batched backend call.
enum class KeyState : std::uint8_t {
  kHit = 0,    // get/exists: present (value filled); put: stored
  kMiss = 1,   // get/exists: absent
  kError = 2,  // not answered: transport error, timeout, server error reply
};

/// A key-value store holding block payloads. Every call is batched: one call carries many
/// keys and fills one state per key. The returned Status is ok when every key got an
/// answer; otherwise it says why the batch stopped (kTimeout, kIoError, ...) and the keys
/// without an answer are kError (keys answered before the failure keep their result).
/// Implementations never throw from these calls.
class BlockBackend {
 public:
  virtual ~BlockBackend() = default;
  /// Reads n keys; values[i] is replaced when states[i] == kHit.
  virtual Status get(const std::string* keys,  // [n]
                     std::size_t n,
                     std::string* values,  // [n]
                     KeyState* states) = 0;  // [n]
  /// Writes n key/value pairs (overwriting).
  virtual Status put(const std::string* keys,    // [n]
                     const std::string* values,  // [n]
                     std::size_t n,
                     KeyState* states) = 0;  // [n]
  /// Presence of n keys (no values transferred).
  virtual Status exists(const std::string* keys,  // [n]
                        std::size_t n,
                        KeyState* states) = 0;  // [n]
  /// Deletes n keys (absent keys are fine).
  virtual Status remove(const std::string* keys,  // [n]
                        std::size_t n) = 0;
};

/// In-process backend: a byte-bounded LRU map (key bytes + value bytes count towards the
/// capacity). get and exists refresh recency; put evicts least-recently-used entries until
/// the new value fits; a single value larger than the capacity is not stored (kError).
/// Thread-safe (one mutex).
class MemoryBackend final : public BlockBackend {
 public:
  explicit MemoryBackend(std::size_t capacity_bytes) : capacity_(capacity_bytes) {
    KVKIT_CHECK(capacity_bytes > 0, "kvkit: MemoryBackend capacity must be > 0 bytes");
  }

  Status get(const std::string* keys, std::size_t n, std::string* values,
             KeyState* states) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (std::size_t i = 0; i < n; ++i) {
      auto it = map_.find(keys[i]);
      if (it == map_.end()) {
        states[i] = KeyState::kMiss;
        continue;
      }
      lru_.splice(lru_.begin(), lru_, it->second);
      values[i].assign(it->second->second);
      states[i] = KeyState::kHit;
    }
    return Status::ok();
  }

  Status put(const std::string* keys, const std::string* values, std::size_t n,
             KeyState* states) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (std::size_t i = 0; i < n; ++i) {
      erase_locked(keys[i]);
      const std::size_t cost = keys[i].size() + values[i].size();
      if (cost > capacity_) {
        states[i] = KeyState::kError;
        continue;
      }
      while (used_ + cost > capacity_ && !lru_.empty()) erase_locked(lru_.back().first);
      lru_.emplace_front(keys[i], values[i]);
      map_.emplace(lru_.front().first, lru_.begin());
      used_ += cost;
      states[i] = KeyState::kHit;
    }
    return Status::ok();
  }

  Status exists(const std::string* keys, std::size_t n, KeyState* states) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (std::size_t i = 0; i < n; ++i) {
      auto it = map_.find(keys[i]);
      if (it != map_.end()) lru_.splice(lru_.begin(), lru_, it->second);
      states[i] = it == map_.end() ? KeyState::kMiss : KeyState::kHit;
    }
    return Status::ok();
  }

  Status remove(const std::string* keys, std::size_t n) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (std::size_t i = 0; i < n; ++i) erase_locked(keys[i]);
    return Status::ok();
  }

  /// Bytes held (keys + values), always <= capacity().
  std::size_t used_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return used_;
  }
  std::size_t capacity() const { return capacity_; }
  /// Entries held.
  std::size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return map_.size();
  }

 private:
  using Entry = std::pair<std::string, std::string>;
  void erase_locked(const std::string& key) {
    auto it = map_.find(key);
    if (it == map_.end()) return;
    used_ -= it->second->first.size() + it->second->second.size();
    auto node = it->second;
    map_.erase(it);  // the map's key views the node's string: erase it first
    lru_.erase(node);
  }

  std::size_t capacity_;
  std::size_t used_ = 0;
  std::list<Entry> lru_;  // front = most recently used
  std::unordered_map<std::string_view, std::list<Entry>::iterator> map_;
  mutable std::mutex mu_;
};

/// Configuration of a BlockStore: who the blocks belong to and their geometry.
struct BlockStoreConfig {
  std::string ns;             // namespace: make_namespace(model fingerprint, salt)
  std::int32_t num_layers = 0;
  std::int32_t page_size = 0;     // tokens per block (= the engine's page size)
  std::int32_t num_kv_heads = 0;
  std::int32_t head_dim = 0;
  std::int32_t v_head_dim = 0;    // 0: head_dim
  KeyStyle key_style = KeyStyle::kPlain;
  EncodeOptions encode;           // codec and payload row order
  std::int32_t blocks_per_batch = 64;  // blocks per backend call (bounds client memory)
};

/// Result of BlockStore::load.
struct LoadResult {
  std::size_t blocks_loaded = 0;  // leading blocks now in their pages, bit-exact
  Status status;                  // why loading stopped early (ok when all were loaded or
                                  // the first failure was a plain miss)
};

/// Counters (cumulative, for reports).
struct BlockStoreStats {
  std::uint64_t blocks_saved = 0;
  std::uint64_t blocks_loaded = 0;
  std::uint64_t rejected_payloads = 0;  // present but failed decode_block's checks
};

/// The connector over one backend for one model's pool geometry. Not thread-safe (one per
/// engine thread; the backend may be shared when it is thread-safe).
template <class T>
class BlockStore {
 public:
  BlockStore(BlockBackend& backend, BlockStoreConfig config)
      : backend_(&backend), cfg_(std::move(config)) {
    KVKIT_CHECK(cfg_.num_layers > 0, "kvkit: BlockStore num_layers must be > 0, got ",
                cfg_.num_layers);
    KVKIT_CHECK(cfg_.page_size > 0 && cfg_.num_kv_heads > 0 && cfg_.head_dim > 0 &&
                    cfg_.v_head_dim >= 0,
                "kvkit: BlockStore geometry page_size=", cfg_.page_size,
                " num_kv_heads=", cfg_.num_kv_heads, " head_dim=", cfg_.head_dim,
                " v_head_dim=", cfg_.v_head_dim, " is invalid");
    KVKIT_CHECK(cfg_.blocks_per_batch > 0, "kvkit: BlockStore blocks_per_batch must be > 0, got ",
                cfg_.blocks_per_batch);
    KVKIT_CHECK(cfg_.ns.find_first_of(":{}") == std::string::npos,
                "kvkit: BlockStore namespace '", cfg_.ns, "' must not contain ':', '{' or '}'");
  }

  const BlockStoreConfig& config() const { return cfg_; }
  const BlockStoreStats& stats() const { return stats_; }

  /// Key of one half-block under this store's namespace and style.
  std::string key(int layer, const BlockHash& h, KVKind kind) const {
    return block_key(cfg_.ns, layer, h, kind, cfg_.key_style);
  }

  /// Number of leading blocks of `hashes` whose every layer's K and V are present; probes
  /// a batch at a time and stops at the first incomplete block. A backend failure ends
  /// the count at the failed block (a miss, never an error). `st` (optional) gets it.
  std::size_t match_blocks(const BlockHash* hashes,  // [n] prefix-chained, in order
                           std::size_t n, Status* st = nullptr) {
    const std::size_t per_block = 2 * static_cast<std::size_t>(cfg_.num_layers);
    std::size_t matched = 0;
    if (st != nullptr) *st = Status::ok();
    while (matched < n) {
      const std::size_t nb = std::min<std::size_t>(n - matched, cfg_.blocks_per_batch);
      fill_keys(hashes + matched, nb);
      states_.resize(keys_.size());
      Status s = backend_->exists(keys_.data(), keys_.size(), states_.data());
      if (st != nullptr && !s.is_ok()) *st = s;
      for (std::size_t b = 0; b < nb; ++b) {
        for (std::size_t j = 0; j < per_block; ++j)
          if (states_[b * per_block + j] != KeyState::kHit) return matched;
        ++matched;
      }
    }
    return matched;
  }

  /// Matched tokens for a request: match_blocks * page_size.
  std::size_t match_tokens(const BlockHash* hashes, std::size_t n) {  // hashes: [n]
    return match_blocks(hashes, n) * static_cast<std::size_t>(cfg_.page_size);
  }

  /// Loads blocks [0, n) into physical pages pages[0..n) of every layer's view
  /// (layers[l] is layer l; host views of this store's geometry). Stops at the first block
  /// with any piece missing, rejected or unanswered; see LoadResult.
  LoadResult load(const BlockHash* hashes,  // [n]
                  const std::int32_t* pages,  // [n] physical page of each logical block
                  std::size_t n,
                  const PagedKVView<T>* layers) {  // [num_layers]
    LoadResult r;
    r.status = check_views(layers);
    if (!r.status.is_ok()) return r;
    const std::size_t per_block = 2 * static_cast<std::size_t>(cfg_.num_layers);
    while (r.blocks_loaded < n) {
      const std::size_t first = r.blocks_loaded;
      const std::size_t nb = std::min<std::size_t>(n - first, cfg_.blocks_per_batch);
      fill_keys(hashes + first, nb);
      states_.resize(keys_.size());
      values_.resize(keys_.size());
      const Status s = backend_->get(keys_.data(), keys_.size(), values_.data(), states_.data());
      for (std::size_t b = 0; b < nb; ++b) {
        for (std::size_t j = 0; j < per_block; ++j) {
          const std::size_t i = b * per_block + j;
          if (states_[i] != KeyState::kHit) {
            r.status = states_[i] == KeyState::kError ? s : Status::ok();
            if (r.status.is_ok() && states_[i] == KeyState::kError)
              r.status = make_status(StatusCode::kIoError, "store did not answer ", keys_[i]);
            return finish(r);
          }
          const int layer = static_cast<int>(j / 2);
          const KVKind kind = j % 2 == 0 ? KVKind::kKey : KVKind::kValue;
          const Status d = decode_block(values_[i], expect(layer, hashes[first + b], kind),
                                        layers[layer], pages[first + b], scratch_);
          if (!d.is_ok()) {
            ++stats_.rejected_payloads;
            r.status = make_status(d.code(), keys_[i], ": ", d.message());
            return finish(r);
          }
        }
        ++r.blocks_loaded;
      }
    }
    return finish(r);
  }

  /// load() for the first n logical blocks of sequence `seq` of the views' page table
  /// (pages = layers[0].page_id(seq, i); every layer shares one table).
  LoadResult load_sequence(const BlockHash* hashes,  // [n]
                           std::size_t n, const PagedKVView<T>* layers,  // [num_layers]
                           std::int32_t seq) {
    LoadResult r;
    r.status = sequence_pages(layers, seq, n);
    if (!r.status.is_ok()) return r;
    return load(hashes, seq_pages_.data(), n, layers);
  }

  /// Saves full blocks [0, n) from physical pages pages[0..n) of every layer (a block is
  /// saved only as a whole: its 2L values go in one backend call). Returns the first
  /// failure; `saved` (optional) gets the number of leading blocks fully stored.
  Status save(const BlockHash* hashes,  // [n]
              const std::int32_t* pages,  // [n]
              std::size_t n,
              const PagedKVView<T>* layers,  // [num_layers]
              std::size_t* saved = nullptr) {
    if (saved != nullptr) *saved = 0;
    KVKIT_RETURN_IF_ERROR(check_views(layers));
    const std::size_t per_block = 2 * static_cast<std::size_t>(cfg_.num_layers);
    std::size_t done = 0;
    while (done < n) {
      const std::size_t nb = std::min<std::size_t>(n - done, cfg_.blocks_per_batch);
      fill_keys(hashes + done, nb);
      values_.resize(keys_.size());
      states_.resize(keys_.size());
      for (std::size_t b = 0; b < nb; ++b)
        for (std::size_t j = 0; j < per_block; ++j) {
          const int layer = static_cast<int>(j / 2);
          const KVKind kind = j % 2 == 0 ? KVKind::kKey : KVKind::kValue;
          KVKIT_RETURN_IF_ERROR(encode_block(layers[layer], kind, pages[done + b],
                                             cfg_.page_size, static_cast<std::uint32_t>(layer),
                                             hashes[done + b], cfg_.encode, scratch_,
                                             &values_[b * per_block + j]));
        }
      const Status s = backend_->put(keys_.data(), values_.data(), keys_.size(), states_.data());
      for (std::size_t b = 0; b < nb; ++b) {
        for (std::size_t j = 0; j < per_block; ++j)
          if (states_[b * per_block + j] != KeyState::kHit)
            return s.is_ok() ? make_status(StatusCode::kIoError, "store refused ",
                                           keys_[b * per_block + j])
                             : s;
        ++done;
        ++stats_.blocks_saved;
        if (saved != nullptr) *saved = done;
      }
      if (!s.is_ok()) return s;
    }
    return Status::ok();
  }

  /// save() of the first n logical blocks of sequence `seq` (full pages only: n must not
  /// exceed seq_len / page_size).
  Status save_sequence(const BlockHash* hashes,  // [n]
                       std::size_t n, const PagedKVView<T>* layers,  // [num_layers]
                       std::int32_t seq, std::size_t* saved = nullptr) {
    if (saved != nullptr) *saved = 0;
    KVKIT_RETURN_IF_ERROR(sequence_pages(layers, seq, n));
    KVKIT_CHECK_STATUS(static_cast<std::size_t>(layers[0].seq_len(seq) / cfg_.page_size) >= n,
                       StatusCode::kOutOfRange, "sequence ", seq, " has ",
                       layers[0].seq_len(seq) / cfg_.page_size, " full blocks, asked to save ", n);
    return save(hashes, seq_pages_.data(), n, layers, saved);
  }

 private:
  void fill_keys(const BlockHash* hashes, std::size_t nb) {  // hashes: [nb]
    const std::size_t per_block = 2 * static_cast<std::size_t>(cfg_.num_layers);
    keys_.resize(nb * per_block);
    for (std::size_t b = 0; b < nb; ++b)
      for (std::size_t j = 0; j < per_block; ++j)
        keys_[b * per_block + j] = key(static_cast<int>(j / 2), hashes[b],
                                       j % 2 == 0 ? KVKind::kKey : KVKind::kValue);
  }

  BlockExpect expect(int layer, const BlockHash& h, KVKind kind) const {
    BlockExpect e;
    e.dtype = dtype_of<T>::value;
    e.kind = kind;
    e.layer = static_cast<std::uint32_t>(layer);
    e.page_size = static_cast<std::uint32_t>(cfg_.page_size);
    e.num_heads = static_cast<std::uint32_t>(cfg_.num_kv_heads);
    e.head_dim = static_cast<std::uint32_t>(
        kind == KVKind::kKey || cfg_.v_head_dim == 0 ? cfg_.head_dim : cfg_.v_head_dim);
    e.tokens = static_cast<std::uint32_t>(cfg_.page_size);
    e.hash = h;
    return e;
  }

  Status check_views(const PagedKVView<T>* layers) const {
    KVKIT_CHECK_STATUS(layers != nullptr, StatusCode::kInvalidArgument, "null layer views");
    const std::int32_t vdim = cfg_.v_head_dim == 0 ? cfg_.head_dim : cfg_.v_head_dim;
    for (std::int32_t l = 0; l < cfg_.num_layers; ++l) {
      const PagedKVView<T>& v = layers[l];
      KVKIT_CHECK_STATUS(v.space == MemorySpace::kHost, StatusCode::kWrongMemorySpace, "layer ",
                         l, " view is not in host memory");
      KVKIT_CHECK_STATUS(v.page_size == cfg_.page_size && v.num_kv_heads == cfg_.num_kv_heads &&
                             v.head_dim == cfg_.head_dim && v.v_head_dim == vdim,
                         StatusCode::kInvalidArgument, "layer ", l,
                         " view geometry differs from the store's");
    }
    return Status::ok();
  }

  Status sequence_pages(const PagedKVView<T>* layers, std::int32_t seq, std::size_t n) {
    KVKIT_CHECK_STATUS(layers != nullptr, StatusCode::kInvalidArgument, "null layer views");
    const PagedKVView<T>& v = layers[0];
    KVKIT_CHECK_STATUS(seq >= 0 && seq < v.batch_size, StatusCode::kOutOfRange, "sequence ", seq,
                       " outside [0, ", v.batch_size, ")");
    KVKIT_RETURN_IF_ERROR(kvkit::detail::check_sequence_pages(v, seq));
    KVKIT_CHECK_STATUS(static_cast<std::size_t>(v.num_pages(seq)) >= n, StatusCode::kOutOfRange,
                       "sequence ", seq, " has ", v.num_pages(seq), " pages, need ", n);
    seq_pages_.resize(n);
    for (std::size_t i = 0; i < n; ++i)
      seq_pages_[i] = v.page_id(seq, static_cast<std::int32_t>(i));
    return Status::ok();
  }

  LoadResult& finish(LoadResult& r) {
    stats_.blocks_loaded += r.blocks_loaded;
    return r;
  }

  BlockBackend* backend_;
  BlockStoreConfig cfg_;
  BlockStoreStats stats_;
  std::vector<std::string> keys_;  // reused across calls (keep capacity)
  std::vector<std::string> values_;
  std::vector<KeyState> states_;
  std::vector<std::int32_t> seq_pages_;
  BlockScratch scratch_;
};

}  // namespace store
}  // namespace kvkit
