// voicechat's fused kernels on MLX arrays: every op, each taking and returning mlx::core::array and
// running on the stream or device it is given (MLX's default when none), as MLX's own ops do.
#pragma once

#include "voicechat/add_rms_norm.h"
#include "voicechat/causal_conv.h"
#include "voicechat/code_embedding.h"
#include "voicechat/decode_attention.h"
#include "voicechat/gated_rms_norm.h"
#include "voicechat/gemv.h"
#include "voicechat/mamba_scan.h"
#include "voicechat/mog_sample.h"
#include "voicechat/qkv_heads.h"
#include "voicechat/rel_pos_attention.h"
#include "voicechat/rnnt_greedy.h"
#include "voicechat/rvq_search.h"
