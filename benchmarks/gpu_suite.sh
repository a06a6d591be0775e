#!/usr/bin/env bash
# Everything ds4lab measures on an NVIDIA GPU machine, in one command (docs/GPU.md says what each step needs).
# On a machine without a package index, stage the wheels first (docs/GPU.md): benchmarks/stage_mlx_cuda.sh's
# .mlxA copied to /tmp/w by a first call and .mlxB carried by this one; or the MLX wheel and the first two parts
# of the MLX CUDA wheel in /tmp/w, its third part and the py3.12 wheels of gguf, tokenizers, tqdm, pyyaml and
# pytest in .whlC. Then:
#     bash benchmarks/gpu_suite.sh [GROUP or STEP ...]   (groups: tests graph slice decode profile flash tiers ncu all;
#                                                      steps: tests_cupy ... compare, mlx_ops)
# Results go to $OUT (JSON per benchmark, a log per step). Each step has its own time limit, so one slow
# step cannot eat the call. "slice" (about 3 min) fits one call (a call may run 10 min), "all" does not, and
# "tests" may not: 4-8 min on an H200, MLX's kernel tests taking 2-4 min with its kernel cache cold (then name
# tests_cupy tests_mlx in one call and tests_mlx_tiers tests_tiers in the next).
set -u
what=" ${*:-all} "
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -f /tmp/w/part_aa ] && [ -f /tmp/w/part_ab ] && [ -f .whlC/part_ac ]; then
    cat /tmp/w/part_aa /tmp/w/part_ab .whlC/part_ac > /tmp/w/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
    rm -f /tmp/w/part_a*
fi
# Without the two staging calls (a CuPy-only run) there is no MLX wheel: the rest installs all the same.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    $(ls /tmp/w/*.whl .whlC/*.whl .mlxB/*.whl 2>/dev/null) > "$OUT/install.log" 2>&1 || echo "install: see install.log"
# stage_mlx_cuda.sh's halves of the unpacked CUDA wheel: the first in /tmp/w (call 1), the second carried now
if [ -f /tmp/w/mlx_cuda.txz.0 ] && [ -f .mlxB/mlx_cuda.txz.1 ]; then
    cat /tmp/w/mlx_cuda.txz.0 .mlxB/mlx_cuda.txz.1 | xz -d | tar -C /tmp/site -xf - && rm -f /tmp/w/mlx_cuda.txz.0
fi
export PYTHONPATH=/tmp/site:$PWD
n_gpu=$(nvidia-smi -L | wc -l)
# the whole Flash layout needs an H200's memory: on a smaller GPU flash_full.py takes its first 30 layers
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
flash_fit=""; [ "${gpu_mib:-0}" -lt 100000 ] && flash_fit="--layers 30"
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "   exit $?; $(tail -n 1 "$OUT/$name.log")"
}
want() {  # want STEP GROUP: the step was asked for by its name, its group, or "all"
    case " $what " in *" $1 "*|*" $2 "*|*" all "*) return 0;; esac; return 1
}
want cold slice && step cold 120 python3 benchmarks/cold_start.py --json "$OUT/cold.json"
# one process: the GPU tests share the GPU (pyproject's "-n auto" would start a worker per CPU core)
pytest_gpu="python3 -m pytest -q -p no:cacheprovider -o addopts=-rs"
want tests_cupy tests && step tests_cupy 150 $pytest_gpu -m gpu tests/test_gpu_kernels.py -k "cupy"
# two steps: with MLX's kernel cache cold the kernel tests alone took 124 s on one lease, past 220 s on another
want tests_mlx tests && step tests_mlx 300 $pytest_gpu tests/test_gpu_kernels.py -k "mlx and not emulated"
want tests_mlx_tiers tests && step tests_mlx_tiers 200 $pytest_gpu tests/test_tiers.py -k "mlx and not emulated"
# two GPUs: the tier tests; one: the NCCL link's own test (its communicator sending to itself)
want tests_tiers tests && step tests_tiers 120 $pytest_gpu tests/test_gpu_tiers.py $([ "$n_gpu" -ge 2 ] || echo -k nccl_link)
# ds4's graph tests through the command line (ds4lab run --graph-test family): the embedded model (trained) and a
# nano one (random weights: over a long prompt its FP8/FP4 rounding flips grow, so it runs in exact numerics),
# a decode step and a prompt of 2-3 chunks of 256, kernels against plain ops
graph() {  # graph BACKEND: every graph test on both models; exit 1 if any FAILs
    local rc=0 m t
    python3 -m ds4lab.cli make-model -o /tmp/graph_nano.gguf || return 1
    for m in "" "-m /tmp/graph_nano.gguf --numerics exact"; do
        for t in --graph-test --graph-full-test "--graph-prompt-test --prefill-chunk 256 --ctx 1024"; do
            echo "## ${m:-embedded} $t"
            python3 -m ds4lab.cli run $m --backend "$1" $t -p "$(head -c 1500 data/tinyshakespeare.txt)" || rc=1
        done
    done
    return $rc
}
export -f graph
want graph_cupy graph && step graph_cupy 200 bash -c "graph cupy"
want graph_mlx graph && step graph_mlx 300 bash -c "graph mlx"
want slice_cupy slice && step slice_cupy 200 python3 benchmarks/gpu_slice.py --backend cupy --json "$OUT/slice_cupy.json"
want decode_cupy decode && step decode_cupy 120 python3 benchmarks/gpu_slice.py --backend cupy --prefill \
    --json "$OUT/decode_cupy.json"
