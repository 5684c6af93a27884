/* The verbs emulator's socket I/O: whole packets over a QP's socket (never
 * SIGPIPE: a dead peer is an error return), and the sockets themselves:
 * by default abstract Unix sockets named after the QP number (one host,
 * one network namespace); with UCCL_IBV_EMU_IPV4, TCP on that address, so
 * that QPs in different network namespaces (or hosts) can be joined. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include "ibv_emu.h"

int emu_send_full(int fd, struct iovec *iov, int n)
{
    while (n > 0) {
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t w = sendmsg(fd, &mh, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        while (n > 0 && (size_t)w >= iov->iov_len) {
            w -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + w;
            iov->iov_len -= (size_t)w;
        }
    }
    return 0;
}

int emu_recv_full(int fd, void *buf, size_t len)
{
    char *p = buf;
    while (len > 0) {
        ssize_t r = recv(fd, p, len, MSG_WAITALL);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        p += r;
        len -= (size_t)r;
    }
    return 0;
}

int emu_drain(int fd, size_t len)
{
    char sink[4096];
    while (len > 0) {
        size_t n = len < sizeof(sink) ? len : sizeof(sink);
        if (emu_recv_full(fd, sink, n))
            return -1;
        len -= n;
    }
    return 0;
}

/* UCCL_IBV_EMU_IPV4=<a.b.c.d>: the port's address (GID 1 is its RoCE v2
 * GID) and QPs joined over TCP on it; 0 (unset): Unix sockets.  Network
 * order. */
uint32_t emu_ipv4(void)
{
    const char *v = getenv("UCCL_IBV_EMU_IPV4");
    struct in_addr a;
    return v && *v && inet_pton(AF_INET, v, &a) == 1 ? a.s_addr : 0;
}

/* The abstract Unix name a QP listens on: its number makes it unique in the
 * network namespace (abstract names are per namespace). */
static void abstract_name(uint32_t qpn, struct sockaddr_un *a, socklen_t *len)
{
    memset(a, 0, sizeof(*a));
    a->sun_family = AF_UNIX;
    int n = snprintf(a->sun_path + 1, sizeof(a->sun_path) - 1, "uccl-ibv-emu-%06x", qpn);
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

int emu_listen(uint32_t *qpn_p)
{
    uint32_t ip = emu_ipv4();
    int fd = socket(ip ? AF_INET : AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (ip) { /* the OS picks the port; the QP number carries it: port << 8 | 1..255 */
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = ip};
        socklen_t sl = sizeof(sa);
        if (bind(fd, (struct sockaddr *)&sa, sl) == 0 && listen(fd, 4) == 0 &&
            getsockname(fd, (struct sockaddr *)&sa, &sl) == 0) {
            *qpn_p = (uint32_t)ntohs(sa.sin_port) << 8 | (emu_random_key() % 255 + 1);
            return fd;
        }
    } else { /* a random number; bind() is the uniqueness check */
        for (int i = 0; i < 1000; i++) {
            uint32_t qpn = emu_random_key() & 0xffffff;
            struct sockaddr_un sa;
            socklen_t sl;
            abstract_name(qpn, &sa, &sl);
            if (qpn > 1 && bind(fd, (struct sockaddr *)&sa, sl) == 0 && listen(fd, 4) == 0) {
                *qpn_p = qpn;
                return fd;
            }
        }
    }
    close(fd);
    errno = ENOMEM;
    return -1;
}

/* The peer's IPv4 address from its RoCE v2 GID (::ffff:a.b.c.d), network
 * order; 0 if the GID is not one. */
static uint32_t gid_ipv4(const union ibv_gid_u *g)
{
    static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    uint32_t ip = 0;
    if (memcmp(g->raw, prefix, sizeof(prefix)) == 0)
        memcpy(&ip, g->raw + 12, sizeof(ip));
    return ip;
}

int emu_dials(uint32_t qpn, uint32_t dest_qpn, const union ibv_gid_u *dgid)
{
    uint32_t ip = emu_ipv4();
    if (!ip)
        return qpn < dest_qpn;
    uint64_t mine = (uint64_t)qpn << 32 | ntohl(ip), theirs = (uint64_t)dest_qpn << 32 |
                                                              ntohl(gid_ipv4(dgid));
    return mine < theirs;
}

int emu_same_qp(uint32_t qpn, uint32_t dest_qpn, const union ibv_gid_u *dgid)
{
    uint32_t ip = emu_ipv4();
    return qpn == dest_qpn && (!ip || gid_ipv4(dgid) == ip);
}

int emu_dial(uint32_t dest_qpn, const union ibv_gid_u *dgid)
{
    uint32_t ip = emu_ipv4();
    int fd = socket(ip ? AF_INET : AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    int rc;
    if (ip) {
        struct sockaddr_in sa = {.sin_family = AF_INET,
                                 .sin_port = htons((uint16_t)(dest_qpn >> 8)),
                                 .sin_addr.s_addr = gid_ipv4(dgid)};
        /* bounded: an unreachable peer fails the QP, it does not hang modify_qp */
        struct timeval tv = {5, 0}, none = {0, 0};
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        rc = sa.sin_addr.s_addr ? connect(fd, (struct sockaddr *)&sa, sizeof(sa)) : -1;
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &none, sizeof(none));
    } else {
        struct sockaddr_un sa;
        socklen_t sl;
        abstract_name(dest_qpn, &sa, &sl);
        rc = connect(fd, (struct sockaddr *)&sa, sl);
    }
    if (rc) {
        close(fd);
        return -1;
    }
    return fd;
}
