#!/usr/bin/env bash
# Cold start on the whole Flash layout: the shell's clock from process start to the end of the first decode
# step of a one-token prompt (benchmarks/flash_short_prompts.py; it writes /tmp/flash.gguf if missing), for
# each ds4lab checkout given (its root, or a folder of benchmarks/stage_trees.sh), in turn, ROUNDS times. A
# first, untimed run of each fills CuPy's kernel cache, so every timed run starts warm (issue 25's target).
#     bash benchmarks/cold_flash_upload.sh ROUNDS CHECKOUT...
set -u
run() {  # run CHECKOUT
    PYTHONPATH="$1:${PYTHONPATH:-}" python3 benchmarks/flash_short_prompts.py --backend cupy --max-len 1 \
        > /tmp/cold_flash.log 2>&1
}
rounds=$1; shift
for checkout in "$@"; do
    run "$checkout" || { cat /tmp/cold_flash.log; exit 1; }
done
for _ in $(seq "$rounds"); do
    for checkout in "$@"; do
        t0=$(date +%s%N)
        run "$checkout" || { echo "$checkout: failed"; cat /tmp/cold_flash.log; exit 1; }
        t1=$(date +%s%N)
        echo "$checkout: $(( (t1 - t0) / 1000000 )) ms to the end of the first decode step; $(tail -n 1 /tmp/cold_flash.log)"
    done
done
