#pragma once
// GGUF llama models -> the engine's Checkpoint (quantized views of the projections, plus float32
// weights dequantized at load unless the caller asks for the quantized weights only).
//
// Hyper-parameters come from the metadata, never from constants: llama.embedding_length,
// block_count, feed_forward_length, attention.head_count, attention.head_count_kv,
// context_length, rope.freq_base (default 10000), attention.layer_norm_rms_epsilon, and the
// vocabulary size from tokenizer.ggml.tokens (llama.vocab_size and token_embd.weight must
// agree with it). Tensors: token_embd.weight, blk.N.{attn_norm, attn_q, attn_k, attn_v,
// attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}.weight, output_norm.weight and
// output.weight (absent: the classifier is the token embedding). GGUF dims are
// fastest-first, so a [out][in] row-major matrix has ne = {in, out}; that is the
// Checkpoint's layout, so rows are copied as they are.
//
// RoPE pairing: llama.cpp's converter permutes the Q and K rows of HF llama checkpoints so
// that GGUF llama rotates adjacent pairs (2i, 2i+1) of each head, which is what Model does.
// Partial rotary (rope.dimension_count != head_dim) is rejected.

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine/gguf.hpp"
#include "engine/quant_matvec.hpp"
#include "kvkit/core/error.hpp"

namespace kvkit {
namespace engine {

namespace detail {

inline std::int32_t gguf_positive_i32(const GgufFile& g, const std::string& key) {
  const std::int64_t v = g.get_int(key);
  KVKIT_CHECK(v > 0 && v <= std::numeric_limits<std::int32_t>::max(), "kvkit: gguf ", g.source(),
              ": ", key, " = ", v, " is out of range (expected 1 to 2^31-1)");
  return static_cast<std::int32_t>(v);
}

}  // namespace detail

/// The ModelConfig of a GGUF file of architecture `llama`. Throws kvkit::Error naming the
/// key for a missing or out-of-range hyper-parameter, an unsupported architecture or
/// feature (mixture of experts, partial rotary), or an inconsistent vocabulary size.
inline ModelConfig gguf_llama_config(const GgufFile& g) {
  const std::string arch = g.get_string("general.architecture");
  KVKIT_CHECK(arch == "llama", "kvkit: gguf ", g.source(), ": unsupported architecture '", arch,
              "' (only 'llama' is supported)");
  const std::string p = "llama.";
  ModelConfig c;
  c.dim = detail::gguf_positive_i32(g, p + "embedding_length");
  c.n_layers = detail::gguf_positive_i32(g, p + "block_count");
  c.hidden_dim = detail::gguf_positive_i32(g, p + "feed_forward_length");
  c.n_heads = detail::gguf_positive_i32(g, p + "attention.head_count");
  c.n_kv_heads = g.has(p + "attention.head_count_kv")
                     ? detail::gguf_positive_i32(g, p + "attention.head_count_kv")
                     : c.n_heads;
  c.seq_len = detail::gguf_positive_i32(g, p + "context_length");
  c.rope_theta = g.get_float(p + "rope.freq_base", 10000.0);
  KVKIT_CHECK(std::isfinite(c.rope_theta) && c.rope_theta > 1.0, "kvkit: gguf ", g.source(), ": ", p,
              "rope.freq_base = ", c.rope_theta, " must be a finite number > 1");
  const double eps = g.get_float(p + "attention.layer_norm_rms_epsilon");
  KVKIT_CHECK(std::isfinite(eps) && eps > 0 && eps < 1, "kvkit: gguf ", g.source(), ": ", p,
              "attention.layer_norm_rms_epsilon = ", eps, " must be in (0, 1)");
  c.norm_eps = static_cast<float>(eps);
  KVKIT_CHECK(g.get_int(p + "expert_count", 0) == 0, "kvkit: gguf ", g.source(),
              ": mixture-of-experts llama models (", p, "expert_count = ",
              g.get_int(p + "expert_count", 0), ") are not supported");

  if (g.has("tokenizer.ggml.tokens")) {
    const std::uint64_t n = g.array_size("tokenizer.ggml.tokens");
    KVKIT_CHECK(n > 0 && n <= static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max()),
                "kvkit: gguf ", g.source(), ": tokenizer.ggml.tokens has ", n, " entries");
    c.vocab_size = static_cast<std::int32_t>(n);
    if (g.has(p + "vocab_size"))
      KVKIT_CHECK(g.get_int(p + "vocab_size") == c.vocab_size, "kvkit: gguf ", g.source(), ": ", p,
                  "vocab_size = ", g.get_int(p + "vocab_size"),
                  " disagrees with the ", c.vocab_size, " entries of tokenizer.ggml.tokens");
  } else {
    c.vocab_size = detail::gguf_positive_i32(g, p + "vocab_size");
  }
  c.shared_classifier = g.tensor("output.weight") == nullptr;
  validate_config(c, g.source());

