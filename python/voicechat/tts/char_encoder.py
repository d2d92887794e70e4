"""Text conditioning of EAR-TTS: the char-aware subword encoder (`embed_subword.*`).

A subword id becomes the characters of its token string, looked up in a dense character
vocabulary (the tokenizer's single-character tokens sorted by id; index 256 pads); characters
outside that vocabulary are dropped. The characters go through `embed_tokens * sqrt(hidden)`, one
T5Gemma encoder layer (bidirectional, RoPE, tanh soft-capped scores, padding mask), the final
norm, a masked mean over characters (an empty sequence pools to zero) and `proj_embedding`. Then
the subword-flag and BOS/EOS embeddings are added at every position, masked or not.

The encoder output depends on the subword id alone, so `table()` computes it once for every id;
a step's conditioning is then one row gather.
"""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import CharacterEncoderConfig
from .layers import GatedMLP, OffsetRMSNorm

# Character positions per batch when tabulating the whole vocabulary (bounds peak memory).
_TABLE_BATCH_CHARS = 1 << 13
# Padded widths of the table's batches: every batch of one bucket has the same shape, so a GPU
# compiles the encoder's kernels for a handful of shapes, not for every word length.
_TABLE_WIDTHS = (4, 8, 16, 32)


class CharVocabularyError(ValueError):
    """The tokenizer's single-character tokens do not match the checkpoint's char embedding."""


