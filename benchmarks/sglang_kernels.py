"""SGLang 0.5.23's own kv-canary kernels against ours (kvcanary.ops), on the same plans: identity, then time.

Per workload the inputs are built once (seeded): clean prefix chains, a forward's plan (ours, converted to
SGLang's VerifyPlan / WritePlan; SGLang's plan kernels must give the same) and write inputs. Each op x real-KV
mode runs once per provider on planted corruptions: byte-identical record buffers, the same violation rows
as a multiset (ring order differs with atomics), equal ring counts and launch counters. Then both are timed
on clean inputs from CUDA graphs, one launch per replay and 20 in one graph (per launch = replay / 20):
median, 20th/80th percentiles of many replays, the providers' rounds alternating. ratio = sglang / ours
(> 1: ours is faster); ours is the Triton backend on CUDA. SGLang's kernels come from its wheel unmodified
(CUDA: JIT-built by its load_jit through tvm_ffi, nvcc, ninja; CPU: its torch references); only sglang's
top-level ``__init__`` (the frontend API: aiohttp, IPython, ...) is not run, the package is registered by path.

    bash benchmarks/sglang_wheels.sh install /tmp/sgl    # the wheels carried as wheels_sglang/
    PYTHONPATH=/tmp/sgl:$PWD python3 benchmarks/sglang_kernels.py --device cuda --out k.json
    TRITON_INTERPRET=1 PYTHONPATH=DIR:$PWD python benchmarks/sglang_kernels.py --device cpu --small
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a checkout, not installed

from kvcanary import ops  # noqa: E402
from kvcanary.format import LaunchTag, RealKvMode  # noqa: E402

# name: (batch, prefix per request, new tokens per request, ops timed); every op is checked in each
WORKLOADS = {"decode-bs256-ctx4k": (256, 4095, 1, ("verify", "write")), "decode-bs64-ctx4k": (64, 4095, 1, ("write",)),
             "prefill-bs4-8k": (4, 8192, 8192, ("verify", "write"))}
SMALL_WORKLOADS = {"decode-bs8-ctx64": (8, 63, 1, ("verify", "write")), "decode-bs4-ctx64": (4, 63, 1, ("write",)),
                   "prefill-bs2-32": (2, 32, 32, ("verify", "write"))}
MODES, TAG = (RealKvMode.NONE, RealKvMode.PARTIAL), LaunchTag.TAIL_K_FULL
STRIDE = 32  # SGLang's record (4 fields); ours stores nothing past it without writer ids
RING = 4096  # far above the planted rows: which rows land in a full ring would depend on the atomics' order
CHAIN = 20  # launches per graph in timing mode (b)


def import_sglang() -> types.SimpleNamespace:
    """SGLang's kv-canary modules from its wheel, the ``sglang`` package registered by path (its __init__ not run);
    exits with what to install when they do not import."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("kv-canary: sglang must be importable, got none on sys.path: run `bash "
                         "benchmarks/sglang_wheels.sh install DIR` and put DIR first on PYTHONPATH")
    if "sglang" not in sys.modules:
        pkg = types.ModuleType("sglang")
        pkg.__path__, pkg.__file__, pkg.__spec__ = list(spec.submodule_search_locations), spec.origin, spec
        sys.modules["sglang"] = pkg
    try:
        mods = {n: importlib.import_module(f"sglang.kernels.{m}") for n, m in (
            ("verify", "ops.kv_canary.verify"), ("write", "ops.kv_canary.write"), ("consts", "ops.kv_canary.consts"),
            ("plan", "ops.kv_canary.plan.api"), ("entries", "ops.kv_canary.plan.entries_kernel"), ("jit", "jit.utils"))}
    except ModuleNotFoundError as e:
        raise SystemExit(f"kv-canary: sglang's kernel modules must import, got no module {e.name!r}: install the "
                         "wheels of benchmarks/sglang_wheels.sh (it lists what the kernel path needs)") from e
    from importlib.metadata import distributions

    found = {d.metadata["Name"].lower(): d.version for d in distributions()}
    return types.SimpleNamespace(**mods, version=found.get("sglang"), tvm_ffi_version=found.get("apache-tvm-ffi"),
                                 root=str(Path(spec.origin).parent))