  auto check_dim = [&](const std::string& key) {
    if (!g.has(key)) return;
    KVKIT_CHECK(g.get_int(key) == c.head_dim(), "kvkit: gguf ", g.source(), ": ", key, " = ",
                g.get_int(key), " differs from head_dim ", c.head_dim(), " (embedding_length ",
                c.dim, " / head_count ", c.n_heads, "): not supported");
  };
  check_dim(p + "rope.dimension_count");
  check_dim(p + "attention.key_length");
  check_dim(p + "attention.value_length");
  return c;
}

/// The projections and the classifier of a GGUF llama as quantized views into the file
/// image (no copy; the returned object keeps the image alive), for decode's quantized
/// matrix-vector products. Null when a matrix has a type without a quantized product
/// (BF16): the model then runs on the float weights. Shapes must have been checked
/// (load_gguf_checkpoint does).
inline std::shared_ptr<const QuantWeights> gguf_quant_weights(const GgufFile& g, const ModelConfig& c) {
  auto q = std::make_shared<QuantWeights>();
  const auto file = std::make_shared<const GgufFile>(g);
  q->owner = file;
  bool ok = true;
  auto view = [&](const std::string& name) {
    const GgufTensorInfo* t = file->tensor(name);
    KVKIT_CHECK(t != nullptr && t->n_dims == 2, "kvkit: gguf ", g.source(), ": missing matrix '", name, "'");
    QuantFormat f = QuantFormat::kF32;
    switch (t->ggml_type()) {
      case GgmlType::kF32: f = QuantFormat::kF32; break;
      case GgmlType::kF16: f = QuantFormat::kF16; break;
      case GgmlType::kQ8_0: f = QuantFormat::kQ8_0; break;
      case GgmlType::kQ4_0: f = QuantFormat::kQ4_0; break;
      case GgmlType::kQ4_1: f = QuantFormat::kQ4_1; break;
      default: ok = false; return QMatrix{};
    }
    return QMatrix::make(f, static_cast<std::int32_t>(t->ne[1]), static_cast<std::int32_t>(t->ne[0]),
                         file->tensor_data(*t), name.c_str());
  };
  for (int l = 0; l < c.n_layers; ++l) {
    auto w = [&](const char* part) { return view(kvkit::detail::concat("blk.", l, ".", part, ".weight")); };
    QuantLayer L;
    L.wq = w("attn_q");
    L.wk = w("attn_k");
    L.wv = w("attn_v");
    L.wo = w("attn_output");
    L.w1 = w("ffn_gate");
    L.w2 = w("ffn_down");
    L.w3 = w("ffn_up");
    q->layers.push_back(L);
  }
  q->classifier = view(c.shared_classifier ? "token_embd.weight" : "output.weight");
  if (!ok) return nullptr;
  return q;
}

/// Loads a GGUF llama model into a Checkpoint with quantized views of the projections
/// (Checkpoint::quantized(): decode's and batched prefill's quantized products) and, with
/// `float_projections` (default), every weight dequantized to float32 as well (the float
/// paths: EngineOptions::quantized_matvec = false, float64 references). Without it only the
/// embedding and the norms are dequantized (SmolLM2-135M: about 113 MB instead of 540 MB),
/// unless a matrix has a type without quantized products (BF16), which needs the floats.
/// Throws kvkit::Error naming the tensor for a missing tensor, a shape that disagrees with
/// the metadata, or a type without dequantization support.
inline Checkpoint load_gguf_checkpoint(const GgufFile& g, bool float_projections = true) {
  const ModelConfig c = gguf_llama_config(g);
  using U = std::uint64_t;
  const U dim = static_cast<U>(c.dim), kv = static_cast<U>(c.kv_dim());
  const U hid = static_cast<U>(c.hidden_dim), vocab = static_cast<U>(c.vocab_size);
  // Every tensor is found and its shape checked before anything is allocated, so a
  // corrupted hyper-parameter is an error naming the tensor, never a huge allocation (the
  // tensors' bytes were bounds-checked against the file at parse).
  std::vector<const GgufTensorInfo*> order;
  // Tensor `name`, whose GGUF shape must be {cols, rows} ({cols} when rows is 0).
  auto want = [&](const std::string& name, U cols, U rows) {
    const GgufTensorInfo* t = g.tensor(name);
    KVKIT_CHECK(t != nullptr, "kvkit: gguf ", g.source(), ": missing tensor '", name, "'");
    const bool ok = rows == 0 ? (t->n_dims == 1 && t->ne[0] == cols)
                              : (t->n_dims == 2 && t->ne[0] == cols && t->ne[1] == rows);
    if (!ok)
      fail("kvkit: gguf ", g.source(), ": tensor '", name, "' has shape ", t->shape_string(),
           ", expected [", cols, rows ? kvkit::detail::concat(", ", rows) : std::string(),
           "] from the metadata (", detail::config_string(c), ")");
    KVKIT_CHECK(ggml_type_traits(t->type).dequantizable, "kvkit: gguf ", g.source(), ": tensor '",
                name, "' has type ", ggml_type_name(t->type),
                ", which this reader cannot dequantize (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)");
    order.push_back(t);
  };
  auto per_layer = [&](const char* part, U cols, U rows) {
    for (int l = 0; l < c.n_layers; ++l)
      want(kvkit::detail::concat("blk.", l, ".", part, ".weight"), cols, rows);
  };
  // Checkpoint order: embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1 (gate), w2 (down),
  // w3 (up), rms_final[, classifier].
  want("token_embd.weight", dim, vocab);
  per_layer("attn_norm", dim, 0);
  per_layer("attn_q", dim, dim);
  per_layer("attn_k", dim, kv);
  per_layer("attn_v", dim, kv);
  per_layer("attn_output", dim, dim);
  per_layer("ffn_norm", dim, 0);
  per_layer("ffn_gate", dim, hid);
  per_layer("ffn_down", hid, dim);
  per_layer("ffn_up", dim, hid);
  want("output_norm.weight", dim, 0);
  if (!c.shared_classifier) want("output.weight", dim, vocab);

  std::shared_ptr<const QuantWeights> quant = gguf_quant_weights(g, c);  // null: BF16 present
  if (!float_projections && quant) {
    // Embedding and norms only, in file order.
    std::vector<float> w(static_cast<std::size_t>(checkpoint_norm_weight_count(c)));
    std::size_t off = 0;
    for (const GgufTensorInfo* t : order) {
      const bool keep = t == order.front() || t->n_dims == 1;  // token_embd and the norms
      if (!keep) continue;
      KVKIT_CHECK(t->n_elements <= w.size() - off, "kvkit: gguf ", g.source(),
                  ": internal error: tensors exceed the embedding and norm size");
      g.dequantize(*t, w.data() + off);
      off += static_cast<std::size_t>(t->n_elements);
    }
    KVKIT_CHECK(off == w.size(), "kvkit: gguf ", g.source(), ": internal error: filled ", off, " of ",
                w.size(), " embedding and norm weights");
    return Checkpoint(c, std::move(w), g.source(), std::move(quant));
  }
  std::vector<float> w(static_cast<std::size_t>(checkpoint_weight_count(c)));
  std::size_t off = 0;
  for (const GgufTensorInfo* t : order) {
    KVKIT_CHECK(t->n_elements <= w.size() - off, "kvkit: gguf ", g.source(),
                ": internal error: tensors exceed the checkpoint size");
    g.dequantize(*t, w.data() + off);
    off += static_cast<std::size_t>(t->n_elements);
  }
  KVKIT_CHECK(off == w.size(), "kvkit: gguf ", g.source(), ": internal error: filled ", off,
              " of ", w.size(), " weights");
  Checkpoint ck(c, std::move(w), g.source());
  ck.set_quantized(std::move(quant));  // decode's quantized products (null: BF16 present)
  return ck;
}

/// Opens `path` and loads it (see load_gguf_checkpoint(const GgufFile&, bool)).
inline Checkpoint load_gguf_checkpoint(const std::string& path, bool float_projections = true) {
  return load_gguf_checkpoint(GgufFile::open(path), float_projections);
}

}  // namespace engine
}  // namespace kvkit
