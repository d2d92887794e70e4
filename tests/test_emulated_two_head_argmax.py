"""The two-head argmax (vc_two_head_argmax_stream: both heads' 16-row slabs on the streamed
integer-MMA walk, each block's best keys; then vc_argmax_finish over the blocks' keys), run under the
CPU emulation (tests/cuda_emulation.py), gives numpy's argmax of the reference logits: ties to the
first index, a NaN the largest (the first one)."""

from __future__ import annotations

import copy
import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import (CUDA_TYPE, SOURCES, Case, as_float, compile_emulated, emulate, mutated, normal, promote,
                            quantized, run_mutant)


def _argmax_heads(n, k, m, x_dtype):
    """Two 4-bit heads [n, k] as (weight, scales, biases) each, flat, and x [m, k], with ties and NaNs
    (below), and the reference logits of each (rounded to the output dtype, as float32)."""
    heads = []
    for seed in (1, 2):
        w, s, b = quantized(n, k, 4, 64, mx.bfloat16, seed=seed)
        heads.append([np.array(w), np.array(s.view(mx.uint16)), np.array(b.view(mx.uint16))])
    x = normal((m, k), x_dtype)

    def logits(h):
        w, s, b = mx.array(h[0]), mx.array(h[1]).view(mx.bfloat16), mx.array(h[2]).view(mx.bfloat16)
        with mx.stream(mx.cpu):
            out = mx.quantized_matmul(x.astype(mx.float32), w, s, b, transpose=True, group_size=64, bits=4)
            return np.array(out.astype(promote(x_dtype, mx.bfloat16)).astype(mx.float32))

    # Ties: head a's best row again one row earlier and in another block. Head b: NaN logits (NaN
    # scales) in the last block, a negative NaN first: NaN wins whatever its sign, the first one.
    top = int(np.argmax(logits(heads[0])[0]))
    for dst in (top - 1, top % 7):
        for part in heads[0]:
            part[dst] = part[top]
    heads[1][1][n - 3] = 0xFFC0
    heads[1][1][n - 1] = 0x7FC0
    arrays = [mx.array(a) if i == 0 else mx.array(a).view(mx.bfloat16) for h in heads for i, a in enumerate(h)]
    return x, arrays, [logits(heads[0]), logits(heads[1])]


def argmax_stream_case(n, k, m, x_dtype, write_logits, warps, blocks, w_offset=0):
    """Both heads' slabs walked by a persistent grid of `blocks` blocks, 2 in flight; w_offset > 0
    misaligns head b's weight, so the blocks copy every slab themselves (the heads' own pointers
    through HeadsWalk)."""
    x, arrays, ref = _argmax_heads(n, k, m, x_dtype)
    out = promote(x_dtype, mx.bfloat16)
    args = dict(K=k, N=2 * n, M=m, WARPS=warps, STAGES=2, WRITE_LOGITS=write_logits, TX=x_dtype, TS=mx.bfloat16,
                TO=out)
    case = Case("vc_two_head_argmax_stream", args, [x, *arrays],
                [("int64_t", (m, 2, blocks)), (CUDA_TYPE[out], (2, m, n) if write_logits else (1,))], blocks,
                32 * warps, [0, 0, 0, 0, w_offset, 0, 0])
    return case, ref


def finish_case(m, nb):
    """The finish kernel over the blocks' keys: a block for each row of x and head."""
    return Case("vc_argmax_finish", dict(NB=nb, THREADS=256), [mx.zeros((m * 2 * nb,), mx.int64)],
                [("int32_t", (m, 2))], m * 2, 256)


