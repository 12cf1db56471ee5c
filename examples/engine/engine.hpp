#pragma once
// Engine: a small paged inference engine around Model, the host in which kvkit policies
// are demonstrated.
//
// It owns, per layer, a K pool and a V pool of pages (layout NHD or HND, see
// kvkit::packed_strides; elements float32, or float16 / bfloat16 with
// EngineOptions::kv_dtype, as engines store them), a BlockAllocator handing out page ids shared by all layers, and
// a batch of sequences. Every step builds the page table in the configured encoding (CSR
// or dense block table) and one kvkit::PagedKVView per layer, then runs one token per live
// sequence. Decoding: a sequence whose prompt is not consumed yet is teacher-forced on its
// next prompt token; after that the next token is the greedy argmax of the logits (ties go
// to the lower id), or a caller-forced token with forward_tokens().
//
// `contiguous` mode gives every sequence one page of seq_len tokens: a contiguous-cache
// run through exactly the same kernels, the baseline paged runs are compared against.
//
// Host contract (what a policy may rely on and must respect):
//  - Tokens, position, cache. tokens(id) = prompt + generated. The first position(id) of
//    them are processed (processed_tokens(id)); tokens(id)[position(id)] is the pending
//    token (pending_token(id)), the input of the next step, at RoPE position position(id);
//    any tokens after it are prompt still to be teacher-forced. kv_len(id) <= position(id)
//    tokens have K/V in pages(id) (ceil(kv_len / page_size) pages, in order); a policy that
//    drops tokens lowers kv_len, never the position. add_sequence(tokens, pages, cached_len,
//    position) resumes a sequence (e.g. a compressed conversation) with position tokens
//    processed, cached_len of them cached.
//  - Steps are all-or-nothing. step() / try_step() either completes for every sequence or
//    leaves every sequence exactly as before (pages, kv_len, position, tokens, logits): an
//    attention hook returning an error or throwing, or too few pages, changes nothing (the
//    step's fresh pages go back to the allocator; their allocate/release events are seen).
//  - Attention hook (set_attention): an AttentionFn gets, per layer, the view, the sequence
//    id of every batch row (AttentionCall::seq_ids; do not assume rows sorted by id), the
//    post-RoPE queries and a Workspace sized by its AttentionWorkspaceFn (at least what the
//    dense kernel needs). It must not change sequences. One hook at a time: installing a
//    second one throws (several policies: see composite_policy.hpp).
//  - Step hooks (add_step_hook) run after a completed step with its views, queries and
//    logits; they may change sequences (truncate_kv, free_sequence, notify_rewrite).
//  - Page events (add_page_listener): every allocate / retain / release of a page, with the
//    sequence the engine acted for (-1 for direct allocator() calls), and kRewrite when a
//    page's contents change other than by appending: truncate_kv (slots past the new end
//    of an exclusively owned last page), notify_rewrite (a compaction policy rewrote
//    pages; it must call it) and copies (copy-on-write, fork_sequence; source_page set).
//    Appending a token to the partial last page is not an event (step hooks see it); full
//    pages never change otherwise, so a summary or hash of a full page stays valid until a
//    kRewrite or its freeing kRelease (refcount 0).
//  - Copy-on-write: a step never writes into a page another owner still holds; it copies
//    the page (all layers, K and V) to a fresh one first (two live sequences sharing a
//    partial page: the first in batch order copies, the other then writes in place).
//    fork_sequence(id) shares full pages (retain) and copies the partly filled last page.
//    Pages handed to add_sequence may be shared. A compaction policy that rewrites pages
//    in place calls make_exclusive(id) first.
//  - Allocation pressure: when a step, fork or make_exclusive needs more pages than are
//    free, the reclaim callback (set_reclaim) is asked for the missing count and may free
//    pages (evict a cached conversation, release stored blocks, truncate or free
//    sequences; not from a forward_tokens step, whose batch must stay fixed). If still
//    short, the call fails with "out of KV pages" and changes no sequence.
//  - Extra pools: a policy with its own page storage (packed pages of another head dim)
//    registers its byte counter with register_pool(); kv_bytes_in_use() / kv_bytes_peak()
//    include it.
//  - Element type: the pages hold EngineOptions::kv_dtype. Hooks and policies that read
//    or write pages through float views (StepInfo::layer_views, set_attention's
//    AttentionCall, k_pool(), layer_views()) need float32 pages: with 16-bit pages
//    set_attention and k_pool() / v_pool() / layer_views() throw naming the dtype, and
//    StepInfo::layer_views is null. set_typed_attention installs a hook for every page type
//    (AttentionCallT<T>: the pages' view, q and out rounded to T as the dense kernel gets
//    them), pool_view<T> and layer_views<T> read typed pages. Page events, reclaim and
//    registered pools work with any dtype.
//  - Pool size: the pools are allocated up front; a size above max_pool_bytes (default:
//    physical memory) throws PoolTooLargeError naming the value and the bytes needed.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include "engine/block_allocator.hpp"
#include "engine/checkpoint.hpp"
#include "engine/model.hpp"
#include "engine/prefill.hpp"
#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/kernels/cpu.hpp"

