#pragma once
// The CPU backend of kvkit's core KV operations (exec::Host): write_kv,
// paged_decode_attention, gather_tokens, compact_tokens, copy_pages. It is also the
// oracle the CUDA kernels are checked against. See kernels/params.hpp for the list.

#include "kvkit/kernels/cpu/attention.hpp"
#include "kvkit/kernels/cpu/copy_pages.hpp"
#include "kvkit/kernels/cpu/gather.hpp"
#include "kvkit/kernels/cpu/parallel.hpp"
#include "kvkit/kernels/cpu/write_kv.hpp"
