"""Find a checkpoint, read its safetensors lazily, and load it into modules strictly.

A checkpoint is a directory (or a hub id resolved with huggingface_hub) holding `config.json`,
`model.safetensors` or `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`,
`tokenizer.json` and optionally `rnnt_tokenizer/vocab.json`.

Published checkpoints store tensors in the PyTorch layout (Conv1d `[out, in, k]`, Conv2d
`[out, in, kh, kw]`, ConvTranspose1d `[in, out, k]`, LSTM `weight_ih_l{n}` ...). They are
converted to MLX's layout once, at load, gated on shape: a tensor that already has the MLX shape
is left alone, so MLX-layout files load too and a second conversion is a no-op.
"""

from __future__ import annotations

import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .config import ConfigError, VoiceChatConfig

# Modules the published checkpoints quantize; nothing else may be (the speech encoder, RNNT, TTS
# and codec stay dense).
QUANTIZABLE = re.compile(
    r"^stt_model\.(embed_tokens|lm_head|function_head"
    r"|llm\.layers\.\d+\.mixer\.(in_proj|out_proj|q_proj|k_proj|v_proj|o_proj|up_proj|down_proj))$"
)
_QUANT_PARTS = (".scales", ".biases")
# The dtypes a float tensor may be stored in (what the kernels take); integer buffers may be any
# integer type; a quantized weight is packed uint32.
FLOATING = (mx.float16, mx.bfloat16, mx.float32)
_FLOATING_NAMES = "a float (float16, bfloat16 or float32)"
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


# --------------------------------------------------------------------------- finding files

def resolve(path_or_id: str | os.PathLike) -> Path:
    """A local directory as is; otherwise a hub id, downloaded (or taken from the cache)."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    text = str(path_or_id)
    if path.exists():
        raise CheckpointError(f"{text}: is a file; a checkpoint is a directory with config.json")
    if not _HUB_ID.match(text) or text.startswith((".", "/", "~")):
        raise CheckpointError(f"{text}: no such checkpoint directory")
    return _download(text)


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        raise CheckpointError(f"{repo_id}: not a local directory, and huggingface_hub is not installed")
    patterns = ["*.json", "*.safetensors", "rnnt_tokenizer/*", "*.txt", "*.model"]
    try:  # the cache first: no network needed once downloaded
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except RepositoryNotFoundError:
        raise CheckpointError(f"{repo_id}: no such model on the Hugging Face hub (and no such directory)") from None
    except LocalEntryNotFoundError:
        raise CheckpointError(
            f"{repo_id}: not in the local Hugging Face cache and the hub cannot be reached "
            "(offline?); download it once with network access or pass a local directory") from None
    except Exception as e:  # network errors come in many types
        raise CheckpointError(
            f"{repo_id}: could not download from the Hugging Face hub ({type(e).__name__}: {e}); "
            "pass a local directory or retry with network access") from None


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a checkpoint: the index's shards, or the single model.safetensors."""
    index = directory / _SAFETENSORS_INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError, OSError) as e:  # (UnicodeDecodeError is one)
            raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map is not an object of tensor -> file names")
        bad = [f for f in weight_map.values() if Path(f).name != f or f in (".", "..")]
        if bad:  # a shard is a file beside the index, never a path elsewhere
            raise CheckpointError(f"{index}: shard {bad[0]!r} is not a file name in {directory}")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (directory / f).exists()]
        if missing:
            raise CheckpointError(f"{directory}: missing shard(s) named in {_SAFETENSORS_INDEX}: {', '.join(missing)}")
        return [directory / f for f in files]
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    shards = sorted(directory.glob("model-*-of-*.safetensors"))
    if shards:
        raise CheckpointError(f"{directory}: sharded weights without {_SAFETENSORS_INDEX}")
    raise CheckpointError(f"{directory}: no model.safetensors (or sharded model-*.safetensors + index)")


def read_tensors(files: Iterable[Path]) -> dict[str, mx.array]:
    """All tensors of the files, lazily: nothing is read from disk until a tensor is evaluated."""
    return read_grouped(files, 1)[0]


