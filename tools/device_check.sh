#!/usr/bin/env bash
# The GPU checks of issue 32 as one script, for a lent GPU machine (its
# image: CUDA PyTorch, Triton, pytest; no MMEngine, no package index).
#
#   tools/device_check.sh            # on the GPU: about 3 minutes
#   tools/device_check.sh --cpu      # its CPU half (make test runs it)
#
# It runs the CUDA tests (tests/test_cuda: every hook's CUDA path against
# its CPU path, the int8 codec and the casts bit for bit, CUDA AMP, FSDP2
# on one GPU) and the codec benchmark against the device's copy bandwidth
# (tools/analysis_tools/benchmark_codec.py), and leaves under $OUT (default
# work_dirs/device_check):
#   device_check.log   everything printed, the device and torch first
#   tests.xml          the tests' JUnit report
#   codec.json         the benchmark's figures
#   device_check.json  a summary: device, passed/failed/skipped, exit codes
# Its exit code is 0 only when the tests and the benchmark both passed.
# With --cpu it runs the same steps on the CPU (the CUDA tests skip, the
# benchmark takes small buckets): the script cannot rot between loans.
set -u

PROG=device_check.sh
USAGE="usage: $PROG [--cpu]"
MODE=cuda
for arg in "$@"; do
    case "$arg" in
        --cpu) MODE=cpu ;;
        -h | --help) echo "$USAGE"; exit 0 ;;
        *) echo "$USAGE" >&2
           echo "$PROG: error: unknown argument '$arg' (only --cpu)" >&2
           exit 2 ;;
    esac
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
# PYTHON if set, else the checkout's venv, else the image's python.
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    command -v python >/dev/null && PYTHON=python
    [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
fi
OUT=${OUT:-work_dirs/device_check}
mkdir -p "$OUT" || exit 1
LOG=$OUT/device_check.log
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if [ "$MODE" = cuda ]; then
    SIZES="16 64 256"
    DEVICE=cuda
    # Everything under tests/test_cuda, the CPU case run included.
    SELECT=()
else
    SIZES="1 4"
    DEVICE=cpu
    # make test runs the CPU cases already; here only the plumbing.
    SELECT=(-k "not test_the_cases_run_on_cpu")
fi

{
    echo "# $PROG ($MODE) at $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    command -v nvidia-smi >/dev/null && nvidia-smi
    "$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
} >"$LOG" 2>&1

timeout 420 "$PYTHON" -m pytest tests/test_cuda "${SELECT[@]}" -q -rs \
    -p no:cacheprovider --junitxml="$OUT/tests.xml" >>"$LOG" 2>&1
TESTS_RC=$?
# shellcheck disable=SC2086
timeout 120 "$PYTHON" tools/analysis_tools/benchmark_codec.py \
    --device "$DEVICE" --sizes-mb $SIZES --json "$OUT/codec.json" \
    >>"$LOG" 2>&1
BENCH_RC=$?

"$PYTHON" - "$OUT" "$MODE" "$TESTS_RC" "$BENCH_RC" <<'EOF' >>"$LOG" 2>&1
import json
import os
import sys
import xml.etree.ElementTree as ET

out, mode, tests_rc, bench_rc = sys.argv[1], sys.argv[2], *map(
    int, sys.argv[3:])
summary = dict(mode=mode, tests_rc=tests_rc, bench_rc=bench_rc)
try:
    suite = ET.parse(os.path.join(out, 'tests.xml')).getroot()
    suite = suite if suite.tag == 'testsuite' else suite[0]
    total, failed, errors, skipped = (
        int(suite.get(k, 0)) for k in ('tests', 'failures', 'errors',
                                       'skipped'))
    summary.update(
        passed=total - failed - errors - skipped,
        failed=failed + errors,
        skipped=skipped,
        failures=[
            case.get('name') for case in suite.iter('testcase')
            if case.find('failure') is not None
            or case.find('error') is not None
        ])
except (OSError, ET.ParseError, IndexError) as e:
    summary['tests_report'] = f'unreadable: {e}'
try:
    with open(os.path.join(out, 'codec.json')) as f:
        codec = json.load(f)
    summary['device'] = codec['device']
    summary['torch'] = codec['torch']
    summary['codec'] = {
        f"{r['name']} {r['size_mb']:g} MiB": round(r['of_copy'], 3)
        for r in codec['rows']
    }
except (OSError, ValueError, KeyError) as e:
    summary['codec_report'] = f'unreadable: {e}'
tmp = os.path.join(out, 'device_check.json.tmp')
with open(tmp, 'w') as f:
    json.dump(summary, f, indent=1)
os.replace(tmp, os.path.join(out, 'device_check.json'))
print(json.dumps(summary, indent=1))
EOF

tail -n 40 "$LOG"
if [ "$TESTS_RC" -ne 0 ] || [ "$BENCH_RC" -ne 0 ]; then
    echo "$PROG: tests exited with $TESTS_RC, the benchmark with $BENCH_RC (see $LOG)" >&2
    exit 1
fi
