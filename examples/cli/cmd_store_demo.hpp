#pragma once
// `kvkit store-demo`: the BlockStore on a shared-prefix workload (cli/store_demo.hpp).
//
//   kvkit store-demo --model M --store memory|redis://HOST:PORT|redis-cluster://HOST:PORT[,...]
//                    [--max-tokens N] [--page-size P] [--threads T] [--document FILE]
//                    [--codec raw|zstd] [--kv-dtype float32|float16|bfloat16] [--keep] [--json]
//                    [--prefix-tokens N] [--requests N]
//
// A GGUF model (SmolLM2) answers 4 questions about one shared document (ChatML, text out);
// a llama2.c model (.bin) runs a 272-token common prefix + 4 suffixes of token ids (sizes
// set by --prefix-tokens and --requests). Three fresh engines run the workload in turn:
// without a store (reference outputs), cold (saves blocks), warm (loads them). Prints
// blocks saved, hit tokens, prefill tokens avoided, load and save time, and whether the warm
// outputs equal the reference token for token.
// The keys go under a namespace of the model and a per-run salt and are deleted at the end
// (--keep leaves them). Redis needs the kvkit::redis component (KVKIT_CLI_HAS_REDIS=1), zstd
// the kvkit::zstd one (KVKIT_HAS_ZSTD=1).
//
// add_store_demo_options() adds the options to a CLI11 subcommand; run_store_demo() runs it
// and returns the exit code: usage errors go to the caller's `fail(code, message)`, library
// and I/O errors are thrown (kvkit::Error, std::exception).

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/store_demo.hpp"
#include "engine/checkpoint.hpp"
#include "engine/gguf.hpp"
#include "engine/gguf_checkpoint.hpp"
#include "engine/tokenizer.hpp"
#include "kvkit/store/block_store.hpp"
#include "kvkit/version.hpp"
#if defined(KVKIT_CLI_HAS_REDIS) && KVKIT_CLI_HAS_REDIS
#include "kvkit/store/redis_cluster_store.hpp"
#include "kvkit/store/redis_store.hpp"
#endif

