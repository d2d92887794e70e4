"""The C++ stand-ins the CPU emulation runs where a kernel has inline PTX (`#ifdef __CUDA_ARCH__ ...
#else`), held to the PTX ISA's definition of each instruction, written here from the ISA: lop3.b32
(vc_gemv::under_magic, vc_gemv::pair_word), dp4a.u32.s32 (vc_levels::dp4a), mma.sync m16n8k32
.u8.s8 (vc_imma::mma and its fragment layout), the cluster's rank and distributed shared memory
(vc_cluster::rank / load_remote), and cp.async.bulk with its mbarrier (vc_stream): the bytes land
once the phase is waited for, not before."""

from __future__ import annotations

import subprocess

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import SOURCES, Case, compile_emulated, emulate

RNG = np.random.default_rng(5)
WORDS = [int(w) for w in RNG.integers(0, 2**32, 64, dtype=np.uint64)] + [0, 0xFFFFFFFF, 0x80000000, 0x0F0F0F0F]


def lop3(a: int, b: int, c: int, lut: int) -> int:
    """lop3.b32: bit i of the result is bit (a_i << 2 | b_i << 1 | c_i) of the immediate table (the
    table of F is F(0xF0, 0xCC, 0xAA))."""
    out = 0
    for i in range(32):
        index = ((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1)
        out |= ((lut >> index) & 1) << i
    return out


def dp4a_u32_s32(a: int, b: int, c: int) -> int:
    """dp4a.u32.s32 d, a, b, c: c plus the four products of a's bytes (zero-extended) and b's bytes
    (sign-extended), as a 32-bit two's complement sum."""
    total = c
    for i in range(4):
        ua = (a >> (8 * i)) & 0xFF
        sb = (b >> (8 * i)) & 0xFF
        total += ua * (sb - 256 if sb >= 128 else sb)
    return (total + 2**31) % 2**32 - 2**31


def _printed(tmp_path, header: str, lines: list[str]) -> list[int]:
    """The values a program made of `header` and `lines` (C++ statements printing one integer a line)
    prints, compiled against the emulation."""
    text = "\n".join(['#include "cuda_emu.h"', "#include <cstdio>", header, "int main() {", *lines, "  return 0;", "}"])
    exe = compile_emulated(text, tmp_path / "ptx", opt="-O0")
    return [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]


def test_lop3_stand_ins_are_lop3(tmp_path):
    """under_magic<MASK>(v) is lop3.b32 v, MASK, 0x4B000000, 0xEA; pair_word<S>(v) is lop3.b32 of v
    shifted (S = 0: left by 3, else right by 4 S - 3), 0x00780078, 0x41804180, 0xEA."""
    masks = [0x000000FF, 0x0000FF00, 0x007F0000]
    lines = []
    for v in WORDS:
        lines += [f'  std::printf("%u\\n", vc_gemv::under_magic<{m}u>({v}u));' for m in masks]
        lines += [f'  std::printf("%u\\n", vc_gemv::pair_word<{s}>({v}u));' for s in range(4)]
    got = _printed(tmp_path, SOURCES["vc_qmv"]["header"], lines)
    want = []
    for v in WORDS:
        want += [lop3(v, m, 0x4B000000, 0xEA) for m in masks]
        want += [lop3((v << 3) & 0xFFFFFFFF if s == 0 else v >> (4 * s - 3), 0x00780078, 0x41804180, 0xEA)
                 for s in range(4)]
    assert got == want


def test_dp4a_stand_in_is_dp4a_u32_s32(tmp_path):
    triples = [(WORDS[i], WORDS[i + 1], int(RNG.integers(-2**30, 2**30))) for i in range(0, 64, 2)]
    triples += [(0xFFFFFFFF, 0x80808080, 0), (0xFFFFFFFF, 0x7F7F7F7F, -5), (0x01020304, 0xFF00FF01, 2**31 - 600)]
    lines = [f'  std::printf("%d\\n", vc_levels::dp4a({a}u, {b}u, {c}));' for a, b, c in triples]
    assert _printed(tmp_path, SOURCES["vc_qmv_stream"]["header"], lines) == [dp4a_u32_s32(*t) for t in triples]


def _fragments(a: np.ndarray, b: np.ndarray, c: np.ndarray):
    """The m16n8k32 .u8 / .s8 / .s32 fragments of A [16, 32], B [32, 8], C [16, 8] a lane holds
    (lane = 4 groupID + threadID_in_group), by the ISA's tables: A's element i (register i / 4, byte
    i % 4) at row groupID (i < 4 or 8 <= i < 12, else + 8), column 4 threadID_in_group + i % 4 (+ 16
    from i = 8); B's element i at row 4 threadID_in_group + i % 4 (+ 16 from i = 4), column groupID;
    C's element i at row groupID (+ 8 from i = 2), column 2 threadID_in_group + i % 2."""
    ra, rb, rc = np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32), np.zeros((32, 4), np.int32)
    for lane in range(32):
        g, t = lane >> 2, lane % 4
        for i in range(16):
            row = g if i < 4 or 8 <= i < 12 else g + 8
            col = 4 * t + (i & 3) + (16 if i >= 8 else 0)
            ra[lane, i // 4] |= np.uint32(int(a[row, col]) & 0xFF) << np.uint32(8 * (i % 4))
        for i in range(8):
            row = 4 * t + (i & 3) + (16 if i >= 4 else 0)
            rb[lane, i // 4] |= np.uint32(int(b[row, g]) & 0xFF) << np.uint32(8 * (i % 4))
        for i in range(4):
            rc[lane, i] = c[g + (8 if i >= 2 else 0), 2 * t + (i & 1)]
    return ra, rb, rc


MMA = {"name": "ptx_mma", "input_names": ["a", "b", "c"], "output_names": ["d"], "cluster": 1,
       "header": SOURCES["vc_qmv_imma_stream"]["header"], "source": """
  const int lane = threadIdx.x;
  unsigned int ra[4], rb[2];
  int rd[4];
  for (int i = 0; i < 4; ++i) ra[i] = a[lane * 4 + i];
  for (int i = 0; i < 2; ++i) rb[i] = b[lane * 2 + i];
  for (int i = 0; i < 4; ++i) rd[i] = c[lane * 4 + i];
  vc_imma::mma(rd, ra, rb);
  for (int i = 0; i < 4; ++i) d[lane * 4 + i] = rd[i];
"""}

# Each block r of a cluster of 4 writes 100 + its rank into its shared memory, and after the cluster's
# barrier reads that word of every block of the cluster (mapa + ld.shared::cluster).
CLUSTER = {"name": "ptx_cluster", "input_names": ["unused"], "output_names": ["seen"], "cluster": 4,
           "header": SOURCES["vc_rvq_cluster"]["header"], "source": """
  VC_CLUSTER_SMEM(smem);
  unsigned long long* word = reinterpret_cast<unsigned long long*>(smem);
  const unsigned int rank = vc_cluster::rank();
  if (threadIdx.x == 0) *word = 100 + rank;
  vc_cluster::sync();
  if (threadIdx.x < 4) seen[blockIdx.x * 5 + threadIdx.x] = static_cast<int>(vc_cluster::load_remote(word, threadIdx.x));
  if (threadIdx.x == 4) seen[blockIdx.x * 5 + 4] = static_cast<int>(rank);
  vc_cluster::sync();
"""}

# One warp: a bulk copy of 256 bytes into dynamic shared memory under an mbarrier; every lane reads its
# two words before the wait and after it.
BULK = {"name": "ptx_bulk", "input_names": ["src"], "output_names": ["before", "after"], "cluster": 1,
        "header": SOURCES["vc_qmv_stream"]["header"], "source": """
  VC_DYNAMIC_SMEM(smem);
  __shared__ unsigned long long bar;
  const int lane = threadIdx.x;
  unsigned int* dst = reinterpret_cast<unsigned int*>(smem + 1024);
  if (lane == 0) {
    vc_stream::bar_init(&bar);
    vc_stream::bar_expect(&bar, 256);
  }
  __syncwarp();
  if (lane < 2) vc_stream::bulk_copy(dst + 32 * lane, src + 32 * lane, 128, &bar);
  __syncwarp();
  for (int i = 0; i < 2; ++i) before[lane * 2 + i] = dst[lane * 2 + i];
  __syncwarp();
  vc_stream::bar_wait(&bar, 0);
  for (int i = 0; i < 2; ++i) after[lane * 2 + i] = dst[lane * 2 + i];
"""}


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    a = RNG.integers(0, 256, (16, 32))
    b = RNG.integers(-128, 128, (32, 8))
    c = RNG.integers(-2**20, 2**20, (16, 8))
    ra, rb, rc = _fragments(a, b, c)
    mma = Case(MMA, {}, [mx.array(ra.reshape(-1)), mx.array(rb.reshape(-1)), mx.array(rc.reshape(-1))],
               [("int32_t", (32, 4))], 1, 32)
    cluster = Case(CLUSTER, {}, [mx.zeros((1,), mx.int32)], [("int32_t", (8, 5))], 8, 32)
    src = mx.array(RNG.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32))
    bulk = Case(BULK, {}, [src], [("uint32_t", (64,)), ("uint32_t", (64,))], 1, 32)
    want_d = _fragments(a, b, a @ b + c)[2]  # D = A B + C, laid out as C
    return emulate(tmp_path_factory, "ptx",
                   {"mma_lanes": (mma, want_d), "cluster_ranks": (cluster, None), "copy_at_wait": (bulk, src)})


def test_mma_stand_in_is_mma_m16n8k32_u8_s8(emulated):
    """Each lane's D fragment is D = A B + C's elements at the ISA's places for that lane."""
    (d,) = emulated.run("mma_lanes")
    np.testing.assert_array_equal(d, emulated.refs["mma_lanes"])


def test_cluster_stand_ins_are_its_rank_and_distributed_shared_memory(emulated):
    """%cluster_ctarank is a block's place in its cluster of 4 consecutive blocks; mapa + ld.shared::
    cluster read the same address of the named block's shared memory."""
    (seen,) = emulated.run("cluster_ranks")
    for blk in range(8):
        assert seen[blk].tolist() == [100, 101, 102, 103, blk % 4], seen[blk]


def test_a_bulk_copy_lands_when_its_phase_is_waited_for(emulated):
    """Before the mbarrier wait the destination holds none of the source's words (a copy in flight
    owns its bytes: garbage here); after it, the source exactly."""
    before, after = emulated.run("copy_at_wait")
    src = np.array(emulated.refs["copy_at_wait"])
    np.testing.assert_array_equal(after, src)
    assert not np.any(before == src)
