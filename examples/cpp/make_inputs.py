"""Inputs and expected outputs for the C++ example (main.cpp), in one .safetensors file.

    python make_inputs.py example.safetensors

The expected outputs come from the pure-MLX references the kernel tests hold the ops to
(voicechat.kernels.*_reference), on the CPU; the scalar arguments ride in the file's metadata.
"""

import sys

import mlx.core as mx

from voicechat.kernels.mamba_scan import mamba_scan_reference
from voicechat.kernels.rel_pos_attention import rel_pos_attention_reference
from voicechat.kernels.rvq import codebook_norms, rvq_search_reference


def rvq(arrays: dict, meta: dict) -> None:
    """The RVQ search over a run of codebooks, as the TTS step runs it (one row)."""
    codebooks = mx.random.normal((8, 64, 16))
    residual = mx.random.normal((1, 16)) * 2.0
    start, count = 2, 5
    codes, rest = rvq_search_reference(residual, codebooks, start, count)
    arrays.update({"rvq.residual": residual, "rvq.codebooks": codebooks, "rvq.norms": codebook_norms(codebooks),
                   "rvq.codes": codes, "rvq.residual_out": rest})
    meta.update({"rvq.start": str(start), "rvq.count": str(count)})


def rel_pos(arrays: dict, meta: dict) -> None:
    """FastConformer rel-pos attention over 12 frames, chunks of 2 frames seeing 2 chunks back."""
    b, h, length, d = 1, 2, 12, 8
    q, k, v = (mx.random.normal((b, h, length, d)) for _ in range(3))
    p = mx.random.normal((h, 2 * length - 1, d))
    u, vb = mx.random.normal((h, d)) * 0.1, mx.random.normal((h, d)) * 0.1
    scale, left, right = d ** -0.5, 4, 1
    out = rel_pos_attention_reference(q, k, v, p, u, vb, scale, left, right)
    arrays.update({"rel.q": q, "rel.k": k, "rel.v": v, "rel.p": p, "rel.pos_bias_u": u, "rel.pos_bias_v": vb,
                   "rel.out": out})
    meta.update({"rel.scale": repr(scale), "rel.left": str(left), "rel.right": str(right)})


def mamba_step(arrays: dict, meta: dict) -> None:
    """One Mamba-2 decode step (L = 1) from a state: 4 heads of 8 channels in 2 groups, state size 16."""
    b, heads, p, groups, n = 1, 4, 8, 2, 16
    x = mx.random.normal((b, 1, heads, p))
    dt = mx.random.normal((b, 1, heads))
    a_log, d, dt_bias = mx.random.normal((heads,)) * 0.5, mx.random.normal((heads,)), mx.random.normal((heads,)) * 0.1
    bm, cm = mx.random.normal((b, 1, groups, n)), mx.random.normal((b, 1, groups, n))
    state = mx.random.normal((b, heads, p, n))
    y, state_out = mamba_scan_reference(x, dt, a_log, bm, cm, d, dt_bias, state)
    arrays.update({"mamba.x": x, "mamba.dt": dt, "mamba.A_log": a_log, "mamba.B": bm, "mamba.C": cm, "mamba.D": d,
                   "mamba.dt_bias": dt_bias, "mamba.state": state, "mamba.y": y, "mamba.state_out": state_out})


def main(path: str) -> None:
    mx.set_default_device(mx.cpu)
    mx.random.seed(0)
    arrays, meta = {}, {}
    for make in (rvq, rel_pos, mamba_step):
        make(arrays, meta)
    mx.eval(arrays)
    mx.save_safetensors(path, arrays, metadata=meta)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python make_inputs.py OUT.safetensors")
    main(sys.argv[1])
