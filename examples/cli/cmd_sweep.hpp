#pragma once
// `kvkit sweep`: many `generate --policy P --budget B --compare-full` runs of one prompt
// for the price of one full-cache run. The full-cache run is the same for every policy and
// budget, so it runs once and its per-step next tokens and logits are recorded; each
// policy engine is then teacher-forced with those tokens and compared with those logits
// (engine/fidelity.hpp), one engine at a time. With a GGUF model the prompt's batched
// prefill is also done once: the policy engines start from a copy of the full engine's
// prompt K/V (the policy hooks never see prefilled tokens, so this is what their own
// prefill would give, bit for bit). --free-run adds each policy's own greedy answer (no
// teacher forcing), as `generate --policy P` without --compare-full prints it.
//
//   kvkit sweep [--model M] [--prompt IDS|TEXT | --prompt-file F] [--chat] [--system S]
//               [--steps N | --max-tokens N] [--stop-at-eos] --policies r1kv,snapkv,streaming
//               --budgets 256,512 [--buffer U] [--window W] [--kernel K] [--lambda L]
//               [--sinks N] [--free-run] [--free-max-tokens N] [--threads T] [--page-size P]
//
// Each run's numbers equal the separate `generate` run's (tests/test_cli_sweep.cpp); a run
// whose cache never reaches budget + buffer is the full cache exactly and is reported as
// skipped. One JSON object on stdout; exit codes as the rest of the CLI (2: usage error).

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine/engine.hpp"
#include "engine/fidelity.hpp"
#include "engine/gguf.hpp"
#include "engine/gguf_checkpoint.hpp"
#include "engine/r1kv_policy.hpp"
#include "cli/parse_subcommand.hpp"
#include "engine/tokenizer.hpp"
#include "kvkit/version.hpp"