namespace kvkit {
namespace engine {

using SeqId = std::int32_t;

/// BOS token of llama2.c tokenizers.
inline constexpr std::int32_t kBosToken = 1;

struct EngineOptions {
  std::int32_t page_size = 16;                       // tokens per page (ignored when contiguous)
  KVLayout layout = KVLayout::kNHD;                  // layout inside a page
  PageTableKind table_kind = PageTableKind::kCsr;    // page-table encoding of the views
  std::int32_t max_batch = 8;                        // sizes the default pool
  std::int32_t num_pages = 0;                        // 0: max_batch * ceil(seq_len / page_size)
  bool contiguous = false;                           // one seq_len-token page per sequence
  std::uint64_t shuffle_seed = 0;                    // != 0 scatters page ids (BlockAllocator)
  int threads = 1;                                   // threads of the projections and KV kernels
  bool quantized_matvec = true;                      // decode on the checkpoint's quantized blocks
  bool validate_tables = false;                      // validate_page_table() on every step
  // Batched prefill attends through the paged decode kernel, one view row per query token,
  // instead of the tiled kernel: the prompt's K/V and logits are then bitwise what decode
  // computes token by token, whatever the chunking (a cached prefix + a short prefill gives
  // the same tokens as a whole prefill). Costs O(T^2) K/V reads per chunk.
  bool prefill_decode_attention = false;
  std::int64_t max_pool_bytes = 0;                   // K+V pool cap; 0: physical memory
  DType kv_dtype = DType::kFloat32;                  // element type of the K/V pages
};

/// Thrown by the Engine constructor when the K/V pools would exceed max_pool_bytes (a
/// usage error: the message names page_size, num_pages and the bytes needed).
class PoolTooLargeError : public Error {
 public:
  explicit PoolTooLargeError(const std::string& what) : Error(what) {}
};

/// Bytes of physical memory, or 0 when the platform does not say.
inline std::int64_t physical_memory_bytes() {
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
  const long pages = ::sysconf(_SC_PHYS_PAGES), size = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && size > 0 &&
      pages <= std::numeric_limits<std::int64_t>::max() / size)
    return static_cast<std::int64_t>(pages) * size;
#endif
  return 0;
}

class Engine;

/// What a StepHook sees. Pointers are valid during the call only; a hook that changes
/// sequences (truncate_kv, free_sequence) makes `layer_views` stale.
struct StepInfo {
  std::int64_t step = 0;                             // steps run so far, this one included
  std::int32_t batch = 0;                            // sequences in this step
  const SeqId* seq_ids = nullptr;                    // [batch] sequence of each view row
  const PagedKVView<float>* layer_views = nullptr;   // [n_layers] after this step's write;
                                                     // null unless kv_dtype is float32
  const float* const* queries = nullptr;             // [n_layers] -> [batch, Hq, D] post-RoPE
  const float* logits = nullptr;                     // [batch, vocab]
};

/// Called after every completed step (see the file comment).
using StepHook = std::function<void(Engine&, const StepInfo&)>;
/// Receives page events (see the file comment); must not call back into the engine.
using PageListener = std::function<void(const PageEvent&)>;
/// Asked for `pages_needed` more free pages; frees what it can and returns how many it
/// freed (informational: the engine recounts the free list).
using ReclaimFn = std::function<std::int32_t(std::int32_t pages_needed)>;
/// Bytes a registered pool holds now (and at its peak).
using PoolBytesFn = std::function<std::int64_t()>;

class Engine {
 public:
  /// Builds the pools and allocator; throws kvkit::Error on bad options (value named) and
  /// PoolTooLargeError when the pools exceed max_pool_bytes, before allocating them.
  Engine(std::shared_ptr<const Checkpoint> ckpt, const EngineOptions& options)
      : model_(ckpt, options.threads, options.quantized_matvec), opt_(options) {
    const ModelConfig& c = model_.config();
    KVKIT_CHECK(opt_.max_batch > 0, "kvkit: max_batch must be > 0, got ", opt_.max_batch);
    if (opt_.contiguous) {
      opt_.page_size = c.seq_len;
      if (opt_.num_pages == 0) opt_.num_pages = opt_.max_batch;
    }
    KVKIT_CHECK(opt_.page_size > 0, "kvkit: page_size must be > 0, got ", opt_.page_size);
    KVKIT_CHECK(opt_.threads >= 0, "kvkit: threads must be >= 0, got ", opt_.threads);
    KVKIT_CHECK(opt_.num_pages >= 0, "kvkit: num_pages must be > 0 (or 0 for the default), got ",
                opt_.num_pages);
    KVKIT_CHECK(opt_.max_pool_bytes >= 0, "kvkit: max_pool_bytes must be >= 0, got ",
                opt_.max_pool_bytes);
    KVKIT_CHECK(opt_.kv_dtype == DType::kFloat32 || opt_.kv_dtype == DType::kFloat16 ||
                    opt_.kv_dtype == DType::kBFloat16,
                "kvkit: unsupported kv_dtype ", static_cast<int>(opt_.kv_dtype));
    max_pages_per_seq_ = static_cast<std::int32_t>(pages_for(c.seq_len));
    if (opt_.num_pages == 0) {
      const std::int64_t n = static_cast<std::int64_t>(opt_.max_batch) * max_pages_per_seq_;
      KVKIT_CHECK(n <= 1 << 30, "kvkit: default pool of ", n, " pages is too large");
      opt_.num_pages = static_cast<std::int32_t>(n);
    }
    check_pool_size(c);
    prefiller_.set_tiled_attention(!opt_.prefill_decode_attention);
    geometry_.num_kv_heads = c.n_kv_heads;
    geometry_.head_dim = c.head_dim();
    geometry_.page_size = opt_.page_size;
    geometry_.num_pages = opt_.num_pages;
    strides_ = packed_strides(geometry_, opt_.layout);
    const std::size_t pool = static_cast<std::size_t>(strides_.page) * opt_.num_pages *
                             static_cast<std::size_t>(dtype_size(opt_.kv_dtype));
    for (int l = 0; l < c.n_layers; ++l) {  // zeroed bytes: 0.0 in every dtype
      k_pools_.push_back(std::make_unique<unsigned char[]>(pool));
      v_pools_.push_back(std::make_unique<unsigned char[]>(pool));
    }
    // Batch-0 views over each layer's pools, for page copies (copy-on-write, fork).
    with_kv_type([&](auto tag) {
      using T = decltype(tag);
      for (int l = 0; l < c.n_layers; ++l)
        views_of<T>(pool_views_).push_back(make_csr_view(geometry_, pool_as<T>(k_pools_, l), strides_,
                                                         pool_as<T>(v_pools_, l), strides_,
                                                         CsrPageTable{kZeroIndptr, nullptr, nullptr, 0}));
    });
    allocator_ = std::make_unique<BlockAllocator>(opt_.num_pages, opt_.shuffle_seed);
    allocator_->set_observer([this](const PageEvent& e) {
      PageEvent ev = e;
      ev.seq = event_seq_;
      emit(ev);
    });
    model_.reserve(opt_.max_batch);
  }
  Engine(const Checkpoint& ckpt, const EngineOptions& options)
      : Engine(std::make_shared<const Checkpoint>(ckpt), options) {}
  // The allocator's observer points at this engine.
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// K+V bytes of all layers' pools for `options` resolved against `c` (page_size,
  /// num_pages as the constructor resolves them), saturating at INT64_MAX.
  static std::int64_t pool_bytes_needed(const ModelConfig& c, EngineOptions o) {
    if (o.contiguous) {
      o.page_size = c.seq_len;
      if (o.num_pages == 0) o.num_pages = o.max_batch;
    }
    if (o.page_size <= 0) return 0;
    if (o.num_pages == 0)
      o.num_pages = static_cast<std::int32_t>(std::min<std::int64_t>(
          static_cast<std::int64_t>(o.max_batch) *
              ((static_cast<std::int64_t>(c.seq_len) + o.page_size - 1) / o.page_size),
          std::numeric_limits<std::int32_t>::max()));
    std::int64_t b = 1;
    for (std::int64_t f : {static_cast<std::int64_t>(o.page_size), static_cast<std::int64_t>(o.num_pages),
                           static_cast<std::int64_t>(c.n_kv_heads), static_cast<std::int64_t>(c.head_dim()),
                           static_cast<std::int64_t>(dtype_size(o.kv_dtype)), static_cast<std::int64_t>(c.n_layers),
                           std::int64_t{2}}) {
      if (f <= 0) return 0;
      if (b > std::numeric_limits<std::int64_t>::max() / f) return std::numeric_limits<std::int64_t>::max();
      b *= f;
    }
    return b;
  }