want hostprof decode && step hostprof 120 python3 benchmarks/gpu_slice.py --backend cupy --cprofile 50 --decode-ctx 4096
want slice_mlx slice && step slice_mlx 200 python3 benchmarks/gpu_slice.py --backend mlx --decode-ctx 4096 --prefill 8192 \
    --json "$OUT/slice_mlx.json"
want mlx_decode slice && step mlx_decode 200 python3 benchmarks/mlx_decode_host.py --steps 12 --gpu-kernels \
    --json "$OUT/mlx_decode.json"
# MLX-CUDA commits a CUDA graph every MLX_MAX_OPS_PER_BUFFER primitives (MLX 0.32's default on an H100/H200: 100,
# or 1000 MB of inputs; 20 on other GPUs): the decode step at three sizes (only when asked for by name)
if [[ "$what" == *" mlx_ops "* ]]; then
    for n in 20 100 250; do
        step "mlx_ops_$n" 150 python3 benchmarks/mlx_decode_host.py --steps 12 --max-ops-per-buffer "$n" \
            --json "$OUT/mlx_ops_$n.json"
    done
fi
want qgemm slice && step qgemm 60 python3 benchmarks/qgemm_bench.py --repeats 5 --json "$OUT/qgemm.json"
want resources profile && step resources 120 python3 benchmarks/kernel_resources.py
want qmatmul profile && step qmatmul 120 python3 benchmarks/qmatmul_bench.py --variants 8x1s 4x1s --json "$OUT/qmatmul.json"
want profile profile && step profile 150 python3 benchmarks/kernel_profile.py --json "$OUT/profile.json"
# each layer half's kernels by start time at 4K and 32K (q8): where a longer context's decode time goes; "own"
# (only when named): the same with every kernel launched as usual, each kernel's time its own (--no-programmatic)
for c in 4096 32768; do
    want "trace$c" profile && step "trace$c" 200 python3 benchmarks/kernel_profile.py --context "$c" --decode-matmul q8 \
        --trace --json "$OUT/trace$c.json"
    [[ "$what" == *" trace_own$c "* ]] && step "trace_own$c" 200 python3 benchmarks/kernel_profile.py --context "$c" \
        --decode-matmul q8 --trace --no-programmatic --json "$OUT/trace_own$c.json"
done
# a decode step's attention kernels alone (each in a graph of 20 launches) at 4K-32K
want attn_bench profile && step attn_bench 200 python3 benchmarks/decode_attention_bench.py \
    --contexts 4096 8192 16384 32768 --json "$OUT/attn_bench.json"
want flash_f32 flash && step flash_f32 300 python3 benchmarks/flash_full.py $flash_fit --json "$OUT/flash_f32.json"
want flash_tf32 flash && step flash_tf32 300 python3 benchmarks/flash_full.py $flash_fit --prefill-matmul tf32 \
    --json "$OUT/flash_tf32.json"
want flash_f16 flash && step flash_f16 300 python3 benchmarks/flash_full.py $flash_fit --prefill-matmul f16 \
    --json "$OUT/flash_f16.json"
