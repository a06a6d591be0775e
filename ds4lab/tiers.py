"""Tier placement: the model's layers split over devices, with the switches between them recorded.

A :class:`Placement` maps the embedding, every layer and the output head to a tier. When the next unit
lives on another tier, the forward pass switches the active tier in one of three modes
(``metal_graph_set_active_tier_*`` of the articles ds4lab was described from; the real ds4 runs on one device:
``ds4_gpu_init`` in ds4's ds4_cuda.cu selects device 0):

- ``decode``: copy the current token's hidden state, n_hc × n_embd floats;
- ``batch``: copy the chunk's hidden states, chunk × n_hc × n_embd, once per tier boundary per chunk;
- ``no-copy``: switch only. Used at the start of a step, where the embedding is allocated on its tier
  and nothing is carried over, and between two tiers on one physical device (data already resident).

Every switch becomes a :class:`TierSwitch` record. Without ``devices`` tiers are logical: each is its
own "device", so a switch makes a real array copy and the bytes are real. With MLX, ``"cpu"`` and
``"gpu"`` tiers run their layers on that device's stream. With CuPy, ``"cuda:N"`` tiers keep their
layers' weights and KV state on GPU N and switch over NCCL where it is installed (:mod:`ds4lab.cuda.nccl_link`),
else with peer copies. A tier is a small object with
``device``, ``copy_in(x)``, ``adopt(x)``, ``settle(x)`` and ``scope()``.

With ``"rank:N"`` devices (:meth:`Placement.over_ranks`) the tiers are the processes of an ``mx.distributed``
group (:mod:`ds4lab.distributed`): every process runs the same script, computes only its tiers' units and
keeps only their layers' KV state; a switch to another rank sends the hidden state over the group's link,
and the head's logits reach every rank.
"""

from __future__ import annotations

import math
import numbers
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from .config import check_count, is_int
from .text_table import aligned, plural, runs

EMBED = -1  # the layer index records give the embedding; the output head is n_layer
MODES = ("decode", "batch")  # what a step asks for; "no-copy" is decided per switch


# -- devices ------------------------------------------------------------------------------------------
class LogicalTier:
    """A tier in the backend's own memory. Tiers with different ``device`` names are kept apart as if
    they were devices (switching copies the array); tiers with the same name share their data."""

    def __init__(self, device: str, backend):
        self.backend = backend
        self.device = device

    def copy_in(self, x):
        y = self.backend.xp.array(x)  # np.array and mx.array both copy the buffer
        self.backend.eval(y)
        return y

    def adopt(self, x):
        """``x`` as this tier keeps it (a state array arriving from elsewhere); logical tiers share memory."""
        return x

    def settle(self, x):
        """Finish the work that produces ``x`` (so a switch's time is the copy's alone)."""
        self.backend.eval(x)

    def scope(self):
        return self.backend.scope()


class MLXDeviceTier:
    """MLX's cpu or gpu device: the tier's layers run on that device's default stream."""

    def __init__(self, device: str, backend):
        import mlx.core as mx

        self.backend = backend
        self.device = device
        self._device = mx.cpu if device == "cpu" else mx.gpu
        if not mx.is_available(self._device):
            raise ValueError(f"MLX has no {device} device on this machine")

    def copy_in(self, x):
        import mlx.core as mx

        with mx.stream(self._device):
            y = mx.array(x)
            mx.eval(y)
        return y

    def adopt(self, x):
        return x  # unified memory: every device reads every array

    def settle(self, x):
        self.backend.eval(x)

    def scope(self):
        import mlx.core as mx

        return mx.stream(self._device)


