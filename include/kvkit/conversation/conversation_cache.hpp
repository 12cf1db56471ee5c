#pragma once
// ConversationCache: keeps a conversation's KV pages alive between turns, so turn k
// processes only its new tokens (seed conversation-caching.md, issue 19).
//
// State per conversation id: the pages holding its K/V (one cache reference each), the
// token ids those pages cover ("computed tokens": K/V present for exactly these), the turn
// number and the time of its last activity. Lifecycle:
//   create(id)                 a new conversation, running its first turn (holds no pages);
//   suspend(id, tokens, pages) the turn finished: the cache retains every page of the
//                              request, the partly filled last page included (block-level
//                              prefix caching cannot reuse that one), then the caller frees
//                              its request;
//   resume(id, prompt)         the next turn: the longest common prefix L of the cached
//                              tokens and the prompt is kept (L = all cached tokens when the
//                              prompt extends them; at most prompt length - 1, so the request
//                              has a token to feed), pages past ceil(L / page_size) are
//                              released, and the kept pages' references are handed to the
//                              request, which starts with L tokens cached;
//   end(id)                    frees everything; resuming it later is an error.
// A running conversation holds no cache references, so eviction can never take pages of a
// running request: those references belong to the request.
//
// Eviction (whole conversations, least recently active first): the idle timeout
// (evict_idle(), also checked on every create / suspend / resume), max_active (running +
// suspended conversations), page_budget (page references the cache holds) and allocator
// pressure: reclaim(n) evicts until n pages went back to the host's free list (a page
// shared with a fork or a running request is not freed by dropping the cache's reference,
// so reclaim keeps going; Params::trim_under_pressure drops only as many tail pages of the
// LRU conversation as needed, so its prefix stays resumable). With a BlockStore, an evicted conversation is first spilled:
// its pages are saved as content-addressed blocks (chained BlockHash of the page's tokens;
// the partial last page is saved whole, named by the hash of the tokens it holds), and
// resume restores as many leading blocks as load back intact, into freshly allocated pages
// (a failed or missing block is a miss: those tokens are recomputed, never wrong).
//
// Branching: fork(src, dst) gives dst the same pages, shared by refcount; the host's
// copy-on-write copies a shared partly filled page before writing into it (set
// Params::fork_copies_partial_page for a host without copy-on-write: the partial page is
// copied at fork time through PageHost::copy_page).
//
// Cross-conversation prefix sharing (Params::share_prefixes): every full page a suspended
// conversation holds is indexed by the chained BlockHash of the tokens up to its end (the
// same name prefix caching and the BlockStore use), and the index holds one reference of
// its own on each indexed page. create(id, prompt) and the resume of an evicted
// conversation take the longest run of indexed pages matching the prompt's full pages
// from the start (a page is shared only when the whole chain up to it matches, so its K/V
// is exactly what recomputing would write: same tokens at the same positions), retained
// by refcount instead of recomputed; a ChatML system prompt is then held once however many
// conversations start with it. Eviction of a conversation drops its own references; its
// indexed pages that no other conversation holds join an "unused" queue (tail pages
// first) and are released to the host only when room is needed (reclaim, page_budget),
// as a block-level prefix cache keeps freed blocks until reuse, so a conversation evicted
// whole can still find its prefix when it returns. page_budget then counts distinct pages:
// one per indexed page plus one per holder of a page outside the index (the partial last
// page). reclaim prefers, in LRU order, a conversation whose eviction releases pages.
//
// Compressed conversations: a turn whose sequence was compressed (a policy such as R1KV
// dropped tokens, so only kv_len < n of its n processed tokens keep K/V) is suspended with
// the kv_len overload of suspend(). Its pages then hold the K/V of a *subset* of its
// tokens, compacted to slots 0..kv_len-1, not a token prefix, so the cache records the
// position (n, all processed tokens) apart from the cached length, and:
//  - resume continues it only when the prompt extends its whole token history by at least
//    one token (the usual chat turn: history + new user tokens): all its pages are handed
//    over with cached_len = kv_len and Resume::position = n (Engine::add_sequence's
//    four-argument form). Any other prompt (an edit, a truncation, the history alone) is a
//    miss: every page is released and the turn recomputes from token 0. No prefix of a
//    compressed cache is "the K/V of those tokens", so there is no partial reuse;
//  - its pages are never indexed for share_prefixes nor spilled to the BlockStore (both
//    name a page by the hash of the token prefix it would hold: a compressed page does not
//    hold that prefix, so sharing or restoring it would hand out wrong K/V). Evicting a
//    compressed conversation just drops it (its resume recomputes everything), and
//    trim_under_pressure evicts it whole (a cut compressed cache is not what the policy
//    would have kept);
//  - the host may store state of its own with a suspended conversation (suspend's
//    `state`, e.g. the compressor's window of recent queries, which the next compression
//    needs exactly as an uninterrupted run would have it). The cache hands it back
//    (Resume::state) only on a resume that continues the whole history, and drops it with
//    the pages otherwise (miss, divergence, eviction, trimming, end); forks copy it. It
//    does not count against page_budget (it is host memory, not pages); the host says how
//    many bytes it takes and host_state_bytes() reports the total held, so a report of
//    what suspended conversations cost can include it. Uncompressed conversations may
//    carry state too.
//
// The cache talks to the engine only through PageHost (allocate, retain, release,
// refcount, copy, per-layer pool views for the store), so it depends on no engine. The
// clock is injectable (seconds, monotonic). Not thread-safe: one per engine thread.
// Configuration and bad calls (unknown id, resume of an ended conversation, fork of a
// running request, a conversation larger than the page budget) throw kvkit::Error naming
// the value, before any page reference changes.

#include <algorithm>
#include <any>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kvkit/core/block_hash.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/store/block_store.hpp"

