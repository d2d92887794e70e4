"""The whole checkpoint as one module tree: `stt_model.*` and `tts_model.*`, key for key."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .codec.codec import AudioCodec
from .config import SPEAKER_PROMPT_FRAMES, VoiceChatConfig
from .llm.nemotron_h import DuplexLM
from .stt.conformer import Perception
from .stt.rnnt import RNNTDecoder, RNNTJoint
from .tts.ear_tts import EarTTS


class ListeningModel(DuplexLM):
    """`stt_model.*`: perception, the duplex LLM with its two heads, and the RNNT transcript. It
    listens and decides what to say; the speaking model turns that into audio."""

    def __init__(self, config: VoiceChatConfig):
        super().__init__(config.text_config, config.function_channel_weight)
        self.perception = Perception(config.audio_config)
        self.rnnt_decoder = RNNTDecoder(config.audio_config.decoder)
        self.rnnt_joint = RNNTJoint(config.audio_config.joint)


class SpeakingModel(nn.Module):
    """`tts_model.*`: EAR-TTS (itself `tts_model.tts_model.*`), the codec, the speaker prompt and
    the special codes."""

    def __init__(self, config: VoiceChatConfig):
        super().__init__()
        t = config.tts_config
        self.tts_model = EarTTS(t, config.text_config.vocab_size, config.eos_token_id, config.pad_token_id)
        self.audio_codec = AudioCodec(config.codec_config)
        self.audio_prompt_latents = {config.speaker: mx.zeros((1, SPEAKER_PROMPT_FRAMES, t.hidden_size))}
        self.codec_silence_tokens = mx.zeros((t.num_quantizers,), dtype=mx.int32)
        self.control_codes = mx.zeros((3,), dtype=mx.int32)


class VoiceChatModel(nn.Module):
    """The whole checkpoint: the listening model and the speaking model."""

    def __init__(self, config: VoiceChatConfig):
        super().__init__()
        self.config = config
        self.stt_model = ListeningModel(config)
        self.tts_model = SpeakingModel(config)
