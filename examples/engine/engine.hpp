#pragma once
// Engine: a small paged inference engine around Model, the host in which kvkit policies
// are demonstrated.
//
// It owns, per layer, a K pool and a V pool of float pages (layout NHD or HND, see
// kvkit::packed_strides), a BlockAllocator handing out page ids shared by all layers, and
// a batch of sequences. Each sequence has its tokens (prompt + generated), the number of
// tokens processed (= the RoPE position of the next one), the number of tokens whose K/V
// are cached (kv_len; equal to processed unless a policy dropped tokens) and its pages.
// Every step builds the page table in the configured encoding (CSR or dense block table)
// and one kvkit::PagedKVView per layer, then runs one token per live sequence.
//
// Decoding: a sequence whose prompt is not consumed yet is teacher-forced on its next
// prompt token; after that the next token is the greedy argmax of the logits (ties go to
// the lower id), or a caller-forced token with forward_tokens().
//
// Policy hook point: after every step the engine calls each StepHook (add_step_hook) with
// the step's per-layer views (K/V of the step already written), the post-RoPE queries and
// the logits. That is where a policy observes the cache and, through truncate_kv(),
// retain()/free_sequence() and the pools, changes it. An AttentionFn (set_attention)
// replaces the dense attention for policies that read only part of the cache.
//
// `contiguous` mode gives every sequence one page of seq_len tokens: a contiguous-cache
// run through exactly the same kernels, the baseline paged runs are compared against.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "engine/block_allocator.hpp"
#include "engine/checkpoint.hpp"
#include "engine/model.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/paged_kv_view.hpp"

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
  int threads = 1;                                   // exec::Host threads for the KV kernels
  bool validate_tables = false;                      // validate_page_table() on every step
};

class Engine;

/// What a StepHook sees. Pointers are valid during the call only; a hook that changes
/// sequences (truncate_kv, free_sequence) makes `layer_views` stale.
struct StepInfo {
  std::int64_t step = 0;                             // steps run so far, this one included
  std::int32_t batch = 0;                            // sequences in this step
  const SeqId* seq_ids = nullptr;                    // [batch] sequence of each view row
  const PagedKVView<float>* layer_views = nullptr;   // [n_layers] after this step's write
  const float* const* queries = nullptr;             // [n_layers] -> [batch, Hq, D] post-RoPE
  const float* logits = nullptr;                     // [batch, vocab]
};

/// Called after every step (see the file comment).
using StepHook = std::function<void(Engine&, const StepInfo&)>;

class Engine {
 public:
  /// Builds the pools and allocator; throws kvkit::Error on bad options (value named).
  Engine(std::shared_ptr<const Checkpoint> ckpt, const EngineOptions& options)
      : model_(ckpt, options.threads), opt_(options) {
    const ModelConfig& c = model_.config();
    KVKIT_CHECK(opt_.max_batch > 0, "kvkit: max_batch must be > 0, got ", opt_.max_batch);
    if (opt_.contiguous) {
      opt_.page_size = c.seq_len;
      if (opt_.num_pages == 0) opt_.num_pages = opt_.max_batch;
    }
    KVKIT_CHECK(opt_.page_size > 0, "kvkit: page_size must be > 0, got ", opt_.page_size);
    KVKIT_CHECK(opt_.threads >= 0, "kvkit: threads must be >= 0, got ", opt_.threads);
    max_pages_per_seq_ = (c.seq_len + opt_.page_size - 1) / opt_.page_size;
    if (opt_.num_pages == 0) {
      const std::int64_t n = static_cast<std::int64_t>(opt_.max_batch) * max_pages_per_seq_;
      KVKIT_CHECK(n <= 1 << 30, "kvkit: default pool of ", n, " pages is too large");
      opt_.num_pages = static_cast<std::int32_t>(n);
    }
    KVKIT_CHECK(opt_.num_pages > 0, "kvkit: num_pages must be > 0, got ", opt_.num_pages);
    geometry_ = KVGeometry{c.n_kv_heads, c.head_dim(), opt_.page_size, opt_.num_pages};
    strides_ = packed_strides(geometry_, opt_.layout);
    const std::size_t pool = static_cast<std::size_t>(strides_.page) * opt_.num_pages;
    k_pools_.assign(static_cast<std::size_t>(c.n_layers), std::vector<float>(pool, 0.f));
    v_pools_.assign(static_cast<std::size_t>(c.n_layers), std::vector<float>(pool, 0.f));
    allocator_ = std::make_unique<BlockAllocator>(opt_.num_pages, opt_.shuffle_seed);
    model_.reserve(opt_.max_batch);
  }
  Engine(const Checkpoint& ckpt, const EngineOptions& options)
      : Engine(std::make_shared<const Checkpoint>(ckpt), options) {}

