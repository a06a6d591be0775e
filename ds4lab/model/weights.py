"""Tensors of a DS4 GGUF bound to a backend, converted on first use and kept; and the model's view of them,
one object per layer with one named attribute per tensor.

:class:`Weights` (a GGUF file's tensors) and :class:`ArrayWeights` (named float arrays, e.g. parameters
being trained) look tensors up by their GGUF names. :class:`LayerWeights` and :class:`HeadWeights` are
made once per model over either (the names are joined once, there); an attribute reads its tensor through
the source when used, so nothing is converted before a step needs it and a converted tensor is kept by the
source (one copy per device a tier runs on).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from ..quants import dequantize

EXPERT_CACHE_BYTES = 512 << 20


class Weights:
    """Dense tensors are converted once; routed experts are converted one expert at a time when the
    router selects them and kept in a least-recently-used cache of ``expert_cache_bytes`` (float
    bytes), so the 256-expert tensors are never expanded whole."""

    def __init__(self, file, backend, o_groups: int, o_lora: int, expert_cache_bytes: int = EXPERT_CACHE_BYTES):
        self.file = file
        self.backend = backend
        self.o_groups, self.o_lora = o_groups, o_lora
        self._cache: dict[str, object] = {}
        self._experts: OrderedDict[tuple[int, int], tuple] = OrderedDict()
        self._expert_bytes = 0
        self.expert_cache_bytes = expert_cache_bytes

    def __contains__(self, name: str) -> bool:
        return name in self.file.tensors

    def _dense(self, name: str):
        t = self.file.tensors[name]
        return dequantize(t.data, t.qtype, t.shape[0])

    def _memo(self, key: str, make):
        key = (self.backend.device_key(), key)  # one copy per device a tier runs on
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def linear(self, name: str):
        """``x -> x @ Wᵀ`` with W = the tensor as ``[ne1, ne0]`` (ne0 is the input dim;
        docs/MODEL.md, "Notation")."""
        t = self.file.tensors[name]
        return self._memo(name, lambda: self.backend.linear(t.data, t.qtype, t.shape[0]))

    def linears(self, *names: str):
        """``x -> [x @ W_iᵀ for each name]``, the tensors of one type and input dim stacked into one matrix:
        one product (a single launch on kernel backends) in place of one per tensor; outputs come back split."""
        return self._memo("+".join(names), lambda: self._stacked_linears(names))

    def _stacked_linears(self, names):
        tensors = [self.file.tensors[n] for n in names]
        groups: dict[tuple, list[int]] = {}  # (type, input dim) -> which names
        for i, t in enumerate(tensors):
            groups.setdefault((t.qtype, t.shape[0]), []).append(i)
        products = []
        for (qtype, ne0), which in groups.items():
            raw = np.concatenate([tensors[i].data for i in which]) if len(which) > 1 else tensors[which[0]].data
            ends = np.cumsum([tensors[i].shape[1] for i in which])
            products.append((which, self.backend.linear(raw, qtype, ne0), [0, *ends.tolist()]))

        def each_tensor(cut):  # x -> every tensor's share of its product, each product cut by cut(product, x, bounds)
            def run(x):
                out = [None] * len(names)
                for which, product, bounds in products:
                    for i, y in zip(which, cut(product, x, bounds)):
                        out[i] = y
                return out
            return run

        def columns(product, x, bounds):
            y = product(x)
            return [y[..., lo:hi] for lo, hi in zip(bounds, bounds[1:])]

        apply = each_tensor(columns)
        if all(hasattr(product, "split_columns") for _, product, _ in products):
            # each tensor's product as the backend leaves it for the op that reads it (Ops.split_sums)
            apply.split_sums = each_tensor(lambda product, x, bounds: product.split_columns(x, bounds))
        return apply

    def vector(self, name: str):
        return self._memo(name, lambda: self.backend.constant(self._dense(name).reshape(-1)))

    def table(self, name: str):
        """A small 2-D tensor as a dense ``[ne1, ne0]`` backend array (compressor APE)."""
        return self._memo(name, lambda: self.backend.constant(self._dense(name)))

    def out_a_groups(self, il: int):
        """attn_output_a split by output group: group g owns rows g·o_lora … (g+1)·o_lora − 1."""
        t = self.file.tensors[f"blk.{il}.attn_output_a.weight"]
        rows = self.o_lora
        return self._memo(f"blk.{il}.attn_output_a.groups", lambda: [
            self.backend.linear(t.data[g * rows:(g + 1) * rows], t.qtype, t.shape[0]) for g in range(self.o_groups)])

    def out_a_stacked(self, il: int):
        """attn_output_a's groups as one stacked linear in block form (None where the backend has no kernel)."""
        def make():
            t = self.file.tensors[f"blk.{il}.attn_output_a.weight"]
            raw = t.data.reshape(self.o_groups, self.o_lora, t.data.shape[-1])
            return self.backend.stacked_linear(raw, t.qtype, t.shape[0])

        return self._memo(f"blk.{il}.attn_output_a.stacked", make)

    def stacked_experts(self, il: int):
        """(gate, up, down) over all experts of layer ``il`` in block form on the device, where the backend
        has the kernels for it (see :func:`ds4lab.model.moe.routed_experts_gathered`); else None."""
        def make():
            mats = tuple(self.backend.stacked_linear(t.data, t.qtype, t.shape[0]) for t in self._expert_tensors(il))
            return None if None in mats else mats

        return self._memo(f"blk.{il}.experts", make)

    def _expert_tensors(self, il: int):
        return [self.file.tensors[f"blk.{il}.ffn_{kind}_exps.weight"] for kind in ("gate", "up", "down")]

    def expert(self, il: int, e: int):
        """Gate, up and down of routed expert ``e``, built from that expert's blocks only (for backends
        without stacked experts: those with kernels run every expert in one launch per projection)."""
        key = (self.backend.device_key(), il, e)
        if key in self._experts:
            self._experts.move_to_end(key)
            return self._experts[key][0]
        tensors = self._expert_tensors(il)
        mats = tuple(self.backend.linear(t.data[e], t.qtype, t.shape[0]) for t in tensors)
        size = sum(t.shape[0] * t.shape[1] for t in tensors) * np.dtype(self.backend.np_dtype).itemsize
        self._experts[key] = (mats, size)
        self._expert_bytes += size
        while self._expert_bytes > self.expert_cache_bytes and len(self._experts) > 1:
            _, (_, dropped) = self._experts.popitem(last=False)
            self._expert_bytes -= dropped
        return mats

    def hash_table(self, il: int) -> np.ndarray:
        return self._memo(f"blk.{il}.tid2eid", lambda: self._dense(f"blk.{il}.ffn_gate_tid2eid.weight"))

    def hash_table_on_device(self, il: int):
        """The hash layer's token → experts table as a device int32 array (routing that stays there)."""
        return self._memo(f"blk.{il}.tid2eid.device",
                          lambda: self.backend.constant(self.hash_table(il).astype(np.int32)))

    def embed(self, tokens: np.ndarray):
        return self._embedding()(tokens)

    def embed_on_device(self, ids):
        """Embedding rows of device int32 ids (a compiled step's), looked up and decoded on the device."""
        return self._embedding().on_device(ids)

    def _embedding(self):
        t = self.file.tensors["token_embd.weight"]
        return self._memo("token_embd", lambda: self.backend.embedding(t.data, t.qtype, t.shape[0]))