def compile_sglang(sgl) -> float:
    """JIT-build SGLang's three CUDA modules up front (in parallel), with progress lines; seconds taken."""
    say("compiling SGLang's kv-canary CUDA modules (verify, write, plan entries: nvcc via tvm_ffi and ninja, cached "
        f"under {os.environ.get('SGLANG_JIT_CACHE_DIR', '~/.cache/sglang/jit')}) ...")
    t0 = time.perf_counter()
    sgl.jit.parallel_compile([lambda: sgl.verify._jit_canary_verify_module(True), sgl.write._jit_canary_write_module,
                              lambda: sgl.entries._jit_plan_entries_module(False, True)])
    say(f"compiled (or loaded from the cache) in {(dt := time.perf_counter() - t0):.1f} s")
    return dt


class Case:
    """One workload's inputs, built once from ``seed``: bs requests with a clean prefix chain of P tokens
    (written by our default backend, one buffer per real-KV mode), then a forward of E new tokens each."""

    def __init__(self, bs: int, P: int, E: int, device: torch.device, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        ctx, self.bs, self.device = P + E, bs, device
        self.num_slots = bs * ctx + 1  # slot 0: padding
        rtt = torch.zeros(bs + 1, ctx, dtype=torch.int32)
        rtt[1:] = (torch.randperm(self.num_slots - 1, generator=g) + 1).view(bs, ctx).to(torch.int32)
        tokens = torch.randint(0, 32000, (bs + 1, ctx), generator=g, dtype=torch.int32)
        self.kv = torch.randn(self.num_slots, 64, generator=g).to(torch.bfloat16).to(device)
        self.sources = (ops.RealKvSource(self.kv, 1, 128, 128),)
        self.rtt, self.tokens = rtt.to(device), tokens.to(device)
        full = lambda n: torch.full((bs,), n, dtype=torch.int64, device=device)  # noqa: E731
        self.plan_args = dict(req_pool_indices=torch.arange(1, bs + 1, device=device), prefix_lens=full(P),
                              extend_lens=full(E), req_to_token=self.rtt, token_table=self.tokens,
                              token_valid_lens=full(ctx))
        self.plan = ops.Plan.allocate(bs * P, bs, device)
        ops.plan(out=self.plan, **self.plan_args)
        self.loc, self.ids, self.pos = self._inputs(P, E)
        self.flag = torch.ones(1, dtype=torch.int32, device=device)  # the chain-position assert, armed
        pre = ops.Plan.allocate(1, bs, device)  # the prefix: one forward writing P tokens per request
        ops.plan(**{**self.plan_args, "prefix_lens": full(0), "extend_lens": full(P)}, out=pre)
        loc, ids, pos = self._inputs(0, P)
        self.clean = {}
        for mode in MODES:
            buf = ops.allocate_canary_buffer(self.num_slots, STRIDE, device)
            ring = ops.ViolationRing.allocate(RING, device)
            ops.write(buf=buf, plan=pre, num_requests=bs, out_cache_loc=loc, input_ids=ids, positions=pos, ring=ring,
                      counters=ops.allocate_counters(device), launch_tag=LaunchTag.HEAD_K_FULL, sources=self.sources,
                      real_kv_mode=mode)
            assert int(ring.write_index[0]) == 0, "the prefix chains must write clean"
            self.clean[mode] = buf

    def _inputs(self, start: int, n: int):
        loc = self.rtt[1:, start:start + n].reshape(-1).to(torch.int64)
        ids = self.tokens[1:, start:start + n].reshape(-1).to(torch.int64)
        return loc, ids, torch.arange(start, start + n, device=self.device).repeat(self.bs)

    def verify_plants(self, mode, g: torch.Generator):
        """A copy of the clean buffer with records changed at 8 verified entries (token, position, prev hash,
        real-KV hash in turn), and a verified slot whose KV byte to flip (reported in PARTIAL only)."""
        buf, e = self.clean[mode].clone(), self.plan.entries
        picks = torch.randperm(int(e.count[0]), generator=g)[:9].tolist()
        for i, k in enumerate(picks[:8]):
            buf.view(torch.int64)[int(e.slot[k]), i % 4] += 1 + i
        return buf, int(e.slot[picks[8]])

    def write_plants(self, g: torch.Generator):
        """Write inputs off the clean ones (the expected values): a token (write-input assert), a position (both
        asserts: two rows), a skipped slot (-1: no record, no chain step, not counted)."""
        a, b, c = torch.randperm(self.loc.shape[0], generator=g)[:3].tolist()
        loc, ids, pos = self.loc.clone(), self.ids.clone(), self.pos.clone()
        ids[a] += 7
        pos[b] += 3
        loc[c] = -1
        return loc, ids, pos


def sgl_structs(sgl, case: Case, buf, ring, counters, mode):
    """Our plan as SGLang's VerifyPlan / WritePlan (the same tensors where the dtypes agree), and its launch
    context on our ring and counter table (its two counters are views of our tag's row)."""
    e, p, v = case.plan.entries, case.plan, sgl.verify
    vplan = v.VerifyPlan(verify_slot_indices=e.slot, verify_expected_tokens=e.expected_token,
                         verify_expected_positions=e.position, verify_prev_slot_indices=e.prev,
                         verify_num_valid=e.count.to(torch.int32), enable=e.enable)
    wplan = sgl.write.WritePlan(write_offsets=p.write_offsets, write_seed_slot_indices=p.seed_slot,
                                write_num_valid_reqs=torch.full((1,), case.bs, dtype=torch.int32, device=case.device))
    src = tuple(v.RealKvSource(tensor=s.tensor, page_size=s.page_size, num_bytes_per_token=s.num_bytes_per_token,
                               read_bytes=s.read_bytes) for s in case.sources)
    ctx = v.VerifyOrWriteContext(
        canary_buf=buf, kernel_kind=v.CanaryLaunchTag(int(TAG)), violation_ring=ring.rows,
        violation_write_index=ring.write_index, slot_run_counter=counters[int(TAG), 1:2],
        kernel_run_counter=counters[int(TAG), 0:1], real_kv_sources=src,
        real_kv_hash_mode=sgl.consts.RealKvHashMode(int(mode)), enable_chain_position_assert=case.flag)
    return vplan, wplan, ctx


def launcher(sgl, case, provider, op, mode, buf, ring, counters, inputs=None, expected=None):
    """A no-argument call of one op by one provider ('sglang' or one of our backends)."""
    loc, ids, pos = inputs or (case.loc, case.ids, case.pos)
    exp_ids, exp_pos = expected or (None, None)
    if provider == "sglang":
        vplan, wplan, ctx = sgl_structs(sgl, case, buf, ring, counters, mode)
        if op == "verify":
            return lambda: sgl.verify.launch_canary_verify_kernel(context=ctx, plan=vplan,
                                                                  check_verify_expected_token=True)
        return lambda: sgl.write.launch_canary_write_kernel(
            context=ctx, plan=wplan, input_ids=ids, positions=pos, out_cache_loc=loc,
            enable_write_input_assert=exp_ids is not None, expected_input_tokens=exp_ids,
            expected_input_positions=exp_pos)
    kw = dict(buf=buf, ring=ring, counters=counters, launch_tag=TAG, sources=case.sources, real_kv_mode=mode,
              backend=provider)
    if op == "verify":
        return lambda: ops.verify(entries=case.plan.entries, check_token=True, **kw)
    return lambda: ops.write(plan=case.plan, num_requests=case.bs, out_cache_loc=loc, input_ids=ids, positions=pos,
                             expected_input_ids=exp_ids, expected_positions=exp_pos, chain_check=case.flag, **kw)


def check_op(sgl, case, providers, op, mode, seed) -> dict:
    """Every provider once on the planted case; each must agree with SGLang. Returns what was compared."""
    g = torch.Generator().manual_seed(seed)
    if op == "verify":
        (start, kv_slot), inputs, expected = case.verify_plants(mode, g), None, None
    else:
        start, kv_slot, inputs, expected = case.clean[mode], None, case.write_plants(g), (case.ids, case.pos)
    got, flips = {}, [kv_slot] if kv_slot is not None else []
    for slot in flips:  # a KV byte changed after its record was written (undone below: timing runs clean)
        case.kv.view(torch.uint8)[slot, 3] ^= 0x40
    for p in ["sglang"] + providers:
        buf, ring, counters = start.clone(), ops.ViolationRing.allocate(RING, case.device), \
            ops.allocate_counters(case.device)
        launcher(sgl, case, p, op, mode, buf, ring, counters, inputs, expected)()
        n = int(ring.write_index[0])
        got[p] = buf.cpu(), n, sorted(map(tuple, ring.rows[:min(n, RING)].tolist())), counters[int(TAG)].tolist()
    for slot in flips:
        case.kv.view(torch.uint8)[slot, 3] ^= 0x40
    ref_buf, ref_n, ref_rows, ref_counters = got["sglang"]
    what = f"{op} real_kv={mode.name.lower()}"
    assert 0 < ref_n < RING, f"{what}: the plants must give violations within the ring, got {ref_n}"
    for p in providers:
        buf, n, rows, counters = got[p]
        assert torch.equal(buf, ref_buf), f"{what}: {p} stored different records than sglang, slots " \
            f"{(buf != ref_buf).any(1).nonzero().flatten()[:8].tolist()}"
        assert n == ref_n and rows == ref_rows, f"{what}: {p} rows ({n}) {rows} != sglang's ({ref_n}) {ref_rows}"
        assert counters == ref_counters, f"{what}: {p} counters {counters} != sglang's {ref_counters}"
    return {"op": op, "real_kv": mode.name.lower(), "providers": ["sglang"] + providers, "identical": True,
            "violations": ref_n, "reason_bits": sorted({r[7] for r in ref_rows}), "counters": ref_counters}


def check_plan(sgl, case) -> dict:
    """SGLang's own plan kernels on the same inputs must give the plan ours did (entries up to the count)."""
    e, cap, a = case.plan.entries, case.plan.entries.capacity, case.plan_args
    vp = sgl.verify.VerifyPlan.allocate(verify_capacity=cap, device=case.device)
    wp = sgl.write.WritePlan.allocate(write_req_capacity=case.bs, device=case.device)
    sgl.plan.launch_canary_plan_kernels(
        verify_plan_out=vp, write_plan_out=wp, req_pool_indices=a["req_pool_indices"], prefix_lens=a["prefix_lens"],
        extend_seq_lens=a["extend_lens"], req_to_token=case.rtt, swa_window_size=0, full_to_swa_index_mapping=None,
        verify_capacity=cap, req_to_verify_expected_tokens=case.tokens,
        req_to_verify_expected_tokens_valid_lens=a["token_valid_lens"], kv_token_id_vs_position_offset=0)
    n = int(e.count[0])
    pairs = {"count": (vp.verify_num_valid.long(), e.count), "enable": (vp.enable, e.enable),
             "write_offsets": (wp.write_offsets, case.plan.write_offsets),
             "seed_slot": (wp.write_seed_slot_indices, case.plan.seed_slot)} | {
        k: (getattr(vp, f"verify_{theirs}")[:n], getattr(e, k)[:n]) for k, theirs in (
            ("slot", "slot_indices"), ("prev", "prev_slot_indices"), ("position", "expected_positions"),
            ("expected_token", "expected_tokens"))}
    bad = [k for k, (x, y) in pairs.items() if not torch.equal(x.cpu(), y.cpu())]
    assert not bad, f"sglang's plan differs from ours in {bad}"
    return {"op": "plan", "identical": True, "entries": n}


def _quantiles(xs):
    xs = sorted(xs)
    return [xs[min(len(xs) - 1, int(q * len(xs)))] for q in (0.2, 0.5, 0.8)]


def time_cuda(fns: dict, launches: int, budget_s: float, rounds: int = 5) -> dict:
    """ms per launch (p20, p50, p80) of each call, replayed from a graph of ``launches`` captured calls; the
    providers' replays alternate in ``rounds`` blocks so the shared host's drift hits both alike."""
    graphs = {}
    for name, fn in fns.items():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()  # Triton's and SGLang's first-call work stays out of the capture
        torch.cuda.current_stream().wait_stream(side)
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            for _ in range(launches):
                fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for g in [g for g in graphs.values() for _ in range(3)]:
        g.replay()
    torch.cuda.synchronize()
    per_replay = (time.perf_counter() - t0) / (3 * len(graphs))
    n = max(4, min((2000 if launches == 1 else 200) // rounds, int(budget_s / rounds / max(per_replay, 1e-6))))
    times = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
            for a, b in ev:
                a.record()
                g.replay()
                b.record()
            torch.cuda.synchronize()
            times[name] += [a.elapsed_time(b) / launches for a, b in ev]
    return {name: _quantiles(t) for name, t in times.items()} | {"replays": n * rounds}


def time_cpu(fns: dict, reps: int) -> dict:
    """Coarse: wall ms of single eager calls (CPU: SGLang's Python reference against our CPU backend)."""
    def once(fn, t0):
        fn()
        return (time.perf_counter() - t0) * 1e3

    return {n: _quantiles([once(fn, time.perf_counter()) for _ in range(reps)]) for n, fn in fns.items()} | {
        "replays": reps}


def run_workload(sgl, name, spec, providers, device, args) -> tuple[list, list]:
    bs, P, E, timed = spec
    t0 = time.perf_counter()
    case = Case(bs, P, E, device, seed=args.seed)
    say(f"{name}: inputs built in {time.perf_counter() - t0:.1f} s")
    checks = [check_plan(sgl, case)]
    say(f"{name}: plan: sglang's plan kernels give ours ({checks[0]['entries']} verify entries)")
    for op in ("verify", "write"):
        for mode in MODES:
            checks.append(c := check_op(sgl, case, providers, op, mode, args.seed + 1))
            say(f"{name}: {op} real_kv={c['real_kv']}: identical ({c['violations']} planted violation rows, "
                f"reason bits {c['reason_bits']})")
    results, ours, cuda = [], providers[0], device.type == "cuda"
    for op, mode in [(op, mode) for op in timed for mode in MODES] if not args.no_time else []:
        bufs = {p: case.clean[mode].clone() for p in ("sglang", ours)}
        rings = {p: ops.ViolationRing.allocate(RING, device) for p in bufs}
        fns = {p: launcher(sgl, case, p, op, mode, bufs[p], rings[p], ops.allocate_counters(device)) for p in bufs}
        for launches in (1, CHAIN) if cuda else (None,):
            q = time_cuda(fns, launches, args.budget_s) if cuda else time_cpu(fns, args.reps)
            # timed on clean inputs: nothing reported, and both left the same records
            assert all(int(r.write_index[0]) == 0 for r in rings.values()), f"{name} {op}: timed runs reported"
            assert torch.equal(bufs["sglang"], bufs[ours]), f"{name} {op}: timed runs stored different records"
            results.append({"workload": name, "op": op, "real_kv": mode.name.lower(),
                            "entries": bs * (P if op == "verify" else E), "launches_per_graph": launches,
                            "ours": ours, "ours_ms": q[ours], "sglang_ms": q["sglang"], "replays": q["replays"],
                            "ratio": q["sglang"][1] / q[ours][1]})
            say(fmt_row(results[-1]))
    return [dict(c, workload=name) for c in checks], results


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # progress: stderr, the table and the meta line: stdout


def fmt_row(r) -> str:
    us = lambda q: f"{q[1] * 1e3:9.1f} us ({q[0] * 1e3:.1f}-{q[2] * 1e3:.1f})"  # noqa: E731
    launches = f"x{r['launches_per_graph']}" if r["launches_per_graph"] else "eager"
    return (f"{r['workload']:20s} {r['op']:6s} {r['real_kv']:7s} {launches:5s} ours {us(r['ours_ms'])}  "
            f"sglang {us(r['sglang_ms'])}  ratio {r['ratio']:5.2f}")


def _stdout(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def meta(device, sgl, compile_s, write_lanes: bool) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "sglang": sgl.version, "tvm_ffi": sgl.tvm_ffi_version,
            "sglang_import": "sglang's top-level __init__ not run (frontend API); its kernel modules as shipped",
            "ratio": "sglang_ms / ours_ms at the median (> 1: ours is faster)", "jit_compile_s": compile_s}
    if importlib.util.find_spec("triton"):
        info["triton"] = importlib.import_module("triton").__version__
    # KVCANARY_COMMIT names the commit where a checkout carries no (or a stale) .git; +dirty: ops changed since
    commit = os.environ.get("KVCANARY_COMMIT") or _stdout(["git", "rev-parse", "--short", "HEAD"])
    if commit and not os.environ.get("KVCANARY_COMMIT") and _stdout(["git", "status", "--porcelain", "kvcanary"]):
        commit += "+dirty"
    info["commit"], info["write_lanes"] = commit, write_lanes
    if device.type == "cpu":
        info["timing"] = "coarse: eager wall time on the CPU (SGLang's Python reference), not a kernel figure"
    else:
        nvcc = _stdout(["nvcc", "--version"])
        info |= {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
                 "nvcc": nvcc.splitlines()[-1] if nvcc else None}
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="the tiny workloads (the default on cpu)")
    ap.add_argument("--workloads", nargs="+", default=None, help="a subset of the workloads by name")
    ap.add_argument("--no-time", action="store_true", help="the identity checks only")
    ap.add_argument("--budget-s", type=float, default=0.6, help="cuda: seconds of replays per provider and timing")
    ap.add_argument("--reps", type=int, default=3, help="cpu: eager calls timed per provider")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write-lanes", action="store_true", help="decode writes through the block kernel (docs/ops.md)")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args()
    if args.no_write_lanes:  # (on by default: triton_ops.WRITE_LANES_MAX_RATIO)
        importlib.import_module("kvcanary.ops.triton_ops").WRITE_LANES_MAX_RATIO = 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kv-canary: --device cuda must have a CUDA GPU, got none")
    # ours: Triton on cuda (timed); on cpu torch (timed), Triton's interpreter and numba where they run
    cpu, interpret = device.type == "cpu", os.environ.get("TRITON_INTERPRET") == "1"
    providers = ["torch"] + ["triton"] * interpret + ["numba"] * ops.api.numba_available() if cpu else ["triton"]
    if cpu and not interpret:
        say("TRITON_INTERPRET is not 1: our triton backend is not checked on cpu")
    known = {**WORKLOADS, **SMALL_WORKLOADS}
    if unknown := [n for n in args.workloads or [] if n not in known]:
        raise SystemExit(f"kv-canary: --workloads must be among {sorted(known)}, got {unknown}")
    workloads = ({n: known[n] for n in args.workloads} if args.workloads
                 else SMALL_WORKLOADS if args.small or cpu else WORKLOADS)
    sgl = import_sglang()
    say(f"sglang {sgl.version} from {sgl.root}; ours: {providers}")
    compile_s = compile_sglang(sgl) if device.type == "cuda" else None
    runs = [run_workload(sgl, name, spec, providers, device, args) for name, spec in workloads.items()]
    checks, results = [c for cs, _ in runs for c in cs], [r for _, rs in runs for r in rs]
    out = {"meta": meta(device, sgl, compile_s, not args.no_write_lanes), "checks": checks, "results": results}
    print(f"{len(checks)} checks identical (plans, record buffers, violation rows, counters)")
    print("\n".join([f"{'workload':20s} {'op':6s} {'real_kv':7s} {'graph':5s} median per launch (p20-p80); "
                     "ratio = sglang / ours"] * bool(results) + [fmt_row(r) for r in results]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    print(json.dumps(out["meta"]))


if __name__ == "__main__":
    main()