# two rows of bfloat16 x with the logits; one row of float32 x; head b's weight misaligned (the
# blocks' own copies): (n, k, m, x dtype, write logits, warps, blocks[, w_offset])
CONFIGS = {"argmax_stream_bf16_logits": (256, 512, 2, mx.bfloat16, True, 4, 3),
           "argmax_stream_f32": (256, 512, 1, mx.float32, False, 4, 2),
           "argmax_stream_own_copies": (128, 1024, 1, mx.float32, True, 8, 3, 1)}


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    cases = {name: argmax_stream_case(*config) for name, config in CONFIGS.items()}
    for name, config in CONFIGS.items():
        cases[name + "_finish"] = (finish_case(config[2], config[6]), None)
    return emulate(tmp_path_factory, "two_head_argmax", cases)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_head_argmax_kernels_emulated(emulated, name):
    case, (ref_a, ref_b) = emulated.cases[name], emulated.refs[name]
    keys, logits = emulated.run(name)
    finish = copy.copy(emulated.cases[name + "_finish"])
    finish.inputs = [mx.array(keys.reshape(-1))]
    (ids,) = emulated.run(name + "_finish", finish)
    want = np.stack([np.argmax(ref_a, -1), np.argmax(ref_b, -1)], -1)  # numpy: first max, first NaN
    assert np.isnan(ref_b).any() and int(want[0, 1]) == int(np.flatnonzero(np.isnan(ref_b[0]))[0])
    np.testing.assert_array_equal(ids, want)
    if case.template_args["WRITE_LOGITS"]:
        t = case.outputs[1][0]
        for got, ref in zip(logits, (ref_a, ref_b)):
            np.testing.assert_allclose(as_float(got, t), ref, rtol=8e-3, atol=8e-3 * np.nanmax(np.abs(ref)))


@pytest.mark.parametrize("replacement", [
    "",  # no block zeroes its keys: they start as the shared memory does
    "if (blockIdx.x == 0) best_keys[threadIdx.x] = 0ull;",  # only the first block: the others rely on it carrying over
])
def test_keys_that_start_from_shared_memory_as_it_is_fail(emulated, tmp_path, replacement):
    """A hazard the emulation must catch: the argmax kernel's blocks not zeroing their best keys in
    shared memory (all of them, or all but the first) start from garbage, and the ids the finish takes
    from the blocks' keys are not the argmax. (Were shared memory zero at first and kept from block to
    block, both would give the right ids.)"""
    name = "argmax_stream_f32"
    case = mutated(emulated.cases[name], r"best_keys\[threadIdx\.x\] = 0ull;", 1, replacement)
    outputs, _ = run_mutant(case, tmp_path)
    ref_a, ref_b = emulated.refs[name]
    want = np.stack([np.argmax(ref_a, -1), np.argmax(ref_b, -1)], -1)
    if outputs is not None:
        best = outputs[0].view(np.uint64).max(-1)  # [m, head]: what the finish kernel takes
        ids = (~(best & np.uint64(0xFFFFFFFF))).astype(np.uint32).astype(np.int64)
        assert not np.array_equal(ids, want)


KEY_VALUES = [[1.0, 3.0, 3.0, -1.0], [-0.0, 0.0], [0.0, -0.0, -1e-30], [-np.inf, -np.inf], [-5.0, -2.0, -2.0, -7.0],
              [1.0, np.nan, 3.0, np.nan], [np.inf, np.nan], [-np.nan, 2.0], [np.inf, 1e38, np.inf], [-3e38, -np.inf]]


def test_argmax_keys_order_like_mx_argmax(tmp_path):
    """vc_gemv::argmax_key (the kernels' header, compiled for the emulation): the index of the largest
    key of each list is mx.argmax's (equal values to the first index, -0 equal to +0, every NaN above
    +inf, the first NaN)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    blocks = []
    for values in KEY_VALUES:
        bits = ", ".join(f"0x{b:08x}u" for b in np.array(values, np.float32).view(np.uint32))
        blocks.append(f"""  {{
    const unsigned int v[] = {{{bits}}};
    unsigned long long best = 0;
    for (int i = 0; i < {len(values)}; ++i) {{
      const unsigned long long key = vc_gemv::argmax_key(__uint_as_float(v[i]), i);
      best = key > best ? key : best;
    }}
    std::printf("%u\\n", ~static_cast<unsigned int>(best));
  }}""")
    text = "\n".join(['#include "cuda_emu.h"', "#include <cstdio>", SOURCES["vc_two_head_argmax_stream"]["header"],
                      "int main() {", *blocks, "  return 0;", "}"])
    exe = compile_emulated(text, tmp_path / "keys", opt="-O0")
    got = [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    assert got == [int(mx.argmax(mx.array(np.array(v, np.float32)))) for v in KEY_VALUES]
