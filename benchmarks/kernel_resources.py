"""Registers, stack frame, spills and local-memory instructions of every CUDA kernel, and with ``--loops`` the
instructions of each loop by kind (SASS, from cuobjdump). A kernel whose arrays were meant to stay in registers
shows a stack frame and LDL/STL instructions when they did not; a loop's mix shows what it issues per step.

By default the module CuPy compiles with NVRTC is compiled here by nvcc for the GPU present. ``--nvrtc``
compiles each kernel with NVRTC instead (the library CuPy and MLX-CUDA use), which needs no GPU and no nvcc:
on a machine without CUDA, the ``nvidia-cuda-nvrtc``, ``nvidia-cuda-runtime`` (cuda_fp16.h), ``nvidia-cuda-
cuobjdump`` and ``nvidia-cuda-nvdisasm`` wheels give the tools (set CUDA_HOME to their ``nvidia/cu13`` folder,
with a ``lib64`` link to its ``lib``, and put its ``bin`` on PATH).

    python benchmarks/kernel_resources.py [--arch sm_90] [--only qmatmul]
    python benchmarks/kernel_resources.py --nvrtc --only qmatmul_iq2_xxs --loops
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

from ds4lab.mlx_kernels import specs as S
from ds4lab.mlx_kernels.dialects import cuda_module_source


def nvcc_build(arch: str, tmp: Path) -> tuple[str, dict]:
    """The SASS of every kernel in one module compiled by nvcc, and ptxas's registers, stack and spills."""
    src, cubin = tmp / "kernels.cu", tmp / "kernels.cubin"
    src.write_text(cuda_module_source(S.all_specs()))
    build = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-std=c++17", "-Xptxas", "-v", "-o", str(cubin),
                            str(src)], capture_output=True, text=True)
    if build.returncode:
        raise SystemExit(f"nvcc failed:\n{build.stderr[-4000:]}")
    info, name = {}, None
    for line in build.stderr.splitlines():
        if m := re.search(r"(?:Compiling entry function|Function properties for) '?(\w+)'?", line):
            name = m.group(1)
        elif name and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                                      line)):
            info.setdefault(name, {}).update(stack=int(m[1]), spill_st=int(m[2]), spill_ld=int(m[3]))
        elif name and (m := re.search(r"Used (\d+) registers", line)):
            info.setdefault(name, {})["registers"] = int(m[1])
    return subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout, info


def nvrtc_build(arch: str, tmp: Path, only: str) -> tuple[str, dict]:
    """The same through NVRTC, a cubin per kernel (registers and stack from cuobjdump; spills show as LDL/STL)."""
    from ds4lab.mlx_kernels.nvrtc import compile_cubin

    sass, info = [], {}
    for spec in S.all_specs():
        if only not in spec.name:
            continue
        cubin = tmp / f"{spec.name}.cubin"
        cubin.write_bytes(compile_cubin(cuda_module_source([spec]), arch, spec.name))
        sass.append(subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True,
                                   check=True).stdout)
        usage = subprocess.run(["cuobjdump", "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        if m := re.search(r"REG:(\d+) STACK:(\d+)", usage):
            info[spec.name] = {"registers": int(m[1]), "stack": int(m[2])}
    return "\n".join(sass), info


def loops(body: str) -> list[tuple[int, collections.Counter]]:
    """Each loop of a function's SASS (a branch back to an earlier instruction): its length and its
    instructions by kind (the opcode before its first dot, predicates dropped)."""
    ins = [(int(m[1], 16), m[2].strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", body)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    found = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m[1], 16) < a and int(m[1], 16) in at:
            span = ins[at[int(m[1], 16)]:i + 1]
            kinds = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in span)
            found.append((len(span), kinds))
    return found


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--only", default="", help="kernels whose name contains this")
    p.add_argument("--nvrtc", action="store_true", help="compile with NVRTC, a kernel at a time (no GPU needed)")
    p.add_argument("--loops", action="store_true", help="print each loop's instructions by kind")
    p.add_argument("--min-loop", type=int, default=40, help="loops shorter than this many instructions are left out")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        sass, info = nvrtc_build(args.arch, Path(tmp), args.only) if args.nvrtc else nvcc_build(args.arch, Path(tmp))
    bodies = dict(re.findall(r"Function : (\w+)\n(.*?)(?=\n\s*Function : |\Z)", sass, flags=re.S))
    for fn, body in bodies.items():
        lines = [ln for ln in body.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]
        info.setdefault(fn, {}).update(instructions=len(lines), local=sum("LDL" in ln or "STL" in ln for ln in lines),
                                       i2f=sum("I2F" in ln for ln in lines))
    print(f"{'kernel':24s} {'regs':>5s} {'stack':>6s} {'spills':>7s} {'instr':>6s} {'LDL/STL':>8s} {'I2F':>5s}")
    for fn in sorted(info):
        if args.only in fn:
            d = info[fn]
            spills = d["spill_st"] + d["spill_ld"] if "spill_st" in d else "?"
            print(f"{fn:24s} {d.get('registers', '?'):>5} {d.get('stack', '?'):>6} {spills:>7} "
                  f"{d.get('instructions', '?'):>6} {d.get('local', '?'):>8} {d.get('i2f', '?'):>5}")
            if args.loops and fn in bodies:
                for n, kinds in loops(bodies[fn]):
                    if n >= args.min_loop:
                        mix = ", ".join(f"{k} {c}" for k, c in kinds.most_common(12))
                        print(f"    loop of {n} instructions: {mix}")


if __name__ == "__main__":
    main()
