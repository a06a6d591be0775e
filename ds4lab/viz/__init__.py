"""Notebook views and charts (needs the ``notebook`` extra: anywidget, ipywidgets, altair).

``PrefillView(session, prompt)``, ``KVCacheView(session)``, ``AttentionView(capture)``,
``GenerationView(session, prompt)``, ``ExpertView(capture)`` (or ``ExpertView.from_prompt(session, prompt)``),
``TierView(session)`` and Altair chart builders in :mod:`ds4lab.viz.charts`. The widgets' front-end (ESM +
CSS) is ``ds4lab/viz/static``.
"""

from .experts import ExpertView, capture_prefill
from .generation import GenerationView
from .tier_view import TierView
from .views import AttentionView, KVCacheView, PrefillView, kv_summary

__all__ = [
    "AttentionView",
    "ExpertView",
    "GenerationView",
    "KVCacheView",
    "PrefillView",
    "TierView",
    "capture_prefill",
    "kv_summary",
]
