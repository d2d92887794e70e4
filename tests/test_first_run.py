"""The first run: the TTS char table's disk cache, `voicechat.precompile`, load's warm-up and
`vc-generate --precompile`. What a cache or a precompile changes must never be an id or a code."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import voicechat
from voicechat import char_table_cache
from voicechat.cli import main
from voicechat.precompile import (PARTS, PROCESS_PARTS, _seed_kernel_cache, merge_kernel_cache, precompile,
                                  worker_processes)


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint32))


def _answer(chat, wav) -> tuple:
    r = chat.generate(wav, seed=3, extra_decoding_seconds=1.0)
    return r.text_tokens, r.function_tokens, r.audio_codes, r.user_transcript


@pytest.fixture
def table_dir(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "char-table"
    monkeypatch.setenv("VOICECHAT_CHAR_TABLE_DIR", str(folder))
    return folder


def test_a_cached_char_table_gives_bit_identical_ids_and_codes(tiny_checkpoint, spoken_wav, table_dir,
                                                               monkeypatch):
    first = voicechat.load(tiny_checkpoint)
    assert first.ear_tts.char_table_source == "computed"
    files = list(table_dir.glob("*.safetensors"))
    assert len(files) == 1 and not list(table_dir.glob(".*"))  # written whole, no temp file left
    cached = voicechat.load(tiny_checkpoint)
    assert cached.ear_tts.char_table_source == "cache"
    monkeypatch.setenv("VOICECHAT_CHAR_TABLE_DIR", "")  # empty: no cache
    uncached = voicechat.load(tiny_checkpoint)
    assert uncached.ear_tts.char_table_source == "computed, not kept"
    table = _bits(first.ear_tts.char_table())
    assert np.array_equal(table, _bits(cached.ear_tts.char_table()))
    assert np.array_equal(table, _bits(uncached.ear_tts.char_table()))
    assert _answer(cached, spoken_wav) == _answer(uncached, spoken_wav)


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last float of the table (its data ends the file)
    path.write_bytes(bytes(data))


def _cut_short(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _other_key(path: Path) -> None:
    arrays = mx.load(str(path))
    char_table_cache.write_table(path, "another checkpoint's key", arrays["table"])


def _other_shape(path: Path) -> None:
    arrays = mx.load(str(path))
    char_table_cache.write_table(path, path.stem, arrays["table"][:-1])


@pytest.mark.parametrize("damage", [_flip_last_byte, _cut_short, _other_key, _other_shape])
def test_a_corrupt_or_foreign_char_table_file_is_recomputed_and_written_again(tiny_checkpoint, table_dir, damage):
    original = _bits(voicechat.load(tiny_checkpoint).ear_tts.char_table())
    (path,) = table_dir.glob("*.safetensors")
    damage(path)
    again = voicechat.load(tiny_checkpoint).ear_tts
    assert again.char_table_source == "computed"
    assert np.array_equal(_bits(again.char_table()), original)
    assert voicechat.load(tiny_checkpoint).ear_tts.char_table_source == "cache"  # the file is whole again


def test_the_checksum_sees_one_flipped_bit_and_swapped_rows():
    table = mx.array(np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32))
    words = np.array(table.view(mx.uint32))
    flipped = words.copy()
    flipped[4, 2] ^= 1 << 31
    swapped = words[[1, 0, 2, 3, 4, 5]]
    total = char_table_cache.checksum(table)
    for other in (flipped, swapped, words[:, [0, 1, 2, 4, 3]]):
        assert char_table_cache.checksum(mx.array(other).view(mx.float32)) != total
    assert char_table_cache.checksum(mx.array(words).view(mx.float32)) == total


def test_the_key_follows_the_char_encoders_weights_and_vocabulary_only(tiny_checkpoint, table_dir):
    chat = voicechat.load(tiny_checkpoint)
    tts = chat.ear_tts
    encoder = tts.embed_subword
    section = tts.cfg.character_encoder.to_dict()

    def key(vocabulary=None, kernels=False) -> str:
        return char_table_cache.table_key(encoder, section, vocabulary or encoder.vocabulary_digest, kernels)

    base = key()
    assert key() == base
    assert key(vocabulary="0" * 64) != base
    assert key(kernels=True) != base
    assert char_table_cache.table_key(encoder, {**section, "rope_base": 5e3}, encoder.vocabulary_digest, False) != base
    weight = encoder.proj_embedding.weight
    encoder.proj_embedding.weight = mx.concatenate([weight[:1] + 1e-3, weight[1:]])
    assert key() != base
    encoder.proj_embedding.weight = weight
    chat.listening.lm_head.weight = chat.listening.lm_head.weight + 1  # not the char encoder's: same key
    assert key() == base


def test_the_code_digest_reads_the_extension_and_the_kernel_library():
    """The table's kernels live in the kernel library beside the extension: a new build of either
    must give a new key."""
    names = [p.name for p in char_table_cache.code_files()]
    assert any(n.startswith("_ext") for n in names) and any(n.startswith("libvoicechat_kernels") for n in names)
    assert "char_table_cache.py" in names


def test_an_unwritable_char_table_folder_is_one_warning_line(tiny_checkpoint, tmp_path, monkeypatch, capfd):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("VOICECHAT_CHAR_TABLE_DIR", str(blocker / "char-table"))
    monkeypatch.setattr(char_table_cache, "_said_unwritable", False)
    chats = [voicechat.load(tiny_checkpoint) for _ in range(2)]
    assert [c.ear_tts.char_table_source for c in chats] == ["computed, not kept"] * 2
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "char table" in line]
    assert len(lines) == 1 and lines[0].startswith("voicechat: cannot keep the char table in ")
    assert "Traceback" not in err


def test_precompile_and_the_warm_up_at_load_change_no_id_or_code(tiny_checkpoint, tiny_checkpoint_q4, spoken_wav,
                                                                  table_dir, tmp_path, monkeypatch):
    from voicechat.precompile import is_precompiled

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # where the marker goes
    chat = voicechat.load(tiny_checkpoint)
    assert not is_precompiled(chat)
    seen = []
    last = precompile(chat, progress=seen.append, long_inputs=False, processes=0, live=True)
    assert is_precompiled(chat) and not is_precompiled(voicechat.load(tiny_checkpoint_q4))  # other shapes
    assert last.finished and last.done == last.total == len(PARTS) - 1  # (no long context)
    assert "live session" in {p.part for p in seen}
    assert [p.done for p in seen if not p.finished] == sorted(p.done for p in seen if not p.finished)
    assert seen[-1] == last
    stages = []
    warm = voicechat.load(tiny_checkpoint, progress=stages.append, warmup=True)
    assert stages == ["opening the checkpoint", "reading weights", "char table", "speaker prompt", "warming up"]
    plain = voicechat.load(tiny_checkpoint)
    assert _answer(chat, spoken_wav) == _answer(plain, spoken_wav) == _answer(warm, spoken_wav)


def test_vc_generate_precompile_compiles_and_exits_with_stage_lines(capsys, tiny_checkpoint, table_dir):
    assert main(["-m", str(tiny_checkpoint), "--precompile"]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    for needle in ("load: opening the checkpoint: ", "load: reading weights: ", "load: char table: ",
                   "load: speaker prompt: ", "kernels for this model (first run only): ", "precompiled: "):
        assert needle in err, needle
    assert main(["-m", str(tiny_checkpoint), "--precompile", "--audio", os.devnull]) == 2
    assert capsys.readouterr().err.startswith("error: --precompile compiles and exits")


def _nvrtc_or_skip() -> None:
    from voicechat.kernels import ext

    try:
        ext.nvrtc_cubin(ext.strided_copy_text("sm_90"), "sm_90")
    except RuntimeError as e:
        if "cannot be loaded" in str(e):
            pytest.skip("no NVRTC here (VOICECHAT_NVRTC names one)")
        raise


def test_kernel_texts_compile_side_by_side_into_the_cubin_cache(tmp_path, monkeypatch):
    from voicechat.kernels import ext
    from voicechat.precompile import compile_kernel_texts

    _nvrtc_or_skip()
    folder = tmp_path / "cubin"
    monkeypatch.setenv("VOICECHAT_CUBIN_DIR", str(folder))
    good = [(ext.strided_copy_text(arch), arch) for arch in ("sm_80", "sm_90")]
    good.append((ext.own_kernel_text("vc_rvq_step", 0, "sm_90"), "sm_90"))
    bad = ('// sm_90\nextern "C" __global__ void vc_kernel() { undeclared_name(); }\n', "sm_90")
    seen = []
    errors = compile_kernel_texts(good + [bad], threads=2, done=seen.append)
    assert len(errors) == 1 and "did not compile" in errors[0]
    assert sorted(seen) == [1, 2, 3, 4]
    paths = [folder / f"{ext.own_kernel_file_name(text)}.cubin" for text, _ in good]
    for path, (text, _) in zip(paths, good):
        assert ext.read_cached_cubin(str(path), text)[:4] == b"\x7fELF"
    stamps = [p.stat().st_mtime_ns for p in paths]
    assert compile_kernel_texts(good, threads=2) == []  # all kept: none compiled again
    assert [p.stat().st_mtime_ns for p in paths] == stamps
    assert sorted(f.name for f in folder.iterdir()) == sorted(p.name for p in paths)  # no temp file left


def test_discovery_finds_nothing_where_our_launch_does_not_run(tiny_checkpoint):
    from voicechat.kernels import ext, kernel_launch
    from voicechat.precompile import discover_own_kernels

    if kernel_launch()["launch"] == "own":
        pytest.skip("our own launch runs here")
    assert discover_own_kernels(voicechat.load(tiny_checkpoint)) == []
    ext.own_launch_discovery(True)  # where the launch is not built, discovery records nothing
    ext.own_launch_discovery(False)
    assert ext.own_launch_discovered() == []


def test_nvrtc_lets_other_threads_run_while_it_compiles():
    """Python runs on another thread through the middle half of a compile: ext.nvrtc_cubin holds no
    GIL there, so that a pool of threads compiles side by side (with the GIL held, no Python line
    could run on another thread until the call returned)."""
    import threading
    import time

    from voicechat.kernels import ext

    _nvrtc_or_skip()
    text = ext.own_kernel_text("vc_rvq_step", 0, "sm_90")
    span = {}

    def compile_once() -> None:
        span["start"] = time.perf_counter()
        ext.nvrtc_cubin(text, "sm_90")
        span["end"] = time.perf_counter()

    worker = threading.Thread(target=compile_once)
    beats = []
    worker.start()
    while worker.is_alive():
        beats.append(time.perf_counter())
        time.sleep(0.001)
    worker.join()
    start, end = span["start"], span["end"]
    middle = [b for b in beats if start + (end - start) / 4 < b < end - (end - start) / 4]
    assert len(middle) >= 3, (end - start, len(beats))


def test_precompile_in_worker_processes_changes_no_id_or_code(tiny_checkpoint, spoken_wav, table_dir):
    chat = voicechat.load(tiny_checkpoint)
    seen = []
    last = precompile(chat, progress=seen.append, long_inputs=False, processes=2)
    assert last.finished and last.done == last.total == 2 + len(PROCESS_PARTS)  # (no live session)
    assert {p.part for p in seen} >= set(PROCESS_PARTS)
    assert _answer(chat, spoken_wav) == _answer(voicechat.load(tiny_checkpoint), spoken_wav)


def test_a_workers_kernel_cache_merges_whole_and_keeps_what_is_there(tmp_path):
    shared, private = tmp_path / "shared", tmp_path / "private"
    (shared / "long").mkdir(parents=True)
    (shared / "a.ptx").write_bytes(b"shared a")
    (shared / "long" / "b.ptx").write_bytes(b"shared b")
    _seed_kernel_cache(shared, private)
    assert (private / "a.ptx").read_bytes() == b"shared a" and (private / "long" / "b.ptx").read_bytes() == b"shared b"
    (private / "a.ptx").unlink()  # (a worker never rewrites a file it has: this one is another's)
    (private / "a.ptx").write_bytes(b"worker a")
    (private / "c.txt").write_text("c kernels")
    (private / "c.ptx").write_bytes(b"worker c")
    (private / ("d" * 245 + ".ptx")).write_bytes(b"a name as long as MLX makes them")
    assert merge_kernel_cache(private, shared) == 3
    assert (shared / "a.ptx").read_bytes() == b"shared a"  # kept
    assert (shared / "c.ptx").read_bytes() == b"worker c" and (shared / "c.txt").read_text() == "c kernels"
    assert (shared / ("d" * 245 + ".ptx")).exists()
    assert not [f for f in shared.rglob("*") if f.name.endswith(".tmp")]
    assert merge_kernel_cache(private, shared) == 0


def test_worker_processes_need_weights_on_disk_and_a_whole_number(tiny_checkpoint, tmp_path, monkeypatch):
    from voicechat.synthetic import random_checkpoint

    chat = voicechat.load(tiny_checkpoint)
    monkeypatch.setenv("VOICECHAT_PRECOMPILE_PROCESSES", "3")
    assert worker_processes(chat) == 3
    monkeypatch.setenv("VOICECHAT_PRECOMPILE_PROCESSES", "0")
    assert worker_processes(chat) == 0
    monkeypatch.setenv("VOICECHAT_PRECOMPILE_PROCESSES", "many")
    with pytest.raises(ValueError, match="VOICECHAT_PRECOMPILE_PROCESSES"):
        worker_processes(chat)
    monkeypatch.setenv("VOICECHAT_PRECOMPILE_PROCESSES", "3")
    assert worker_processes(voicechat.load(random_checkpoint(tmp_path / "mem", "tiny"))) == 0  # in memory only


def test_the_mlx_version_for_the_kernel_cache_is_the_installed_ones():
    from importlib.metadata import version

    assert voicechat._mlx_version() == version("mlx") == mx.__version__


def test_discovery_on_a_gpu_names_every_kernel_generate_launches(tiny_checkpoint, spoken_wav, tmp_path, monkeypatch):
    """Traced in discovery, the LLM step, the TTS step and the speech encoder name the kernels a
    generate then finds compiled: it compiles none of its own (new cubin files), and its ids and codes
    are those of a run without precompile."""
    from voicechat.kernels import kernel_launch
    from voicechat.precompile import compile_kernel_texts, discover_own_kernels

    if kernel_launch()["launch"] != "own":
        pytest.skip("our own launch runs on a CUDA GPU")
    folder = tmp_path / "cubin"
    monkeypatch.setenv("VOICECHAT_CUBIN_DIR", str(folder))
    chat = voicechat.load(tiny_checkpoint)
    before = set(folder.iterdir()) if folder.exists() else set()  # (what the load itself launched)
    texts = discover_own_kernels(chat, long_inputs=False)
    assert texts and compile_kernel_texts(texts) == []
    compiled = set(folder.iterdir())
    assert len(compiled - before) == len(texts)
    # (a kernel this process loaded before, in an earlier test, writes no file either way: run alone,
    # every kernel of the generate path is new here)
    answer = _answer(chat, spoken_wav)
    assert set(folder.iterdir()) == compiled
    monkeypatch.delenv("VOICECHAT_CUBIN_DIR")
    assert answer == _answer(voicechat.load(tiny_checkpoint), spoken_wav)
