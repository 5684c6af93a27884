/* Socket helpers.  Every socket is CLOEXEC and (for TCP) NODELAY.  Sockets
 * used with deadlines are non-blocking and waited on with poll(); the data
 * streams of tp_tcp.c are blocking and are unblocked by shutdown(). */
#ifndef UCCL_SOCK_H
#define UCCL_SOCK_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h" /* uccl__now_ns */

/* Listen on bind_ip (NULL: all IPv4 addresses) and port (0: ephemeral). */
int uccl__sock_listen(const char *bind_ip, int port, int *fd_p, int *port_p);

/* Connect with a deadline (absolute, uccl__now_ns()).  Returns a blocking fd. */
int uccl__sock_connect(const char *ip, int port, uint64_t deadline_ns, int *fd_p);

/* Send/receive exactly len bytes before the deadline (0: no deadline).
 * Handle EINTR/EAGAIN; a closed peer is UCCL_ERR_IO.  recv_all's blocking:
 * as uccl__sock_sendv's (one MSG_WAITALL call for the whole buffer). */
int uccl__sock_send_all(int fd, const void *buf, size_t len, uint64_t deadline_ns);
int uccl__sock_recv_all(int fd, void *buf, size_t len, uint64_t deadline_ns, int blocking);
/* Send every byte of iov[0..n) (which it modifies as it goes).  blocking:
 * fd is a blocking socket (tp_tcp.c's data streams, unblocked by
 * shutdown()), whose calls wait in the kernel; else EAGAIN waits in poll()
 * until the deadline (0: none). */
struct iovec;
int uccl__sock_sendv(int fd, struct iovec *iov, int n, uint64_t deadline_ns, int blocking);
/* Send a then b as one stream of bytes (one system call when they fit). */
int uccl__sock_send2(int fd, const void *a, size_t alen, const void *b, size_t blen,
                     uint64_t deadline_ns);

int uccl__sock_set_nonblock(int fd, int on);
void uccl__sock_tune(int fd);

/* The IPv4 address to advertise: UCCL_SOCKET_IFNAME's address if set, else
 * the first non-loopback interface that is up, else 127.0.0.1. */
int uccl__sock_local_ip(char *buf, size_t len);

/* "ip:port" of the peer of fd, for log messages. */
void uccl__sock_peer_name(int fd, char *buf, size_t len);

#endif