def read_grouped(files: Iterable[Path], readers: int) -> tuple[dict[str, mx.array], list[list[str]]]:
    """`read_tensors`, with the tensors split, balanced by size (largest first to the group with
    the fewest bytes so far), into `readers` groups, each group's loads on a stream of its own
    that any thread may use (`reader_streams`): `(tensors, names of each group)`, for `read_all`."""
    streams = reader_streams(readers) if readers > 1 else [None]
    loaded: list[list[dict[str, mx.array]]] = []  # per file, the file loaded on each stream
    seen: set[str] = set()
    for f in files:
        try:
            str(f).encode("utf-8")
        except UnicodeEncodeError:  # MLX takes only UTF-8 paths
            raise CheckpointError(f"{f}: MLX cannot open a path that is not UTF-8; rename it") from None
        try:
            # (a load parses the header only: the file loaded on each stream costs no reading)
            parts = [mx.load(str(f)) if s is None else mx.load(str(f), stream=s) for s in streams]
        except Exception as e:
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
        dup = seen & parts[0].keys()
        if dup:
            raise CheckpointError(f"{f}: tensor {sorted(dup)[0]} is also in another shard")
        seen |= parts[0].keys()
        loaded.append(parts)
    sizes = sorted(((parts[0][k].nbytes, k, i) for i, parts in enumerate(loaded) for k in parts[0]),
                   key=lambda t: (-t[0], t[1]))
    tensors: dict[str, mx.array] = {}
    groups: list[list[str]] = [[] for _ in streams]
    totals = [0] * len(streams)
    for nbytes, name, i in sizes:
        g = totals.index(min(totals))
        tensors[name] = loaded[i][g][name]
        groups[g].append(name)
        totals[g] += nbytes
    return tensors, groups


_READER_STREAMS: dict[str, list[mx.Stream]] = {}  # per device, made as asked for, then kept
_STREAMS_LOCK = threading.Lock()
_READING = threading.Lock()  # one `read_all` at a time: its streams are the process's


def reader_streams(count: int) -> list[mx.Stream]:
    """`count` streams on the default device that any thread may use: the process's first `count`
    (MLX never frees a stream, so every reading shares them)."""
    device = mx.default_device()
    with _STREAMS_LOCK:
        streams = _READER_STREAMS.setdefault(str(device), [])
        while len(streams) < count:
            streams.append(mx.new_thread_unsafe_stream(device))
        return streams[:count]


def default_readers() -> int:
    """Threads that read a checkpoint. On a CUDA GPU a load is a read into host memory and then a
    copy to the device, one after another on a thread, so threads overlap them: 8 read ~5 GB/s
    where one reads ~1.7 GB/s. A CPU gains nothing from more threads than it has cores."""
    return max(1, min(8, os.cpu_count() or 1))


def read_all(tensors: dict[str, mx.array], groups: list[list[str]]) -> None:
    """Read the tensors of every group on a thread of its own (`read_grouped`'s groups: each
    group's loads are on its own stream). The reader streams are shared by the process, so one
    read runs at a time."""
    groups = [g for g in groups if g]
    if len(groups) <= 1:
        mx.eval([tensors[k] for g in groups for k in g])
        return
    from .tts_thread import release_mlx_state_at_thread_exit

    def read(names: list[str]) -> None:
        release_mlx_state_at_thread_exit()
        mx.eval([tensors[k] for k in names])

    with _READING, ThreadPoolExecutor(max_workers=len(groups)) as pool:
        for job in [pool.submit(read, g) for g in groups]:
            job.result()


# --------------------------------------------------------------------------- quantization

