"""Where an EAR-TTS frame's time goes: the backbone step, one MoG call, the 8-iteration code
generation and the whole step, each compiled, waited for (sync) and as a pipelined chain.

    PYTHONPATH=python python benchmarks/profile_tts_step.py [--size full] [--json out.json]

Full size: random bf16 weights at the published shapes, our GEMVs swapped in on a CUDA GPU as
`voicechat.load` does (`--no-gemv`: MLX's matmuls). The vocabulary is cut to 2048 ids there: it
only sizes the conditioning table (a row gather per step), and encoding all 131072 subwords is
load-time work that would cost this script minutes of kernel compiles. Also prints the
primitives each compiled graph runs (`opcount`). A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from mlx_settings import mlx_env

from voicechat.kernels.decode_attention import decode_attention, decode_attention_qkv
from voicechat.kernels.gemv import on_cuda_gpu, use_gemv
from voicechat.llm.opcount import by_kind, count_ops, kernel_count, op_labels
from voicechat.tokenizer import TextTokenizer
from voicechat.tts.backbone import write_step_kv
from voicechat.tts.ear_tts import EarTTS

PROMPT_FRAMES = 37
FULL_VOCAB_FOR_PROFILE = 2048


def _tts(size: str, gemv: bool):
    from bench_tts import _random_weights

    from voicechat.checkpoint import open_checkpoint
    from voicechat.config import VoiceChatConfig
    from voicechat.synthetic import build_tokenizer, make_checkpoint

    if size == "full":
        cfg = VoiceChatConfig()
        tts = EarTTS(cfg.tts_config, FULL_VOCAB_FOR_PROFILE)
        _random_weights(tts, mx.bfloat16)
        path = Path(tempfile.mkdtemp()) / "tokenizer.json"
        build_tokenizer(FULL_VOCAB_FOR_PROFILE).save(str(path))
        tokenizer_path = path
        aria = mx.random.normal((1, PROMPT_FRAMES, cfg.tts_config.hidden_size)).astype(mx.bfloat16)
    else:
        directory = make_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "tiny")
        ckpt = open_checkpoint(directory)
        cfg = ckpt.config
        tts = EarTTS(cfg.tts_config, cfg.text_config.vocab_size)
        ckpt.load_into(tts, "tts_model.tts_model.")
        tokenizer_path = directory / "tokenizer.json"
        aria = ckpt.tensors["tts_model.audio_prompt_latents.Aria"]
    if gemv and on_cuda_gpu():
        use_gemv(tts)
    tts.set_tokenizer(TextTokenizer(tokenizer_path))
    tts.prepare()
    cache = tts.make_cache()
    prompt = mx.zeros((1, PROMPT_FRAMES, tts.cfg.num_quantizers), mx.int32)
    previous = tts.warmup(aria, prompt, cache)
    mx.eval(previous, cache.buffers)
    return tts, cache, previous


def _advance(tts: EarTTS, cache, previous, offset: int):
    """Step the timeline until the cache holds `offset` positions: the attention's and the
    buffers' costs grow with them."""
    key, text = mx.random.key(0), mx.array([0], mx.int32)
    silence = mx.zeros((tts.cfg.num_quantizers,), mx.int32)
    while cache.offset < offset:
        previous, key = tts.step(previous, text, cache, key, silence)
        mx.async_eval(previous, key)
    mx.eval(previous, cache.buffers)
    return previous


def _stats(samples: list[float]) -> dict:
    return {"min_ms": 1e3 * min(samples), "median_ms": 1e3 * statistics.median(samples), "rounds": len(samples)}


def _time(run, rounds: int) -> dict:
    """run() builds one lazy result; each round evaluates it from an idle device and waits. Also
    `host_ms`: building it and queueing its kernels (`async_eval` returns once they are launched),
    the host's share of the round."""
    samples, host = [], []
    for _ in range(rounds + 3):
        mx.synchronize()
        t0 = time.perf_counter()
        out = run()
        mx.async_eval(out)
        t1 = time.perf_counter()
        mx.eval(out)
        samples.append(time.perf_counter() - t0)
        host.append(t1 - t0)
    return {**_stats(samples[3:]), "host_ms": _stats(host[3:])["median_ms"]}


def _ops(counts) -> dict:
    """The launches (`ops`) and, for reading where they go, the count of each primitive."""
    return {"ops": kernel_count(counts), "op_kinds": dict(counts.most_common())}


