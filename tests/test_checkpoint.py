"""Finding and reading checkpoints, quantization maps, layout conversion and strict loading."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from voicechat.checkpoint import (CheckpointError, load_weights, open_checkpoint, quantization_map,
                                  read_grouped, read_tensors, resolve, safetensors_files, to_mlx_layout)
from voicechat.config import ConfigError, VoiceChatConfig
from voicechat.synthetic import make_checkpoint


def test_sharded_equals_single_file(tmp_path):
    one = make_checkpoint(tmp_path / "one", "tiny", quantize=4, seed=3)
    three = make_checkpoint(tmp_path / "three", "tiny", quantize=4, seed=3, shards=3)
    files = safetensors_files(three)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    a, b = read_tensors(safetensors_files(one)), read_tensors(files)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]), k


@pytest.mark.parametrize("readers", [2, 3, 8])
def test_reader_groups_split_every_tensor_once_balanced_by_size(tmp_path, readers):
    three = make_checkpoint(tmp_path / "three", "tiny", quantize=4, seed=3, shards=3)
    tensors, groups = read_grouped(safetensors_files(three), readers)
    assert len(groups) == readers
    names = [k for g in groups for k in g]
    assert sorted(names) == sorted(tensors) == sorted(read_tensors(safetensors_files(three)))
    # largest first to the lightest group: no group is heavier than another by more than a tensor
    totals = [sum(tensors[k].nbytes for k in g) for g in groups]
    largest = max(a.nbytes for a in tensors.values())
    assert max(totals) - min(totals) <= largest


@pytest.mark.parametrize("quantize", [None, 4])
def test_a_checkpoint_read_on_several_threads_loads_the_same_model(tmp_path, quantize):
    """`Checkpoint.read()` reads each reader group on a thread and stream of its own: the model
    that `load` builds from it holds the tensors a single reader gives, bit for bit."""
    from mlx.utils import tree_flatten

    import voicechat

    path = make_checkpoint(tmp_path / "c", "tiny", quantize=quantize, seed=5, shards=2)
    one = voicechat.load(open_checkpoint(path, readers=1))
    four = open_checkpoint(path, readers=4)
    assert sum(1 for g in four.groups if g) == 4
    many = voicechat.load(four)
    a, b = dict(tree_flatten(one.model.parameters())), dict(tree_flatten(many.model.parameters()))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]).item(), k
    one.close()
    many.close()


def test_loads_on_several_threads_at_once_share_the_reader_streams_safely(tmp_path):
    """Three `load`s at once (a process's reader streams are shared: one read at a time) each get
    the checkpoint's tensors."""
    from concurrent.futures import ThreadPoolExecutor

    from mlx.utils import tree_flatten

    import voicechat

    path = make_checkpoint(tmp_path / "c", "tiny", quantize=4, seed=6, shards=2)
    stored = read_tensors(safetensors_files(path))
    with ThreadPoolExecutor(3) as pool:
        chats = list(pool.map(lambda _: voicechat.load(open_checkpoint(path, readers=3)), range(3)))
    key = "stt_model.llm.layers.0.mixer.in_proj.weight"
    for chat in chats:
        params = dict(tree_flatten(chat.model.parameters()))
        assert mx.array_equal(params[key], stored[key]).item()
        assert mx.array_equal(params["tts_model.audio_codec.prvq.mus_list.0"],
                              stored["tts_model.audio_codec.prvq.mus_list.0"]).item()
        chat.close()


def test_tensors_are_read_lazily(tiny_checkpoint):
    mx.eval(mx.zeros((1,)))
    before = mx.get_active_memory()
    tensors = open_checkpoint(tiny_checkpoint).tensors
    assert len(tensors) > 100
    assert mx.get_active_memory() - before < 1 << 16  # nothing materialized yet


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dtype_is_kept_as_stored(tmp_path, dtype):
    ckpt = open_checkpoint(make_checkpoint(tmp_path / "c", "tiny", dtype=dtype))
    assert ckpt.tensors["tts_model.tts_model.rvq_embs"].dtype == getattr(mx, dtype)
    assert ckpt.tensors["stt_model.llm.layers.0.mixer.A_log"].dtype == mx.float32
    assert ckpt.tensors["tts_model.codec_silence_tokens"].dtype == mx.int32


def test_missing_directory_file_and_shard_errors(tmp_path, tiny_checkpoint):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        resolve(tmp_path / "nope")
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        resolve(tmp_path / "f.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        safetensors_files(empty)
    sharded = make_checkpoint(tmp_path / "s", "tiny", shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing shard.*model-00002-of-00002"):
        open_checkpoint(sharded)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        open_checkpoint(broken)


def test_wrong_model_type_and_speaker(tmp_path, tiny_checkpoint):
    for field, value in (("model_type", "llama"), ("speaker", "Zed")):
        d = tmp_path / field
        shutil.copytree(tiny_checkpoint, d)
        data = json.loads((d / "config.json").read_text())
        data[field] = value
        (d / "config.json").write_text(json.dumps(data))
        with pytest.raises(ConfigError, match=field):
            open_checkpoint(d)


def test_offline_hub_id_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache|cannot be reached|could not download"):
        resolve("nobody-here/NoSuchModel-xyz")


def test_quantization_map_rules():
    c = VoiceChatConfig()
    c.quantization = {"group_size": 64, "bits": 4, "stt_model.lm_head": {"group_size": 64, "bits": 8},
                      "stt_model.llm.layers.3.mixer.in_proj": True, "stt_model.function_head": False}
    assert quantization_map(c) == {"stt_model.lm_head": {"group_size": 64, "bits": 8},
                                   "stt_model.llm.layers.3.mixer.in_proj": {"group_size": 64, "bits": 4}}
    c.quantization = {"group_size": 64, "bits": 4, "tts_model.tts_model.embed_code": True}
    with pytest.raises(ConfigError, match="never quantized"):
        quantization_map(c)
    c.quantization = {"stt_model.lm_head": {"group_size": 64, "bits": 3}}
    with pytest.raises(ConfigError, match="unsupported bits"):
        quantization_map(c)


class _Tiny(nn.Module):
    """A small module tree with every layout the loader converts."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 5, kernel_size=4, bias=False)
        self.up = nn.ConvTranspose1d(5, 2, kernel_size=7, stride=7, bias=False)
        self.conv2 = nn.Conv2d(1, 6, kernel_size=3)
        self.lstm = [nn.LSTM(4, 8), nn.LSTM(8, 8)]
        self.proj = nn.Linear(64, 9, bias=False)


def _torch_tensors(rng):
    t = {
        "conv.weight": rng.standard_normal((5, 3, 4)),
        "up.weight": rng.standard_normal((5, 2, 7)),
        "conv2.weight": rng.standard_normal((6, 1, 3, 3)),
        "conv2.bias": rng.standard_normal((6,)),
        "proj.weight": rng.standard_normal((9, 64)),
    }
    for n, width in ((0, 4), (1, 8)):
        t[f"lstm.weight_ih_l{n}"] = rng.standard_normal((32, width))
        t[f"lstm.weight_hh_l{n}"] = rng.standard_normal((32, 8))
        t[f"lstm.bias_ih_l{n}"] = rng.standard_normal((32,))
        t[f"lstm.bias_hh_l{n}"] = rng.standard_normal((32,))
    return {k: mx.array(v.astype(np.float32)) for k, v in t.items()}


def test_torch_layout_is_converted_once():
    torch = _torch_tensors(np.random.default_rng(0))
    m = _Tiny()
    converted = to_mlx_layout(torch, m)
    assert converted["conv.weight"].shape == (5, 4, 3)
    assert converted["up.weight"].shape == (2, 7, 5)
    assert converted["conv2.weight"].shape == (6, 3, 3, 1)
    assert mx.array_equal(converted["conv.weight"], torch["conv.weight"].transpose(0, 2, 1))
    assert mx.array_equal(converted["up.weight"], torch["up.weight"].transpose(1, 2, 0))
    assert mx.allclose(converted["lstm.1.bias"], torch["lstm.bias_ih_l1"] + torch["lstm.bias_hh_l1"])
    assert mx.array_equal(converted["lstm.0.Wx"], torch["lstm.weight_ih_l0"])
    again = to_mlx_layout(converted, m)  # idempotent: already-converted tensors stay as they are
    assert again.keys() == converted.keys()
    assert all(mx.array_equal(again[k], converted[k]) for k in again)
    load_weights(m, converted)
    assert mx.array_equal(m.up.weight, converted["up.weight"])


def test_every_problem_is_reported_at_once():
    t = to_mlx_layout(_torch_tensors(np.random.default_rng(1)), _Tiny())
    del t["conv2.bias"]
    t["proj.weight"] = mx.zeros((9, 65))
    t["stray.weight"] = mx.zeros((1,))
    with pytest.raises(CheckpointError) as e:
        load_weights(_Tiny(), t, prefix="net.")
    msg = str(e.value)
    assert "3 problems" in msg
    assert "missing tensor net.conv2.bias" in msg
    assert "unexpected tensor net.stray.weight" in msg
    assert "net.proj.weight has shape (9, 65), expected (9, 64)" in msg


def test_quantized_module_from_dense_tensors_and_the_reverse(tiny_checkpoint, tiny_checkpoint_q4):
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(192, 384, bias=False)

    dense, quant = open_checkpoint(tiny_checkpoint), open_checkpoint(tiny_checkpoint_q4)
    h = Head()
    quant.load_into(h, "stt_model.", ignore=("embed_tokens", "function_head", "llm", "perception", "rnnt"))
    assert isinstance(h.lm_head, nn.QuantizedLinear)
    # dense file, but config.json says quantized
    dense.config.quantization = quant.config.quantization
    with pytest.raises(CheckpointError, match="stt_model.lm_head is quantized in config.json but the checkpoint stores it dense"):
        dense.load_into(Head(), "stt_model.", ignore=("embed_tokens", "function_head", "llm", "perception", "rnnt"))
    # quantized file, but config.json lists nothing
    quant.config.quantization = quant.config.quantization_config = None
    with pytest.raises(CheckpointError, match="stt_model.lm_head.scales is stored"):
        quant.load_into(Head(), "stt_model.", ignore=("embed_tokens", "function_head", "llm", "perception", "rnnt"))


def _copy_with_config(tmp_path, src, name, edit):
    d = tmp_path / name
    shutil.copytree(src, d)
    data = json.loads((d / "config.json").read_text())
    edit(data)
    (d / "config.json").write_text(json.dumps(data))
    return d


@pytest.mark.parametrize("field,value,needle", [
    ("audio_config.encoder.n_layers", 300, "audio_config.encoder.n_layers is 300 but the weights have 2 (layers 0..1)"),
    ("text_config.num_hidden_layers", 6, "text_config.num_hidden_layers is 6 but the weights have 5"),
    ("tts_config.mog_head.num_layers", 4, "tts_config.mog_head.num_layers is 4 but the weights have 3"),
    ("audio_config.decoder.pred_rnn_layers", 3, "audio_config.decoder.pred_rnn_layers is 3 but the weights have 2"),
])
def test_layer_counts_are_checked_against_the_weights_before_anything_is_built(tmp_path, tiny_checkpoint, field,
                                                                              value, needle):
    """open_checkpoint builds nothing: a count the weights do not have is refused there, with the
    field and the count the tensor names show."""
    def edit(data):
        node = data
        *parents, last = field.split(".")
        for key in parents:
            node = node[key]
        node[last] = value
        if field == "text_config.num_hidden_layers":
            node["hybrid_override_pattern"] += "-"

    d = _copy_with_config(tmp_path, tiny_checkpoint, "c", edit)
    with pytest.raises(CheckpointError, match=f"{d}: config.json does not match the weights") as info:
        open_checkpoint(d)
    assert needle in str(info.value)


def test_widths_are_checked_against_the_weights(tmp_path, tiny_checkpoint):
    def edit(data):
        data["text_config"]["vocab_size"] = 512
        data["tts_config"]["codebook_size"] = data["codec_config"]["codebook_size"] = 60

    d = _copy_with_config(tmp_path, tiny_checkpoint, "c", edit)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(d)
    msg = str(info.value)
    assert "text_config.vocab_size is 512 but tensor stt_model.embed_tokens.weight has 384 on axis 0" in msg
    assert "tts_config.codebook_size is 60 but tensor tts_model.tts_model.rvq_embs has 52 on axis 1" in msg


def test_the_published_layouts_pass_the_size_check():
    """Every tensor of the full-size and tiny configs, dense and quantized, in both layouts (the
    inventory's shapes, nothing made): the size check finds nothing to say."""
    from voicechat.checkpoint import check_sizes
    from voicechat.synthetic import full_config, inventory, tiny_config

    class Header:  # what check_sizes reads of a lazily loaded tensor
        def __init__(self, shape):
            self.shape, self.ndim = shape, len(shape)

    for config in (full_config(), tiny_config()):
        for quantize in (None, 4):
            for layout in ("torch", "mlx"):
                specs, _ = inventory(config, quantize=quantize, layout=layout)
                check_sizes(config, {s.name: Header(s.shape) for s in specs})


@pytest.mark.parametrize("name,dtype,expected", [
    ("stt_model.perception.proj.weight", "int32", "a float (float16, bfloat16 or float32)"),
    ("tts_model.tts_model.backbone.norm.weight", "uint8", "a float (float16, bfloat16 or float32)"),
    ("tts_model.tts_model.null_emb", "bool", "a float (float16, bfloat16 or float32)"),
    ("stt_model.embed_tokens.weight", "int32", "a float (float16, bfloat16 or float32)"),
    ("tts_model.codec_silence_tokens", "float32", "an integer type (an index buffer)"),
    ("tts_model._control_codes", "float16", "an integer type (an index buffer)"),
    ("stt_model.rnnt_decoder.prediction.dec_rnn.lstm.bias_hh_l1", "int32", "a float"),
])
def test_a_tensor_stored_in_a_dtype_the_model_cannot_use_is_named(tmp_path, tiny_checkpoint, name, dtype, expected):
    from voicechat.model import VoiceChatModel

    d = tmp_path / "c"
    shutil.copytree(tiny_checkpoint, d)
    tensors = mx.load(str(d / "model.safetensors"))
    tensors[name] = tensors[name].astype(mx.bool_ if dtype == "bool" else getattr(mx, dtype))
    mx.save_safetensors(str(d / "model.safetensors"), tensors)
    ckpt = open_checkpoint(d)
    with pytest.raises(CheckpointError) as info:
        ckpt.load_into(VoiceChatModel(ckpt.config), "")
    msg = str(info.value)
    shown = name.replace("._control_codes", ".control_codes")  # (the loader's name for the torch buffer)
    assert f"tensor {shown} is {dtype}, expected {expected}" in msg, msg


def test_a_quantized_checkpoint_s_dtypes_are_accepted(tiny_checkpoint_q4):
    from voicechat.model import VoiceChatModel

    ckpt = open_checkpoint(tiny_checkpoint_q4)
    ckpt.load_into(VoiceChatModel(ckpt.config), "")


def test_index_and_shard_names_are_checked(tmp_path):
    d = make_checkpoint(tmp_path / "s", "tiny", shards=2)
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    for weight_map, needle in (({first: "../elsewhere.safetensors"}, "is not a file name"),
                               ([1, 2], "weight_map is not an object")):
        index.write_text(json.dumps({**data, "weight_map": weight_map}))
        with pytest.raises(CheckpointError, match=needle):
            safetensors_files(d)
    index.write_bytes(b'{"weight_map": {"\xff": 1}}')
    with pytest.raises(CheckpointError, match=f"{index}: not a safetensors index"):
        safetensors_files(d)


def test_quantization_values_of_the_wrong_type_are_config_errors():
    c = VoiceChatConfig()
    for q, needle in (({"group_size": "x"}, "quantization.group_size: expected an integer"),
                      ({"bits": None}, "quantization.bits: expected an integer"),
                      ({"stt_model.lm_head": {"bits": "4"}}, "quantization.stt_model.lm_head.bits")):
        c.quantization = q
        with pytest.raises(ConfigError, match=needle):
            quantization_map(c)
