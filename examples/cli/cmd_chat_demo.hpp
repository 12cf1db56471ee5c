#pragma once
// `kvkit chat-demo`: a multi-turn workload under a KV page budget, run four ways
// (issue 19 §5):
//   no_cache                  every turn prefills the whole history;
//   prefix_lru                block-level prefix caching as vLLM does it
//                             (examples/engine/prefix_lru.hpp);
//   conversation_cache        kvkit::conversation::ConversationCache, same page budget;
//   conversation_cache_spill  the same, evicted conversations spilled to a BlockStore
//                             (--store memory | redis://...) and restored on resume.
// The next conversation to speak is drawn with Zipf-skewed popularity (weight 1/(rank)^s,
// fixed seed) among those with turns left. A turn adds a user message (GGUF: the chats of
// examples/prompts/suite.json in ChatML, cycled; llama2.c / synthetic: random token ids)
// and a greedy reply. Prints per-turn prefill tokens, reuse % and wall time per way and a
// summary; --json prints one object {no_cache, prefix_lru, conversation_cache,
// conversation_cache_spill: {prefill_tokens, reused_tokens, reuse_fraction, evictions,
// wall_s, shared_pages (conversation ways)}, outputs_match}. The conversation ways share
// full prefix pages across conversations by refcount (Params::share_prefixes; --no-share
// turns it off). reuse_fraction = reused / history tokens computed in earlier
// turns (what could have been reused); evictions counts conversations (blocks for
// prefix_lru). The default page budget is 25 % of the pages of the total final history
// (at least one conversation's pages).
//
// --budget B [--buffer U] adds a fifth way, conversation_cache_r1kv: conversation_cache with
// R1KV attached (CompressorPolicy, budget B, buffer U), so conversations are compressed and
// suspended / resumed compressed (the policy's query window carried, see
// conversation_host.hpp). It is lossy by design, so outputs_match leaves it out; every
// conversation way reports the KV bytes its cache holds (kv_bytes_held at the end,
// kv_bytes_held_peak after any turn), the host memory of the policy states it keeps with
// suspended conversations (state_bytes_held: R1KV's query windows, outside the KV pools)
// and the R1KV way its compression counters.
//
// Entry point: run_chat_demo(argc, argv) with argv[0] == "chat-demo"; returns the exit code
// (0 ok, 1 library or I/O error, 2 usage error), errors as in the rest of the CLI.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/parse_subcommand.hpp"
#include "engine/checkpoint.hpp"
#include "engine/conversation_host.hpp"
#include "engine/engine.hpp"
#include "engine/gguf.hpp"
#include "engine/gguf_checkpoint.hpp"
#include "engine/prefix_lru.hpp"
#include "engine/r1kv_policy.hpp"
#include "engine/tokenizer.hpp"
#include "kvkit/conversation/conversation_cache.hpp"
#include "kvkit/store/block_store.hpp"
#if defined(KVKIT_CLI_HAS_REDIS)
#include "kvkit/store/redis_store.hpp"
#endif

