"""Decode-speed matrix-vector products: a few rows of activations against a large weight.

At decode time every LLM projection, both 131072-wide heads and the TTS backbone's linears see
one or two rows (a few more when sessions step together); those products are bound by how fast the weights stream from memory. On a CUDA
GPU these functions run our kernels (csrc/kernels/gemv: 16-byte weight loads, float32
accumulation, float32 or bfloat16 activations at the same speed); elsewhere, and for shapes the
kernels do not take (other than 1, 2 or 4 rows for 4-bit weights, more than 2 for dense ones, K
not a multiple of 8 for dense weights), MLX's own ops, which are also the `_reference` twins. A
4-bit shape takes the same layout and launch at 1, 2 and 4 rows, so each row's output has the same
bits whichever rows come with it.

- `quantized_matvec(x, w, scales, biases, group_size=64, bits=4)`: `mx.quantized_matmul(...,
  transpose=True)` for MLX's affine 4- / 8-bit packing, same output dtype.
- `dense_matvec(x, w)`: `x @ w.T`, same output dtype.
- `two_head_argmax(h, head_a, head_b)`: the argmax of both quantized heads over the same hidden
  state in one pass, without writing the logits first: int32 ids `[..., 2]` (head_a, head_b).
  Ties go to the first index and a NaN logit counts as the largest (the first NaN wins), as
  `mx.argmax` does; the logits are compared as stored (rounded to the output dtype).
- Both take an epilogue done in the same launch: `squared_relu=True` (`relu(y)^2`) or
  `residual=r` (`y + r`, a residual stream of the output's shape).
- Norms carried between launches (`Prenormed`): a norm's output left as its input times its
  weight plus partial sums of the input's squares, so that the matvec reading it applies the scale
  (`quantized_matvec(..., prenormed=...)`) and no launch of its own forms it.
  `quantized_matvec_emit_norm` is the `+ residual` matvec that leaves the next RMSNorm so; the
  Mamba conv + scan kernel leaves its gated group norm so.
- `GemvQuantizedLinear` / `GemvLinear`: drop-in layers using the kernels on a CUDA GPU for the rows
  they take; `use_gemv(model)` swaps them in for every `nn.QuantizedLinear` / `nn.Linear`;
  `linear(layer, x, residual=..., squared_relu=..., emit_norm=...)` applies any layer with an
  epilogue (`x` may be `Prenormed`); `stack_linears(layers)` makes one layer of several over the
  same input (one launch).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from ._native import build_info, ext, use_reference

MAX_ROWS = 2  # input rows the dense kernels take
QUANTIZED_ROWS = (1, 2, 4)  # input rows the 4-bit kernels take
_CUDA_BUILD = build_info()["backend"] == "cuda"


def on_cuda_gpu() -> bool:
    """True when the default stream is a CUDA GPU (where the kernels run)."""
    return _CUDA_BUILD and mx.default_device().type == mx.DeviceType.gpu


def rows_of(x: mx.array) -> int:
    return x.size // x.shape[-1] if x.ndim else 0


# --------------------------------------------------------------------------- epilogues

def relu_squared(y: mx.array) -> mx.array:
    return mx.square(nn.relu(y))


def _epilogue(y, residual, squared_relu: bool):
    """What the kernels fuse after the product, in MLX ops: relu(y)^2, or y + residual."""
    if residual is not None and squared_relu:
        raise ValueError("a residual and an activation cannot be fused together")
    y = relu_squared(y) if squared_relu else y
    return y if residual is None else y + residual


def _activation(squared_relu: bool) -> str:
    return "relu_squared" if squared_relu else ""


# --------------------------------------------------------------------------- norms carried between launches

class Prenormed(NamedTuple):
    """A (group) RMSNorm's output, not yet formed: `weighted` [..., K] is the norm's input times its
    weight, `partials` [..., P] float32 partial sums of the input's squares, `groups` equal channel
    groups each summed over P / groups consecutive partials (1: one RMSNorm over all K). The norm's
    output is `weighted * rsqrt(sum / (K / groups) + eps)` per group (`resolve()`); a quantized
    matvec applies that scale in its own launch."""

    weighted: mx.array
    partials: mx.array
    groups: int
    eps: float

    @property
    def shape(self):
        return self.weighted.shape

    def resolve(self) -> mx.array:
        """The normalized array, in MLX ops (float32)."""
        x, k = self.weighted.astype(mx.float32), self.weighted.shape[-1]
        lead, g = x.shape[:-1], self.groups
        sums = self.partials.astype(mx.float32).reshape(*lead, g, -1).sum(-1, keepdims=True)
        scaled = x.reshape(*lead, g, k // g) * mx.rsqrt(sums / (k // g) + self.eps)
        return scaled.reshape(x.shape)


def resolved(x):
    """`x` itself, or the normalized array a `Prenormed` stands for (MLX ops)."""
    return x.resolve() if isinstance(x, Prenormed) else x


# --------------------------------------------------------------------------- quantized

def quantized_matvec_reference(x, w, scales, biases, group_size: int = 64, bits: int = 4, *, bias=None,
                               residual=None, squared_relu: bool = False):
    x = resolved(x)
    y = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    return _epilogue(y if bias is None else y + bias, residual, squared_relu)


def _prenorm_args(x) -> tuple[mx.array, dict]:
    if isinstance(x, Prenormed):
        return x.weighted, dict(prenormed=x.partials, prenorm_groups=x.groups, norm_eps=float(x.eps))
    return x, {}


def quantized_matvec(x, w, scales, biases, group_size: int = 64, bits: int = 4, *, bias=None, residual=None,
                     squared_relu: bool = False, stream=None):
    """`x @ dequantize(w).T (+ bias)`, then `relu(.)^2` (`squared_relu`) or `+ residual` [..., N];
    `x` [..., K] or `Prenormed` (its scales applied in the same launch), w packed uint32
    [N, K * bits / 32]. On CUDA the launch follows the shape: for one row of x on sm_90 the streamed
    integer-MMA layout at the wide outputs of a narrow input (K < 8192, N >= 8192), the streamed
    layout where K >= 8192, the block layout elsewhere (csrc/ops/gemv.cpp)."""
    if use_reference():
        return quantized_matvec_reference(x, w, scales, biases, group_size, bits, bias=bias, residual=residual,
                                          squared_relu=squared_relu)
    x, pre = _prenorm_args(x)
    return ext.quantized_matvec(x, w, scales, biases, bias, group_size, bits, residual=residual,
                                activation=_activation(squared_relu), stream=stream, **pre)


def quantized_matvec_emit_norm_reference(x, w, scales, biases, residual, next_norm, group_size: int = 64,
                                         bits: int = 4, *, bias=None, eps: float = 1e-5):
    out = quantized_matvec_reference(x, w, scales, biases, group_size, bits, bias=bias, residual=residual)
    out32 = out.astype(mx.float32)
    return out, Prenormed(out32 * next_norm.astype(mx.float32), mx.sum(mx.square(out32), -1, keepdims=True), 1, eps)


def quantized_matvec_emit_norm(x, w, scales, biases, residual, next_norm, group_size: int = 64, bits: int = 4, *,
                               bias=None, eps: float = 1e-5, stream=None):
    """`(out, Prenormed)`: `out = x @ dequantize(w).T (+ bias) + residual` as `quantized_matvec`'s, and
    `rms_norm(out, next_norm, eps)` left for the next quantized matvec to apply (the next block's
    input norm, formed by no launch of its own). One launch on a CUDA GPU."""
    if use_reference():
        return quantized_matvec_emit_norm_reference(x, w, scales, biases, residual, next_norm, group_size, bits,
                                                    bias=bias, eps=eps)
    x, pre = _prenorm_args(x)
    out, weighted, partials = ext.quantized_matvec_emit_norm(x, w, scales, biases, residual, next_norm, bias,
                                                             group_size, bits, stream=stream, **pre)
    return out, Prenormed(weighted, partials, 1, eps)


# --------------------------------------------------------------------------- dense

def gelu_gate(x: mx.array) -> mx.array:
    """`gelu_approx(x[..., :K]) * x[..., K:]` of a `[..., 2K]` gate / up output."""
    gate, up = mx.split(x, 2, axis=-1)
    return nn.gelu_approx(gate) * up


def dense_matvec_reference(x, w, *, bias=None, residual=None, squared_relu: bool = False,
                           gated_input: bool = False):
    x = gelu_gate(x) if gated_input else x
    return _epilogue(x @ w.T if bias is None else mx.addmm(bias, x, w.T), residual, squared_relu)


def dense_matvec(x, w, *, bias=None, residual=None, squared_relu: bool = False, gated_input: bool = False,
                 sessions: int = 1, stream=None):
    """`x @ w.T (+ bias)`, then the epilogue as `quantized_matvec`'s; `x` [..., K], w [N, K].
    `gated_input`: x is `[..., 2K]` (gate, up) and `gelu_gate(x)` is the product's input; the kernel
    forms it as it loads x (no launch of its own). `sessions`: x's rows are that many equal groups
    (a session's CFG pair each), in one launch, each group's rows with the bits of its product alone."""
    if use_reference():
        return dense_matvec_reference(x, w, bias=bias, residual=residual, squared_relu=squared_relu,
                                      gated_input=gated_input)
    return ext.dense_matvec(x, w, bias, residual=residual, activation=_activation(squared_relu),
                            input="gelu_gate" if gated_input else "", sessions=sessions, stream=stream)


# --------------------------------------------------------------------------- two heads

def _head_arrays(head: nn.QuantizedLinear) -> tuple[mx.array, mx.array, mx.array]:
    return head["weight"], head["scales"], head["biases"]


def _heads_fit(a: nn.Module, b: nn.Module) -> bool:
    """Both heads affine-quantized alike, without a Linear bias: what the fused kernel takes."""
    if not (isinstance(a, nn.QuantizedLinear) and isinstance(b, nn.QuantizedLinear)):
        return False
    if a.mode != "affine" or b.mode != "affine" or "bias" in a or "bias" in b:
        return False
    if (a.group_size, a.bits) != (b.group_size, b.bits):
        return False
    return all(p.shape == q.shape and p.dtype == q.dtype for p, q in zip(_head_arrays(a), _head_arrays(b)))


def two_head_argmax_reference(h, head_a, head_b, return_logits: bool = False):
    logits_a, logits_b = head_a(h), head_b(h)
    ids = mx.stack([mx.argmax(logits_a, axis=-1), mx.argmax(logits_b, axis=-1)], axis=-1).astype(mx.int32)
    return (ids, logits_a, logits_b) if return_logits else ids


def two_head_argmax(h, head_a, head_b, return_logits: bool = False, *, stream=None):
    """argmax of `head_a(h)` and of `head_b(h)` as int32 ids [..., 2], in one pass over both.

    With `return_logits`, `(ids, logits_a, logits_b)`. On an sm_90 GPU one launch walks both heads'
    16-row slabs (and a second picks the best of its blocks' keys); heads that are not whole 16-row
    slabs, and other backends, take MLX's ops.
    """
    if use_reference() or not _heads_fit(head_a, head_b):
        return two_head_argmax_reference(h, head_a, head_b, return_logits)
    out = ext.two_head_argmax(h, _head_arrays(head_a), _head_arrays(head_b), head_a.group_size, head_a.bits,
                              return_logits, stream=stream)
    return tuple(out) if return_logits else out[0]


# --------------------------------------------------------------------------- layers

def gemv_applies(x, quantized: bool = False, sessions: int = 1) -> bool:
    """Whether our GEMV layers run their kernels for `x` (an array or `Prenormed`) on a CUDA GPU:
    1-2 rows for dense weights, 1, 2 or 4 for `quantized` ones; with `sessions`, that many a
    session (x's rows in equal groups)."""
    x = x.weighted if isinstance(x, Prenormed) else x
    rows, left = divmod(rows_of(x), sessions)
    fits = not left and (rows in QUANTIZED_ROWS if quantized else 1 <= rows <= MAX_ROWS)
    return fits and on_cuda_gpu() and not use_reference()


def _same_arrays(cls, layer: nn.Module):
    """A `cls` instance holding `layer`'s arrays and settings (no copies)."""
    new = cls.__new__(cls)
    new.__dict__.update(layer.__dict__)
    new._no_grad = set(layer._no_grad)
    dict.update(new, layer)
    return new


class GemvQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` that runs `quantized_matvec` for 1, 2 or 4 rows on a CUDA GPU."""

    @classmethod
    def from_quantized_linear(cls, layer: nn.QuantizedLinear) -> "GemvQuantizedLinear":
        return _same_arrays(cls, layer)

    def __call__(self, x, *, residual=None, squared_relu: bool = False):
        """`layer(x)`, then `relu(.)^2` or `+ residual`: one launch on the kernel path. `x` may be
        `Prenormed` (applied in the same launch there)."""
        if self.mode == "affine" and gemv_applies(x, quantized=True):
            return quantized_matvec(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits,
                                    bias=self.get("bias"), residual=residual, squared_relu=squared_relu)
        x = resolved(x)
        return _epilogue(super().__call__(x), residual, squared_relu)

    def emit_norm(self, x, residual, norm: nn.RMSNorm):
        """`(layer(x) + residual, Prenormed norm of that)` on the kernel path (one launch), else
        `(layer(x) + residual, None)`."""
        if self.mode == "affine" and gemv_applies(x, quantized=True):
            return quantized_matvec_emit_norm(x, self["weight"], self["scales"], self["biases"], residual,
                                              norm.weight, self.group_size, self.bits, bias=self.get("bias"),
                                              eps=norm.eps)
        return self(x, residual=residual), None


class GemvLinear(nn.Linear):
    """`nn.Linear` that runs `dense_matvec` for 1-2 rows on a CUDA GPU."""

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> "GemvLinear":
        return _same_arrays(cls, layer)

    def __call__(self, x, *, residual=None, squared_relu: bool = False, gated_input: bool = False,
                 sessions: int = 1):
        """`layer(x)` with the epilogue; `gated_input`: `layer(gelu_gate(x))` (one launch on the kernel
        path). `sessions`: x's rows are that many equal groups, each with the bits of its product alone."""
        x = resolved(x)
        if gemv_applies(x, sessions=sessions):
            return dense_matvec(x, self["weight"], bias=self.get("bias"), residual=residual,
                                squared_relu=squared_relu, gated_input=gated_input, sessions=sessions)
        return _epilogue(super().__call__(gelu_gate(x) if gated_input else x), residual, squared_relu)


def fuses_prenormed(layer: nn.Module, x) -> bool:
    """Whether `linear(layer, x)` applies a `Prenormed` input's scales in its own launch (our
    quantized GEMV layer at a shape the kernel takes), so a producer may hand it one."""
    return isinstance(layer, GemvQuantizedLinear) and layer.mode == "affine" and gemv_applies(x, quantized=True)


def linear(layer: nn.Module, x, *, residual=None, squared_relu: bool = False, emit_norm: nn.RMSNorm | None = None,
           gated_input: bool = False, sessions: int = 1):
    """`layer(x)` then `relu(.)^2` or `+ residual`, fused into the GEMV when `layer` is one of ours
    (composed otherwise: the same ops the kernel path is held to). `x` may be `Prenormed`.

    `emit_norm` (with `residual`): returns `(out, Prenormed or None)`, the second `emit_norm(out)`
    left for the next quantized matvec when the kernel formed it (`GemvQuantizedLinear.emit_norm`),
    None when the caller has to apply the norm itself. `gated_input`: `layer(gelu_gate(x))`, the gate
    formed as our dense GEMV loads x. `sessions` (dense layers): x's rows are that many equal groups
    (sessions stepped together), each group's bits those of its product alone."""
    if gated_input:
        if isinstance(layer, GemvLinear):
            return layer(x, residual=residual, squared_relu=squared_relu, gated_input=True, sessions=sessions)
        return _epilogue(layer(gelu_gate(resolved(x))), residual, squared_relu)
    if emit_norm is not None:
        if isinstance(layer, GemvQuantizedLinear):
            return layer.emit_norm(x, residual, emit_norm)
        return linear(layer, x, residual=residual), None
    if isinstance(layer, GemvLinear):
        return layer(x, residual=residual, squared_relu=squared_relu, sessions=sessions)
    if isinstance(layer, GemvQuantizedLinear):
        return layer(x, residual=residual, squared_relu=squared_relu)
    x = resolved(x)
    return _epilogue(layer(x), residual, squared_relu)


_DENSE = (nn.Linear, GemvLinear)
_QUANTIZED = (nn.QuantizedLinear, GemvQuantizedLinear)


def stack_linears(layers) -> nn.Module:
    """One layer whose output is the concatenation of `layers`' outputs over the same input: one
    launch instead of `len(layers)`. Layers of one class (`nn.Linear`, `GemvLinear`,
    `nn.QuantizedLinear` or `GemvQuantizedLinear`), all with or all without bias, quantized ones
    alike (mode, bits, group size); the result has that class. Each output row is computed as
    before (quantization is per row), so the values are the same. The given layers keep working:
    their arrays become views of the stacked ones (row ranges of one buffer), so stacking costs no
    memory."""
    first = layers[0]
    kind, has_bias = type(first), "bias" in first
    if kind not in _DENSE + _QUANTIZED or any(type(l) is not kind or ("bias" in l) != has_bias for l in layers):
        raise TypeError("stack_linears: layers of one class (nn.Linear, GemvLinear, nn.QuantizedLinear or "
                        "GemvQuantizedLinear), all with or without bias")
    quantized = kind in _QUANTIZED
    if quantized and len({(l.mode, l.bits, l.group_size) for l in layers}) != 1:
        raise ValueError("stack_linears: quantized layers must share mode, bits and group size")
    if len({l.weight.shape[1] for l in layers}) != 1:
        raise ValueError("stack_linears: the layers must share their input width")
    stacked = _same_arrays(kind, first)
    names = [n for n in ("weight", "scales", "biases", "bias") if n in first]
    for name in names:
        stacked[name] = mx.concatenate([l[name] for l in layers])
    mx.eval(stacked.parameters())
    start = 0
    for l in layers:
        n = l.weight.shape[0]
        for name in names:
            l[name] = stacked[name][start : start + n]
        start += n
        mx.eval(l.parameters())
    return stacked


def _swap(layer):
    if type(layer) is nn.QuantizedLinear and layer.mode == "affine":
        return GemvQuantizedLinear.from_quantized_linear(layer)
    if type(layer) is nn.Linear:
        return GemvLinear.from_linear(layer)
    return layer


def use_gemv(module: nn.Module) -> nn.Module:
    """Swap `GemvQuantizedLinear` / `GemvLinear` in for every `nn.QuantizedLinear` / `nn.Linear`
    of a loaded model, keeping its arrays. Returns the model (a new layer if `module` itself is
    one of those layers)."""
    if type(module) in (nn.QuantizedLinear, nn.Linear):
        return _swap(module)
    leaves = tree_map_with_path(lambda _, m: _swap(m), module.leaf_modules(), is_leaf=nn.Module.is_module)
    module.update_modules(leaves)
    return module
