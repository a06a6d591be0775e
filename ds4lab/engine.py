"""``ds4lab.load()`` and ``Model``: a GGUF file bound to a backend, with its tokenizer."""

from __future__ import annotations

import warnings
from importlib import resources
from pathlib import Path

import numpy as np

from .backends import get_backend
from .config import ModelConfig, ModelFileError
from .costs import float_weight_bytes
from .gguf_file import load_model_file
from .kv.layout import Geometry, new_state
from .model.transformer import Transformer
from .model.weights import EXPERT_CACHE_BYTES, Weights
from .ops import Ops
from .platform_support import available_memory
from .runtime import Runtime
from .tokenizer import Tokenizer

DEFAULT_MODEL = "shakespeare.gguf"


def default_model_path() -> Path:
    """The embedded default model shipped in ``ds4lab/assets``."""
    return Path(str(resources.files("ds4lab") / "assets" / DEFAULT_MODEL))


class Model:
    """A DS4-architecture model. ``logits(ids)`` returns float32 ``[T, vocab]`` for every position.

    ``transformer`` is the math (:class:`ds4lab.model.transformer.Transformer`, over the file's weights);
    ``runtime`` runs chunks of it (:class:`ds4lab.runtime.Runtime`: compiled calls, padding, tiers).
    """

    def __init__(self, path: Path, backend: str = "auto", numerics: str = "ds4", device: str | None = None,
                 kernels: bool | None = None, prefill_matmul: str = "auto", decode_matmul: str = "float32"):
        self.path = Path(path)
        config, file = load_model_file(self.path)
        self.config: ModelConfig = config
        self.file = file
        try:
            self.tokenizer = Tokenizer.from_metadata(file.metadata)
        except ValueError as e:  # a vocabulary without ds4's special tokens, a merge of unknown symbols, ...
            raise ModelFileError(f"{self.path}: metadata keys tokenizer.ggml.tokens and tokenizer.ggml.merges "
                                 f"do not make a ds4 tokenizer: {e}") from None
        self.backend = get_backend(backend, device, kernels, prefill_matmul, decode_matmul)
        self.numerics = numerics
        weights = Weights(file, self.backend, config.o_groups, config.o_lora)
        self.transformer = Transformer(config, weights, Ops(self.backend), numerics)
        self.runtime = Runtime(self.transformer, self.backend)

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({self.path.name}: {c.n_layer} layers, n_embd {c.n_embd}, vocab {c.n_vocab}, "
                f"backend={self.backend.name}, numerics={self.numerics})")

    @property
    def is_chat(self) -> bool:
        """Whether the file declares a chat template (GGUF's ``tokenizer.chat_template``): chat models get
        their prompts rendered as chat turns by default; others (the embedded Shakespeare model) continue
        plain text."""
        return "tokenizer.chat_template" in self.file.metadata

    def token_ids(self, tokens) -> np.ndarray:
        """Token ids from a list/array, or from a string tokenized as plain text (no chat rendering)."""
        if isinstance(tokens, str):
            tokens = self.tokenizer.encode(tokens)
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError("expected a non-empty 1-D sequence of integer token ids (or a string)")
        return ids.astype(np.int64)

    def geometry(self, ctx: int, prefill_chunk: int | None = None) -> Geometry:
        """The context, chunk and ring of a state of ``ctx`` tokens on this model's backend (see :class:`Geometry`:
        the default chunk is ds4's rule, its later one where the backend runs long chunks eagerly)."""
        return Geometry.for_context(self.config, ctx, prefill_chunk, long_chunks=self.backend.long_prefill_chunks)

    def new_state(self, ctx: int, prefill_chunk: int | None = None):
        """An empty KV state sized for ``ctx`` tokens (see :meth:`geometry`), the RoPE tables made for its positions
        (:meth:`Runtime.rope_tables_for`)."""
        geometry = self.geometry(ctx, prefill_chunk)
        state = new_state(self.config, self.backend, geometry)
        self.runtime.rope_tables_for(geometry)
        return state

    def session(self, ctx: int = 4096, prefill_chunk: int | None = None, max_checkpoints: int = 16, kv_store=None,
                placement=None):
        """A live timeline with step-wise prefill and decode (see :class:`ds4lab.session.Session`).

        ``prefill_chunk`` defaults to ds4's rule: ``DS4_METAL_PREFILL_CHUNK``, else 2048 when ctx > 2048 (on CuPy
        ds4's later 4096 when ctx > 4096; Pro: 8192).
        ``kv_store`` (a :class:`ds4lab.KVStore`) adds ds4-server's disk checkpoints. ``placement`` (a
        :class:`ds4lab.Placement`) splits the layers over tiers; the default is one tier.
        """
        from .session import Session

        self._warn_if_weights_outgrow_memory()
        return Session(self, ctx=ctx, prefill_chunk=prefill_chunk, max_checkpoints=max_checkpoints, kv_store=kv_store,
                       placement=placement)

    _memory_checked = False

    def _warn_if_weights_outgrow_memory(self) -> None:
        """Once, before a first session runs steps: on the numpy backend the dense weights are kept as float64 once a
        step uses them; where that outgrows the memory available, say so (the process is otherwise killed for memory
        some minutes in, without a word: the Flash file on a 24 GB machine)."""
        if self._memory_checked or self.backend.name != "numpy":
            return
        self._memory_checked = True
        need = float_weight_bytes(self.file, np.dtype(self.backend.np_dtype).itemsize) + EXPERT_CACHE_BYTES
        have = available_memory()
        if have is not None and need > have:
            warnings.warn(f"{self.path.name} on the numpy backend keeps its weights as float64 once used: about "
                          f"{need / 2**30:.1f} GiB, where this machine has {have / 2**30:.1f} GiB available, so its "
                          "steps will likely be stopped for memory (a GPU backend keeps the weights quantized)",
                          stacklevel=3)

    def logits(self, tokens) -> np.ndarray:
        """Logits ``[T, vocab]`` (float32) for every position of a prefill of ``tokens`` from zero.

        The prompt runs as one chunk unless the raw ring cannot hold it (more than 8192 tokens, or a
        smaller ``DS4_METAL_GRAPH_RAW_CAP``); chunked and one-shot prefills give the same logits.
        """
        ids = self.token_ids(tokens)
        self.file.check_unchanged()
        state = self.new_state(len(ids) + 1, len(ids))
        out = []
        for start in range(0, len(ids), state.geometry.step):
            X, state = self.runtime.forward(ids[start:start + state.geometry.step], state)
            logits = self.transformer.head(X)
            self.backend.eval(logits)
            out.append(np.asarray(self.backend.to_numpy(logits), dtype=np.float32))
        return np.concatenate(out)


