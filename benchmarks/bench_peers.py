"""voicechat next to the other MLX ports of NemotronLabs VoiceChat: one checkpoint, one WAV.

    python benchmarks/bench_peers.py --checkpoint DIR --audio WAV [--peers voicechat,mlx-vlm,mlx-audio]
                                     [--runs 3] [--seconds 5] [--peer-language-cache both|off|on]
                                     [--json OUT.json] [--with EARLIER.json]
    python benchmarks/bench_peers.py --write-tiny DIR     # a tiny checkpoint all three load (CPU)

Each implementation runs in a process of its own (its imports and its peak memory apart from the
others') on the same checkpoint directory and the same 16 kHz samples, with the same system
prompt (none by default), no extra decoding seconds and seed 0: it loads, runs once to warm up
(kernel compilation, caches), then times `--runs` runs of its offline generate, each from audio
samples to the response waveform and transcript. The row gives the timeline frames, ms per 80 ms
frame (the fastest run's generate time over the frames), the real-time factor (that time over
the input's seconds), the peak of `mx.get_peak_memory()` over the timed runs (each after
`mx.reset_peak_memory()`), the load time (imports apart), and whether the text ids equal
voicechat's (the JSON also compares the function ids and the transcript). It measures and
asserts nothing: a package that is not installed is reported and skipped, one that fails is
reported with its error.

The peers (mlx-vlm `models/nemotron_voicechat`, mlx-audio `sts/models/nemotron_voicechat`):
- both load the published layout (`vc-make-checkpoint --layout torch`, the default); their
  `sanitize` converts from it only (LSTM keys, convolutions transposed with no shape check), so
  MLX-layout files do not load;
- both build the TTS's text embeddings for the published vocabulary: mlx-vlm fixes it at 131072
  ids, mlx-audio builds the character encoder at the TTS backbone's widths. The tiny checkpoint
  (`tiny_config`) has neither; `--write-tiny` writes tiny widths with both;
- mlx-audio reads its config in NeMo's schema and the LLM's config and tokenizer from the hub
  repository its config names (`pretrained_llm`); the published config.json has neither, so it
  gets a folder of links to the checkpoint's files with the same config re-expressed in that
  schema, naming the folder itself for the tokenizer (no network);
- their offline `generate` runs the LLM over the whole history at every frame unless asked for
  the language cache (`use_language_cache=True`, what their streaming sessions use): a row each
  (`--peer-language-cache`);
- their package `__init__`s import every model they ship; each peer's model files are imported
  without them (`bare_packages`), so the dependencies are those of the VoiceChat path only.

Each process gets the caller's environment: voicechat itself turns MLX's TF32 off for float32
matmuls (its greedy ids must equal a float32 computation), the peers run MLX's default unless
MLX_ENABLE_TF32 is exported.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The environment handed to each implementation's process, before anything here sets a knob.
ENVIRONMENT = dict(os.environ)
FRAME_SECONDS = 0.08
INPUT_RATE = 16000

# name: (module that tells whether it is installed, distribution for its version)
IMPLEMENTATIONS = {
    "voicechat": ("voicechat", "voicechat"),
    "mlx-vlm": ("mlx_vlm", "mlx-vlm"),
    "mlx-audio": ("mlx_audio", "mlx-audio"),
}
MLX_AUDIO_PACKAGES = ("mlx_audio", "mlx_audio.codec", "mlx_audio.codec.models", "mlx_audio.stt",
                      "mlx_audio.stt.models", "mlx_audio.sts", "mlx_audio.sts.models")


# --------------------------------------------------------------------------- one implementation

# Each implementation: imports, then returns `load()`, which returns `generate(samples)` -> (text ids,
# function ids, text, transcript, prompt frames). The load time is that of `load()`, imports apart.

def _voicechat(checkpoint: Path, system_prompt: str, language_cache: bool, scratch: Path):
    """Its own caches always (`language_cache` is the peers' switch)."""
    import voicechat
    import voicechat.session  # noqa: F401  (imported here: load() times no imports)

    def load():
        chat = voicechat.load(checkpoint)

        def generate(samples):
            r = chat.generate(samples, system_prompt=system_prompt or None, extra_decoding_seconds=0.0, seed=0,
                              sample_rate=INPUT_RATE)
            return r.text_tokens, r.function_tokens, r.text, r.user_transcript, r.prompt_frames

        return generate

    return load


def _prompt_frames(tokenizer, system_prompt: str) -> int:
    """The timeline frames a peer's system prompt takes: BOS, its ids, EOS (none when empty)."""
    return len(tokenizer.encode(system_prompt, add_special_tokens=False)) + 2 if system_prompt.strip() else 0


def _peer_generate(session, tokenizer, system_prompt: str, language_cache: bool):
    import mlx.core as mx

    prompt_frames = _prompt_frames(tokenizer, system_prompt)

    def generate(samples):
        r = session.generate(mx.array(samples), system_prompt=system_prompt, extra_decoding_seconds=0.0, seed=0,
                             use_language_cache=language_cache)
        return r.text_tokens.tolist(), r.function_tokens.tolist(), r.text, r.user_transcript, prompt_frames

    return generate


def _mlx_vlm(checkpoint: Path, system_prompt: str, language_cache: bool, scratch: Path):
    from bare_packages import bare_packages

    bare_packages("mlx_vlm", "mlx_vlm.models")
    bare_packages(*MLX_AUDIO_PACKAGES)  # its VoiceChat imports mlx-audio's conformer, RNNT and codec
    import mlx_vlm.models.nemotron_voicechat  # noqa: F401  (imported here: load() times no imports)
    from mlx_vlm.utils import load as mlx_vlm_load

    def load():
        model, processor = mlx_vlm_load(str(checkpoint))
        session = model.create_session(processor)
        return _peer_generate(session, session.tokenizer, system_prompt, language_cache)

    return load


def mlx_audio_config(config: dict, tokenizer_dir: Path) -> dict:
    """The checkpoint's config.json with the same model re-expressed in the NeMo schema that
    mlx-audio's `ModelConfig.from_dict` reads, the LLM's config under `mlx_audio.llm_config` and
    `pretrained_llm` naming `tokenizer_dir` (a folder with the checkpoint's tokenizer files)."""
    t, a, tts, codec = config["text_config"], config["audio_config"], config["tts_config"], config["codec_config"]
    llm = {k: v for k, v in t.items() if k != "time_step_limit"}  # absent: unbounded, as in ours
    llm.setdefault("use_bias", False)
    encoder = dict(a["encoder"])
    context = encoder.get("att_context_size", [70, 0])
    if context and isinstance(context[0], list):
        encoder["att_context_size"] = context[0]
    frame = config.get("frame_duration", FRAME_SECONDS)
    backbone_keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "sliding_window")
    nemo = {
        "data": {"source_sample_rate": config.get("input_sample_rate", INPUT_RATE),
                 "target_sample_rate": config.get("output_sample_rate", 22050), "frame_length": frame},
        "model": {
            "inference_speaker_name": config.get("speaker", "Aria"),
            "stt": {"model": {
                "pretrained_llm": str(tokenizer_dir),
                "perception": {"preprocessor": a["preprocessor"], "encoder": encoder, "output_dim": a["output_dim"]},
                "duplex_function_channel_weight": config.get("function_channel_weight", 2.0),
                "max_symbols": a.get("max_symbols", 10)}},
            "speech_generation": {
                "data": {"audio_prompt_duration": tts.get("audio_prompt_duration", 3.0), "frame_length": frame},
                "model": {
                    "tts_config": {"backbone_config": {k: tts[k] for k in backbone_keys},
                                   "mog_head_config": tts["mog_head"], "latent_size": tts["latent_size"],
                                   "codebook_size": tts["codebook_size"], "num_quantizers": tts["num_quantizers"],
                                   "exponent": tts["exponent"]},
                    "codec_config": {"base_hidden_size": codec["base_channels"],
                                     "channel_mult": codec["channel_multipliers"], "rates": codec["downsample_rates"],
                                     "num_blocks": codec["blocks_per_stage"], "kernel_size": codec["block_kernel_size"],
                                     "latent_size": codec["latent_dim"], "n_fft": codec["n_fft"],
                                     "hop_length": codec["hop_length"], "num_quantizers": codec["num_quantizers"],
                                     "codebook_size": codec["codebook_size"]},
                    "inference_num_iterations": tts["num_iterations"],
                    "inference_guidance_scale": tts["guidance_scale"], "inference_top_p_or_k": tts["top_p"],
                    "inference_noise_scale": tts["noise_scale"]}}},
        "_rnnt_merge_info": {
            "decoder_config": {"prednet": {"pred_hidden": a["decoder"]["pred_hidden"],
                                           "pred_rnn_layers": a["decoder"]["pred_rnn_layers"]},
                               "vocab_size": a["decoder"]["vocab_size"],
                               "blank_as_pad": a["decoder"].get("blank_as_pad", True)},
            "joint_config": {"jointnet": {k: a["joint"][k] for k in ("joint_hidden", "activation", "encoder_hidden",
                                                                      "pred_hidden")},
                             "num_classes": a["joint"]["num_classes"], "vocabulary": config.get("rnnt_vocabulary", []),
                             "blank_id": config.get("rnnt_blank_id", a["joint"]["num_classes"])}},
        # mlx-audio counts the characters without the padding entry
        "mlx_audio": {"llm_config": llm, "char_vocab_size": tts["character_encoder"]["char_vocab_size"] - 1},
    }
    return {**config, **nemo}


