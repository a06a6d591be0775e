"""Registers, stack frame, spills and local-memory instructions of every CUDA kernel, from nvcc and cuobjdump
(the module CuPy compiles with NVRTC, compiled here by nvcc for the GPU present). A kernel whose arrays
were meant to stay in registers shows a stack frame and LDL/STL instructions when they did not.

    python benchmarks/kernel_resources.py [--arch sm_90] [--only qmatmul]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

from ds4lab.mlx_kernels import specs as S
from ds4lab.mlx_kernels.dialects import cuda_module_source


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--only", default="", help="kernels whose name contains this")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "kernels.cu", Path(tmp) / "kernels.cubin"
        src.write_text(cuda_module_source(S.all_specs()))
        build = subprocess.run(["nvcc", f"-arch={args.arch}", "-cubin", "-std=c++17", "-Xptxas", "-v", "-o", str(cubin),
                                str(src)], capture_output=True, text=True)
        if build.returncode:
            raise SystemExit(f"nvcc failed:\n{build.stderr[-4000:]}")
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    info, name = {}, None
    for line in build.stderr.splitlines():
        if m := re.search(r"(?:Compiling entry function|Function properties for) '?(\w+)'?", line):
            name = m.group(1)
        elif name and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                                      line)):
            info.setdefault(name, {}).update(stack=int(m[1]), spill_st=int(m[2]), spill_ld=int(m[3]))
        elif name and (m := re.search(r"Used (\d+) registers", line)):
            info.setdefault(name, {})["registers"] = int(m[1])
    for fn, body in re.findall(r"Function : (\w+)\n(.*?)(?=\n\s*Function : |\Z)", sass, flags=re.S):
        lines = [ln for ln in body.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]
        info.setdefault(fn, {}).update(instructions=len(lines), local=sum("LDL" in ln or "STL" in ln for ln in lines),
                                       i2f=sum("I2F" in ln for ln in lines))
    print(f"{'kernel':24s} {'regs':>5s} {'stack':>6s} {'spills':>7s} {'instr':>6s} {'LDL/STL':>8s} {'I2F':>5s}")
    for fn in sorted(info):
        if args.only in fn:
            d = info[fn]
            print(f"{fn:24s} {d.get('registers', '?'):>5} {d.get('stack', '?'):>6} "
                  f"{d.get('spill_st', 0) + d.get('spill_ld', 0):>7} {d.get('instructions', '?'):>6} "
                  f"{d.get('local', '?'):>8} {d.get('i2f', '?'):>5}")


if __name__ == "__main__":
    main()
