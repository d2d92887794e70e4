"""The whole checkpoint loads into the model tree strictly, tensor for tensor, in every variant."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from voicechat.checkpoint import open_checkpoint, to_mlx_layout
from voicechat.model import VoiceChatModel
from voicechat.synthetic import make_checkpoint

VARIANTS = {
    "float32-torch": dict(dtype="float32"),
    "bfloat16-torch": dict(dtype="bfloat16"),
    "q4-torch": dict(quantize=4, dtype="bfloat16"),
    "q8-mlx": dict(quantize=8, dtype="bfloat16", layout="mlx"),
    "sharded-q4": dict(quantize=4, dtype="float32", shards=3),
}


def _loaded(directory):
    ckpt = open_checkpoint(directory)
    model = VoiceChatModel(ckpt.config)
    ckpt.load_into(model, "")
    return ckpt, model


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_tensor_loads_back_bit_identical(tmp_path, name):
    ckpt, model = _loaded(make_checkpoint(tmp_path / name, "tiny", seed=5, **VARIANTS[name]))
    params = dict(tree_flatten(model.parameters()))
    stored = to_mlx_layout(ckpt.tensors, model)  # the one conversion the loader applies
    assert params.keys() == stored.keys()
    for key, value in params.items():
        want = stored[key]
        assert value.dtype == want.dtype, key
        assert value.shape == want.shape, key
        assert np.array_equal(np.array(value.astype(mx.float32) if value.dtype == mx.bfloat16 else value),
                              np.array(want.astype(mx.float32) if want.dtype == mx.bfloat16 else want)), key
    quantized = {k[: -len(".scales")] for k in params if k.endswith(".scales")}
    assert quantized == set(ckpt.quantization)
    assert bool(quantized) == ("quantize" in VARIANTS[name])


def test_torch_and_mlx_layouts_load_to_the_same_weights(tmp_path):
    _, torch_model = _loaded(make_checkpoint(tmp_path / "t", "tiny", seed=2, layout="torch"))
    _, mlx_model = _loaded(make_checkpoint(tmp_path / "m", "tiny", seed=2, layout="mlx"))
    a, b = dict(tree_flatten(torch_model.parameters())), dict(tree_flatten(mlx_model.parameters()))
    assert a.keys() == b.keys()
    for key in a:  # the LSTM's two torch biases and the mlx file's one sum agree exactly too
        assert np.array_equal(np.array(a[key]), np.array(b[key])), key


def test_converting_twice_changes_nothing(tiny_checkpoint):
    ckpt, model = _loaded(tiny_checkpoint)
    once = to_mlx_layout(ckpt.tensors, model)
    twice = to_mlx_layout(once, model)
    assert once.keys() == twice.keys()
    assert all(np.array_equal(np.array(once[k]), np.array(twice[k])) for k in once)
    assert any(ckpt.tensors[k].shape != once[k].shape for k in once if k in ckpt.tensors)  # something was converted


def _allocated(arrays) -> int:
    """The active memory that fresh copies of `arrays` take: what they hold in this backend's
    allocator (MLX-CUDA rounds a buffer up to a power of two below 16 KB and to 16 KB pages above,
    ~1.8 MB over the tiny checkpoint's nbytes there; the CPU's ~1%)."""
    before = mx.get_active_memory()
    copies = [mx.multiply(a, 1) for a in arrays]
    mx.eval(copies)
    return mx.get_active_memory() - before


@pytest.mark.parametrize("fixture", ["tiny_checkpoint", "tiny_checkpoint_q4"])
def test_a_loaded_chat_holds_no_tensor_twice(request, fixture):
    """voicechat.load drops the checkpoint's tensors once the model holds what it uses: a tensor
    the model replaced by a converted copy (a cast, a stacked projection) would stay in memory
    twice (before: 28% over the model's arrays on the tiny checkpoint, 35% on the 4-bit one). What
    a load adds is the model's parameters and the TTS conditioning table, to a few percent (the
    bound leaves room for what else this test process allocates meanwhile). Sizes are the
    allocator's, with its cache emptied first: a cached buffer it hands out again may be up to
    twice the size asked for."""
    import gc

    import voicechat
    from voicechat.checkpoint import CheckpointError

    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    chat = voicechat.load(request.getfixturevalue(fixture))
    gc.collect()
    added = mx.get_active_memory() - before
    held = _allocated([v for _, v in tree_flatten(chat.model.parameters())] + [chat.ear_tts.char_table()])
    assert chat.checkpoint.released and not chat.checkpoint.tensors and chat.checkpoint.nbytes > 0
    assert added <= 1.15 * held, (added, held)
    with pytest.raises(CheckpointError, match="released"):
        chat.checkpoint.load_into(VoiceChatModel(chat.config), "")
