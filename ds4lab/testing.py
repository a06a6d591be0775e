"""Random ds4 model files for tests and demos.

``make_model`` writes a GGUF with ds4's tensor names, shapes and per-tensor types
(docs/FORMATS.md, "GGUF model files") for any :class:`ModelConfig`, filled with seeded random weights scaled so
activations stay O(1) through the network, plus a small byte-level BPE tokenizer trained on real text.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import zlib
from pathlib import Path
from typing import Callable, Collection, Literal, NamedTuple, Sequence, Union

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from .config import ModelConfig
from .gguf_file import write_gguf
from .quants import quantize, random_blocks
from .tokenizer import BOS, BYTE_TO_UNICODE, EOS, SPECIAL_TOKENS, train_bpe

# The checkout's data/ (beside pyproject.toml, one level above this package); None in an installed wheel, whose
# parent folder is site-packages. Tests point it elsewhere to see what a wheel does.
_DATA_DIR = (Path(__file__).resolve().parents[1] / "data"
             if (Path(__file__).resolve().parents[1] / "pyproject.toml").is_file() else None)
_TEXT_CHARS = 300_000

_DENSE_TYPES = frozenset({Q.Q8_0, Q.F16, Q.BF16, Q.F32})
_EXPERT_TYPES = frozenset({Q.IQ2_XXS, Q.Q2_K, Q.Q4_K, Q.MXFP4, Q.Q8_0, Q.F16, Q.F32})
_BLOCK_TYPES = frozenset({Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.IQ2_XXS, Q.MXFP4})  # made with quants.random_blocks
ExpertTypes = Union[tuple[str, str], Sequence[tuple[str, str]]]  # one (gate/up, down) pair, or one a layer

# Used when the repository's data/ folder is not there (an installed wheel). It has enough distinct
# words for the merges of a vocabulary of ~1000 tokens.
_FALLBACK_TEXT = """\
The keeper of the northern light climbed the spiral stairs each evening before sunset, carrying a can
of oil, a rag, and a notebook bound in faded green cloth. He wrote down the colour of the sky, the
direction of the wind, the height of the swell against the rocks, and the names of any ships that
passed close enough to read. Over forty winters the notebook became a small library: shelves of
identical volumes, their spines darkened by salt and the warmth of his hands.

Visitors were rare. Once a botanist arrived by the supply boat, hoping to catalogue the mosses that grew
in the cracks of the seaward wall. She stayed for three weeks, measuring, sketching, pressing delicate
specimens between sheets of blotting paper, and asking questions about everything: why the lamp turned
clockwise, how the lens had been ground, whether the gulls returned to the same ledges every spring.
He answered slowly, because nobody had asked him such things before, and discovered that he knew far
more than he had imagined.

In the village across the bay people argued about the harbour, the price of fish, the new schoolteacher
and the broken clock on the church tower. Children raced bicycles along the quay; a baker sold warm
bread with caraway seeds; an old fiddler played jigs outside the tavern whenever the weather allowed.
Merchants brought copper kettles, woollen blankets, lanterns, rope, tobacco, and newspapers that were
always a week out of date. Nobody minded: news travelled slowly there, and most of it was forgotten
before it could matter.

Winter storms were another matter entirely. Waves thundered against the cliffs, spray froze on the
windows, and the whole tower seemed to shudder under the weight of the gale. On such nights the keeper
did not sleep. He trimmed the wick, polished the brass, checked the clockwork that rotated the great
lens, and watched the darkness for the faint glimmer of a masthead lamp. Twice he saw a vessel driven
toward the reef; twice the beam turned her away just in time, and in the morning he recorded both
events in careful, unhurried handwriting, as though they were ordinary weather.

Numbers fascinated him as well. He counted the steps (one hundred and twelve), the panes of glass in
the lantern room (twenty-four), the days between supply boats (usually nine, sometimes eleven), and the
seconds between flashes (exactly seven). Arithmetic, he said, was a quiet companion: it never complained,
never exaggerated, and always gave the same answer when questioned politely.

