/* Does a process hold the other end of one of our TCP sockets?
 *
 * A peer on this host says its process id in the handshake; the same-host
 * transport then reads and writes that process's memory (CMA), and the
 * connector lets that process ptrace it (base/ptracer.h).  A peer must not
 * be able to name another process (a third one, or ours): the pid is taken
 * only if that process's descriptor table holds the socket at the other end
 * of the connection.  The kernel names that socket: a sock_diag query
 * (NETLINK_SOCK_DIAG, an exact lookup of the connection's four-tuple) gives
 * its inode, and /proc/<pid>/fd lists the sockets the process holds. */
#ifndef UCCL_SOCK_OWNER_H
#define UCCL_SOCK_OWNER_H

#include <stdint.h>

/* *held_p = 1 if process pid holds the peer's end of connected TCP socket
 * fd (both ends in this network namespace), else 0 (the reason is recorded,
 * for the log).  Fails only on a bad fd. */
int uccl__sock_peer_held_by(int fd, uint32_t pid, int *held_p);

#endif
