// kvkit's SmolLM2-135M-Instruct against llama.cpp on the same GGUF file: teacher-forced on
// llama.cpp's greedy continuations of five ChatML prompts x 128 tokens
// (tests/fixtures/smollm2_greedy.json, recorded by scripts/record-greedy-fixtures.py),
// kvkit's top-1 is compared with llama.cpp's at each of the 640 positions. The prompt runs
// through Engine::prefill and decode through steps, both on the file's quantized blocks
// with 8-bit activations as llama.cpp's CPU backend does (q8_1 blocks for Q4_1, q8_0 for
// Q8_0: engine/quant_matvec.hpp; the checkpoint is loaded without float projections, as
// the CLI does). llama.cpp (recorded with n_batch 512, flash attention off) also keeps K/V
// in f16 and rounds queries and attention weights to f16, and sums in other orders. The
// model amplifies any rounding difference: at the first generated position kvkit's own
// portable and AVX-512 builds differ by ~1.5 % of the logits' spread, as much as either
// differs from llama.cpp, and emulating llama.cpp's f16 K/V, queries and attention weights
// or its float RoPE table did not move agreement out of that noise (620 to 625 / 640). So
// near-ties flip; after a flip both keep following llama.cpp's tokens (teacher forcing),
// so one flip costs one position. Measured with this test (deterministic for a given
// build): 624 / 640 = 97.5 % agree in the default (portable) Release build; with a
// token-by-token prompt instead of prefill 621 / 640 (portable), 625 / 640 (-march=native);
// kvkit's portable and native builds agree with each other on 628 / 640 of the same
// positions. The goal is 98 %. Every flip is a near-tie: kvkit's lead over
// llama.cpp's token and llama.cpp's own top-1 margin are both below 0.5 logits. The test
// requires >= 619 / 640 (the measured 624 less the spread of 5 positions seen across
// builds and summation orders) and near-tie flips only, so a real divergence (RoPE, norm,
// template, a quantized kernel) fails it. The prompts' token ids must match kvkit's
// tokenizer + ChatML template exactly. Skips with a message without the model file.

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "engine/engine.hpp"
#include "engine/gguf.hpp"
#include "engine/gguf_checkpoint.hpp"
#include "engine/tokenizer.hpp"

using namespace kvkit;
using namespace kvkit::engine;
namespace fs = std::filesystem;

namespace {

const std::string kSmolPath = std::string(KVKIT_MODEL_DIR) + "/SmolLM2-135M-Instruct.Q4_1.gguf";

std::int32_t argmax(const std::vector<float>& x) {
  std::int32_t best = 0;
  for (std::int32_t i = 1; i < static_cast<std::int32_t>(x.size()); ++i)
    if (x[static_cast<std::size_t>(i)] > x[static_cast<std::size_t>(best)]) best = i;
  return best;
}

}  // namespace

TEST_CASE("SmolLM2: kvkit's top-1 agrees with llama.cpp's greedy continuations", "[llamacpp][smollm2]") {
  if (!fs::exists(kSmolPath)) {
    WARN("skipped: no model file " << kSmolPath << " (run scripts/fetch-model.sh)");
    return;
  }
  std::ifstream in(KVKIT_GREEDY_FIXTURE);
  REQUIRE(in.good());
  const nlohmann::json fx = nlohmann::json::parse(in);
  const GgufFile g = GgufFile::open(kSmolPath);
  const auto ck = std::make_shared<const Checkpoint>(load_gguf_checkpoint(g, /*float_projections=*/false));
  const Tokenizer tok = Tokenizer::from_gguf(g);
  const ChatTemplate tmpl = ChatTemplate::from_gguf(g);
  std::int64_t agree = 0, total = 0;
  double worst_lead = 0, worst_margin = 0;  // over the flips
  REQUIRE(fx.at("cases").size() == 5);
  for (const auto& c : fx.at("cases")) {
    const auto prompt = c.at("prompt").get<std::vector<std::int32_t>>();
    const auto cont = c.at("continuation").get<std::vector<std::int32_t>>();
    REQUIRE(cont.size() == 128);
    INFO("prompt: " << c.at("user").get<std::string>());
    CHECK(tmpl.encode(tok, {{"user", c.at("user").get<std::string>()}}, true) == prompt);
    EngineOptions o;
    o.max_batch = 1;
    o.num_pages = static_cast<std::int32_t>((prompt.size() + cont.size()) / 16 + 2);
    Engine eng(ck, o);
    const SeqId id = eng.add_sequence(prompt);
    REQUIRE(eng.prefill(id) == static_cast<std::int32_t>(prompt.size()) - 1);  // all but the last token
    const auto margins = c.at("margins").get<std::vector<double>>();
    std::int64_t here = 0;
    std::ostringstream flips;
    for (std::size_t i = 0; i < cont.size(); ++i) {
      eng.forward_tokens({cont[i]});  // logits predict cont[i]; llama.cpp's token is kept
      const std::vector<float>& lg = eng.last_logits(id);
      const std::int32_t mine = argmax(lg);
      if (mine == cont[i]) {
        ++here;
      } else {
        worst_lead = std::max<double>(worst_lead, lg[static_cast<std::size_t>(mine)] - lg[static_cast<std::size_t>(cont[i])]);
        worst_margin = std::max(worst_margin, margins[i]);
        flips << " [pos " << i << ": kvkit " << mine << " by " << lg[static_cast<std::size_t>(mine)] - lg[static_cast<std::size_t>(cont[i])]
              << ", llama.cpp margin " << margins[i] << "]";
      }
    }
    WARN("llama.cpp agreement " << here << "/" << cont.size() << " on: " << c.at("user").get<std::string>()
                                << "; flips (kvkit's lead over llama.cpp's token, llama.cpp's own top-1 margin):"
                                << flips.str());
    agree += here;
    total += static_cast<std::int64_t>(cont.size());
  }
  WARN("llama.cpp agreement overall " << agree << "/" << total << "; flips: kvkit leads by at most "
                                      << worst_lead << ", llama.cpp's margin at most " << worst_margin);
  CHECK(agree * 640 >= total * 619);
  CHECK(worst_lead < 0.5);
  CHECK(worst_margin < 0.5);
}