  const ModelConfig& config() const { return model_.config(); }
  /// Effective options (page_size / num_pages resolved).
  const EngineOptions& options() const { return opt_; }
  Model& model() { return model_; }
  const Model& model() const { return model_; }
  BlockAllocator& allocator() { return *allocator_; }
  const BlockAllocator& allocator() const { return *allocator_; }
  KVGeometry geometry() const { return geometry_; }
  KVStrides strides() const { return strides_; }
  /// Element type of the K/V pages (EngineOptions::kv_dtype).
  DType kv_dtype() const { return opt_.kv_dtype; }
  /// Calls f(T{}) with T the pages' element type (float, half_t or bfloat16_t), so a host
  /// of the engine instantiates its typed code once per dtype and runs the one in use.
  template <class F>
  auto with_kv_type(F&& f) const -> decltype(f(float{})) {
    return visit_dtype(opt_.kv_dtype, std::forward<F>(f));
  }
  /// Layer `layer`'s K (V) pool as floats [num_pages * page elements]; throws kvkit::Error
  /// naming the dtype unless the pages hold float32.
  float* k_pool(int layer) { return pool_as<float>(k_pools_, layer); }
  float* v_pool(int layer) { return pool_as<float>(v_pools_, layer); }
  /// Layer `layer`'s storage as a batch-0 view of element type T (page ids are physical;
  /// for copies, stores and policies that address pages directly). Throws kvkit::Error
  /// naming the dtype unless T is the pages' type.
  template <class T>
  PagedKVView<T> pool_view(int layer) {
    require_pages<T>("pool_view");
    return views_of<T>(pool_views_).at(static_cast<std::size_t>(layer));
  }

  /// Adds a sequence that will be fed `prompt` (teacher-forced) and then decode greedily.
  /// Returns its id (ids increase; batch order is ascending id).
  SeqId add_sequence(const std::vector<std::int32_t>& prompt) {
    check_prompt(prompt);
    Sequence s;
    s.tokens = prompt;
    return insert(std::move(s));
  }

  /// Adds a sequence whose first `cached_len` tokens already have K/V in `pages` (a reused
  /// prefix, blocks loaded from a store). Same as the four-argument form with position =
  /// cached_len.
  SeqId add_sequence(const std::vector<std::int32_t>& prompt, const std::vector<std::int32_t>& pages,
                     std::int32_t cached_len) {
    return add_sequence(prompt, pages, cached_len, cached_len);
  }

  /// Adds a sequence whose first `position` tokens of `tokens` are already processed (the
  /// next one, tokens[position], is fed at RoPE position `position`) and of which
  /// `cached_len` <= position still have K/V, in `pages` (ceil(cached_len / page_size)
  /// pages, in order): a compressed conversation resumes with cached_len < position. The
  /// engine takes over one reference of each page (the caller allocated or retained it).
  /// Pages may be shared: the first write into a shared page copies it.
  SeqId add_sequence(const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& pages,
                     std::int32_t cached_len, std::int32_t position) {
    check_prompt(tokens);
    KVKIT_CHECK(position >= 0 && static_cast<std::size_t>(position) < tokens.size(),
                "kvkit: position ", position, " must be in [0, token count ", tokens.size(),
                ") (the token at the position is the next input)");
    KVKIT_CHECK(cached_len >= 0 && cached_len <= position, "kvkit: cached_len ", cached_len,
                " must be in [0, position ", position, "]");
    const std::int64_t need = pages_for(cached_len);
    KVKIT_CHECK(static_cast<std::int64_t>(pages.size()) == need, "kvkit: ", pages.size(),
                " pages given for ", cached_len, " cached tokens of page size ", opt_.page_size,
                ", expected ", need);
    std::set<std::int32_t> seen;
    for (std::int32_t p : pages) {
      KVKIT_CHECK(p >= 0 && p < allocator_->num_pages() && allocator_->refcount(p) > 0,
                  "kvkit: cached page ", p, " is not allocated");
      KVKIT_CHECK(seen.insert(p).second, "kvkit: cached page ", p, " is listed twice");
    }
    Sequence s;
    s.tokens = tokens;
    s.pages = pages;
    s.kv_len = cached_len;
    s.processed = position;
    return insert(std::move(s));
  }

  /// A new sequence identical to `id` (tokens, position, cached K/V, last logits) that then
  /// decodes on its own: full pages are shared (retained), the partly filled last page is
  /// copied into a fresh page (all layers, K and V). Asks the reclaim callback when no page
  /// is free; throws kvkit::Error ("out of KV pages", batch full) changing nothing.
  SeqId fork_sequence(SeqId id) {
    KVKIT_CHECK(num_sequences() < opt_.max_batch, "kvkit: batch is full (max_batch ",
                opt_.max_batch, ")");
    check_self_contained(id, "forked");
    const Status st = ensure_free(
        [&] { return has_sequence(id) && seq(id).kv_len % opt_.page_size != 0 ? 1 : 0; },
        "fork_sequence");
    if (!st.is_ok()) fail("kvkit: ", st.message());
    const Sequence& src = seq(id);  // reclaim may have changed the map
    Sequence s;
    s.tokens = src.tokens;
    s.logits = src.logits;
    s.kv_len = src.kv_len;
    s.processed = src.processed;
    s.pages = src.pages;
    const SeqId nid = next_id_;
    const std::size_t full = static_cast<std::size_t>(src.kv_len / opt_.page_size);
    SeqScope scope(*this, nid);
    for (std::size_t i = 0; i < full; ++i) allocator_->retain(s.pages[i]);
    if (full < s.pages.size()) {
      const std::int32_t copy = allocator_->try_allocate();  // ensure_free made room
      copy_page(s.pages[full], copy, nid);
      s.pages[full] = copy;
    }
    return insert(std::move(s));
  }

  /// Copies every page of `id` that is shared (refcount > 1) to a fresh page, so a policy
  /// may rewrite the sequence's K/V in place (compaction). Asks the reclaim callback when
  /// short of pages; throws kvkit::Error ("out of KV pages") changing nothing.
  void make_exclusive(SeqId id) {
    auto shared = [&] {
      std::int32_t n = 0;
      if (has_sequence(id))
        for (std::int32_t p : seq(id).pages) n += allocator_->refcount(p) > 1 ? 1 : 0;
      return n;
    };
    const Status st = ensure_free(shared, "make_exclusive");
    if (!st.is_ok()) fail("kvkit: ", st.message());
    Sequence& s = seq(id);
    SeqScope scope(*this, id);
    for (std::int32_t& p : s.pages) {
      if (allocator_->refcount(p) <= 1) continue;
      const std::int32_t copy = allocator_->try_allocate();
      copy_page(p, copy, id);
      allocator_->release(p);
      p = copy;
    }
    dirty_ = true;
  }

  /// Releases the sequence's pages (one reference each) and forgets it.
  void free_sequence(SeqId id) {
    Sequence& s = seq(id);
    SeqScope scope(*this, id);
    for (std::int32_t p : s.pages) allocator_->release(p);
    seqs_.erase(id);
    dirty_ = true;
  }

  /// Drops cached K/V past `new_kv_len` (a policy compacted the kept tokens to the front)
  /// and releases the pages no longer needed. The position keeps counting processed tokens.
  /// Emits kRelease for dropped pages and kRewrite (first_slot = new_kv_len % page_size) for
  /// a kept, exclusively owned last page that lost tokens.
  void truncate_kv(SeqId id, std::int32_t new_kv_len) {
    Sequence& s = seq(id);
    KVKIT_CHECK(new_kv_len >= 0 && new_kv_len <= s.kv_len, "kvkit: truncate_kv of sequence ", id,
                " to ", new_kv_len, " tokens, it caches ", s.kv_len);
    const std::size_t keep = static_cast<std::size_t>(pages_for(new_kv_len));
    SeqScope scope(*this, id);
    while (s.pages.size() > keep) {
      allocator_->release(s.pages.back());
      s.pages.pop_back();
    }
    const std::int32_t cut = new_kv_len % opt_.page_size;
    // An exclusively owned last page gets its cut slots overwritten in place by the next
    // steps; a shared one is copied before that (copy-on-write), so its contents stay.
    if (cut != 0 && new_kv_len < s.kv_len && allocator_->refcount(s.pages.back()) == 1)
      emit_rewrite(s.pages.back(), id, -1, cut);
    s.kv_len = new_kv_len;
    dirty_ = true;
  }

