#!/usr/bin/env bash
# The checks that need a GPU, in one run on a lent GPU machine (one H100 or H200; its host a 16-core
# Xeon): the device tool runs it in the repository root, the project as source (PYTHONPATH=src).
#
#   bash scripts/device-check.sh            every part, about 9 minutes (the limits below add to 515 s, 536 with the kill grace)
#   bash scripts/device-check.sh tests fuzz  some parts: env, tests, defects, fuzz, bench, cpu, decode
#
# Each part has a time limit of its own, so that the whole run ends in time and one part's hang costs
# only its own; each prints what it ran and its figures; logs and results go to $OUT (the device
# tool brings them back) or ./device-check-out. MHA_TEST_DEVICE=cpu runs the parts on the CPU (a dry
# run of this script; no GPU figures).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=${OUT:-device-check-out}
mkdir -p "$out"
parts=${*:-env tests defects fuzz bench cpu decode}
device=${MHA_TEST_DEVICE:-cuda}
status=0

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $out/NAME.log, report how it ended
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s): $*"
    local start=$SECONDS
    timeout --signal=INT --kill-after=3 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local code=${PIPESTATUS[0]}
    echo "== $name: exit $code after $((SECONDS - start)) s"
    [ "$code" -eq 0 ] || status=1
}

for part in $parts; do
    case $part in
        env)
            step env 20 python - <<'EOF'
import os, platform, subprocess, torch
print("torch", torch.__version__, "| python", platform.python_version(), "| cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.0f} GiB", p.multi_processor_count, "SMs")
try:
    import triton, transformers
    print("triton", triton.__version__, "| transformers", transformers.__version__)
except ImportError as error:
    print("missing:", error)
flags = open("/proc/cpuinfo").read()
model = next((l.split(":", 1)[1].strip() for l in flags.splitlines() if l.startswith("model name")), "?")
wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")
print("cpu", model, os.cpu_count(), "cores |", " ".join(f for f in wanted if f" {f}" in flags))
EOF
            ;;
        tests)  # tests/cuda: every public entry in three dtypes, flex compiled, compile, modules, transformers
            MHA_TEST_DEVICE=$device step tests 180 python -m pytest -q -p no:cacheprovider -m cuda tests/cuda -rs \
                --durations=15 --junitxml="$out/cuda-tests.xml"
            ;;
        defects)  # the zero-sized dims that crashed torch 2.11's process (issue 42), on this torch
            MHA_NATIVE=off step defects 30 python -m pytest -q -p no:cacheprovider tests/kernels/test_defects.py \
                -k "zero_sized or zero_heads or no_rows"
            ;;
        fuzz)  # random calls on the device against the float64 reference; a crash is a finding
            MHA_NATIVE=off step fuzz 35 python -m mha.tools.fuzz --device "$device" --cases 10 --seed 42 --workers 1 \
                --kinds sdpa,varlen,positions --timeout 28 --out "$out/fuzz.json"
            ;;
        bench)  # mha against torch's SDPA and hand-written FlexAttention, half-precision errors
            if [ "$device" = cuda ]; then
                step bench 100 python -m mha bench --sections gpu --quick --repeat 3 --out "$out/bench"
            else
                step bench 120 python -c "
from mha.tools import bench
for r in bench.gpu_rows(dict(plain=[64], terms=256, term_sets=['window', 'documents']), 1, device='cpu'):
    print(r.point, r.ratios, r.extra)"
            fi
            ;;
        cpu)  # the host's CPU (a 16-core Xeon with AMX): its peaks and the native kernel against torch at 16 and 2
              # threads (issue 44's AMX targets); the first call builds the native kernel (ninja is in the image)
            MHA_TUNE=off step cpu 100 python -m mha bench --sections peaks native --quick --repeat 2 --threads 16 2 \
                --out "$out/cpu"
            ;;
        decode)  # the host's bfloat16 decoding steps read three ways (AMX tiles, strips, rows) beside float32, from
                 # memory and from cache, at 16 threads (whether the reading's rule holds there: scripts/decode_reading.py)
            if [ "$device" = cuda ]; then
                MHA_TUNE=off step decode 90 python scripts/decode_reading.py --threads 16 --keys 4096 16384 --rounds 5
            else
                MHA_TUNE=off step decode 50 python scripts/decode_reading.py --threads 2 --keys 1024 --rounds 3
            fi
            ;;
        *) echo "unknown part $part (env, tests, defects, fuzz, bench, cpu, decode)"; status=2 ;;
    esac
done
echo "== device check: exit $status"
exit $status
