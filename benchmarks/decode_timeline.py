"""Where a CuPy decode step's wall time goes beside its graph's replay: CUDA events around every replay of a
greedy decode (the session's own ``Decode.step``, steps launched ahead as the sweep runs them).

Per replay, on the GPU's clock: the copy of its arguments in, the graph, the copies of its outputs out (the new
state's own copy among them), and the time from its last copy to the next replay's first (the token of the step
launched ahead, the logits' and the ids' copies to the host, the tables' upload, and any time the GPU had nothing
queued). ``host_late`` is how long the GPU sat idle because the host had not yet called the next replay (the host's
clock put on the GPU's by one synchronised event; tens of microseconds of error). ``parts_us``: what of that time
between replays each of those launches takes on the stream (events around the session's calls of them: the device's
choice of the token ahead, the backend's fetches to the host and its uploads), medians in microseconds and how many a
replay. Used by ``flash_full.py --timeline N``; alone on a CPU it has nothing to measure.
"""

from __future__ import annotations

import time

import numpy as np


def timeline(sess, steps: int) -> dict:
    """Run ``steps`` greedy decode steps of ``sess`` (a CuPy session) with events around each graph replay, then put
    the session back where it was; returns the medians (ms) of each part and the steps' wall times."""
    import cupy as cp

    from ds4lab import session as session_module
    from ds4lab.cuda import driver, graphs

    replays, inside, launched = [], [], []
    call, launch = graphs._Captured.__call__, driver.GraphExec.launch
    backend_type = type(sess.model.backend)
    timed = {(session_module.Decode, "_choose_on_device"): "token ahead", (backend_type, "fetch"): "fetch to host",
             (backend_type, "upload"): "upload"}
    originals = {key: getattr(*key) for key in timed}

    def with_events(label, fn):
        def run(*args, **kwargs):
            stream = cp.cuda.get_current_stream()
            began, ended = cp.cuda.Event(), cp.cuda.Event()
            began.record(stream)
            out = fn(*args, **kwargs)
            ended.record(stream)
            launched.append((label, began, ended))
            return out
        return run

    def traced_call(self, args, *rest):
        stream = cp.cuda.get_current_stream()
        mark = {"host": time.perf_counter(), "ev": [cp.cuda.Event() for _ in range(4)]}
        replays.append(mark)
        mark["ev"][0].record(stream)
        inside.append(mark)
        try:
            out = call(self, args, *rest)
        finally:
            inside.pop()
        mark["ev"][3].record(stream)
        return out

    def traced_launch(self, stream):
        if not inside:  # a graph launched by something else than a replay (none in a decode step now)
            return launch(self, stream)
        inside[-1]["ev"][1].record(stream)
        launch(self, stream)
        inside[-1]["ev"][2].record(stream)

    snapshot = sess.checkpoint()
    decode = sess.decoder(top=1, exclude=[sess.model.tokenizer.eos_id], temperature=0.0, seed=0)
    stream = cp.cuda.get_current_stream()
    stream.synchronize()
    ref = cp.cuda.Event()
    ref.record(stream)
    ref.synchronize()
    host0 = time.perf_counter()
    walls = []
    graphs._Captured.__call__, driver.GraphExec.launch = traced_call, traced_launch
    for (owner, name), label in timed.items():
        setattr(owner, name, with_events(label, originals[owner, name]))
    try:
        for i in range(steps):
            began = time.perf_counter()
            decode.step(more=i + 1 < steps)
            walls.append(time.perf_counter() - began)
        cp.cuda.Device().synchronize()
    finally:
        graphs._Captured.__call__, driver.GraphExec.launch = call, launch
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)
        sess.restore(snapshot)

    def at(e):  # ms on the GPU's clock since ref
        return cp.cuda.get_elapsed_time(ref, e)

    rows = [[at(e) for e in m["ev"]] + [(m["host"] - host0) * 1e3] for m in replays]
    t = np.array(rows)  # call start, launch start, launch end, call end, host call
    parts = {"copy_in": t[:, 1] - t[:, 0], "graph": t[:, 2] - t[:, 1], "copy_out": t[:, 3] - t[:, 2]}
    parts["between"] = t[1:, 0] - t[:-1, 3]
    parts["host_late"] = np.maximum(0.0, t[1:, 4] - t[:-1, 3])
    parts["replay_to_replay"] = np.diff(t[:, 0])
    out = {k: float(np.median(v)) for k, v in parts.items()}
    out.update(replays=len(replays), step_wall_ms=float(np.median(walls)) * 1e3,
               host_late_mean=float(parts["host_late"].mean()), between_mean=float(parts["between"].mean()))
    out["parts_us"] = {label: {"median": float(np.median(us)) * 1e3, "per_replay": len(us) / len(replays)}
                       for label, us in _by_label(launched).items()}
    return out


def _by_label(spans) -> dict:
    """{label: [ms of each span]} from ``(label, began, ended)`` events."""
    import cupy as cp

    out = {}
    for label, began, ended in spans:
        out.setdefault(label, []).append(cp.cuda.get_elapsed_time(began, ended))
    return out
