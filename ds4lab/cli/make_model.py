"""``ds4lab make-model``: write a small GGUF of the Flash architecture with seeded random weights
(:func:`ds4lab.testing.make_model`)."""

from __future__ import annotations

from .common import check_output


def make_model_command(args) -> int:
    from ..config import PRESETS
    from ..testing import make_model

    check_output(args.output, "-o")
    try:
        path = make_model(PRESETS[args.preset], args.output, seed=args.seed)
    except OSError as e:  # the writer's error names its hidden temporary file: name the requested one
        raise OSError(f"-o {args.output}: {e.strerror or e}") from None
    print(path)
    return 0
