#pragma once
// `kvkit probe --model M`: the ChannelSelector's importance statistics only (probe mode:
// nothing is packed, the cache stays full width). Greedy decoding of each prompt; at
// every selection update (every --T-update tokens) one JSON line per (layer, kv head):
//   {"prompt": i, "step": s, "update": u, "layer": l, "head": h, "k_top": [...],
//    "v_top": [...], "retention_k": x, "retention_v": x, "stable_updates": n,
//    "stable": bool, "k_score": [...], "v_score": [...], "v_ema": [...]}
// (k_score / v_score: the scores the top sets are chosen by under --kvchan-score; v_ema: the
// |v| EMA, equal to v_score except under centered, where v_score is Var[v_d]).
// then one {"prompt": i, "summary": true, "stable_heads": n, "heads": N, "updates": u}.
// Prompts: --prompt (repeatable; token ids for llama2.c models, text for GGUF, which is
// wrapped as a ChatML user turn), or --suite FILE (examples/prompts/suite.json: the first
// turn of each prompt whose kind is --suite-kind, default "code"), else BOS.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine/engine.hpp"
#include "engine/gguf.hpp"
#include "engine/gguf_checkpoint.hpp"
#include "engine/kvchan_policy.hpp"
#include "engine/tokenizer.hpp"