class ArrayWeights:
    """The same interface over named float arrays ``[ne1, ne0]`` (``[n_expert, out, in]`` for experts),
    e.g. the parameters being trained; the hash-routing tables stay host integer arrays."""

    def __init__(self, params: dict, hash_tables: dict[int, np.ndarray], xp, o_groups: int, o_lora: int):
        self.p, self.hash_tables, self.xp = params, hash_tables, xp
        self.o_groups, self.o_lora = o_groups, o_lora

    def __contains__(self, name: str) -> bool:
        return name in self.p

    def linear(self, name: str):
        w = self.p[name]
        return lambda x: x @ w.T

    def linears(self, *names: str):
        products = [self.linear(n) for n in names]
        return lambda x: [f(x) for f in products]

    def vector(self, name: str):
        return self.p[name].reshape(-1)

    def table(self, name: str):
        return self.p[name]

    def out_a_groups(self, il: int):
        w, rows = self.p[f"blk.{il}.attn_output_a.weight"], self.o_lora
        return [lambda x, g=g: x @ w[g * rows:(g + 1) * rows].T for g in range(self.o_groups)]

    def out_a_stacked(self, il: int):
        return None  # plain arrays: the groups run one by one

    def stacked_experts(self, il: int):
        return None

    def expert(self, il: int, e: int):
        mats = [self.p[f"blk.{il}.ffn_{kind}_exps.weight"][e] for kind in ("gate", "up", "down")]
        return tuple((lambda x, w=w: x @ w.T) for w in mats)

    def hash_table(self, il: int) -> np.ndarray:
        return self.hash_tables[il]

    def embed(self, tokens: np.ndarray):
        return self.p["token_embd.weight"][self.xp.array(tokens)]

    def embed_on_device(self, ids):
        return self.p["token_embd.weight"][ids]


