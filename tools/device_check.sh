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
# Its exit code is 0 only when the tests and the benchmark both passed
# (on a GPU, with at least one test run there); otherwise its last line
# says what failed, with each exit code. Where torch sees no CUDA device
# it runs neither and exits 1 saying so: nothing was checked on a GPU.
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
} >"$LOG" 2>&1
# The torch line goes to the log; its last word, whether CUDA is there,
# decides whether a CUDA run can check anything at all.
TORCH=$("$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>>"$LOG")
[ -n "$TORCH" ] && echo "$TORCH" >>"$LOG"
NOT_RUN=
if [ "$MODE" = cuda ] && [ -z "$TORCH" ]; then
    NOT_RUN="$PYTHON cannot import torch: nothing was checked on a GPU; tests/test_cuda and the codec benchmark did not run"
elif [ "$MODE" = cuda ] && [ "${TORCH##* }" != True ]; then
    NOT_RUN="no CUDA device ($TORCH): nothing was checked on a GPU; tests/test_cuda and the codec benchmark did not run (tools/device_check.sh --cpu runs the CPU half)"
fi

TESTS_RC=-
BENCH_RC=-
if [ -z "$NOT_RUN" ]; then
    timeout 420 "$PYTHON" -m pytest tests/test_cuda "${SELECT[@]}" -q -rs \
        -p no:cacheprovider --junitxml="$OUT/tests.xml" >>"$LOG" 2>&1
    TESTS_RC=$?
    # shellcheck disable=SC2086
    timeout 120 "$PYTHON" tools/analysis_tools/benchmark_codec.py \
        --device "$DEVICE" --sizes-mb $SIZES --json "$OUT/codec.json" \
        >>"$LOG" 2>&1
    BENCH_RC=$?
fi

# The summary goes to device_check.json and the log; what failed, one
# line, to stdout (empty when all passed).
PROBLEMS=$("$PYTHON" - "$OUT" "$MODE" "$TESTS_RC" "$BENCH_RC" "$NOT_RUN" \
    <<'EOF' 2>>"$LOG"
import json
import os
import sys
import xml.etree.ElementTree as ET

out, mode, tests_rc, bench_rc, not_run = sys.argv[1:]
tests_rc, bench_rc = (None if rc == '-' else int(rc)
                      for rc in (tests_rc, bench_rc))
summary = dict(mode=mode, tests_rc=tests_rc, bench_rc=bench_rc)
problems = [not_run] if not_run else []
if tests_rc is not None:
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
    if tests_rc == 124:
        problems.append('tests/test_cuda timed out after 420 s (exit 124)')
    elif tests_rc != 0:
        counted = (f", {summary['failed']} failed"
                   if summary.get('failed') else '')
        problems.append(f'tests/test_cuda exited with {tests_rc}{counted}')
    elif mode == 'cuda' and summary.get('passed') == 0:
        problems.append('tests/test_cuda exited with 0 but no test ran on '
                        f"the GPU ({summary['skipped']} skipped)")
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
    if bench_rc == 124:
        problems.append('the codec benchmark timed out after 120 s '
                        '(exit 124)')
    elif bench_rc != 0:
        problems.append(f'the codec benchmark exited with {bench_rc}')
summary['problems'] = problems
tmp = os.path.join(out, 'device_check.json.tmp')
with open(tmp, 'w') as f:
    json.dump(summary, f, indent=1)
os.replace(tmp, os.path.join(out, 'device_check.json'))
with open(os.path.join(out, 'device_check.log'), 'a') as f:
    print(json.dumps(summary, indent=1), file=f)
print('; '.join(problems))
EOF
)
SUMMARY_RC=$?
[ "$SUMMARY_RC" -ne 0 ] && PROBLEMS="${PROBLEMS:+$PROBLEMS; }its summary failed (exit $SUMMARY_RC)"

tail -n 40 "$LOG"
if [ -n "$PROBLEMS" ]; then
    echo "$PROG: $PROBLEMS (see $LOG)" >&2
    exit 1
fi
