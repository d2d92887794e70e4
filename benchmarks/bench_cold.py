"""The first run: new processes on empty caches, then on the caches the first one left.

    PYTHONPATH=python python benchmarks/bench_cold.py                         # tiny checkpoint (CPU)
    PYTHONPATH=python python benchmarks/bench_cold.py --size full --precompile --json  # real shapes (GPU)

Every run is a new process whose caches are folders of one temp dir made here: XDG_CACHE_HOME,
MLX_PTX_CACHE_DIR (MLX's CUDA kernels), VOICECHAT_CUBIN_DIR and VOICECHAT_KERNEL_TEXT_DIR (ours),
VOICECHAT_CHAR_TABLE_DIR (the TTS char table), CUDA_CACHE_PATH (the driver's PTX cache) and TMPDIR
(MLX's CPU kernels, $TMPDIR/mlx). Runs (`--runs`, in order; second and warmup run on the caches
that first left, or that first-precompile left where first does not run):

- first: empty caches: load, then generate twice (the first is the first run's, compiling as it
  goes; the second is the same process warm);
- first-precompile (with `--precompile`): empty caches of its own: load, `voicechat.precompile`
  (without the shapes of long inputs, as vc-generate's first run on a GPU), then generate twice;
- second: warm caches: load, generate twice (fresh-process vs in-process warm);
- warmup: the same caches, `voicechat.load(..., warmup=True)`, generate twice: what a warm-up
  at load leaves of a fresh process's first generate.

Full size uses random weights in the published 4-bit layout (`voicechat.synthetic.random_checkpoint`,
as bench_e2e.py), written once as a safetensors checkpoint in the temp dir (untimed: `setup_s`),
which every run loads from disk as it would a downloaded one (precompile's worker processes need
it on disk); `--in-memory` makes them in memory in each process instead (`weights_s`, not part of
load; precompile then runs its parts as threads). The input is the bundled spoken question padded
with silence to `--seconds` (default 10.7), with the default 3 s of extra decoding. `--peer mlx-vlm
--peer-model ID` also times `python -m mlx_vlm.generate` on empty caches where mlx_vlm is installed
(skipped otherwise). It measures and asserts nothing; `--json` prints one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CACHE_VARS = {
    "XDG_CACHE_HOME": "xdg",
    "MLX_PTX_CACHE_DIR": "mlx-ptx",
    "VOICECHAT_CUBIN_DIR": "cubin",
    "VOICECHAT_KERNEL_TEXT_DIR": "kernel-text",
    "VOICECHAT_CHAR_TABLE_DIR": "char-table",
    "CUDA_CACHE_PATH": "cuda-driver",
    "TMPDIR": "tmp",
}
RUNS = ("first", "second", "warmup", "first-precompile")


def _child(args: argparse.Namespace) -> dict:
    """One measured process: prints its numbers as one JSON line on stdout."""
    start = time.perf_counter()
    import mlx.core as mx

    import voicechat
    from voicechat.precompile import count_kernels, dummy_audio, precompile
    from voicechat.session import load

    out: dict = {"run": args.child, "import_s": time.perf_counter() - start, "device": str(mx.default_device())}
    kernels_before = count_kernels()
    t = time.perf_counter()
    if args.checkpoint:
        model = args.checkpoint
    else:  # full size, in memory
        from voicechat.synthetic import random_checkpoint

        model = random_checkpoint(Path(args.workdir) / f"full-{args.child}", "full", quantize=4)
    out["weights_s"] = time.perf_counter() - t
    stages: dict[str, float] = {}
    clock = [time.perf_counter(), None]

    def stage(name: str) -> None:
        now = time.perf_counter()
        if clock[1] is not None:
            stages[clock[1]] = now - clock[0]
        clock[0], clock[1] = now, name

    t = time.perf_counter()
    chat = load(model, progress=stage, warmup=args.child == "warmup")
    stage("")
    out["load_s"] = time.perf_counter() - t
    out["load_stages_s"] = {k: v for k, v in stages.items() if k}
    out["char_table"] = chat.ear_tts.char_table_source
    out["tts_thread"] = chat.tts_thread
    if args.child == "first-precompile":
        from voicechat.precompile import worker_processes

        out["precompile_processes"] = worker_processes(chat)
        last = precompile(chat, long_inputs=False)  # as vc-generate's first run on a GPU
        out["precompile_s"], out["precompile_kernels"] = last.elapsed, last.kernels
        out["precompile_own_kernels"] = last.own_total  # ours, compiled side by side
    audio = dummy_audio(args.seconds, chat.config.input_sample_rate)
    for name in ("generate_1", "generate_2"):
        t = time.perf_counter()
        r = chat.generate(audio, sample_rate=chat.config.input_sample_rate)
        wall = time.perf_counter() - t
        frames = r.frames + r.prompt_frames
        out[name] = {"s": wall, "frames": frames, "ms_per_frame": 1000 * wall / frames,
                     "timeline_ms_per_frame": 1000 * r.timings["timeline_s"] / frames,
                     "stages_s": {k: v for k, v in r.timings.items() if k != "generate_s"},
                     "text_tokens_head": r.text_tokens[:8]}
    out["kernels_compiled"] = count_kernels() - kernels_before
    out["process_s"] = time.perf_counter() - start
    out["end_to_end_s"] = out["load_s"] + out.get("precompile_s", 0.0) + out["generate_1"]["s"]
    out["voicechat"] = voicechat.__version__
    return out


def _write_full_checkpoint(directory: Path) -> None:
    """Random full-size weights as a checkpoint folder (config.json, tokenizer.json, one
    model.safetensors in MLX's layout, as open_checkpoint reads any)."""
    import mlx.core as mx

    from voicechat.synthetic import random_checkpoint

    checkpoint = random_checkpoint(directory, "full", quantize=4)
    mx.save_safetensors(str(directory / "model.safetensors"), checkpoint.tensors, metadata={"format": "mlx"})


def _run_child(run: str, args: argparse.Namespace, env: dict, workdir: Path, checkpoint: str | None) -> dict:
    cmd = [sys.executable, __file__, "--child", run, "--size", args.size, "--seconds", str(args.seconds),
           "--workdir", str(workdir)]
    if checkpoint:
        cmd += ["--checkpoint", checkpoint]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"run": run, "error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:], "wall_s": wall}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall  # from spawning the process to its exit
    return result


def _cache_env(root: Path) -> dict:
    """This process's environment with every cache variable pointing into a new folder of `root`."""
    env = dict(os.environ)
    for var, folder in CACHE_VARS.items():
        (root / folder).mkdir(parents=True)
        env[var] = str(root / folder)
    return env


def _peer(args: argparse.Namespace, env: dict) -> dict:
    """mlx-vlm's first run on the same empty caches, where it is installed."""
    if importlib.util.find_spec("mlx_vlm") is None:
        return {"peer": "mlx-vlm", "skipped": "mlx_vlm is not installed"}
    if not args.peer_model:
        return {"peer": "mlx-vlm", "skipped": "no --peer-model"}
    cmd = [sys.executable, "-m", "mlx_vlm.generate", "--model", args.peer_model, "--max-tokens", "32",
           "--prompt", "Say hello."]
    out = {"peer": "mlx-vlm", "model": args.peer_model}
    for run in ("first", "second"):
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        out[f"{run}_wall_s"] = time.perf_counter() - start
        if proc.returncode != 0:
            out["error"] = f"exit {proc.returncode}: {proc.stderr[-1000:]}"
            break
    return out


def _summary(results: list[dict]) -> dict:
    by = {r["run"]: r for r in results if "error" not in r}
    s: dict = {}
    if "first" in by:
        s["first_run_end_to_end_s"] = by["first"]["end_to_end_s"]
    if "first-precompile" in by:
        s["first_run_precompiled_end_to_end_s"] = by["first-precompile"]["end_to_end_s"]
        s["precompile_s"] = by["first-precompile"]["precompile_s"]
    if "second" in by:
        g1, g2 = by["second"]["generate_1"], by["second"]["generate_2"]
        s["second_process_load_s"] = by["second"]["load_s"]
        s["second_process_end_to_end_s"] = by["second"]["end_to_end_s"]
        s["fresh_ms_per_frame"], s["warm_ms_per_frame"] = g1["ms_per_frame"], g2["ms_per_frame"]
        s["fresh_over_warm"] = g1["ms_per_frame"] / g2["ms_per_frame"]
    if "warmup" in by:
        g1, g2 = by["warmup"]["generate_1"], by["warmup"]["generate_2"]
        s["warmup_load_s"] = by["warmup"]["load_s"]
        s["fresh_after_warmup_over_warm"] = g1["ms_per_frame"] / g2["ms_per_frame"]
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("tiny", "full"), default="tiny")
    p.add_argument("--seconds", type=float, default=10.7, help="input length (the bundled question + silence)")
    p.add_argument("--precompile", action="store_true",
                   help="add the first-precompile run (its own empty caches; voicechat.precompile after load)")
    p.add_argument("--runs", help=f"which runs, in order, of {', '.join(RUNS)} (default: all but first-precompile, "
                                  "which --precompile adds)")
    p.add_argument("--peer", choices=("mlx-vlm",), help="also time a peer's first run, where it is installed")
    p.add_argument("--peer-model", help="the model the peer runs (a hub id or folder)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--keep", action="store_true", help="keep the temp dir of caches (its path is printed)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    p.add_argument("--in-memory", action="store_true", help="full size: random weights made in memory in each run")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child == "setup":
        _write_full_checkpoint(Path(args.workdir))
        return 0
    if args.child:
        print(json.dumps(_child(args)))
        return 0
    runs = [r for r in (args.runs or ",".join(RUNS[:3])).split(",") if r]
    if args.precompile and "first-precompile" not in runs:
        runs.append("first-precompile")
    if any(r not in RUNS for r in runs):
        p.error(f"--runs: each of {', '.join(RUNS)}")

    workdir = Path(tempfile.mkdtemp(prefix="vc-bench-cold-"))
    env, env_own = _cache_env(workdir / "shared"), _cache_env(workdir / "own")
    checkpoint = None
    try:
        setup = time.perf_counter()
        if args.size == "tiny":
            from voicechat.synthetic import make_checkpoint

            checkpoint = str(make_checkpoint(workdir / "tiny", "tiny"))
        elif not args.in_memory:  # made in a process of its own, whose device memory is then free again
            checkpoint = str(workdir / "full")
            subprocess.run([sys.executable, __file__, "--child", "setup", "--workdir", checkpoint],
                           env=_cache_env(workdir / "setup"), check=True, timeout=args.timeout)  # (its kernels apart)
        setup_s = time.perf_counter() - setup
        results = []
        for run in runs:
            if not args.json:
                print(f"run {run} ...", file=sys.stderr)
            # second and warmup run on the caches that first left, or first-precompile without first
            own = run == "first-precompile" and "first" in runs
            results.append(_run_child(run, args, env_own if own else env, workdir, checkpoint))
        report = {"size": args.size, "seconds": args.seconds, "weights": "in memory" if checkpoint is None else "on disk",
                  "setup_s": setup_s, "summary": _summary(results), "runs": results}
        if args.peer:
            report["peer"] = _peer(args, _cache_env(workdir / "peer"))  # the peer's own empty caches
        if args.keep:
            report["workdir"] = str(workdir)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            _print(report)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _print(report: dict) -> None:
    print(f"size {report['size']}, {report['seconds']} s input, weights {report['weights']} "
          f"(setup {report['setup_s']:.1f} s)")
    for r in report["runs"]:
        if "error" in r:
            print(f"  {r['run']}: {r['error']}\n{r['stderr_tail']}")
            continue
        g1, g2 = r["generate_1"], r["generate_2"]
        pre = (f", precompile {r['precompile_s']:.1f} s ({r['precompile_kernels']} kernels, "
               f"{r['precompile_own_kernels']} of ours, {r['precompile_processes']} worker processes)"
               if "precompile_s" in r else "")
        print(f"  {r['run']:7s} load {r['load_s']:.2f} s (char table: {r['char_table']}){pre}, "
              f"generate {g1['s']:.2f} s ({g1['ms_per_frame']:.1f} ms/frame), then {g2['s']:.2f} s "
              f"({g2['ms_per_frame']:.1f} ms/frame); end to end {r['end_to_end_s']:.1f} s, "
              f"{r['kernels_compiled']} kernels compiled, process {r['wall_s']:.1f} s")
        print(f"          load stages: " + ", ".join(f"{k} {v:.2f} s" for k, v in r["load_stages_s"].items()))
    for k, v in report["summary"].items():
        print(f"  {k}: {v:.3f}")
    if "peer" in report:
        print(f"  peer: {report['peer']}")


if __name__ == "__main__":
    sys.exit(main())