class CupyDeviceTier:
    """CUDA GPU N (``"cuda:N"``): the tier's layers run, and their weights and KV state live, on that GPU;
    a switch is a send over ``link`` (an :class:`~ds4lab.cuda.nccl_link.NcclLink` that :func:`_cupy_tiers` gives
    a placement's tiers), or a peer copy where it is None."""

    def __init__(self, device: str, backend):
        import cupy as cp

        self.backend, self.device = backend, device
        try:
            self.index = int(device.removeprefix("cuda:"))
        except ValueError:
            raise ValueError(f"unknown CUDA device {device!r}; use 'cuda:N'") from None
        if not 0 <= self.index < cp.cuda.runtime.getDeviceCount():
            raise ValueError(f"no CUDA device {device!r} here ({cp.cuda.runtime.getDeviceCount()} GPUs)")
        self._device = cp.cuda.Device(self.index)
        self.link = None

    def copy_in(self, x):
        import cupy as cp

        if self.link is not None and x.device.id != self.index:
            return self.link.move(x, self.index)
        with self._device:
            y = cp.array(x, copy=True)  # a peer copy when x is on another GPU
            self._device.synchronize()
        return y

    def adopt(self, x):
        return x if x is None or x.device.id == self.index else self.copy_in(x)

    def settle(self, x):
        x.device.synchronize()

    def scope(self):
        return self._device


def make_tiers(backend, devices: Sequence[str] | None, n_tiers: int, group=None) -> tuple:
    if devices is None:
        return tuple(LogicalTier(f"logical:{t}", backend) for t in range(n_tiers))
    if any(d.startswith("rank:") for d in devices):
        if not all(d.startswith("rank:") for d in devices):
            raise ValueError(f"devices {list(devices)} mix ranks and devices: a placement over ranks has 'rank:N' "
                             "tiers only (each rank runs on its process's default device)")
        from .distributed import rank_tiers

        return rank_tiers(backend, devices, group)
    if backend.name == "cupy":
        return _cupy_tiers(backend, devices)
    known = ("cpu", "gpu") if backend.name == "mlx" else ("cpu",)
    for d in devices:
        if d not in known:
            raise ValueError(f"unknown device {d!r} for the {backend.name} backend; use one of {', '.join(known)}")
    if backend.name == "mlx":
        return tuple(MLXDeviceTier(d, backend) for d in devices)
    return tuple(LogicalTier(d, backend) for d in devices)


def _cupy_tiers(backend, devices: Sequence[str]) -> tuple:
    """CuPy tiers on ``devices``, sharing the process's NCCL link over their GPUs where they span two or more
    and NCCL starts (:func:`ds4lab.cuda.nccl_link.link_for`), else switching with peer copies."""
    from .cuda.nccl_link import link_for

    tiers = tuple(CupyDeviceTier(d, backend) for d in devices)
    link = link_for(tuple(sorted({t.index for t in tiers})))
    for t in tiers:
        t.link = link
    return tiers


# -- records ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TierSwitch:
    step: int  # the session's evaluation step
    layer: int  # the unit about to run: EMBED (-1), a layer, or n_layer for the output head
    from_tier: int
    to_tier: int
    mode: str  # "decode", "batch" or "no-copy"
    bytes: int
    seconds: float


@dataclass(frozen=True)
class TierMemory:
    tier: int
    device: str
    weights: int  # GGUF bytes of the tensors of the units on the tier
    kv: int  # the KV state arrays of its layers
    activations: int  # the chunk's hidden-state buffer (batch_cur_hc), if the tier runs anything
    budget: int | None

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations


# -- the plan -----------------------------------------------------------------------------------------
Plan = Callable[[int, list[int], int], list[int]]  # (n_layer, unit costs, activation bytes) -> unit tiers


