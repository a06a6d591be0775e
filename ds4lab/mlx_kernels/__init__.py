"""Custom GPU kernels for the hot paths, each body written once for MLX's two custom-kernel dialects.

``sources/`` holds the bodies (``*.body``, each named for the op it runs: ``store_kv.body`` is the op
``store_kv``) and the helpers they share (``common.h``); :mod:`.dialects` maps the portable names onto CUDA
or Metal; :mod:`.specs` lists the kernels and the host-side plans of their launches; :mod:`.fast` launches
them through MLX's ``mx.fast.metal_kernel`` or, as cubins :mod:`.nvrtc` compiles,
``mx.fast.precompiled_cuda_kernel``; :mod:`ds4lab.cuda.kernels` compiles the same sources for CuPy;
:mod:`.cpu` compiles them as C++ whose work-group threads are fibers with real barriers, so the test suite
runs every kernel on CPUs too (slowly). The host side of a launch is written once, in :mod:`.launches`.
Which op runs a kernel and which its reference formula (the plain-ops path of ``ds4lab/model/``, which the
tests hold the kernels to) is decided in :mod:`ds4lab.ops`, where "How to add a kernel" lists the steps.
"""
