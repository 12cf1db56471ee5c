#pragma once
// `kvkit generate --policy eps`: the Sketcher (kvkit/sketch/eps.hpp) hosted by the
// example engine (engine/eps_policy.hpp): page-group summaries and a pre-pass that picks
// the pages decode attention reads.
//
//   --strict             certified bounds only (box, norm; FD with --method fd, the
//                        rotated box with --method rbox, per-token codes with --method codes)
//   --eps E              omitted softmax mass budget in (0, 1) (default 1e-3)
//   --method M           box | jl | 1pc | fd | rbox | codes (default box)
//   --code-bits b        bits per key channel of --method codes: 4 or 8 (default 4)
//   --group-pages g      pages per summarised group (default 1)
//   --last-n n           newest groups always read (default 1)
//   --top-pages N        cap on pages read beyond the last groups (default 0: none)
//   --score-budget N     groups scored exactly per (sequence, query head) before the rest
//                        up to the cap is read unscored (default 0: no limit)
//   --score-fraction F   ... and at most ceil(F x candidates) of them (default 0.25; 1: no
//                        limit, the plain eps rule)
//   --jl-dim m, --fd-rows l, --alpha A   sketch sizes and the default-mode safety factor
//   --summaries all|method  every summary of the seed (default) or only what --method
//                        reads (SketchParams::all_summaries; the same pages, fewer bytes)
// Stats: pages_total / pages_visited (summed over layers, kv heads and steps),
// bytes_kv_read_est, prepass_ms, certified_omitted_max, summary_bytes.

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include "cli/policies.hpp"
#include "engine/eps_policy.hpp"

namespace kvkit {
namespace cli {

/// The eps --policy value.
inline PolicyEntry eps_policy_entry() {
  struct Opts {
    bool strict = false;
    double eps = 1e-3, alpha = 1.1;
    std::string method = "box";
    std::string summaries = "all";
    std::int32_t group_pages = 1, last_n = 1, top_pages = 0, jl_dim = 8, fd_rows = 8, score_budget = 0, code_bits = 4;
    double score_fraction = sketch::SketchParams{}.score_fraction;
  };
  auto o = std::make_shared<Opts>();
  PolicyEntry e;
  e.names = {"eps"};
  e.option_names = {"--strict", "--eps", "--method", "--group-pages", "--last-n",
                    "--top-pages", "--jl-dim", "--fd-rows", "--alpha", "--score-budget", "--score-fraction", "--summaries", "--code-bits"};
  e.add_options = [o](CLI::App& g) {
    g.add_flag("--strict", o->strict, "eps: certified bounds only (omitted softmax mass <= --eps, guaranteed)");
    g.add_option("--eps", o->eps, "eps: omitted softmax mass budget in (0, 1) (default 1e-3)");
    g.add_option("--method", o->method,
                 "eps: summary that bounds the groups: box | jl | 1pc | fd | rbox | codes (default box)");
    g.add_option("--code-bits", o->code_bits, "eps: bits per key channel of --method codes, 4 or 8 (default 4)");
    g.add_option("--group-pages", o->group_pages, "eps: pages per summarised group (default 1)");
    g.add_option("--last-n", o->last_n, "eps: newest groups always read (default 1)");
    g.add_option("--top-pages", o->top_pages, "eps: cap on pages read beyond the newest groups (default 0: none)");
    g.add_option("--jl-dim", o->jl_dim, "eps: JL sketch dimension m (default 8)");
    g.add_option("--fd-rows", o->fd_rows, "eps: Frequent Directions rows l (default 8)");
    g.add_option("--alpha", o->alpha, "eps: safety factor on jl/1pc estimates without --strict (default 1.1)");
    g.add_option("--summaries", o->summaries,
                 "eps: all (box, JL, FD, 1-PC, as the seed) or method (only what --method reads: less memory, "
                 "same pages) (default all)")
        ->check(CLI::IsMember({"all", "method"}));
    g.add_option("--score-budget", o->score_budget,
                 "eps: groups scored exactly per (sequence, query head); past it pages are read unscored (default 0: no limit)");
    g.add_option("--score-fraction", o->score_fraction,
                 "eps: at most this fraction of the candidate groups is scored; where the eps rule needs more, pages "
                 "are read unscored (default 0.25; 1: no limit)");
  };
  e.make = [o](const std::string& name, const engine::ModelConfig&,
               const engine::EngineOptions&) -> std::unique_ptr<engine::EnginePolicy> {
    sketch::SketchParams p;
    p.strict = o->strict;
    p.eps = o->eps;
    p.alpha = o->alpha;
    p.method = sketch::parse_method(o->method);
    p.group_pages = o->group_pages;
    p.last_n = o->last_n;
    p.top_pages = o->top_pages;
    p.jl_dim = o->jl_dim;
    p.fd_rows = o->fd_rows;
    p.score_budget = o->score_budget;
    p.score_fraction = o->score_fraction;
    p.all_summaries = o->summaries == "all";
    p.code_bits = o->code_bits;
    return std::make_unique<engine::EpsPolicy>(p, name);
  };
  return e;
}

}  // namespace cli
}  // namespace kvkit
