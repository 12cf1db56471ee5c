#pragma once
// `kvkit generate --policy kvchan`: the ChannelSelector (examples/engine/kvchan_policy.hpp)
// with its options on the generate subcommand:
//   --W N            full-width window (default 128)
//   --rK N           key dims kept per head (default head_dim / 2)
//   --rV N           value dims kept per head (default head_dim: values not compressed)
//   --check-every N  steps between fidelity checks while packed (default 16; 0: never)
//   --T-update N     tokens between selection updates (default 16)
//   --N-stable N     retained updates before packing (default 3)
//   --no-k           keys stay full width (only values are compressed)
//   --kvchan-mode M  dynamic (default), full or probe
//   --kvchan-score S ema (default), think or centered (E[q_d^2] Var[k_d]; V by Var[v_d])
//   --kvchan-compensate   dropped V dims read as their mean over the packed tokens
//   --kvchan-k-compensate dropped K dims read as their mean over the packed tokens (lse bias)
//   --kvchan-residual-bits B  4 or 8: dropped dims kept as B-bit codes, one scale a row (0: dropped)
//   --kvchan-max-kl X     fidelity KL threshold in nats (default 0.01)
//   --kvchan-min-overlap X  top-k overlap a check must reach (default 0.8)
//   --kvchan-max-margin-drift X  margin drift a check allows, logit units (default 0.5)
//   --kvchan-top-k N      tokens the overlap compares (default 5)
//   --kvchan-ema A        EMA decay of the statistics (default 0.95)
//   --kvchan-retention X  retention of a stable update (default 0.9)
//   --kvchan-stable-frac X  fraction of stable heads that starts packing (default 1)
//   --jsonl FILE     one JSON record per fidelity check

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include "cli/policies.hpp"
#include "engine/kvchan_policy.hpp"

