#pragma once
// PrefixLruCache: block-level prefix caching as vLLM's v1 KV-cache manager does it, the
// baseline the ConversationCache is compared with (`kvkit chat-demo`, bench_conversation).
//
// A full page (block) of a finished request is named by the chained hash of its tokens
// (kvkit::prefix_block_hashes) and kept, holding one reference, while nothing else uses it.
// Unused cached blocks wait in an LRU queue (front = evicted first); a finished request's
// blocks are queued tail first, so a shared prefix outlives the tails behind it. A new
// request hashes its prompt's full blocks (all but its last token: that one must be
// computed to give logits) and takes the longest run found from the start; hit blocks
// leave the queue. The partly filled last page is never cached. reclaim(n) evicts from
// the queue front: the engine's answer to allocation pressure.

#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

#include "engine/block_allocator.hpp"
#include "kvkit/core/block_hash.hpp"
#include "kvkit/core/error.hpp"

namespace kvkit {
namespace engine {

class PrefixLruCache {
 public:
  struct Hit {
    std::vector<std::int32_t> pages;  // one reference each, now the caller's
    std::int32_t cached_len = 0;      // pages.size() * page_size
  };

  PrefixLruCache(BlockAllocator& alloc, std::int32_t page_size) : a_(&alloc), ps_(page_size) {
    KVKIT_CHECK(page_size > 0, "kvkit: PrefixLruCache page_size must be > 0, got ", page_size);
  }
  PrefixLruCache(const PrefixLruCache&) = delete;
  PrefixLruCache& operator=(const PrefixLruCache&) = delete;
  ~PrefixLruCache() { clear(); }

  /// Longest run of cached full blocks at the start of prompt[0, n - 1).
  Hit lookup(const std::int32_t* prompt, std::size_t n) {  // prompt: [n]
    Hit h;
    if (n < 2) return h;
    const std::vector<BlockHash> hashes = prefix_block_hashes(prompt, n - 1, ps_);
    for (const BlockHash& bh : hashes) {
      auto it = by_hash_.find(bh);
      if (it == by_hash_.end()) break;
      const std::int32_t p = it->second;
      a_->retain(p);
      unqueue(p);
      h.pages.push_back(p);
    }
    h.cached_len = static_cast<std::int32_t>(h.pages.size()) * ps_;
    ++lookups_;
    hit_blocks_ += h.pages.size();
    return h;
  }

  /// Caches the full blocks of a finished request (tokens[0, n) have K/V in `pages`) before
  /// the caller releases its references; then call queue_unused(pages).
  void cache_blocks(const std::int32_t* tokens, std::size_t n,  // tokens: [n]
                    const std::vector<std::int32_t>& pages) {
    const std::size_t full = n / static_cast<std::size_t>(ps_);
    const std::vector<BlockHash> hashes = prefix_block_hashes(tokens, full * static_cast<std::size_t>(ps_), ps_);
    for (std::size_t i = 0; i < hashes.size() && i < pages.size(); ++i) {
      if (by_hash_.count(hashes[i]) != 0) continue;  // already cached (this page or a twin)
      if (hash_of_.count(pages[i]) != 0) continue;
      a_->retain(pages[i]);
      by_hash_.emplace(hashes[i], pages[i]);
      hash_of_.emplace(pages[i], hashes[i]);
    }
  }

  /// After the request released its pages: cached blocks nobody else uses join the queue,
  /// tail first.
  void queue_unused(const std::vector<std::int32_t>& pages) {
    for (auto it = pages.rbegin(); it != pages.rend(); ++it) {
      const std::int32_t p = *it;
      if (hash_of_.count(p) == 0 || queued_.count(p) != 0 || a_->refcount(p) != 1) continue;
      queue_.push_back(p);
      queued_.emplace(p, std::prev(queue_.end()));
    }
  }

  /// Evicts unused cached blocks from the queue front until `n` pages are free again.
  std::int32_t reclaim(std::int32_t n) {
    std::int32_t freed = 0;
    while (freed < n && !queue_.empty()) {
      const std::int32_t p = queue_.front();
      queue_.pop_front();
      queued_.erase(p);
      by_hash_.erase(hash_of_.at(p));
      hash_of_.erase(p);
      a_->release(p);
      ++freed;
      ++evicted_;
    }
    return freed;
  }

  /// Drops every cached block (in use ones keep their other references).
  void clear() {
    for (const auto& kv : hash_of_) a_->release(kv.first);
    by_hash_.clear();
    hash_of_.clear();
    queue_.clear();
    queued_.clear();
  }

  std::size_t cached_blocks() const { return hash_of_.size(); }
  std::size_t queued_blocks() const { return queue_.size(); }
  std::uint64_t evicted_blocks() const { return evicted_; }
  std::uint64_t hit_blocks() const { return hit_blocks_; }
  std::uint64_t lookups() const { return lookups_; }

 private:
  void unqueue(std::int32_t p) {
    auto it = queued_.find(p);
    if (it == queued_.end()) return;
    queue_.erase(it->second);
    queued_.erase(it);
  }

  BlockAllocator* a_;
  std::int32_t ps_;
  std::unordered_map<BlockHash, std::int32_t> by_hash_;   // block hash -> page
  std::unordered_map<std::int32_t, BlockHash> hash_of_;   // page -> block hash
  std::list<std::int32_t> queue_;                          // unused cached pages, front = evict first
  std::unordered_map<std::int32_t, std::list<std::int32_t>::iterator> queued_;
  std::uint64_t evicted_ = 0, hit_blocks_ = 0, lookups_ = 0;
};

}  // namespace engine
}  // namespace kvkit
