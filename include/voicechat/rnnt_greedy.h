// RNNT greedy decoding of a whole utterance (the transcript branch).
#pragma once

#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace voicechat {

// Greedy RNNT decode of every frame: enc_proj [F, J] (the joint's encoder projection), embed
// [V + 1, H], lstm = [Wx0, Wh0, b0, Wx1, ...], pred_w [J, H], pred_b [J], out_w [V + 1, J], out_b
// [V + 1] -> [F, max_symbols] int32 tokens a frame, -1 padded. Runs on `s`, a CPU stream (default:
// the default CPU stream). threads: worker threads (0: by the model's size, up to half the cores);
// any count gives the same tokens.
mlx::core::array rnnt_greedy(const mlx::core::array& enc_proj, const mlx::core::array& embed,
                             const std::vector<mlx::core::array>& lstm, const mlx::core::array& pred_w,
                             const mlx::core::array& pred_b, const mlx::core::array& out_w,
                             const mlx::core::array& out_b, int blank_id, int max_symbols, int threads = 0,
                             mlx::core::StreamOrDevice s = {});

// rnnt_greedy from a prediction-network state [2, layers, H] float32 (h, then c) and the last
// emitted token [1] int32 (blank: none yet), both by default the utterance's start. Returns
// {tokens, state, last}: decoding frames in pieces, each from the state and last token the one
// before ended with, gives the tokens of one call over every frame.
std::vector<mlx::core::array> rnnt_greedy_from(const mlx::core::array& enc_proj, const mlx::core::array& embed,
                                               const std::vector<mlx::core::array>& lstm,
                                               const mlx::core::array& pred_w, const mlx::core::array& pred_b,
                                               const mlx::core::array& out_w, const mlx::core::array& out_b,
                                               int blank_id, int max_symbols, int threads = 0,
                                               mlx::core::StreamOrDevice s = {},
                                               const std::optional<mlx::core::array>& state = std::nullopt,
                                               const std::optional<mlx::core::array>& last = std::nullopt);

// rnnt_greedy_from over several streams at once (each its own frames enc_projs[i] [F_i, J], state
// and last token; none: every stream at the utterance's start), one weight pass a step for all
// of them. Returns {tokens, state, last} of each stream in turn; each stream gets the tokens it
// gets alone.
std::vector<mlx::core::array> rnnt_greedy_streams(const std::vector<mlx::core::array>& enc_projs,
                                                  const mlx::core::array& embed,
                                                  const std::vector<mlx::core::array>& lstm,
                                                  const mlx::core::array& pred_w, const mlx::core::array& pred_b,
                                                  const mlx::core::array& out_w, const mlx::core::array& out_b,
                                                  int blank_id, int max_symbols, int threads = 0,
                                                  mlx::core::StreamOrDevice s = {},
                                                  const std::vector<mlx::core::array>& states = {},
                                                  const std::vector<mlx::core::array>& lasts = {});

}  // namespace voicechat