def rotate_half_rope(x: mx.array, base: float) -> mx.array:
    """RoPE at positions 0..T-1 of x [..., T, D] in the rotate-half form (mx.fast.rope's
    traditional=False): pairs (x_i, x_{i + D/2}) turn by t * base^(-2i / D)."""
    t, d = x.shape[-2], x.shape[-1]
    half = d // 2
    inv_freq = base ** (-mx.arange(0, half, dtype=mx.float32) * (2.0 / d))
    angles = mx.arange(t, dtype=mx.float32)[:, None] * inv_freq[None, :]
    cos, sin = mx.cos(angles), mx.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class EncoderAttention(nn.Module):
    """T5Gemma self-attention: no q/k norms, scores `tanh(s / cap) * cap`, key padding mask."""

    def __init__(self, cfg: CharacterEncoderConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        self.softcap = float(cfg.attn_logit_softcapping)
        self.rope_base = float(cfg.rope_base)
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)

    def __call__(self, x: mx.array, key_mask: mx.array) -> mx.array:
        """x [N, C, hidden], key_mask [N, C] (True = a real character)."""
        n, c, _ = x.shape
        q = self.q_proj(x).reshape(n, c, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(n, c, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(n, c, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        # Composed RoPE (rotate-half): this runs at load time over batches of thousands of
        # subwords, where mlx-cuda 0.32.4's fast.rope launch failed (cudaGraphAddKernelNode).
        q, k = rotate_half_rope(q, self.rope_base), rotate_half_rope(k, self.rope_base)
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
        scores = (q * self.scale) @ k.transpose(0, 1, 3, 2)
        scores = mx.tanh(scores / self.softcap) * self.softcap
        # A finite floor, not -inf: a sequence with no characters must not produce NaNs (its
        # rows are discarded by the pooling anyway).
        scores = mx.where(key_mask[:, None, None, :], scores, mx.finfo(mx.float32).min)
        out = mx.softmax(scores, axis=-1, precise=True) @ v
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(n, c, -1))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: CharacterEncoderConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = EncoderAttention(cfg)
        self.mlp = GatedMLP(h, cfg.intermediate_size)
        self.pre_self_attn_layernorm = OffsetRMSNorm(h, eps)
        self.post_self_attn_layernorm = OffsetRMSNorm(h, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps)

    def __call__(self, x: mx.array, key_mask: mx.array) -> mx.array:
        x = x + self.post_self_attn_layernorm(self.self_attn(self.pre_self_attn_layernorm(x), key_mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class T5GemmaEncoder(nn.Module):
    """`encoder.layers.N.*`, `encoder.norm` (the embedding lives outside, in `embed_tokens`)."""

    def __init__(self, cfg: CharacterEncoderConfig):
        super().__init__()
        self.layers = [EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, key_mask: mx.array) -> mx.array:
        for layer in self.layers:
            x = layer(x, key_mask)
        return self.norm(x)


class _EncoderHolder(nn.Module):
    """The checkpoint nests the encoder as `backbone.encoder`."""

    def __init__(self, cfg: CharacterEncoderConfig):
        super().__init__()
        self.encoder = T5GemmaEncoder(cfg)


def _safe_ids(ids: mx.array, vocab: int, pad: mx.array) -> mx.array:
    """Ids outside the text vocabulary index the stored pad entry."""
    return mx.where(ids >= vocab, pad.astype(ids.dtype), ids)


class SubwordFlagEmbedding(nn.Module):
    """`cont_emb[is_continuation[id]]` (`is_continuation` holds vocab + 1 flags)."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.cont_emb = nn.Embedding(2, hidden)
        self.is_continuation = mx.zeros((vocab_size + 1,), mx.int32)
        self.pad_tensor = mx.array(vocab_size, mx.int32)

    def __call__(self, ids: mx.array) -> mx.array:
        flags = self.is_continuation[_safe_ids(ids, self.vocab_size, self.pad_tensor)]
        return self.cont_emb(flags).astype(mx.float32)


class BosEosEmbedding(nn.Module):
    """`special_emb[special_flags[id]]` (0 regular, 1 BOS, 2 EOS)."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.special_emb = nn.Embedding(3, hidden)
        self.special_flags = mx.zeros((vocab_size,), mx.int32)
        self.pad_tensor = mx.array(vocab_size - 1, mx.int32)

    def __call__(self, ids: mx.array) -> mx.array:
        flags = self.special_flags[_safe_ids(ids, self.vocab_size, self.pad_tensor)]
        return self.special_emb(flags).astype(mx.float32)


class SubwordChars:
    """Every subword's char-vocabulary ids, as two flat arrays: `lengths [vocab]` and `flat` (the
    ids of subword 0, then 1, ...). Not a list of tuples: a module attribute that is a list is
    walked by every tree traversal of the model (131072 tuples at full size)."""

    def __init__(self, lengths: np.ndarray, flat: np.ndarray):
        self.lengths = lengths.astype(np.int32)
        self.flat = flat.astype(np.int32)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)[:-1]])

    @classmethod
    def build(cls, vocab: dict[str, int], chars: list[str], vocab_size: int) -> "SubwordChars":
        """Each id's token of `vocab` (token -> id) as indices into `chars` (the char vocabulary),
        the characters outside it dropped; ids without a token have none."""
        tokens = [""] * vocab_size
        for token, i in vocab.items():
            if 0 <= i < vocab_size:
                tokens[i] = token
        lengths = np.fromiter(map(len, tokens), np.int64, vocab_size)
        points = np.frombuffer("".join(tokens).encode("utf-32-le", "surrogatepass"), np.uint32)
        known = np.array([ord(c) for c in chars], np.uint32)
        order = np.argsort(known, kind="stable")
        at = np.minimum(np.searchsorted(known[order], points), len(known) - 1)
        kept = known[order][at] == points
        owner = np.repeat(np.arange(vocab_size), lengths)
        return cls(np.bincount(owner[kept], minlength=vocab_size), order[at][kept])

    def digest(self) -> str:
        """sha256 of the map (the char table's key)."""
        return hashlib.sha256(self.lengths.tobytes() + b"\0" + self.flat.tobytes()).hexdigest()

    def __getitem__(self, i: int) -> tuple[int, ...]:
        start = int(self.starts[i])
        return tuple(self.flat[start : start + int(self.lengths[i])].tolist())


class CharAwareSubwordEncoder(nn.Module):
    """`embed_subword.*`: subword id -> hidden vector, from the id's characters."""

    def __init__(self, cfg: CharacterEncoderConfig, vocab_size: int):
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.vocab_size = vocab_size
        self.char_pad = cfg.char_vocab_size - 1  # the last char embedding row pads
        self.backbone = _EncoderHolder(cfg)
        self.embed_tokens = nn.Embedding(cfg.char_vocab_size, cfg.hidden_size)
        self.proj_embedding = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.subword_flag_emb = SubwordFlagEmbedding(vocab_size, cfg.hidden_size)
        self.bos_eos_emb = BosEosEmbedding(vocab_size, cfg.hidden_size)
        self._chars: SubwordChars | None = None
        self.vocabulary_digest: str | None = None  # sha256 of the subword -> chars map (the table's key)

    # ------------------------------------------------------------------ vocabulary

    def set_tokenizer(self, tokenizer) -> None:
        """Build the dense char vocabulary and every subword's char ids from a `TextTokenizer`."""
        vocab = tokenizer.vocab()
        singles = tokenizer.single_character_tokens(vocab)  # (id, token), sorted by id
        if len(singles) != self.char_pad:
            raise CharVocabularyError(
                f"the tokenizer has {len(singles)} single-character tokens, but the TTS char encoder "
                f"embeds {self.char_pad} characters (+1 padding); this tokenizer does not belong to "
                "this checkpoint")
        self._chars = SubwordChars.build(vocab, [token for _, token in singles], self.vocab_size)
        self.vocabulary_digest = self._chars.digest()

    @property
    def has_vocabulary(self) -> bool:
        return self._chars is not None

    def char_ids(self, subword_id: int) -> tuple[int, ...]:
        """Char-vocabulary ids of one subword (empty outside the text vocabulary)."""
        if self._chars is None:
            raise RuntimeError("the TTS char encoder has no vocabulary yet: call set_tokenizer(tokenizer)")
        return self._chars[subword_id] if 0 <= subword_id < self.vocab_size else ()

    # ------------------------------------------------------------------ encoding

    def encode_chars(self, char_ids: mx.array, lengths: mx.array) -> mx.array:
        """Padded char ids [N, C] with lengths [N] -> pooled, projected [N, hidden] (float32)."""
        c = char_ids.shape[1]
        key_mask = mx.arange(c)[None, :] < lengths[:, None]
        scale = mx.array(math.sqrt(self.hidden_size), mx.float32)
        x = self.embed_tokens(char_ids).astype(mx.float32) * scale
        x = self.backbone.encoder(x, key_mask)
        x = mx.where(key_mask[..., None], x, 0.0)
        pooled = x.sum(axis=1) / mx.maximum(lengths, 1).astype(mx.float32)[:, None]
        return self.proj_embedding(pooled)

    def flags(self, ids: mx.array) -> mx.array:
        """The subword-flag and BOS/EOS embeddings of `ids` ([..., hidden], float32)."""
        return self.subword_flag_emb(ids) + self.bos_eos_emb(ids)

    def _padded(self, ids: Sequence[int], width: int = 0) -> tuple[mx.array, mx.array]:
        seqs = [self.char_ids(int(i)) for i in ids]
        width = max([len(s) for s in seqs] + [1, width])
        out = np.full((len(seqs), width), self.char_pad, np.int32)
        for row, s in enumerate(seqs):
            out[row, : len(s)] = s
        return mx.array(out), mx.array(np.array([len(s) for s in seqs], np.int32))

    def __call__(self, ids, mask=None) -> mx.array:
        """The per-id encoder: `ids [B, T]` -> `[B, T, hidden]` (float32).

        Only positions where `mask` is true run the char encoder; the others stay zero. The flag
        embeddings are added everywhere."""
        ids_np = np.asarray(ids, dtype=np.int64)
        mask_np = np.ones(ids_np.shape, bool) if mask is None else np.asarray(mask, dtype=bool)
        out = mx.zeros(ids_np.shape + (self.hidden_size,), mx.float32)
        where = np.nonzero(mask_np)
        if len(where[0]):
            chars, lengths = self._padded(ids_np[where].tolist())
            out[tuple(mx.array(w) for w in where)] = self.encode_chars(chars, lengths)
        return out + self.flags(mx.array(ids_np.astype(np.int32)))

    def table(self) -> mx.array:
        """`[vocab + 1, hidden]` float32: the encoder output with flags for every id, the last
        row for ids outside the vocabulary (pad flags, no characters)."""
        if self._chars is None:
            raise RuntimeError("the TTS char encoder has no vocabulary yet: call set_tokenizer(tokenizer)")
        by_width: dict[int, list[int]] = {}
        for i, n in enumerate(self._chars.lengths.tolist()):
            if n:
                width = next((w for w in _TABLE_WIDTHS if n <= w), -(-n // 64) * 64)
                by_width.setdefault(width, []).append(i)
        table = mx.zeros((self.vocab_size + 1, self.hidden_size), mx.float32)
        # Batches of one bucket share a shape: the last is filled up with repeats of its first id
        # (written twice, the same value). Each is evaluated before the next is built.
        for width, members in sorted(by_width.items()):
            count = min(len(members), max(1, _TABLE_BATCH_CHARS // width))
            for start in range(0, len(members), count):
                batch = members[start : start + count]
                batch += batch[:1] * (count - len(batch))
                chars, lengths = self._padded(batch, width)
                table[mx.array(batch)] = self.encode_chars(chars, lengths)
                mx.eval(table)
        table = table + self.flags(mx.arange(self.vocab_size + 1, dtype=mx.int32))
        mx.eval(table)
        return table