  /// Tells page listeners that a policy rewrote `pages` of sequence `id` in place (token
  /// slots [first_slot, page_size) of each; compaction). Each page must belong to the
  /// sequence and not be shared (call make_exclusive() before rewriting).
  void notify_rewrite(SeqId id, const std::vector<std::int32_t>& pages, std::int32_t first_slot = 0) {
    const Sequence& s = seq(id);
    KVKIT_CHECK(first_slot >= 0 && first_slot < opt_.page_size, "kvkit: notify_rewrite first_slot ",
                first_slot, " outside [0, page_size ", opt_.page_size, ")");
    for (std::int32_t p : pages) {
      KVKIT_CHECK(std::find(s.pages.begin(), s.pages.end(), p) != s.pages.end(),
                  "kvkit: notify_rewrite: page ", p, " is not a page of sequence ", id);
      KVKIT_CHECK(allocator_->refcount(p) == 1, "kvkit: notify_rewrite: page ", p,
                  " of sequence ", id, " is shared (refcount ", allocator_->refcount(p),
                  "); call make_exclusive() before rewriting");
    }
    for (std::int32_t p : pages) emit_rewrite(p, id, -1, first_slot);
  }

  /// Live sequences in batch order (ascending id).
  std::vector<SeqId> sequences() const {
    std::vector<SeqId> ids;
    for (const auto& kv : seqs_) ids.push_back(kv.first);
    return ids;
  }
  std::int32_t num_sequences() const { return static_cast<std::int32_t>(seqs_.size()); }
  bool has_sequence(SeqId id) const { return seqs_.count(id) != 0; }
  /// All tokens: processed_tokens(), then the pending token, then any prompt tokens not
  /// fed yet.
  const std::vector<std::int32_t>& tokens(SeqId id) const { return seq(id).tokens; }
  /// The tokens already fed through the model (the first position() of tokens()).
  std::vector<std::int32_t> processed_tokens(SeqId id) const {
    const Sequence& s = seq(id);
    return std::vector<std::int32_t>(s.tokens.begin(), s.tokens.begin() + s.processed);
  }
  /// The next step's input: tokens()[position()], fed at RoPE position position().
  std::int32_t pending_token(SeqId id) const {
    const Sequence& s = seq(id);
    return s.tokens[static_cast<std::size_t>(s.processed)];
  }
  /// Tokens processed so far (the RoPE position of the pending token).
  std::int32_t position(SeqId id) const { return seq(id).processed; }
  /// Tokens whose K/V are cached (<= position()).
  std::int32_t kv_len(SeqId id) const { return seq(id).kv_len; }
  /// Declares that policy `holder` keeps `n` of `id`'s processed tokens outside the engine's
  /// pages (kvchan moves a sequence's old tokens into its own pool and truncates them
  /// here). Such a sequence is not self-contained: its pages and kv_len do not describe
  /// its cache, so fork_sequence refuses it, and so does any host that would hand its
  /// pages on (conversation_host's finish_turn), instead of continuing from a cache
  /// that silently lacks those tokens. n = 0 clears it.
  void set_external_tokens(SeqId id, std::int32_t n, const std::string& holder) {
    Sequence& s = seq(id);
    KVKIT_CHECK(n >= 0 && n <= s.processed - s.kv_len, "kvkit: sequence ", id, " cannot have ", n,
                " tokens held outside the engine's pages (position ", s.processed, ", kv_len ", s.kv_len, ")");
    s.external = n;
    s.holder = n > 0 ? holder : std::string();
  }
  /// Tokens of `id` a policy holds outside the engine's pages (set_external_tokens).
  std::int32_t external_tokens(SeqId id) const { return seq(id).external; }
  /// Throws kvkit::Error naming the policy when `id` has tokens outside the engine's pages,
  /// so it cannot be `what` (forked, suspended) without losing them.
  void check_self_contained(SeqId id, const char* what) const {
    const Sequence& s = seq(id);
    KVKIT_CHECK(s.external == 0, "kvkit: sequence ", id, " cannot be ", what, ": ", s.external,
                " of its tokens are held by policy ", s.holder, " outside the engine's pages");
  }
  const std::vector<std::int32_t>& pages(SeqId id) const { return seq(id).pages; }
  /// Logits [vocab] of the sequence's last step; throws before its first step.
  const std::vector<float>& last_logits(SeqId id) const {
    const Sequence& s = seq(id);
    KVKIT_CHECK(!s.logits.empty(), "kvkit: sequence ", id, " has not run a step yet");
    return s.logits;
  }

  std::int64_t steps_run() const { return steps_; }
  std::int32_t pages_in_use() const { return allocator_->pages_in_use(); }
  /// Bytes of one page of one layer's K (or V) pool.
  std::int64_t bytes_per_page() const { return strides_.page * static_cast<std::int64_t>(dtype_size(opt_.kv_dtype)); }
  /// K and V bytes of all layers held by pages in use, plus every registered pool (now /
  /// at the peak; the peak adds each pool's own peak, an upper bound of their joint peak).
  std::int64_t kv_bytes_in_use() const {
    std::int64_t b = pages_bytes(allocator_->pages_in_use());
    for (const auto& kv : pools_) b += kv.second.in_use();
    return b;
  }
  std::int64_t kv_bytes_peak() const {
    std::int64_t b = pages_bytes(allocator_->peak_pages_in_use());
    for (const auto& kv : pools_) b += kv.second.peak ? kv.second.peak() : kv.second.in_use();
    return b;
  }
  /// K and V bytes of all layers for `pages` pages of the engine's own pool.
  std::int64_t pages_bytes(std::int64_t pages) const {
    return pages * bytes_per_page() * config().n_layers * 2;
  }

  /// Registers a policy's own page pool under `name`: `in_use` (and `peak`, default
  /// in_use) report its bytes, which kv_bytes_in_use() / kv_bytes_peak() then include.
  void register_pool(const std::string& name, PoolBytesFn in_use, PoolBytesFn peak = {}) {
    KVKIT_CHECK(!name.empty(), "kvkit: register_pool needs a name");
    KVKIT_CHECK(static_cast<bool>(in_use), "kvkit: register_pool '", name, "' needs a byte counter");
    KVKIT_CHECK(pools_.count(name) == 0, "kvkit: pool '", name, "' is already registered");
    pools_.emplace(name, ExtraPool{std::move(in_use), std::move(peak)});
  }
  void unregister_pool(const std::string& name) {
    KVKIT_CHECK(pools_.erase(name) == 1, "kvkit: no registered pool '", name, "'");
  }
  /// Bytes the registered pool `name` holds now.
  std::int64_t pool_bytes(const std::string& name) const {
    auto it = pools_.find(name);
    KVKIT_CHECK(it != pools_.end(), "kvkit: no registered pool '", name, "'");
    return it->second.in_use();
  }

