#!/usr/bin/env bash
# The CPU path: the engine benchmark (tiny model, transformers continuous batching) with the torch and
# the numba backend, batch 4 and 16, context 64 and 256. JSON results go to ${OUT:-out/cpu_backends}.
# Usage: PY=.venv/bin/python bash benchmarks/cpu_backends.sh   (BACKENDS=numba: that backend only)
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-out/cpu_backends}
mkdir -p "$OUT"
# Backends alternate per workload so both see the same load on a shared machine.
for batch in 4 16; do
  for context in 64 256; do
    for backend in ${BACKENDS:-torch numba}; do
      PYTHONPATH=$PWD "$PY" -m kvcanary.bench.engine --device cpu --model-size tiny --batch "$batch" \
        --context "$context" --no-profile --rounds "${ROUNDS:-4}" --canary-option "backend=$backend" \
        --json "$OUT/$backend-b$batch-c$context.json" > "$OUT/$backend-b$batch-c$context.log" 2>&1
    done
  done
done
PYTHONPATH=$PWD "$PY" - "$OUT" <<'PYEOF'
import glob, json, sys
print("| backend | batch | context | step without | step with | overhead (pooled / paired) | canary host per step (integration + runtime + launch) |")
print("|---|---|---|---|---|---|---|")
for p in sorted(glob.glob(f"{sys.argv[1]}/*.json"), key=lambda p: (p.split("/")[-1].split("-")[0] != "torch", p)):
    d = json.load(open(p))
    w, h = d["workload"], d["canary_host_us_by_part"]
    b = w["canary_options"][0].split("=")[1]
    print(f"| {b} | {w['batch']} | {w['context']} | {d['step_without_canary']['median_ms']:.2f} ms "
          f"| {d['step_with_canary']['median_ms']:.2f} ms | +{d['overhead_pct']:.1f}% / +{d['overhead_pct_paired']:.1f}% "
          f"| {h['total']:,.0f} us ({h['integration']:,.0f} + {h['runtime']:,.0f} + {h['launch']:,.0f}) |")
PYEOF
