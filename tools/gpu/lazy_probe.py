"""Which cache state differs between compiled LLM decode steps evaluated one at a time and the same
teacher-forced steps evaluated as one lazy graph (tests/test_nemotron_h.py's lazy-order test), with
each decode-path mechanism switched off in turn: the attention's in-place K/V write, the carried
norms (emit / prenormed), the gated norm left for out_proj. Run on the lent H200.

    python3 tools/gpu/lazy_probe.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

import voicechat.kernels.gemv as gemv
import voicechat.llm.nemotron_h as nh
from voicechat.checkpoint import open_checkpoint
from voicechat.testing import make_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_nemotron_h import stepped_and_lazy_decode  # noqa: E402  (the lazy-order test's own run)


def run(path: Path) -> str:
    ckpt = open_checkpoint(path)
    lm = nh.DuplexLM(ckpt.config.text_config, ckpt.config.function_channel_weight)
    ckpt.load_into(lm, "stt_model.", ignore=("perception.", "rnnt_decoder.", "rnnt_joint."))
    lm.prepare(decode_kernels=True)
    want, got, stepped, lazy = stepped_and_lazy_decode(lm)
    diffs = [f"{i}:{float(np.abs(np.array(a) - np.array(b)).max()):.3g}"
             for i, (a, b) in enumerate(zip(stepped, lazy)) if not np.array_equal(np.array(a), np.array(b))]
    return f"ids {'same' if got == want else 'DIFFER'}; states differing (index:max diff) {diffs or 'none'}"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp) / "tiny-q4", "tiny", quantize=4, dtype="bfloat16")
        print("all on:", run(path), flush=True)
        takes, emit = nh.plain_kernel_takes, gemv.GemvQuantizedLinear.emit_norm
        nh.plain_kernel_takes = lambda *a: False
        print("no in-place K/V write:", run(path), flush=True)
        nh.plain_kernel_takes = takes
        gemv.GemvQuantizedLinear.emit_norm = lambda self, x, residual, norm: (self(x, residual=residual), None)
        print("no carried RMSNorm:", run(path), flush=True)
        gemv.GemvQuantizedLinear.emit_norm = emit
        nh.gemv_applies = lambda x: False  # the mixer's check for leaving the gated norm to out_proj
        print("no carried gated norm:", run(path), flush=True)
        nh.plain_kernel_takes = lambda *a: False
        gemv.GemvQuantizedLinear.emit_norm = lambda self, x, residual, norm: (self(x, residual=residual), None)
        print("none of the three:", run(path), flush=True)


if __name__ == "__main__":
    main()