  /// Registers a hook run after every completed step, in registration order.
  void add_step_hook(StepHook hook) { hooks_.push_back(std::move(hook)); }
  /// Replaces the dense attention (an empty function restores it). `workspace_size` says
  /// how much scratch the hook needs for a layer's view (sized before each call). The
  /// attention call is one slot: replacing a hook that is already installed throws
  /// kvkit::Error (two policies would otherwise silently drop one another); restore the
  /// dense kernel first to swap hooks on purpose.
  void set_attention(AttentionFn fn, AttentionWorkspaceFn workspace_size = {}) {
    if (fn) require_pages<float>("set_attention (an attention hook reads float views)");
    check_attention_slot(static_cast<bool>(fn));
    attention_ = AttentionHook{};
    attention_.run = std::move(fn);
    attention_.workspace_size = std::move(workspace_size);
  }
  /// set_attention for pages of any element type: `fn` is a generic callable taking
  /// `const AttentionCallT<T>&` for T = float, half_t and bfloat16_t; each step calls it
  /// with the pages' type (kv_dtype). `workspace_size` (optional) is a generic callable
  /// taking (int layer, const PagedKVView<T>&) for the same three types; without it the
  /// hook gets the dense kernel's workspace. Same single slot as set_attention.
  template <class F, class W = std::nullptr_t>
  void set_typed_attention(F fn, W workspace_size = nullptr) {
    check_attention_slot(true);
    attention_ = AttentionHook{};
    attention_.run = fn;
    attention_.run_f16 = fn;
    attention_.run_bf16 = std::move(fn);
    if constexpr (!std::is_same<W, std::nullptr_t>::value) {
      attention_.workspace_size = workspace_size;
      attention_.workspace_size_f16 = workspace_size;
      attention_.workspace_size_bf16 = std::move(workspace_size);
    }
  }
  /// Registers a page listener; returns a handle for remove_page_listener.
  int add_page_listener(PageListener fn) {
    KVKIT_CHECK(static_cast<bool>(fn), "kvkit: add_page_listener needs a function");
    listeners_.push_back(std::move(fn));
    return static_cast<int>(listeners_.size()) - 1;
  }
  void remove_page_listener(int handle) {
    KVKIT_CHECK(handle >= 0 && static_cast<std::size_t>(handle) < listeners_.size() &&
                    listeners_[static_cast<std::size_t>(handle)],
                "kvkit: no page listener ", handle);
    listeners_[static_cast<std::size_t>(handle)] = nullptr;
  }
  /// Sets the callback asked to free pages when the pool runs short (empty: none).
  void set_reclaim(ReclaimFn fn) { reclaim_ = std::move(fn); }

  /// One decode step for every live sequence: prompt tokens are teacher-forced, then the
  /// greedy argmax (lowest id on ties) is appended. All-or-nothing; throws kvkit::Error
  /// with try_step()'s message on failure.
  void step() { throw_if_failed(try_step()); }

  /// step() returning a Status instead of throwing: kInvalidArgument with no sequences,
  /// kOutOfRange when a sequence reached seq_len or the pool is out of pages (after the
  /// reclaim callback), or the attention's Status. On failure no sequence changed. (A
  /// throwing hook or callback propagates, also leaving every sequence unchanged.)
  Status try_step() { return run_step(nullptr); }

  /// One step where forced_next[i] (batch order) becomes sequence i's next token instead
  /// of the argmax (teacher forcing). For a sequence still inside its prompt the entry
  /// must be -1 or equal to the prompt's next token.
  void forward_tokens(const std::vector<std::int32_t>& forced_next) {
    throw_if_failed(try_forward_tokens(forced_next));
  }
  /// forward_tokens() returning the step's Status (bad forced tokens still throw).
  Status try_forward_tokens(const std::vector<std::int32_t>& forced_next) {
    KVKIT_CHECK(static_cast<std::int32_t>(forced_next.size()) == num_sequences(),
                "kvkit: forward_tokens got ", forced_next.size(), " tokens for ",
                num_sequences(), " sequences");
    std::size_t i = 0;
    for (const auto& kv : seqs_) {
      const Sequence& s = kv.second;
      const std::int32_t f = forced_next[i++];
      const std::size_t next = static_cast<std::size_t>(s.processed) + 1;
      if (next < s.tokens.size()) {
        KVKIT_CHECK(f == -1 || f == s.tokens[next], "kvkit: forced token ", f, " for sequence ",
                    kv.first, " contradicts its prompt token ", s.tokens[next]);
      } else {
        KVKIT_CHECK(f >= 0 && f < config().vocab_size, "kvkit: forced token ", f,
                    " for sequence ", kv.first, " outside the vocabulary [0, ",
                    config().vocab_size, ")");
      }
    }
    return run_step(&forced_next);
  }

  /// Consumes the pending prompt of `id` except its last token in batched passes (one per
  /// layer per chunk of tokens, see prefill.hpp) instead of one step per token; the next
  /// step processes the last prompt token and gives its logits (equal to teacher forcing
  /// up to float rounding). Pages are taken as a step takes them (reclaim callback when
  /// short, copy-on-write of a shared partly filled page, page events); step hooks and the
  /// attention hook do not see the prefilled tokens. The sequence keeps its id; its logits
  /// are cleared until the next step. At most `max_tokens` tokens are taken per call (a
  /// caller may interleave chunks of a long prompt with other sequences' steps). Returns
  /// the number of tokens prefilled (0 when at most one prompt token is pending). Throws
  /// kvkit::Error ("out of KV pages", a failed kernel) leaving every sequence unchanged.
  std::int32_t prefill(SeqId id, std::int32_t max_tokens = std::numeric_limits<std::int32_t>::max()) {
    KVKIT_CHECK(!in_step_, "kvkit: prefill() called from inside a step (hook or callback)");
    KVKIT_CHECK(max_tokens > 0, "kvkit: prefill max_tokens must be > 0, got ", max_tokens);
    const std::int32_t n = std::min(
        max_tokens, static_cast<std::int32_t>(seq(id).tokens.size()) - 1 - seq(id).processed);
    if (n <= 0) return 0;
    auto cow = [&](const Sequence& s) {
      return s.kv_len % opt_.page_size != 0 &&
             allocator_->refcount(s.pages[static_cast<std::size_t>(s.kv_len / opt_.page_size)]) > 1;
    };
    auto need = [&]() -> std::int32_t {
      if (!has_sequence(id)) return 0;
      const Sequence& s = seq(id);
      return static_cast<std::int32_t>(pages_for(static_cast<std::int64_t>(s.kv_len) + n) -
                                       static_cast<std::int64_t>(s.pages.size())) + (cow(s) ? 1 : 0);
    };
    const Status st = ensure_free(need, "prefill");
    if (!st.is_ok()) fail("kvkit: ", st.message());
    KVKIT_CHECK(has_sequence(id), "kvkit: the reclaim callback freed sequence ", id, " during prefill");
    Sequence& s = seq(id);  // reclaim may have changed the map
    SeqScope scope(*this, id);
    std::vector<std::int32_t> pages = s.pages, fresh;  // committed only on success
    std::int32_t replaced = -1;
    if (cow(s)) {
      const std::size_t idx = static_cast<std::size_t>(s.kv_len / opt_.page_size);
      const std::int32_t p = allocator_->try_allocate();  // ensure_free made room
      copy_page(pages[idx], p, id);
      replaced = pages[idx];
      pages[idx] = p;
      fresh.push_back(p);
    }
    while (static_cast<std::int64_t>(pages.size()) < pages_for(static_cast<std::int64_t>(s.kv_len) + n)) {
      fresh.push_back(allocator_->try_allocate());
      pages.push_back(fresh.back());
    }
    Status res;
#if KVKIT_HAS_EXCEPTIONS
    try {
#endif
      res = with_kv_type([&](auto tag) {
        using T = decltype(tag);
        return prefiller_.run(model_, views_of<T>(pool_views_).data(), pages, s.tokens.data() + s.processed, n,
                              s.kv_len, s.processed, nullptr);
      });
#if KVKIT_HAS_EXCEPTIONS
    } catch (...) {
      for (std::int32_t p : fresh) allocator_->release(p);
      throw;
    }
#endif
    if (!res.is_ok()) {
      for (std::int32_t p : fresh) allocator_->release(p);
      fail("kvkit: prefill of sequence ", id, " failed: ", res.to_string());
    }
    if (replaced >= 0) allocator_->release(replaced);  // the copy replaced our reference
    s.pages = std::move(pages);
    s.kv_len += n;
    s.processed += n;
    s.logits.clear();
    dirty_ = true;
    return n;
  }

