import json
import math

import pytest

from voicechat.config import ConfigError, VoiceChatConfig
from voicechat.synthetic import tiny_config


def test_defaults_are_the_published_model():
    c = VoiceChatConfig()
    assert c.model_type == "nemotron_voicechat" and c.speaker == "Aria"
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id, c.silence_token_id) == (1, 2, 12, 11)
    assert c.text_config.hidden_size == 4480 and c.text_config.vocab_size == 131072
    assert c.audio_config.encoder.att_context_size == (70, 0)
    assert c.tts_config.num_hidden_layers == 28 and c.codec_config.downsample_rates == (7, 7, 9)


def test_derived_values():
    c = VoiceChatConfig()
    assert c.samples_per_frame == 1764 == c.codec_config.waveform_to_token_ratio
    assert c.codec_config.stft_channels == 18
    assert c.input_samples_per_frame == 1280
    t = c.text_config
    assert t.attention_layers == [14, 21, 30, 39]
    assert len(t.mamba_layers) == 27 and len(t.mlp_layers) == 25
    assert t.mamba_inner_size == 10240 and t.mamba_conv_dim == 12288 and t.mamba_in_proj_size == 22656
    assert c.audio_config.encoder.subsampled_features == 17
    assert c.tts_config.global_layers == [5, 11, 17, 23]
    assert c.tts_config.mask_schedule == [0, 0, 0, 1, 1, 3, 4, 22]
    assert t.time_step_limit == (0.0, math.inf)


def test_round_trip_through_json_keeps_unknown_keys():
    data = VoiceChatConfig().to_dict()
    data["some_future_field"] = {"x": 1}
    data["tts_config"]["new_tts_knob"] = 3
    c = VoiceChatConfig.from_dict(json.loads(json.dumps(data)))
    assert c.extra == {"some_future_field": {"x": 1}}
    assert c.tts_config.extra == {"new_tts_knob": 3}
    again = VoiceChatConfig.from_dict(json.loads(json.dumps(c.to_dict())))
    assert again == c and again.to_dict() == c.to_dict()


def test_tiny_round_trip(tmp_path):
    c = tiny_config()
    c.save(tmp_path / "config.json")
    assert VoiceChatConfig.from_file(tmp_path / "config.json") == c


@pytest.mark.parametrize("value", [[70, 0], [[70, 0]], (70, 0)])
def test_att_context_size_forms(value):
    data = VoiceChatConfig().to_dict()
    data["audio_config"]["encoder"]["att_context_size"] = value
    assert VoiceChatConfig.from_dict(data).audio_config.encoder.att_context_size == (70, 0)


def _with(path, value):
    data = VoiceChatConfig().to_dict()
    node = data
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    return data


@pytest.mark.parametrize("path,value,needle", [
    ("model_type", "llama", "model_type"),
    ("speaker", "Bob", "speaker"),
    ("text_config.model_type", "mamba", "text_config.model_type"),
    ("text_config.hybrid_override_pattern", "M*", "text_config.hybrid_override_pattern"),
    ("text_config.hybrid_override_pattern", "M" * 55 + "x", "text_config.hybrid_override_pattern"),
    ("text_config.num_key_value_heads", 7, "text_config.num_key_value_heads"),
    ("text_config.hidden_size", 0, "text_config.hidden_size"),
    ("tts_config.head_dim", 64, "tts_config.head_dim"),
    ("tts_config.character_encoder.head_dim", 70, "tts_config.character_encoder.head_dim"),
    ("audio_config.encoder.n_heads", 7, "audio_config.encoder.n_heads"),
    ("audio_config.encoder.att_context_size", [70], "audio_config.encoder.att_context_size"),
    ("audio_config.output_dim", 4096, "audio_config.output_dim"),
    ("audio_config.joint.encoder_hidden", 512, "audio_config.joint.encoder_hidden"),
    ("codec_config.downsample_rates", [7, 7, 8], "frame_duration"),
    ("codec_config.latent_dim", 256, "tts_config.latent_size"),
    ("rnnt_blank_id", 1000, "rnnt_blank_id"),
    ("pad_token_id", 131072, "pad_token_id"),
    ("tts_config", [1], "tts_config"),
])
def test_validation_errors_name_the_field(path, value, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        VoiceChatConfig.from_dict(_with(path, value))


def test_rnnt_vocabulary_length_is_checked():
    with pytest.raises(ConfigError, match="rnnt_vocabulary"):
        VoiceChatConfig.from_dict(_with("rnnt_vocabulary", ["a", "b"]))


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        VoiceChatConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        VoiceChatConfig.from_file(tmp_path / "config.json")