namespace kvkit {
namespace cli {

struct SweepOptions {
  std::string model, prompt, prompt_file, system;
  bool chat = false, stop_at_eos = false, free_run = false;
  std::int32_t steps = 64, max_tokens = 128, free_max_tokens = 0;  // 0: max_tokens
  std::vector<std::string> policies;
  std::vector<std::int32_t> budgets;
  std::int32_t buffer = 128, window = 8, kernel = 7, sinks = 4, threads = 1, page_size = 16;
  float lambda = 0.07f;
  std::string matvec = "quantized";  // GGUF projections: quantized or float (see generate --matvec)
};

namespace detail {

struct SweepModel {
  std::shared_ptr<const engine::Checkpoint> ckpt;
  std::shared_ptr<const engine::Tokenizer> tok;  // GGUF only
  std::vector<std::int32_t> prompt;
  std::string name;
};

inline bool sweep_is_gguf(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::string(magic, 4) == "GGUF";
}

inline std::string sweep_read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KVKIT_CHECK(static_cast<bool>(in), "kvkit: cannot read prompt file '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The model and the prompt's tokens, as `kvkit generate` makes them.
inline SweepModel sweep_load(const SweepOptions& o) {
  SweepModel m;
  std::string text = o.prompt_file.empty() ? o.prompt : sweep_read_file(o.prompt_file);
  if (!o.model.empty() && sweep_is_gguf(o.model)) {
    const engine::GgufFile g = engine::GgufFile::open(o.model);
    m.ckpt = std::make_shared<const engine::Checkpoint>(engine::load_gguf_checkpoint(g, o.matvec == "float"));
    m.tok = std::make_shared<const engine::Tokenizer>(engine::Tokenizer::from_gguf(g));
    m.name = o.model;
    if (o.chat) {
      const engine::ChatTemplate tmpl =
          g.has("tokenizer.chat_template") ? engine::ChatTemplate::from_gguf(g) : engine::ChatTemplate();
      std::vector<engine::ChatMessage> msgs;
      if (!o.system.empty()) msgs.push_back({"system", o.system});
      msgs.push_back({"user", text});
      m.prompt = tmpl.encode(*m.tok, msgs, /*add_generation_prompt=*/true);
    } else {
      m.prompt = m.tok->encode(text, /*add_special=*/true, /*parse_special=*/true);
    }
  } else {
    KVKIT_CHECK(!o.chat && o.system.empty(), "kvkit: sweep: --chat and --system need a GGUF model");
    m.ckpt = std::make_shared<const engine::Checkpoint>(
        o.model.empty() ? engine::default_synthetic_checkpoint() : engine::load_checkpoint(o.model));
    m.name = o.model.empty() ? "synthetic" : o.model;
    if (!o.prompt_file.empty()) text = text.substr(0, text.find('\n'));  // the first line
    std::istringstream in(text.empty() ? "1" : text);
    std::string w;
    while (in >> w) m.prompt.push_back(static_cast<std::int32_t>(std::stol(w)));
  }
  const engine::ModelConfig& c = m.ckpt->config();
  KVKIT_CHECK(!m.prompt.empty() && static_cast<std::int64_t>(m.prompt.size()) <= c.seq_len,
              "kvkit: sweep: the prompt has ", m.prompt.size(), " tokens (1 to seq_len ", c.seq_len, ")");
  for (std::int32_t t : m.prompt)
    KVKIT_CHECK(t >= 0 && t < c.vocab_size, "kvkit: sweep: token ", t, " outside the vocabulary");
  return m;
}

// The full-cache run: per step, the token forced next and the logits to compare with.
struct FullRecord {
  std::vector<std::int32_t> forced;    // [steps]
  std::vector<char> compared;          // [steps]
  std::vector<float> logits;           // [compared steps, vocab]
  std::vector<std::int32_t> generated; // GGUF: the answer (stop token excluded)
  std::string stop;
  std::int32_t prefilled = 0;          // GGUF: prompt tokens prefilled in a batch
  std::int32_t max_kv_len = 0;         // the longest cache the run held
};

inline std::unique_ptr<engine::EnginePolicy> sweep_policy(const SweepOptions& o, const std::string& name,
                                                          std::int32_t budget) {
  engine::CompressorPolicyOptions po;
  po.params.budget = budget;
  po.params.buffer = o.buffer;
  po.params.window = o.window;
  po.params.kernel = o.kernel;
  po.params.lambda = o.lambda;
  po.params.sinks = o.sinks;
  if (name == "r1kv") return std::make_unique<engine::R1KVPolicy>(po);
  if (name == "snapkv") return std::make_unique<engine::SnapKVPolicy>(po);
  if (name == "streaming") return std::make_unique<engine::StreamingLLMPolicy>(po);
  fail("kvkit: sweep: unknown policy '", name, "' (r1kv, snapkv, streaming)");
}

// A sequence of `prompt` in `eng` that starts where `full`'s sequence `fid` was after its
// prefill: the first `prefilled` tokens' K/V copied page by page (all layers, K and V).
inline engine::SeqId sweep_add(engine::Engine& eng, engine::Engine& full, engine::SeqId fid,
                               const std::vector<std::int32_t>& prompt, std::int32_t prefilled) {
  if (prefilled == 0) return eng.add_sequence(prompt);
  const std::int32_t ps = eng.options().page_size;
  const std::int32_t n = (prefilled + ps - 1) / ps;
  const std::vector<std::int32_t>& src = full.pages(fid);
  const std::size_t page = static_cast<std::size_t>(eng.strides().page);
  std::vector<std::int32_t> pages;
  for (std::int32_t i = 0; i < n; ++i) {
    const std::int32_t p = eng.allocator().allocate();
    pages.push_back(p);
    const std::size_t s = static_cast<std::size_t>(src.at(static_cast<std::size_t>(i))) * page;
    for (int l = 0; l < eng.config().n_layers; ++l) {
      std::memcpy(eng.k_pool(l) + static_cast<std::size_t>(p) * page, full.k_pool(l) + s, page * sizeof(float));
      std::memcpy(eng.v_pool(l) + static_cast<std::size_t>(p) * page, full.v_pool(l) + s, page * sizeof(float));
    }
  }
  return eng.add_sequence(prompt, pages, prefilled, prefilled);
}

// Greedy decoding of `id` as `generate` does it (GGUF: until the answer has max_tokens
// tokens or, with stop_at_eos, an end-of-turn token; else `steps` steps), calling
// on_step after each step. Returns the answer and why it stopped.
template <class OnStep>
std::vector<std::int32_t> sweep_decode(engine::Engine& eng, engine::SeqId id, const SweepModel& m,
                                       const SweepOptions& o, std::int32_t max_tokens, std::string* stop,
                                       OnStep on_step) {
  std::vector<std::int32_t> out;
  const std::int32_t seq_len = eng.config().seq_len;
  if (!m.tok) {
    for (std::int32_t s = 0; s < o.steps; ++s) on_step(s);
    *stop = "steps";
    return out;
  }
  const std::size_t prompt_end = m.prompt.size();
  std::int32_t s = 0;
  while (eng.tokens(id).size() == prompt_end) {
    if (eng.position(id) >= seq_len) return *stop = "seq_len", out;
    on_step(s++);
  }
  for (;;) {
    const std::int32_t next = eng.tokens(id).back();
    if (o.stop_at_eos && m.tok->is_end_of_generation(next)) return *stop = "eos", out;
    out.push_back(next);
    if (static_cast<std::int32_t>(out.size()) >= max_tokens) return *stop = "max_tokens", out;
    if (eng.position(id) >= seq_len) return *stop = "seq_len", out;
    on_step(s++);
  }
}

inline engine::EngineOptions sweep_engine_options(const SweepOptions& o, const SweepModel& m) {
  const engine::ModelConfig& c = m.ckpt->config();
  engine::EngineOptions e;
  e.page_size = o.page_size;
  e.max_batch = 1;
  e.threads = o.threads;
  e.quantized_matvec = o.matvec != "float";
  if (m.tok) {  // the pool holds the run's positions, as generate sizes it
    const std::int64_t pos = std::min<std::int64_t>(c.seq_len, static_cast<std::int64_t>(m.prompt.size()) +
                                                                   std::max(o.max_tokens, o.free_max_tokens) - 1);
    e.num_pages = static_cast<std::int32_t>((pos + o.page_size - 1) / o.page_size);
  } else {
    KVKIT_CHECK(o.steps <= c.seq_len, "kvkit: sweep: --steps ", o.steps, " exceeds the model's seq_len ", c.seq_len);
  }
  return e;
}

// A policy's counters as JSON numbers (integers where integral, as generate writes them).
inline void sweep_stats(nlohmann::json& j, const engine::PolicyStats& stats) {
  for (const auto& kv : stats) {
    const double v = kv.second;
    if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9e15) j[kv.first] = static_cast<std::int64_t>(v);
    else j[kv.first] = v;
  }
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

inline nlohmann::json sweep_run(const SweepOptions& o) {
  using Json = nlohmann::json;
  const SweepModel m = sweep_load(o);
  const engine::ModelConfig& c = m.ckpt->config();
  const engine::EngineOptions eo = sweep_engine_options(o, m);
  for (const std::string& p : o.policies)
    for (std::int32_t b : o.budgets) (void)sweep_policy(o, p, b);  // bad values fail before any run
  const std::int32_t vocab = c.vocab_size;
  const std::int32_t free_max = o.free_max_tokens > 0 ? o.free_max_tokens : o.max_tokens;

  // The full cache, once.
  auto t0 = std::chrono::steady_clock::now();
  engine::Engine full(m.ckpt, eo);
  const engine::SeqId fid = full.add_sequence(m.prompt);
  FullRecord rec;
  if (m.tok) rec.prefilled = full.prefill(fid);
  rec.generated = sweep_decode(full, fid, m, o, o.max_tokens, &rec.stop, [&](std::int32_t) {
    full.step();
    rec.forced.push_back(full.pending_token(fid));
    const bool cmp = static_cast<std::size_t>(full.position(fid)) >= m.prompt.size();
    rec.compared.push_back(cmp);
    if (cmp) rec.logits.insert(rec.logits.end(), full.last_logits(fid).begin(), full.last_logits(fid).end());
    rec.max_kv_len = std::max(rec.max_kv_len, full.kv_len(fid));
  });
  Json j = {{"command", "sweep"},
            {"version", KVKIT_VERSION},
            {"model", m.name},
            {"threads", o.threads},
            {"matvec", o.matvec},
            {"page_size", eo.page_size},
            {"buffer", o.buffer},
            {"prompt_tokens", m.prompt},
            {"full",
             {{"tokens", m.tok ? rec.generated : full.tokens(fid)},
              {"stop", rec.stop},
              {"steps", rec.forced.size()},
              {"kv_bytes_final", full.kv_bytes_in_use()},
              {"seconds", seconds_since(t0)}}}};
  if (m.tok) j["full"]["text"] = m.tok->decode(rec.generated, /*render_special=*/false);

  Json runs = Json::array();
  for (const std::string& name : o.policies)
    for (std::int32_t budget : o.budgets) {
      Json r = {{"policy", name}, {"budget", budget}, {"buffer", o.buffer}};
      if (static_cast<std::int64_t>(rec.max_kv_len) < static_cast<std::int64_t>(budget) + o.buffer &&
          free_max <= o.max_tokens) {
        r["skipped"] = "the cache never reaches budget + buffer (" + std::to_string(rec.max_kv_len) + " < " +
                       std::to_string(budget + o.buffer) + "): the run is the full cache";
        runs.push_back(r);
        continue;
      }
      // Teacher-forced against the recorded full run.
      t0 = std::chrono::steady_clock::now();
      auto policy = sweep_policy(o, name, budget);
      engine::Engine eng(m.ckpt, eo);
      policy->attach(eng);
      const engine::SeqId id = sweep_add(eng, full, fid, m.prompt, rec.prefilled);
      engine::FidelityMeter meter;
      std::size_t k = 0;
      for (std::size_t s = 0; s < rec.forced.size(); ++s) {
        eng.forward_tokens({rec.forced[s]});
        if (rec.compared[s]) meter.add(rec.logits.data() + (k++) * vocab, eng.last_logits(id).data(), vocab);
      }
      sweep_stats(r, policy->stats());
      r["top1_agreement"] = meter.top1_agreement();
      r["mean_kl"] = meter.mean_kl();
      r["median_kl"] = meter.median_kl();
      r["max_kl"] = meter.max_kl();
      r["compare_steps"] = meter.steps();
      r["kv_bytes_final"] = eng.kv_bytes_in_use();
      r["full_kv_bytes_final"] = full.kv_bytes_in_use();
      r["tokens"] = eng.tokens(id);
      r["seconds"] = seconds_since(t0);
      if (o.free_run) {  // its own greedy answer
        t0 = std::chrono::steady_clock::now();
        auto fp = sweep_policy(o, name, budget);
        engine::Engine fe(m.ckpt, eo);
        fp->attach(fe);
        const engine::SeqId fsid = sweep_add(fe, full, fid, m.prompt, rec.prefilled);
        std::string stop;
        const std::vector<std::int32_t> ans =
            sweep_decode(fe, fsid, m, o, free_max, &stop, [&](std::int32_t) { fe.step(); });
        Json f = {{"tokens", m.tok ? ans : fe.tokens(fsid)}, {"stop", stop}, {"seconds", seconds_since(t0)}};
        sweep_stats(f, fp->stats());
        if (m.tok) f["text"] = m.tok->decode(ans, /*render_special=*/false);
        r["free"] = f;
      }
      runs.push_back(r);
    }
  j["runs"] = runs;
  return j;
}

inline std::vector<std::string> sweep_split(const std::string& s) {
  std::vector<std::string> out;
  std::string w;
  std::istringstream in(s);
  while (std::getline(in, w, ','))
    if (!w.empty()) out.push_back(w);
  return out;
}

}  // namespace detail

/// `kvkit sweep ...` (argv[0] is "sweep"): prints one JSON object; 0 ok, 1 a library or
/// I/O error, 2 a usage error ({"error": ..., "code": N} on stdout too).
inline int run_sweep(int argc, char** argv) {
  SweepOptions o;
  std::string policies = "r1kv,snapkv,streaming", budgets;
  CLI::App app("kvkit sweep: one full-cache run, every policy x budget teacher-forced from it", "kvkit sweep");
  app.add_option("--model", o.model, "GGUF model or llama2.c checkpoint (default: the synthetic model)");
  app.add_option("--prompt", o.prompt, "GGUF: text; else token ids \"1 2 3\" (default: BOS)");
  app.add_option("--prompt-file", o.prompt_file, "GGUF: the whole file is the prompt; else its first line")
      ->excludes("--prompt");
  app.add_flag("--chat", o.chat, "GGUF: wrap the prompt in the ChatML template");
  app.add_option("--system", o.system, "GGUF with --chat: system message");
  app.add_option("--steps", o.steps, "token-id models: positions per run, prompt included (default 64)")
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--max-tokens", o.max_tokens, "GGUF: answer tokens at most (default 128)")
      ->check(CLI::Range(1, 1 << 30));
  app.add_flag("--stop-at-eos", o.stop_at_eos, "GGUF: the answer ends at the end-of-turn token");
  app.add_option("--policies", policies, "comma-separated: r1kv, snapkv, streaming (default all three)");
  app.add_option("--budgets", budgets, "comma-separated budgets")->required();
  app.add_option("--buffer", o.buffer, "compress when the cache reaches budget + buffer (default 128)");
  app.add_option("--window", o.window, "query window and recent slots kept (default 8)");
  app.add_option("--kernel", o.kernel, "max-pool width, odd (default 7)");
  app.add_option("--lambda", o.lambda, "R1KV importance weight (default 0.07)");
  app.add_option("--sinks", o.sinks, "StreamingLLM sink tokens (default 4)");
  app.add_flag("--free-run", o.free_run, "also each policy's own greedy answer (no teacher forcing)");
  app.add_option("--free-max-tokens", o.free_max_tokens, "GGUF: answer tokens of --free-run (default --max-tokens)")
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--threads", o.threads, "engine threads (default 1)")->check(CLI::Range(1, 64));
  app.add_option("--page-size", o.page_size, "tokens per KV page (default 16)")->check(CLI::Range(1, 1 << 20));
  app.add_option("--matvec", o.matvec,
                 "GGUF projections: quantized (int8 activations, default) or float (no activation rounding: "
                 "the KL then measures only the policy)")
      ->check(CLI::IsMember({"quantized", "float"}));
  bool json = true;  // --json is accepted for symmetry with generate: the output is always JSON
  app.add_flag("--json", json, "the output is always one JSON object");
  auto error = [](int code, const std::string& msg) {
    std::cerr << "kvkit: " << (code == 2 ? "error: " : "") << "sweep: " << msg << "\n";
    std::cout << nlohmann::json{{"error", msg}, {"code", code}}.dump() << "\n";
    return code;
  };
  if (const int rc = parse_subcommand(app, argc, argv, error); rc != kParsed) return rc;
  try {
    o.policies = detail::sweep_split(policies);
    for (const std::string& b : detail::sweep_split(budgets)) o.budgets.push_back(std::stoi(b));
    if (o.policies.empty() || o.budgets.empty()) return error(2, "--policies and --budgets need values");
  } catch (const std::exception&) {
    return error(2, "--budgets '" + budgets + "' is not a list of integers");
  }
  try {
    std::cout << detail::sweep_run(o).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    return 0;
  } catch (const Error& e) {
    return error(2, e.what());
  } catch (const std::exception& e) {
    return error(1, e.what());
  }
}

}  // namespace cli
}  // namespace kvkit