  /// Appends `more` after the tokens of `id` as prompt to teacher-force (a new chat turn
  /// after the pending last generated token); the cached K/V stays. Throws kvkit::Error
  /// for a token outside the vocabulary or a total past seq_len, changing nothing.
  void append_tokens(SeqId id, const std::vector<std::int32_t>& more) {
    Sequence& s = seq(id);
    KVKIT_CHECK(s.tokens.size() + more.size() <= static_cast<std::size_t>(config().seq_len),
                "kvkit: append_tokens: ", s.tokens.size(), " + ", more.size(),
                " tokens exceed the model's seq_len ", config().seq_len);
    for (std::int32_t t : more)
      KVKIT_CHECK(t >= 0 && t < config().vocab_size, "kvkit: append_tokens: token ", t,
                  " outside the vocabulary [0, ", config().vocab_size, ")");
    s.tokens.insert(s.tokens.end(), more.begin(), more.end());
  }

  /// Per-layer views over the live sequences as they are now (batch order = sequences()).
  /// Valid until the next change to the engine. T must be the pages' type (kv_dtype;
  /// throws kvkit::Error naming both dtypes otherwise).
  template <class T = float>
  const std::vector<PagedKVView<T>>& layer_views() {
    require_pages<T>("layer_views()");
    if (dirty_) build_views(0);
    return views_of<T>(views_);
  }

 private:
  struct Sequence {
    std::vector<std::int32_t> tokens;
    std::vector<std::int32_t> pages;
    std::vector<float> logits;  // [vocab] of the last step
    std::int32_t kv_len = 0;
    std::int32_t processed = 0;
    std::int32_t external = 0;  // tokens a policy holds outside the engine's pages
    std::string holder;         // that policy's name
  };

  struct ExtraPool {
    PoolBytesFn in_use, peak;
  };

  // A page change a step made before its forward pass, undone if the step fails.
  struct StepPageChange {
    SeqId id = -1;
    std::size_t index = 0;        // page index in the sequence
    std::int32_t old_page = -1;   // -1: appended; else the shared page that was copied
    std::int32_t new_page = -1;
  };

  // Sets the sequence id that allocator events are attributed to, for one scope.
  class SeqScope {
   public:
    SeqScope(Engine& e, SeqId id) : e_(e), saved_(e.event_seq_) { e_.event_seq_ = id; }
    ~SeqScope() { e_.event_seq_ = saved_; }
    SeqScope(const SeqScope&) = delete;
    SeqScope& operator=(const SeqScope&) = delete;

   private:
    Engine& e_;
    SeqId saved_;
  };

  template <class T>
  using Views = std::vector<PagedKVView<T>>;
  using TypedViews = std::tuple<Views<float>, Views<half_t>, Views<bfloat16_t>>;  // one in use

  template <class T>
  static Views<T>& views_of(TypedViews& v) { return std::get<Views<T>>(v); }
  // The one dtype check of every typed access: throws kvkit::Error naming both dtypes
  // unless the pages hold T.
  template <class T>
  void require_pages(const char* what) const {
    if (dtype_of_v<T> != opt_.kv_dtype)
      fail("kvkit: ", what, " needs ", to_string(dtype_of_v<T>), " pages, this engine stores ",
           to_string(opt_.kv_dtype), " (EngineOptions::kv_dtype)");
  }
  // The attention call is one slot: installing into an occupied one throws.
  void check_attention_slot(bool installing) const {
    KVKIT_CHECK(!installing || !attention_.installed(),
                "kvkit: set_attention: the attention call is already replaced by another hook "
                "(set_attention({}) restores the dense kernel first)");
  }
  template <class T>
  T* pool_as(std::vector<std::unique_ptr<unsigned char[]>>& pools, int layer) const {
    require_pages<T>("the K/V pool");
    return reinterpret_cast<T*>(pools.at(static_cast<std::size_t>(layer)).get());
  }

  static constexpr int kMaxReclaimRounds = 4;
  static constexpr std::int32_t kZeroIndptr[1] = {0};

  // ceil(n / page_size) in 64 bits (n + page_size - 1 overflows int32 near INT32_MAX).
  std::int64_t pages_for(std::int64_t n) const { return (n + opt_.page_size - 1) / opt_.page_size; }

  void check_pool_size(const ModelConfig& c) const {
    const std::int64_t need = pool_bytes_needed(c, opt_);
    const std::int64_t phys = physical_memory_bytes();
    const std::int64_t cap = opt_.max_pool_bytes > 0 ? opt_.max_pool_bytes : phys;
    if (cap > 0 && need > cap) {
      throw PoolTooLargeError(kvkit::detail::concat(
          "kvkit: KV pool too large: page_size ", opt_.page_size, " x num_pages ", opt_.num_pages,
          " needs ", need, " bytes (K and V, ", c.n_layers, " layers, ", c.n_kv_heads,
          " heads x ", c.head_dim(), " ", to_string(opt_.kv_dtype), " per token), more than the limit of ", cap,
          " bytes (", opt_.max_pool_bytes > 0 ? "max_pool_bytes" : "physical memory", ")"));
    }
  }

  void check_prompt(const std::vector<std::int32_t>& prompt) const {
    KVKIT_CHECK(!prompt.empty(), "kvkit: a sequence needs at least one prompt token");
    KVKIT_CHECK(prompt.size() <= static_cast<std::size_t>(config().seq_len), "kvkit: prompt of ",
                prompt.size(), " tokens exceeds the model's seq_len ", config().seq_len);
    for (std::int32_t t : prompt)
      KVKIT_CHECK(t >= 0 && t < config().vocab_size, "kvkit: prompt token ", t,
                  " outside the vocabulary [0, ", config().vocab_size, ")");
  }

