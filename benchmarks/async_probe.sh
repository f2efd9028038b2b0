# Diagnosis of the canary's step graphs under async batching (docs/notes/async_batching.md), one process per
# variant, logs in $OUT: 1B serving under the canary with graphs and async (defaults, then fused steps off),
# the lagging-side-stream test of tests/test_hf_async.py, then 1B serving with the static refill's wait for the
# side stream dropped (runtime/step/graphs.py, _general), which must fail as 21b73ed did (an illegal address).
# Run at b79c616 with the last variant on the tiny model's test instead, which passed with the wait dropped
# too: the tiny model does not reproduce the race; the 1B variant has not run in this form yet.
export PYTHONUNBUFFERED=1
run() { name=$1; shift; timeout ${T:-100} "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$? $(grep -c 'illegal memory' $OUT/$name.log) illegal; $(grep -m1 'tok/s\|passed\|failed' $OUT/$name.log | cut -c1-200)"; }
UC="benchmarks/user_cost.py --workloads serving --rounds 1 --model-size 1b --arms canary_fast"
run default python3 $UC
run nofused python3 $UC --tuning fused_steps=0
run lag_test python3 -m pytest -q -p no:cacheprovider tests/test_hf_async.py -k lagging
cat > $OUT/drop.py <<'PY'
import runpy, sys
from kvcanary.runtime.launch import ForwardLauncher
orig = ForwardLauncher.follow
def follow(self, other):  # the refill's wait for the side stream dropped (graphs.py: _general)
    if other is not None and other == self.streams.side():
        return
    return orig(self, other)
ForwardLauncher.follow = follow
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
PY
run dropped python3 $OUT/drop.py $UC
