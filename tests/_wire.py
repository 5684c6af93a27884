"""The handshake (csrc/net/wire.h, csrc/tp/handshake.h) written by hand in
Python, for tests whose peer speaks the wire format itself (hostile peers,
hand-made records, the attacks of tests/test_handshake_security.py).

Records are 256 bytes: magic, version 2, type; the connector's nonce or the
acceptor's; the fields at the offsets of net/wire.c; the proof (HMAC-SHA256)
in the last 32 bytes.  The functions here compute what the engine computes
(proofs, the seal, the connection key, the probe values) with Python's own
hmac module, so they also check the engine's C SHA-256 from outside."""
from __future__ import annotations

import hashlib
import hmac
import os
import struct

MAGIC = 0x4C434355
VERSION = 2
CONN, STREAM, CHALLENGE, HELLO, ACK, REFUSE = 1, 2, 3, 4, 5, 6
REFUSE_BUSY = -100
ERR_AUTH, ERR_PROTO, ERR_UNAVAIL = -9, -8, -10
TP_AUTO, TP_TCP, TP_SHM = 0, 1, 2
SEAL_OFF, SEAL_END, MAC_OFF = 40, 224, 224
_FIELDS = "<QiIiiIIIIIIQQ"   # token .. probe_addr, from offset 40
_F_OFF = 40


def record(typ, nonce=bytes(32), token=0, status=0, pid=0, gpu=-1, rank=-1, transport=0,
           shm_mode=0, nstreams=1, sidx=0, lport=0, caps=0, chunk=1 << 20, probe=0, host=b"",
           shm_name=b"", mac=bytes(32), version=VERSION):
    """One 256-byte handshake record (proof field as given: sign() fills it)."""
    b = bytearray(256)
    struct.pack_into("<IHH", b, 0, MAGIC, version, typ)
    b[8:40] = nonce
    struct.pack_into(_FIELDS, b, _F_OFF, token, status, pid, gpu, rank, transport, shm_mode,
                     nstreams, sidx, lport, caps, chunk, probe)
    b[104:104 + len(host)] = host
    b[168:168 + len(shm_name)] = shm_name
    b[MAC_OFF:] = mac
    return bytes(b)


def parse(b):
    """The fields of a record, as a dict."""
    magic, version, typ = struct.unpack_from("<IHH", b, 0)
    (token, status, pid, gpu, rank, transport, shm_mode, nstreams, sidx, lport, caps, chunk,
     probe) = struct.unpack_from(_FIELDS, b, _F_OFF)
    return dict(magic=magic, version=version, type=typ, nonce=bytes(b[8:40]), token=token,
                status=status, pid=pid, gpu=gpu, rank=rank, transport=transport,
                shm_mode=shm_mode, nstreams=nstreams, sidx=sidx, lport=lport, caps=caps,
                chunk=chunk, probe=probe, host=bytes(b[104:168]).split(b"\0")[0],
                shm_name=bytes(b[168:212]).split(b"\0")[0], mac=bytes(b[MAC_OFF:]))


def proof(key, label, recs):
    """HMAC(key, label | recs), the last record's proof field as zeros."""
    m = hmac.new(key, label.encode(), hashlib.sha256)
    for r in recs[:-1]:
        m.update(r)
    m.update(recs[-1][:MAC_OFF] + bytes(32))
    return m.digest()


def sign(key, label, recs):
    """The last of recs with its proof filled in."""
    return recs[-1][:MAC_OFF] + proof(key, label, recs)


def seal(chal, key, init):
    """XOR of the CHALLENGE's identity bytes (sealing and unsealing)."""
    out = bytearray(chal)
    off, i = SEAL_OFF, 0
    while off < SEAL_END:
        ks = hmac.new(key, b"uccl-v2 seal" + init[8:40] + chal[8:40] + bytes([i]),
                      hashlib.sha256).digest()
        for j in range(32):
            if off >= SEAL_END:
                break
            out[off] ^= ks[j]
            off += 1
        i += 1
    return bytes(out)


def conn_key(secret, init, chal):
    return hmac.new(secret, b"uccl-v2 conn key" + init + chal, hashlib.sha256).digest()


def probe_value(ckey, connector):
    label = b"uccl-v2 probe c" if connector else b"uccl-v2 probe a"
    return int.from_bytes(hmac.new(ckey, label, hashlib.sha256).digest()[:8], "little")