namespace kvkit {
namespace conversation {

/// What the cache needs from the engine's page allocator. Calls are synchronous; none may
/// call back into the cache (in particular try_allocate must not run the engine's reclaim).
template <class T>
class PageHost {
 public:
  virtual ~PageHost() = default;
  /// Tokens per page.
  virtual std::int32_t page_size() const = 0;
  /// A free page with one reference (the caller's), or -1 when none is free.
  virtual std::int32_t try_allocate() = 0;
  /// Adds a reference to an in-use page.
  virtual void retain(std::int32_t page) = 0;
  /// Drops one reference; returns the references left (0: the page is free again).
  virtual std::int32_t release(std::int32_t page) = 0;
  /// References a page has now.
  virtual std::int32_t refcount(std::int32_t page) const = 0;
  /// Copies page `src` to `dst` (all layers, K and V).
  virtual void copy_page(std::int32_t src, std::int32_t dst) = 0;
  /// One view per layer over the K/V pools (only storage, geometry and strides are used),
  /// for spilling to and restoring from a BlockStore; null when the host has none.
  virtual const PagedKVView<T>* pool_views() = 0;  // [num_layers] or null
};

enum class State : std::uint8_t {
  kRunning,    // a request holds its pages (the cache holds none)
  kSuspended,  // the cache holds its pages
  kSpilled,    // evicted to the BlockStore; resume restores what loads back
  kEvicted,    // evicted without a copy; resume recomputes the whole prompt
};

inline const char* to_string(State s) {
  switch (s) {
    case State::kRunning: return "running";
    case State::kSuspended: return "suspended";
    case State::kSpilled: return "spilled";
    case State::kEvicted: return "evicted";
  }
  return "unknown";
}

/// Why a conversation was evicted (Metrics::evictions_by counts each).
enum class EvictReason : std::uint8_t { kTimeout = 0, kMaxActive, kPageBudget, kPressure, kManual };
inline constexpr int kNumEvictReasons = 5;

struct Params {
  double idle_timeout_s = 0.0;        // evict a suspended conversation idle this long; 0: never
  std::int32_t max_active = 0;        // running + suspended conversations; 0: no limit
  std::int32_t page_budget = 0;       // page references the cache may hold (a page shared by
                                      // forks counts once per holder); 0: no own limit
  bool spill = false;                 // spill evicted conversations to the BlockStore
  bool fork_copies_partial_page = false;  // copy the shared partial page at fork time
  bool trim_under_pressure = false;  // reclaim(n) drops the LRU conversation's pages from its
                                     // tail, as many as needed (its prefix stays cached),
                                     // instead of evicting it whole; ignored with spill
  bool share_prefixes = false;  // index full pages by chained token hash and share them by
                                // refcount across conversations (see the file comment)
};

/// Cumulative counters (for reports and the chat demo's JSON).
struct Metrics {
  std::uint64_t resumes = 0;             // resume() calls
  std::uint64_t hits = 0;                // resumes that reused >= 1 token
  std::uint64_t prompt_tokens = 0;       // prompt tokens of all resumes
  std::uint64_t tokens_reused = 0;       // prompt tokens whose K/V were still in memory
  std::uint64_t tokens_restored = 0;     // prompt tokens whose K/V came back from the store
  std::uint64_t tokens_released = 0;     // cached tokens dropped because a prompt diverged
  std::uint64_t evictions = 0;           // conversations evicted (any reason)
  std::uint64_t evictions_by[kNumEvictReasons] = {};
  std::uint64_t pages_freed = 0;         // pages eviction returned to the free list
  std::uint64_t pages_trimmed = 0;       // tail pages dropped by trim_under_pressure
  std::uint64_t spills = 0;              // evictions that saved >= 1 block
  std::uint64_t spilled_blocks = 0;
  std::uint64_t spill_failures = 0;      // saves that stopped early (a shorter prefix kept)
  std::uint64_t restores = 0;            // resumes that loaded >= 1 block
  std::uint64_t restored_blocks = 0;
  std::uint64_t restore_misses = 0;      // resumes of a spilled conversation that loaded less than asked
  std::uint64_t forks = 0;
  std::uint64_t shared_pages = 0;        // pages create() / resume() of an evicted or spilled
                                         // conversation took from the prefix index
  std::uint64_t shared_tokens = 0;       // tokens those pages cover
  std::uint64_t unused_pages_freed = 0;  // unused indexed pages released to the host
  std::uint64_t compressed_hits = 0;     // resumes that continued a compressed conversation
  std::uint64_t compressed_misses = 0;   // resumes of a compressed conversation (in memory)
                                         // whose prompt did not extend its history: recomputed
  std::uint64_t compressed_evictions = 0;  // compressed conversations evicted (dropped, never spilled)
  double hit_rate() const { return resumes == 0 ? 0.0 : static_cast<double>(hits) / resumes; }
  /// Prompt tokens that needed no prefill thanks to the cache (memory + store).
  std::uint64_t prefill_tokens_avoided() const { return tokens_reused + tokens_restored; }
};

/// What resume() hands to the next turn's request.
struct Resume {
  std::vector<std::int32_t> pages;   // ceil(cached_len / page_size) pages; one reference each
                                     // now belongs to the caller (add_sequence takes them)
  std::int32_t cached_len = 0;       // leading prompt tokens whose K/V those pages hold
                                     // (compressed: kept tokens of the first `position`)
  std::int32_t position = 0;         // leading prompt tokens already processed: cached_len,
                                     // or more when a compressed conversation continues
  std::int32_t restored_tokens = 0;  // of cached_len, how many came back from the store
  std::int32_t turn = 0;             // turn number of this request (0 = first)
  std::any state;                    // the host state suspend() stored, when this resume
                                     // continues the whole history (else empty)
};

/// Seconds on a monotonic clock.
using Clock = std::function<double()>;

inline double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class T = float>
class ConversationCache {
 public:
  /// `store` (optional, not owned) is required when params.spill is set; its page size must
  /// equal the host's. Throws kvkit::Error naming a bad value.
  ConversationCache(PageHost<T>& host, Params params, Clock clock = {},
                    store::BlockStore<T>* store = nullptr)
      : host_(&host), p_(params), clock_(clock ? std::move(clock) : Clock(steady_seconds)),
        store_(store), ps_(host.page_size()) {
    KVKIT_CHECK(ps_ > 0, "kvkit: ConversationCache: host page_size must be > 0, got ", ps_);
    KVKIT_CHECK(p_.idle_timeout_s >= 0.0, "kvkit: ConversationCache idle_timeout_s must be >= 0, got ",
                p_.idle_timeout_s);
    KVKIT_CHECK(p_.max_active >= 0, "kvkit: ConversationCache max_active must be >= 0, got ",
                p_.max_active);
    KVKIT_CHECK(p_.page_budget >= 0, "kvkit: ConversationCache page_budget must be >= 0, got ",
                p_.page_budget);
    KVKIT_CHECK(!p_.spill || store_ != nullptr, "kvkit: ConversationCache spill=true needs a BlockStore");
    if (store_ != nullptr)
      KVKIT_CHECK(store_->config().page_size == ps_, "kvkit: ConversationCache: store page_size ",
                  store_->config().page_size, " differs from the host's ", ps_);
  }
  ConversationCache(const ConversationCache&) = delete;
  ConversationCache& operator=(const ConversationCache&) = delete;
  /// Releases every page the cache still holds.
  ~ConversationCache() {
    for (auto& kv : convs_)
      for (std::int32_t pg : kv.second.pages) host_->release(pg);
    for (auto& kv : idx_) host_->release(kv.first);
  }

