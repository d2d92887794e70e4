"""What a live session's result and frames must be against the offline `generate` of the same
input (shared by the live-session and engine tests)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

# The streamed codec decoder's samples against the whole-signal decode: float32 rounding on a CPU;
# on a GPU, kernels picked by length round differently (ids and codes stay identical).
AUDIO_ATOL = 1e-5 if mx.default_device() == mx.cpu else 1e-4


def check_equal(frames, result, expected):
    assert result.text_tokens == expected.text_tokens
    assert result.function_tokens == expected.function_tokens
    assert result.audio_codes == expected.audio_codes
    assert result.user_transcript == expected.user_transcript
    assert (result.text, result.function_text) == (expected.text, expected.function_text)
    assert (result.frames, result.prompt_frames) == (expected.frames, expected.prompt_frames)
    assert result.audio.shape == expected.audio.shape
    np.testing.assert_allclose(result.audio, expected.audio, rtol=0, atol=AUDIO_ATOL)
    # what the frames handed out, joined, is the result
    assert [f.index for f in frames] == list(range(expected.frames))
    assert [f.text_id for f in frames] == expected.text_tokens
    assert [f.function_id for f in frames] == expected.function_tokens
    np.testing.assert_array_equal(np.concatenate([f.audio for f in frames]), result.audio)
    assert "".join(f.text for f in frames) == expected.text
    assert "".join(f.function_text for f in frames) == expected.function_text
    assert "".join(f.transcript for f in frames) == expected.user_transcript
    # final as they come: 1764 samples a frame, 6 fewer in the first, 6 more in the last
    sizes = [f.audio.size for f in frames]
    assert sizes[0] == 1758 and sizes[-1] == 1770 and set(sizes[1:-1]) <= {1764}
    assert all(f.audio.dtype == np.float32 for f in frames)