When at last a younger keeper came to replace him, the old man handed over the keys, the oil can, and
the most recent notebook, then walked down the hill without looking back. Years later a historian
found the collection in a damp cellar, dried every page, and published a thick volume describing
half a century of tides, birds, shipwrecks avoided, quarrels overheard, recipes exchanged, and the
slow, patient work of keeping a single light burning above a dangerous sea.
"""


def make_model(
    config: ModelConfig,
    path: str | os.PathLike,
    seed: int = 0,
    *,
    dense_type: str = "Q8_0",
    expert_types: ExpertTypes = ("IQ2_XXS", "Q2_K"),
    router_bias_layers: Literal["auto"] | Collection[int] = "auto",
    tokenizer_text: str | None = None,
) -> Path:
    """Write a ds4 GGUF for ``config`` with seeded random weights; the same arguments give the same bytes.

    ``dense_type`` (Q8_0, F16, BF16 or F32) is used for the projections the real file stores as Q8_0;
    ``expert_types`` are (gate/up, down) for the routed experts (IQ2_XXS, Q2_K, Q4_K, MXFP4, Q8_0, F16 or F32), or
    a list of such pairs, one a layer (as ds4's q2-q4 Flash file has Q4_K experts in its last six layers only).
    ``router_bias_layers`` lists the layers that get ``exp_probs_b.bias``; "auto" gives it to every
    other non-hash layer starting with the first, so both router paths (with and without bias) exist.
    The tokenizer is trained on ``tokenizer_text`` (default: the start of tinyshakespeare).
    """
    tensors = model_tensors(config, seed, dense_type=dense_type, expert_types=expert_types,
                            router_bias_layers=router_bias_layers)
    text = default_tokenizer_text() if tokenizer_text is None else tokenizer_text
    return write_gguf(path, _metadata(config, seed, text), tensors)


def model_tensors(
    config: ModelConfig,
    seed: int = 0,
    *,
    dense_type: str = "Q8_0",
    expert_types: ExpertTypes = ("IQ2_XXS", "Q2_K"),
    router_bias_layers: Literal["auto"] | Collection[int] = "auto",
    distinct_rows: int | None = None,
    filled: Callable[[str], bool] | None = None,
) -> list[tuple[str, tuple[int, ...], Q, np.ndarray | None]]:
    """``(name, shape, qtype, raw bytes)`` of every tensor :func:`make_model` writes.

    ``distinct_rows`` (for full-width benchmark models) draws only that many leading rows (experts,
    for expert tensors) at random and repeats them to the full size, which is much faster for the
    gigabytes of a Flash layer and costs the same to evaluate. ``filled(name)`` False leaves a tensor's
    bytes None: zeros, which :func:`ds4lab.gguf_file.write_gguf` writes as a hole (:func:`make_sparse_model`)."""
    dense = _qtype(dense_type, _DENSE_TYPES, "dense_type")
    experts = _layer_expert_types(expert_types, config.n_layer)
    if router_bias_layers == "auto":
        bias_layers = set(range(config.n_hash_layer, config.n_layer, 2))
    else:
        bias_layers = set(router_bias_layers)
    tensors = []
    for name, (shape, _, required) in config.tensor_specs().items():
        if not required and _layer(name) not in bias_layers:
            continue
        qtype, dist = _plan(_key(name), shape[0], dense, experts[_layer(name) or 0])
        _check_rows(name, shape[0], qtype)
        if filled is not None and not filled(name):
            tensors.append((name, shape, qtype, None))
            continue
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])  # independent of the other tensors
        lead = shape[-1]
        few = distinct_rows is not None and len(shape) >= 2 and lead > distinct_rows and dist.kind != "tid2eid"
        drawn = (*shape[:-1], distinct_rows) if few else shape
        raw = _tensor_bytes(qtype, dist, drawn, config, rng)
        if drawn != shape:
            raw = np.resize(raw, (lead, *raw.shape[1:]))  # np.resize repeats the drawn rows
        tensors.append((name, shape, qtype, raw))
    return tensors


def data_dir() -> Path | None:
    """The ``data/`` folder of the checkout ds4lab runs from (a clone with ``pip install -e .``), or None
    where there is none (ds4lab installed from a wheel). It holds the public-domain texts that the tests,
    the training script, the benchmarks and the bench's default prompt read (``data/README.md``)."""
    return _DATA_DIR if _DATA_DIR is not None and _DATA_DIR.is_dir() else None


def data_file(name: str) -> Path:
    """``data/<name>`` of the checkout; FileNotFoundError, naming where it looked, where it is not there."""
    folder = data_dir()
    if folder is None:
        raise FileNotFoundError(f"{name}: ds4lab is not running from a checkout with a data/ folder "
                                f"(looked beside {Path(__file__).resolve().parent})")
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file in the checkout's data/ folder")
    return path


def make_sparse_model(
    config: ModelConfig,
    path: str | os.PathLike,
    seed: int = 0,
    *,
    filled: Callable[[str], bool] = lambda name: False,
    alignment: int | None = None,
    dense_type: str = "Q8_0",
    expert_types: ExpertTypes = ("IQ2_XXS", "Q2_K"),
    router_bias_layers: Literal["all"] | Collection[int] = "all",
) -> Path:
    """A GGUF of ``config``'s exact layout (the real Flash file's, with :data:`ds4lab.config.FLASH`) that costs
    only the tensors ``filled(name)`` picks on disk: those hold :func:`make_model`'s seeded random weights,
    every other tensor is a hole that reads as zeros. The vocabulary is :func:`layout_vocab`'s (no training
    at 129,280 tokens); ``alignment`` sets ``general.alignment``; every non-hash layer has a router bias, as in
    the real file, unless ``router_bias_layers`` says otherwise. Writing the 81 GiB Flash layout with only its
    small tensors filled takes seconds."""
    tokens, merges = layout_vocab(config.n_vocab)
    meta = model_metadata(config, f"ds4lab sparse {config.n_layer}-layer layout (seed {seed})", tokens, merges)
    if alignment is not None:
        meta["general.alignment"] = (alignment, "UINT32")
    if router_bias_layers == "all":
        router_bias_layers = range(config.n_hash_layer, config.n_layer)
    tensors = model_tensors(config, seed, dense_type=dense_type, expert_types=expert_types,
                            router_bias_layers=router_bias_layers, filled=filled)
    return write_gguf(path, meta, tensors)


# The routed experts of ds4's Flash files (its download_model.sh), for make_sparse_model(FLASH, ..., expert_types=):
# IQ2_XXS gate/up with Q2_K down ("q2", 81 GiB), those with Q4_K experts in the last six layers ("q2-q4", 91 GiB),
# Q4_K experts ("q4", 153 GiB), DeepSeek's own MXFP4 experts ("mxfp4", 145 GiB).
FLASH_EXPERT_LAYOUTS = {
    "q2": ("IQ2_XXS", "Q2_K"),
    "q2-q4": [("IQ2_XXS", "Q2_K")] * 37 + [("Q4_K", "Q4_K")] * 6,
    "q4": ("Q4_K", "Q4_K"),
    "mxfp4": ("MXFP4", "MXFP4"),
}

# The tensors a decode step mostly reads (routed experts, the Q8_0 projections, the head): holes in a layout
# model made for speed, where their values do not change the work. What decides routing stays random.
# attn_q_a is not among them (4.5 MB a Flash layer), and the indexer's own q_b is filled (17 MB a ratio-4 layer):
# the indexer's queries read both, and zeros there tie every indexer score, the top-k's slowest case, which real
# weights never give.
BIG_PROJECTIONS = ("_exps.weight", "_shexp.weight", "attn_q_b.weight", "attn_kv.weight", "attn_output_a.weight",
                   "attn_output_b.weight", "output.weight")


def routing_filled(name: str) -> bool:
    """``filled`` for :func:`make_sparse_model`: embeddings, routers, norms, hyper-connection and indexer
    weights random (routing differs per token, and so do the indexer's scores row to row),
    :data:`BIG_PROJECTIONS` holes."""
    return ".indexer." in name or not name.endswith(BIG_PROJECTIONS)


@functools.lru_cache(maxsize=2)
def layout_vocab(n_vocab: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A byte-level BPE vocabulary of exactly ``n_vocab`` tokens made without training: the 256 byte symbols,
    then every pair of them, then pairs followed by one more symbol, each with its merge, then the special
    tokens. It tokenizes any text (every byte is a symbol), which is all a layout model needs."""
    n_learned = n_vocab - 256 - len(SPECIAL_TOKENS)
    if not 0 <= n_learned <= 256 ** 2 * 257:
        raise ValueError(f"layout_vocab: {n_vocab} tokens is outside 263..{256 + 256 ** 2 * 257 + 7}")
    symbols = list(BYTE_TO_UNICODE)
    pairs = ((a, b) for a in symbols for b in symbols)
    triples = ((a + b, c) for a in symbols for b in symbols for c in symbols)
    merges = [f"{a} {b}" for a, b in itertools.islice(itertools.chain(pairs, triples), n_learned)]
    tokens = symbols + [m.replace(" ", "") for m in merges] + list(SPECIAL_TOKENS)
    return tuple(tokens), tuple(merges)


@functools.cache
def default_tokenizer_text() -> str:
    """The first ~300 KB of tinyshakespeare (``data/``), or a built-in paragraph outside a checkout."""
    try:
        path = data_file("tinyshakespeare.txt")
    except FileNotFoundError:
        return _FALLBACK_TEXT
    with path.open(encoding="utf-8") as f:
        return f.read(_TEXT_CHARS)


@functools.lru_cache(maxsize=8)
def _tokenizer(text: str, vocab_size: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    tokens, merges = train_bpe(text, vocab_size)
    return tuple(tokens), tuple(merges)


def _metadata(config: ModelConfig, seed: int, text: str) -> dict:
    tokens, merges = _tokenizer(text, config.n_vocab)
    return model_metadata(config, f"ds4lab random {config.n_layer}-layer model (seed {seed})", tokens, merges)


def model_metadata(config: ModelConfig, name: str, tokens, merges) -> dict:
    """The GGUF metadata of a model: the config's keys, its name and its tokenizer."""
    meta = config.to_metadata()
    meta["general.name"] = (name, "STRING")
    meta["tokenizer.ggml.model"] = ("gpt2", "STRING")
    meta["tokenizer.ggml.tokens"] = (list(tokens), "ARRAY[STRING]")
    meta["tokenizer.ggml.merges"] = (list(merges), "ARRAY[STRING]")
    meta["tokenizer.ggml.bos_token_id"] = (list(tokens).index(BOS), "UINT32")
    meta["tokenizer.ggml.eos_token_id"] = (list(tokens).index(EOS), "UINT32")
    return meta


def write_model(config: ModelConfig, path: str | os.PathLike, params: dict, name: str, tokens, merges, *,
                dense_type: str = "Q8_0", expert_types: ExpertTypes = ("Q8_0", "Q8_0")) -> Path:
    """Write given float weights (``name -> [ne1, ne0]`` arrays, experts ``[n_expert, out, in]``, the
    I32 hash tables as integer arrays) as a GGUF with the same per-tensor types ``make_model`` uses."""
    dense = _qtype(dense_type, _DENSE_TYPES, "dense_type")
    experts = _layer_expert_types(expert_types, config.n_layer)
    tensors = []
    for tname, (shape, _, required) in config.tensor_specs().items():
        if tname not in params:
            if required:
                raise ValueError(f"write_model: tensor {tname} is missing from params")
            continue
        qtype, _ = _plan(_key(tname), shape[0], dense, experts[_layer(tname) or 0])
        _check_rows(tname, shape[0], qtype)
        values = np.asarray(params[tname])
        if values.shape != tuple(reversed(shape)):
            raise ValueError(f"write_model: tensor {tname} has shape {values.shape}, expected {tuple(reversed(shape))}")
        raw = values.astype("<i4").view(np.uint8) if qtype == Q.I32 else quantize(values.astype(np.float32), qtype)
        tensors.append((tname, shape, qtype, raw))
    return write_gguf(path, model_metadata(config, name, tokens, merges), tensors)


# -- per-tensor type and initialisation --------------------------------------------------------------

class _Dist(NamedTuple):
    kind: Literal["normal", "uniform", "tid2eid"]
    a: float = 0.0  # mean or low
    b: float = 0.0  # std or high


def _plan(key: str, ne0: int, dense: Q, experts: tuple[Q, Q]) -> tuple[Q, _Dist]:
    """Type and distribution of a tensor, from its name without the ``blk.N.`` prefix."""
    fan_in = _Dist("normal", 0.0, 1 / math.sqrt(ne0))
    if key == "token_embd.weight":
        return Q.F16, _Dist("normal", 0.0, 1.0)
    if key.endswith("norm.weight"):
        return Q.F32, _Dist("normal", 1.0, 0.1)
    if "hc_" in key:
        # The HC mixer input is RMS-normalised, so rows of std 0.5/sqrt(hc_dim) give mixes of std ~0.5.
        if key.endswith("_fn.weight"):
            return Q.F16, _Dist("normal", 0.0, 0.5 / math.sqrt(ne0))
        if key.endswith("_scale.weight"):
            return Q.F32, _Dist("uniform", 0.5, 1.5)
        return Q.F32, _Dist("normal", 0.0, 0.5)  # _base
    if key == "attn_sinks.weight":
        return Q.F32, _Dist("normal", 0.0, 1.0)
    if key == "exp_probs_b.bias":
        return Q.F32, _Dist("normal", 0.0, 0.1)
    if key == "ffn_gate_tid2eid.weight":
        return Q.I32, _Dist("tid2eid")
    if key.endswith("compressor_ape.weight"):
        return Q.F16, _Dist("normal", 0.0, 0.5)
    if "compressor_" in key or key.startswith("indexer.") or key == "ffn_gate_inp.weight":
        return Q.F16, fan_in
    if key in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
        return experts[0], fan_in
    if key == "ffn_down_exps.weight":
        return experts[1], fan_in
    return dense, fan_in  # attn_q_a/q_b/kv/output_a/output_b, shared expert, output.weight


def _tensor_bytes(qtype: Q, dist: _Dist, shape: tuple[int, ...], config: ModelConfig,
                  rng: np.random.Generator) -> np.ndarray:
    rows, ne0 = tuple(reversed(shape[1:])), shape[0]
    if dist.kind == "tid2eid":
        # Per token (row), n_expert_used distinct expert ids: the first columns of a random permutation.
        order = np.argsort(rng.random((*rows, config.n_expert)), axis=-1)
        return order[..., :ne0].astype("<i4").view(np.uint8)
    if qtype in _BLOCK_TYPES:
        return random_blocks(qtype, rows, ne0, rng, dist.b)
    if dist.kind == "uniform":
        values = rng.uniform(dist.a, dist.b, size=(*rows, ne0))
    else:
        values = dist.a + dist.b * rng.standard_normal((*rows, ne0), dtype=np.float32)
    return quantize(values, qtype)


def _check_rows(name: str, ne0: int, qtype: Q) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    if ne0 % block:
        raise ValueError(f"tensor {name}: ne0 = {ne0} is not a multiple of the {qtype.name} block size {block}")


def _qtype(name: str, allowed: frozenset, what: str) -> Q:
    qtype = Q[name] if isinstance(name, str) else Q(name)
    if qtype not in allowed:
        raise ValueError(f"{what} {qtype.name} is not one of {', '.join(sorted(t.name for t in allowed))}")
    return qtype


def _layer_expert_types(expert_types: ExpertTypes, n_layer: int) -> list[tuple[Q, Q]]:
    """Each layer's (gate/up, down) routed-expert types from one pair for all or a list of one pair a layer."""
    pairs = [expert_types] * n_layer if isinstance(expert_types[0], (str, int)) else list(expert_types)
    if len(pairs) != n_layer or any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"expert_types: one (gate/up, down) pair, or one for each of the {n_layer} layers; "
                         f"got {expert_types!r}")
    return [tuple(_qtype(t, _EXPERT_TYPES, f"expert_types of layer {il}") for t in pair)
            for il, pair in enumerate(pairs)]


def _key(name: str) -> str:
    return name.split(".", 2)[2] if name.startswith("blk.") else name


def _layer(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("blk.") else None


def live_state_rows(state, cfg: ModelConfig, to_numpy=np.asarray) -> list:
    """Every array of ``state`` (a KVState) as NumPy, only its rows a later step reads (runtime.compiled.live_rows):
    what two runs' states must agree on, a compiled step's copy leaving the other rows as its memory held them."""
    from .runtime.compiled import live_rows, present

    arrays = [to_numpy(a) for layer in state.layers for a in present(layer)]
    return [a if live is None else np.concatenate([a[start:stop] for start, stop in live] + [a[:0]])
            for a, live in zip(arrays, live_rows(cfg, state.geometry, state.n_past))]
