#pragma once
// Llama checkpoints in the llama2.c binary format, loaded into one float32 buffer.
//
// File layout: seven little-endian int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
// vocab_size, seq_len), then float32 weights in this order: token_embedding[vocab][dim],
// rms_att[L][dim], wq[L][dim][dim], wk[L][kv_dim][dim], wv[L][kv_dim][dim],
// wo[L][dim][dim], rms_ffn[L][dim], w1[L][hidden][dim], w2[L][dim][hidden],
// w3[L][hidden][dim], rms_final[dim], two legacy RoPE tables of seq_len*head_dim/2 floats
// each (skipped: RoPE is recomputed), then classifier[vocab][dim] only when vocab_size was
// written negative (otherwise the classifier is the token embedding).
//
// Everything is validated before a single weight is used: a missing or short file, a
// size that differs from the size the header implies, non-positive or inconsistent
// dimensions and non-finite weights all throw kvkit::Error naming the file and the value.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kvkit/core/error.hpp"

namespace kvkit {
namespace engine {

struct QuantWeights;  // engine/quant_matvec.hpp

/// Model hyper-parameters (the checkpoint header, with the classifier sign decoded).
struct ModelConfig {
  std::int32_t dim = 0;         // residual width
  std::int32_t hidden_dim = 0;  // SwiGLU hidden width
  std::int32_t n_layers = 0;
  std::int32_t n_heads = 0;     // query heads
  std::int32_t n_kv_heads = 0;  // key/value heads (grouped-query attention)
  std::int32_t vocab_size = 0;  // always positive here
  std::int32_t seq_len = 0;     // maximum positions
  bool shared_classifier = true;  // classifier == token embedding
  double rope_theta = 10000.0;    // RoPE base (llama2.c files: 10000; GGUF: rope.freq_base)
  float norm_eps = 1e-5f;         // RMSNorm epsilon

