"""Seeded test models, written once per test session through the project's own GGUF writer."""

import pytest

from ds4lab.config import NANO, replace

# Four configurations covering the architecture's variants: hash layers, ratio-4 layers whose indexer
# is active (more visible rows than top-k), ratio-128 layers, windows shorter than the prompt,
# Q8_0 / Q2_K / Q4_K / IQ2_XXS / MXFP4 / F16 / F32 tensors, and routed experts of other types in other layers
# ("q4k": Q4_K, then MXFP4 as in ds4's native Flash file, as its q2-q4 file changes types in its last layers).
CONFIGS = {
    "nano": (NANO, dict(dense_type="Q8_0", expert_types=("IQ2_XXS", "Q2_K"))),
    "narrow": (replace(NANO, n_layer=5, head_dim=96, value_dim=96, n_rot=32, idx_dim=32, swa=16, idx_topk=8, o_groups=1,
                       n_head=2, q_lora=64, o_lora=64, n_expert=4, n_expert_used=3, ff_exp=64, n_hc=2,
                       n_hash_layer=1),
               dict(dense_type="F16", expert_types=("Q8_0", "F16"))),
    "q4k": (replace(NANO, n_layer=4, n_hash_layer=0, swa=24, idx_topk=12, n_expert=6, n_expert_used=3,
                    idx_heads=2, n_vocab=768),
            dict(dense_type="F32", expert_types=[("Q4_K", "Q4_K")] * 2 + [("MXFP4", "MXFP4")] * 2)),
    "mixed": (replace(NANO, n_layer=4, compress_ratios=(4, 128, 0, 4), swiglu_clamp=(10.0, 7.0, 10.0, 10.0),
                      n_hash_layer=2, swa=8, idx_topk=20, n_hc=3, n_head=8, o_groups=4, n_vocab=512),
              dict(dense_type="Q8_0", expert_types=("IQ2_XXS", "IQ2_XXS"))),
}


@pytest.fixture(scope="session")
def model_paths(tmp_path_factory):
    from ds4lab.testing import make_model

    root = tmp_path_factory.mktemp("models")
    return {name: make_model(cfg, root / f"{name}.gguf", seed=7 + i, **kw)
            for i, (name, (cfg, kw)) in enumerate(CONFIGS.items())}


def emulated_model(path, numerics="ds4", kernels=True, prefill_matmul="float32", mlx_kernels=None,
                   decode_matmul="float32"):
    """A CPU model rebuilt on emulated GPU kernels: the CUDA kernels' bodies compiled for the CPU (numpy backend),
    or, with ``mlx_kernels`` (the emulator's MLX launches), MLX on its CPU device with its kernels answered by the
    emulator. ``kernels=False`` gives the same backend's plain-ops path."""
    import ds4lab
    from ds4lab import ops
    from ds4lab.backends.emulated_backend import EmulatedBackend
    from ds4lab.model.transformer import Transformer
    from ds4lab.model.weights import Weights
    from ds4lab.runtime import Runtime

    if mlx_kernels is None:
        model = ds4lab.load(path, backend="numpy", numerics=numerics)
        model.backend = EmulatedBackend(kernels, chunk_operands=prefill_matmul, decode_matmul=decode_matmul)
    else:
        model = ds4lab.load(path, backend="mlx", device="cpu", numerics=numerics, kernels=False)
        model.backend._kernels = mlx_kernels if kernels else None
    cfg = model.config
    weights = Weights(model.file, model.backend, cfg.o_groups, cfg.o_lora)
    model.transformer = Transformer(cfg, weights, ops.Ops(model.backend), numerics)
    model.runtime = Runtime(model.transformer, model.backend)
    return model