def _mlx_audio(checkpoint: Path, system_prompt: str, language_cache: bool, scratch: Path):
    """Loads `scratch`: links to the checkpoint's files and the config in mlx-audio's schema."""
    from bare_packages import bare_packages

    bare_packages(*MLX_AUDIO_PACKAGES)
    import mlx_audio.sts.models.nemotron_voicechat  # noqa: F401  (imported here: load() times no imports)
    import transformers  # noqa: F401  (its post-load hook's tokenizer)
    from mlx_audio.sts.utils import load_model

    def load():
        for item in checkpoint.iterdir():
            if item.name != "config.json":
                (scratch / item.name).symlink_to(item.resolve())
        config = json.loads((checkpoint / "config.json").read_text())
        (scratch / "config.json").write_text(json.dumps(mlx_audio_config(config, scratch), indent=2) + "\n")
        model = load_model(scratch, strict=True)  # strict: every tensor found and of its shape
        session = model.create_session()
        return _peer_generate(session, session.tokenizer, system_prompt, language_cache)

    return load


def worker(args) -> dict:
    """Load, warm up, time; the result as a dict (the parent reads it as JSON)."""
    import mlx.core as mx
    import numpy as np

    samples = np.load(args.samples)
    implementation = {"voicechat": _voicechat, "mlx-vlm": _mlx_vlm, "mlx-audio": _mlx_audio}[args.worker]
    with tempfile.TemporaryDirectory(prefix=f"{args.worker}-") as scratch:
        load = implementation(args.checkpoint, args.system_prompt, args.language_cache, Path(scratch))
        start = time.perf_counter()
        generate = load()
        load_s = time.perf_counter() - start

        start = time.perf_counter()
        generate(samples)
        first_s = time.perf_counter() - start
        runs_s, peaks = [], []
        for _ in range(args.runs):
            mx.reset_peak_memory()
            start = time.perf_counter()
            text_ids, function_ids, text, transcript, prompt_frames = generate(samples)
            runs_s.append(time.perf_counter() - start)
            peaks.append(mx.get_peak_memory())

    audio_frames = len(text_ids)
    frames = prompt_frames + audio_frames
    best = min(runs_s)
    return {
        "frames": frames, "audio_frames": audio_frames, "prompt_frames": prompt_frames,
        "ms_per_frame": 1e3 * best / frames, "rtf": best / (audio_frames * FRAME_SECONDS),
        "runs_s": runs_s, "first_run_s": first_s, "load_s": load_s,
        "peak_memory_gb": max(peaks) / 1e9, "peak_memory_gb_by_run": [p / 1e9 for p in peaks],
        "text_ids": [int(i) for i in text_ids], "function_ids": [int(i) for i in function_ids],
        "text": text, "user_transcript": transcript,
        "device": mx.device_info().get("device_name", str(mx.default_device())),
        "mlx": importlib.metadata.version("mlx"),
        "MLX_ENABLE_TF32": os.environ.get("MLX_ENABLE_TF32"),
    }


