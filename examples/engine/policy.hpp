#pragma once
// EnginePolicy: how the example engine hosts a kvkit policy for a whole run (the CLI's
// `generate --policy NAME`, the demos and the quality reports).
//
// A policy is built for one engine, attaches its hooks once (step hooks, the attention
// hook, page listeners, the reclaim callback, extra pools) before the first sequence is
// added, and reports counters. Several policies may attach to one engine: each sees the
// others' page changes through page events (kRewrite from a compaction, releases), never
// through private calls, so none assumes it is alone (see engine.hpp's host contract).

#include <string>
#include <utility>
#include <vector>

#include "engine/engine.hpp"

namespace kvkit {
namespace engine {

/// Counters of a policy, in a stable order: ("compressions", 3), ("pages_freed", 40).
using PolicyStats = std::vector<std::pair<std::string, double>>;

/// What a policy takes over in the engine, so several can share one (CompositePolicy):
/// the attention call is a single slot, and a sequence's old tokens can be moved by one
/// policy only (a compactor rewrites them inside the engine's pages, a channel packer
/// moves them to its own pool; either one would invalidate the other's bookkeeping).
/// Everything else (step hooks, page listeners, pools) is shared by construction.
struct PolicyRole {
  bool replaces_attention = false;  // installs Engine::set_attention
  bool moves_tokens = false;        // rewrites, truncates or moves cached tokens
};

/// A policy hosted by the example engine. attach() is called once, before the engine has
/// sequences; stats() may be called at any time (names become JSON keys of `kvkit
/// generate --json`, so use snake_case and do not reuse the CLI's own keys).
class EnginePolicy {
 public:
  virtual ~EnginePolicy() = default;
  /// The --policy name this object was built for ("r1kv", "kvchan", ...).
  virtual std::string name() const = 0;
  /// Installs the policy's hooks on `eng`; throws kvkit::Error when the engine's model or
  /// options cannot host it (value named).
  virtual void attach(Engine& eng) = 0;
  /// Counters so far.
  virtual PolicyStats stats() const = 0;
  /// What attach() takes over (default: neither), checked before policies are combined.
  virtual PolicyRole role() const { return {}; }
  /// True when the policy can run on pages of element type `d` (EngineOptions::kv_dtype);
  /// default float32 only (the policy reads float views).
  virtual bool supports_kv_dtype(DType d) const { return d == DType::kFloat32; }
};

}  // namespace engine
}  // namespace kvkit