namespace kvkit {
namespace cli {

/// Options of `kvkit store-demo`.
struct StoreDemoOptions {
  std::string model;
  std::string store = "memory";
  std::string document;  // text models: file with the shared document (default: built in)
  std::string codec = "raw";
  std::string kv_dtype = "float32";  // element type of the pages, and so of the stored blocks
  std::int32_t max_tokens = 32;
  std::int32_t page_size = 16;
  std::int32_t threads = 1;
  std::optional<std::int32_t> prefix_tokens;  // llama2.c checkpoints: common prefix length (272)
  std::optional<std::int32_t> requests;       // llama2.c checkpoints: requests sharing it (4)
  bool keep = false;
  bool json = false;
};

/// Adds store-demo's options to `cmd` (values land in `o`).
inline void add_store_demo_options(CLI::App& cmd, StoreDemoOptions& o) {
  auto positive = [](std::int64_t hi) {
    return CLI::Range(std::int64_t{1}, hi);
  };
  cmd.add_option("--model", o.model, "GGUF model (text: a document + 4 questions) or llama2.c checkpoint (token ids)")
      ->type_name("PATH")
      ->required();
  cmd.add_option("--store", o.store,
                 "memory (default), redis://[[user]:pass@]HOST:PORT[/db], unix:///PATH (a local server's unix socket) or redis-cluster://HOST:PORT[,HOST:PORT...]")
      ->type_name("URL");
  cmd.add_option("--max-tokens", o.max_tokens, "tokens generated per request (default 32)")
      ->type_name("N")
      ->check(positive(4096));
  cmd.add_option("--page-size", o.page_size, "tokens per KV page = per stored block (default 16)")
      ->type_name("P")
      ->check(positive(4096));
  cmd.add_option("--threads", o.threads, "threads of the KV kernels and prefill (default 1)")
      ->type_name("T")
      ->check(positive(64));
  cmd.add_option("--prefix-tokens", o.prefix_tokens,
                 "llama2.c checkpoints: tokens of the common prefix, BOS included (default 272)")
      ->type_name("N")
      ->check(positive(1 << 20));
  cmd.add_option("--requests", o.requests, "llama2.c checkpoints: requests sharing the prefix (default 4)")
      ->type_name("N")
      ->check(positive(1024));
  cmd.add_option("--document", o.document, "text models: file holding the shared document (default: a built-in one)")
      ->type_name("FILE");
  cmd.add_option("--codec", o.codec, "stored payloads: raw (default) or zstd")
      ->type_name("C")
      ->check(CLI::IsMember({"raw", "zstd"}));
  cmd.add_option("--kv-dtype", o.kv_dtype,
                 "element type of the K/V pages and so of the stored blocks: float32 (default), float16 "
                 "or bfloat16 (half the bytes saved and loaded)")
      ->type_name("T")
      ->check(CLI::IsMember({"float32", "float16", "bfloat16"}));
  cmd.add_flag("--keep", o.keep, "leave the saved blocks in the store (default: delete them at the end)");
  cmd.add_flag("--json", o.json, "print exactly one JSON object on stdout");
}

namespace detail {

/// A command-line mistake (exit code 2).
struct StoreDemoUsage : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline bool is_gguf_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::string(magic, 4) == "GGUF";
}

struct Backend {
  std::unique_ptr<store::BlockBackend> backend;
  store::KeyStyle style = store::KeyStyle::kPlain;
};

inline Backend open_backend(const std::string& url) {
  Backend b;
  if (url == "memory") {
    b.backend = std::make_unique<store::MemoryBackend>(std::size_t{1} << 30);
    return b;
  }
  const bool cluster = url.rfind("redis-cluster://", 0) == 0;
  if (!cluster && url.rfind("redis://", 0) != 0 && url.rfind("unix://", 0) != 0 &&
      url.rfind("redis+unix://", 0) != 0)
    throw StoreDemoUsage("--store '" + url + "': expected memory, redis://HOST:PORT, unix:///PATH or redis-cluster://HOST:PORT[,...]");
#if defined(KVKIT_CLI_HAS_REDIS) && KVKIT_CLI_HAS_REDIS
  if (cluster) {
    store::RedisClusterOptions o;
    const Status st = store::parse_redis_cluster_url(url, &o);
    if (!st.is_ok()) throw StoreDemoUsage("--store: " + st.message());
    o.node.ttl_seconds = 3600;  // as for redis:// below
    auto r = std::make_unique<store::RedisClusterBackend>(o);
    // The slot map now, as redis:// connects now: an unreachable seed or a server without
    // cluster support fails here, naming --store, not after the store-free run.
    const Status c = r->refresh();
    if (!c.is_ok()) throw std::runtime_error("--store " + url + ": " + c.message());
    b.backend = std::move(r);
    b.style = store::KeyStyle::kClusterTagged;
  } else {
    store::RedisOptions o;
    const Status st = store::parse_redis_url(url, &o);
    if (!st.is_ok()) throw StoreDemoUsage("--store: " + st.message());
    o.ttl_seconds = 3600;  // a crashed demo leaves nothing for long
    auto r = std::make_unique<store::RedisBackend>(o);
    // Connecting also refuses a Redis Cluster node (the message names redis-cluster://):
    // as a single server it would answer MOVED for most keys, after the store-free run.
    const Status c = r->connect();
    if (!c.is_ok()) throw std::runtime_error("--store " + url + ": " + c.message());
    b.backend = std::move(r);
  }
  return b;
#else
  throw StoreDemoUsage("--store '" + url + "': this kvkit was built without hiredis (the kvkit::redis component)");
#endif
}

inline std::string join_ids(const std::vector<std::int32_t>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? " " : "") + std::to_string(v[i]);
  return s;
}

}  // namespace detail