  std::int32_t head_dim() const { return n_heads > 0 ? dim / n_heads : 0; }
  std::int32_t kv_dim() const { return n_heads > 0 ? n_kv_heads * (dim / n_heads) : 0; }
};

/// The shape of stories260K (the tiny real model the tests and demos use).
inline ModelConfig stories260k_config() {
  ModelConfig c;
  c.dim = 64;
  c.hidden_dim = 172;
  c.n_layers = 5;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.vocab_size = 512;
  c.seq_len = 512;
  c.shared_classifier = true;
  return c;
}

inline constexpr std::size_t kCheckpointHeaderBytes = 7 * sizeof(std::int32_t);

namespace detail {

// a * b with an overflow check (checkpoint headers are untrusted input).
inline std::uint64_t checked_mul(std::uint64_t a, std::uint64_t b, const std::string& what) {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a)
    fail("kvkit: checkpoint ", what, ": size overflows");
  return a * b;
}

inline std::string config_string(const ModelConfig& c) {
  return kvkit::detail::concat("dim=", c.dim, " hidden_dim=", c.hidden_dim,
                               " n_layers=", c.n_layers, " n_heads=", c.n_heads,
                               " n_kv_heads=", c.n_kv_heads, " vocab_size=", c.vocab_size,
                               " seq_len=", c.seq_len);
}

}  // namespace detail

/// Throws kvkit::Error when a configuration cannot describe a llama model: every
/// dimension must be positive, dim a multiple of n_heads, n_heads a multiple of
/// n_kv_heads and head_dim even (RoPE rotates pairs). `source` names the file in messages.
inline void validate_config(const ModelConfig& c, const std::string& source = "config") {
  auto positive = [&](const char* name, std::int32_t v) {
    KVKIT_CHECK(v > 0, "kvkit: checkpoint ", source, ": ", name, " must be > 0, got ", v);
  };
  positive("dim", c.dim);
  positive("hidden_dim", c.hidden_dim);
  positive("n_layers", c.n_layers);
  positive("n_heads", c.n_heads);
  positive("n_kv_heads", c.n_kv_heads);
  positive("vocab_size", c.vocab_size);
  positive("seq_len", c.seq_len);
  KVKIT_CHECK(c.dim % c.n_heads == 0, "kvkit: checkpoint ", source, ": dim ", c.dim,
              " is not a multiple of n_heads ", c.n_heads);
  KVKIT_CHECK(c.n_heads % c.n_kv_heads == 0, "kvkit: checkpoint ", source, ": n_heads ",
              c.n_heads, " is not a multiple of n_kv_heads ", c.n_kv_heads);
  KVKIT_CHECK(c.head_dim() % 2 == 0, "kvkit: checkpoint ", source, ": head_dim ", c.head_dim(),
              " (dim ", c.dim, " / n_heads ", c.n_heads, ") must be even for RoPE");
}

/// Number of float32 weights the model itself uses (without the legacy RoPE tables).
inline std::uint64_t checkpoint_weight_count(const ModelConfig& c) {
  validate_config(c);
  using U = std::uint64_t;
  const std::string w = "weights";
  const U dim = static_cast<U>(c.dim), hid = static_cast<U>(c.hidden_dim);
  const U layers = static_cast<U>(c.n_layers), vocab = static_cast<U>(c.vocab_size);
  const U kv = static_cast<U>(c.kv_dim());
  U n = detail::checked_mul(vocab, dim, w);                                    // embedding
  n += detail::checked_mul(layers, dim, w) * 2;                                // rms_att, rms_ffn
  n += detail::checked_mul(detail::checked_mul(layers, dim, w), dim, w) * 2;   // wq, wo
  n += detail::checked_mul(detail::checked_mul(layers, kv, w), dim, w) * 2;    // wk, wv
  n += detail::checked_mul(detail::checked_mul(layers, hid, w), dim, w) * 3;   // w1, w2, w3
  n += dim;                                                                    // rms_final
  if (!c.shared_classifier) n += vocab * dim;
  return n;
}

/// Float32 weights besides the projections: token embedding, rms_att, rms_ffn, rms_final.
inline std::uint64_t checkpoint_norm_weight_count(const ModelConfig& c) {
  validate_config(c);
  using U = std::uint64_t;
  const U dim = static_cast<U>(c.dim);
  return detail::checked_mul(static_cast<U>(c.vocab_size), dim, "weights") +
         detail::checked_mul(static_cast<U>(c.n_layers), dim, "weights") * 2 + dim;
}

/// Exact file size in bytes implied by a header (legacy RoPE tables included).
inline std::uint64_t expected_checkpoint_bytes(const ModelConfig& c) {
  const std::uint64_t rope = 2 * detail::checked_mul(static_cast<std::uint64_t>(c.seq_len),
                                                     static_cast<std::uint64_t>(c.head_dim() / 2),
                                                     "rope tables");
  return kCheckpointHeaderBytes + 4 * (checkpoint_weight_count(c) + rope);
}

/// A loaded (or generated) model: its configuration and all weights in one buffer.
/// Accessors return pointers into `weights`; offsets, not pointers, are stored, so a
/// Checkpoint can be copied and moved freely.
class Checkpoint {
 public:
  Checkpoint() = default;
  /// Takes `weights` in file order without RoPE tables (checkpoint_weight_count floats).
  Checkpoint(const ModelConfig& config, std::vector<float> weights, std::string source)
      : config_(config), weights_(std::move(weights)), source_(std::move(source)) {
    validate_config(config_, source_);
    KVKIT_CHECK(weights_.size() == checkpoint_weight_count(config_), "kvkit: checkpoint ",
                source_, ": got ", weights_.size(), " weights, expected ",
                checkpoint_weight_count(config_));
    const std::size_t dim = static_cast<std::size_t>(config_.dim);
    const std::size_t layers = static_cast<std::size_t>(config_.n_layers);
    const std::size_t kv = static_cast<std::size_t>(config_.kv_dim());
    const std::size_t hid = static_cast<std::size_t>(config_.hidden_dim);
    const std::size_t vocab = static_cast<std::size_t>(config_.vocab_size);
    std::size_t off = 0;
    auto take = [&](std::size_t n) {
      const std::size_t o = off;
      off += n;
      return o;
    };
    token_embedding_ = take(vocab * dim);
    rms_att_ = take(layers * dim);
    wq_ = take(layers * dim * dim);
    wk_ = take(layers * kv * dim);
    wv_ = take(layers * kv * dim);
    wo_ = take(layers * dim * dim);
    rms_ffn_ = take(layers * dim);
    w1_ = take(layers * hid * dim);
    w2_ = take(layers * dim * hid);
    w3_ = take(layers * hid * dim);
    rms_final_ = take(dim);
    classifier_ = config_.shared_classifier ? token_embedding_ : take(vocab * dim);
    for (std::size_t i = 0; i < weights_.size(); ++i)
      KVKIT_CHECK(std::isfinite(weights_[i]), "kvkit: checkpoint ", source_,
                  ": non-finite weight ", weights_[i], " at float index ", i);
  }

