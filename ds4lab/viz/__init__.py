"""Notebook views and charts (needs the ``notebook`` extra: anywidget, ipywidgets, altair).

``PrefillView(session, prompt)``, ``KVCacheView(session)``, ``AttentionView(capture)`` and Altair chart
builders in :mod:`ds4lab.viz.charts`. The widgets' front-end (ESM + CSS) is ``ds4lab/viz/static``.
"""

from .views import AttentionView, KVCacheView, PrefillView, kv_summary

__all__ = ["AttentionView", "KVCacheView", "PrefillView", "kv_summary"]
