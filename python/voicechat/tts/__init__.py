"""EAR-TTS (Network 3): text ids and previous codec codes in, 31 codes per 80 ms frame out."""

from .backbone import Backbone, BackboneCache
from .char_encoder import CharVocabularyError
from .ear_tts import EarTTS

__all__ = ["Backbone", "BackboneCache", "CharVocabularyError", "EarTTS"]