def _chain(step, first, length: int) -> dict:
    """`step(prev) -> next`, queued `length` times with async_eval: ms per link, steady state, and
    `host_ms` the host's time per link (building and queueing, with any wait MLX makes when too
    much is queued)."""
    per, host = [], []
    for _ in range(3):
        x = first
        mx.eval(x)
        t0 = time.perf_counter()
        busy = 0.0
        for _ in range(length):
            h0 = time.perf_counter()
            x = step(x)
            mx.async_eval(x)
            busy += time.perf_counter() - h0
        mx.eval(x)
        per.append((time.perf_counter() - t0) / length)
        host.append(busy / length)
    return {**_stats(per), "host_ms": _stats(host)["median_ms"]}


def profile(tts: EarTTS, cache, previous, rounds: int, chain: int) -> dict:
    cfg = tts.cfg
    h = cfg.hidden_size
    hidden = mx.random.normal((2, 1, h), key=mx.random.key(1))
    silence = mx.zeros((cfg.num_quantizers,), mx.int32)
    mx.eval(hidden)
    out = {}

    backbone = mx.compile(tts.backbone.step_arrays)
    cache.reserve(cache.offset + 1, 2)
    offset = mx.array(cache.offset, mx.int32)

    def backbone_once():
        return backbone(hidden, offset, cache.buffers, cache.pending)

    out["backbone"] = _time(backbone_once, rounds)
    out["backbone"].update(_ops(count_ops(backbone_once())))

    mog = mx.compile(lambda x, u, noise: tts.mog_head.sample(x, cfg.guidance_scale, cfg.top_p, u, noise,
                                                             cfg.noise_scale))
    u = mx.random.uniform(shape=(1, 1, tts.mog_head.num_predictions), key=mx.random.key(2))
    noise = mx.random.normal((1, 1, cfg.latent_size), key=mx.random.key(6))
    out["mog_sample"] = _time(lambda: mog(hidden, u, noise), rounds)
    out["mog_sample"].update(_ops(count_ops(mog(hidden, u, noise))))

    generate = mx.compile(tts.generate_codes)
    out["generate_codes"] = _time(lambda: generate(hidden, mx.random.key(3)), rounds)
    out["generate_codes"].update(_ops(count_ops(generate(hidden, mx.random.key(3)))))
    # Each link takes the previous key, and the codes are evaluated too (else only the keys would be).
    out["generate_codes_chain"] = _chain(lambda codes_key: generate(hidden, codes_key[1]),
                                         (previous, mx.random.key(4)), chain)

    state = {"previous": previous, "key": mx.random.key(0)}
    text = mx.array([100 % tts.vocab_size], mx.int32)

    def whole_step():
        # Same position every round (the cache offset is put back): a steady-state frame.
        start = cache.offset
        codes, key = tts.step(state["previous"], text, cache, state["key"], silence)
        cache.offset = start
        return codes, key

    out["step"] = _time(whole_step, rounds)
    # Counted on one step's outputs (a second step left lazy would also count the first's launches
    # its cache buffers hang on). op_labels: every launch by its label, compiled graphs by the ops
    # they fuse, for reading.
    labels = op_labels(*whole_step())
    out["step"].update(_ops(by_kind(labels)))
    out["step"]["op_labels"] = dict(labels.most_common())

    def linked(prev_and_key):
        codes, key = tts.step(prev_and_key[0], text, cache, prev_and_key[1], silence)
        return codes, key

    out["step_chain"] = _chain(linked, (previous, mx.random.key(5)), chain)
    return out