  const Params& params() const { return p_; }
  const Metrics& metrics() const { return m_; }
  std::int32_t page_size() const { return ps_; }

  /// Starts conversation `id` (its first turn is running; it holds no pages yet). An id
  /// that was ended may be used again. Throws when `id` is live.
  void create(const std::string& id) {
    KVKIT_CHECK(convs_.count(id) == 0, "kvkit: conversation '", id, "' already exists (state ",
                to_string(convs_.at(id).state), ")");
    evict_idle();
    ended_.erase(id);
    Conv c;
    c.state = State::kRunning;
    c.last = clock_();
    convs_.emplace(id, std::move(c));
    ++running_;
    enforce_limits(nullptr);
  }

  /// create(id) for a first turn whose prompt is `prompt[0, n)`: with share_prefixes, the
  /// longest run of indexed pages matching the prompt's full pages (all but its last token)
  /// is handed to the request like resume() does (Resume::pages, cached_len); without it,
  /// or when nothing matches, the Resume is empty. Throws as create(id) does.
  Resume create(const std::string& id, const std::int32_t* prompt,  // [n]
                std::size_t n) {
    KVKIT_CHECK(n > 0 && prompt != nullptr, "kvkit: create of conversation '", id,
                "' with an empty prompt");
    create(id);
    Resume r;
    if (!p_.share_prefixes) return r;
    // The prompt's full pages, all but its last token (it must be fed to give logits).
    Conv& c = convs_.at(id);
    const std::size_t ps = static_cast<std::size_t>(ps_);
    BlockHash prev = BlockHash::root();
    for (std::size_t start = 0; start + ps <= n - 1; start += ps) {
      prev = block_hash(prev, prompt + start, ps);
      auto it = by_hash_.find(prev);
      if (it == by_hash_.end()) break;
      host_->retain(it->second);  // the request's reference
      hold(it->second);
      r.pages.push_back(it->second);
      c.chain.push_back(prev);
    }
    lend(c, r.pages);
    r.cached_len = static_cast<std::int32_t>(r.pages.size()) * ps_;
    r.position = r.cached_len;
    m_.shared_pages += r.pages.size();
    m_.shared_tokens += static_cast<std::uint64_t>(r.cached_len);
    return r;
  }
  Resume create(const std::string& id, const std::vector<std::int32_t>& prompt) {
    return create(id, prompt.data(), prompt.size());
  }

  /// Hands the cached pages of `id` to its next turn, whose full prompt (history + new
  /// tokens) is `prompt[0, n)`: see the file comment. Throws for an unknown or ended id, a
  /// running conversation or an empty prompt, changing nothing.
  Resume resume(const std::string& id, const std::int32_t* prompt,  // [n]
                std::size_t n) {
    Conv& c = check_resume(id, n);
    KVKIT_CHECK(prompt != nullptr, "kvkit: resume of conversation '", id, "': null prompt");
    if (c.compressed) {  // all or nothing: the prompt must extend the whole history
      const bool extends = n > c.tokens.size() && std::equal(c.tokens.begin(), c.tokens.end(), prompt);
      return finish_resume(c, extends ? c.tokens.size() : 0, n);
    }
    const std::size_t limit = std::min(c.tokens.size(), n - 1);  // feed at least one token
    const std::size_t common = static_cast<std::size_t>(
        std::mismatch(c.tokens.begin(), c.tokens.begin() + static_cast<std::ptrdiff_t>(limit), prompt).first -
        c.tokens.begin());
    return finish_resume(c, common, n);
  }

  /// resume() for a caller that guarantees its prompt of `n` tokens extends the cached
  /// tokens (it appended the new turn to the previous request's tokens, as `kvkit chat`
  /// does): no token comparison, so the cost does not grow with the history.
  Resume resume_extending(const std::string& id, std::size_t n) {
    Conv& c = check_resume(id, n);
    if (c.compressed) return finish_resume(c, n > c.tokens.size() ? c.tokens.size() : 0, n);
    return finish_resume(c, std::min(c.tokens.size(), n - 1), n);
  }
  Resume resume(const std::string& id, const std::vector<std::int32_t>& prompt) {
    return resume(id, prompt.data(), prompt.size());
  }

