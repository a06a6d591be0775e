"""How much KV cache a context costs: DS4's compressed cache against the dense caches of a model of the same
shape, counted from the config's dimensions alone (docs/MODEL.md, "Where the KV state lives").

Every scheme is counted in cached values per token position times ``bytes_per_value`` (2: the F16 DS4 stores
its rows in, and the F16/BF16 the dense caches are usually kept in), so the numbers compare the layouts, not
the number formats:

- ``ds4``: what a DS4 session holds after ``n`` tokens, every layer: the raw window (at most ``swa`` rows),
  ⌊n/R⌋ compressed rows, ⌊n/4⌋ indexer rows on ratio-4 layers, and the compressors' pending states.
- ``shared row``: one uncompressed ``head_dim`` row per token and layer (DS4's K = V row, kept for every
  position: what the compression saves is the gap to ``ds4``).
- ``MLA``: a DeepSeek-V3-style latent per token and layer, ``head_dim`` values plus a decoupled RoPE key of
  ``n_rot``.
- ``GQA``: keys and values of ``gqa_heads`` heads of ``head_dim`` per token and layer.
- ``MHA``: keys and values of every one of ``n_head`` heads of ``head_dim`` per token and layer.
"""

from __future__ import annotations

from .layout import raw_live_rows, state_values

SCHEMES = ("ds4", "shared row", "MLA", "GQA", "MHA")
GQA_HEADS = 8  # a common choice (Llama 3 70B's eight KV heads)


def ds4_values(cfg, n_tokens: int) -> int:
    """Values DS4 caches after ``n_tokens`` tokens: every layer's live raw rows, compressed and indexer rows and
    pending compressor states, as a checkpoint's payload holds them (its header and logits aside)."""
    return state_values(cfg, n_tokens, raw_live_rows(n_tokens, cfg.swa))


def cache_bytes(cfg, n_tokens: int, bytes_per_value: int = 2, gqa_heads: int = GQA_HEADS) -> dict[str, int]:
    """Bytes each of :data:`SCHEMES` caches for ``n_tokens`` tokens of a model shaped as ``cfg``."""
    n, L = int(n_tokens), cfg.n_layer
    values = {
        "ds4": ds4_values(cfg, n),
        "shared row": n * L * cfg.head_dim,
        "MLA": n * L * (cfg.head_dim + cfg.n_rot),
        "GQA": n * L * 2 * gqa_heads * cfg.head_dim,
        "MHA": n * L * 2 * cfg.n_head * cfg.head_dim,
    }
    return {k: v * bytes_per_value for k, v in values.items()}


def cache_table(cfg, contexts=(1 << 10, 1 << 13, 1 << 16, 1 << 17, 1 << 20), bytes_per_value: int = 2,
                gqa_heads: int = GQA_HEADS) -> list[dict]:
    """Rows ``{"tokens", "scheme", "bytes"}`` of :func:`cache_bytes` over ``contexts`` (for a chart or a table)."""
    return [dict(tokens=int(n), scheme=k, bytes=b) for n in contexts
            for k, b in cache_bytes(cfg, n, bytes_per_value, gqa_heads).items()]
