#pragma once
// BlockAllocator: the engine's page allocator (a free list plus per-page reference counts).
//
// A page is free (refcount 0) or in use (refcount >= 1). allocate() hands out a free page
// with refcount 1; retain() adds a reference (a page shared by a prefix, a suspended
// conversation or a stored block); release() drops one and returns the page to the free
// list when the count reaches zero. Misuse (releasing a free page, an id outside the
// pool) throws kvkit::Error naming the page, because it means the engine's bookkeeping
// is already wrong. The initial free order can be shuffled with a seed so that page ids
// of a sequence are scattered, which makes tests catch code that assumes contiguity.
//
// An observer (set_observer) sees every reference-count change as a PageEvent, so state
// keyed by physical page (per-page summaries, stored-block hashes) can follow allocation
// and release whoever triggers them; Engine adds the sequence and rewrite events.

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "kvkit/core/error.hpp"

namespace kvkit {
namespace engine {

/// What happened to a page (see PageEvent).
enum class PageEventKind {
  kAllocate,  // a free page was handed out (refcount 0 -> 1); its old contents are stale
  kRetain,    // one more reference to an in-use page
  kRelease,   // one reference dropped; refcount 0 means the page is free again
  kRewrite,   // contents changed other than by appending tokens (see PageEvent::first_slot)
};

inline const char* to_string(PageEventKind k) {
  switch (k) {
    case PageEventKind::kAllocate: return "allocate";
    case PageEventKind::kRetain: return "retain";
    case PageEventKind::kRelease: return "release";
    case PageEventKind::kRewrite: return "rewrite";
  }
  return "unknown";
}

/// One page notification. The allocator fills kind, page and refcount; the Engine adds the
/// sequence it acted for and emits the kRewrite events (compaction, truncation, copies).
struct PageEvent {
  PageEventKind kind = PageEventKind::kAllocate;
  std::int32_t page = -1;         // physical page id
  std::int32_t refcount = 0;      // references after the event (0 after a freeing release)
  std::int32_t seq = -1;          // sequence the engine acted for; -1: none (direct call)
  std::int32_t source_page = -1;  // kRewrite: the page now holds a copy of this one, else -1
  std::int32_t first_slot = 0;    // kRewrite: token slots [first_slot, page_size) changed
};

/// Receives page events; called synchronously, so it must not throw through a step.
using PageObserver = std::function<void(const PageEvent&)>;

class BlockAllocator {
 public:
  /// A pool of `num_pages` pages with ids [0, num_pages). With shuffle_seed != 0 the free
  /// list starts in a seeded random order; with 0, pages come out as 0, 1, 2, ...
  explicit BlockAllocator(std::int32_t num_pages, std::uint64_t shuffle_seed = 0)
      : refcount_(static_cast<std::size_t>(num_pages > 0 ? num_pages : 0), 0) {
    KVKIT_CHECK(num_pages > 0, "kvkit: BlockAllocator needs num_pages > 0, got ", num_pages);
    free_.reserve(static_cast<std::size_t>(num_pages));
    for (std::int32_t i = num_pages - 1; i >= 0; --i) free_.push_back(i);  // pop_back gives 0 first
    if (shuffle_seed != 0) {
      std::uint64_t s = shuffle_seed;
      for (std::size_t i = free_.size(); i > 1; --i) {  // Fisher-Yates with xorshift64*
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        const std::uint64_t r = s * 0x2545f4914f6cdd1dull;
        std::swap(free_[i - 1], free_[static_cast<std::size_t>(r % i)]);
      }
    }
  }

  std::int32_t num_pages() const { return static_cast<std::int32_t>(refcount_.size()); }
  std::int32_t num_free() const { return static_cast<std::int32_t>(free_.size()); }
  std::int32_t pages_in_use() const { return num_pages() - num_free(); }
  /// Highest pages_in_use() seen since construction (or reset_peak()).
  std::int32_t peak_pages_in_use() const { return peak_; }
  void reset_peak() { peak_ = pages_in_use(); }

  /// A free page with refcount 1, or -1 when the pool is exhausted (callers that can
  /// reclaim memory, e.g. by evicting a cached conversation, try again).
  std::int32_t try_allocate() {
    if (free_.empty()) return -1;
    const std::int32_t p = free_.back();
    free_.pop_back();
    refcount_[static_cast<std::size_t>(p)] = 1;
    if (pages_in_use() > peak_) peak_ = pages_in_use();
    notify(PageEventKind::kAllocate, p, 1);
    return p;
  }

  /// Like try_allocate() but throws kvkit::Error when no page is free.
  std::int32_t allocate() {
    const std::int32_t p = try_allocate();
    KVKIT_CHECK(p >= 0, "kvkit: out of KV pages: all ", num_pages(), " pages are in use");
    return p;
  }

  /// Adds a reference to an in-use page.
  void retain(std::int32_t page) {
    check_id(page, "retain");
    KVKIT_CHECK(refcount_[static_cast<std::size_t>(page)] > 0, "kvkit: retain of free page ", page);
    const std::int32_t rc = ++refcount_[static_cast<std::size_t>(page)];
    notify(PageEventKind::kRetain, page, rc);
  }

  /// Drops one reference; the page becomes free when none are left.
  void release(std::int32_t page) {
    check_id(page, "release");
    std::int32_t& rc = refcount_[static_cast<std::size_t>(page)];
    KVKIT_CHECK(rc > 0, "kvkit: double free of page ", page, " (it is already free)");
    if (--rc == 0) free_.push_back(page);
    notify(PageEventKind::kRelease, page, rc);
  }

  std::int32_t refcount(std::int32_t page) const {
    check_id(page, "refcount");
    return refcount_[static_cast<std::size_t>(page)];
  }

  /// Calls `observer` after every allocate, retain and release (an empty one: none).
  /// Engine installs its own observer; use Engine::add_page_listener there instead.
  void set_observer(PageObserver observer) { observer_ = std::move(observer); }

 private:
  void notify(PageEventKind kind, std::int32_t page, std::int32_t refcount) const {
    if (!observer_) return;
    PageEvent e;
    e.kind = kind;
    e.page = page;
    e.refcount = refcount;
    observer_(e);
  }

  void check_id(std::int32_t page, const char* op) const {
    KVKIT_CHECK(page >= 0 && page < num_pages(), "kvkit: ", op, " of page id ", page,
                " outside the pool [0, ", num_pages(), ")");
  }

  std::vector<std::int32_t> refcount_;  // [num_pages]
  std::vector<std::int32_t> free_;      // stack of free page ids
  std::int32_t peak_ = 0;
  PageObserver observer_;
};

}  // namespace engine
}  // namespace kvkit