  /// The running turn of `id` finished with K/V for exactly `tokens[0, n)` in `pages`
  /// (ceil(n / page_size) pages, in order). The cache retains each page (the caller then
  /// frees its request), then enforces its limits (evicting other conversations). Throws,
  /// retaining nothing, for an unknown / ended / not running id, a page count that does not
  /// match, or more pages than page_budget.
  void suspend(const std::string& id, const std::int32_t* tokens,  // [n]
               std::size_t n, const std::int32_t* pages,              // [npages]
               std::size_t npages) {
    suspend(id, tokens, n, n, pages, npages);
  }
  void suspend(const std::string& id, const std::vector<std::int32_t>& tokens,
               const std::vector<std::int32_t>& pages) {
    suspend(id, tokens.data(), tokens.size(), pages.data(), pages.size());
  }

  /// suspend() for a turn that processed `tokens[0, n)` but whose pages hold K/V of only
  /// `kv_len` <= n of them (ceil(kv_len / page_size) pages): kv_len < n is a compressed
  /// conversation (see the file comment: resumable only by a prompt extending all n
  /// tokens, never shared nor spilled). `state` (optional) is the host's own state of the
  /// turn, handed back by the resume that continues it (Resume::state), taking
  /// `state_bytes` of host memory (counted by host_state_bytes() while the cache holds it).
  /// Throws as suspend() does, and for kv_len > n or state_bytes < 0.
  void suspend(const std::string& id, const std::int32_t* tokens,  // [n]
               std::size_t n, std::size_t kv_len, const std::int32_t* pages,  // [npages]
               std::size_t npages, std::any state = {}, std::int64_t state_bytes = 0) {
    Conv& c = live(id, "suspend");
    KVKIT_CHECK(state_bytes >= 0, "kvkit: suspend of conversation '", id, "': state_bytes ", state_bytes,
                " is negative");
    KVKIT_CHECK(c.state == State::kRunning, "kvkit: suspend of conversation '", id, "' which is ",
                to_string(c.state), ", not running");
    KVKIT_CHECK(kv_len <= n, "kvkit: suspend of conversation '", id, "': kv_len ", kv_len,
                " exceeds its ", n, " processed tokens");
    const std::size_t need = (kv_len + static_cast<std::size_t>(ps_) - 1) / static_cast<std::size_t>(ps_);
    KVKIT_CHECK(npages == need, "kvkit: suspend of conversation '", id, "': ", npages, " pages for ",
                kv_len, " tokens of page size ", ps_, ", expected ", need);
    KVKIT_CHECK(n == 0 || tokens != nullptr, "kvkit: suspend of conversation '", id, "': null tokens");
    KVKIT_CHECK(p_.page_budget == 0 || npages <= static_cast<std::size_t>(p_.page_budget),
                "kvkit: conversation '", id, "' needs ", npages, " pages, more than the page budget ",
                p_.page_budget);
    for (std::size_t i = 0; i < npages; ++i)
      KVKIT_CHECK(pages[i] >= 0 && host_->refcount(pages[i]) > 0, "kvkit: suspend of conversation '",
                  id, "': page ", pages[i], " is not allocated");
    for (std::size_t i = 0; i < npages; ++i) host_->retain(pages[i]);
    c.pages.assign(pages, pages + npages);
    c.tokens.assign(tokens, tokens + n);
    c.compressed = kv_len < n;
    c.kv_len = kv_len;
    c.host_state = std::move(state);
    c.host_state_bytes = state_bytes;
    c.n_private = static_cast<std::int32_t>(npages);
    if (p_.share_prefixes) index_pages(c);
    private_refs_ += c.n_private;
    c.state = State::kSuspended;
    c.last = clock_();
    --running_;
    lru_push(id, c);
    evict_idle();
    enforce_limits(&c);
  }

  /// The running turn of `id` failed before it could be suspended: the conversation keeps
  /// its turn count but no cache (the next resume recomputes). The request's pages are the
  /// caller's to free.
  void abort_turn(const std::string& id) {
    Conv& c = live(id, "abort_turn");
    KVKIT_CHECK(c.state == State::kRunning, "kvkit: abort_turn of conversation '", id, "' which is ",
                to_string(c.state), ", not running");
    unlend(c, false);
    c.chain.clear();
    c.host_state.reset();
    c.state = State::kEvicted;
    --running_;
  }

  /// Frees everything of `id` (a running conversation's request keeps its own pages).
  void end(const std::string& id) {
    Conv& c = live(id, "end");
    if (c.state == State::kRunning) --running_;
    lru_remove(c);
    unlend(c, true);
    drop_pages(c, true);
    convs_.erase(id);
    ended_.insert(id);
  }

  /// A new conversation `dst` continuing suspended `src`: the same tokens and turn, its
  /// pages shared by refcount (see Params::fork_copies_partial_page). Throws, changing
  /// nothing, when `src` is unknown, ended, running (its request owns the pages: fork after
  /// suspending it) or not in memory, or `dst` exists, or the copy finds no free page.
  void fork(const std::string& src, const std::string& dst) {
    Conv& s = live(src, "fork");
    KVKIT_CHECK(s.state != State::kRunning, "kvkit: fork of conversation '", src,
                "' while its request is running (suspend it first)");
    KVKIT_CHECK(s.state == State::kSuspended, "kvkit: fork of conversation '", src, "' which is ",
                to_string(s.state), " (resume it first)");
    KVKIT_CHECK(convs_.count(dst) == 0, "kvkit: fork target '", dst, "' already exists");
    const bool copy = p_.fork_copies_partial_page && cached_tokens(s) % static_cast<std::size_t>(ps_) != 0;
    std::int32_t fresh = -1;
    if (copy) {
      fresh = host_->try_allocate();
      KVKIT_CHECK(fresh >= 0, "kvkit: fork of conversation '", src, "': out of KV pages for the partial page copy");
      host_->copy_page(s.pages.back(), fresh);
    }
    Conv d;
    d.state = State::kSuspended;
    d.tokens = s.tokens;
    d.pages = s.pages;
    d.chain = s.chain;
    d.compressed = s.compressed;
    d.kv_len = s.kv_len;
    d.host_state = s.host_state;
    d.host_state_bytes = s.host_state_bytes;
    d.n_private = s.n_private;  // a copied partial page replaces a private one
    d.turn = s.turn;
    d.last = clock_();
    for (std::size_t i = 0; i < d.pages.size(); ++i) {
      if (copy && i + 1 == d.pages.size()) {
        d.pages[i] = fresh;
      } else {
        host_->retain(d.pages[i]);
        hold(d.pages[i]);
      }
    }
    private_refs_ += d.n_private;
    s.last = d.last;
    lru_remove(s);
    lru_push(src, s);
    auto it = convs_.emplace(dst, std::move(d)).first;
    lru_push(dst, it->second);
    ended_.erase(dst);
    ++m_.forks;
    enforce_limits(&it->second);
  }

