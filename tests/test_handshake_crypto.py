"""The engine's SHA-256 and HMAC-SHA256 (csrc/base/sha256.c), the handshake's
only primitives, against published known answers: FIPS 180-4's examples (NIST
"Example Algorithms": one block, two blocks, the 896-bit message, a million
'a'; and the empty message) and the seven HMAC-SHA256 cases of RFC 4231
(case 5 truncated to 128 bits, as the RFC gives it).  Then every length from
0 to 300 bytes (every padding case) and keys of 0, 1, 63, 64, 65 and 131
bytes against Python's hashlib/hmac, and the incremental form (the
handshake's proofs) through tests/_wire.py's records."""
from __future__ import annotations

import hashlib
import hmac

import pytest

from uccl_collective import _engine

FIPS = [
    (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
    (b"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
    (b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
     "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"),
    (b"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklm"
     b"nopqrlmnopqrsmnopqrstnopqrstu",
     "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"),
    (b"a" * 1000000, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"),
]

RFC4231 = [
    (b"\x0b" * 20, b"Hi There",
     "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"),
    (b"Jefe", b"what do ya want for nothing?",
     "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"),
    (b"\xaa" * 20, b"\xdd" * 50,
     "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"),
    (bytes(range(1, 26)), b"\xcd" * 50,
     "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"),
    (b"\x0c" * 20, b"Test With Truncation", "a3b6167473100ee06e0c796c2955552b"),
    (b"\xaa" * 131, b"Test Using Larger Than Block-Size Key - Hash Key First",
     "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"),
    (b"\xaa" * 131, b"This is a test using a larger than block-size key and a larger than "
     b"block-size data. The key needs to be hashed before being used by the HMAC algorithm.",
     "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"),
]


@pytest.mark.parametrize("msg,digest", FIPS, ids=["abc", "empty", "448-bit", "896-bit",
                                                   "million-a"])
def test_sha256_fips_180_4(msg, digest):
    assert _engine._sha256(msg).hex() == digest


@pytest.mark.parametrize("key,msg,mac", RFC4231, ids=[f"case{i}" for i in range(1, 8)])
def test_hmac_sha256_rfc_4231(key, msg, mac):
    assert _engine._hmac_sha256(key, msg).hex()[:len(mac)] == mac


def test_every_padding_case_and_key_length():
    data = bytes(range(256)) * 2
    for n in range(0, 301):
        assert _engine._sha256(data[:n]) == hashlib.sha256(data[:n]).digest(), n
        for kl in (0, 1, 63, 64, 65, 131):
            key = bytes((i * 7 + kl) & 0xFF for i in range(kl))
            assert _engine._hmac_sha256(key, data[:n]) == \
                hmac.new(key, data[:n], hashlib.sha256).digest(), (n, kl)
