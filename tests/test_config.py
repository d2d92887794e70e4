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


@pytest.mark.parametrize("path,value,needle", [
    ("bos_token_id", "x", "bos_token_id: expected an integer, got str 'x'"),
    ("audio_config.preprocessor.window_size", None, "audio_config.preprocessor.window_size: expected a number, got null"),
    ("frame_duration", "0.08", "frame_duration: expected a number"),
    ("text_config.time_step_limit", None, "text_config.time_step_limit: expected a list, got null"),
    ("text_config.time_step_limit", [0.0, "x"], r"text_config.time_step_limit\[1\]: expected a number"),
    ("codec_config.downsample_rates", None, "codec_config.downsample_rates: expected a list"),
    ("codec_config.downsample_rates", ["7", 7, 9], r"codec_config.downsample_rates\[0\]: expected an integer"),
    ("tts_config.exponent", "x", "tts_config.exponent: expected a number"),
    ("tts_config.exponent", 0, "tts_config.exponent: must be in"),
    ("tts_config.use_subword_flag_emb", "yes", "tts_config.use_subword_flag_emb: expected true or false"),
    ("rnnt_vocabulary", 5, "rnnt_vocabulary: expected a list"),
    ("quantization", [1], "quantization: expected an object"),
    ("speaker", 7, "speaker: expected a string"),
    ("audio_config.encoder.n_layers", 2**31, r"audio_config.encoder.n_layers: must be an integer in \[1, 512\]"),
    ("text_config.max_position_embeddings", 10**30, "text_config.max_position_embeddings: must be an integer"),
    ("text_config.vocab_size", 1e300, "text_config.vocab_size: must be an integer"),
    ("audio_config.preprocessor.n_fft", 2**20, "audio_config.preprocessor.n_fft: must be an integer"),
    ("tts_config.character_encoder.query_pre_attn_scalar", 0, "query_pre_attn_scalar: must be in"),
    ("tts_config.guidance_scale", float("nan"), "tts_config.guidance_scale: must be finite"),
    ("input_sample_rate", 10**12, "input_sample_rate: must be in"),
])
def test_types_and_bounds_are_config_errors_naming_the_field(path, value, needle):
    """A wrong type, null or absurd size is one ConfigError naming the field (not a TypeError from
    deep inside, nor 2^31 layers built)."""
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        VoiceChatConfig.from_dict(_with(path, value))


def test_whole_floats_are_integers_and_inf_strings_read_back():
    c = VoiceChatConfig.from_dict(_with("text_config.hidden_size", 4480.0))
    assert c.text_config.hidden_size == 4480 and isinstance(c.text_config.hidden_size, int)
    assert VoiceChatConfig.from_dict(VoiceChatConfig().to_dict()).text_config.time_step_limit == (0.0, math.inf)


def test_a_config_file_must_say_model_type(tmp_path):
    data = VoiceChatConfig().to_dict()
    del data["model_type"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=f"{tmp_path}/config.json: model_type: missing"):
        VoiceChatConfig.from_file(tmp_path / "config.json")


def test_file_errors_name_the_file(tmp_path):
    path = tmp_path / "config.json"
    data = json.dumps(VoiceChatConfig().to_dict()).encode()
    for content, needle in ((data.replace(b"nemotron_voicechat", b"nemotron_\xffvoicechat"), "not UTF-8 text"),
                            (b"\xff\xfe{}", "not UTF-8 text"),
                            (b"[" * 100_000 + b"]" * 100_000, "nested too deeply|not valid JSON"),
                            (b"[1, 2]", "expected a JSON object, got list"),
                            (json.dumps(_with("tts_config.head_dim", None)).encode(), "tts_config.head_dim")):
        path.write_bytes(content)
        with pytest.raises(ConfigError, match=needle) as info:
            VoiceChatConfig.from_file(path)
        assert str(info.value).startswith(f"{path}: "), info.value
    path.unlink()
    path.mkdir()
    with pytest.raises(ConfigError, match=f"{path}: cannot read"):
        VoiceChatConfig.from_file(path)