namespace kvkit {
namespace cli {

inline PolicyEntry kvchan_policy_entry() {
  struct Opts {
    std::int32_t window = 128, r_k = 0, r_v = 0, check_every = 16, t_update = 16, n_stable = 3, residual_bits = 0;
    bool no_k = false, compensate = false, k_compensate = false;
    std::string mode = "dynamic", score = "ema", jsonl;
    double max_kl = 1e-2, ema = 0.95, retention = 0.9, stable_frac = 1.0;
    channel::FidelityThresholds guard;  // overlap / margin-drift limits and top_k of the checks
  };
  auto o = std::make_shared<Opts>();
  PolicyEntry e;
  e.names = {"kvchan"};
  e.option_names = {"--W",         "--rK",          "--rV",           "--check-every",
                    "--T-update",  "--N-stable",    "--no-k",         "--kvchan-mode",
                    "--kvchan-score", "--kvchan-compensate", "--kvchan-k-compensate", "--kvchan-residual-bits", "--kvchan-max-kl",
                    "--kvchan-min-overlap", "--kvchan-max-margin-drift", "--kvchan-top-k", "--kvchan-ema",
                    "--kvchan-retention", "--kvchan-stable-frac", "--jsonl"};
  e.add_options = [o](CLI::App& g) {
    g.add_option("--W", o->window, "kvchan: full-width window of recent tokens (default 128)")->type_name("N");
    g.add_option("--rK", o->r_k, "kvchan: key dims kept per head (default head_dim/2)")->type_name("N");
    g.add_option("--rV", o->r_v, "kvchan: value dims kept per head (default head_dim)")->type_name("N");
    g.add_option("--check-every", o->check_every,
                 "kvchan: steps between fidelity checks while packed (default 16, 0 never)")
        ->type_name("N");
    g.add_option("--T-update", o->t_update, "kvchan: tokens between selection updates (default 16)")->type_name("N");
    g.add_option("--N-stable", o->n_stable, "kvchan: retained updates (>= 0.9) before packing (default 3)")
        ->type_name("N");
    g.add_flag("--no-k", o->no_k, "kvchan: keep keys full width (compress values only)");
    g.add_option("--kvchan-mode", o->mode, "kvchan: dynamic (default), full or probe")
        ->type_name("M")
        ->check(CLI::IsMember({"dynamic", "full", "probe"}));
    g.add_option("--kvchan-score", o->score,
                 "kvchan: key importance, ema (default), think or centered (E[q^2] Var[k]; V by Var[v])")
        ->type_name("S")
        ->check(CLI::IsMember({"ema", "think", "centered"}));
    g.add_flag("--kvchan-compensate", o->compensate, "kvchan: dropped V dims read as their mean (compensation)");
    g.add_flag("--kvchan-k-compensate", o->k_compensate,
               "kvchan: dropped K dims read as their mean over the packed tokens (a log-sum-exp bias)");
    g.add_option("--kvchan-residual-bits", o->residual_bits,
                 "kvchan: keep the dropped dims as 4- or 8-bit codes with one scale per row (default 0: dropped)")
        ->type_name("B");
    g.add_option("--kvchan-max-kl", o->max_kl, "kvchan: fidelity check KL threshold in nats (default 0.01)")
        ->type_name("X");
    g.add_option("--kvchan-min-overlap", o->guard.min_overlap,
                 "kvchan: fidelity check top-k overlap it must reach, in [0, 1] (default 0.8)")
        ->type_name("X");
    g.add_option("--kvchan-max-margin-drift", o->guard.max_margin_drift,
                 "kvchan: fidelity check margin drift allowed, logit units (default 0.5)")
        ->type_name("X");
    g.add_option("--kvchan-top-k", o->guard.top_k, "kvchan: tokens the overlap compares (default 5)")
        ->type_name("N");
    g.add_option("--kvchan-ema", o->ema, "kvchan: EMA decay of the |k|, |v| statistics, in [0, 1) (default 0.95)")
        ->type_name("A");
    g.add_option("--kvchan-retention", o->retention,
                 "kvchan: retention a stable update needs, in (0, 1] (default 0.9)")
        ->type_name("X");
    g.add_option("--kvchan-stable-frac", o->stable_frac,
                 "kvchan: fraction of heads that must be stable before packing, in (0, 1] (default 1)")
        ->type_name("X");
    g.add_option("--jsonl", o->jsonl, "kvchan: write one JSON record per fidelity check to FILE")->type_name("FILE");
  };
  e.make = [o](const std::string&, const engine::ModelConfig& c, const engine::EngineOptions& eo) {
    KVKIT_CHECK(!eo.contiguous, "kvchan needs a paged engine, not --contiguous");
    engine::KvchanOptions ko;
    channel::ChannelParams& p = ko.params;
    p.window = o->window;
    p.r_k = o->r_k != 0 ? o->r_k : std::max(1, c.head_dim() / 2);
    p.r_v = o->r_v;
    p.check_every = o->check_every;
    p.t_update = o->t_update;
    p.n_stable = o->n_stable;
    p.compress_k = !o->no_k;
    p.mean_compensation = o->compensate;
    p.k_compensation = o->k_compensate;
    p.residual_bits = o->residual_bits;
    p.mode = o->mode == "full" ? channel::ChannelMode::kFull
             : o->mode == "probe" ? channel::ChannelMode::kProbe
                                  : channel::ChannelMode::kDynamic;
    p.score = o->score == "think"      ? channel::ChannelScore::kThink
              : o->score == "centered" ? channel::ChannelScore::kCentered
                                       : channel::ChannelScore::kEma;
    p.thresholds = o->guard;
    p.thresholds.max_kl = o->max_kl;
    p.ema_decay = static_cast<float>(o->ema);
    p.min_retention = o->retention;
    p.min_stable_fraction = o->stable_frac;
    KVKIT_CHECK(!(o->no_k && o->k_compensate), "kvchan: --kvchan-k-compensate needs compressed keys, not --no-k");
    KVKIT_CHECK(o->r_v >= 0, "kvchan: rV must be in [1, head_dim ", c.head_dim(), "], got ", o->r_v);
    p.validate(c.head_dim());  // bad values are usage errors (exit 2) before the run
    ko.jsonl_path = o->jsonl;
    return std::unique_ptr<engine::EnginePolicy>(new engine::KvchanPolicy(ko));
  };
  return e;
}

}  // namespace cli
}  // namespace kvkit