  /// A checkpoint whose projections exist only as quantized blocks (no float32 copy: for a
  /// GGUF model that decodes and prefills on its quantized weights). `weights` holds, in
  /// file order, only token_embedding, rms_att, rms_ffn and rms_final
  /// (checkpoint_norm_weight_count floats); wq() ... w3() (and classifier() when not shared)
  /// are then null, has_float_projections() is false, and a Model on it must run quantized.
  Checkpoint(const ModelConfig& config, std::vector<float> weights, std::string source,
             std::shared_ptr<const QuantWeights> quantized)
      : config_(config), weights_(std::move(weights)), source_(std::move(source)),
        quantized_(std::move(quantized)), float_projections_(false) {
    validate_config(config_, source_);
    KVKIT_CHECK(quantized_ != nullptr, "kvkit: checkpoint ", source_,
                ": a checkpoint without float projections needs quantized weights");
    KVKIT_CHECK(weights_.size() == checkpoint_norm_weight_count(config_), "kvkit: checkpoint ", source_,
                ": got ", weights_.size(), " embedding and norm weights, expected ",
                checkpoint_norm_weight_count(config_));
    const std::size_t dim = static_cast<std::size_t>(config_.dim);
    const std::size_t layers = static_cast<std::size_t>(config_.n_layers);
    token_embedding_ = 0;
    rms_att_ = static_cast<std::size_t>(config_.vocab_size) * dim;
    rms_ffn_ = rms_att_ + layers * dim;
    rms_final_ = rms_ffn_ + layers * dim;
    classifier_ = token_embedding_;
    for (std::size_t i = 0; i < weights_.size(); ++i)
      KVKIT_CHECK(std::isfinite(weights_[i]), "kvkit: checkpoint ", source_,
                  ": non-finite weight ", weights_[i], " at float index ", i);
  }

  const ModelConfig& config() const { return config_; }
  const std::string& source() const { return source_; }
  /// Whether wq() ... w3() and classifier() point at float32 weights (false: quantized only).
  bool has_float_projections() const { return float_projections_; }
  /// All float weights in file order (RoPE tables removed; without float projections only
  /// the embedding and norms).
  const std::vector<float>& weights() const { return weights_; }

  // Per-layer matrices are row-major [out][in], as in the file.
  const float* token_embedding() const { return at(token_embedding_); }  // [vocab, dim]
  const float* rms_att(int l) const { return at(rms_att_, l, dim()); }   // [dim]
  // Projections: null without float projections (has_float_projections()).
  const float* wq(int l) const { return proj(wq_, l, dim() * dim()); }     // [dim, dim]
  const float* wk(int l) const { return proj(wk_, l, kv() * dim()); }      // [kv_dim, dim]
  const float* wv(int l) const { return proj(wv_, l, kv() * dim()); }      // [kv_dim, dim]
  const float* wo(int l) const { return proj(wo_, l, dim() * dim()); }     // [dim, dim]
  const float* rms_ffn(int l) const { return at(rms_ffn_, l, dim()); }     // [dim]
  const float* w1(int l) const { return proj(w1_, l, hid() * dim()); }     // [hidden, dim]
  const float* w2(int l) const { return proj(w2_, l, dim() * hid()); }     // [dim, hidden]
  const float* w3(int l) const { return proj(w3_, l, hid() * dim()); }     // [hidden, dim]
  const float* rms_final() const { return at(rms_final_); }                // [dim]
  const float* classifier() const {                                        // [vocab, dim]
    return float_projections_ || config_.shared_classifier ? at(classifier_) : nullptr;
  }

  /// The projections (and classifier) in their file's quantized blocks, for decode's
  /// quantized matrix-vector products (engine/quant_matvec.hpp); null when the checkpoint
  /// has only float weights (llama2.c files). Shared by copies of the checkpoint.
  const std::shared_ptr<const QuantWeights>& quantized() const { return quantized_; }
  void set_quantized(std::shared_ptr<const QuantWeights> q) { quantized_ = std::move(q); }

 private:
  std::size_t dim() const { return static_cast<std::size_t>(config_.dim); }
  std::size_t kv() const { return static_cast<std::size_t>(config_.kv_dim()); }
  std::size_t hid() const { return static_cast<std::size_t>(config_.hidden_dim); }
  const float* at(std::size_t off, int layer = 0, std::size_t per_layer = 0) const {
    return weights_.data() + off + static_cast<std::size_t>(layer) * per_layer;
  }
  const float* proj(std::size_t off, int layer, std::size_t per_layer) const {
    return float_projections_ ? at(off, layer, per_layer) : nullptr;
  }