# issue 25's figures: decode (q8, with the step's timeline) and prefill (f16) at the frontiers 4K-32K
want flash_sweep flash && step flash_sweep 300 python3 benchmarks/flash_full.py $flash_fit --prefill-matmul f16 \
    --decode-matmul q8 --timeline 64 --ctx-start 4096 --step-incr 4096 --ctx-max 32768 --gen-tokens 64 \
    --json "$OUT/flash_sweep.json"
# ds4's other Flash files that fit one H200 (q2-q4: 91 GiB) and, over two GPUs, the MXFP4 one (145 GiB)
want flash_q2q4 flash && [ -z "$flash_fit" ] && step flash_q2q4 300 python3 benchmarks/flash_full.py --experts q2-q4 --prefill-matmul f16 \
    --json "$OUT/flash_q2q4.json"
want flash_mxfp4 tiers && [ "$n_gpu" -ge 2 ] && step flash_mxfp4 400 python3 benchmarks/flash_full.py --experts mxfp4 \
    --prefill-matmul f16 --tiers 2 --json "$OUT/flash_mxfp4.json"
want tier_split tiers && [ "$n_gpu" -ge 2 ] && step tier_split 200 python3 benchmarks/tier_split.py --json "$OUT/tier_split.json"
# the whole Flash model over two GPUs (layers split evenly) and on one, frontiers 4K-32K (issue 29's run)
for t in 2 1; do
    want flash_tiers tiers && [ "$n_gpu" -ge 2 ] && step "flash_tiers$t" 400 python3 benchmarks/flash_full.py \
        --prefill-matmul f16 --tiers "$t" --ctx-start 4096 --step-incr 4096 --ctx-max 32768 --gen-tokens 64 \
        --json "$OUT/flash_tiers$t.json"