  /// Allocator pressure: releases unused indexed pages (share_prefixes), then evicts
  /// suspended conversations, least recently active first (preferring, with
  /// share_prefixes, one whose eviction releases a page), until `n_pages` pages were freed
  /// or none is left (Params::trim_under_pressure: drops their pages tail first instead,
  /// keeping prefixes). Returns the pages freed.
  std::int32_t reclaim(std::int32_t n_pages) {
    std::int32_t freed = 0;
    while (freed < n_pages) {
      if (!unused_.empty()) {
        freed += drop_entry(unused_.front());
        continue;
      }
      if (lru_.empty()) break;
      if (!p_.trim_under_pressure || p_.spill) {
        freed += evict_conv(victim(), EvictReason::kPressure);
        continue;
      }
      // Tail first: the remaining prefix ends on a full page, still valid to resume from.
      // A compressed cache has no such prefix: it goes whole.
      Conv& c = convs_.at(lru_.front());
      if (c.compressed) {
        freed += evict_conv(lru_.front(), EvictReason::kPressure);
        continue;
      }
      c.host_state.reset();  // it described the whole history
      while (freed < n_pages && !c.pages.empty()) {
        const std::int32_t f = release_back(c, true);
        c.tokens.resize(std::min(c.tokens.size(), c.pages.size() * static_cast<std::size_t>(ps_)));
        c.chain.resize(std::min(c.chain.size(), c.tokens.size() / static_cast<std::size_t>(ps_)));
        freed += f;
        ++m_.pages_trimmed;
        m_.pages_freed += static_cast<std::uint64_t>(f);
      }
      if (c.pages.empty()) evict_conv(lru_.front(), EvictReason::kPressure);
    }
    return freed;
  }

  /// Releases every unused indexed page (share_prefixes: pages no conversation holds, kept
  /// for reuse until room is needed). Returns the pages freed.
  std::int32_t release_unused() {
    std::int32_t freed = 0;
    while (!unused_.empty()) freed += drop_entry(unused_.front());
    return freed;
  }

  /// Evicts every suspended conversation idle for at least idle_timeout_s (none when the
  /// timeout is 0). Returns the number evicted.
  std::int32_t evict_idle() {
    if (p_.idle_timeout_s <= 0.0) return 0;
    const double now = clock_();
    std::int32_t n = 0;
    while (!lru_.empty() && now - convs_.at(lru_.front()).last >= p_.idle_timeout_s) {
      evict_conv(lru_.front(), EvictReason::kTimeout);
      ++n;
    }
    return n;
  }

  /// Evicts suspended conversation `id` now (spilling it when enabled). Returns pages freed.
  std::int32_t evict(const std::string& id) {
    Conv& c = live(id, "evict");
    KVKIT_CHECK(c.state == State::kSuspended, "kvkit: evict of conversation '", id, "' which is ",
                to_string(c.state), ", not suspended");
    return evict_conv(id, EvictReason::kManual);
  }

  // ---- inspection ----
  bool contains(const std::string& id) const { return convs_.count(id) != 0; }
  bool ended(const std::string& id) const { return ended_.count(id) != 0; }
  State state(const std::string& id) const { return clive(id).state; }
  std::int32_t turn(const std::string& id) const { return clive(id).turn; }
  double last_activity(const std::string& id) const { return clive(id).last; }
  /// Token ids whose K/V the cache holds (suspended) or saved (spilled); with
  /// share_prefixes also those of an evicted conversation (its resume looks their full
  /// pages up in the prefix index). Compressed: all processed tokens (the position), of
  /// which the pages hold cached_len(id).
  const std::vector<std::int32_t>& tokens(const std::string& id) const { return clive(id).tokens; }
  /// Whether suspended `id` is compressed (its pages hold K/V of only cached_len(id) of
  /// its tokens(id); see the file comment).
  bool compressed(const std::string& id) const { return clive(id).compressed; }
  /// Tokens whose K/V the pages of suspended `id` hold: tokens(id).size(), or fewer when
  /// compressed.
  std::size_t cached_len(const std::string& id) const { return cached_tokens(clive(id)); }
  /// Pages the cache holds for `id` (empty unless suspended).
  const std::vector<std::int32_t>& pages(const std::string& id) const { return clive(id).pages; }
  /// Running + suspended conversations.
  std::int32_t active() const { return running_ + static_cast<std::int32_t>(lru_.size()); }
  std::int32_t suspended() const { return static_cast<std::int32_t>(lru_.size()); }
  std::int32_t size() const { return static_cast<std::int32_t>(convs_.size()); }
  /// What page_budget limits: one per indexed page plus one per conversation reference to
  /// a page outside the index (without share_prefixes: every page reference the cache holds).
  std::int64_t held_references() const { return private_refs_ + static_cast<std::int64_t>(idx_.size()); }
  /// References the cache holds on each page: one per suspended holder, plus the index's
  /// own (for allocator invariant checks; O(held)).
  std::unordered_map<std::int32_t, std::int32_t> references() const {
    std::unordered_map<std::int32_t, std::int32_t> r;
    for (const auto& kv : convs_)
      for (std::int32_t pg : kv.second.pages) ++r[pg];
    for (const auto& kv : idx_) ++r[kv.first];
    return r;
  }
  /// Pages in the prefix index (share_prefixes), and of them those no conversation holds
  /// (released first under pressure).
  std::int32_t indexed_pages() const { return static_cast<std::int32_t>(idx_.size()); }
  std::int32_t unused_pages() const { return static_cast<std::int32_t>(unused_.size()); }
  /// Conversations (suspended, or running with pages from the cache) holding indexed page
  /// `page`; 0 when it is not indexed.
  std::int32_t sharers(std::int32_t page) const {
    auto it = idx_.find(page);
    return it == idx_.end() ? 0 : it->second.holders;
  }
  /// Bytes of the host states the cache holds (suspend()'s state_bytes of every
  /// conversation whose state it still keeps; O(conversations)).
  std::int64_t host_state_bytes() const {
    std::int64_t b = 0;
    for (const auto& kv : convs_) b += kv.second.host_state.has_value() ? kv.second.host_state_bytes : 0;
    return b;
  }
  /// Distinct pages the cache holds a reference to (O(held)).
  std::int32_t held_pages() const { return static_cast<std::int32_t>(references().size()); }
  /// Suspended conversations, least recently active first (the eviction order).
  std::vector<std::string> lru_order() const { return std::vector<std::string>(lru_.begin(), lru_.end()); }