# -- the model's view: one object per layer, one attribute per tensor -------------------------------------
class _Tensor:
    """A weight attribute of a :class:`_Named` group: the source's ``kind`` (``linear``, ``vector``, ``table``
    or ``linears``) of the tensors named by the group's prefix and ``suffixes``, read when the attribute is."""

    def __init__(self, kind: str, *suffixes: str):
        self.kind, self.suffixes = kind, suffixes

    def __set_name__(self, owner, attr: str):
        self.attr = attr

    def __get__(self, group, owner=None):
        if group is None:
            return self
        return getattr(group.source, self.kind)(*group.names[self.attr])


def _linear(suffix: str) -> _Tensor:
    """``x -> x @ Wᵀ`` (:meth:`Weights.linear`)."""
    return _Tensor("linear", suffix)


def _linears(*suffixes: str) -> _Tensor:
    """``x -> [x @ W_iᵀ ...]``, stacked into one product where the types allow (:meth:`Weights.linears`)."""
    return _Tensor("linears", *suffixes)


def _vector(suffix: str) -> _Tensor:
    return _Tensor("vector", suffix)


def _table(suffix: str) -> _Tensor:
    return _Tensor("table", suffix)


class _Named:
    """Weights under one GGUF name prefix: ``names`` maps each :class:`_Tensor` attribute of the class to its
    tensors' full names, joined once here."""

    def __init__(self, source, prefix: str):
        self.source = source
        self.names = {attr: tuple(prefix + s for s in t.suffixes)
                      for cls in type(self).__mro__ for attr, t in vars(cls).items() if isinstance(t, _Tensor)}


class HCWeights(_Named):
    """A hyper-connection mixer's weights (``hc_attn_*`` before the attention, ``hc_ffn_*`` before the FFN)."""

    fn = _linear("fn.weight")
    scale = _vector("scale.weight")
    base = _vector("base.weight")


class CompressorWeights(_Named):
    """One compressor's APE and norm (``attn_compressor_*`` or ``indexer_compressor_*``); its kv and gate
    projections run in the layer's products of ``a`` (:meth:`LayerWeights.compressor_projections`)."""

    ape = _table("ape.weight")  # [R, W]: the score bias of each slot in the window
    norm = _vector("norm.weight")


class CompressorProjections(NamedTuple):
    """The products of the attention's normed input ``a`` that the compressors read: the compressor's kv and gate
    (ratio ≠ 0), the indexer compressor's and, once the indexer selects, the indexer's head weights (ratio 4). None
    where the layer has no such weight."""

    comp_kv: object = None
    comp_gate: object = None
    index_kv: object = None
    index_gate: object = None
    index_proj: object = None