  const ModelConfig& config() const { return model_.config(); }
  /// Effective options (page_size / num_pages resolved).
  const EngineOptions& options() const { return opt_; }
  Model& model() { return model_; }
  const Model& model() const { return model_; }
  BlockAllocator& allocator() { return *allocator_; }
  const BlockAllocator& allocator() const { return *allocator_; }
  KVGeometry geometry() const { return geometry_; }
  KVStrides strides() const { return strides_; }
  float* k_pool(int layer) { return k_pools_.at(static_cast<std::size_t>(layer)).data(); }
  float* v_pool(int layer) { return v_pools_.at(static_cast<std::size_t>(layer)).data(); }

  /// Adds a sequence that will be fed `prompt` (teacher-forced) and then decode greedily.
  /// Returns its id (ids increase; batch order is ascending id).
  SeqId add_sequence(const std::vector<std::int32_t>& prompt) {
    check_prompt(prompt);
    Sequence s;
    s.tokens = prompt;
    return insert(std::move(s));
  }

  /// Adds a sequence whose first `cached_len` tokens already have K/V in `pages` (a reused
  /// prefix, a resumed conversation, blocks loaded from a store). The engine takes over
  /// one reference of each page (the caller allocated or retained it) and starts at
  /// position cached_len, so prompt.size() must exceed cached_len. A partly filled last
  /// page must be exclusively owned (refcount 1), since the next token is written into it.
  SeqId add_sequence(const std::vector<std::int32_t>& prompt, const std::vector<std::int32_t>& pages,
                     std::int32_t cached_len) {
    check_prompt(prompt);
    KVKIT_CHECK(cached_len >= 0 && static_cast<std::size_t>(cached_len) < prompt.size(),
                "kvkit: cached_len ", cached_len, " must be in [0, prompt length ", prompt.size(), ")");
    const std::int32_t need = (cached_len + opt_.page_size - 1) / opt_.page_size;
    KVKIT_CHECK(static_cast<std::int32_t>(pages.size()) == need, "kvkit: ", pages.size(),
                " pages given for ", cached_len, " cached tokens of page size ", opt_.page_size,
                ", expected ", need);
    for (std::int32_t p : pages)
      KVKIT_CHECK(allocator_->refcount(p) > 0, "kvkit: cached page ", p, " is not allocated");
    // The next token is written into a partly filled last page: it must not be shared
    // (there is no copy-on-write), or the other owner's cache would change under it.
    if (cached_len % opt_.page_size != 0)
      KVKIT_CHECK(allocator_->refcount(pages.back()) == 1, "kvkit: partly filled cached page ",
                  pages.back(), " is shared (refcount ", allocator_->refcount(pages.back()),
                  "); share only full pages");
    Sequence s;
    s.tokens = prompt;
    s.pages = pages;
    s.kv_len = cached_len;
    s.processed = cached_len;
    return insert(std::move(s));
  }

  /// Releases the sequence's pages (one reference each) and forgets it.
  void free_sequence(SeqId id) {
    Sequence& s = seq(id);
    for (std::int32_t p : s.pages) allocator_->release(p);
    seqs_.erase(id);
    dirty_ = true;
  }

  /// Drops cached K/V past `new_kv_len` (a policy compacted the kept tokens to the front)
  /// and releases the pages no longer needed. The position keeps counting processed tokens.
  void truncate_kv(SeqId id, std::int32_t new_kv_len) {
    Sequence& s = seq(id);
    KVKIT_CHECK(new_kv_len >= 0 && new_kv_len <= s.kv_len, "kvkit: truncate_kv of sequence ", id,
                " to ", new_kv_len, " tokens, it caches ", s.kv_len);
    const std::size_t keep = static_cast<std::size_t>((new_kv_len + opt_.page_size - 1) / opt_.page_size);
    while (s.pages.size() > keep) {
      allocator_->release(s.pages.back());
      s.pages.pop_back();
    }
    s.kv_len = new_kv_len;
    dirty_ = true;
  }

