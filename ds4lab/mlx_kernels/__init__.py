"""Custom GPU kernels for the hot paths, each body written once for MLX's two custom-kernel dialects.

``sources/`` holds the bodies (``*.body``) and the helpers they share (``common.h``);
:mod:`.dialects` maps the portable names onto CUDA or Metal; :mod:`.specs` lists the kernels and the
host-side plans of their launches; :mod:`.mlx_ops` launches them through ``mx.fast.metal_kernel`` or,
as cubins :mod:`.nvrtc` compiles, ``mx.fast.precompiled_cuda_kernel``; :mod:`ds4lab.cuda` compiles the
same sources for CuPy; :mod:`.cpu` compiles them as C++ whose work-group threads are fibers with real
barriers, so the test suite runs every kernel on CPUs too (slowly).
The host side of a launch is written once, in :mod:`.launches`. The plain-ops path in
:mod:`ds4lab.model` stays the reference the tests hold the kernels to.
"""
