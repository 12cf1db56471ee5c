#pragma once
// CompositePolicy: several EnginePolicy objects hosted by one engine (`kvkit generate
// --policy r1kv+eps`).
//
// The parts attach in the order given and never call each other: they meet only through
// the engine's host contract. A compactor (the Compressor policies) rewrites pages and
// says so with notify_rewrite / truncate_kv, so a Sketcher (EpsPolicy) sees kRewrite and
// freeing kRelease events and re-summarises or drops exactly those pages; step hooks run in
// registration order; registered pools add up in kv_bytes_in_use().
//
// Two things exist once per engine and are checked before anything attaches (PolicyRole):
// the attention call (EpsPolicy and the kvchan policy both replace it) and the right to
// move a sequence's cached tokens (a compactor rewrites them in the engine's pages, the
// kvchan policy moves old tokens to its packed pool; each keeps per-sequence bookkeeping
// the other would silently break). Combinations that need both twice throw kvkit::Error
// naming the two policies.
//
// A composite is a SequenceStateKeeper for the parts that are (the Compressor's query
// window), so a ConversationCache host resumes a conversation with every part's state.

#include <any>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.hpp"
#include "engine/policy.hpp"
#include "engine/sequence_state.hpp"
#include "kvkit/core/error.hpp"

namespace kvkit {
namespace engine {

class CompositePolicy : public EnginePolicy, public SequenceStateKeeper {
 public:
  /// Takes at least two policies with distinct names; throws kvkit::Error naming the
  /// conflict when two of them replace the attention call or move tokens.
  explicit CompositePolicy(std::vector<std::unique_ptr<EnginePolicy>> parts) : parts_(std::move(parts)) {
    KVKIT_CHECK(parts_.size() >= 2, "kvkit: a composite policy needs at least 2 policies, got ", parts_.size());
    std::set<std::string> names;
    const EnginePolicy* attention = nullptr;
    const EnginePolicy* mover = nullptr;
    for (const auto& p : parts_) {
      KVKIT_CHECK(p != nullptr, "kvkit: a composite policy got a null policy");
      KVKIT_CHECK(names.insert(p->name()).second, "kvkit: policy ", p->name(), " is listed twice");
      // Each engine slot has at most one owner.
      auto claim = [&](const EnginePolicy*& owner, bool takes, const char* what) {
        if (!takes) return;
        KVKIT_CHECK(owner == nullptr, "kvkit: policies ", owner ? owner->name() : "", " and ", p->name(),
                    " both ", what, "; combine at most one of them with others");
        owner = p.get();
      };
      const PolicyRole r = p->role();
      claim(attention, r.replaces_attention, "replace the attention call");
      claim(mover, r.moves_tokens, "move cached tokens");
    }
  }

  /// The parts' names joined by '+', in attach order ("r1kv+eps").
  std::string name() const override {
    std::string n;
    for (const auto& p : parts_) n += (n.empty() ? "" : "+") + p->name();
    return n;
  }

  void attach(Engine& eng) override {
    KVKIT_CHECK(!attached_, "kvkit: policy ", name(), " is already attached to an engine");
    attached_ = true;
    for (const auto& p : parts_) p->attach(eng);
  }

  /// Every part's counters in attach order; a name reported by an earlier part is
  /// prefixed with the later part's name ("eps_pages_freed"), so no counter is lost.
  PolicyStats stats() const override {
    PolicyStats all;
    std::set<std::string> seen;
    for (const auto& p : parts_)
      for (auto kv : p->stats()) {
        if (!seen.insert(kv.first).second) {
          kv.first = p->name() + "_" + kv.first;
          seen.insert(kv.first);
        }
        all.push_back(std::move(kv));
      }
    return all;
  }

  PolicyRole role() const override {
    PolicyRole r;
    for (const auto& p : parts_) {
      const PolicyRole q = p->role();
      r.replaces_attention = r.replaces_attention || q.replaces_attention;
      r.moves_tokens = r.moves_tokens || q.moves_tokens;
    }
    return r;
  }
  bool supports_kv_dtype(DType d) const override {
    for (const auto& p : parts_)
      if (!p->supports_kv_dtype(d)) return false;
    return true;
  }

  /// The state of every part that keeps one (in attach order); empty when none has any.
  std::any save_sequence(SeqId seq) const override {
    States s;
    bool any = false;
    for (const auto& p : parts_)
      if (const auto* k = dynamic_cast<const SequenceStateKeeper*>(p.get())) {
        s.parts.push_back(k->save_sequence(seq));
        any = any || s.parts.back().has_value();
      }
    return any ? std::any(std::move(s)) : std::any();
  }
  /// Hands each keeping part its own saved state; throws kvkit::Error for a state this
  /// composite did not save.
  void restore_sequence(SeqId seq, const std::any& state) override {
    if (!state.has_value()) return;
    const States* s = std::any_cast<States>(&state);
    KVKIT_CHECK(s != nullptr, "kvkit: policy ", name(), " cannot restore sequence ", seq,
                " from a state it did not save");
    std::size_t i = 0;
    for (const auto& p : parts_)
      if (auto* k = dynamic_cast<SequenceStateKeeper*>(p.get())) {
        KVKIT_CHECK(i < s->parts.size(), "kvkit: policy ", name(), " got a state of ", s->parts.size(),
                    " parts for sequence ", seq);
        k->restore_sequence(seq, s->parts[i++]);
      }
  }

  /// The parts' own state_bytes, summed.
  std::int64_t state_bytes(const std::any& state) const override {
    const States* s = std::any_cast<States>(&state);
    if (s == nullptr) return 0;
    std::int64_t b = 0;
    std::size_t i = 0;
    for (const auto& p : parts_)
      if (const auto* k = dynamic_cast<const SequenceStateKeeper*>(p.get()))
        if (i < s->parts.size()) b += k->state_bytes(s->parts[i++]);
    return b;
  }

  /// Part i, in attach order.
  EnginePolicy& part(std::size_t i) const { return *parts_.at(i); }
  /// The first part of type P (nullptr when none), e.g. find<EpsPolicy>() for its telemetry.
  template <class P>
  P* find() const {
    for (const auto& p : parts_)
      if (auto* x = dynamic_cast<P*>(p.get())) return x;
    return nullptr;
  }
  std::size_t size() const { return parts_.size(); }

 private:
  struct States {
    std::vector<std::any> parts;  // one per keeping part, in attach order
  };
  std::vector<std::unique_ptr<EnginePolicy>> parts_;
  bool attached_ = false;
};

}  // namespace engine
}  // namespace kvkit
