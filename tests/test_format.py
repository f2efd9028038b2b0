"""SPEC 3 test vectors and the Python-int hash helpers."""

import pytest
import torch

from kvcanary import format as f
from kvcanary.ops import RealKvSource, fingerprint


@pytest.mark.parametrize(
    "x, expected",
    [
        (1, 0x5692161D100B05E5),
        (0xDEADBEEFCAFEBABE, 0x7AD6664F09FFE52C),
        (2**64 - 1, 0xB4D055FCF2CBBD7B),
        (2**63, 0x25C26EA579CEA98A),
    ],
    ids=["one", "deadbeef", "all-ones", "top-bit"],
)
def test_splitmix64_vectors(x, expected):
    assert f.splitmix64(x) == expected


def test_chain_head_is_splitmix_of_anchor():
    assert f.splitmix64(f.CHAIN_ANCHOR) == f.CHAIN_HEAD == 0xDE7FAE23A9A1B716


def test_chain_vector():
    assert f.chain_hashes([11, 22, 33]) == [0xDE7FAE23A9A1B716, 0x89CD2ABFBEBC0649, 0x5782FFC5B5D6409B]


def test_mix3_is_three_rounds():
    a, b, c = 3, 5, 7
    assert f.mix3(a, b, c) == f.splitmix64(f.splitmix64(f.splitmix64(a) ^ b) ^ c)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_real_kv_vector(backend):
    # One source whose 16 bytes are 0x00..0x0F.
    t = torch.arange(16, dtype=torch.uint8).reshape(1, 16)
    src = RealKvSource(t, page_size=1, num_bytes_per_token=16, read_bytes=16)
    w0 = int.from_bytes(bytes(range(8)), "little")
    w1 = int.from_bytes(bytes(range(8, 16)), "little")
    source_hash = f.splitmix64(f.splitmix64(w0) ^ w1)
    assert source_hash == 0x447F1B95028CE131
    assert f.splitmix64(source_hash) == 0xD6D75024DFD6C30C
    got = fingerprint(torch.tensor([0]), [src], f.RealKvMode.ALL, backend=backend)
    assert f.to_unsigned(int(got[0])) == 0xD6D75024DFD6C30C


def test_signed_roundtrip():
    for x in (0, 1, 2**63 - 1, 2**63, 2**64 - 1):
        assert f.to_unsigned(f.to_signed(x)) == x


def test_reason_labels():
    assert f.reason_label(1) == "verify_chain_hash"
    assert f.reason_label(1 | 2 | 32) == "verify_chain_hash+verify_position+verify_token"
    assert f.reason_label(8 | 16) == "write_token+write_position"


def test_launch_tags():
    assert f.launch_tag("tail", "k", "full") == f.LaunchTag.TAIL_K_FULL == 2
    assert f.launch_tag("sweep", "v", "swa") == f.LaunchTag.SWEEP_V_SWA == 11


def test_oracle_token_in_vocab():
    toks = [f.oracle_token(7, p, 100) for p in range(50)]
    assert all(0 <= t < 100 for t in toks) and len(set(toks)) > 10
