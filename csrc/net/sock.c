#define _GNU_SOURCE
#include "net/sock.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "base/config.h"
#include "base/status.h"

static int remaining_ms(uint64_t deadline_ns)
{
    if (deadline_ns == 0)
        return 200; /* no deadline: wake up now and then anyway */
    uint64_t now = uccl__now_ns();
    if (now >= deadline_ns)
        return 0;
    uint64_t ms = (deadline_ns - now + 999999) / 1000000;
    return ms > 200 ? 200 : (int)ms;
}

/* Wait until fd is ready for events, or the deadline (0: none) passes. */
static int wait_fd(int fd, short events, uint64_t deadline_ns)
{
    for (;;) {
        struct pollfd p = {.fd = fd, .events = events};
        int n = poll(&p, 1, remaining_ms(deadline_ns));
        if (n > 0)
            return UCCL_OK;
        if (n < 0 && errno != EINTR)
            return uccl__err(UCCL_ERR_IO, "poll(): %s", strerror(errno));
        if (deadline_ns && uccl__now_ns() >= deadline_ns)
            return uccl__err(UCCL_ERR_TIMEOUT, "socket wait timed out");
    }
}

/* After a socket call on fd failed with errno: UCCL_INPROGRESS to try
 * again (interrupted, or a non-blocking fd became ready for `events` before
 * the deadline), else the error, recorded as "<what>: <reason>".  The one
 * place that handles EINTR, EAGAIN and poll() for every loop here. */
static int retry_or_fail(int fd, short events, uint64_t deadline_ns, const char *what)
{
    if (errno == EINTR)
        return UCCL_INPROGRESS;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
        int rc = wait_fd(fd, events, deadline_ns);
        return rc ? rc : UCCL_INPROGRESS;
    }
    return uccl__err(UCCL_ERR_IO, "%s: %s", what, strerror(errno));
}

int uccl__sock_set_nonblock(int fd, int on)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        return uccl__err(UCCL_ERR_IO, "fcntl(F_GETFL): %s", strerror(errno));
    fl = on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK);
    if (fcntl(fd, F_SETFL, fl) < 0)
        return uccl__err(UCCL_ERR_IO, "fcntl(F_SETFL): %s", strerror(errno));
    return UCCL_OK;
}

void uccl__sock_tune(int fd)
{
    int one = 1;
    /* Control messages are small and latency-bound: never wait for Nagle. */
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

int uccl__sock_listen(const char *bind_ip, int port, int *fd_p, int *port_p)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (bind_ip && *bind_ip) {
        if (inet_pton(AF_INET, bind_ip, &sa.sin_addr) != 1)
            return uccl__err(UCCL_ERR_INVALID, "bad IPv4 address to listen on: '%s'", bind_ip);
    } else {
        sa.sin_addr.s_addr = htonl(INADDR_ANY);
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return uccl__err(UCCL_ERR_IO, "socket(): %s", strerror(errno));
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        int e = errno;
        close(fd);
        return uccl__err(e == EADDRINUSE ? UCCL_ERR_UNAVAIL : UCCL_ERR_IO,
                         "bind(port %d): %s", port, strerror(e));
    }
    if (listen(fd, 256) < 0) {
        /* EADDRINUSE here: another socket bound the same port (SO_REUSEADDR
         * lets both bind while neither listens) and listened first. */
        int e = errno;
        close(fd);
        return uccl__err(e == EADDRINUSE ? UCCL_ERR_UNAVAIL : UCCL_ERR_IO,
                         "listen(port %d): %s", port, strerror(e));
    }
    socklen_t sl = sizeof(sa);
    getsockname(fd, (struct sockaddr *)&sa, &sl);
    *fd_p = fd;
    *port_p = ntohs(sa.sin_port);
    return UCCL_OK;
}

int uccl__sock_connect(const char *ip, int port, uint64_t deadline_ns, int *fd_p)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (port <= 0 || port > 65535)
        return uccl__err(UCCL_ERR_INVALID, "bad port %d (must be 1..65535)", port);
    if (inet_pton(AF_INET, ip, &sa.sin_addr) != 1)
        return uccl__err(UCCL_ERR_INVALID, "bad IPv4 address '%s'", ip);
    /* A listener that is not up yet refuses: retry until the deadline, as
     * NCCL's bootstrap does, so ranks may start in any order. */
    for (;;) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0)
            return uccl__err(UCCL_ERR_IO, "socket(): %s", strerror(errno));
        int rc = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
        int err = rc == 0 ? 0 : errno;
        if (err == EINPROGRESS) {
            int wrc = wait_fd(fd, POLLOUT, deadline_ns);
            if (wrc) {
                close(fd);
                return wrc == UCCL_ERR_TIMEOUT
                           ? uccl__err(wrc, "connect to %s:%d timed out", ip, port) : wrc;
            }
            socklen_t sl = sizeof(err);
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &sl);
        }
        if (err == 0) {
            uccl__sock_set_nonblock(fd, 0);
            uccl__sock_tune(fd);
            *fd_p = fd;
            return UCCL_OK;
        }
        close(fd);
        if ((err != ECONNREFUSED && err != ETIMEDOUT && err != EHOSTUNREACH) ||
            (deadline_ns && uccl__now_ns() + 20000000ull >= deadline_ns))
            return uccl__err(err == ECONNREFUSED ? UCCL_ERR_IO : UCCL_ERR_IO,
                             "connect to %s:%d failed: %s", ip, port, strerror(err));
        struct timespec ts = {0, 20000000}; /* 20 ms between tries */
        nanosleep(&ts, NULL);
    }
}

