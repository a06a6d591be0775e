"""Notebook views and charts (needs the ``notebook`` extra: anywidget, ipywidgets).

``PrefillView(session, prompt)`` (with the KV cache and a ``MaskView`` beside it), ``KVCacheView(session)``,
``MaskView.of_step(session, layer, pos0, n)``, ``AttentionView(capture)``,
``GenerationView(session, prompt)``, ``ExpertView(capture)`` (or ``ExpertView.from_prompt(session, prompt)``),
``TierView(session)`` and the chart builders of :mod:`ds4lab.viz.charts` (Vega-Lite specs, see
:mod:`ds4lab.viz.vegalite`). The widgets' front-end (an ESM per view, one shared stylesheet) is ``widgets/`` at
the repository root, shipped in the wheel as ``ds4lab.widgets``;
:mod:`ds4lab.viz.base` finds it and holds what the views share (``View``, ``FollowingView``, ``ViewModel``).
Charts render with no network (JupyterLab's own Vega-Lite renderer, a PNG fallback for saved notebooks);
``offline_charts()`` does the same for one's own Altair charts, whose HTML would load Vega from a CDN.
"""

from .attention_view import AttentionView
from .experts import ExpertView, capture_prefill
from .generation import GenerationView
from .kv_view import KVCacheView, kv_summary
from .mask_view import MaskView
from .prefill_view import PrefillView
from .tier_view import TierView
from .vegalite import Chart, chart_bundle, offline_charts

__all__ = [
    "AttentionView",
    "Chart",
    "ExpertView",
    "GenerationView",
    "KVCacheView",
    "MaskView",
    "PrefillView",
    "TierView",
    "capture_prefill",
    "chart_bundle",
    "kv_summary",
    "offline_charts",
]
