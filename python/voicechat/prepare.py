"""Readies a loaded model for decoding: the load-time casts, and our kernel layers swapped in.

This is the one place that swaps the fast layers in. On a CUDA GPU every projection of the LLM and
the TTS becomes a GEMV layer (`voicechat.kernels.gemv`): it reads 4-bit and bf16 weights as stored
and fuses what comes before and after the product (norms, residual adds, activations). Elsewhere
the model keeps MLX's layers, which compute the same values. The model files ask the kernel module
what a layer fuses (`linear`, `fuses_prenormed`) and never test a layer's class themselves.
"""

from __future__ import annotations

from .kernels.gemv import on_cuda_gpu, use_gemv
from .llm.nemotron_h import DuplexLM
from .tts.ear_tts import EarTTS


def decode_kernels_default() -> bool:
    """Our decode kernels run where the default device is a CUDA GPU."""
    return on_cuda_gpu()


def prepare_lm(lm: DuplexLM, kernels: bool | None = None) -> DuplexLM:
    """Casts the LLM's small weights once (`DuplexLM.cast_for_decoding`), swaps in the GEMV layers for
    every projection and both heads (`kernels`, default: on a CUDA GPU) and stacks each attention
    layer's q, k and v. Returns `lm`."""
    kernels = decode_kernels_default() if kernels is None else kernels
    # The GEMV layers read bf16 quantization scales as stored (half the bytes a step).
    lm.cast_for_decoding(keep_quantization_scales=kernels)
    lm.decode_kernels = kernels
    if kernels:
        use_gemv(lm.llm)
        lm.lm_head, lm.function_head = use_gemv(lm.lm_head), use_gemv(lm.function_head)
    for layer in lm.llm.layers:
        if layer.kind == "attention":
            layer.mixer.stack()
    return lm


def prepare_tts(tts: EarTTS, tokenizer, kernels: bool | None = None) -> EarTTS:
    """Swaps the GEMV layers into EAR-TTS (`kernels`, default: on a CUDA GPU: its batch-2 products
    read the bf16 weights as stored, with no per-call float32 copy), sets its tokenizer and does all
    load-time work (`EarTTS.prepare`). The char encoder's many-row calls keep MLX's matmul."""
    kernels = decode_kernels_default() if kernels is None else kernels
    tts.decode_kernels = kernels
    if kernels:
        use_gemv(tts)
    tts.set_tokenizer(tokenizer)
    tts.prepare()
    return tts


def prepare_listening(listening: DuplexLM, kernels: bool | None = None) -> None:
    """The listening model (`stt_model`): its LLM (`prepare_lm`) and its speech encoder's attention
    layers stacked."""
    prepare_lm(listening, kernels)
    listening.perception.encoder.prepare()
