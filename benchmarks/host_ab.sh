#!/bin/bash
# A/B of the canary's host time per step on one GPU machine: an older tree in .ab_old against the
# working tree, alternating, batch 64 and batch 1 (1B, 2K context), two runs each.
#   echo /.ab_old/ >> .git/info/exclude; mkdir .ab_old; git archive <commit> kvcanary benchmarks | tar -x -C .ab_old
#   then, on the GPU machine (with .ab_old carried along): OUT=<dir> bash benchmarks/host_ab.sh
export PYTHONUNBUFFERED=1
root=$PWD
for args in "--batch 64 --context 2048 --steps 48" "--batch 1 --context 2048 --steps 48"; do
  for r in 1 2; do
    for v in old new; do
      dir=$root; [ $v = old ] && dir=$root/.ab_old
      (cd $dir && PYTHONPATH=$dir python3 $dir/benchmarks/host_profile.py --device cuda --model-size 1b $args --no-cprofile > $OUT/ab_$v.json 2>&1)
      python3 - "$v" "$args" <<'PY'
import json, sys
s = open(f"{__import__('os').environ['OUT']}/ab_{sys.argv[1]}.json").read()
d = json.loads(s[s.index('{'):])
print(sys.argv[1], sys.argv[2], "host", d["canary_host_us_by_part"], "step without/with ms",
      round(d["step_without_canary"]["median_ms"], 2), round(d["step_with_canary"]["median_ms"], 2))
PY
    done
  done
done
