"""The synthetic checkpoint generator writes the published checkpoint's tensors, name for name."""

import json
import math
from pathlib import Path

import mlx.core as mx
import pytest

from voicechat.checkpoint import file_metadata, quantization_map
from voicechat.config import VoiceChatConfig
from voicechat.synthetic import full_config, inventory, make_checkpoint, published_config_json, tiny_config

PUBLISHED = Path(__file__).parent / "data" / "published-checkpoint-keys.tsv"


def published() -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    for line in PUBLISHED.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, shape, dtype = line.split("\t")
        dims = tuple(int(d) for d in shape.strip("()").split(",") if d.strip())
        out[name] = (dims, dtype.removeprefix("mlx.core."))
    return out


def test_full_size_inventory_equals_the_published_checkpoint():
    specs, qmap = inventory(full_config(), quantize=4, dtype="bfloat16", layout="torch")
    ours = {s.name: (s.shape, str(s.dtype).removeprefix("mlx.core.")) for s in specs}
    ref = published()
    assert len(ref) == 1878
    assert sorted(ours.keys() - ref.keys()) == []
    assert sorted(ref.keys() - ours.keys()) == []
    assert {k: v for k, v in ours.items() if ref[k] != v} == {}
    # exactly the modules the spec quantizes
    assert "stt_model.embed_tokens" in qmap and "stt_model.lm_head" in qmap and "stt_model.function_head" in qmap
    assert all(k.startswith("stt_model.") for k in qmap)
    assert len(qmap) == 3 + 27 * 2 + 4 * 4 + 25 * 2
    assert 8.5e9 < sum(s.nbytes for s in specs) < 8.7e9


@pytest.mark.parametrize("quantize,dtype,layout", [(None, "float32", "torch"), (4, "bfloat16", "torch"),
                                                   (8, "bfloat16", "mlx")])
def test_tiny_files_hold_exactly_the_inventory(tmp_path, quantize, dtype, layout):
    d = make_checkpoint(tmp_path / "c", "tiny", quantize=quantize, dtype=dtype, layout=layout)
    specs, qmap = inventory(tiny_config(), quantize, dtype, layout)
    stored = file_metadata(d)
    assert stored == {s.name: (s.shape, s.dtype) for s in specs}
    config = VoiceChatConfig.from_file(d / "config.json")
    assert quantization_map(config) == qmap
    assert config.quantization == config.quantization_config


def test_config_json_has_the_published_text_config_fields(tmp_path):
    """`use_bias: false` is written and the unbounded `time_step_limit` left out (read back as
    unbounded); a finite limit is written as it is."""
    d = make_checkpoint(tmp_path / "c", "tiny")
    text = json.loads((d / "config.json").read_text())["text_config"]
    assert text["use_bias"] is False and "time_step_limit" not in text
    assert VoiceChatConfig.from_file(d / "config.json").text_config.time_step_limit == (0.0, math.inf)
    limited = tiny_config()
    limited.text_config.time_step_limit = (0.0, 5.0)
    assert published_config_json(limited)["text_config"]["time_step_limit"] == [0.0, 5.0]


def test_tiny_keeps_every_structural_feature():
    c = tiny_config()
    assert set(c.text_config.block_types) == {"mamba", "attention", "mlp"}
    t = c.tts_config
    assert t.global_layers and len(t.global_layers) < t.num_hidden_layers
    assert c.audio_config.decoder.pred_rnn_layers == 2
    assert c.codec_config.downsample_rates == (7, 7, 9) and c.codec_config.hop_length == 4
    assert c.codec_config.n_fft == 16 and c.samples_per_frame == 1764
    assert (c.input_sample_rate, c.output_sample_rate) == (16000, 22050)
    assert c.audio_config.encoder.subsampling_factor == 8
    assert t.mask_schedule == [0, 0, 0, 1, 1, 3, 4, 22]


def test_tiny_widths_are_all_different():
    c = tiny_config()
    widths = [c.text_config.hidden_size, c.text_config.intermediate_size, c.text_config.mamba_inner_size,
              c.text_config.num_attention_heads * c.text_config.head_dim, c.audio_config.encoder.d_model,
              c.audio_config.decoder.pred_hidden, c.audio_config.joint.joint_hidden, c.tts_config.hidden_size,
              c.tts_config.intermediate_size, c.tts_config.character_encoder.intermediate_size,
              c.tts_config.mog_head.intermediate_size, c.tts_config.latent_size, c.tts_config.codebook_size,
              c.codec_config.base_channels, c.audio_config.encoder.subsampling_conv_channels]
    assert len(set(widths)) == len(widths), widths


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    a = make_checkpoint(tmp_path / "a", "tiny", seed=1)
    b = make_checkpoint(tmp_path / "b", "tiny", seed=1)
    c = make_checkpoint(tmp_path / "c", "tiny", seed=2)
    ta, tb, tc = (mx.load(str(d / "model.safetensors")) for d in (a, b, c))
    key = "stt_model.llm.layers.0.mixer.in_proj.weight"
    assert all(mx.array_equal(ta[k], tb[k]) for k in ta)
    assert not mx.array_equal(ta[key], tc[key])


def test_generator_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    with pytest.raises(FileExistsError):
        make_checkpoint(tmp_path / "x", "tiny")


def test_command_writes_a_checkpoint(tmp_path):
    from voicechat.synthetic import main

    assert main([str(tmp_path / "out"), "--quantize", "8", "--shards", "2"]) == 0
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    assert main([str(tmp_path / "out")]) == 2  # not empty now


def test_command_errors_are_one_line_and_leave_nothing(tmp_path, capsys):
    """A place that takes no folder, a count below its least, a file where the folder should be:
    one error line each, nothing written; missing parent folders are made."""
    from voicechat.synthetic import main

    assert main(["/proc/voicechat-ckpt"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: [Errno ") and "cannot write /proc/voicechat-ckpt: " in err and err.count("\n") == 1
    for args in (["--shards", "0"], ["--seed", "-1"]):
        with pytest.raises(SystemExit) as info:
            main([str(tmp_path / "bad"), *args])
        assert info.value.code == 2 and "must be >=" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main([str(tmp_path / "file")]) == 2 and "not an empty directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    # a name the file system refuses (at the final move): the folders made for it are removed too
    assert main([str(tmp_path / "new" / "sub" / ("x" * 300))]) == 1
    assert "name too long" in capsys.readouterr().err.lower()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert main([str(tmp_path / "a" / "b" / "ckpt")]) == 0
    assert (tmp_path / "a" / "b" / "ckpt" / "config.json").exists()
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["ckpt"]  # no scratch folder left
