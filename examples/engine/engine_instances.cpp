// The example engine's heavy templates, instantiated once for the three page types: the
// model's step (Model::forward), the batched prefill (Prefiller::run) and the decode
// kernel they and the policies call (paged_decode_attention). Every other file
// that runs the engine sees them as `extern template` (KVKIT_ENGINE_PRECOMPILED, set by the
// kvkit_example_engine library) and links this one copy: each of those files used to
// spend about 25 s of compile time (-O3) instantiating them again.
#include "engine/model.hpp"
#include "engine/prefill.hpp"

namespace kvkit {
namespace engine {

#define KVKIT_ENGINE_INSTANTIATE(T)                                                                        \
  template Status Model::forward<T>(const ForwardBatch&, const PagedKVView<T>*, float*, const AttentionHook*); \
  template Status Prefiller::run<T>(Model&, const PagedKVView<T>*, const std::vector<std::int32_t>&,           \
                                    const std::int32_t*, std::int32_t, std::int32_t, std::int32_t, float*);

KVKIT_ENGINE_INSTANTIATE(float)
KVKIT_ENGINE_INSTANTIATE(half_t)
KVKIT_ENGINE_INSTANTIATE(bfloat16_t)

#undef KVKIT_ENGINE_INSTANTIATE

}  // namespace engine

template Status paged_decode_attention<float>(exec::Host, PagedKVView<float>, const float*, float*,
                                              const DecodeAttentionParams&, Workspace, float*);
template Status paged_decode_attention<half_t>(exec::Host, PagedKVView<half_t>, const half_t*, half_t*,
                                               const DecodeAttentionParams&, Workspace, float*);
template Status paged_decode_attention<bfloat16_t>(exec::Host, PagedKVView<bfloat16_t>, const bfloat16_t*,
                                                   bfloat16_t*, const DecodeAttentionParams&, Workspace, float*);

}  // namespace kvkit
