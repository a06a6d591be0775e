#!/usr/bin/env bash
# Cold start on the whole Flash layout at each upload setting of CupyBackend.device_bytes (threads, the size
# under which a tensor goes up in one copy): the shell's clock from process start to the end of the first
# decode step of a one-token prompt (benchmarks/flash_short_prompts.py; it writes /tmp/flash.gguf if missing).
# A first, untimed run fills CuPy's kernel cache, so every timed run starts with a warm cache, as the issue's
# "cold start" target asks.
#     bash benchmarks/cold_flash_upload.sh [ROUNDS]
set -u
run() {  # run THREADS SMALL_BYTES
    python3 -c "
import runpy, sys
from ds4lab.backends import cupy_backend as c
c.UPLOAD_THREADS, c.SMALL_BYTES = $1, $2
sys.argv = ['flash_short_prompts.py', '--backend', 'cupy', '--max-len', '1']
runpy.run_path('benchmarks/flash_short_prompts.py', run_name='__main__')" > /tmp/cold_flash.log 2>&1
}
run 8 $((64 << 20)) || { cat /tmp/cold_flash.log; exit 1; }
for _ in $(seq "${1:-2}"); do
    for setting in "8 $((64 << 20))" "16 $((1 << 20))" "16 $((64 << 20))" "8 $((1 << 20))"; do
        set -- $setting
        t0=$(date +%s%N)
        run "$1" "$2"
        t1=$(date +%s%N)
        echo "threads $1, one copy up to $2 bytes: $(( (t1 - t0) / 1000000 )) ms to the end of the first decode step;" \
             "$(tail -n 1 /tmp/cold_flash.log)"
    done
done
