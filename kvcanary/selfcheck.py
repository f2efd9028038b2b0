"""A short self-check: every op on an example, every usable backend compared with the reference.

``kvcanary selfcheck`` prints one row per (op, backend): whether its output matched the
reference bit for bit, and what the example found (violations planted on purpose); then the
backends it could not run here, each with the reason.
"""

from __future__ import annotations

import os

import torch

from kvcanary import ops
from kvcanary.format import CHAIN_HEAD, FailReason, LaunchTag, RealKvMode, splitmix64, to_unsigned


OPS = ("scatter", "plan", "write", "accept_rewrites", "verify", "fingerprint", "read_table", "attention")


def skipped_backends(device: torch.device) -> dict[str, str]:
    """The backends that cannot run on ``device`` here, each with the reason."""
    from kvcanary.ops import api

    out = {}
    if device.type != "cpu":
        out["numba"] = f"numba runs CPU tensors only, the device is {device.type}"
    elif not api.numba_available():
        out["numba"] = "numba does not import (pip install 'kv-canary[cpu]')"
    if not api.triton_available():
        out["triton"] = "triton does not import (pip install 'kv-canary[triton]')"
    elif device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        out["triton"] = "Triton on the CPU needs TRITON_INTERPRET=1 (its interpreter)"
    return out


def usable_backends(device: torch.device) -> list[str]:
    skipped = skipped_backends(device)
    return [b for b in ("reference", "torch", "numba", "triton") if b not in skipped]


def _example(device: torch.device) -> dict:
    """Two requests with a shared prefix page, a prefill then a decode, one planted stale table cell."""
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(17, 4, 16, generator=g).to(torch.bfloat16).to(device)  # 17 pages of 4 tokens
    src = ops.RealKvSource(kv, page_size=4, num_bytes_per_token=32, read_bytes=32)
    rtt = torch.zeros(3, 16, dtype=torch.int32, device=device)
    rtt[1, :6] = torch.tensor([4, 5, 6, 7, 8, 9], dtype=torch.int32)
    rtt[2, :6] = torch.tensor([4, 5, 6, 7, 12, 13], dtype=torch.int32)
    return {"kv": kv, "src": src, "rtt": rtt, "device": device}


def _run(backend: str, ex: dict) -> dict:
    device = ex["device"]
    t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    buf = ops.allocate_canary_buffer(68, 48, device)
    ring = ops.ViolationRing.allocate(16, device)
    counters = ops.allocate_counters(device)
    plan = ops.Plan.allocate(32, 2, device)
    table = torch.full((3, 16), -7, dtype=torch.int32, device=device)
    prompts = [[11, 12, 13, 14, 15, 16], [11, 12, 13, 14, 25, 26]]
    ops.scatter_req_token_ids(t(prompts[0] + prompts[1]), t([0, 6, 12]), t([1, 2]), table, backend=backend)
    rows = t([1, 2])
    common = dict(ring=ring, counters=counters, backend=backend)
    # Prefill request 1 (6 tokens), then request 2 reuses its first page (4 tokens) and writes 2.
    # A seed slot is never written by the same launch (implementations run requests in parallel).
    for rows_, prefix, extend, locs, ids, pos, writer in (
            ([1], [0], [6], [4, 5, 6, 7, 8, 9], prompts[0], [0, 1, 2, 3, 4, 5], [100]),
            ([2], [4], [2], [12, 13], prompts[1][4:], [4, 5], [200])):
        ops.plan(req_pool_indices=t(rows_), prefix_lens=t(prefix), extend_lens=t(extend), req_to_token=ex["rtt"],
                 out=plan, token_table=table, token_valid_lens=t([6]), backend=backend)
        ops.write(buf=buf, plan=plan, num_requests=1, out_cache_loc=t(locs), input_ids=t(ids), positions=t(pos),
                  launch_tag=LaunchTag.TAIL_K_FULL, sources=(ex["src"],), real_kv_mode=RealKvMode.ALL,
                  writer_ids=t(writer), step=t([0]), **common)
    # Request 2's prefill again, as an engine recomputing it: slot 12 rewritten with the same record and
    # bytes that differ by rounding (accepted: its hash follows the bytes, the decode below reads it clean);
    # slot 13's HEAD record differs (kept).
    head = buf.clone()
    head[13] = 0
    ex["kv"][3, 0, 0] += 1
    rewrites = torch.zeros(1, dtype=torch.int64, device=device)
    ops.accept_rewrites(head_buf=head, tail_buf=buf, plan=plan, num_requests=1, out_cache_loc=t([12, 13]),
                        sources=(ex["src"],), real_kv_mode=RealKvMode.ALL, rewrites=rewrites, backend=backend)
    accepted = (buf.cpu(), int(rewrites[0]))
    # Decode with a planted stale cell: request 2's position 5 points at request 1's slot 9.
    ex["rtt"][2, 5] = 9
    ops.plan(req_pool_indices=rows, prefix_lens=t([6, 6]), extend_lens=t([1, 1]), req_to_token=ex["rtt"], out=plan,
             token_table=table, token_valid_lens=t([6, 6]), backend=backend)
    ops.verify(buf=buf, entries=plan.entries, launch_tag=LaunchTag.TAIL_K_FULL, sources=(ex["src"],),
               real_kv_mode=RealKvMode.ALL, **common)
    ex["rtt"][2, 5] = 13
    fp = ops.fingerprint(t([4, 9, 13, 99]), (ex["src"],), RealKvMode.PARTIAL, backend=backend)
    # A read table from a flat read index: request 1 reads 5 slots, request 2 reads 6 (index entries from 9 on
    # take -1).
    read_out = torch.full((3, 8), -7, dtype=torch.int32, device=device)
    flat = torch.cat([ex["rtt"][1, :5], ex["rtt"][2, :6]])
    ops.read_table(read_out, rows, t([4, 5]), t([1, 1]), flat, clamp_max=flat.numel() - 1, limit=9, fill=-1,
                   backend=backend)
    rows_found = sorted(map(tuple, ring.rows[:int(ring.write_index[0])].tolist()))
    attention = _attention(backend, device)
    return {"scatter": table.cpu(), "plan": [x.cpu() for x in (plan.entries.slot, plan.entries.prev,
                                                               plan.entries.expected_token, plan.write_offsets)],
            "write": buf.cpu(), "accept_rewrites": accepted, "verify": rows_found, "read_table": read_out.cpu(),
            "counters": counters.cpu(), "fingerprint": fp.cpu(), "attention": attention}