  ModelConfig config_;
  std::vector<float> weights_;
  std::string source_;
  std::shared_ptr<const QuantWeights> quantized_;
  bool float_projections_ = true;
  std::size_t token_embedding_ = 0, rms_att_ = 0, wq_ = 0, wk_ = 0, wv_ = 0, wo_ = 0;
  std::size_t rms_ffn_ = 0, w1_ = 0, w2_ = 0, w3_ = 0, rms_final_ = 0, classifier_ = 0;
};

/// Parses a checkpoint image held in memory (`bytes` bytes). `source` names it in errors.
inline Checkpoint parse_checkpoint(const void* data /* [bytes] */, std::size_t bytes,
                                   const std::string& source) {
  KVKIT_CHECK(bytes >= kCheckpointHeaderBytes, "kvkit: checkpoint ", source, " is ", bytes,
              " bytes, shorter than the ", kCheckpointHeaderBytes, "-byte header (truncated?)");
  std::int32_t h[7];
  std::memcpy(h, data, sizeof(h));
  ModelConfig c;
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  KVKIT_CHECK(h[5] != 0 && h[5] != std::numeric_limits<std::int32_t>::min(),
              "kvkit: checkpoint ", source, ": vocab_size must be non-zero, got ", h[5]);
  c.vocab_size = h[5] > 0 ? h[5] : -h[5];
  c.shared_classifier = h[5] > 0;
  c.seq_len = h[6];
  validate_config(c, source);
  const std::uint64_t expected = expected_checkpoint_bytes(c);
  if (bytes != expected) {
    ModelConfig other = c;
    other.shared_classifier = !c.shared_classifier;
    fail("kvkit: checkpoint ", source, " is ", bytes, " bytes, expected ", expected,
         " bytes for ", detail::config_string(c), " with ",
         c.shared_classifier ? "a shared" : "an unshared", " classifier",
         bytes < expected ? " (truncated?)" : "", "; ",
         c.shared_classifier ? "an unshared" : "a shared", " classifier would be ",
         expected_checkpoint_bytes(other), " bytes");
  }
  const std::uint64_t n = checkpoint_weight_count(c);
  const std::uint64_t n_main = n - (c.shared_classifier ? 0 : static_cast<std::uint64_t>(c.vocab_size) * c.dim);
  const std::uint64_t rope = static_cast<std::uint64_t>(c.seq_len) * c.head_dim();  // both tables
  std::vector<float> w(static_cast<std::size_t>(n));
  const unsigned char* p = static_cast<const unsigned char*>(data) + kCheckpointHeaderBytes;
  std::memcpy(w.data(), p, static_cast<std::size_t>(n_main) * 4);
  if (n > n_main)
    std::memcpy(w.data() + n_main, p + (n_main + rope) * 4, static_cast<std::size_t>(n - n_main) * 4);
  return Checkpoint(c, std::move(w), source);
}

/// Loads a llama2.c checkpoint file; throws kvkit::Error (naming the file and the bad
/// value or the expected vs actual size) on any problem.
inline Checkpoint load_checkpoint(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  KVKIT_CHECK(in.good(), "kvkit: cannot open checkpoint file '", path, "'");
  const std::streamoff size = in.tellg();
  KVKIT_CHECK(size >= 0, "kvkit: cannot read the size of checkpoint file '", path, "'");
  std::vector<unsigned char> bytes(static_cast<std::size_t>(size));
  in.seekg(0);
  if (size > 0) in.read(reinterpret_cast<char*>(bytes.data()), size);
  KVKIT_CHECK(in.good(), "kvkit: read error in checkpoint file '", path, "'");
  return parse_checkpoint(bytes.data(), bytes.size(), "'" + path + "'");
}

/// Serialises a checkpoint in the llama2.c format (RoPE tables written as zeros, which
/// loaders skip). Used to hand generated models to the CLI and to build bad files in tests.
inline std::vector<unsigned char> serialize_checkpoint(const Checkpoint& ck) {
  const ModelConfig& c = ck.config();
  KVKIT_CHECK(ck.has_float_projections(), "kvkit: checkpoint ", ck.source(),
              " has no float projections (quantized only): cannot write it as a llama2.c file");
  const std::uint64_t total = expected_checkpoint_bytes(c);
  std::vector<unsigned char> out(static_cast<std::size_t>(total), 0);
  const std::int32_t h[7] = {c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads,
                             c.shared_classifier ? c.vocab_size : -c.vocab_size, c.seq_len};
  std::memcpy(out.data(), h, sizeof(h));
  const std::size_t n = ck.weights().size();
  const std::size_t n_cls = c.shared_classifier ? 0 : static_cast<std::size_t>(c.vocab_size) * c.dim;
  const std::size_t rope = static_cast<std::size_t>(c.seq_len) * c.head_dim();
  unsigned char* p = out.data() + kCheckpointHeaderBytes;
  std::memcpy(p, ck.weights().data(), (n - n_cls) * 4);
  if (n_cls) std::memcpy(p + (n - n_cls + rope) * 4, ck.weights().data() + (n - n_cls), n_cls * 4);
  return out;
}

/// Writes serialize_checkpoint(ck) to `path`; throws kvkit::Error on I/O failure.
inline void save_checkpoint(const Checkpoint& ck, const std::string& path) {
  const std::vector<unsigned char> bytes = serialize_checkpoint(ck);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  KVKIT_CHECK(out.good(), "kvkit: cannot create checkpoint file '", path, "'");
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  KVKIT_CHECK(out.good(), "kvkit: write error in checkpoint file '", path, "'");
}

namespace detail {
// splitmix64: tiny, seedable and identical on every platform (std distributions are not).
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  float symmetric() { return static_cast<float>(static_cast<double>(next() >> 11) * 0x1.0p-52 - 1.0); }
};
}  // namespace detail