  /// Live sequences in batch order (ascending id).
  std::vector<SeqId> sequences() const {
    std::vector<SeqId> ids;
    for (const auto& kv : seqs_) ids.push_back(kv.first);
    return ids;
  }
  std::int32_t num_sequences() const { return static_cast<std::int32_t>(seqs_.size()); }
  bool has_sequence(SeqId id) const { return seqs_.count(id) != 0; }
  /// Prompt plus generated tokens; the last one is not processed yet.
  const std::vector<std::int32_t>& tokens(SeqId id) const { return seq(id).tokens; }
  /// Tokens processed so far (the RoPE position of the next one).
  std::int32_t position(SeqId id) const { return seq(id).processed; }
  /// Tokens whose K/V are cached.
  std::int32_t kv_len(SeqId id) const { return seq(id).kv_len; }
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
  std::int64_t bytes_per_page() const { return strides_.page * static_cast<std::int64_t>(sizeof(float)); }
  /// K and V bytes of all layers held by pages in use (now / at the peak).
  std::int64_t kv_bytes_in_use() const { return pages_bytes(allocator_->pages_in_use()); }
  std::int64_t kv_bytes_peak() const { return pages_bytes(allocator_->peak_pages_in_use()); }
  std::int64_t pages_bytes(std::int64_t pages) const {
    return pages * bytes_per_page() * config().n_layers * 2;
  }

  /// Registers a hook run after every step, in registration order.
  void add_step_hook(StepHook hook) { hooks_.push_back(std::move(hook)); }
  /// Replaces the dense attention (an empty function restores it).
  void set_attention(AttentionFn fn) { attention_ = std::move(fn); }

  /// One decode step for every live sequence: prompt tokens are teacher-forced, then the
  /// greedy argmax (lowest id on ties) is appended. Throws kvkit::Error when there is no
  /// sequence, a sequence reached the model's seq_len, or the pool is out of pages.
  void step() { run_step(nullptr); }

  /// One step where forced_next[i] (batch order) becomes sequence i's next token instead
  /// of the argmax (teacher forcing). For a sequence still inside its prompt the entry
  /// must be -1 or equal to the prompt's next token.
  void forward_tokens(const std::vector<std::int32_t>& forced_next) {
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
    run_step(&forced_next);
  }

  /// Per-layer views over the live sequences as they are now (batch order = sequences()).
  /// Valid until the next change to the engine.
  const std::vector<PagedKVView<float>>& layer_views() {
    if (dirty_) build_views();
    return views_;
  }

 private:
  struct Sequence {
    std::vector<std::int32_t> tokens;
    std::vector<std::int32_t> pages;
    std::vector<float> logits;  // [vocab] of the last step
    std::int32_t kv_len = 0;
    std::int32_t processed = 0;
  };

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

  // Rebuilds the page-table arrays and per-layer views from the live sequences.
  void build_views() {
    const std::int32_t B = num_sequences();
    indptr_.assign(1, 0);
    indices_.clear();
    last_page_len_.clear();
    table_.assign(static_cast<std::size_t>(B) * max_pages_per_seq_, -1);
    seq_lens_.clear();
    std::int32_t b = 0;
    for (const auto& kv : seqs_) {
      const Sequence& s = kv.second;
      indices_.insert(indices_.end(), s.pages.begin(), s.pages.end());
      indptr_.push_back(static_cast<std::int32_t>(indices_.size()));
      last_page_len_.push_back(s.kv_len == 0 ? 0 : s.kv_len - (static_cast<std::int32_t>(s.pages.size()) - 1) * opt_.page_size);
      std::copy(s.pages.begin(), s.pages.end(), table_.begin() + static_cast<std::ptrdiff_t>(b) * max_pages_per_seq_);
      seq_lens_.push_back(s.kv_len);
      ++b;
    }
    views_.clear();
    for (int l = 0; l < config().n_layers; ++l) {
      if (opt_.table_kind == PageTableKind::kCsr) {
        views_.push_back(make_csr_view(geometry_, k_pool(l), strides_, v_pool(l), strides_,
                                       CsrPageTable{indptr_.data(), indices_.data(),
                                                    last_page_len_.data(), B}));
      } else {
        views_.push_back(make_block_table_view(geometry_, k_pool(l), strides_, v_pool(l), strides_,
                                               BlockTable{table_.data(), max_pages_per_seq_,
                                                          seq_lens_.data(), B}));
      }
    }
    if (opt_.validate_tables && !views_.empty()) views_.front().validate_page_table();
    dirty_ = false;
  }