/// Runs `kvkit store-demo` (see the file comment). `fail(code, message)` reports a usage
/// error and returns the exit code.
inline int run_store_demo(const StoreDemoOptions& o, const std::function<int(int, const std::string&)>& fail) {
  using namespace kvkit::engine;
  using Json = nlohmann::json;
  try {
    if (o.codec == "zstd" && !store::zstd_available())
      throw detail::StoreDemoUsage("--codec zstd: this kvkit was built without libzstd (the kvkit::zstd component)");
    // The store first, before the model is read: a bad --store (unreachable, a cluster node
    // given as redis://, no cluster behind redis-cluster://) fails in milliseconds.
    detail::Backend be = detail::open_backend(o.store);
    const bool text = detail::is_gguf_file(o.model);
    if (!text && !o.document.empty()) throw detail::StoreDemoUsage("--document needs a GGUF model with a tokenizer");
    if (text && (o.prefix_tokens || o.requests))
      throw detail::StoreDemoUsage(std::string(o.prefix_tokens ? "--prefix-tokens" : "--requests") +
                                   " sizes the token-id workload of llama2.c checkpoints; a GGUF model runs its "
                                   "--document and 4 questions");
    std::shared_ptr<const Checkpoint> ck;
    DemoWorkload w;
    std::shared_ptr<const Tokenizer> tok;
    std::int32_t stop = -1;
    if (text) {
      const GgufFile g = GgufFile::open(o.model);
      ck = std::make_shared<const Checkpoint>(load_gguf_checkpoint(g, /*float_projections=*/false));
      tok = std::make_shared<const Tokenizer>(Tokenizer::from_gguf(g));
      const ChatTemplate tmpl = g.has("tokenizer.chat_template") ? ChatTemplate::from_gguf(g) : ChatTemplate("");
      std::string doc = kStoreDemoDocument;
      if (!o.document.empty()) {
        std::ifstream in(o.document, std::ios::binary);
        if (!in) throw std::runtime_error("cannot read document file '" + o.document + "'");
        std::stringstream ss;
        ss << in.rdbuf();
        doc = ss.str();
      }
      w = text_workload(*tok, tmpl, doc, store_demo_questions());
      stop = tok->find_token("<|im_end|>");
      if (stop < 0) stop = tok->eos_id();
    } else {
      ck = std::make_shared<const Checkpoint>(load_checkpoint(o.model));
      const std::int32_t prefix = o.prefix_tokens.value_or(272);
      if (ck->config().seq_len < prefix + 17 + o.max_tokens)
        throw detail::StoreDemoUsage("the model's seq_len " + std::to_string(ck->config().seq_len) +
                                     " cannot hold the " + std::to_string(prefix) +
                                     "-token prefix, a suffix and --max-tokens " + std::to_string(o.max_tokens));
      w = token_workload(ck->config().vocab_size, prefix, o.requests.value_or(4));
    }
    std::size_t longest = 0;
    for (const DemoRequest& r : w.requests) longest = std::max(longest, r.prompt.size());
    if (static_cast<std::int64_t>(longest) + o.max_tokens > ck->config().seq_len)
      throw detail::StoreDemoUsage("a prompt of " + std::to_string(longest) + " tokens + --max-tokens " +
                                   std::to_string(o.max_tokens) + " exceed the model's seq_len " +
                                   std::to_string(ck->config().seq_len));

    DemoRunConfig cfg;
    cfg.engine.page_size = o.page_size;
    cfg.engine.threads = o.threads;
    if (!dtype_from_string(o.kv_dtype.c_str(), &cfg.engine.kv_dtype))
      throw detail::StoreDemoUsage("unsupported --kv-dtype " + o.kv_dtype);
    cfg.max_tokens = o.max_tokens;
    cfg.stop_token = stop;
    const auto t0 = std::chrono::steady_clock::now();
    const DemoRun base = run_demo_workload(ck, w, cfg);
    const auto t1 = std::chrono::steady_clock::now();
    std::random_device rd;
    const std::string salt = "store-demo-" + std::to_string(::getpid()) + "-" + std::to_string(rd());
    const auto& c = ck->config();
    std::ostringstream fp;  // the model's identity: file name, size and shape
    std::ifstream mf(o.model, std::ios::binary | std::ios::ate);
    fp << o.model.substr(o.model.find_last_of('/') + 1) << ":" << static_cast<long long>(mf.tellg()) << ":" << c.dim
       << "x" << c.n_layers << "x" << c.n_kv_heads << "x" << c.vocab_size;
    cfg.backend = be.backend.get();
    cfg.store.ns = store::make_namespace(fp.str(), salt);
    cfg.store.key_style = be.style;
    cfg.store.encode.codec = o.codec == "zstd" ? store::Codec::kZstd : store::Codec::kRaw;
    cfg.store.lookup = false;
    const DemoRun cold = run_demo_workload(ck, w, cfg);
    const auto t2 = std::chrono::steady_clock::now();
    cfg.store.lookup = true;
    const DemoRun warm = run_demo_workload(ck, w, cfg);
    const auto t3 = std::chrono::steady_clock::now();
    const bool match = same_outputs(base, warm) && same_outputs(base, cold);

    std::int64_t removed_keys = 0;
    if (!o.keep) {  // every key the runs may have written: all layers of every full block
      std::vector<std::string> keys;
      for (std::size_t i = 0; i < w.requests.size(); ++i)
        for (const DemoRun* r : {&cold, &warm}) {
          std::vector<std::int32_t> all = w.requests[i].prompt;
          all.insert(all.end(), r->requests[i].generated.begin(), r->requests[i].generated.end());
          for (const BlockHash& h : prefix_block_hashes(all.data(), all.size(), o.page_size))
            for (int l = 0; l < c.n_layers; ++l)
              for (store::KVKind k : {store::KVKind::kKey, store::KVKind::kValue})
                keys.push_back(store::block_key(cfg.store.ns, l, h, k, be.style));
        }
      const Status st = be.backend->remove(keys.data(), keys.size());
      if (!st.is_ok()) std::cerr << "kvkit: store-demo: deleting the demo's keys failed: " << st.message() << "\n";
      removed_keys = static_cast<std::int64_t>(keys.size());
    }

    auto ms = [](std::chrono::steady_clock::duration d) {
      return std::chrono::duration<double, std::milli>(d).count();
    };
    auto output_of = [&](const DemoRequestResult& r) {
      return tok ? tok->decode(r.generated, /*render_special=*/false) : detail::join_ids(r.generated);
    };
    if (o.json) {
      Json reqs = Json::array();
      for (std::size_t i = 0; i < w.requests.size(); ++i) {
        const DemoRequestResult& b = base.requests[i];
        const DemoRequestResult& r = warm.requests[i];
        Json j = {{"label", w.requests[i].label},
                  {"prompt_tokens", w.requests[i].prompt.size()},
                  {"matched_blocks", r.matched_blocks},
                  {"loaded_blocks", r.loaded_blocks},
                  {"cold_saved_blocks", cold.requests[i].saved_blocks},
                  {"tokens", r.generated},
                  {"baseline_tokens", b.generated},
                  {"match", r.generated == b.generated}};
        if (tok) j["text"] = output_of(r);
        if (!r.load_error.empty()) j["load_error"] = r.load_error;
        reqs.push_back(j);
      }
      const Json j = {{"command", "store-demo"},
                      {"version", KVKIT_VERSION},
                      {"model", o.model},
                      {"workload", text ? "document + 4 questions (ChatML)" : "common prefix + " + std::to_string(w.requests.size()) + " suffixes (token ids)"},
                      {"store", o.store},
                      {"namespace", cfg.store.ns},
                      {"codec", o.codec},
                      {"kv_dtype", o.kv_dtype},
                      {"page_size", o.page_size},
                      {"layers", c.n_layers},
                      {"shared_prefix_tokens", w.shared_prefix_tokens},
                      {"requests", reqs},
                      {"blocks_saved", cold.blocks_saved},
                      {"warm_blocks_saved", warm.blocks_saved},
                      {"hit_tokens", warm.hit_tokens},
                      {"prefill_tokens_avoided", warm.prefill_tokens_avoided},
                      {"load_ms", warm.load_ms},
                      {"save_ms", cold.save_ms},
                      {"baseline_ms", ms(t1 - t0)},
                      {"cold_ms", ms(t2 - t1)},
                      {"warm_ms", ms(t3 - t2)},
                      {"baseline_compute_ms", base.compute_ms},
                      {"warm_compute_ms", warm.compute_ms},
                      {"removed_keys", removed_keys},
                      {"outputs_match", match}};
      std::cout << j.dump(-1, ' ', false, Json::error_handler_t::replace) << "\n";
    } else {
      std::cout << "store-demo: " << o.model << ", store " << o.store << " (namespace " << cfg.store.ns << ", "
                << o.codec << "), " << w.requests.size() << " requests sharing " << w.shared_prefix_tokens
                << " tokens, pages of " << o.page_size << "\n";
      for (std::size_t i = 0; i < w.requests.size(); ++i) {
        const DemoRequestResult& r = warm.requests[i];
        std::cout << "\n[" << i + 1 << "] " << w.requests[i].label << " (" << w.requests[i].prompt.size()
                  << " prompt tokens, " << r.loaded_blocks << " blocks loaded"
                  << (r.load_error.empty() ? "" : ", load stopped: " + r.load_error) << ")\n"
                  << output_of(r) << "\n";
      }
      std::cout << std::fixed << std::setprecision(1) << "\nblocks saved: " << cold.blocks_saved << " (" << c.n_layers
                << " layers x K,V each) in " << cold.save_ms << " ms\n"
                << "hit tokens: " << warm.hit_tokens << ", prefill tokens avoided: " << warm.prefill_tokens_avoided
                << ", loaded in " << warm.load_ms << " ms\n"
                << "compute: " << base.compute_ms << " ms without the store, " << warm.compute_ms
                << " ms with the loaded prefix\n"
                << "outputs match the run without the store: " << (match ? "yes" : "NO") << "\n";
    }
    return match ? 0 : 1;
  } catch (const detail::StoreDemoUsage& e) {
    return fail(2, e.what());
  }
}

}  // namespace cli
}  // namespace kvkit
