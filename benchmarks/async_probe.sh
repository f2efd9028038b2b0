# Diagnosis of the canary's step graphs under async batching (docs/notes/async_batching.md): one process per
# variant, logs in $OUT. 1B serving with the canary's defaults and with its fused steps off; then the lagging
# side-stream test of tests/test_hf_async.py with the refill's wait dropped (it must fail: the planted race).
export PYTHONUNBUFFERED=1
run() { name=$1; shift; timeout ${T:-100} "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$? $(grep -c 'illegal memory' $OUT/$name.log) illegal; $(grep -m1 'tok/s\|passed\|failed' $OUT/$name.log | cut -c1-200)"; }
UC="python3 benchmarks/user_cost.py --workloads serving --rounds 1 --model-size 1b"
run default $UC --arms canary_fast
run nofused $UC --arms canary_fast --tuning fused_steps=0
run lag_test python3 -m pytest -q -p no:cacheprovider tests/test_hf_async.py -k lagging
cat > $OUT/drop.py <<'PY'
import sys, pytest
from kvcanary.runtime.launch import ForwardLauncher
orig = ForwardLauncher.follow
def follow(self, other):  # the refill's wait for the side stream dropped (graphs.py: _general)
    if other is not None and other == self.streams.side():
        return
    return orig(self, other)
ForwardLauncher.follow = follow
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "tests/test_hf_async.py", "-k", "lagging"]))
PY
run lag_test_dropped python3 $OUT/drop.py
grep -m3 "assert\|Error" $OUT/lag_test_dropped.log | cut -c1-200