/// A deterministic random llama checkpoint (same seed, same weights on every machine), so
/// demos and tests run without a model file. Scales keep activations O(1): matrices are
/// uniform with variance ~gain^2/fan_in, RMSNorm weights near 1, small embeddings and
/// strong output projections, so greedy decoding does not settle on the input token (which
/// a shared classifier otherwise favours): it wanders over the vocabulary in stretches broken
/// by runs of one repeated token (default model, 256 steps from BOS: 65 distinct tokens, 11
/// 401s right after BOS, runs of up to 23). Varied enough to exercise paging, not language.
inline Checkpoint make_synthetic_checkpoint(const ModelConfig& config, std::uint64_t seed) {
  validate_config(config, "synthetic");
  const std::uint64_t n = checkpoint_weight_count(config);
  std::vector<float> w(static_cast<std::size_t>(n));
  detail::SplitMix64 rng{seed ^ 0x6b766b6974ull};
  const std::size_t dim = static_cast<std::size_t>(config.dim);
  const std::size_t layers = static_cast<std::size_t>(config.n_layers);
  const std::size_t kv = static_cast<std::size_t>(config.kv_dim());
  const std::size_t hid = static_cast<std::size_t>(config.hidden_dim);
  const std::size_t vocab = static_cast<std::size_t>(config.vocab_size);
  std::size_t off = 0;
  auto fill = [&](std::size_t count, float center, float scale) {
    for (std::size_t i = 0; i < count; ++i) w[off + i] = center + scale * rng.symmetric();
    off += count;
  };
  const float sqrt3 = 1.7320508f;  // uniform[-a, a] has variance a^2 / 3
  auto mat = [&](std::size_t count, std::size_t fan_in, float gain) {
    fill(count, 0.f, gain * sqrt3 / std::sqrt(static_cast<float>(fan_in)));
  };
  const float g = 3.f;  // residual writes dominate the (shared-classifier) embedding: varied tokens
  fill(vocab * dim, 0.f, 0.3f * sqrt3);     // token_embedding
  fill(layers * dim, 1.f, 0.2f);            // rms_att
  mat(layers * dim * dim, dim, 1.5f);       // wq
  mat(layers * kv * dim, dim, 1.5f);        // wk
  mat(layers * kv * dim, dim, 1.f);         // wv
  mat(layers * dim * dim, dim, g);          // wo
  fill(layers * dim, 1.f, 0.2f);            // rms_ffn
  mat(layers * hid * dim, dim, 1.f);        // w1
  mat(layers * dim * hid, hid, g);          // w2
  mat(layers * hid * dim, dim, 1.f);        // w3
  fill(dim, 2.f, 0.4f);                     // rms_final
  if (!config.shared_classifier) mat(vocab * dim, dim, 3.f);
  return Checkpoint(config, std::move(w), "synthetic");
}

/// Seed of the synthetic model the CLI uses when no --model is given.
inline constexpr std::uint64_t kDefaultSyntheticSeed = 20240601;

/// The synthetic stand-in for stories260K (same shape, kDefaultSyntheticSeed).
inline Checkpoint default_synthetic_checkpoint() {
  return make_synthetic_checkpoint(stories260k_config(), kDefaultSyntheticSeed);
}

}  // namespace engine
}  // namespace kvkit
