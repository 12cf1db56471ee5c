// Logits of SmolLM2-135M-Instruct at the 640 teacher-forced positions of
// tests/fixtures/smollm2_greedy.json, as an .npy [5, 128, vocab], computed two ways:
//
//   logits kvkit OUT.npy          kvkit's Engine, as test_llamacpp_agreement runs it (the
//                                 prompt through Engine::prefill, then one step per token)
//   logits ggml OUT.npy [--rope-mul-add]
//                                 a plain forward pass, one token at a time, that calls
//                                 llama.cpp's own CPU kernels (libggml-cpu.so of the project
//                                 venv's llama-cpp-python 0.3.36) for every operation that
//                                 library exports, and does the rest in ggml's order: RMSNorm
//                                 with a double sum and (x * scale) * w, RoPE from ggml's float
//                                 table (theta *= theta_scale) rotated with fused multiply-adds
//                                 as ggml's compiled code does (--rope-mul-add: separate
//                                 multiply and add), K/V cache, queries and attention weights in
//                                 f16, the KV length padded to 256 as llama.cpp's cache does.
//
// The ggml forward reproduces llama.cpp's own logits bitwise (max |diff| 0.0 over all 640
// positions) when llama.cpp also runs one token at a time (llama_logits.py dump --n-batch 1);
// --rope-mul-add (a different rounding of one operation) moves it to the same distance from
// llama.cpp as kvkit and as llama.cpp's batched runs (rms ~0.26 logits). A diagnostic for
// the agreement criterion of issue 14, not part of the build: build.sh compiles it.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.hpp"
#include "engine/gguf.hpp"
#include "engine/gguf_checkpoint.hpp"
#include "engine/npy.hpp"