def quantization_map(config: VoiceChatConfig) -> dict[str, dict[str, int]]:
    """Module path -> {group_size, bits} for the modules config.json says are quantized."""
    q = config.quantization or config.quantization_config
    if not q:
        return {}
    def whole(value, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config.json: {where}: expected an integer, got {value!r}")
        return value

    default = {"group_size": whole(q.get("group_size", 64), "quantization.group_size"),
               "bits": whole(q.get("bits", 4), "quantization.bits")}
    out: dict[str, dict[str, int]] = {}
    for key, value in q.items():
        if key in ("group_size", "bits", "mode", "quant_method"):
            continue
        if value is False:
            continue
        params = dict(default)
        if isinstance(value, dict):
            params.update({k: whole(v, f"quantization.{key}.{k}") for k, v in value.items()
                           if k in ("group_size", "bits")})
        elif value is not True:
            raise ConfigError(f"config.json: quantization.{key}: expected an object or a boolean, got {value!r}")
        if not QUANTIZABLE.match(key):
            raise ConfigError(f"config.json: quantization.{key}: this module is never quantized "
                              "(only embed_tokens, the two heads and the Nemotron-H mixer projections are)")
        if params["bits"] not in (4, 8) or params["group_size"] not in (32, 64, 128):
            raise ConfigError(f"config.json: quantization.{key}: unsupported bits={params['bits']} "
                              f"group_size={params['group_size']} (bits 4 or 8, group 32/64/128)")
        out[key] = params
    return out


def quantize_modules(module: nn.Module, qmap: dict[str, dict[str, int]], prefix: str = "") -> None:
    """Swap in quantized layers for the map's modules under `prefix` (before loading weights)."""
    def predicate(path: str, m: nn.Module):
        return qmap.get(prefix + path, False)

    nn.quantize(module, class_predicate=predicate)


# --------------------------------------------------------------------------- layout conversion

def _rename_torch_keys(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """Torch-only key names to ours: LSTM gates, and buffers whose names start with '_'."""
    out: dict[str, mx.array] = {}
    lstm_bias: dict[str, dict[str, mx.array]] = {}
    for key, value in tensors.items():
        m = re.match(r"^(.*)\.(weight_ih|weight_hh|bias_ih|bias_hh)_l(\d+)$", key)
        if m:
            base, kind, n = m.groups()
            if kind == "weight_ih":
                out[f"{base}.{n}.Wx"] = value
            elif kind == "weight_hh":
                out[f"{base}.{n}.Wh"] = value
            else:
                lstm_bias.setdefault(f"{base}.{n}.bias", {})[kind] = value
            continue
        key = key.replace("._variance_list.", ".variance_list.")
        key = re.sub(r"(^|\.)_control_codes$", r"\1control_codes", key)
        out[key] = value
    for key, parts in lstm_bias.items():
        if set(parts) != {"bias_ih", "bias_hh"}:
            missing = "bias_hh" if "bias_ih" in parts else "bias_ih"
            raise CheckpointError(f"{key}: torch LSTM bias is missing its {missing} half")
        for kind, part in parts.items():  # (the sum below would turn integers into floats unseen)
            if part.dtype not in FLOATING:
                raise CheckpointError(f"tensor {key.rsplit('.', 2)[0]}.{kind}_l{key.rsplit('.', 2)[1]} is "
                                      f"{_dtype_name(part.dtype)}, expected {_FLOATING_NAMES}")
        # One bias for both products; summed in float32 so no rounding is added.
        out[key] = parts["bias_ih"].astype(mx.float32) + parts["bias_hh"].astype(mx.float32)
    return out


def _layout_rules(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Parameter path -> permutation that takes the torch layout to MLX's, for conv kernels."""
    rules: dict[str, tuple[int, ...]] = {}
    for path, m in module.named_modules():
        join = (lambda name: f"{path}.{name}") if path else (lambda name: name)
        if isinstance(m, nn.ConvTranspose1d):
            rules[join("weight")] = (1, 2, 0)  # [in, out, k] -> [out, k, in]
        elif isinstance(m, nn.Conv1d):
            rules[join("weight")] = (0, 2, 1)  # [out, in, k] -> [out, k, in]
        elif isinstance(m, nn.Conv2d):
            rules[join("weight")] = (0, 2, 3, 1)  # [out, in, kh, kw] -> [out, kh, kw, in]
        # Raw kernels held outside nn.Conv* declare theirs: `TORCH_LAYOUT = {name: permutation}`.
        for name, perm in getattr(type(m), "TORCH_LAYOUT", {}).items():
            rules[join(name)] = tuple(perm)
    return rules


def to_mlx_layout(tensors: dict[str, mx.array], module: nn.Module) -> dict[str, mx.array]:
    """Rename torch-only keys and transpose torch-layout kernels whose shape says so."""
    tensors = _rename_torch_keys(tensors)
    expected = dict(tree_flatten(module.parameters()))
    rules = _layout_rules(module)
    out = {}
    for key, value in tensors.items():
        perm = rules.get(key)
        want = expected.get(key)
        if perm is not None and want is not None and value.shape != want.shape and value.ndim == len(perm):
            moved = tuple(value.shape[p] for p in perm)
            if moved == tuple(want.shape):
                value = mx.transpose(value, perm)
        out[key] = value
    return out


# --------------------------------------------------------------------------- strict loading

def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _dtype_problem(want: mx.Dtype, got: mx.Dtype) -> str | None:
    """None when a tensor stored as `got` can stand where the model holds `want`, else what it
    must be: packed uint32 for a quantized weight (its scales and biases are floats), an integer
    type for an integer buffer, a float everywhere else."""
    if want == mx.uint32:
        return None if got == mx.uint32 else "packed uint32 (a quantized weight)"
    if mx.issubdtype(want, mx.integer):
        return None if mx.issubdtype(got, mx.integer) else "an integer type (an index buffer)"
    return None if got in FLOATING else _FLOATING_NAMES


def check_weights(module: nn.Module, tensors: dict[str, mx.array], prefix: str = "") -> None:
    """Every missing, unexpected or misshapen tensor, reported all at once (keys with prefix)."""
    expected = dict(tree_flatten(module.parameters()))
    problems: list[str] = []
    for key in sorted(expected.keys() - tensors.keys()):
        problems.append(f"missing tensor {prefix}{key} {tuple(expected[key].shape)}")
    for key in sorted(tensors.keys() - expected.keys()):
        problems.append(f"unexpected tensor {prefix}{key} {tuple(tensors[key].shape)}")
    for key in sorted(expected.keys() & tensors.keys()):
        want, got = expected[key], tensors[key]
        if tuple(want.shape) != tuple(got.shape):
            problems.append(f"tensor {prefix}{key} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        elif (why := _dtype_problem(want.dtype, got.dtype)) is not None:
            problems.append(f"tensor {prefix}{key} is {_dtype_name(got.dtype)}, expected {why}")
    if problems:
        head = f"checkpoint does not match the model ({len(problems)} problem{'s' * (len(problems) > 1)}): "
        raise CheckpointError(head + "; ".join(problems))


def _check_quantization(module: nn.Module, tensors: dict[str, mx.array], prefix: str) -> None:
    """A module's `.scales` in the file must agree with its being quantized in the model."""
    modules = dict(module.named_modules())
    quantized = {path for path, m in modules.items() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    # Scales of modules the model does not have are reported as unexpected tensors later.
    stored = {k[: -len(".scales")] for k in tensors if k.endswith(".scales")} & modules.keys()
    problems = []
    for path in sorted(stored - quantized):
        problems.append(f"{prefix}{path}.scales is stored (a quantized module) but config.json's "
                        "quantization map does not list it")
    for path in sorted(quantized - stored):
        problems.append(f"{prefix}{path} is quantized in config.json but the checkpoint stores it "
                        f"dense (no {prefix}{path}.scales)")
    if problems:
        raise CheckpointError("quantization mismatch: " + "; ".join(problems))


def load_weights(module: nn.Module, tensors: dict[str, mx.array], prefix: str = "") -> None:
    """Load `tensors` (keys relative to `module`) strictly, converting torch layouts once.

    `prefix` is only used to name keys in errors. Quantized modules must already be swapped in
    (`quantize_modules`). Tensors keep their stored dtype.
    """
    _check_quantization(module, tensors, prefix)
    tensors = to_mlx_layout(tensors, module)
    check_weights(module, tensors, prefix)
    module.update(tree_unflatten(list(tensors.items())))


def subtree(tensors: dict[str, mx.array], prefix: str) -> dict[str, mx.array]:
    """The tensors under `prefix` ("a.b."), with the prefix removed."""
    n = len(prefix)
    return {k[n:]: v for k, v in tensors.items() if k.startswith(prefix)}


# --------------------------------------------------------------------------- sizes before building

# config.json's layer counts, each against the stored tensors' layer indices.
_LAYER_STACKS = (
    ("text_config.num_hidden_layers", r"stt_model\.llm\.layers\.(\d+)\."),
    ("audio_config.encoder.n_layers", r"stt_model\.perception\.encoder\.layers\.(\d+)\."),
    ("audio_config.decoder.pred_rnn_layers",
     r"stt_model\.rnnt_decoder\.prediction\.dec_rnn\.lstm\.(?:weight_ih_l(\d+)$|(\d+)\.Wx$)"),
    ("tts_config.num_hidden_layers", r"tts_model\.tts_model\.backbone\.layers\.(\d+)\."),
    ("tts_config.character_encoder.num_hidden_layers",
     r"tts_model\.tts_model\.embed_subword\.backbone\.encoder\.layers\.(\d+)\."),
    ("tts_config.mog_head.num_layers", r"tts_model\.tts_model\.mog_head\.mlp_stack\.(\d+)\.mlp\."),
    ("codec_config.num_quantizers", r"tts_model\.audio_codec\.prvq\.mus_list\.(\d+)$"),
)


def _widths(config: VoiceChatConfig) -> list[tuple[str, int, str, int, int]]:
    """(field, its value, tensor, axis, offset): the tensor's size on that axis must be the value
    plus the offset. Rows and 1-D tensors only, which quantization and the torch layout leave as
    they are."""
    t, a, tts, codec = config.text_config, config.audio_config, config.tts_config, config.codec_config
    llm, enc = "stt_model.llm", "stt_model.perception.encoder"
    return [
        ("text_config.hidden_size", t.hidden_size, f"{llm}.norm_f.weight", 0, 0),
        ("text_config.vocab_size", t.vocab_size, "stt_model.embed_tokens.weight", 0, 0),
        ("text_config.vocab_size", t.vocab_size, "stt_model.lm_head.weight", 0, 0),
        ("audio_config.preprocessor.features", a.preprocessor.features,
         "stt_model.perception.preprocessor.featurizer.fb", 1, 0),
        ("audio_config.preprocessor.n_fft", a.preprocessor.n_fft // 2,
         "stt_model.perception.preprocessor.featurizer.fb", 2, 1),
        ("audio_config.encoder.d_model", a.encoder.d_model, f"{enc}.layers.0.norm_out.weight", 0, 0),
        ("audio_config.encoder.subsampling_conv_channels", a.encoder.subsampling_conv_channels,
         f"{enc}.pre_encode.conv.0.weight", 0, 0),
        ("audio_config.output_dim", a.output_dim, "stt_model.perception.proj.weight", 0, 0),
        ("audio_config.decoder.vocab_size", a.decoder.vocab_size,
         "stt_model.rnnt_decoder.prediction.embed.weight", 0, 1),
        ("audio_config.joint.joint_hidden", a.joint.joint_hidden, "stt_model.rnnt_joint.enc.weight", 0, 0),
        ("tts_config.hidden_size", tts.hidden_size, "tts_model.tts_model.backbone.norm.weight", 0, 0),
        ("tts_config.character_encoder.char_vocab_size", tts.character_encoder.char_vocab_size,
         "tts_model.tts_model.embed_subword.embed_tokens.weight", 0, 0),
        ("tts_config.num_quantizers", tts.num_quantizers, "tts_model.tts_model.rvq_embs", 0, 0),
        ("tts_config.codebook_size", tts.codebook_size, "tts_model.tts_model.rvq_embs", 1, 0),
        ("tts_config.latent_size", tts.latent_size, "tts_model.tts_model.rvq_embs", 2, 0),
        ("tts_config.mog_head.num_predictions", tts.mog_head.num_predictions,
         "tts_model.tts_model.mog_head.low_mat", 0, 0),
        ("codec_config.codebook_size", codec.codebook_size, "tts_model.audio_codec.prvq.mus_list.0", 0, 0),
    ]


def check_sizes(config: VoiceChatConfig, tensors: dict[str, mx.array]) -> None:
    """config.json's layer counts and main widths against the stored tensors' names and shapes
    (read from the files' headers: nothing is loaded), before any module is built from them. A
    tensor that is not stored is left to the strict loader, which names every one missing."""
    problems: list[str] = []
    for field_path, pattern in _LAYER_STACKS:
        want = config
        for part in field_path.split("."):
            want = getattr(want, part)
        found = set()
        for key in tensors:
            m = re.match(pattern, key)
            if m:
                found.add(int(next(g for g in m.groups() if g is not None)))
        if found and len(found) != want:
            problems.append(f"{field_path} is {want} but the weights have {len(found)} "
                            f"(layers {min(found)}..{max(found)})")
    for field_path, want, key, axis, offset in _widths(config):
        tensor = tensors.get(key)
        if tensor is None or tensor.ndim <= axis:
            continue
        got = tensor.shape[axis] - offset
        if got != want:
            problems.append(f"{field_path} is {want} but tensor {key} has {tensor.shape[axis]} on axis {axis}"
                            + (f" ({got} + {offset})" if offset else ""))
    if problems:
        many = len(problems) > 1
        raise CheckpointError(f"config.json does not match the weights ({len(problems)} problem{'s' * many}): "
                              + "; ".join(problems))


# --------------------------------------------------------------------------- the checkpoint

@dataclass
class Checkpoint:
    """An opened checkpoint: its directory, parsed config, and lazily read tensors."""

    path: Path
    config: VoiceChatConfig
    tensors: dict[str, mx.array] = field(repr=False)
    nbytes: int = 0  # of all tensors, counted before `release()`
    released: bool = False
    groups: list[list[str]] = field(default_factory=list, repr=False)  # `read_grouped`'s

    def read(self) -> None:
        """Read every tensor now, each reader group on a thread of its own (`read_all`)."""
        read_all(self.tensors, self.groups or [list(self.tensors)])

    def __post_init__(self):
        self.nbytes = self.nbytes or sum(v.nbytes for v in self.tensors.values())

    @property
    def quantization(self) -> dict[str, dict[str, int]]:
        return quantization_map(self.config)

    def release(self) -> None:
        """Drop the tensors once loaded: a module keeps what it uses, and every tensor it replaced
        by a converted copy (a cast, a stacked projection, a layout change) would otherwise stay in
        memory twice. `nbytes` keeps their size."""
        self.tensors = {}
        self.released = True

    def load_into(self, module: nn.Module, prefix: str, ignore: Iterable[str] = ()) -> None:
        """Quantize `module` as config.json says, then load the tensors under `prefix` into it.

        `ignore`: key prefixes (relative to `prefix`) that belong to other modules, for loading
        one part of a subtree on its own.
        """
        if self.released:
            raise CheckpointError(f"{self.path}: its tensors were released after loading; open it again")
        ignore = tuple(ignore)
        quantize_modules(module, self.quantization, prefix)
        tensors = {k: v for k, v in subtree(self.tensors, prefix).items() if not (ignore and k.startswith(ignore))}
        load_weights(module, tensors, prefix)

    def unused(self, prefixes: Iterable[str]) -> list[str]:
        prefixes = tuple(prefixes)
        return sorted(k for k in self.tensors if not k.startswith(prefixes))


def open_checkpoint(path_or_id: str | os.PathLike, readers: int = 1) -> Checkpoint:
    """Find, open and check a checkpoint; its tensors are read lazily, or all at once by
    `Checkpoint.read()` on `readers` threads (`load` takes `default_readers()`)."""
    directory = resolve(path_or_id)
    config = VoiceChatConfig.from_file(directory / "config.json")
    tensors, groups = read_grouped(safetensors_files(directory), readers)
    try:
        check_sizes(config, tensors)
    except CheckpointError as e:
        raise CheckpointError(f"{directory}: {e}") from None
    return Checkpoint(directory, config, tensors, groups=groups)


def file_metadata(directory: Path) -> dict[str, Any]:
    """Names, shapes and dtypes of every stored tensor, without reading any data."""
    tensors = read_tensors(safetensors_files(directory))
    return {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