def _attention(backend: str, device: torch.device) -> list:
    """The attention-metadata pass (``ops/attention_ops.py``) over two requests' metadata with two planted faults:
    request 2's key length one too long, and its first query's mask row showing request 1's key 0. Its ring rows."""
    from kvcanary.ops.attention_ops import attention_impl

    t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    # request 1: prefix 2, 2 new tokens (keys 0-3); request 2: prefix 1, 1 new token (keys 4-5)
    allowed = torch.zeros(3, 6, dtype=torch.bool)
    allowed[0, :3], allowed[1, :4], allowed[2, 4:6] = True, True, True
    allowed[2, 0] = True
    mask = torch.where(allowed, 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16).to(device)
    ring = ops.ViolationRing.allocate(8, device)
    attention_impl(backend)(req_pool_indices=t([1, 2]), prefix_lens=t([2, 1]), extend_lens=t([2, 1]),
                            positions=t([2, 3, 1]), request_ids=t([100, 200]), window=0,
                            cu_seqlens_k=t([0, 4, 7], torch.int32), mask=mask, key_slots=t([4, 5, 6, 7, 12, 13]),
                            launch_tag=int(LaunchTag.HEAD_K_FULL), ring=ring)
    return sorted(map(tuple, ring.rows[:int(ring.write_index[0])].tolist()))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
        return all(_same(x, y) for x, y in zip(a, b))
    return a == b


def run_selfcheck(device: str | torch.device = "cpu") -> dict:
    """Run the example on every usable backend; returns {"vectors": bool, "rows": [...], "ok": bool}."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"kv-canary: selfcheck device must be available, got {device} without a CUDA GPU")
    vectors = (splitmix64(1) == 0x5692161D100B05E5 and CHAIN_HEAD == 0xDE7FAE23A9A1B716)
    results = {b: _run(b, _example(device)) for b in usable_backends(device)}
    skipped = skipped_backends(device)
    ref = results["reference"]
    rows = []
    for backend, res in results.items():
        for op in OPS:
            rows.append({"op": op, "backend": backend, "matches_reference": _same(res[op], ref[op])})
    found = [{"slot": r[1], "position": r[2], "reason": r[7], "expected_aux": hex(to_unsigned(r[6]))}
             for r in ref["verify"]]
    attention = [{"request": r[5], "reason": r[7]} for r in ref["attention"]]
    ok = (vectors and all(r["matches_reference"] for r in rows) and len(found) == 1 and found[0]["slot"] == 9
          and ref["accept_rewrites"][1] == 1 and sorted(a["reason"] for a in attention) == sorted(
              [int(FailReason.KEY_LENGTH), int(FailReason.ATTENTION_MASK)]))
    return {"device": str(device), "vectors": vectors, "rows": rows, "planted_found": found,
            "rewrites_accepted": ref["accept_rewrites"][1], "attention_found": attention, "skipped": skipped,
            "ok": ok}


def format_selfcheck(result: dict) -> str:
    lines = [f"kv-canary self-check on {result['device']}: hash test vectors "
             f"{'ok' if result['vectors'] else 'FAILED'}", f"{'op':16s} {'backend':10s} bit-exact vs reference"]
    for r in result["rows"]:
        lines.append(f"{r['op']:16s} {r['backend']:10s} {'yes' if r['matches_reference'] else 'NO'}")
    lines.append(f"planted stale table cell -> {len(result['planted_found'])} violation(s): "
                 + ", ".join(f"slot {f['slot']} pos {f['position']} reason {f['reason']}"
                             for f in result["planted_found"]))
    lines.append(f"rewrite with the same record -> {result['rewrites_accepted']} accepted (of 2 rewritten slots)")
    lines.append(f"planted key length and mask cell -> {len(result['attention_found'])} row(s): "
                 + ", ".join(f"request {a['request']} reason {a['reason']}" for a in result["attention_found"]))
    for backend, why in result["skipped"].items():
        lines.append(f"skipped {backend}: {why}")
    lines.append("self-check " + ("passed" if result["ok"] else "FAILED"))
    return "\n".join(lines)
