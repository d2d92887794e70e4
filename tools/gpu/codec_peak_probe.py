"""The windowed codec decode's peak memory on its own, in a fresh process (test_codec's two peak tests
fail on the H200 inside the suite's process, pass on the CPU): the peak over the tiny checkpoint's
decode at 64 and 320 code frames, as decode() runs it and with one change each (every window waited
for; each kept piece copied out of its window's buffer), read before and after a synchronize. On the
H200 (eighteenth session) it did not grow with the answer here: 31.0 / 34.5 MB.

    PYTHONPATH=python python tools/gpu/codec_peak_probe.py
"""

from __future__ import annotations

import tempfile

import mlx.core as mx
import numpy as np

from voicechat.checkpoint import open_checkpoint
from voicechat.codec.codec import AudioCodec, decode_context, decode_windows
from voicechat.testing import make_checkpoint


def decode(codec, codes, mode: str) -> mx.array:
    latent = codec.prvq.decode(codes)
    spf, pieces = codec.samples_per_frame, []
    for lo, hi, start, end in decode_windows(latent.shape[1], 16, *decode_context(codec.config)):
        wave = codec.decode_latent(latent[:, lo:hi])
        if pieces and mode != "sync":
            mx.eval(pieces[-1])
        piece = wave[:, (start - lo) * spf:(end - lo) * spf]
        if mode == "copy":
            piece = mx.contiguous(piece) if hasattr(mx, "contiguous") else piece * 1.0
        pieces.append(piece)
        (mx.eval if mode == "sync" else mx.async_eval)(pieces[-1])
    return mx.concatenate(pieces, axis=1)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(tmp, size="tiny", seed=0)
        ckpt = open_checkpoint(tmp)
        codec = AudioCodec(ckpt.config.codec_config)
        ckpt.load_into(codec, "tts_model.audio_codec.")
    cfg = codec.config
    for mode in ("as_is", "sync", "copy", "as_is"):
        row = {}
        for frames in (64, 320):
            rng = np.random.default_rng(frames)
            codes = mx.array(rng.integers(0, cfg.codebook_size, (1, cfg.num_quantizers, frames)).astype(np.int32))
            mx.eval(codes, codec.prvq.codebooks())
            mx.synchronize()
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            wave = codec.decode(codes, chunk_frames=16) if mode == "as_is" else decode(codec, codes, mode)
            mx.eval(wave)
            peak = mx.get_peak_memory() - base
            mx.synchronize()
            row[frames] = (round(peak / 1e6, 2), round((mx.get_peak_memory() - base) / 1e6, 2),
                           round((mx.get_active_memory() - base) / 1e6, 2), round(wave.nbytes / 1e6, 2))
            del wave
        print(mode, "frames: (peak MB, peak after sync, active after sync, output MB)", row, flush=True)


if __name__ == "__main__":
    main()