namespace kvkit {
namespace cli {
namespace chat_demo {

using Json = nlohmann::json;
using engine::Engine;
using engine::EngineOptions;
using engine::SeqId;

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Options {
  std::string model;
  std::int32_t conversations = 16;
  std::int32_t turns = 10;
  std::int32_t page_budget = 0;  // 0: 25 % of the total history
  std::int32_t page_size = 16;
  std::int32_t reply_tokens = 0;  // 0: 16 (llama2.c / synthetic) or 24 (GGUF)
  std::int32_t threads = 1;
  std::string store = "memory";
  std::string suite;
  std::uint64_t seed = 1;
  double zipf = 1.0;
  std::string evict = "whole";  // conversation_cache under pressure: whole | trim
  bool no_share = false;        // conversation ways without cross-conversation prefix sharing
  bool json = false;
  std::int32_t r1kv_budget = 0;   // > 0: also run conversation_cache_r1kv
  std::int32_t r1kv_buffer = 16;
  std::string kv_dtype = "float32";  // element type of the pages (and of spilled blocks)
};

/// The workload: per conversation, per turn, the tokens a turn appends (GGUF turns after the
/// first also get the end-of-turn token when the reply was cut), and who speaks when.
struct Workload {
  bool text = false;
  std::vector<std::vector<std::vector<std::int32_t>>> user;  // [conversation][turn]
  std::vector<std::int32_t> order;                            // conversation of each turn
  std::int32_t reply = 16;
  std::int32_t end_of_turn = -1;
  std::shared_ptr<const engine::Tokenizer> tok;
};

inline double u01(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * (1.0 / 9007199254740992.0); }

// Zipf-skewed speaking order: each draw picks among conversations with turns left, with
// weight 1 / (c + 1)^s.
inline std::vector<std::int32_t> zipf_order(std::int32_t n, std::int32_t turns, double s, std::mt19937_64& rng) {
  std::vector<std::int32_t> left(static_cast<std::size_t>(n), turns), order;
  std::vector<double> w(static_cast<std::size_t>(n));
  for (std::int32_t c = 0; c < n; ++c) w[static_cast<std::size_t>(c)] = 1.0 / std::pow(c + 1.0, s);
  for (std::int64_t k = 0; k < static_cast<std::int64_t>(n) * turns; ++k) {
    double total = 0;
    for (std::int32_t c = 0; c < n; ++c) total += left[static_cast<std::size_t>(c)] > 0 ? w[static_cast<std::size_t>(c)] : 0.0;
    double u = u01(rng) * total;
    std::int32_t pick = -1;
    for (std::int32_t c = 0; c < n; ++c) {
      if (left[static_cast<std::size_t>(c)] == 0) continue;
      pick = c;
      u -= w[static_cast<std::size_t>(c)];
      if (u < 0) break;
    }
    --left[static_cast<std::size_t>(pick)];
    order.push_back(pick);
  }
  return order;
}

inline std::string default_suite_path() {
  const std::filesystem::path here = std::filesystem::path(__FILE__).parent_path();
  return (here.parent_path() / "prompts" / "suite.json").string();
}

inline bool file_is_gguf(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return static_cast<bool>(in.read(magic, 4)) && std::string(magic, 4) == "GGUF";
}

// The chats of the prompt suite (kind "chat"): their user turns.
inline std::vector<std::vector<std::string>> suite_chats(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read the prompt suite " + path + " (use --suite)");
  const Json j = Json::parse(in);
  std::vector<std::vector<std::string>> chats;
  for (const Json& p : j.at("prompts"))
    if (p.at("kind") == "chat") chats.push_back(p.at("turns").get<std::vector<std::string>>());
  if (chats.empty()) throw std::runtime_error("the prompt suite " + path + " has no chats");
  return chats;
}

struct TurnRecord {
  std::int32_t conversation = 0, turn = 0, prompt = 0, prefill = 0, reused = 0, reusable = 0;
  double wall_s = 0;
};

struct WayResult {
  std::string name;
  std::int64_t prefill = 0, reused = 0, reusable = 0, evictions = 0;
  std::int64_t shared_pages = -1;  // conversation ways: pages taken from the prefix index
  double wall_s = 0;
  std::vector<TurnRecord> turns;
  std::vector<std::vector<std::int32_t>> outputs;  // generated tokens of each turn
  std::int32_t max_pages = 0;    // pages of the longest conversation (prompt + reply)
  std::int64_t total_pages = 0;  // sum over conversations of their final history's pages
  std::int64_t kv_bytes_held = -1;       // conversation ways: KV bytes the cache holds at the end
  std::int64_t kv_bytes_held_peak = -1;  // ... and at most after a turn
  std::int64_t state_bytes_held = -1;    // ... and the policy states kept with them (host memory)
  std::int32_t suspended = 0;            // conversations suspended in memory at the end
  engine::PolicyStats policy_stats;      // the R1KV way's counters
  conversation::Metrics metrics;         // conversation ways
  double reuse_fraction() const { return reusable > 0 ? static_cast<double>(reused) / reusable : 0.0; }
};

/// The conversation_cache_r1kv way's policy options (--budget, --buffer).
inline engine::CompressorPolicyOptions r1kv_options(const Options& o) {
  engine::CompressorPolicyOptions po;
  po.params.budget = o.r1kv_budget;
  po.params.buffer = o.r1kv_buffer;
  return po;
}

enum class Way { kNoCache, kPrefixLru, kConversation, kConversationSpill, kConversationR1kv };

inline const char* way_name(Way w) {
  switch (w) {
    case Way::kNoCache: return "no_cache";
    case Way::kPrefixLru: return "prefix_lru";
    case Way::kConversation: return "conversation_cache";
    case Way::kConversationSpill: return "conversation_cache_spill";
    case Way::kConversationR1kv: return "conversation_cache_r1kv";
  }
  return "?";
}

inline std::int32_t pages_for(std::int64_t tokens, std::int32_t ps) {
  return static_cast<std::int32_t>((tokens + ps - 1) / ps);
}

template <class T>
WayResult run_way(Way way, const Workload& wl, std::shared_ptr<const engine::Checkpoint> ck, const Options& o,
                  std::int32_t num_pages, store::BlockBackend* backend, const std::string& ns) {
  WayResult res;
  res.name = way_name(way);
  EngineOptions eo;
  eo.page_size = o.page_size;
  eo.num_pages = num_pages;
  eo.max_batch = 1;
  eo.threads = o.threads;
  eo.kv_dtype = dtype_of_v<T>;
  // Every way must produce no_cache's tokens exactly: reused pages were written by decode
  // steps or by earlier prefills split elsewhere, so prefill attends as decode does.
  eo.prefill_decode_attention = true;
  Engine eng(ck, eo);
  const auto& cfg = eng.config();
  std::unique_ptr<engine::EngineConversationHostT<T>> host;
  std::unique_ptr<store::BlockStore<T>> bs;
  std::unique_ptr<conversation::ConversationCache<T>> cache;
  std::unique_ptr<engine::PrefixLruCache> plru;
  std::unique_ptr<engine::R1KVPolicy> r1kv;
  if (way == Way::kConversationR1kv) {
    r1kv = std::make_unique<engine::R1KVPolicy>(r1kv_options(o));
    r1kv->attach(eng);
  }
  if (way == Way::kConversation || way == Way::kConversationSpill || way == Way::kConversationR1kv) {
    conversation::Params p;
    p.trim_under_pressure = o.evict == "trim";
    p.share_prefixes = !o.no_share;
    if (way == Way::kConversationSpill) {
      store::BlockStoreConfig sc;
      sc.ns = ns;
      sc.num_layers = cfg.n_layers;
      sc.page_size = o.page_size;
      sc.num_kv_heads = cfg.n_kv_heads;
      sc.head_dim = cfg.head_dim();
      bs = std::make_unique<store::BlockStore<T>>(*backend, sc);
      p.spill = true;
    }
    host = std::make_unique<engine::EngineConversationHostT<T>>(eng);
    cache = std::make_unique<conversation::ConversationCache<T>>(*host, p, conversation::Clock{}, bs.get());
    eng.set_reclaim([&](std::int32_t n) { return cache->reclaim(n); });
  } else if (way == Way::kPrefixLru) {
    plru = std::make_unique<engine::PrefixLruCache>(eng.allocator(), o.page_size);
    eng.set_reclaim([&](std::int32_t n) { return plru->reclaim(n); });
  }
  const std::size_t n_conv = wl.user.size();
  std::vector<std::vector<std::int32_t>> hist(n_conv);
  std::vector<std::int32_t> computed(n_conv, 0), next_turn(n_conv, 0);
  const auto t_all = std::chrono::steady_clock::now();
  for (std::int32_t c : wl.order) {
    const std::size_t ci = static_cast<std::size_t>(c);
    const std::int32_t t = next_turn[ci]++;
    std::vector<std::int32_t> prompt = hist[ci];
    if (wl.text && t > 0 && !wl.tok->is_end_of_generation(prompt.back())) prompt.push_back(wl.end_of_turn);
    const auto& add = wl.user[ci][static_cast<std::size_t>(t)];
    prompt.insert(prompt.end(), add.begin(), add.end());
    if (static_cast<std::int64_t>(prompt.size()) + wl.reply > cfg.seq_len)
      throw UsageError("conversation " + std::to_string(c) + " would reach " +
                       std::to_string(prompt.size() + static_cast<std::size_t>(wl.reply)) +
                       " tokens at turn " + std::to_string(t) + ", past the model's seq_len " +
                       std::to_string(cfg.seq_len) + " (fewer --turns)");
    const std::string id = std::to_string(c);
    const auto t0 = std::chrono::steady_clock::now();
    SeqId s = -1;
    std::int32_t cached = 0;
    if (way == Way::kNoCache) {
      s = eng.add_sequence(prompt);
    } else if (way == Way::kPrefixLru) {
      engine::PrefixLruCache::Hit h = plru->lookup(prompt.data(), prompt.size());
      cached = h.cached_len;
      s = eng.add_sequence(prompt, h.pages, h.cached_len);
    } else {
      conversation::Resume r;
      s = engine::start_turn(eng, *cache, id, prompt, &r, r1kv.get());
      cached = r.position;  // a compressed resume caches fewer, but prefills only past it
    }
    eng.prefill(s);
    std::vector<std::int32_t> out;
    for (std::int32_t i = 0; i < wl.reply; ++i) {
      eng.step();
      const std::int32_t tok = eng.tokens(s).back();
      out.push_back(tok);
      if (wl.text && wl.tok->is_end_of_generation(tok)) break;
    }
    hist[ci] = eng.tokens(s);
    res.max_pages = std::max(res.max_pages, static_cast<std::int32_t>(eng.pages(s).size()));
    TurnRecord rec;
    rec.conversation = c;
    rec.turn = t;
    rec.prompt = static_cast<std::int32_t>(prompt.size());
    rec.prefill = rec.prompt - cached;
    rec.reused = cached;
    rec.reusable = computed[ci];
    computed[ci] = eng.position(s);
    if (way == Way::kNoCache) {
      eng.free_sequence(s);
    } else if (way == Way::kPrefixLru) {
      const std::vector<std::int32_t> pages = eng.pages(s);
      const std::vector<std::int32_t> done = eng.processed_tokens(s);
      plru->cache_blocks(done.data(), done.size(), pages);
      eng.free_sequence(s);
      plru->queue_unused(pages);
    } else {
      engine::finish_turn(eng, *cache, id, s, r1kv.get());
      res.kv_bytes_held_peak = std::max(res.kv_bytes_held_peak, eng.pages_bytes(cache->held_pages()));
    }
    rec.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    res.prefill += rec.prefill;
    res.reused += rec.reused;
    res.reusable += rec.reusable;
    res.turns.push_back(rec);
    res.outputs.push_back(std::move(out));
  }
  res.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_all).count();
  for (const auto& h : hist) res.total_pages += pages_for(static_cast<std::int64_t>(h.size()), o.page_size);
  if (cache) res.evictions = static_cast<std::int64_t>(cache->metrics().evictions);
  if (cache) res.shared_pages = static_cast<std::int64_t>(cache->metrics().shared_pages);
  if (cache) {
    res.kv_bytes_held = eng.pages_bytes(cache->held_pages());
    res.state_bytes_held = cache->host_state_bytes();
    res.suspended = cache->suspended();
    res.metrics = cache->metrics();
  }
  if (r1kv) res.policy_stats = r1kv->stats();
  if (plru) res.evictions = static_cast<std::int64_t>(plru->evicted_blocks());
  return res;
}

inline Workload make_workload(const Options& o, const std::string& model_path,
                              std::shared_ptr<const engine::Checkpoint>* ck, std::string* model_name) {
  Workload wl;
  std::mt19937_64 rng(o.seed);
  const std::size_t n = static_cast<std::size_t>(o.conversations), T = static_cast<std::size_t>(o.turns);
  wl.user.assign(n, std::vector<std::vector<std::int32_t>>(T));
  if (!model_path.empty() && file_is_gguf(model_path)) {
    const engine::GgufFile g = engine::GgufFile::open(model_path);
    *ck = std::make_shared<const engine::Checkpoint>(engine::load_gguf_checkpoint(g, /*float_projections=*/false));
    wl.tok = std::make_shared<const engine::Tokenizer>(engine::Tokenizer::from_gguf(g));
    engine::ChatTemplate tmpl;
    if (g.has("tokenizer.chat_template")) tmpl = engine::ChatTemplate::from_gguf(g);
    wl.text = true;
    wl.end_of_turn = wl.tok->find_token("<|im_end|>");
    if (wl.end_of_turn < 0) wl.end_of_turn = wl.tok->eos_id();
    wl.reply = o.reply_tokens > 0 ? o.reply_tokens : 24;
    const auto chats = suite_chats(o.suite.empty() ? default_suite_path() : o.suite);
    for (std::size_t c = 0; c < n; ++c) {
      const auto& chat = chats[c % chats.size()];
      for (std::size_t t = 0; t < T; ++t) {
        std::string text = chat[t % chat.size()];
        if (t == 0) {
          text = "(chat " + std::to_string(c) + ") " + text;  // conversations differ from the first turn on
          wl.user[c][t] = tmpl.encode(*wl.tok, {{"user", text}}, /*add_generation_prompt=*/true);
        } else {
          wl.user[c][t] = wl.tok->encode("\n<|im_start|>user\n" + text + "<|im_end|>\n<|im_start|>assistant\n",
                                         /*add_special=*/false, /*parse_special=*/true);
        }
      }
    }
  } else {
    *ck = std::make_shared<const engine::Checkpoint>(model_path.empty() ? engine::default_synthetic_checkpoint()
                                                                        : engine::load_checkpoint(model_path));
    wl.reply = o.reply_tokens > 0 ? o.reply_tokens : 16;
    const std::int32_t vocab = (*ck)->config().vocab_size;
    for (std::size_t c = 0; c < n; ++c)
      for (std::size_t t = 0; t < T; ++t) {
        const std::size_t len = 8 + static_cast<std::size_t>(rng() % 17);  // 8..24 tokens
        std::vector<std::int32_t> u;
        if (t == 0) u.push_back(engine::kBosToken);
        for (std::size_t i = 0; i < len; ++i) u.push_back(3 + static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(vocab - 3)));
        wl.user[c][t] = std::move(u);
      }
  }
  *model_name = model_path.empty() ? "synthetic" : model_path;
  wl.order = zipf_order(o.conversations, o.turns, o.zipf, rng);
  return wl;
}

inline std::unique_ptr<store::BlockBackend> make_backend(const std::string& spec) {
  if (spec == "memory") return std::make_unique<store::MemoryBackend>(std::size_t{8} << 30);
  if (spec.rfind("redis://", 0) == 0) {
#if defined(KVKIT_CLI_HAS_REDIS)
    store::RedisOptions ro;
    const Status st = store::parse_redis_url(spec, &ro);
    if (!st.is_ok()) throw UsageError("--store " + spec + ": " + st.to_string());
    auto b = std::make_unique<store::RedisBackend>(ro);
    const Status c = b->connect();
    if (!c.is_ok()) throw std::runtime_error("--store " + spec + ": cannot connect: " + c.to_string());
    return b;
#else
    throw UsageError("--store " + spec + ": this kvkit was built without Redis (hiredis)");
#endif
  }
  throw UsageError("--store must be memory or redis://..., got '" + spec + "'");
}

inline int run(const Options& o) {
  DType dtype = DType::kFloat32;
  if (!dtype_from_string(o.kv_dtype.c_str(), &dtype)) throw UsageError("unsupported --kv-dtype " + o.kv_dtype);
  std::shared_ptr<const engine::Checkpoint> ck;
  std::string model_name;
  const Workload wl = make_workload(o, o.model, &ck, &model_name);
  const auto& cfg = ck->config();
  // Without pressure no_cache needs one conversation's pages: bound it by what the turns add.
  std::int64_t longest = 0;
  for (const auto& conv : wl.user) {
    std::int64_t len = 0;
    for (const auto& u : conv) len += static_cast<std::int64_t>(u.size()) + wl.reply + 1;
    longest = std::max(longest, len);
  }
  const std::int32_t one = pages_for(std::min<std::int64_t>(longest, cfg.seq_len), o.page_size) + 1;
  auto backend = make_backend(o.store);
  // The dtype is in the namespace too: blocks of another page type are never looked up.
  const std::string ns = store::make_namespace(
      model_name, "chat-demo-" + std::to_string(o.page_size) + (dtype == DType::kFloat32 ? "" : "-" + o.kv_dtype));

  if (o.r1kv_budget > 0) {  // the policy's own checks, as a usage error
    try {
      r1kv_options(o).params.validate();
    } catch (const Error& e) {
      throw UsageError(std::string("--budget / --buffer: ") + e.what());
    }
    if (o.r1kv_budget >= cfg.seq_len)
      throw UsageError("--budget " + std::to_string(o.r1kv_budget) + " must be below the model's seq_len " +
                       std::to_string(cfg.seq_len));
  }
  // run_way on pages of the --kv-dtype type.
  auto run_typed = [&](Way w, std::int32_t pages, store::BlockBackend* be) {
    return visit_dtype(dtype, [&](auto tag) { return run_way<decltype(tag)>(w, wl, ck, o, pages, be, ns); });
  };
  std::vector<WayResult> results;
  results.reserve(5);  // `base` refers into it
  results.push_back(run_typed(Way::kNoCache, one, nullptr));
  const WayResult& base = results[0];
  std::int32_t budget = o.page_budget;
  if (budget == 0)
    budget = std::max(base.max_pages, static_cast<std::int32_t>(std::ceil(0.25 * static_cast<double>(base.total_pages))));
  if (budget < base.max_pages)
    throw UsageError("--page-budget " + std::to_string(budget) + " is below one conversation: the longest needs " +
                     std::to_string(base.max_pages) + " pages of " + std::to_string(o.page_size) + " tokens");
  for (Way w : {Way::kPrefixLru, Way::kConversation, Way::kConversationSpill})
    results.push_back(run_typed(w, budget, backend.get()));
  if (o.r1kv_budget > 0) results.push_back(run_typed(Way::kConversationR1kv, budget, backend.get()));

  bool match = true;
  for (const WayResult& r : results) {
    if (r.name == way_name(Way::kConversationR1kv)) continue;  // lossy: other tokens are expected
    std::size_t first = 0;
    while (first < r.outputs.size() && r.outputs[first] == base.outputs[first]) ++first;
    if (first < r.outputs.size()) {
      match = false;
      std::cerr << "kvkit: chat-demo: " << r.name << " differs from no_cache first at turn " << first
                << " (conversation " << r.turns[first].conversation << ", its turn " << r.turns[first].turn
                << ")\n";
    }
  }
  if (o.json) {
    Json j;
    for (const WayResult& r : results) {
      j[r.name] = {{"prefill_tokens", r.prefill},
                   {"reused_tokens", r.reused},
                   {"reuse_fraction", r.reuse_fraction()},
                   {"evictions", r.evictions},
                   {"wall_s", r.wall_s}};
      if (r.shared_pages >= 0) j[r.name]["shared_pages"] = r.shared_pages;
      if (r.kv_bytes_held >= 0) {
        j[r.name]["kv_bytes_held"] = r.kv_bytes_held;
        j[r.name]["kv_bytes_held_peak"] = r.kv_bytes_held_peak;
        j[r.name]["state_bytes_held"] = r.state_bytes_held;
        j[r.name]["suspended"] = r.suspended;
      }
      if (!r.policy_stats.empty()) {
        for (const auto& kv : r.policy_stats) j[r.name][kv.first] = kv.second;
        j[r.name]["compressed_hits"] = r.metrics.compressed_hits;
        j[r.name]["compressed_misses"] = r.metrics.compressed_misses;
        j[r.name]["compressed_evictions"] = r.metrics.compressed_evictions;
      }
    }
    j["kv_dtype"] = o.kv_dtype;
    j["outputs_match"] = match;
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::cout << "kvkit chat-demo: " << model_name << ", " << o.conversations << " conversations x " << o.turns
            << " turns (Zipf s=" << o.zipf << ", seed " << o.seed << "), replies <= " << wl.reply
            << " tokens, page size " << o.page_size << ", page budget " << budget << " pages (total history "
            << base.total_pages << " pages), " << o.kv_dtype << " pages, store " << o.store << ", eviction " << o.evict
            << (o.no_share ? ", no prefix sharing" : ", prefix sharing") << "\n";
  std::cout << "  #  conv turn prompt |";
  for (const WayResult& r : results) std::cout << " " << std::setw(24) << r.name << " |";
  std::cout << "\n" << std::string(24, ' ') << "|";
  for (std::size_t i = 0; i < results.size(); ++i) std::cout << "  prefill reuse%    ms   |";
  std::cout << "\n";
  for (std::size_t k = 0; k < base.turns.size(); ++k) {
    const TurnRecord& b = base.turns[k];
    std::cout << std::setw(3) << k << " " << std::setw(5) << b.conversation << " " << std::setw(4) << b.turn << " "
              << std::setw(6) << b.prompt << " |";
    for (const WayResult& r : results) {
      const TurnRecord& t = r.turns[k];
      std::cout << " " << std::setw(8) << t.prefill << " " << std::setw(6) << std::fixed << std::setprecision(1)
                << (t.reusable > 0 ? 100.0 * t.reused / t.reusable : 0.0) << " " << std::setw(7)
                << std::setprecision(2) << 1e3 * t.wall_s << " |";
    }
    std::cout << "\n";
  }
  std::cout << std::setprecision(3);
  for (const WayResult& r : results)
    std::cout << r.name << ": prefill " << r.prefill << " tokens, reused " << r.reused << " of " << r.reusable
              << " (" << 100.0 * r.reuse_fraction() << " %), evictions " << r.evictions
              << (r.shared_pages >= 0 ? ", shared pages " + std::to_string(r.shared_pages) : std::string())
              << (r.kv_bytes_held >= 0 ? ", KV held " + std::to_string(r.kv_bytes_held / 1024) + " KiB for " +
                                             std::to_string(r.suspended) + " suspended (peak " +
                                             std::to_string(r.kv_bytes_held_peak / 1024) + " KiB)" +
                                             (r.state_bytes_held > 0 ? " + " + std::to_string(r.state_bytes_held / 1024) +
                                                                           " KiB of policy state"
                                                                     : std::string())
                                       : std::string())
              << ", wall " << r.wall_s << " s\n";
  for (const WayResult& r : results)
    if (!r.policy_stats.empty())
      std::cout << r.name << ": R1KV budget " << o.r1kv_budget << " buffer " << o.r1kv_buffer << ", compressions "
                << r.policy_stats[0].second << ", compressed resumes " << r.metrics.compressed_hits
                << ", misses " << r.metrics.compressed_misses << ", compressed evictions "
                << r.metrics.compressed_evictions << " (lossy: not in outputs_match)\n";
  std::cout << "outputs_match: " << (match ? "true" : "false") << "\n";
  return 0;
}

}  // namespace chat_demo

/// `kvkit chat-demo ...` (argv[0] is "chat-demo"). Returns the process exit code.
inline int run_chat_demo(int argc, char** argv) {
  chat_demo::Options o;
  bool json = false;
  for (int i = 1; i < argc; ++i) json = json || std::string(argv[i]) == "--json";
  auto fail = [&](int code, const std::string& msg) {
    std::cerr << "kvkit: " << (code == 2 ? "error: " : "") << msg << "\n";
    if (json) std::cout << chat_demo::Json{{"error", msg}, {"code", code}}.dump() << "\n";
    return code;
  };
  CLI::App app("kvkit chat-demo: multi-turn conversations under a KV page budget, four ways "
               "(no_cache, prefix_lru, conversation_cache, conversation_cache_spill)",
               "kvkit chat-demo");
  app.add_option("--model", o.model, "GGUF chat model (suite.json chats) or llama2.c checkpoint (token-id turns); default: the synthetic model")
      ->type_name("PATH");
  app.add_option("--conversations", o.conversations, "conversations (default 16)")->type_name("N")->check(CLI::Range(1, 100000));
  app.add_option("--turns", o.turns, "turns per conversation (default 10)")->type_name("T")->check(CLI::Range(1, 100000));
  app.add_option("--page-budget", o.page_budget, "KV pages of the cached ways' pool (default: 25 % of the total history's pages)")
      ->type_name("P")->check(CLI::Range(1, 1 << 30));
  app.add_option("--page-size", o.page_size, "tokens per KV page (default 16)")->type_name("S")->check(CLI::Range(1, 4096));
  app.add_option("--reply-tokens", o.reply_tokens, "greedy reply tokens per turn, at most (default 16; GGUF 24, stops at <|im_end|>)")
      ->type_name("R")->check(CLI::Range(1, 4096));
  app.add_option("--store", o.store, "spill store of conversation_cache_spill: memory (default) or redis://[[user]:pw@]host[:port][/db]")
      ->type_name("memory|URL");
  app.add_option("--seed", o.seed, "seed of the speaking order and the token-id turns (default 1)")->type_name("S");
  app.add_option("--zipf", o.zipf, "Zipf exponent of the conversation popularity (default 1.0)")->type_name("S")->check(CLI::Range(0.0, 10.0));
  app.add_option("--suite", o.suite, "prompt suite with the chats (default examples/prompts/suite.json)")->type_name("FILE");
  app.add_option("--threads", o.threads, "engine threads (default 1)")->type_name("T")->check(CLI::Range(1, 64));
  app.add_option("--evict", o.evict, "conversation_cache under allocator pressure: whole (evict LRU conversations whole, default) or trim (drop their pages tail first)")
      ->type_name("MODE")->check(CLI::IsMember({"whole", "trim"}));
  app.add_flag("--no-share", o.no_share,
               "conversation ways without cross-conversation prefix sharing (each conversation keeps its pages privately)");
  app.add_option("--budget", o.r1kv_budget,
                 "also run conversation_cache_r1kv: the conversation cache with R1KV attached, budget B tokens per "
                 "kv head (conversations suspended and resumed compressed)")
      ->type_name("B")->check(CLI::Range(1, 1 << 30));
  CLI::Option* buffer_opt = app.add_option("--buffer", o.r1kv_buffer, "R1KV buffer: compress when a sequence caches budget + U tokens (default 16)")
      ->type_name("U")->check(CLI::Range(0, 1 << 30));
  app.add_option("--kv-dtype", o.kv_dtype,
                 "element type of the K/V pages and of spilled blocks: float32 (default), float16, bfloat16")
      ->type_name("DTYPE");
  app.add_flag("--json", o.json, "print one JSON object");
  if (const int rc = parse_subcommand(app, argc, argv, fail); rc != kParsed) return rc;
  if (buffer_opt->count() > 0 && o.r1kv_budget == 0) return fail(2, "--buffer needs --budget");
  try {
    return chat_demo::run(o);
  } catch (const chat_demo::UsageError& e) {
    return fail(2, e.what());
  } catch (const Error& e) {
    std::string m = e.what();
    if (m.rfind("kvkit: ", 0) == 0) m = m.substr(7);
    return fail(1, m);
  } catch (const std::exception& e) {
    return fail(1, e.what());
  }
}

}  // namespace cli
}  // namespace kvkit