  void run_step(const std::vector<std::int32_t>* forced) {
    const ModelConfig& c = config();
    const std::int32_t B = num_sequences();
    KVKIT_CHECK(B > 0, "kvkit: step() with no sequences");
    for (const auto& kv : seqs_)
      KVKIT_CHECK(kv.second.processed < c.seq_len, "kvkit: sequence ", kv.first,
                  " reached the model's seq_len ", c.seq_len);
    // Allocate every page this step needs first, so running out leaves nothing half-done.
    std::vector<std::int32_t> fresh;
    for (const auto& kv : seqs_) {
      const Sequence& s = kv.second;
      if (s.kv_len == static_cast<std::int32_t>(s.pages.size()) * opt_.page_size) {
        const std::int32_t p = allocator_->try_allocate();
        if (p < 0) {
          for (std::int32_t q : fresh) allocator_->release(q);
          fail("kvkit: out of KV pages: all ", allocator_->num_pages(), " pages of ",
               opt_.page_size, " tokens are in use (", B, " sequences)");
        }
        fresh.push_back(p);
      }
    }
    batch_ids_.clear();
    in_tokens_.clear();
    in_pos_.clear();
    in_slots_.clear();
    std::size_t f = 0;
    for (auto& kv : seqs_) {
      Sequence& s = kv.second;
      if (s.kv_len == static_cast<std::int32_t>(s.pages.size()) * opt_.page_size)
        s.pages.push_back(fresh[f++]);
      const std::int32_t page = s.pages[static_cast<std::size_t>(s.kv_len / opt_.page_size)];
      in_slots_.push_back(static_cast<std::int64_t>(page) * opt_.page_size + s.kv_len % opt_.page_size);
      in_tokens_.push_back(s.tokens[static_cast<std::size_t>(s.processed)]);
      in_pos_.push_back(s.processed);
      batch_ids_.push_back(kv.first);
      ++s.kv_len;
    }
    build_views();
    logits_.resize(static_cast<std::size_t>(B) * c.vocab_size);
    const ForwardBatch in{B, in_tokens_.data(), in_pos_.data(), in_slots_.data()};
    const Status st = model_.forward(in, views_.data(), logits_.data(), &attention_);
    if (!st.is_ok()) fail("kvkit: forward step failed: ", st.to_string());
    ++steps_;
    std::int32_t b = 0;
    for (auto& kv : seqs_) {
      Sequence& s = kv.second;
      const float* row = logits_.data() + static_cast<std::size_t>(b) * c.vocab_size;
      s.logits.assign(row, row + c.vocab_size);
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
      const StepInfo info{steps_, B, batch_ids_.data(), views_.data(), query_ptrs_.data(),
                          logits_.data()};
      for (auto& hook : hooks_) hook(*this, info);
    }
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
  std::vector<std::vector<float>> k_pools_, v_pools_;  // [n_layers][num_pages * page elements]
  std::unique_ptr<BlockAllocator> allocator_;
  std::map<SeqId, Sequence> seqs_;
  SeqId next_id_ = 0;
  std::int64_t steps_ = 0;
  bool dirty_ = true;
  std::vector<StepHook> hooks_;
  AttentionFn attention_;
  // Page tables and views of the current batch (rebuilt when sequences change).
  std::vector<std::int32_t> indptr_, indices_, last_page_len_, table_, seq_lens_;
  std::vector<PagedKVView<float>> views_;
  // Step inputs and outputs.
  std::vector<SeqId> batch_ids_;
  std::vector<std::int32_t> in_tokens_, in_pos_;
  std::vector<std::int64_t> in_slots_;
  std::vector<float> logits_;  // [batch, vocab]
  std::vector<const float*> query_ptrs_;
};

}  // namespace engine
}  // namespace kvkit