def recvn(s, n):
    out = b""
    while len(out) < n:
        d = s.recv(n - len(out))
        if not d:
            raise EOFError("closed after %d bytes" % len(out))
        out += d
    return out


class Refused(Exception):
    def __init__(self, status):
        super().__init__(f"refused with status {status}")
        self.status = status


def _expect(b, typ):
    f = parse(b)
    if f["type"] == REFUSE:
        raise Refused(f["status"])
    assert f["type"] == typ, f"record type {f['type']}, expected {typ}"
    return f


# ---- connector --------------------------------------------------------------
def connect(sock, secret=b"", *, typ=CONN, token=None, key=None, check_acceptor=True,
            after_challenge=None, **hello):
    """The connector's side on a connected socket.  A new connection (typ=CONN):
    INIT, CHALLENGE, HELLO, ACK; after_challenge(ckey, chal_fields) runs before
    the HELLO is sent (to set a probe word) and may return more HELLO fields.
    An extra socket (typ=STREAM, with the connection's token and key): one
    STREAM record, then the ACK.  hello: fields of the HELLO / STREAM record
    (record()).  Returns dict(ack=fields, key=connection key,
    challenge=unsealed CHALLENGE fields, token)."""
    if token is None:
        token = int.from_bytes(os.urandom(8), "little") | 1
    if typ == STREAM:
        rec = sign(key, "uccl-v2 stream",
                   [record(STREAM, nonce=os.urandom(32), token=token, **hello)])
        sock.sendall(rec)
        ack = recvn(sock, 256)
        af = _expect(ack, ACK)
        if check_acceptor:
            assert hmac.compare_digest(af["mac"], proof(key, "uccl-v2 ack", [rec, ack])), \
                "the acceptor's ACK proof is wrong"
        return dict(ack=af, key=key, challenge=None, token=token)
    init = record(CONN, nonce=os.urandom(32))
    sock.sendall(init)
    chal = recvn(sock, 256)
    cf = _expect(chal, CHALLENGE)
    if check_acceptor:
        assert hmac.compare_digest(cf["mac"], proof(secret, "uccl-v2 challenge", [init, chal])), \
            "the acceptor's proof is wrong"
    opened = parse(seal(chal, secret, init))
    ckey = conn_key(secret, init, chal)
    if after_challenge is not None:
        hello.update(after_challenge(ckey, opened) or {})
    h = record(HELLO, token=token, **hello)
    h = sign(secret, "uccl-v2 hello", [init, chal, h])
    sock.sendall(h)
    ack = recvn(sock, 256)
    af = _expect(ack, ACK)
    if check_acceptor:
        assert hmac.compare_digest(af["mac"], proof(secret, "uccl-v2 ack", [init, chal, h, ack])), \
            "the acceptor's ACK proof is wrong"
    return dict(ack=af, key=ckey, challenge=opened, token=token)


# ---- acceptor -----------------------------------------------------------------
def accept(sock, secret=b"", *, key=None, pid=0, host=b"", before_ack=None, **ack):
    """The acceptor's side on an accepted socket (key: an extra socket's
    connection key, None for a new connection).  before_ack(ckey,
    hello_fields) runs before the ACK is sent and may return more ACK fields.
    Returns dict(hello=fields of the HELLO or STREAM record, key=connection
    key)."""
    first = recvn(sock, 256)
    if key is not None:
        hf = _expect(first, STREAM)
        assert hmac.compare_digest(hf["mac"], proof(key, "uccl-v2 stream", [first])), \
            "the stream's proof is wrong"
        recs, k, ckey = [first], key, key
    else:
        _expect(first, CONN)
        c = record(CHALLENGE, nonce=os.urandom(32), pid=pid, host=host)
        c = sign(secret, "uccl-v2 challenge", [first, seal(c, secret, first)])
        sock.sendall(c)
        h = recvn(sock, 256)
        hf = _expect(h, HELLO)
        assert hmac.compare_digest(hf["mac"], proof(secret, "uccl-v2 hello", [first, c, h])), \
            "the connector's proof is wrong"
        recs, k, ckey = [first, c, h], secret, conn_key(secret, first, c)
    if before_ack is not None:
        ack.update(before_ack(ckey, hf) or {})
    ack.setdefault("nstreams", hf["nstreams"])
    ack.setdefault("chunk", hf["chunk"])
    a = record(ACK, **ack)
    sock.sendall(sign(k, "uccl-v2 ack", recs + [a]))
    return dict(hello=hf, key=ckey)