using namespace kvkit;
using namespace kvkit::engine;
// llama.cpp's CPU kernels, exported by libggml-cpu.so (f16 as raw bits).
extern "C" {
void quantize_row_q8_1(const float* x, void* y, int64_t k);
void quantize_row_q8_0(const float* x, void* y, int64_t k);
void ggml_vec_dot_q4_1_q8_1(int n, float* s, size_t bs, const void* vx, size_t bx, const void* vy, size_t by, int nrc);
void ggml_vec_dot_q8_0_q8_0(int n, float* s, size_t bs, const void* vx, size_t bx, const void* vy, size_t by, int nrc);
void ggml_vec_dot_f16(int n, float* s, size_t bs, uint16_t* x, size_t bx, uint16_t* y, size_t by, int nrc);
void ggml_vec_swiglu_f32(int n, float* y, const float* x, const float* g);
double ggml_vec_soft_max_f32(int n, float* y, const float* x, float max);
void ggml_cpu_init(void);
}
static bool g_rope_fma = true;  // false: --rope-mul-add
static uint16_t h(float x) { return kvkit::detail::float_to_half_bits(x); }
// One sequence, one token per step, in llama.cpp's graph order and arithmetic.
struct Oracle {
  const Checkpoint& ck; const QuantWeights& qw; int dim, kvd, hid, L, Hq, Hk, hd, V;
  static constexpr int CTX = 1024;  // llama.cpp's n_ctx in the recording
  std::vector<uint16_t> kc, vc;      // f16 K [L][Hk][CTX][hd], V transposed [L][Hk][hd][CTX]
  Oracle(const Checkpoint& c) : ck(c), qw(*c.quantized()) {
    const auto& m = c.config(); dim = m.dim; kvd = m.kv_dim(); hid = m.hidden_dim; L = m.n_layers; Hq = m.n_heads;
    Hk = m.n_kv_heads; hd = m.head_dim(); V = m.vocab_size;
    kc.assign((size_t)L * Hk * CTX * hd, 0); vc.assign(kc.size(), 0);
  }
  // y = w x: x quantized to q8_1 (Q4_1 weights) or q8_0 (Q8_0), ggml's vec_dot per row.
  void mv(const QMatrix& w, const float* x, float* y) {
    std::vector<unsigned char> qa((size_t)w.cols / 32 * 36);
    if (w.format == QuantFormat::kQ4_1) {
      quantize_row_q8_1(x, qa.data(), w.cols);
      for (int r = 0; r < w.rows; ++r) ggml_vec_dot_q4_1_q8_1(w.cols, y + r, 0, w.row(r), 0, qa.data(), 0, 1);
    } else {
      quantize_row_q8_0(x, qa.data(), w.cols);
      for (int r = 0; r < w.rows; ++r) ggml_vec_dot_q8_0_q8_0(w.cols, y + r, 0, w.row(r), 0, qa.data(), 0, 1);
    }
  }
  // ggml's rms_norm (double sum of float squares) fused with the weight multiply.
  void norm(const float* x, const float* w, float* y) {
    double sum = 0; for (int i = 0; i < dim; ++i) sum += (double)(x[i] * x[i]);
    const float mean = sum / dim; const float scale = 1.0f / sqrtf(mean + ck.config().norm_eps);
    for (int i = 0; i < dim; ++i) y[i] = x[i] * scale * w[i];
  }
  void rope(float* v, int heads, int pos) {
    const float theta_scale = powf(ck.config().rope_theta, -2.0f / hd);
    float cache[128]; float theta = (float)pos;
    for (int i0 = 0; i0 < hd; i0 += 2) { cache[i0] = cosf(theta); cache[i0 + 1] = sinf(theta); theta *= theta_scale; }
    for (int hh = 0; hh < heads; ++hh) for (int i0 = 0; i0 < hd; i0 += 2) {
      float* p = v + hh * hd + i0; const float x0 = p[0], x1 = p[1], c = cache[i0], s = cache[i0 + 1];
      if (g_rope_fma) {  // how GCC contracted ggml's x0*c - x1*s and x0*s + x1*c
        p[0] = std::fma(x0, c, -(x1 * s));
        p[1] = std::fma(x0, s, x1 * c);
      } else {
        p[0] = x0 * c - x1 * s;
        p[1] = x0 * s + x1 * c;
      }
    }
  }
  std::vector<float> step(int tok, int pos) {
    std::vector<float> x(dim), xb(dim), q(dim), k(kvd), v(kvd), att(dim), h1(hid), h3(hid), hh(hid);
    std::memcpy(x.data(), ck.token_embedding() + (size_t)tok * dim, dim * 4);
    const int nkv = std::max(256, (pos + 1 + 255) / 256 * 256);  // llama.cpp pads the KV length to 256
    for (int l = 0; l < L; ++l) {
      const QuantLayer& ql = qw.layers[l];
      norm(x.data(), ck.rms_att(l), xb.data());
      mv(ql.wq, xb.data(), q.data()); mv(ql.wk, xb.data(), k.data()); mv(ql.wv, xb.data(), v.data());
      rope(q.data(), Hq, pos); rope(k.data(), Hk, pos);
      for (int g = 0; g < Hk; ++g) for (int d = 0; d < hd; ++d) {
        kc[(((size_t)l * Hk + g) * CTX + pos) * hd + d] = h(k[g * hd + d]);
        vc[(((size_t)l * Hk + g) * hd + d) * CTX + pos] = h(v[g * hd + d]);
      }
      for (int hq = 0; hq < Hq; ++hq) {
        const int g = hq / (Hq / Hk);
        uint16_t qh[128]; for (int d = 0; d < hd; ++d) qh[d] = h(q[hq * hd + d]);
        std::vector<float> s(nkv), p(nkv);
        for (int j = 0; j < nkv; ++j) {
          ggml_vec_dot_f16(hd, &s[j], 0, &kc[(((size_t)l * Hk + g) * CTX + j) * hd], 0, qh, 0, 1);
          s[j] = s[j] * (1.0f / sqrtf(static_cast<float>(hd))) + (j <= pos ? 0.f : -INFINITY);  // scale, mask
        }
        float mx = -INFINITY; for (int j = 0; j < nkv; ++j) mx = std::max(mx, s[j]);
        double sum = ggml_vec_soft_max_f32(nkv, p.data(), s.data(), mx);
        sum = 1.0 / sum; const float sc = (float)sum;
        std::vector<uint16_t> ph(nkv); for (int j = 0; j < nkv; ++j) ph[j] = h(p[j] * sc);
        for (int d = 0; d < hd; ++d)
          ggml_vec_dot_f16(nkv, &att[hq * hd + d], 0, &vc[(((size_t)l * Hk + g) * hd + d) * CTX], 0, ph.data(), 0, 1);
      }
      mv(ql.wo, att.data(), xb.data());
      for (int i = 0; i < dim; ++i) x[i] = xb[i] + x[i];
      norm(x.data(), ck.rms_ffn(l), xb.data());
      mv(ql.w1, xb.data(), h1.data()); mv(ql.w3, xb.data(), h3.data());
      ggml_vec_swiglu_f32(hid, hh.data(), h1.data(), h3.data());
      mv(ql.w2, hh.data(), xb.data());
      for (int i = 0; i < dim; ++i) x[i] = xb[i] + x[i];
    }
    norm(x.data(), ck.rms_final(), xb.data());
    std::vector<float> lg(V); mv(qw.classifier, xb.data(), lg.data());
    return lg;
  }
};
namespace {

const char* kFixture = KVKIT_SOURCE_DIR "/tests/fixtures/smollm2_greedy.json";
const char* kModel = KVKIT_SOURCE_DIR "/../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf";

std::int32_t argmax(const std::vector<float>& x) {
  return static_cast<std::int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || (std::string(argv[1]) != "kvkit" && std::string(argv[1]) != "ggml")) {
    std::fprintf(stderr, "usage: logits kvkit|ggml OUT.npy [--rope-mul-add]\n");
    return 2;
  }
  const bool ggml = std::string(argv[1]) == "ggml";
  if (argc > 3 && std::string(argv[3]) == "--rope-mul-add") g_rope_fma = false;
  if (ggml) ggml_cpu_init();  // ggml's fp16 tables
  std::ifstream in(kFixture);
  const nlohmann::json fx = nlohmann::json::parse(in);
  const GgufFile g = GgufFile::open(kModel);
  const auto ck = std::make_shared<const Checkpoint>(load_gguf_checkpoint(g, /*float_projections=*/false));
  const std::size_t vocab = static_cast<std::size_t>(ck->config().vocab_size);
  std::vector<float> all;
  int agree = 0, ncases = 0;
  for (const auto& c : fx.at("cases")) {
    const auto prompt = c.at("prompt").get<std::vector<std::int32_t>>();
    const auto cont = c.at("continuation").get<std::vector<std::int32_t>>();
    std::vector<std::vector<float>> logits;
    if (ggml) {
      Oracle o(*ck);
      int pos = 0;
      for (std::size_t i = 0; i + 1 < prompt.size(); ++i) o.step(prompt[i], pos++);
      std::int32_t last = prompt.back();
      for (const std::int32_t t : cont) {
        logits.push_back(o.step(last, pos++));
        last = t;
      }
    } else {
      EngineOptions opt;
      opt.max_batch = 1;
      opt.num_pages = static_cast<std::int32_t>((prompt.size() + cont.size()) / 16 + 2);
      Engine eng(ck, opt);
      const SeqId id = eng.add_sequence(prompt);
      eng.prefill(id);
      for (const std::int32_t t : cont) {
        eng.forward_tokens({t});
        logits.push_back(eng.last_logits(id));
      }
    }
    for (std::size_t i = 0; i < cont.size(); ++i) {
      agree += argmax(logits[i]) == cont[i];
      all.insert(all.end(), logits[i].begin(), logits[i].end());
    }
    ++ncases;
  }
  std::printf("%s: top-1 agrees with the fixture's tokens at %d/%zu positions\n", argv[1], agree, all.size() / vocab);
  write_npy(argv[2], all.data(), {ncases, static_cast<std::int64_t>(all.size() / vocab / ncases), static_cast<std::int64_t>(vocab)});
  return 0;
}