 private:
  struct Conv {
    State state = State::kRunning;
    std::vector<std::int32_t> pages;   // cache references (suspended only)
    std::vector<std::int32_t> tokens;  // computed tokens (suspended) / saved tokens (spilled) /
                                       // last computed tokens (evicted, share_prefixes)
    std::vector<BlockHash> hashes;     // spilled: one per saved block
    std::vector<BlockHash> chain;      // share_prefixes: chained hash of each full page of
                                       // `tokens` (running: of the pages the request took)
    std::vector<std::int32_t> lent;    // share_prefixes, running: indexed pages the request took
                                       // from the cache (they count this conversation as holder)
    std::int32_t n_private = 0;        // pages of `pages` outside the index
    bool compressed = false;           // suspended with kv_len < tokens.size() (see file comment)
    std::size_t kv_len = 0;            // compressed: tokens whose K/V `pages` hold
    std::any host_state;               // suspend()'s state, until a resume takes it
    std::int64_t host_state_bytes = 0;  // what suspend() said host_state takes
    std::int32_t turn = 0;
    double last = 0.0;
    bool in_lru = false;
    std::list<std::string>::iterator lru_it;
  };
  // An indexed page: the index holds one reference; `holders` conversations use it.
  struct Entry {
    BlockHash hash;
    std::int32_t holders = 0;
    bool queued = false;  // in unused_ (holders == 0)
    std::list<std::int32_t>::iterator it;
  };

  static std::size_t cached_tokens(const Conv& c) { return c.compressed ? c.kv_len : c.tokens.size(); }

  Conv& check_resume(const std::string& id, std::size_t n) {
    Conv& c = live(id, "resume");
    KVKIT_CHECK(c.state != State::kRunning, "kvkit: resume of conversation '", id,
                "': its turn ", c.turn, " is still running (suspend it first)");
    KVKIT_CHECK(n > 0, "kvkit: resume of conversation '", id, "' with an empty prompt");
    return c;
  }

  // The cached tokens [0, common) match the prompt of n tokens: keep their pages (suspended)
  // or find them in the index / restore them (evicted, spilled), release the rest, hand the
  // kept references to the request. A compressed conversation comes with common = all its
  // tokens (continued: every page kept) or 0 (miss: every page released).
  Resume finish_resume(Conv& c, std::size_t common, std::size_t n) {
    // Idle conversations go first, this one excepted (it is about to be used).
    lru_remove(c);
    evict_idle();
    Resume r;
    const std::size_t ps = static_cast<std::size_t>(ps_);
    std::size_t shared = 0;  // tokens on pages taken from the index
    m_.tokens_released += c.tokens.size() - std::min(c.tokens.size(), common);
    const bool whole = c.state == State::kSuspended && common == c.tokens.size();
    std::size_t cached = common;  // tokens whose K/V the handed pages hold
    if (c.compressed) {
      cached = whole ? c.kv_len : 0;
      ++(whole ? m_.compressed_hits : m_.compressed_misses);
    }
    if (whole) r.state = std::move(c.host_state);
    c.host_state.reset();
    if (c.state == State::kSuspended) {
      // Keep ceil(cached / ps) pages; release the rest (divergence or the n - 1 cap).
      const std::size_t keep = (cached + ps - 1) / ps;
      while (c.pages.size() > keep) release_back(c, false);
      private_refs_ -= c.n_private;  // references move to the request
      c.n_private = 0;
      r.pages = std::move(c.pages);
      c.pages.clear();
    } else {
      std::vector<std::int32_t> got;
      if (p_.share_prefixes) {
        for (std::size_t i = 0; i < c.chain.size() && i * ps < common; ++i) {
          auto it = by_hash_.find(c.chain[i]);
          if (it == by_hash_.end()) break;
          host_->retain(it->second);  // the request's reference
          hold(it->second);
          got.push_back(it->second);
        }
        shared = std::min(common, got.size() * ps);
        m_.shared_pages += got.size();
        m_.shared_tokens += shared;
      }
      if (c.state == State::kSpilled && shared < common) {
        common = restore(c, common, &got, &r);
      } else {
        common = shared;
      }
      cached = common;
      r.pages = std::move(got);
    }
    if (p_.share_prefixes) {
      lend(c, r.pages);
      c.chain.resize(std::min(c.chain.size(), common / ps));
    } else {
      c.chain.clear();
    }
    c.tokens.clear();
    c.hashes.clear();
    c.compressed = false;
    c.kv_len = 0;
    r.cached_len = static_cast<std::int32_t>(cached);
    r.position = static_cast<std::int32_t>(common);
    r.turn = ++c.turn;
    c.state = State::kRunning;
    c.last = clock_();
    ++running_;
    ++m_.resumes;
    m_.prompt_tokens += n;
    if (common > 0) ++m_.hits;
    m_.tokens_restored += static_cast<std::uint64_t>(r.restored_tokens);
    m_.tokens_reused += common - static_cast<std::size_t>(r.restored_tokens);
    enforce_limits(nullptr);
    return r;
  }

