"""Upstream's group rendezvous: join_group(), create_and_join() and
conn_id_of_rank().

Each rank publishes where it listens under "<group>:<rank>" in a key-value
store named by a discovery URI, waits for all world_size entries, then the
lower rank of every pair connects to the higher, which accepts: one
connection per pair, as upstream (connections are one-way: the lower rank
sends, reads and writes on it).  Upstream supports redis:// only; here:

- ``tcp://host:port``: torch.distributed's TCPStore, served by rank 0;
- ``file:///path``: torch.distributed's FileStore (a shared file system);
- ``redis://host:port[/db]``: a Redis server, through the `redis` package
  when it is installed (pip install redis).

Accepted connections are told apart by a first message from the connector
(its rank, the world size and a digest of the group name), so ranks that
share a host and a GPU index are never confused, and a peer of another
group or size is refused loudly.
"""
from __future__ import annotations

import hashlib
import struct
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import numpy as np

NO_CONN = 2**64 - 1  # upstream's UINT64_MAX: no connection for that rank
_HELLO = struct.Struct("<qq16s")  # rank, world size, group digest


class _RedisStore:
    """The two calls of torch's Store used here, over a Redis server."""

    def __init__(self, uri: str, timeout_s: float):
        try:
            import redis
        except ImportError:
            raise RuntimeError(f"join_group: {uri!r} needs the redis package (pip install "
                               "redis), or use tcp://host:port or file:///path") from None
        self._r = redis.Redis.from_url(uri, socket_timeout=timeout_s)
        self._timeout = timeout_s

    def set(self, key: str, value: str) -> None:
        self._r.set(key, value)

    def get_all(self, keys: list[str]) -> list[bytes]:
        deadline = time.monotonic() + self._timeout
        out = []
        for k in keys:
            while (v := self._r.get(k)) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"join_group: no entry {k!r} in Redis after "
                                       f"{self._timeout} s")
                time.sleep(0.05)
            out.append(v)
        return out


class _TorchStore:
    def __init__(self, store: Any, timeout_s: float):
        self._s, self._timeout = store, timedelta(seconds=timeout_s)

    def set(self, key: str, value: str) -> None:
        self._s.set(key, value)

    def get_all(self, keys: list[str]) -> list[bytes]:
        self._s.wait(keys, self._timeout)
        return [self._s.get(k) for k in keys]


def _store(uri: str, world_size: int, my_rank: int, timeout_s: float):
    u = urlparse(uri)
    if u.scheme == "redis":
        return _RedisStore(uri, timeout_s)
    import torch.distributed as dist
    if u.scheme == "tcp":
        if not u.hostname or not u.port:
            raise ValueError(f"join_group: {uri!r} needs a host and a port (tcp://host:port)")
        return _TorchStore(dist.TCPStore(u.hostname, u.port, world_size, my_rank == 0,
                                         timedelta(seconds=timeout_s)), timeout_s)
    if u.scheme == "file":
        if not u.path:
            raise ValueError(f"join_group: {uri!r} names no file (file:///path)")
        return _TorchStore(dist.FileStore(u.path, world_size), timeout_s)
    raise ValueError(f"join_group: discovery URI {uri!r}: the scheme must be tcp://, file:// "
                     "or redis://")


class GroupAPI:
    """Mixed into p2p.Endpoint."""

    def conn_id_of_rank(self, rank: int) -> int:
        """The connection to (lower rank) or from (higher rank) that rank of
        the group joined, or 2**64-1 (upstream's UINT64_MAX) for none."""
        return getattr(self, "_rank2conn", {}).get(int(rank), NO_CONN)

    def join_group(self, discovery_uri: str, group_name: str, world_size: int, my_rank: int,
                   remote_gpu_idx: int = 0) -> bool:
        """Publish this endpoint, wait for world_size peers, connect to every
        higher rank and accept every lower one.  True, or raises (nothing
        joined).  remote_gpu_idx is upstream's argument, unused here: each
        peer publishes its own GPU and port."""
        del remote_gpu_idx
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"join_group: world_size must be an int >= 1, got {world_size!r}")
        if isinstance(my_rank, bool) or not isinstance(my_rank, int) or \
                not 0 <= my_rank < world_size:
            raise ValueError(f"join_group: my_rank {my_rank!r} is not in 0..{world_size - 1}")
        if not group_name or ":" in group_name:
            raise ValueError(f"join_group: group_name {group_name!r} must be non-empty, "
                             "without ':'")
        store = _store(discovery_uri, world_size, my_rank, self.timeout_s)
        ip, port = self.address()
        gpu = -1 if self._local_gpu is None else int(self._local_gpu)
        store.set(f"{group_name}:{my_rank}", f"{ip},{gpu},{port}")
        peers = store.get_all([f"{group_name}:{r}" for r in range(world_size)])
        digest = hashlib.blake2b(group_name.encode(), digest_size=16).digest()
        hello = np.frombuffer(bytearray(_HELLO.pack(my_rank, world_size, digest)), np.uint8)
        got = np.zeros(_HELLO.size * max(my_rank, 1), np.uint8)
        ranks: dict[int, int] = {}
        _, hmr = self.reg(hello.ctypes.data, hello.nbytes)
        _, gmr = self.reg(got.ctypes.data, got.nbytes)
        sends = []
        try:
            for r in range(my_rank + 1, world_size):
                pip, pgpu, pport = peers[r].decode().split(",")
                _, cid = self.connect(pip, max(int(pgpu), 0), int(pport))
                ranks[r] = cid
                sends.append(self.send_async(cid, hmr, hello.ctypes.data, hello.nbytes)[1])
            for i in range(my_rank):
                _, _, _, cid = self.accept()
                at = got.ctypes.data + i * _HELLO.size
                self.recv(cid, gmr, at, _HELLO.size)
                rank, size, their = _HELLO.unpack_from(got, i * _HELLO.size)
                if size != world_size or their != digest or not 0 <= rank < my_rank \
                        or rank in ranks:
                    raise ValueError(
                        f"join_group: rank {my_rank} of {world_size} in group {group_name!r} "
                        f"was reached by a peer saying rank {rank} of {size}"
                        f"{'' if their == digest else ' in another group'}"
                        f"{' (a rank already joined)' if rank in ranks else ''}")
                ranks[rank] = cid
            for t in sends:
                self.wait(t)
        except BaseException:
            for cid in ranks.values():  # nothing half-joined stays
                self.remove_remote_endpoint(cid)
            raise
        finally:
            self.dereg(hmr)
            self.dereg(gmr)
        self._rank2conn = ranks
        return True

    @classmethod
    def create_and_join(cls, discovery_uri: str, group_name: str, world_size: int,
                        my_rank: int, local_gpu_idx: int | None = None, num_cpus: int = 4,
                        remote_gpu_idx: int = 0):
        """An Endpoint that has joined the group (upstream's CreateAndJoin)."""
        ep = cls(local_gpu_idx, num_cpus)
        try:
            ep.join_group(discovery_uri, group_name, world_size, my_rank, remote_gpu_idx)
        except BaseException:
            ep.close()
            raise
        return ep