done
# compare: the 4K decode step, qmatmul_bench and qgemm_bench (float32, tf32) of this tree, then of each tree staged
# under .trees/ (benchmarks/stage_trees.sh BRANCH ...), in one call: their ratios come from one machine and one
# run. COMPARE picks the benchmarks (default "decode qmatmul qgemm qgemm_tf32"); a tree takes about 3-4 minutes
# with all four, so stage one or two branches a call. COMPARE=flash: the full 43-layer Flash model's frontiers
# 2048 and 4096 (flash_full.py; about 25 s a tree once the first has written the sparse file; an H200's memory);
# FLASH_ARGS adds to its arguments (FLASH_ARGS="--decode-matmul q8 --timeline 64"; on a GPU of less than 100 GB
# "--layers 30" is added unless it names --layers); the table of compare_summary.py ends the step.
# COMPARE=slice_q8: the slice's whole decode step graphs at 4K in q8, replayed (kernel_profile.py; about 40 s a
# tree, and it fits an H100). QMATMUL_ARGS adds to qmatmul_bench's (QMATMUL_ARGS='--decode-matmul float32 q8 --only
# routed'). PASSES=2 runs the trees in turn twice (the files of pass 2 named "..._pass2"). COMPARE=tests: a staged
# tree's own CuPy kernel tests, run in the tree (this checkout's data/ and model assets linked into it).
in_tree() {  # in_tree BENCH SECONDS SCRIPT ARGS...: SCRIPT of $tree with $tree's ds4lab, if COMPARE names BENCH
    local bench=$1 limit=$2; shift 2
    [[ " ${COMPARE:-decode qmatmul qgemm qgemm_tf32} " == *" $bench "* ]] || return 0
    step "${bench}_$name" "$limit" env PYTHONPATH="/tmp/site:$tree" python3 "$tree/$1" "${@:2}" \
        --json "$OUT/${bench}_$name.json"
}
tree_tests() {  # the CuPy kernel tests of staged tree $tree, run there (pytest's rootdir puts its ds4lab first)
    [[ " ${COMPARE:-} " == *" tests "* && "$tree" != "$PWD" ]] || return 0
    [ -d "$tree/tests" ] || { echo "== tests_$name: no tests/ staged (stage_trees.sh stages them since 2026-12-05)"; return 0; }
    ln -sfn "$PWD/data" "$tree/data" && ln -sfn "$PWD/ds4lab/assets" "$tree/ds4lab/assets"
    step "tests_$name" 180 bash -c "cd '$tree' && PYTHONPATH=/tmp/site:$tree $pytest_gpu -m gpu tests/test_gpu_kernels.py -k cupy"
}
if [[ "$what" == *" compare "* ]]; then  # only when asked for by name: "all" leaves it out
    [[ "${PASSES:-1}" =~ ^[1-9][0-9]*$ ]] || { echo "PASSES=${PASSES} is not a count of passes" >&2; exit 2; }
    if [[ " ${FLASH_ARGS:-} " != *" --layers "* ]] && [ -n "$flash_fit" ]; then
        FLASH_ARGS="${FLASH_ARGS:-} $flash_fit"
        echo "== compare: ${gpu_mib} MiB of GPU memory, the flash runs take $flash_fit"
    fi
    for pass in $(seq "${PASSES:-1}"); do
        for tree in "$PWD" "$PWD"/.trees/*/; do
            [ -d "$tree/ds4lab" ] || continue
            name=$(basename "$tree"); [ "$tree" = "$PWD" ] && name=this
            [ "$pass" = 1 ] || name="${name}_pass$pass"
            in_tree decode 150 benchmarks/gpu_slice.py --backend cupy --decode-ctx 4096 --prefill
            in_tree qmatmul 120 benchmarks/qmatmul_bench.py ${QMATMUL_ARGS:-}
            in_tree qgemm 90 benchmarks/qgemm_bench.py --repeats 5
            in_tree qgemm_tf32 90 benchmarks/qgemm_bench.py --tf32 --repeats 5
            in_tree qgemm_f16 90 benchmarks/qgemm_bench.py --operands f16 --repeats 5  # trees since 9448da3
            in_tree flash 140 benchmarks/flash_full.py --ctx-max 4096 --gen-tokens 64 ${FLASH_ARGS:-}
            in_tree slice_q8 120 benchmarks/kernel_profile.py --context 4096 --decode-matmul q8 --repeats 5
            [ "$pass" = 1 ] && tree_tests
        done
    done
    # the ratios of the flash runs (this tree's step over each other's, pass by pass) in the call's output
    [[ " ${COMPARE:-} " == *" flash "* ]] && python3 benchmarks/compare_summary.py "$OUT"
fi
# Nsight Compute on one launch each of the prefill's two largest kernels (TF32 variants): speed of light,
# occupancy, warp states, the busiest pipes. ncu runs the GPU at base clocks: read ratios, not times.
NCU_SECTIONS="--section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats
    --section ComputeWorkloadAnalysis"
want ncu_qgemm ncu && step ncu_qgemm 150 ncu --kernel-name regex:qgemm_iq2_xxs_tf32 --launch-skip 2 --launch-count 1 \
    $NCU_SECTIONS python3 benchmarks/qgemm_bench.py --tf32 --repeats 1
want ncu_attn ncu && step ncu_attn 200 ncu --kernel-name regex:attend_chunk_tf32 --launch-skip 8 --launch-count 1 \
    $NCU_SECTIONS python3 benchmarks/gpu_slice.py --backend cupy --decode-ctx --prefill 4096 --tf32
# hc_pre in a decode step's graph (a chain of dependent sums; since 86833bd two launches a half, the mixer's work-group
# on a side stream and x_in's on the main one): both parts, where their warps wait, by source line
want ncu_hc_pre ncu && step ncu_hc_pre 200 ncu --kernel-name regex:^hc_pre\$ --launch-skip 100 --launch-count 2 \
    $NCU_SECTIONS --section SchedulerStats --section SourceCounters python3 benchmarks/gpu_slice.py --backend cupy \
    --decode-ctx 4096 --prefill
# a decode step's chain on a ratio-4 layer at 32K (decode_attention_bench.py's first launches, outside its graphs):
# the indexer's two kernels and the split-key attention, where their warps wait (one run a kernel: ncu's launch count
# is over every launch its regex matches)
for k in indexer_scores indexer_allowed attend_partial; do
    want ncu_decode_attn ncu && step "ncu_$k" 120 ncu --kernel-name "regex:^$k\$" --launch-count 1 $NCU_SECTIONS \
        --section SchedulerStats --section SourceCounters python3 benchmarks/decode_attention_bench.py --contexts 32768
done
# and on one launch of the routed gate's decode product, float32 x and quantized x (their stall reasons)
for k in qmatmul_iq2_xxs qmatmul_xq8_iq2_xxs; do
    want "ncu_$k" ncu && step "ncu_$k" 150 ncu --kernel-name "regex:^$k\$" --launch-skip 2 --launch-count 1 \
        $NCU_SECTIONS --section MemoryWorkloadAnalysis python3 benchmarks/qmatmul_bench.py --decode-matmul float32 q8 \
        --only "routed gate" --repeats 1
done
true