  Conv& live(const std::string& id, const char* op) {
    return const_cast<Conv&>(static_cast<const ConversationCache*>(this)->clive(id, op));
  }
  const Conv& clive(const std::string& id, const char* op = "lookup") const {
    auto it = convs_.find(id);
    if (it == convs_.end()) {
      KVKIT_CHECK(ended_.count(id) == 0, "kvkit: ", op, " of conversation '", id, "' which was ended");
      fail("kvkit: ", op, " of unknown conversation id '", id, "'");
    }
    return it->second;
  }

  void lru_push(const std::string& id, Conv& c) {
    lru_.push_back(id);
    c.lru_it = std::prev(lru_.end());
    c.in_lru = true;
  }
  void lru_remove(Conv& c) {
    if (!c.in_lru) return;
    lru_.erase(c.lru_it);
    c.in_lru = false;
  }

  // ---- prefix index (share_prefixes) ----
  // One more conversation uses `page` (no-op when it is not indexed).
  void hold(std::int32_t page) {
    auto it = idx_.find(page);
    if (it == idx_.end()) return;
    Entry& e = it->second;
    if (e.queued) {
      unused_.erase(e.it);
      e.queued = false;
    }
    ++e.holders;
  }
  // One conversation fewer uses `page`; an unused page is released now (`drop`) or queued
  // for release under pressure. Returns 1 when that freed the page.
  std::int32_t unhold(std::int32_t page, bool drop) {
    auto it = idx_.find(page);
    if (it == idx_.end()) return 0;
    Entry& e = it->second;
    if (--e.holders > 0) return 0;
    if (drop) return drop_entry(page);
    unused_.push_back(page);
    e.it = std::prev(unused_.end());
    e.queued = true;
    return 0;
  }
  // Removes `page` from the index and drops the index's reference; 1 when that freed it.
  std::int32_t drop_entry(std::int32_t page) {
    auto it = idx_.find(page);
    if (it->second.queued) unused_.erase(it->second.it);
    by_hash_.erase(it->second.hash);
    idx_.erase(it);
    const std::int32_t freed = host_->release(page) == 0 ? 1 : 0;
    m_.unused_pages_freed += static_cast<std::uint64_t>(freed);
    m_.pages_freed += static_cast<std::uint64_t>(freed);
    return freed;
  }
  // Suspend: extends c.chain over the new full pages, counts c as a holder of every indexed
  // page it holds (so a page of c is indexed exactly when c counts as its holder) and indexes the full pages whose content is not indexed yet. A page stays private
  // when its twin is already indexed, or when anyone but the request and c holds it (a
  // fork sibling's private page: indexing it would miss that holder). Then c's pages lent
  // to the request are given back. A compressed c indexes nothing (its pages do not hold
  // its token prefix) and has no chain; it still counts as a holder of an indexed page its
  // request kept unchanged.
  void index_pages(Conv& c) {
    const std::size_t ps = static_cast<std::size_t>(ps_);
    const std::size_t full = c.compressed ? 0 : c.tokens.size() / ps;
    if (c.chain.size() > full) c.chain.resize(full);
    BlockHash prev = c.chain.empty() ? BlockHash::root() : c.chain.back();
    for (std::size_t i = c.chain.size(); i < full; ++i) {
      prev = block_hash(prev, c.tokens.data() + i * ps, ps);
      c.chain.push_back(prev);
    }
    for (std::size_t i = 0; i < c.pages.size(); ++i) {
      const std::int32_t pg = c.pages[i];
      if (idx_.count(pg) != 0) {
        // Also a partly used one (a resume cut inside an indexed page and nothing was
        // written): c holds it like any sharer; a write into it copies it first.
        hold(pg);
        --c.n_private;
      } else if (i < full && by_hash_.count(c.chain[i]) == 0 && host_->refcount(pg) == 2) {
        host_->retain(pg);  // the index's reference
        Entry e;
        e.hash = c.chain[i];
        e.holders = 1;
        idx_.emplace(pg, e);
        by_hash_.emplace(c.chain[i], pg);
        --c.n_private;
      }
    }
    unlend(c, false);
  }
  // The request of conversation c takes `pages`: it stays a holder of those indexed now
  // (only those: a page indexed later, at suspend, counts its holders from then on).
  void lend(Conv& c, const std::vector<std::int32_t>& pages) {
    c.lent.clear();
    for (std::int32_t pg : pages)
      if (idx_.count(pg) != 0) c.lent.push_back(pg);
  }
  // The request of running conversation c no longer counts as a holder of its lent pages
  // (tail first, so a queued tail goes before its prefix).
  void unlend(Conv& c, bool drop) {
    for (auto it = c.lent.rbegin(); it != c.lent.rend(); ++it) unhold(*it, drop);
    c.lent.clear();
  }
  // Pressure victim: the least recent suspended conversation whose eviction releases a
  // page (one it alone holds), else the least recent.
  std::string victim() const {
    if (p_.share_prefixes) {
      for (const std::string& id : lru_) {
        const Conv& c = convs_.at(id);
        for (std::int32_t pg : c.pages) {
          auto it = idx_.find(pg);
          if (it == idx_.end() ? host_->refcount(pg) == 1 : it->second.holders == 1) return id;
        }
      }
    }
    return lru_.front();
  }
  // Frees one page's worth of room: an unused indexed page, else the pressure victim.
  bool make_room() {
    if (!unused_.empty()) {
      drop_entry(unused_.front());
      return true;
    }
    if (lru_.empty()) return false;
    evict_conv(victim(), EvictReason::kPressure);
    return true;
  }

  // Drops c's reference on its last page (an indexed page nobody else holds: released now
  // with `drop`, else queued); returns 1 when that freed the page.
  std::int32_t release_back(Conv& c, bool drop) {
    const std::int32_t pg = c.pages.back();
    c.pages.pop_back();
    if (idx_.count(pg) != 0) {
      host_->release(pg);  // the index still holds it
      return unhold(pg, drop);
    }
    --private_refs_;
    --c.n_private;
    return host_->release(pg) == 0 ? 1 : 0;
  }
  std::int32_t drop_pages(Conv& c, bool drop) {
    std::int32_t freed = 0;
    while (!c.pages.empty()) freed += release_back(c, drop);
    return freed;
  }

