"""The reference point for the LLM step: mlx-lm's own `nemotron_h` at the same config, 4-bit.

    VOICECHAT_BENCH_SIZE=full python -m pytest benchmarks/bench_reference_mlx_lm.py --benchmark-enable

One decode step = embedding lookup, the 56 layers with caches, `norm_f`, and both 131072-wide
heads (mlx-lm has one head; a second quantized head of the same shape is applied to the same
hidden state) with their argmax — the same work as `bench_llm.py::test_llm_step`. Random weights,
bf16, quantized with group 64 / 4 bits like the published checkpoint. Skipped when mlx-lm is
not installed (it is not a dependency of voicechat).
"""

from __future__ import annotations

import importlib
import os

import mlx.core as mx
import mlx.nn as nn
import pytest

from voicechat.config import VoiceChatConfig
from voicechat.synthetic import tiny_config

from bare_packages import bare_packages

SIZE = os.environ.get("VOICECHAT_BENCH_SIZE", "tiny")
CONTEXT = 64


def _mlx_lm_nemotron_h():
    """mlx-lm's model file without running `mlx_lm/__init__` (which imports transformers, absent
    from the GPU image)."""
    if not bare_packages("mlx_lm"):
        pytest.skip("mlx-lm is not installed")
    return importlib.import_module("mlx_lm.models.nemotron_h")


@pytest.fixture(scope="module")
def reference():
    nh = _mlx_lm_nemotron_h()
    t = (VoiceChatConfig() if SIZE == "full" else tiny_config()).text_config
    args = nh.ModelArgs(
        model_type="nemotron_h", vocab_size=t.vocab_size, hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size, max_position_embeddings=t.max_position_embeddings,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        attention_bias=t.attention_bias, mamba_num_heads=t.mamba_num_heads, mamba_head_dim=t.mamba_head_dim,
        mamba_proj_bias=t.mamba_proj_bias, ssm_state_size=t.ssm_state_size, conv_kernel=t.conv_kernel,
        n_groups=t.n_groups, mlp_bias=t.mlp_bias, layer_norm_epsilon=t.layer_norm_epsilon, use_bias=False,
        use_conv_bias=t.use_conv_bias, hybrid_override_pattern=list(t.hybrid_override_pattern),
        num_hidden_layers=t.num_hidden_layers, head_dim=t.head_dim)
    model = nh.Model(args)
    second_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)
    model.set_dtype(mx.bfloat16)
    second_head.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=64, bits=4)
    nn.quantize(second_head, group_size=64, bits=4)
    mx.eval(model.parameters(), second_head.parameters())
    cache = model.make_cache()
    mx.eval(model.backbone(mx.zeros((1, CONTEXT), mx.int32), cache=cache))
    return model, second_head, cache


def test_mlx_lm_step_both_heads(benchmark, reference):
    model, second_head, cache = reference
    token = mx.array([[12]], dtype=mx.int32)

    def step():
        hidden = model.backbone(token, cache=cache)
        ids = (mx.argmax(model.lm_head(hidden[:, -1]), -1), mx.argmax(second_head(hidden[:, -1]), -1))
        mx.eval(ids)

    step()
    benchmark.pedantic(step, rounds=30, iterations=1, warmup_rounds=3)
    benchmark.extra_info["size"] = SIZE


CHAIN = 40  # steps per pipelined chain, as bench_llm's


def test_mlx_lm_pipelined_step_both_heads(benchmark, reference):
    """CHAIN steps as mlx-lm's own generate loop runs them: each fed the previous step's argmax and
    queued with `mx.async_eval`, one wait at the end. ms a step is in `extra_info`."""
    model, second_head, cache = reference

    def chain():
        token = mx.array([[12]], dtype=mx.int32)
        for _ in range(CHAIN):
            hidden = model.backbone(token, cache=cache)[:, -1]
            token = mx.argmax(model.lm_head(hidden), -1, keepdims=True).astype(mx.int32)
            other = mx.argmax(second_head(hidden), -1)
            mx.async_eval(token, other)
        mx.eval(token, other)
        return token

    chain()
    assert benchmark.pedantic(chain, rounds=5, iterations=1, warmup_rounds=1).shape == (1, 1)
    if benchmark.stats:  # none with --benchmark-disable
        benchmark.extra_info.update(size=SIZE, chain=CHAIN, ms_per_step=1e3 * benchmark.stats.stats.min / CHAIN)
