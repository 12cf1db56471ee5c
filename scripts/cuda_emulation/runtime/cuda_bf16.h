#pragma once
// Host stand-in for <cuda_bf16.h>: __nv_bfloat16 lives next to __half in cuda_fp16.h.
#include "cuda_fp16.h"