# --------------------------------------------------------------------------- the table

def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def installed(name: str) -> bool:
    return importlib.util.find_spec(IMPLEMENTATIONS[name][0]) is not None


def run_one(name: str, language_cache: bool, args, samples_file: Path) -> dict:
    row = {"implementation": name, "language_cache": language_cache, "version": _version(IMPLEMENTATIONS[name][1])}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--checkpoint", str(args.checkpoint),
               "--samples", str(samples_file), "--runs", str(args.runs), "--system-prompt", args.system_prompt]
    if language_cache:
        command.append("--language-cache")
    print(f"{row_name(row)}: running", file=sys.stderr, flush=True)
    done = subprocess.run(command, env=ENVIRONMENT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        # the exception's own line (a message may go on over several lines), else the last line
        reason = next((line for line in reversed(lines) if re.match(r"[\w.]+(Error|Exception)\b", line)),
                      lines[-1] if lines else f"exit {done.returncode}")
        return {**row, "status": f"failed: {reason.strip()[:200]}"}
    return {**row, "status": "ok", **json.loads(done.stdout.strip().splitlines()[-1])}


def row_name(row: dict) -> str:
    if row["implementation"] == "voicechat" or row["language_cache"] is None:
        return row["implementation"]
    return f"{row['implementation']} ({'language cache' if row['language_cache'] else 'full history'})"


def _reference(rows: list[dict]) -> dict | None:
    """voicechat's row, when it ran: the peers' ids are compared with its."""
    return next((r for r in rows if r["implementation"] == "voicechat" and r["status"] == "ok"), None)


def table(rows: list[dict]) -> str:
    reference = _reference(rows)
    lines = ["| implementation | version | frames | ms per 80 ms frame | real-time factor | peak memory | load "
             "| text ids equal voicechat's |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {row_name(r)} | {r.get('version', '')} | {r['status']} | | | | | |")
            continue
        if r is reference:
            same = "(reference)"
        elif reference is None:
            same = "n/a"
        else:
            at = _first_difference(reference["text_ids"], r["text_ids"])
            same = "yes" if at is None else f"no (first differs at {at})"
        lines.append(f"| {row_name(r)} | {r['version']} | {r['frames']} | {r['ms_per_frame']:.2f} | {r['rtf']:.3f} "
                     f"| {r['peak_memory_gb']:.2f} GB | {r['load_s']:.1f} s | {same} |")
    return "\n".join(lines)


def write_tiny(directory: Path) -> None:
    """`tiny_config()` with what the peers build at the published sizes: the 131072-id
    vocabulary and a character encoder as wide as the TTS backbone."""
    from voicechat.config import VoiceChatConfig
    from voicechat.synthetic import make_checkpoint, tiny_config

    data = tiny_config().to_dict()
    data["text_config"]["vocab_size"] = 131072
    tts = data["tts_config"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        tts["character_encoder"][key] = tts[key]
    print(make_checkpoint(directory, "tiny", quantize=4, layout="torch", config=VoiceChatConfig.from_dict(data)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, help="checkpoint directory (published layout)")
    p.add_argument("--audio", type=Path, help="the input WAV (resampled to 16 kHz mono)")
    p.add_argument("--peers", default="voicechat,mlx-vlm,mlx-audio",
                   help="comma-separated, of " + ", ".join(IMPLEMENTATIONS))
    p.add_argument("--runs", type=int, default=3, help="timed runs after the warm-up run (default 3)")
    p.add_argument("--peer-language-cache", choices=["both", "off", "on"], default="both",
                   help="the peers' use_language_cache: a row each (both), their default (off), or on")
    p.add_argument("--seconds", type=float, help="pad the input with silence (or cut it) to this length, "
                   "as bench_e2e's inputs (default: the WAV as it is)")
    p.add_argument("--system-prompt", default="", help="the same system prompt for all (default: none)")
    p.add_argument("--with", dest="earlier", type=Path, metavar="EARLIER.json",
                   help="the rows of an earlier --json (same checkpoint and input) for implementations this run "
                        "leaves out: one table from runs made apart")
    p.add_argument("--json", type=Path, help="write the setup and every row (with ids and run times) here")
    p.add_argument("--write-tiny", type=Path, metavar="DIR", help="write a tiny checkpoint all three load, and exit")
    p.add_argument("--worker", choices=sorted(IMPLEMENTATIONS), help=argparse.SUPPRESS)
    p.add_argument("--samples", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--language-cache", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.write_tiny:
        write_tiny(args.write_tiny)
        return 0
    if args.worker:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the result only
            result = worker(args)
        print(json.dumps(result))
        return 0
    if args.checkpoint is None or args.audio is None:
        p.error("--checkpoint and --audio are required")
    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = [n for n in names if n not in IMPLEMENTATIONS]
    if unknown:
        p.error(f"unknown implementation(s): {', '.join(unknown)}; known: {', '.join(IMPLEMENTATIONS)}")
    if args.runs < 1:
        p.error("--runs must be at least 1")
    args.checkpoint = args.checkpoint.resolve()

    import numpy as np

    from voicechat.audio import load_audio

    samples = load_audio(str(args.audio), INPUT_RATE)
    if args.seconds is not None:
        wanted = int(round(args.seconds * INPUT_RATE))
        samples = np.concatenate([samples, np.zeros(max(0, wanted - len(samples)), np.float32)])[:wanted]
    cache = {"both": [False, True], "off": [False], "on": [True]}[args.peer_language_cache]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as scratch:
        samples_file = Path(scratch) / "samples.npy"
        np.save(samples_file, samples.astype(np.float32))
        for name in names:
            if not installed(name):
                rows.append({"implementation": name, "language_cache": None, "status": "not installed"})
                continue
            for language_cache in ([True] if name == "voicechat" else cache):
                rows.append(run_one(name, language_cache, args, samples_file))

    setup = {"checkpoint": str(args.checkpoint), "audio": str(args.audio), "audio_seconds": len(samples) / INPUT_RATE,
             "runs": args.runs, "extra_decoding_seconds": 0.0, "system_prompt": args.system_prompt, "seed": 0}
    if args.earlier:
        earlier = json.loads(args.earlier.read_text())
        differs = [k for k in ("checkpoint", "audio_seconds", "system_prompt") if earlier["setup"][k] != setup[k]]
        if differs:
            print(f"note: {args.earlier} was run with another {', '.join(differs)}", file=sys.stderr)
        rows = [{**r, "from": str(args.earlier)} for r in earlier["rows"] if r["implementation"] not in names] + rows
    reference = _reference(rows)
    for r in rows:
        if reference is not None and r is not reference and r["status"] == "ok":
            r["equal_to_voicechat"] = {key: r[key] == reference[key]
                                       for key in ("text_ids", "function_ids", "user_transcript")}
    device = next((r["device"] for r in rows if r["status"] == "ok"), "no implementation ran")
    print(f"{device}, {args.checkpoint.name}, {setup['audio_seconds']:.2f} s of {args.audio.name}, "
          f"best of {args.runs} warm runs, extra decoding 0 s, "
          f"system prompt {args.system_prompt!r}")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"setup": setup, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
