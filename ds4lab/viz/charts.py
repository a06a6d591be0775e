"""Altair charts of a prefill (data reduced to one row per chunk and layer, far under Altair's row limit)."""

from __future__ import annotations


def _alt():
    import altair as alt

    return alt


def prefill_chunks_chart(chunks):
    """Tokens/s per chunk (bars) for a list of ``PrefillChunk``."""
    alt = _alt()
    rows = [
        dict(chunk=i, start=c.start, end=c.end, tokens=c.n_tokens, tokens_per_s=c.tokens_per_s, ms=c.seconds * 1e3)
        for i, c in enumerate(chunks)
    ]
    return (
        alt.Chart(alt.Data(values=rows))
        .mark_bar()
        .encode(
            x=alt.X("chunk:O", title="chunk"),
            y=alt.Y("tokens_per_s:Q", title="tokens/s"),
            tooltip=["chunk:O", "start:Q", "end:Q", "tokens:Q", "ms:Q", "tokens_per_s:Q"],
        )
        .properties(title="prefill speed per chunk", width=320, height=160)
    )


def kv_bytes_chart(session, chunks):
    """KV bytes after each chunk, per layer kind (raw only / ratio 4 / ratio 128), from the chunks' checkpoints."""
    alt = _alt()
    from ..kv.checkpoint import state_to_payload
    from ..kv.view import KVView

    cfg, b = session.model.config, session.model.backend
    rows = []
    for c in chunks:
        cp = c.checkpoint
        kv = KVView(cfg, state_to_payload(cfg, b, cp.state_for(cfg, b, session.geometry), cp.tokens, cp.logits))
        by_kind: dict[str, int] = {}
        for lk in kv:
            kind = f"ratio {lk.ratio}" if lk.ratio else "raw only"
            by_kind[kind] = by_kind.get(kind, 0) + lk.nbytes
        rows += [dict(tokens=c.end, kind=k, bytes=v) for k, v in by_kind.items()]
    return (
        alt.Chart(alt.Data(values=rows))
        .mark_line(point=True)
        .encode(
            x=alt.X("tokens:Q", title="tokens"),
            y=alt.Y("bytes:Q", title="KV bytes (all layers of the kind)"),
            color="kind:N",
            tooltip=["tokens:Q", "kind:N", "bytes:Q"],
        )
        .properties(title="KV bytes by layer kind", width=320, height=160)
    )
