"""The kernel sources on a CPU: both dialects rendered from the same bodies and checked, the CUDA module
compiled where nvcc exists, and the host-side launch plans."""

from __future__ import annotations

import ctypes
import dataclasses
import re
import shutil
import subprocess

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ds4lab.mlx_kernels import layout
from ds4lab.mlx_kernels import specs as S
from ds4lab.mlx_kernels.cpu import compiler
from ds4lab.mlx_kernels.dialects import (
    _IDS,
    CUDA_ONLY,
    METAL_ONLY,
    SOURCES,
    cuda_module_source,
    header,
    places_its_wait,
)
from ds4lab.quants import dequantize, iq2xxs_tables, quantize, random_blocks

SPECS = S.all_specs()
PORTABLE = [re.sub(r"[(].*", "", name) for name in _IDS["cuda"]]


def code_only(src: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", src, flags=re.S)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_metal_source_has_no_cuda_left(spec):
    header, source = spec.mlx_source("metal")
    text = code_only(header + source)
    assert [tok for tok in CUDA_ONLY if tok in text] == []
    # MLX adds Metal's thread attributes to the signature when the source names them.
    used = {name for name in PORTABLE if name in code_only((SOURCES / spec.body).read_text())}
    for name in used:
        attr = _IDS["metal"][name if name != "GROUP_BARRIER" else "GROUP_BARRIER()"]
        assert f"#define {name}" in source and attr in source


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_cuda_source_has_no_metal_left(spec):
    header, source = spec.mlx_source("cuda")
    text = code_only(header + source)
    assert [tok for tok in METAL_ONLY if tok in text] == []


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_every_name_a_body_uses_is_defined(spec):
    body = code_only((SOURCES / spec.body).read_text())
    macros = set(re.findall(r"\b[A-Z][A-Z_0-9]{2,}\b", body))
    for dialect in ("cuda", "metal", "cpu"):
        header, source = spec.mlx_source(dialect)
        defined = set(re.findall(r"#define (\w+)", header + source))
        assert macros <= defined, (dialect, macros - defined)
        # every #define of the body is undone after it, so kernels can share one translation unit
        assert set(re.findall(r"#define (\w+)", source)) == set(re.findall(r"#undef (\w+)", source))


def test_cuda_module_compiles_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed here; the GPU tests compile the module with NVRTC instead")
    src = tmp_path / "ds4lab_kernels.cu"
    src.write_text(cuda_module_source(SPECS))
    run = subprocess.run([nvcc, "-arch=sm_90", "-ptx", str(src), "-o", str(tmp_path / "k.ptx")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    for spec in SPECS:
        assert f".entry {spec.name}(" in ptx
        # a programmatic launch (ds4lab.cuda.driver.launch) may start before the kernel before it has flushed its
        # writes: every kernel waits for them, before its first read of global memory unless its body places the
        # wait itself (after reading only weights and launch constants: qmatmul's IQ2_XXS tables)
        entry = ptx[ptx.index(f".entry {spec.name}("):]
        entry = entry[:entry.find(".entry ", 1)] if ".entry " in entry[1:] else entry
        wait, first_read = entry.find("griddepcontrol.wait"), re.search(r"\bld(\.\w+)*\.global", entry)
        assert wait != -1, spec.name
        if not places_its_wait(spec.body_source("cuda")):
            assert first_read is None or wait < first_read.start(), spec.name


# What a body that places its own wait may read before it: launch constants the host made (no kernel writes them);
# x, the weights' rows, the ids and the outputs only after it.
READ_BEFORE_WAIT = {"dims", "batches", "aux"}


@pytest.mark.parametrize("spec", [s for s in SPECS if places_its_wait(s.body_source("cuda"))], ids=lambda s: s.name)
def test_a_body_reads_only_constants_before_its_wait(spec):
    body = spec.body_source("cuda")
    before = body[:re.search(r"^\s*grid_dependency_wait\(\);", body, re.M).start()]
    before = re.sub(r"//[^\n]*|^#[^\n]*", "", before, flags=re.M)  # comments and the constants' #defines read nothing
    names = {n for n, _ in (*spec.inputs, *spec.outputs)}
    assert {n for n in names if re.search(rf"\b{n}\b", before)} <= READ_BEFORE_WAIT


# The Metal Shading Language names a kernel body uses, as C++ declarations: enough for a C++ compiler to
# check the rendered Metal source for undeclared names, wrong types and syntax (the semantics of threads,
# SIMD groups and barriers are the GPU tests' job).
METAL_SHIM = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#define device
#define threadgroup
#define kernel
#define thread
struct uint3 { unsigned int x, y, z; };
typedef unsigned int uint;
typedef _Float16 half;
typedef unsigned short ushort;
struct float4 {
    float x, y, z, w;
    float4() = default;
    float4(float a, float b, float c, float d) : x(a), y(b), z(c), w(d) {}
};
struct uint2 { unsigned int x, y; };
struct uint4 { unsigned int x, y, z, w; };
struct char4 { signed char x, y, z, w; };
namespace metal { namespace precise { inline float divide(float a, float b) { return a / b; } } }
enum mem_flags { mem_threadgroup };
inline void threadgroup_barrier(mem_flags) {}
inline float simd_sum(float x) { return x; }
inline float simd_max(float x) { return x; }
inline float simd_shuffle(float x, ushort lane) { return x; }
template <class T, class F> T as_type(F f) { T t; std::memcpy(&t, &f, sizeof t); return t; }
using std::ceil; using std::exp; using std::exp2; using std::fabs; using std::floor; using std::log2;
using std::rint; using std::sqrt;
inline float max(float a, float b) { return a > b ? a : b; }
inline float min(float a, float b) { return a < b ? a : b; }
inline uint max(uint a, uint b) { return a > b ? a : b; }
inline uint min(uint a, uint b) { return a < b ? a : b; }
inline uint popcount(uint x) { return uint(__builtin_popcount(x)); }
struct ulong2 { unsigned long x, y; ulong2(unsigned long a, unsigned long b) : x(a), y(b) {} };
template <class T, int C, int R> struct simdgroup_matrix { T e[2]; T* thread_elements() { return e; } };
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
template <class T, int C, int R> simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T) { return {}; }
template <class T, int C, int R>
void simdgroup_load(simdgroup_matrix<T, C, R>&, const T*, unsigned long = C, ulong2 = ulong2(0, 0), bool = false) {}
template <class T, int C, int R>
void simdgroup_store(simdgroup_matrix<T, C, R>, T*, unsigned long = C, ulong2 = ulong2(0, 0), bool = false) {}
template <class T, int C, int R>
void simdgroup_multiply_accumulate(simdgroup_matrix<T, C, R>&, simdgroup_matrix<T, C, R>, simdgroup_matrix<T, C, R>,
                                   simdgroup_matrix<T, C, R>) {}
"""
_METAL_TYPES = {"float32": "float", "float16": "half", "uint8": "uint8_t", "int32": "int32_t"}


def metal_translation_unit(spec) -> str:
    """The rendered Metal source in the form MLX's metal_kernel gives it (header, then the signature
    MLX writes from the input/output names, then the body), over the C++ shim."""
    header, source = spec.mlx_source("metal")
    args = [f"const device {_METAL_TYPES[t]}* {n}" for n, t in spec.inputs]
    args += [f"device {_METAL_TYPES[t]}* {n}" for n, t in spec.outputs]
    args += [f"uint3 {a}" for a in ("threadgroup_position_in_grid", "thread_position_in_threadgroup",
                                    "threads_per_threadgroup")]
    return f"{METAL_SHIM}\n{header}\nkernel void {spec.name}({', '.join(args)}) {{\n{source}\n}}\n"


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_metal_source_compiles_as_cpp_over_a_metal_shim(spec, tmp_path):
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler here (g++ or clang++)")
    src = tmp_path / f"{spec.name}.cpp"
    src.write_text(metal_translation_unit(spec))
    run = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-Werror=return-type", str(src)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]


def test_mlx_cuda_cubins_are_kept_by_source_architecture_and_nvrtc(tmp_path, monkeypatch):
    """MLX-CUDA's cubins (``nvrtc.cubins``) come from disk unless the kernel's source, the GPU architecture or
    NVRTC changed; NVRTC itself is replaced here by a recorder."""
    from ds4lab.mlx_kernels import build_cache, nvrtc

    compiled = []

    def fake_compile(source, arch, what):
        compiled.append((what, arch))
        return f"{arch} {len(source)}".encode()

    monkeypatch.setattr(build_cache.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(nvrtc, "compile_cubin", fake_compile)
    version = [(13, 0)]
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: version[0])
    spec = SPECS[0]
    first = nvrtc.cubins([spec], "sm_90")
    assert nvrtc.cubins([spec], "sm_90") == first == {spec.name: b"sm_90 %d" % len(cuda_module_source([spec]))}
    assert compiled == [(spec.name, "sm_90")]
    changed = dataclasses.replace(spec, defines={**spec.defines, "UNUSED_CONSTANT": 1})
    nvrtc.cubins([changed], "sm_90")
    nvrtc.cubins([spec], "sm_89")
    version[0] = (13, 1)
    nvrtc.cubins([spec], "sm_90")
    assert len(compiled) == 4
    assert len(list(tmp_path.glob("ds4lab-cubin-*.cubin"))) == 4 and not list(tmp_path.glob("*.partial"))


def test_unknown_dialect_is_refused():
    with pytest.raises(ValueError, match="unknown kernel dialect 'opencl'"):
        SPECS[0].body_source("opencl")


def test_pair_batches_group_by_expert_in_batches_of_at_most_max_pairs():
    experts = np.array([3, 1, 3, 3, 0, 3, 3, 3, 3, 3, 3, 3, 1])
    order, batches = S.pair_batches(experts, len(experts), 8)
    assert sorted(order.tolist()) == list(range(len(experts)))
    seen = []
    for e, first, count in batches:
        assert 1 <= count <= 8
        pairs = order[first:first + count]
        assert (experts[pairs] == e).all()
        seen += pairs.tolist()
    assert sorted(seen) == list(range(len(experts)))
    assert [tuple(b) for b in batches] == [(0, 0, 1), (1, 1, 2), (3, 3, 8), (3, 11, 2)]
    # a dense linear: one matrix, pairs in order
    order, batches = S.pair_batches(None, 19, 8)
    assert order.tolist() == list(range(19)) and [tuple(b) for b in batches] == [(0, 0, 8), (0, 8, 8), (0, 16, 3)]


def test_qmatmul_splits_k_for_few_rows():
    # the hyper-connection mixer, the router, the indexer's projection: split until QMATMUL_SIMD_GROUPS
    # SIMD groups or splits of 4 blocks of 256
    assert S.qmatmul_splits(16384, 24, 1) == (16, 1024)
    assert S.qmatmul_splits(4096, 256, 1) == (4, 1024)
    assert S.qmatmul_splits(4096, 64, 1) == (4, 1024)
    R, G = S.QMATMUL_SIMD_ROWS, S.QMATMUL_SIMD_GROUPS  # rows per SIMD group, the SIMD groups wanted
    assert S.qmatmul_splits(4096, G // 4 * R, 2) == (2, 2048)  # two batches of pairs: G/2 groups, two splits
    assert S.qmatmul_splits(4096, G * R, 1)[0] == 1  # enough rows
    assert S.qmatmul_splits(4096, -(-G // 3) * R, 3)[0] == 1
    assert S.qmatmul_splits(1024, 24, 1)[0] == 1  # too short to split
    assert S.qmatmul_splits(2047, 24, 1)[0] == 1
    assert S.qmatmul_splits(2048, 24, 1) == (2, 1024)
    assert S.qmatmul_splits(8448, 24, 1) == (7, 1280)  # 8 splits of 5 blocks: the eighth would be empty
    assert S.qmatmul_splits(5000, 24, 1) == (4, 1280)
    # a kernel's own rows a SIMD group: the routed gate of six experts, 2048 rows, at 8 (float) and 16 (xq8)
    assert S.qmatmul_splits(4096, 2048, 6, 8) == S.qmatmul_splits(4096, 2048, 6) == (1, 4096)
    assert S.qmatmul_splits(4096, 2048, 6, 16) == (2, 2048)
    # Q8_0 to twice the SIMD groups: attn_output_b (4096 rows, K 8192) at 16 rows (xq8) and 8 (float)
    assert S.qmatmul_splits(8192, 4096, 1, 16) == (4, 2048) and S.qmatmul_splits(8192, 4096, 1, 16, Q.Q8_0) == (8, 1024)
    assert S.qmatmul_splits(8192, 4096, 1, 8, Q.Q8_0) == (4, 2048)
    assert S.qmatmul_splits(4096, 2048, 6, 16, Q.IQ2_XXS) == (2, 2048)
    for K in (1, 100, 256, 1000, 2048, 3000, 4096, 5000, 8448, 16384, 65536):
        for N in (1, 24, 64, 256, 1024, 4096):
            for n_batches in (1, 2, 6):
                splits, chunk = S.qmatmul_splits(K, N, n_batches)
                assert (splits - 1) * chunk < K <= splits * chunk  # every split holds some of K
                assert chunk % S.QMATMUL_SPLIT_ALIGN == 0
                groups = -(-N // S.QMATMUL_SIMD_ROWS) * n_batches
                assert splits == 1 or (chunk >= S.QMATMUL_MIN_SPLIT and groups < S.QMATMUL_SIMD_GROUPS)


def test_attention_splits_cover_every_key():
    """Split s holds the keys n ≡ s (mod splits): at most keys_per_split of them, ATTN_MIN_SPLIT or more; the
    splits bring the grid to ATTN_GROUPS work-groups where N has the keys for them."""
    blocks = S.attend_partial_head_blocks
    assert blocks(64) == 64 // S.ATTN_HEADS and blocks(S.ATTN_HEADS + 1) == 2
    # Flash's decode at 4K context: 128 raw rows, then 1,072 compressed ones
    assert S.attend_partial_dims(1, 64, 512, 1200, 128).tolist() == [1, 64, 512, 1200, 32, 38, 128]
    for T in (1, 2, 16):
        for H in (1, 4, 20, 64):
            for n in (1, 31, 32, 255, 257, 1200, 4100, 70000):
                _, _, _, N, splits, per, N1 = S.attend_partial_dims(T, H, 128, n)
                assert N1 == N == n
                assert (per - 1) * splits < n <= per * splits
                assert splits == 1 or n // splits >= S.ATTN_MIN_SPLIT
                groups = T * S.attend_partial_head_blocks(H)
                assert groups * (splits - 1) < S.ATTN_GROUPS
                assert groups * splits >= S.ATTN_GROUPS or splits == max(1, n // S.ATTN_MIN_SPLIT)
    with pytest.raises(ValueError, match="head_dim 1024"):
        S.attend_partial_dims(1, 1, 1024, 10)


def test_chunk_attention_groups_cover_every_head():
    heads = S.ATTN_CHUNK_HEADS
    for H in (1, heads, heads + 1, 64):
        T, blocks = S.attend_chunk_groups(5, H, 512)
        assert T == 5 and (blocks - 1) * heads < H <= blocks * heads
    with pytest.raises(ValueError, match="head_dim 1024"):
        S.attend_chunk_groups(1, 1, 1024)


EIGHT_VALUE_DECODERS = [(q, S.DECODERS[q].replace("dq_", "dq8_"), S.DECODERS[q]) for q in S.DECODERS]


@pytest.mark.skipif(compiler() is None, reason="no C++20 compiler here")
def test_eight_value_decoders_equal_the_element_decoders(tmp_path):
    """dq8_<type>(row, k) gives dq_<type>(row, k + i) bit for bit, every variant qmatmul can select included
    (the common header compiled as C++ through the CPU dialect)."""
    funcs = "".join(
        f'extern "C" void check_{eight}(const uint8_t* row, const uint8_t* aux, uint K, float* got, float* want) {{\n'
        f"    for (uint k = 0; k + 8u <= K; k += 8u) {{\n"
        f"        F8 r = {eight}(row, k, aux);\n"
        f"        for (uint i = 0; i < 8u; i++) {{ got[k + i] = r.v[i]; want[k + i] = {one}(row, k + i, aux); }}\n"
        f"    }}\n}}\n" for _, eight, one in EIGHT_VALUE_DECODERS)
    src, lib = tmp_path / "decoders.cpp", tmp_path / "decoders.so"
    src.write_text(header("cpu") + funcs)
    run = subprocess.run([compiler(), "-std=c++20", "-O1", "-shared", "-fPIC", str(src), "-o", str(lib)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    decoders = ctypes.CDLL(str(lib))
    aux = iq2xxs_tables()
    K = 1024
    for qtype, eight, _ in EIGHT_VALUE_DECODERS:
        rng = np.random.default_rng(int(qtype))
        if qtype in (Q.F32, Q.F16):
            row = quantize(rng.standard_normal((1, K)).astype(np.float32), qtype)[0]
        else:
            row = random_blocks(qtype, (1,), K, rng, 0.05)[0]
        tiled = np.ascontiguousarray(layout.blocks(row, qtype))  # the kernels' layout (Q8_0's tiles)
        got, want = np.full(K, np.nan, np.float32), np.full(K, -1.0, np.float32)
        pointers = [ctypes.c_void_p(a.ctypes.data) for a in (tiled, aux, got, want)]
        getattr(decoders, f"check_{eight}")(*pointers[:2], ctypes.c_uint(K), *pointers[2:])
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), eight
        assert np.array_equal(want, dequantize(row[None], qtype, K)[0]), eight  # the element decoders are right


def test_qgemm_tiles_are_checked(monkeypatch):
    """Tile shapes that overflow Metal's 32 KB of group-shared memory, or do not split into the SIMD
    groups' 16x8 tiles, are refused with the shape named."""
    monkeypatch.setattr(S, "QGEMM_BN", 256)
    with pytest.raises(ValueError, match="64x256x32 need more than 32768 bytes"):
        S.qgemm_spec(Q.Q8_0)
    monkeypatch.setattr(S, "QGEMM_BN", 72)
    with pytest.raises(ValueError, match="whole 16x8 tiles"):
        S.qgemm_spec(Q.Q8_0)
