// kvkit's SmolLM2-135M-Instruct against llama.cpp on the same GGUF file: teacher-forced on
// llama.cpp's greedy continuations of five ChatML prompts x 128 tokens
// (tests/fixtures/smollm2_greedy.json, recorded by scripts/record-greedy-fixtures.py), kvkit's
// top-1 is compared with llama.cpp's at each of the 640 positions. The prompt runs through
// Engine::prefill and decode through steps, both on the file's quantized blocks with 8-bit
// activations as llama.cpp's CPU backend does (q8_1 blocks for Q4_1, q8_0 for Q8_0:
// engine/quant_matvec.hpp; the checkpoint is loaded without float projections, as the CLI does).
// llama.cpp (recorded with n_batch 512, flash attention off) also keeps K/V in f16 and rounds
// queries and attention weights to f16, and sums in other orders.
//
// Why 98 % is not the bar: the 8-bit activation quantization turns any rounding difference into
// whole quantization steps (a value near a .5 boundary rounds the other way), and 30 layers
// spread them, so every implementation that is not bitwise identical to this llama.cpp run lands
// at about the same distance from it. Measured on the 640 positions' full logits (logit std
// 3.66): kvkit portable vs llama.cpp rms difference 0.288, kvkit -march=native 0.283, kvkit
// portable vs native 0.263 (same source, only the compiled rounding differs), and llama.cpp
// against itself 0.267 with the prompt fed one token at a time and 0.246 with prompt +
// continuation in one batch (same file, machine and library; batched matmuls take llamafile's
// kernels). Top-1 agreement with the recorded tokens follows the noise: kvkit 624 / 640
// (portable Release build), 625 (-march=native); llama.cpp itself 619 (one token at a time) and
// 627 (one batch) -- llama.cpp does not reach 98 % (628) against itself either. A forward pass
// that calls llama.cpp's own CPU kernels for every operation
// (scripts/llamacpp-parity/logits.cpp) reproduces llama.cpp's token-at-a-time logits bitwise at
// all 640 positions; rounding just its RoPE rotation differently (separate multiply and add
// instead of the fused multiply-add ggml's compiled code uses) puts it back at rms 0.26 from
// llama.cpp and 628 / 640 -- agreement counts between 619 and 628 are draws from the same noise.
// Only bitwise-identical arithmetic (ggml's op order, its exp polynomial, its f16 roundings, and
// for this fixture's batched prompt llamafile's GEMM order) would reach 640 / 640. Every flip is
// a near-tie: kvkit's lead over llama.cpp's token and llama.cpp's own top-1 margin are both
// below 0.5 logits. After a flip both keep following llama.cpp's tokens (teacher forcing), so
// one flip costs one position.
//
// So the test holds kvkit to the floor llama.cpp sets for itself: at least as many agreeing
// positions as the worse of llama.cpp's two self-agreements, which the recording script measures
// and stores in the fixture ("llama_cpp_self_agreement": 619 / 640 today), and near-tie flips
// only, so a real divergence (RoPE, norm, template, a quantized kernel) fails it. The prompts'
// token ids must match kvkit's tokenizer + ChatML template exactly. Skips with a message without
// the model file.

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
  // llama.cpp against itself, run two other ways (see the file comment): the floor.
  std::int64_t floor = total;
  std::ostringstream self;
  for (const auto& [mode, counts] : fx.at("llama_cpp_self_agreement").items()) {
    std::int64_t n = 0;
    for (const auto& x : counts) n += x.get<std::int64_t>();
    self << " " << mode << " " << n << "/" << total << ";";
    floor = std::min(floor, n);
  }
  REQUIRE(fx.at("llama_cpp_self_agreement").size() == 2);
  REQUIRE(floor < total);  // a floor of 640 would mean the recording went wrong
  WARN("llama.cpp agreement overall " << agree << "/" << total << "; flips: kvkit leads by at most "
                                      << worst_lead << ", llama.cpp's margin at most " << worst_margin
                                      << "; llama.cpp against itself:" << self.str());
  CHECK(agree >= floor);
  CHECK(worst_lead < 0.5);
  CHECK(worst_margin < 0.5);
}