def _byte_counts(values) -> list[int]:
    """Budgets: a non-empty list of positive, finite byte counts (1e9 is one), refused by name otherwise."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"budgets is a list of byte counts, one a tier, got {values!r}")
    values = list(values)
    if not values or not all(isinstance(b, numbers.Real) and not isinstance(b, bool) and math.isfinite(b) and b >= 1
                             for b in values):
        raise ValueError(f"budgets must be positive byte counts, got {values}")
    return [int(b) for b in values]


class Placement:
    """Which tier runs the embedding, each layer and the output head.

    ``Placement(layer_tiers=[0, 0, 1, 1, …])`` places the layers explicitly (the embedding goes with the
    first layer and the head with the last unless ``embed_tier``/``head_tier`` say otherwise); see also
    :meth:`single`, :meth:`even` and :meth:`by_memory`. A plan is resolved against a model and its KV
    state by ``model.session(placement=...)``; the resolved plan (``session.placement``) has the
    per-tier :attr:`memory` and the per-unit :meth:`table`.
    """

    def __init__(self, layer_tiers: Sequence[int], devices: Sequence[str] | None = None, *,
                 embed_tier: int | None = None, head_tier: int | None = None,
                 budgets: Sequence[int] | None = None, group=None):
        tiers = list(layer_tiers)
        bad = next((i for i, t in enumerate(tiers) if not is_int(t) or t < 0), None)
        if bad is not None:
            raise ValueError(f"layer_tiers[{bad}] is {tiers[bad]!r}: a tier is a whole number >= 0")
        tiers = [int(t) for t in tiers]
        if not tiers:
            raise ValueError("layer_tiers is empty")

        def explicit(n_layer: int, costs: list[int], act: int) -> list[int]:
            if len(tiers) != n_layer:
                raise ValueError(f"layer_tiers has {len(tiers)} entries; the model has {n_layer} layers")
            embed = tiers[0] if embed_tier is None else embed_tier
            return [embed, *tiers, tiers[-1] if head_tier is None else head_tier]

        self._init(f"explicit {tiers}", explicit, devices, budgets, group)

    def _init(self, rule: str, plan: Plan, devices, budgets, group=None) -> None:
        self.rule = rule
        self.group = group  # the mx.distributed group of "rank:N" tiers (None: the global group)
        self._plan = plan
        if isinstance(devices, str):  # read letter by letter it named devices 'c' and 'p'
            raise TypeError(f"devices is a list of device names, one a tier, got the string {devices!r}")
        self.devices = None if devices is None else tuple(devices)
        self.budgets = None if budgets is None else tuple(_byte_counts(budgets))
        if self.devices is not None and not self.devices:
            raise ValueError("devices is empty; leave it None for logical tiers")
        if self.budgets is not None and self.devices is not None and len(self.budgets) != len(self.devices):
            raise ValueError(f"{len(self.budgets)} budgets for {len(self.devices)} devices")
        self.unit_tiers: tuple[int, ...] | None = None  # embed, layers…, head once resolved
        self.tiers: tuple = ()
        self.memory: tuple[TierMemory, ...] = ()
        self._weights: tuple[int, ...] = ()
        self._kv: tuple[int, ...] = ()

    @classmethod
    def _rule(cls, rule: str, plan: Plan, devices, budgets=None, group=None) -> "Placement":
        self = cls.__new__(cls)
        self._init(rule, plan, devices, budgets, group)
        return self

    @classmethod
    def single(cls, device: str | None = None) -> "Placement":
        """Everything on one tier (the backend's device, or ``device``)."""
        return cls._rule("single", lambda n, costs, act: [0] * (n + 2), None if device is None else [device])

    @classmethod
    def even(cls, n_tiers: int, devices: Sequence[str] | None = None) -> "Placement":
        """Contiguous, equal runs of layers; the embedding on the first tier, the head on the last."""
        check_count(n_tiers, "n_tiers")
        if devices is not None and len(devices) != n_tiers:
            raise ValueError(f"{len(devices)} devices for {n_tiers} tiers")

        def plan(n_layer: int, costs: list[int], act: int) -> list[int]:
            if n_tiers > n_layer:
                raise ValueError(f"{n_tiers} tiers for {n_layer} layers: every tier needs a layer")
            return [0, *(il * n_tiers // n_layer for il in range(n_layer)), n_tiers - 1]

        return cls._rule(f"even({n_tiers})", plan, devices)

    @classmethod
    def over_ranks(cls, group=None) -> "Placement":
        """Pipeline stages over the processes of an ``mx.distributed`` group (default: the global group, as
        ``mlx.launch`` starts it): :meth:`even` over its ranks, rank r running the r-th run of layers; the
        embedding on rank 0 and the head on the last rank. Every rank runs the same script."""
        import mlx.core as mx

        group = mx.distributed.init() if group is None else group
        size = group.size()
        out = cls.even(size, devices=[f"rank:{r}" for r in range(size)])
        out.rule, out.group = f"over_ranks({size})", group
        return out

    @classmethod
    def by_memory(cls, budgets_bytes: Sequence[int], devices: Sequence[str] | None = None) -> "Placement":
        """Contiguous runs sized in proportion to each tier's budget, counting every unit's weight and KV
        bytes (as llama.cpp's tensor split does with its proportions); each tier must then fit its budget."""
        budgets = _byte_counts(budgets_bytes)

        def plan(n_layer: int, costs: list[int], act: int) -> list[int]:
            room = [b - act for b in budgets]
            if min(room) <= 0:
                t = room.index(min(room))
                raise ValueError(f"tier {t}'s budget of {budgets[t]:,} bytes cannot hold the {act:,}-byte "
                                 "hidden-state buffer of one chunk")
            total, cap = sum(costs), sum(room)
            if total > cap:
                raise ValueError(f"the model needs {total:,} bytes of weights and KV; the budgets leave "
                                 f"{cap:,} after each tier's {act:,}-byte hidden-state buffer")
            bounds = np.cumsum(room) / cap * total
            done, out = 0, []
            for c in costs:  # a unit goes to the tier whose share holds its middle byte
                out.append(min(int(np.searchsorted(bounds, done + c / 2, side="right")), len(budgets) - 1))
                done += c
            return out

        return cls._rule(f"by_memory({len(budgets)} tiers)", plan, devices, budgets)

    # -- resolving against a model --------------------------------------------------------------------
    def resolve(self, model, state) -> "Placement":
        """This plan for ``model`` with the KV ``state`` it will run (its arrays and chunk size are counted);
        raises ``ValueError`` when a tier is unknown or a tier does not fit its budget."""
        cfg, backend = model.config, model.backend
        weights, kv = _unit_bytes(model, state)
        act = state.geometry.step * cfg.n_hc * cfg.n_embd * np.dtype(backend.np_dtype).itemsize
        unit_tiers = [int(t) for t in self._plan(cfg.n_layer, [w + k for w, k in zip(weights, kv)], act)]
        n_tiers = len(self.devices or self.budgets or ()) or max(unit_tiers) + 1
        for u, t in enumerate(unit_tiers):
            if not 0 <= t < n_tiers:
                given = (f" (one a device: {plural(len(self.devices), 'device')} given)" if self.devices else
                         f" (one a budget: {plural(len(self.budgets), 'budget')} given)" if self.budgets else "")
                raise ValueError(f"{unit_name(u - 1, cfg.n_layer)} is on tier {t}, but the plan has tiers "
                                 f"0…{n_tiers - 1}{given}")
        tiers = make_tiers(backend, self.devices, n_tiers, self.group)
        memory = []
        for t in range(n_tiers):
            on = [u for u, ut in enumerate(unit_tiers) if ut == t]
            memory.append(TierMemory(t, tiers[t].device, sum(weights[u] for u in on), sum(kv[u] for u in on),
                                     act if on else 0, None if self.budgets is None else self.budgets[t]))
        for m in memory:
            if m.budget is not None and m.total > m.budget:
                raise ValueError(f"tier {m.tier} ({m.device}) needs {m.total:,} bytes ({m.weights:,} weights + "
                                 f"{m.kv:,} KV + {m.activations:,} activations) but its budget is {m.budget:,} bytes")
        out = _copy(self)
        out.unit_tiers, out.tiers, out.memory = tuple(unit_tiers), tiers, tuple(memory)
        out._weights, out._kv = tuple(weights), tuple(kv)
        out._hidden = (cfg.n_hc, cfg.n_embd, cfg.n_vocab, backend.dtype)
        return out

    @property
    def ranks(self):
        """The :class:`~ds4lab.distributed.Ranks` of a plan over processes, else None."""
        return getattr(self.tiers[0], "ranks", None) if self.tiers else None

    def is_local(self, tier: int) -> bool:
        """Whether this process runs ``tier``: its own rank's, in a plan over processes; every tier, otherwise."""
        ranks = self.ranks
        return ranks is None or self.tiers[tier].rank == ranks.rank

    @property
    def part(self) -> str | None:
        """Which part of the state this process holds, for a plan over processes: this rank and its units
        (None where one process holds everything). Checkpoints of a split state carry it."""
        ranks = self.ranks
        if ranks is None:
            return None
        units = [r["layer"] for r in self.table() if self.is_local(r["tier"])]
        return f"rank {ranks.rank} of {ranks.size} ({_ranges(units, self.n_layer)}; {self.rule})"

    def rank_of(self, layer: int) -> int:
        """The rank whose process runs ``layer`` (a plan over processes)."""
        return self.tiers[self.tier_of(layer)].rank

    def place_state(self, state):
        """``state`` with each layer's arrays on that layer's tier (a no-op where tiers share memory)."""
        layers = []
        for il, layer in enumerate(state.layers):
            tier = self.tiers[self.tier_of(il)]
            layers.append(type(layer).from_arrays([None if a is None else tier.adopt(a) for a in layer.arrays()]))
        return replace(state, layers=tuple(layers))

    def _resolved(self) -> tuple[int, ...]:
        if self.unit_tiers is None:
            raise RuntimeError("this placement is not resolved yet: model.session(placement=...) resolves it")
        return self.unit_tiers

    @property
    def n_layer(self) -> int:
        return len(self._resolved()) - 2

    def tier_of(self, layer: int) -> int:
        """The tier of ``layer`` (EMBED for the embedding, n_layer for the head)."""
        return self._resolved()[layer + 1]

    @property
    def embed_tier(self) -> int:
        return self.tier_of(EMBED)

    @property
    def layer_tiers(self) -> tuple[int, ...]:
        return self._resolved()[1:-1]

    @property
    def head_tier(self) -> int:
        return self.tier_of(self.n_layer)

    @property
    def boundaries(self) -> int:
        """Copying switches per step: consecutive units on tiers of different devices."""
        u = self._resolved()
        return sum(self.tiers[a].device != self.tiers[b].device for a, b in zip(u, u[1:]))

    def table(self) -> list[dict]:
        """One row per unit, embedding first and head last: layer, name, tier, device, weight and KV bytes."""
        u = self._resolved()
        return [dict(layer=i - 1, unit=unit_name(i - 1, len(u) - 2), tier=t, device=self.tiers[t].device,
                     weights=self._weights[i], kv=self._kv[i]) for i, t in enumerate(u)]

    def __repr__(self) -> str:
        if self.unit_tiers is None:
            return f"Placement({self.rule}, devices={self.devices}, unresolved)"
        units = [_ranges([r["layer"] for r in self.table() if r["tier"] == m.tier], self.n_layer) for m in self.memory]
        rows = [[str(m.tier), m.device, names, f"{m.weights:,}", f"{m.kv:,}", f"{m.activations:,}", f"{m.total:,}",
                 "-" if m.budget is None else f"{m.budget:,}"] for m, names in zip(self.memory, units)]
        head = ["tier", "device", "units", "weights", "KV", "activations", "total", "budget"]
        title = (f"Placement {self.rule}: {self.n_layer} layers on {plural(len(self.tiers), 'tier')}, "
                 f"{plural(self.boundaries, 'copying switch', 'copying switches')} per step")
        # device and units read left to right; the numbers line up on the right
        return "\n".join([title, *aligned(head, rows, left={1, 2}, sep="  ")]).rstrip()


def _copy(p: Placement) -> Placement:
    out = Placement.__new__(Placement)
    out.__dict__.update(p.__dict__)
    return out


def unit_name(layer: int, n_layer: int) -> str:
    """A unit's name: "embed" (EMBED), "layer N", or "head" (``n_layer``)."""
    return "embed" if layer == EMBED else "head" if layer == n_layer else f"layer {layer}"


def _ranges(layers: list[int], n_layer: int) -> str:
    """``embed, layers 0-2, head`` (or ``layers 0, 2, 4``) from the unit indices of one tier."""
    held = [il for il in layers if 0 <= il < n_layer]
    named = [f"layer {held[0]}" if len(held) == 1 else f"layers {runs(held)}"] if held else []
    parts = ([unit_name(il, n_layer) for il in layers if il < 0] + named
             + [unit_name(il, n_layer) for il in layers if il >= n_layer])
    return ", ".join(parts) or "-"


def _unit_bytes(model, state) -> tuple[list[int], list[int]]:
    """Weight (GGUF) and KV bytes of the embedding, each layer and the head."""
    n = model.config.n_layer
    weights = [0] * (n + 2)
    for name, t in model.file.tensors.items():
        if name.startswith("blk."):
            u = int(name.split(".")[1]) + 1
        else:
            u = 0 if name.startswith("token_embd.") else n + 1
        weights[u] += int(t.nbytes)
    kv = [0, *(sum(int(a.nbytes) for a in layer.arrays() if a is not None) for layer in state.layers), 0]
    return weights, kv


# -- switching during a step --------------------------------------------------------------------------
class TierRun:
    """The tier switches of one evaluation step: ``forward`` calls :meth:`start`, :meth:`enter` before
    every layer and the head, computes inside :meth:`scope` the units that run :attr:`here`, and passes the
    head's result through :meth:`share`."""

    def __init__(self, placement: Placement, mode: str, step: int, active: int):
        if mode not in MODES:
            raise ValueError(f"unknown tier mode {mode!r}; use one of {', '.join(MODES)}")
        self.placement, self.mode, self.step, self.active = placement, mode, step, active
        self.switches: list[TierSwitch] = []
        self.ranks = placement.ranks
        self.rows = 0

    def start(self, rows: int) -> None:
        """Switch to the embedding's tier for a step of ``rows`` hidden-state rows: the step's hidden state is
        allocated there, nothing is copied."""
        self.rows = rows
        self._switch(EMBED, None)

    def enter(self, layer: int, x):
        """Make ``layer``'s tier active and return ``x`` resident there (None in a process that does not run it)."""
        return self._switch(layer, x)

    def scope(self):
        return self.placement.tiers[self.active].scope()

    @property
    def here(self) -> bool:
        """Whether this process runs the active tier's units (always, unless the tiers are ranks)."""
        return self.ranks is None or self.placement.tiers[self.active].here

    def share(self, logits):
        """The head's ``logits [1, vocab]`` on every process (the head's rank sends them round the ring)."""
        if self.ranks is None:
            return logits
        _, _, n_vocab, dtype = self.placement._hidden
        return self.ranks.share(logits, self.placement.tiers[self.active].rank, (1, n_vocab), dtype,
                                f"step {self.step}: the logits")

    @property
    def one_tier(self) -> bool:
        """Whether the step runs on one tier throughout (nothing switches)."""
        return len(self.placement.tiers) == 1

    @property
    def device(self) -> str:
        """The active tier's device (arrays made for one tier's device serve every tier on it)."""
        return self.placement.tiers[self.active].device

    def _switch(self, layer: int, x):
        dst = self.placement.tier_of(layer)
        src = self.active
        if dst == src:
            return x
        tiers = self.placement.tiers
        if layer == EMBED or tiers[src].device == tiers[dst].device:
            mode, nbytes, seconds = "no-copy", 0, 0.0
        elif self.ranks is not None:
            x, seconds, nbytes = self._send(layer, x, tiers[src], tiers[dst])
            mode = self.mode
        else:
            if self.mode == "decode" and x.shape[0] != 1:
                raise ValueError(f"decode switches carry one token's hidden state, got {x.shape[0]} rows")
            tiers[src].settle(x)  # the layers before the boundary are not part of the switch time
            began = time.perf_counter()
            x = tiers[dst].copy_in(x)
            mode, nbytes, seconds = self.mode, int(x.nbytes), time.perf_counter() - began
        self.switches.append(TierSwitch(self.step, layer, src, dst, mode, nbytes, seconds))
        self.active = dst
        return x

    def _send(self, layer: int, x, src, dst):
        """The hidden state from rank ``src`` to rank ``dst``; every rank records the switch, with the seconds
        it spent sending, relaying or receiving (a receiver's include its wait for the sending stage)."""
        n_hc, n_embd, _, dtype = self.placement._hidden
        if self.mode == "decode" and self.rows != 1:
            raise ValueError(f"decode switches carry one token's hidden state, got {self.rows} rows")
        if x is not None:
            src.settle(x)  # the layers before the boundary are not part of the switch time
        shape = (self.rows, n_hc, n_embd)
        what = f"step {self.step}: the hidden state before {unit_name(layer, self.placement.n_layer)}"
        x, seconds = self.ranks.move(x, src.rank, dst.rank, shape, dtype, what)
        return x, seconds, int(np.prod(shape)) * dtype.size


class _Untiered:
    """The forward pass without a placement: nothing switches."""

    def start(self, rows: int) -> None:
        pass

    def enter(self, layer: int, x):
        return x

    def scope(self):
        return nullcontext()

    def share(self, logits):
        return logits

    device = None
    one_tier = True
    here = True


NO_TIERS = _Untiered()