namespace kvkit {
namespace cli {

struct ProbeOptions {
  std::string model, out = "-", suite, suite_kind = "code";
  std::vector<std::string> prompts;
  std::int32_t steps = 64, t_update = 16, n_stable = 3, r_k = 0, r_v = 0, page_size = 16, threads = 1;
  std::string score = "ema";
  double ema = 0.95;
};

/// Declares the `probe` subcommand on `app`, bound to `o`.
inline CLI::App* add_probe_command(CLI::App& app, ProbeOptions& o) {
  CLI::App* p = app.add_subcommand("probe", "kvchan importance statistics (per-dimension |k|, |v| EMAs, top-r sets, "
                                            "stability) as JSONL; nothing is compressed");
  p->add_option("--model", o.model, "llama2.c checkpoint (.bin) or GGUF model")->type_name("FILE")->required();
  p->add_option("--prompt", o.prompts, "prompt: token ids (.bin) or text (GGUF, as a ChatML user turn); repeatable")
      ->type_name("TEXT");
  p->add_option("--suite", o.suite, "prompt suite JSON (examples/prompts/suite.json)")->type_name("FILE");
  p->add_option("--suite-kind", o.suite_kind, "kind of suite prompts to run (default code)")->type_name("KIND");
  p->add_option("--steps", o.steps, "decode steps per prompt after the prompt (default 64)")
      ->type_name("N")->check(CLI::Range(1, 1 << 20));
  p->add_option("--T-update", o.t_update, "tokens between selection updates (default 16)")
      ->type_name("N")->check(CLI::Range(1, 1 << 20));
  p->add_option("--N-stable", o.n_stable, "retained updates for stability (default 3)")
      ->type_name("N")->check(CLI::Range(1, 1 << 20));
  p->add_option("--rK", o.r_k, "key dims of the top sets (default head_dim/2)")->type_name("N");
  p->add_option("--rV", o.r_v, "value dims of the top sets (default head_dim/2)")->type_name("N");
  p->add_option("--kvchan-score", o.score, "importance: ema (default), think or centered (E[q^2] Var[k]; V by Var[v])")
      ->type_name("S")->check(CLI::IsMember({"ema", "think", "centered"}));
  p->add_option("--kvchan-ema", o.ema, "EMA decay of the statistics, in [0, 1) (default 0.95)")->type_name("A");
  p->add_option("--page-size", o.page_size, "engine page size (default 16)")->type_name("N")->check(CLI::Range(1, 1 << 16));
  p->add_option("--threads", o.threads, "kernel threads (default 1)")->type_name("N")->check(CLI::Range(1, 64));
  p->add_option("--out", o.out, "output JSONL file (default - : stdout)")->type_name("FILE");
  return p;
}

namespace detail {
inline std::vector<std::int32_t> parse_ids(const std::string& s) {
  std::vector<std::int32_t> v;
  std::string t = s;
  for (char& ch : t)
    if (ch == ',') ch = ' ';
  std::istringstream is(t);
  std::string w;
  while (is >> w) {
    std::size_t used = 0;
    long long x = 0;
    try {
      x = std::stoll(w, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    KVKIT_CHECK(used == w.size() && x >= 0 && x < (1LL << 31), "kvkit: probe: '", w, "' is not a token id");
    v.push_back(static_cast<std::int32_t>(x));
  }
  return v;
}
}  // namespace detail

/// Runs `kvkit probe`; returns the exit code (kvkit::Error propagates: exit 1).
inline int run_probe(const ProbeOptions& o) {
  const bool gguf = o.model.size() >= 5 && o.model.substr(o.model.size() - 5) == ".gguf";
  std::shared_ptr<const engine::Checkpoint> ck;
  std::vector<std::vector<std::int32_t>> prompts;
  std::vector<std::string> texts = o.prompts;
  if (!o.suite.empty()) {
    std::ifstream f(o.suite);
    KVKIT_CHECK(f.good(), "kvkit: probe: cannot read --suite ", o.suite);
    const nlohmann::json j = nlohmann::json::parse(f);
    for (const auto& p : j.at("prompts"))
      if (p.value("kind", "") == o.suite_kind) texts.push_back(p.at("turns").at(0).get<std::string>());
    KVKIT_CHECK(!texts.empty(), "kvkit: probe: no prompt of kind ", o.suite_kind, " in ", o.suite);
  }
  if (gguf) {
    const engine::GgufFile g = engine::GgufFile::open(o.model);
    ck = std::make_shared<const engine::Checkpoint>(engine::load_gguf_checkpoint(g, /*float_projections=*/false));
    const engine::Tokenizer tok = engine::Tokenizer::from_gguf(g);
    engine::ChatTemplate tmpl;
    if (g.has("tokenizer.chat_template")) tmpl = engine::ChatTemplate::from_gguf(g);
    KVKIT_CHECK(!texts.empty(), "kvkit: probe with a GGUF model needs --prompt TEXT or --suite FILE");
    for (const std::string& t : texts) prompts.push_back(tmpl.encode(tok, {{"user", t}}, true));
  } else {
    ck = std::make_shared<const engine::Checkpoint>(engine::load_checkpoint(o.model));
    for (const std::string& t : texts) prompts.push_back(detail::parse_ids(t));
    if (prompts.empty()) prompts.push_back({engine::kBosToken});
  }
  const engine::ModelConfig& c = ck->config();
  std::ofstream file;
  if (o.out != "-") {
    file.open(o.out);
    KVKIT_CHECK(file.good(), "kvkit: probe: cannot write --out ", o.out);
  }
  std::ostream& out = o.out == "-" ? std::cout : file;
  for (std::size_t pi = 0; pi < prompts.size(); ++pi) {
    const std::vector<std::int32_t>& prompt = prompts[pi];
    KVKIT_CHECK(!prompt.empty(), "kvkit: probe: prompt ", pi, " has no tokens");
    KVKIT_CHECK(static_cast<std::int64_t>(prompt.size()) + o.steps <= c.seq_len, "kvkit: probe: prompt ", pi,
                " (", prompt.size(), " tokens) + --steps ", o.steps, " exceed the model's seq_len ", c.seq_len);
    engine::EngineOptions eo;
    eo.page_size = o.page_size;
    eo.max_batch = 1;
    eo.threads = o.threads;
    eo.num_pages = static_cast<std::int32_t>((prompt.size() + static_cast<std::size_t>(o.steps)) / o.page_size + 2);
    engine::Engine eng(ck, eo);
    engine::KvchanOptions ko;
    ko.params.mode = channel::ChannelMode::kProbe;
    ko.params.t_update = o.t_update;
    ko.params.n_stable = o.n_stable;
    ko.params.r_k = o.r_k != 0 ? o.r_k : std::max(1, c.head_dim() / 2);
    ko.params.r_v = o.r_v != 0 ? o.r_v : std::max(1, c.head_dim() / 2);
    ko.params.score = o.score == "think"      ? channel::ChannelScore::kThink
                      : o.score == "centered" ? channel::ChannelScore::kCentered
                                              : channel::ChannelScore::kEma;
    ko.params.check_every = 0;
    ko.params.ema_decay = static_cast<float>(o.ema);
    engine::KvchanPolicy pol(ko);
    pol.attach(eng);
    std::int64_t seen = 0;
    eng.add_step_hook([&](engine::Engine&, const engine::StepInfo& info) {
      const channel::ChannelSelector& s = pol.selector();
      if (s.updates() == seen) return;
      seen = s.updates();
      for (std::int32_t l = 0; l < c.n_layers; ++l)
        for (std::int32_t h = 0; h < c.n_kv_heads; ++h) {
          nlohmann::json j;
          j["prompt"] = pi;
          j["step"] = info.step;
          j["update"] = seen;
          j["layer"] = l;
          j["head"] = h;
          j["k_top"] = std::vector<std::int32_t>(s.current_k(l) + h * s.r_k(), s.current_k(l) + (h + 1) * s.r_k());
          j["v_top"] = std::vector<std::int32_t>(s.current_v(l) + h * s.r_v(), s.current_v(l) + (h + 1) * s.r_v());
          j["retention_k"] = s.last_retention_k(l, h);
          j["retention_v"] = s.last_retention_v(l, h);
          j["stable_updates"] = s.counter(l, h);
          j["stable"] = s.head_stable(l, h);
          std::vector<float> ks(static_cast<std::size_t>(c.head_dim()));
          for (std::int32_t d = 0; d < c.head_dim(); ++d) ks[static_cast<std::size_t>(d)] = s.key_score(l, h, d);
          j["k_score"] = ks;
          for (std::int32_t d = 0; d < c.head_dim(); ++d) ks[static_cast<std::size_t>(d)] = s.value_score(l, h, d);
          j["v_score"] = ks;
          j["v_ema"] = std::vector<float>(s.ema_v(l, h), s.ema_v(l, h) + c.head_dim());
          out << j.dump() << "\n";
        }
    });
    const engine::SeqId id = eng.add_sequence(prompt);
    eng.prefill(id);
    for (std::int32_t s = 0; s < o.steps; ++s) eng.step();
    nlohmann::json sum;
    sum["prompt"] = pi;
    sum["summary"] = true;
    sum["tokens"] = eng.position(id);
    sum["updates"] = pol.selector().updates();
    sum["stable_heads"] = pol.selector().stable_heads();
    sum["heads"] = c.n_layers * c.n_kv_heads;
    out << sum.dump() << "\n";
  }
  out.flush();
  return 0;
}

}  // namespace cli
}  // namespace kvkit