  SeqId insert(Sequence s) {
    KVKIT_CHECK(num_sequences() < opt_.max_batch, "kvkit: batch is full (max_batch ",
                opt_.max_batch, ")");
    const SeqId id = next_id_++;
    seqs_.emplace(id, std::move(s));
    dirty_ = true;
    return id;
  }

  Sequence& seq(SeqId id) {
    auto it = seqs_.find(id);
    KVKIT_CHECK(it != seqs_.end(), "kvkit: no sequence with id ", id);
    return it->second;
  }
  const Sequence& seq(SeqId id) const {
    auto it = seqs_.find(id);
    KVKIT_CHECK(it != seqs_.end(), "kvkit: no sequence with id ", id);
    return it->second;
  }

  static void throw_if_failed(const Status& st) {
    if (!st.is_ok()) fail("kvkit: ", st.message());
  }

  void emit(const PageEvent& e) {
    for (std::size_t i = 0; i < listeners_.size(); ++i)
      if (listeners_[i]) listeners_[i](e);
  }
  void emit_rewrite(std::int32_t page, SeqId id, std::int32_t source, std::int32_t first_slot) {
    PageEvent e;
    e.kind = PageEventKind::kRewrite;
    e.page = page;
    e.refcount = allocator_->refcount(page);
    e.seq = id;
    e.source_page = source;
    e.first_slot = first_slot;
    emit(e);
  }

  // Copies page src to dst in every layer's K and V pool, then reports the rewrite.
  void copy_page(std::int32_t src, std::int32_t dst, SeqId id) {
    with_kv_type([&](auto tag) {
      for (const auto& v : views_of<decltype(tag)>(pool_views_)) {
        const Status st = copy_pages(model_.exec(), v, &src, &dst, 1);
        if (!st.is_ok()) fail("kvkit: copying page ", src, " to ", dst, " failed: ", st.to_string());
      }
    });
    emit_rewrite(dst, id, src, 0);
  }

  // Makes sure `need()` pages are free, asking the reclaim callback (which may change
  // sequences, hence the recount) up to kMaxReclaimRounds times.
  template <class NeedFn>
  Status ensure_free(NeedFn need, const char* what) {
    std::int32_t n = need();
    std::int64_t reclaimed = 0;
    for (int round = 0; reclaim_ && n > allocator_->num_free() && round < kMaxReclaimRounds; ++round) {
      const std::int32_t before = allocator_->num_free();
      KVKIT_CHECK(!in_reclaim_, "kvkit: the reclaim callback re-entered the engine's allocation");
      in_reclaim_ = true;
      struct Reset {
        bool& f;
        ~Reset() { f = false; }
      } reset{in_reclaim_};
      reclaim_(n - before);
      n = need();
      reclaimed += allocator_->num_free() - before;
      if (allocator_->num_free() <= before) break;
    }
    const std::int32_t free = allocator_->num_free();
    if (n <= free) return Status::ok();
    const std::string tail = kvkit::detail::concat(
        "; ", what, " needs ", n, " new page", n == 1 ? "" : "s",
        reclaim_ ? kvkit::detail::concat(", reclaim freed ", reclaimed) : std::string());
    if (free == 0)
      return make_status(StatusCode::kOutOfRange, "out of KV pages: all ", allocator_->num_pages(),
                         " pages of ", opt_.page_size, " tokens are in use (", num_sequences(),
                         " sequences)", tail);
    return make_status(StatusCode::kOutOfRange, "out of KV pages: ", free, " of ",
                       allocator_->num_pages(), " pages of ", opt_.page_size, " tokens are free (",
                       num_sequences(), " sequences)", tail);
  }

  // Pages the next step must allocate: one per sequence whose last page is full, one per
  // sequence whose write target is shared (copy-on-write).
  std::int32_t step_pages_needed() {
    std::int32_t n = 0;
    copied_.clear();
    for (const auto& kv : seqs_) {
      const Sequence& s = kv.second;
      const std::size_t idx = static_cast<std::size_t>(s.kv_len / opt_.page_size);
      if (idx == s.pages.size()) {
        ++n;
      } else if (shared_for_write(s.pages[idx])) {
        copied_.push_back(s.pages[idx]);
        ++n;
      }
    }
    return n;
  }

  // True when a step must copy `page` before writing into it: other references remain
  // after the copies this step already planned (each drops one at commit), so with two
  // owners the first in batch order copies and the second writes in place.
  bool shared_for_write(std::int32_t page) const {
    const auto planned = std::count(copied_.begin(), copied_.end(), page);
    return allocator_->refcount(page) - planned > 1;
  }

  // Rebuilds the page-table arrays and per-layer views from the live sequences, each
  // counting `extra` more cached tokens than kv_len (1 while a step writes its token).
  void build_views(std::int32_t extra) {
    const std::int32_t B = num_sequences();
    indptr_.assign(1, 0);
    indices_.clear();
    last_page_len_.clear();
    table_.assign(static_cast<std::size_t>(B) * max_pages_per_seq_, -1);
    seq_lens_.clear();
    std::int32_t b = 0;
    for (const auto& kv : seqs_) {
      const Sequence& s = kv.second;
      const std::int32_t len = s.kv_len + extra;
      indices_.insert(indices_.end(), s.pages.begin(), s.pages.end());
      indptr_.push_back(static_cast<std::int32_t>(indices_.size()));
      const std::int64_t before = (static_cast<std::int64_t>(s.pages.size()) - 1) * opt_.page_size;
      last_page_len_.push_back(len == 0 ? 0 : static_cast<std::int32_t>(len - before));
      std::copy(s.pages.begin(), s.pages.end(), table_.begin() + static_cast<std::ptrdiff_t>(b) * max_pages_per_seq_);
      seq_lens_.push_back(len);
      ++b;
    }
    with_kv_type([&](auto tag) {
      using T = decltype(tag);
      Views<T>& views = views_of<T>(views_);
      views.clear();
      for (int l = 0; l < config().n_layers; ++l) {
        T* k = pool_as<T>(k_pools_, l);
        T* v = pool_as<T>(v_pools_, l);
        if (opt_.table_kind == PageTableKind::kCsr) {
          views.push_back(make_csr_view(geometry_, k, strides_, v, strides_,
                                        CsrPageTable{indptr_.data(), indices_.data(), last_page_len_.data(), B}));
        } else {
          views.push_back(make_block_table_view(geometry_, k, strides_, v, strides_,
                                                BlockTable{table_.data(), max_pages_per_seq_, seq_lens_.data(), B}));
        }
      }
      dirty_ = true;  // until validated below
      if (opt_.validate_tables && !views.empty()) views.front().validate_page_table();
    });
    dirty_ = false;
  }

  // Undoes the page changes of a failed step (reverse order) and returns its fresh pages.
  void rollback(const std::vector<StepPageChange>& changes) {
    for (auto it = changes.rbegin(); it != changes.rend(); ++it) {
      Sequence& s = seqs_.at(it->id);
      if (it->old_page < 0) {
        s.pages.pop_back();
      } else {
        s.pages[it->index] = it->old_page;
      }
      SeqScope scope(*this, it->id);
      allocator_->release(it->new_page);
    }
    dirty_ = true;
  }

