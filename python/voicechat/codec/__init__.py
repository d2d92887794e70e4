"""The audio codec: 22.05 kHz waveform <-> 31 PRVQ codes per 80 ms frame (1764 samples)."""

from .codec import AudioCodec, AudioDecoder, AudioEncoder, ConvNeXtBlock, PRVQ
from .stft import istft, stft

__all__ = ["AudioCodec", "AudioDecoder", "AudioEncoder", "ConvNeXtBlock", "PRVQ", "istft", "stft"]
