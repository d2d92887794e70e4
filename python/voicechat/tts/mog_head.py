"""The mixture-of-Gaussians head of EAR-TTS (`mog_head.*`), inference only.

`infer(x [2, T, hidden])`: three residual gated-MLP layers and a final offset norm, classifier-free
guidance `cond + g * (cond - uncond)`, mixture logits with top-p masking, one component picked by
Gumbel-max, its low-rank mean `low_mat[c] @ (proj_mus[c] @ x)`, and the shared log-std
`max(proj_logs(x), min_log_std)`; returns `(mu * exp(logs) + proj_else(x), logs)` for the
guided row only.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..config import MogHeadConfig
from ..kernels.gemv import linear, stack_linears
from ..kernels.mog_sample import choose_component, component_mean, mog_sample
from .layers import GatedMLP, OffsetRMSNorm, add_and_norm, add_and_norm_guided, add_and_norm_linear, norm_linear


class MLPLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, eps: float):
        super().__init__()
        self.pre_norm = OffsetRMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, intermediate)
        self.post_norm = OffsetRMSNorm(hidden, eps)

    def __call__(self, x: mx.array) -> mx.array:
        return x + self.post_norm(self.mlp(self.pre_norm(x)))


class MoGHead(nn.Module):
    def __init__(self, hidden: int, latent: int, cfg: MogHeadConfig):
        super().__init__()
        self.hidden, self.latent = hidden, latent
        self.num_predictions, self.low_rank = cfg.num_predictions, cfg.low_rank
        self.min_log_std = float(cfg.min_log_std)
        self.mlp_stack = [MLPLayer(hidden, cfg.intermediate_size, cfg.eps) for _ in range(cfg.num_layers)]
        self.mlp_stack.append(OffsetRMSNorm(hidden, cfg.eps))
        self.proj_logits = nn.Linear(hidden, cfg.num_predictions, bias=False)
        self.proj_mus = nn.Linear(hidden, cfg.num_predictions * cfg.low_rank, bias=False)
        self.proj_logs = nn.Linear(hidden, 1, bias=False)
        self.proj_else = nn.Linear(hidden, latent, bias=False)
        self.low_mat = mx.zeros((cfg.num_predictions, latent, cfg.low_rank))
        self._heads = None  # proj_logits, proj_logs and proj_else as one layer (`stack()`)

    def stack(self) -> None:
        self._heads = stack_linears([self.proj_logits, self.proj_logs, self.proj_else])

    def unstack(self) -> None:
        self._heads = None

    def projections(self, h: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(proj_logits(h), proj_logs(h), proj_else(h)): one launch once stacked."""
        if self._heads is None:
            return self.proj_logits(h), self.proj_logs(h), self.proj_else(h)
        n = self.num_predictions
        return tuple(mx.split(self._heads(h), [n, n + 1], axis=-1))

    def trunk(self, x: mx.array, add: mx.array | None = None, guidance: float | None = None,
              sessions: int = 1) -> mx.array:
        """`mlp_stack` in order (each layer `x + post(mlp(pre(x)))`, then the final norm) on `x + add`
        (or `x`), each norm seam between two of them one `add_and_norm`, with the next layer's gate/up
        projection in the same launch once stacked (`add_and_norm_linear`; the first layer's input
        norm and the add: `norm_linear`). With `guidance`, the CFG pair's guided row `cond + g *
        (cond - uncond)` comes out of the last seam's launch (`add_and_norm_guided`). `sessions`: x holds
        that many sessions' CFG pairs (rows 2s, 2s + 1), each pair's bits those it has alone."""
        *layers, final = self.mlp_stack
        h = x.astype(mx.float32)
        if layers[0].mlp._gate_up is not None:
            h, gate_up = norm_linear(h, layers[0].pre_norm, layers[0].mlp._gate_up, add, sessions)
            z = None
        else:
            h = h if add is None else h + add.astype(mx.float32)
            z, gate_up = layers[0].pre_norm(h), None
        for i, layer in enumerate(layers):
            out = layer.mlp(z) if gate_up is None else layer.mlp.down_from(gate_up, sessions)
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            if nxt is None and guidance is not None:
                return add_and_norm_guided(h, out, layer.post_norm, final, guidance)
            if nxt is not None and nxt.mlp._gate_up is not None:
                h, gate_up = add_and_norm_linear(h, out, layer.post_norm, nxt.pre_norm, nxt.mlp._gate_up, sessions)
                z = None
            else:
                h, z = add_and_norm(h, out, layer.post_norm, nxt.pre_norm if nxt is not None else final)
                gate_up = None
        return z

    def infer(self, x: mx.array, guidance_scale: float, top_p: float, u: mx.array) -> tuple[mx.array, mx.array]:
        """x [2, T, hidden] (row 0 conditioned, row 1 not), `u` uniform noise [1, T, num_predictions].

        Returns `(mu [1, T, latent], logs [1, T, 1])` (float32)."""
        h = self.guided(x, guidance_scale)
        logits, log_std, rest = self.projections(h)
        mu = self.component_mean(h, choose_component(logits, top_p, u))
        logs = mx.maximum(log_std, self.min_log_std)
        return mu * mx.exp(logs) + rest, logs

    def guided(self, x: mx.array, guidance_scale: float, add: mx.array | None = None,
               sessions: int = 1) -> mx.array:
        """The trunk over both CFG rows of `x + add` (or `x`), then `cond + g * (cond - uncond)`:
        [1, T, hidden] (`[S, T, hidden]` for `sessions` S pairs)."""
        return self.trunk(x, add, guidance=guidance_scale, sessions=sessions)

    def sample(self, x: mx.array, guidance_scale: float, top_p: float, u: mx.array, noise: mx.array,
               noise_scale: float, add: mx.array | None = None, sessions: int = 1) -> mx.array:
        """One frame's draw `z = mu * s + rest + s * noise * noise_scale` (s = exp(logs)) from
        x [2, 1, hidden] (plus `add`, same shape, when given: added in the first layer's norm launch):
        the numbers of `infer` and that formula; on a CUDA GPU everything after the projections is
        one launch (`kernels.mog_sample`). `sessions` S: x holds S CFG pairs `[2 S, 1, hidden]` and
        u, noise a row each; returns `[S, 1, latent]`, each draw the one its session makes alone."""
        h = self.guided(x, guidance_scale, add, sessions)
        y = (linear(self._heads, h, sessions=sessions) if self._heads is not None
             else mx.concatenate(list(self.projections(h)), axis=-1))
        z, _ = mog_sample(y, h, u, noise, self.proj_mus.weight, self.low_mat, top_p, self.min_log_std, noise_scale,
                          sessions=sessions)
        return z.reshape(sessions, 1, self.latent)

    def component_mean(self, h: mx.array, component: mx.array) -> mx.array:
        """`low_mat[c] @ (proj_mus.weight.reshape(n, r, hidden)[c] @ h)`, only the chosen rows."""
        return component_mean(h, component, self.proj_mus.weight, self.low_mat)
