"""Regenerate the embedded default model, ds4lab/assets/nano.gguf, from a fixed seed.

    python scripts/make_default_model.py

The nano preset with seeded random weights and a byte-level BPE tokenizer trained on the first part
of shared/data/tinyshakespeare.txt. A trained model will replace it (see the issue tracker); until then
its text is noise, but every mechanism of the architecture (compression, window eviction, indexer
selection, hash and top-k routing) is active within a few hundred tokens.
"""

from pathlib import Path

from ds4lab.config import NANO
from ds4lab.engine import default_model_path
from ds4lab.testing import make_model

SEED = 20261130

if __name__ == "__main__":
    path = make_model(NANO, default_model_path(), seed=SEED)
    print(f"wrote {path} ({Path(path).stat().st_size / 1e6:.2f} MB)")