  void enforce_limits(const Conv* keep) {
    while (p_.max_active > 0 && active() > p_.max_active && !lru_.empty() &&
           &convs_.at(lru_.front()) != keep)
      evict_conv(lru_.front(), EvictReason::kMaxActive);
    while (p_.page_budget > 0 && held_references() > p_.page_budget) {
      if (!unused_.empty()) {
        drop_entry(unused_.front());
      } else if (!lru_.empty() && &convs_.at(lru_.front()) != keep) {
        evict_conv(lru_.front(), EvictReason::kPageBudget);
      } else {
        break;
      }
    }
  }

  // Evicts a suspended conversation (copied id: the LRU node goes away). Returns pages freed.
  std::int32_t evict_conv(std::string id, EvictReason why) {
    Conv& c = convs_.at(id);
    lru_remove(c);
    c.state = State::kEvicted;
    c.host_state.reset();
    if (c.compressed) {  // never spilled nor looked up by prefix (see the file comment)
      c.compressed = false;
      c.kv_len = 0;
      c.tokens.clear();
      c.chain.clear();
      ++m_.compressed_evictions;
    }
    if (p_.spill && !c.tokens.empty()) spill(c);
    if (c.state == State::kEvicted && !p_.share_prefixes) c.tokens.clear();
    c.chain.resize(std::min(c.chain.size(), c.tokens.size() / static_cast<std::size_t>(ps_)));
    // Pressure, budget and max_active keep the unused indexed pages queued for reuse until
    // room is needed; a timeout or an explicit evict() releases them now.
    const std::int32_t freed = drop_pages(c, why == EvictReason::kTimeout || why == EvictReason::kManual);
    ++m_.evictions;
    ++m_.evictions_by[static_cast<int>(why)];
    m_.pages_freed += static_cast<std::uint64_t>(freed);
    return freed;
  }

  // Names page i of `tokens` by the chained hash of the tokens it holds (a partial last
  // page: the tokens present, so its name changes once it fills).
  std::vector<BlockHash> page_hashes(const std::vector<std::int32_t>& tokens) const {
    std::vector<BlockHash> h;
    BlockHash prev = BlockHash::root();
    for (std::size_t start = 0; start < tokens.size(); start += static_cast<std::size_t>(ps_)) {
      const std::size_t len = std::min<std::size_t>(static_cast<std::size_t>(ps_), tokens.size() - start);
      prev = block_hash(prev, tokens.data() + start, len);
      h.push_back(prev);
    }
    return h;
  }

  void spill(Conv& c) {
    const PagedKVView<T>* views = host_->pool_views();
    if (views == nullptr || c.pages.empty()) return;
    std::vector<BlockHash> h = page_hashes(c.tokens);
    std::size_t saved = 0;
    const Status st = store_->save(h.data(), c.pages.data(), h.size(), views, &saved);
    if (!st.is_ok()) ++m_.spill_failures;
    if (saved == 0) return;
    h.resize(saved);
    c.tokens.resize(std::min(c.tokens.size(), saved * static_cast<std::size_t>(ps_)));
    c.hashes = std::move(h);
    c.state = State::kSpilled;
    ++m_.spills;
    m_.spilled_blocks += saved;
  }

  // Loads the blocks covering the first `common` tokens after the pages already in `pages`
  // (taken from the index) into fresh pages (making room when none is free) and appends
  // them; returns the tokens now cached.
  std::size_t restore(Conv& c, std::size_t common, std::vector<std::int32_t>* pages, Resume* r) {
    const std::size_t ps = static_cast<std::size_t>(ps_);
    const std::size_t want = std::min((common + ps - 1) / ps, c.hashes.size());
    const std::size_t first = pages->size();
    const std::size_t have = std::min(common, first * ps);
    const PagedKVView<T>* views = host_->pool_views();
    c.state = State::kEvicted;  // whatever fails below leaves a plain miss
    if (want <= first || views == nullptr) return have;
    std::vector<std::int32_t> fresh;
    while (first + fresh.size() < want) {
      std::int32_t pg = host_->try_allocate();
      while (pg < 0 && make_room()) pg = host_->try_allocate();
      if (pg < 0) break;
      fresh.push_back(pg);
    }
    const store::LoadResult lr = store_->load(c.hashes.data() + first, fresh.data(), fresh.size(), views);
    const std::size_t loaded = lr.blocks_loaded;
    while (fresh.size() > loaded) {  // fresh pages, ours alone: these release to free
      host_->release(fresh.back());
      fresh.pop_back();
    }
    if (first + loaded < want) ++m_.restore_misses;
    if (loaded == 0) return have;
    ++m_.restores;
    m_.restored_blocks += loaded;
    pages->insert(pages->end(), fresh.begin(), fresh.end());
    const std::size_t got = std::min(common, pages->size() * ps);
    r->restored_tokens = static_cast<std::int32_t>(got - have);
    return got;
  }

  PageHost<T>* host_;
  Params p_;
  Clock clock_;
  store::BlockStore<T>* store_;
  std::int32_t ps_;
  std::unordered_map<std::string, Conv> convs_;
  std::unordered_set<std::string> ended_;
  std::list<std::string> lru_;  // suspended ids, least recently active first
  std::int64_t private_refs_ = 0;  // references of suspended conversations on pages outside the index
  std::int32_t running_ = 0;
  std::unordered_map<std::int32_t, Entry> idx_;         // indexed page -> entry
  std::unordered_map<BlockHash, std::int32_t> by_hash_;  // chained hash -> indexed page
  std::list<std::int32_t> unused_;  // indexed pages no conversation holds, front = released first
  Metrics m_;
};

}  // namespace conversation
}  // namespace kvkit