class LayerWeights(_Named):
    """Layer ``il``'s weights (``blk.{il}.*``), by their GGUF names less the prefix."""

    attn_norm = _vector("attn_norm.weight")
    attn_q_a_norm = _vector("attn_q_a_norm.weight")
    attn_q_b = _linear("attn_q_b.weight")
    attn_kv_a_norm = _vector("attn_kv_a_norm.weight")
    attn_sinks = _vector("attn_sinks.weight")
    attn_output_b = _linear("attn_output_b.weight")
    indexer_attn_q_b = _linear("indexer.attn_q_b.weight")
    ffn_norm = _vector("ffn_norm.weight")
    ffn_gate_inp = _linear("ffn_gate_inp.weight")  # the router
    ffn_gate_up_shexp = _linears("ffn_gate_shexp.weight", "ffn_up_shexp.weight")
    ffn_down_shexp = _linear("ffn_down_shexp.weight")

    def __init__(self, source, config, il: int):
        p = f"blk.{il}."
        super().__init__(source, p)
        self.il = il
        R = config.ratio(il)
        indexed = bool(R) and config.has_indexer(il)
        self.hc_attn = HCWeights(source, p + "hc_attn_")
        self.hc_ffn = HCWeights(source, p + "hc_ffn_")
        self.attn_compressor = CompressorWeights(source, p + "attn_compressor_") if R else None
        self.indexer_compressor = CompressorWeights(source, p + "indexer_compressor_") if indexed else None
        self._query = (p + "attn_q_a.weight", p + "attn_kv.weight")
        of_a = []
        if R:
            of_a += [p + "attn_compressor_kv.weight", p + "attn_compressor_gate.weight"]
        if indexed:
            of_a += [p + "indexer_compressor_kv.weight", p + "indexer_compressor_gate.weight"]
        # without and with the indexer's head weights (while no query can see more rows than the indexer's
        # top-k, it selects nothing and they are not multiplied)
        self._compressors = (tuple(of_a), tuple(of_a + [p + "indexer.proj.weight"]) if indexed else tuple(of_a))
        bias = p + "exp_probs_b.bias"
        self._router_bias = bias if bias in source else None

    @property
    def query_projections(self):
        """``a -> [q_a, kv]``: the query's and the KV row's products of ``a``, one product per weight type (where the
        backend leaves products as their K splits, ``.split_sums`` gives them so: Ops.split_sums)."""
        return self.source.linears(*self._query)

    def compressor_projections(self, a, indexer_selects: bool) -> CompressorProjections:
        """The compressors' products of ``a`` (and the indexer's head weights), one product per weight type (not one
        per tensor); none where the layer has no compressor."""
        names = self._compressors[bool(indexer_selects)]
        return CompressorProjections(*self.source.linears(*names)(a)) if names else CompressorProjections()

    @property
    def exp_probs_b(self):
        """The router's selection bias, or None where the layer has none."""
        return None if self._router_bias is None else self.source.vector(self._router_bias)

    @property
    def attn_output_a_stacked(self):
        """attn_output_a's groups as one stacked linear in block form (None where the backend has no kernel)."""
        return self.source.out_a_stacked(self.il)

    @property
    def attn_output_a_groups(self):
        """attn_output_a split by output group, a linear each."""
        return self.source.out_a_groups(self.il)

    @property
    def experts_stacked(self):
        """(gate, up, down) over every routed expert in block form, or None (:meth:`Weights.stacked_experts`)."""
        return self.source.stacked_experts(self.il)

    def expert(self, e: int):
        """Routed expert ``e``'s (gate, up, down) linears, made from its own blocks (:meth:`Weights.expert`)."""
        return self.source.expert(self.il, e)

    @property
    def hash_table(self) -> np.ndarray:
        """A hash layer's token → experts table (``ffn_gate_tid2eid``), on the host."""
        return self.source.hash_table(self.il)

    @property
    def hash_table_on_device(self):
        return self.source.hash_table_on_device(self.il)


class HeadWeights(_Named):
    """The output head's weights."""

    output_hc_fn = _linear("output_hc_fn.weight")
    output_hc_scale = _vector("output_hc_scale.weight")
    output_hc_base = _vector("output_hc_base.weight")
    output_norm = _vector("output_norm.weight")
    output = _linear("output.weight")

    def __init__(self, source):
        super().__init__(source, "")
