#pragma once
// The policies `kvkit generate --policy NAME` can host. Each policy family lives in its
// own header (examples/cli/policy_<family>.hpp) that returns one PolicyEntry; add it to
// all_policies() below. The entry declares its options on the `generate` subcommand
// (bound to storage the entry owns) and builds an EnginePolicy for a model.

#include <CLI/CLI.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.hpp"
#include "engine/policy.hpp"

namespace kvkit {
namespace cli {

/// One family of --policy values and its options.
struct PolicyEntry {
  std::vector<std::string> names;  // --policy values served, e.g. {"r1kv", "snapkv", "streaming"}
  /// Declares the family's options on `generate`. Option names must not clash with other
  /// families' (the CLI checks at start-up) or with generate's own.
  std::function<void(CLI::App& generate)> add_options;
  /// Builds the policy `name` for a model and engine options; throws kvkit::Error naming a
  /// bad value (exit 2). Options of this family given without one of its names are an
  /// error the CLI reports (`--budget needs --policy r1kv|snapkv|streaming`).
  std::function<std::unique_ptr<engine::EnginePolicy>(const std::string& name, const engine::ModelConfig& c,
                                                      const engine::EngineOptions& eo)>
      make;
  /// Option names of the family (e.g. {"--budget", "--buffer"}), for that check.
  std::vector<std::string> option_names;
};

/// `--policy none`: hosts nothing, i.e. the full cache. With --compare-full it checks the
/// comparison itself (agreement 1, KL 0 exactly: both engines run the same arithmetic).
class NoPolicy : public engine::EnginePolicy {
 public:
  std::string name() const override { return "none"; }
  void attach(engine::Engine&) override {}
  engine::PolicyStats stats() const override { return {}; }
  bool supports_kv_dtype(DType) const override { return true; }
};

inline PolicyEntry none_policy_entry() {
  PolicyEntry e;
  e.names = {"none"};
  e.add_options = [](CLI::App&) {};
  e.make = [](const std::string&, const engine::ModelConfig&, const engine::EngineOptions&) {
    return std::unique_ptr<engine::EnginePolicy>(new NoPolicy());
  };
  return e;
}

}  // namespace cli
}  // namespace kvkit

#include "cli/policy_r1kv.hpp"  // after PolicyEntry: the family headers use it
#include "cli/policy_eps.hpp"  // after PolicyEntry: the family headers use it
// Policy families (each needs PolicyEntry above).
#include "cli/policy_kvchan.hpp"

namespace kvkit {
namespace cli {

/// Every policy family the CLI knows, in --help order.
inline std::vector<PolicyEntry> all_policies() {
  std::vector<PolicyEntry> v;
  v.push_back(none_policy_entry());
  v.push_back(r1kv_policy_entry());
  v.push_back(kvchan_policy_entry());
  // One line per family (with its #include above), e.g. v.push_back(r1kv_policy_entry());
  v.push_back(eps_policy_entry());
  return v;
}

}  // namespace cli
}  // namespace kvkit