int uccl__sock_sendv(int fd, struct iovec *iov, int n, uint64_t deadline_ns, int blocking)
{
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n};
    while (mh.msg_iovlen > 0 && mh.msg_iov[0].iov_len == 0) { /* nothing to send there */
        mh.msg_iov++;
        mh.msg_iovlen--;
    }
    while (mh.msg_iovlen > 0) {
        ssize_t sent = sendmsg(fd, &mh, MSG_NOSIGNAL | (blocking ? 0 : MSG_DONTWAIT));
        if (sent < 0) {
            int rc = retry_or_fail(fd, POLLOUT, deadline_ns, "send()");
            if (rc != UCCL_INPROGRESS)
                return rc;
            continue;
        }
        size_t k = (size_t)sent;
        while (mh.msg_iovlen > 0 && k >= mh.msg_iov[0].iov_len) {
            k -= mh.msg_iov[0].iov_len;
            mh.msg_iov++;
            mh.msg_iovlen--;
        }
        if (mh.msg_iovlen > 0) {
            mh.msg_iov[0].iov_base = (char *)mh.msg_iov[0].iov_base + k;
            mh.msg_iov[0].iov_len -= k;
        }
    }
    return UCCL_OK;
}

int uccl__sock_send2(int fd, const void *a, size_t alen, const void *b, size_t blen,
                     uint64_t deadline_ns)
{
    struct iovec iov[2] = {{(void *)a, alen}, {(void *)b, blen}};
    return uccl__sock_sendv(fd, iov, 2, deadline_ns, 0);
}

int uccl__sock_send_all(int fd, const void *buf, size_t len, uint64_t deadline_ns)
{
    return uccl__sock_send2(fd, buf, len, NULL, 0, deadline_ns);
}

int uccl__sock_recv_all(int fd, void *buf, size_t len, uint64_t deadline_ns, int blocking)
{
    char *p = buf;
    while (len > 0) {
        ssize_t n = recv(fd, p, len, blocking ? MSG_WAITALL : MSG_DONTWAIT);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
            continue;
        }
        if (n == 0)
            return uccl__err(UCCL_ERR_IO, "peer closed the connection");
        int rc = retry_or_fail(fd, POLLIN, deadline_ns, "recv()");
        if (rc != UCCL_INPROGRESS)
            return rc;
    }
    return UCCL_OK;
}

int uccl__sock_local_ip(char *buf, size_t len)
{
    const char *want = NULL;
    uccl__cfg_str(UCCL_CFG_SOCKET_IFNAME, &want);
    struct ifaddrs *ifa = NULL;
    snprintf(buf, len, "127.0.0.1");
    if (getifaddrs(&ifa) < 0)
        return UCCL_OK;
    int found = 0;
    for (struct ifaddrs *i = ifa; i && !found; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP))
            continue;
        if (want && *want ? strcmp(i->ifa_name, want) != 0 : (i->ifa_flags & IFF_LOOPBACK) != 0)
            continue;
        inet_ntop(AF_INET, &((struct sockaddr_in *)i->ifa_addr)->sin_addr, buf, (socklen_t)len);
        found = 1;
    }
    freeifaddrs(ifa);
    if (want && *want && !found)
        return uccl__err(UCCL_ERR_INVALID, "UCCL_SOCKET_IFNAME=%s: no such interface with an "
                         "IPv4 address that is up", want);
    return UCCL_OK;
}

void uccl__sock_peer_name(int fd, char *buf, size_t len)
{
    struct sockaddr_in sa;
    socklen_t sl = sizeof(sa);
    char ip[INET_ADDRSTRLEN] = "?";
    if (getpeername(fd, (struct sockaddr *)&sa, &sl) == 0 && sa.sin_family == AF_INET) {
        inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof(ip));
        snprintf(buf, len, "%s:%d", ip, ntohs(sa.sin_port));
    } else {
        snprintf(buf, len, "?");
    }
}
