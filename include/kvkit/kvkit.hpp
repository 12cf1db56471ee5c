#pragma once
// Umbrella header for host code: core types, engine adapters, kernel parameters and the
// CPU backend (exec::Host). It never includes anything from CUDA, so it compiles with any
// C++17 compiler and no CUDA on the include path; CUDA code includes <kvkit/cuda.cuh>.
// Including the individual headers instead keeps compile times down.

#include "kvkit/core/config.hpp"
#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/core/thread_pool.hpp"
#include "kvkit/core/workspace.hpp"
#include "kvkit/kernels/params.hpp"
#include "kvkit/version.hpp"

#include "kvkit/core/adapters/flashinfer.hpp"
#include "kvkit/core/adapters/trtllm.hpp"
#include "kvkit/core/adapters/vllm.hpp"
#include "kvkit/core/block_hash.hpp"
#include "kvkit/kernels/cpu.hpp"