def backbone_parts(tts: EarTTS, cache, rounds: int) -> dict:
    """The backbone step cut into its parts, each over all layers in one compiled graph (every
    layer's own weights, so no two calls merge): where the step's time goes. The parts run on
    the same inputs each round, so their sum only approximates the chained step."""
    layers, backbone = tts.backbone.layers, tts.backbone
    h = tts.cfg.hidden_size
    x = mx.random.normal((2, 1, h), key=mx.random.key(7))
    cache.reserve(cache.offset + 1, 2)
    offset = mx.array(cache.offset, mx.int32)
    z = layers[0].input_layernorm(x)
    qkv = [layer.self_attn._qkv(z) for layer in layers]
    heads = [layer.self_attn.heads(q, offset) for layer, q in zip(layers, qkv)]
    buffers = [cache.layer_kv(i) for i in range(len(layers))]
    masks = [mx.arange(cache.capacity(i)) <= offset for i in range(len(layers))]
    slots = [offset if window is None else mx.remainder(offset, window) for window in cache.groups]
    news = [(k, v, slots[cache.place[i][0]]) for i, (_, k, v) in enumerate(heads)]
    mx.eval(x, z, qkv, heads, buffers, masks, slots)

    def attention():
        return [decode_attention(q, k, v, offset, layer.self_attn.scale, m, new=new)
                for layer, (q, _, _), (k, v), m, new in zip(layers, heads, buffers, masks, news)]

    in_place = backbone.writes_cache_in_place()

    def attention_from_qkv():  # what the step runs on CUDA: the head preparation inside the attention
        return [decode_attention_qkv(q, a.q_norm.scale, a.k_norm.scale, a._inv_freq, a.q_norm.eps, k, v, offset,
                                     a.scale, slot, a.n_heads, m, write_cache=in_place)[0]
                for a, q, (k, v), m, (_, _, slot) in zip((layer.self_attn for layer in layers), qkv, buffers,
                                                         masks, news)]

    new_kv = [[(k, v) for (_, k, v), (group, _) in zip(heads, cache.place) if group == g]
              for g in range(len(cache.groups))]

    def cache_writes():
        return write_step_kv(cache.buffers, new_kv, slots)

    core = attention()
    mx.eval(core)
    attn_out = [layer.self_attn.o_proj(c) for layer, c in zip(layers, core)]
    mx.eval(attn_out)
    parts = {
        "qkv_gemv": lambda: [layer.self_attn._qkv(z) for layer in layers],
        "qkv_heads": lambda: [layer.self_attn.heads(q, offset) for layer, q in zip(layers, qkv)],
        # where the attention launches write the keys in place, the step has no separate writes
        **({} if in_place else {"cache_writes": cache_writes}),
        "attention": attention,
        "attention_from_qkv": attention_from_qkv,
        "o_proj": lambda: [layer.self_attn.o_proj(c) for layer, c in zip(layers, core)],
        "after_attention": lambda: [layer.after_attention(x, a, backbone.norm_after(i), backbone._qkv_after(i))
                                    for i, (layer, a) in enumerate(zip(layers, attn_out))],
    }
    out = {}
    for name, fn in parts.items():
        compiled = mx.compile(fn)
        out[name] = _time(compiled, rounds)
        out[name].update(_ops(count_ops(*_flat(compiled()))))
    return out


def _flat(tree) -> list:
    if isinstance(tree, (list, tuple)):
        return [a for item in tree for a in _flat(item)]
    return [tree]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--no-gemv", action="store_true", help="MLX's matmuls, not our GEMV kernels")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--chain", type=int, default=30, help="steps per pipelined chain")
    parser.add_argument("--json")
    parser.add_argument("--no-parts", action="store_true", help="skip the backbone's parts")
    parser.add_argument("--context", default="0", help="timeline frames stepped after the warmup; several, "
                        "comma-separated (ascending), profile the step at each (the parts at the first)")
    args = parser.parse_args()
    contexts = [int(v) for v in args.context.split(",")]
    tts, cache, previous = _tts(args.size, gemv=not args.no_gemv)
    warm = cache.offset
    previous = _advance(tts, cache, previous, warm + contexts[0])
    parts = {} if args.no_parts else backbone_parts(tts, cache, args.rounds)
    results = {"size": args.size, "context": contexts[0], "device": str(mx.default_device()),
               "gemv": on_cuda_gpu() and not args.no_gemv, "mlx_env": mlx_env(),
               **profile(tts, cache, previous, args.rounds, args.chain),
               **{f"backbone.{k}": v for k, v in parts.items()}}
    for context in contexts[1:]:
        previous = _advance(tts, cache, previous, warm + context)
        later = profile(tts, cache, previous, args.rounds, args.chain)
        results.update({f"{k}@{context}": v for k, v in later.items()})
    print("mlx env:", results["mlx_env"] or "defaults")
    for part, s in results.items():
        if isinstance(s, dict) and "min_ms" in s:
            ops = f"  {s['ops']} ops" if "ops" in s else ""
            host = f"  host {s['host_ms']:6.2f} ms" if "host_ms" in s else ""
            print(f"{part:>22}: min {s['min_ms']:7.2f} ms  median {s['median_ms']:7.2f} ms{host}{ops}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