def load(path: str | Path | None = None, backend: str = "auto", numerics: str = "ds4",
         device: str | None = None, kernels: bool | None = None, prefill_matmul: str = "auto",
         decode_matmul: str = "float32") -> Model:
    """Load a DS4 GGUF (the embedded default model when ``path`` is None).

    ``backend``: "auto" (default), "mlx" (float32 on CPU, Metal or CUDA), "numpy" (the float64 reference) or
    "cupy" (float32 on NVIDIA GPUs). "auto" picks as ``ds4lab run --backend auto`` does, through the one rule
    :func:`ds4lab.backends.resolve_backend`: "mlx" on an Apple GPU, else "cupy" when CuPy finds a CUDA GPU,
    else "mlx" when MLX has one (mlx[cuda]), else "numpy" (on CPUs MLX's Linux wheel multiplies matrices with a
    reference BLAS, slower than NumPy); ``device="cpu"`` makes it "numpy", ``device="gpu"`` "mlx".
    ``model.backend.name`` (and ``repr(model)``) says which one it chose.
    ``device``: for "mlx", "cpu" or "gpu" (default: MLX's default device, which a given device also becomes for the
    process; the model's own work keeps its device when a later load moves that default); for "cupy", "cuda:N"
    (default 0).
    ``kernels``: on GPU backends, ds4lab's custom kernels (default on); False gives the plain-ops path.
    ``prefill_matmul``: "auto" (default: "f16" on cupy with its kernels, else "float32"), "float32", "tf32" or
    "f16" (cupy with kernels): with "tf32", weight products over more than 16 rows (a prefill chunk's linears,
    its routed experts' token-expert pairs), a chunk's attention and its indexer scores take both operands
    rounded to TF32 (10 mantissa bits, as many as the half that ds4's GPU prefill casts both to) on the tensor
    cores, with float32 accumulation; decode steps stay float32. About a third of the tensor-core work of the
    float32 path, logits within 2e-3 of float64's scale on the tiny configurations. "f16" rounds the weight
    products' and indexer scores' operands to half instead (the same 10 mantissa bits, to nearest even; the
    tensor cores' half rate, half the shared-memory bytes), attention's too (q, keys and softmax weights): the same
    2e-3, and on an H200 about 3.0x float32's prefill speed on the whole Flash model (2.1x with "tf32"; README,
    "Benchmarks").
    ``decode_matmul``: "float32" (default) or "q8" (cupy with kernels): the decode-sized products (a step's
    linears and routed experts, a short chunk's) of Q8_0, IQ2_XXS and Q2_K weights quantize x to int8 per block as
    ds4's CPU and CUDA decode products do (blocks of 32 for Q8_0 weights, Q8_K's 256 for the low-bit experts) and
    sum the products in integers, four an instruction.
    """
    if path is not None and not str(path):
        raise ValueError("path: an empty path (None loads the embedded model)")
    return Model(Path(path) if path is not None else default_model_path(), backend, numerics, device, kernels,
                 prefill_matmul, decode_matmul)
