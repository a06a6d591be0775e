"""``ds4lab.load()`` and ``Model``: a GGUF file bound to a backend, with its tokenizer."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np

from .backends import get_backend
from .config import ModelConfig
from .gguf_file import load_model_file
from .model.transformer import Transformer
from .tokenizer import Tokenizer

DEFAULT_MODEL = "nano.gguf"


def default_model_path() -> Path:
    """The embedded default model shipped in ``ds4lab/assets``."""
    return Path(str(resources.files("ds4lab") / "assets" / DEFAULT_MODEL))


class Model:
    """A DS4-architecture model. ``logits(ids)`` returns float32 ``[T, vocab]`` for every position."""

    def __init__(self, path: Path, backend: str = "mlx", numerics: str = "ds4", device: str | None = None):
        self.path = Path(path)
        config, file = load_model_file(self.path)
        self.config: ModelConfig = config
        self.file = file
        self.tokenizer = Tokenizer.from_metadata(file.metadata)
        self.backend = get_backend(backend, device)
        self.numerics = numerics
        self.transformer = Transformer(config, file, self.backend, numerics)

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({self.path.name}: {c.n_layer} layers, n_embd {c.n_embd}, vocab {c.n_vocab}, "
                f"backend={self.backend.name}, numerics={self.numerics})")

    def token_ids(self, tokens) -> np.ndarray:
        """Token ids from a list/array, or from a string tokenized as plain text (no chat rendering)."""
        if isinstance(tokens, str):
            tokens = self.tokenizer.encode(tokens)
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError("expected a non-empty 1-D sequence of integer token ids (or a string)")
        return ids.astype(np.int64)

    def logits(self, tokens) -> np.ndarray:
        """Logits ``[T, vocab]`` (float32) for every position of a one-shot prefill of ``tokens``."""
        t = self.transformer
        X, _ = t.forward(self.token_ids(tokens), t.new_cache())
        out = t.head(X)
        self.backend.eval(out)
        return np.asarray(self.backend.to_numpy(out), dtype=np.float32)


def load(path: str | Path | None = None, backend: str = "mlx", numerics: str = "ds4",
         device: str | None = None) -> Model:
    """Load a DS4 GGUF (the embedded default model when ``path`` is None)."""
    return Model(Path(path) if path is not None else default_model_path(), backend, numerics, device)