  Status run_step(const std::vector<std::int32_t>* forced) {
    const ModelConfig& c = config();
    KVKIT_CHECK(!in_step_, "kvkit: step() called from inside a step (hook or callback)");
    in_step_ = true;
    struct Reset {
      bool& f;
      ~Reset() { f = false; }
    } reset{in_step_};
    auto runnable = [&]() -> Status {
      if (seqs_.empty()) return make_status(StatusCode::kInvalidArgument, "step() with no sequences");
      for (const auto& kv : seqs_)
        if (kv.second.processed >= c.seq_len)
          return make_status(StatusCode::kOutOfRange, "sequence ", kv.first,
                             " reached the model's seq_len ", c.seq_len);
      return Status::ok();
    };
    KVKIT_RETURN_IF_ERROR(runnable());
    const std::vector<SeqId> batch_before = sequences();
    KVKIT_RETURN_IF_ERROR(ensure_free([&] { return step_pages_needed(); }, "the step"));
    if (forced != nullptr && sequences() != batch_before)
      return make_status(StatusCode::kInvalidArgument,
                         "the reclaim callback changed the batch of a forward_tokens step");
    KVKIT_RETURN_IF_ERROR(runnable());  // reclaim may have changed sequences
    const std::int32_t B = num_sequences();

    // Pages first (append or copy-on-write); nothing else of a sequence changes until the
    // forward pass succeeded, so undoing these restores every sequence.
    changes_.clear();
    copied_.clear();
    batch_ids_.clear();
    in_tokens_.clear();
    in_pos_.clear();
    in_slots_.clear();
    Status st;
#if KVKIT_HAS_EXCEPTIONS
    try {
#endif
      for (auto& kv : seqs_) {
        Sequence& s = kv.second;
        const std::size_t idx = static_cast<std::size_t>(s.kv_len / opt_.page_size);
        SeqScope scope(*this, kv.first);
        if (idx == s.pages.size()) {
          const std::int32_t p = allocator_->try_allocate();  // ensure_free made room
          s.pages.push_back(p);
          changes_.push_back({kv.first, idx, -1, p});
        } else if (shared_for_write(s.pages[idx])) {
          const std::int32_t p = allocator_->try_allocate();
          copied_.push_back(s.pages[idx]);
          changes_.push_back({kv.first, idx, s.pages[idx], p});
          copy_page(s.pages[idx], p, kv.first);
          s.pages[idx] = p;
        }
        const std::int32_t page = s.pages[idx];
        in_slots_.push_back(static_cast<std::int64_t>(page) * opt_.page_size + s.kv_len % opt_.page_size);
        in_tokens_.push_back(s.tokens[static_cast<std::size_t>(s.processed)]);
        in_pos_.push_back(s.processed);
        batch_ids_.push_back(kv.first);
      }
      build_views(1);
      logits_.resize(static_cast<std::size_t>(B) * c.vocab_size);
      const ForwardBatch in{B, in_tokens_.data(), in_pos_.data(), in_slots_.data(), batch_ids_.data()};
      st = with_kv_type([&](auto tag) {
        return model_.forward(in, views_of<decltype(tag)>(views_).data(), logits_.data(), &attention_);
      });
#if KVKIT_HAS_EXCEPTIONS
    } catch (...) {
      rollback(changes_);
      throw;
    }
#endif
    if (!st.is_ok()) {
      rollback(changes_);
      return make_status(st.code(), "forward step failed: ", st.to_string());
    }

    // Commit.
    for (const StepPageChange& ch : changes_)
      if (ch.old_page >= 0) {
        SeqScope scope(*this, ch.id);
        allocator_->release(ch.old_page);  // the copy replaced this sequence's reference
      }
    ++steps_;
    std::int32_t b = 0;
    for (auto& kv : seqs_) {
      Sequence& s = kv.second;
      const float* row = logits_.data() + static_cast<std::size_t>(b) * c.vocab_size;
      s.logits.assign(row, row + c.vocab_size);
      ++s.kv_len;
      ++s.processed;
      if (static_cast<std::size_t>(s.processed) == s.tokens.size()) {
        const std::int32_t want = forced ? (*forced)[static_cast<std::size_t>(b)] : -1;
        s.tokens.push_back(want >= 0 ? want : argmax(row, c.vocab_size));
      }
      ++b;
    }
    if (!hooks_.empty()) {
      query_ptrs_.clear();
      for (int l = 0; l < c.n_layers; ++l) query_ptrs_.push_back(model_.queries(l));
      const PagedKVView<float>* fv =
          opt_.kv_dtype == DType::kFloat32 ? views_of<float>(views_).data() : nullptr;
      const StepInfo info{steps_, B, batch_ids_.data(), fv, query_ptrs_.data(), logits_.data()};
      in_step_ = false;  // the step is complete: hooks may change sequences
      for (auto& hook : hooks_) hook(*this, info);
    }
    return Status::ok();
  }

  static std::int32_t argmax(const float* x /* [n] */, std::int32_t n) {
    std::int32_t best = 0;
    for (std::int32_t i = 1; i < n; ++i)
      if (x[i] > x[best]) best = i;  // strict: ties keep the lower id
    return best;
  }

  Model model_;
  EngineOptions opt_;
  KVGeometry geometry_;
  KVStrides strides_;
  std::int32_t max_pages_per_seq_ = 0;
  // [n_layers][num_pages * page elements * dtype size] bytes, zeroed
  std::vector<std::unique_ptr<unsigned char[]>> k_pools_, v_pools_;
  TypedViews pool_views_;  // [n_layers] batch-0 views for copies and prefill, kv_dtype's slot
  std::unique_ptr<BlockAllocator> allocator_;
  std::map<SeqId, Sequence> seqs_;
  SeqId next_id_ = 0;
  std::int64_t steps_ = 0;
  bool dirty_ = true;
  bool in_step_ = false, in_reclaim_ = false;
  SeqId event_seq_ = -1;  // sequence allocator events are attributed to
  std::vector<StepHook> hooks_;
  std::vector<PageListener> listeners_;  // removed ones are empty
  ReclaimFn reclaim_;
  std::map<std::string, ExtraPool> pools_;
  AttentionHook attention_;
  // Page tables and views of the current batch (rebuilt when sequences change).
  std::vector<std::int32_t> indptr_, indices_, last_page_len_, table_, seq_lens_;
  TypedViews views_;  // [n_layers] of the current batch, kv_dtype's slot
  // Step inputs and outputs.
  std::vector<StepPageChange> changes_;
  std::vector<std::int32_t> copied_;  // shared pages this step copies (one entry per copy)
  std::vector<SeqId> batch_ids_;
  std::vector<std::int32_t> in_tokens_, in_pos_;
  std::vector<std::int64_t> in_slots_;
  std::vector<float> logits_;  // [batch, vocab]
  std::vector<const float*> query_ptrs_;
  Prefiller prefiller_;  // batched prefill scratch (prefill())
};

}  // namespace engine
}  // namespace kvkit
