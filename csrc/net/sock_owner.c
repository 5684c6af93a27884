/* The process at the other end of a TCP connection (sock_owner.h). */
#define _GNU_SOURCE
#include "net/sock_owner.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/status.h"

/* The inode of the socket whose local address is `src` and peer `dst`
 * (the other end of ours), or 0 where the kernel knows none here. */
static int peer_inode(const struct sockaddr_in *src, const struct sockaddr_in *dst,
                      uint32_t *ino_p)
{
    struct {
        struct nlmsghdr nlh;
        struct inet_diag_req_v2 r;
    } req;
    memset(&req, 0, sizeof(req));
    req.nlh.nlmsg_len = sizeof(req);
    req.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
    req.nlh.nlmsg_flags = NLM_F_REQUEST; /* no NLM_F_DUMP: one exact lookup */
    req.nlh.nlmsg_seq = 1;
    req.r.sdiag_family = AF_INET;
    req.r.sdiag_protocol = IPPROTO_TCP;
    req.r.idiag_states = ~0u;
    req.r.id.idiag_sport = src->sin_port;
    req.r.id.idiag_dport = dst->sin_port;
    memcpy(req.r.id.idiag_src, &src->sin_addr, 4);
    memcpy(req.r.id.idiag_dst, &dst->sin_addr, 4);
    req.r.id.idiag_cookie[0] = req.r.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
    *ino_p = 0;
    int nl = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
    if (nl < 0)
        return uccl__err(UCCL_ERR_UNAVAIL, "sock_diag socket: %s", strerror(errno));
    int rc = UCCL_OK;
    struct sockaddr_nl kernel = {.nl_family = AF_NETLINK};
    if (sendto(nl, &req, sizeof(req), 0, (struct sockaddr *)&kernel, sizeof(kernel)) < 0) {
        rc = uccl__err(UCCL_ERR_UNAVAIL, "sock_diag query: %s", strerror(errno));
        goto out;
    }
    struct pollfd p = {.fd = nl, .events = POLLIN};
    if (poll(&p, 1, 1000) != 1) { /* the kernel answers at once; never hang the listener */
        rc = uccl__err(UCCL_ERR_UNAVAIL, "sock_diag: no answer");
        goto out;
    }
    union {
        struct nlmsghdr h;
        char b[1024];
    } ans;
    ssize_t n = recv(nl, &ans, sizeof(ans), 0);
    if (n < (ssize_t)sizeof(struct nlmsghdr) || ans.h.nlmsg_len > (size_t)n) {
        rc = uccl__err(UCCL_ERR_UNAVAIL, "sock_diag: short answer");
        goto out;
    }
    if (ans.h.nlmsg_type == NLMSG_ERROR) { /* ENOENT: no such connection here */
        rc = uccl__err(UCCL_ERR_UNAVAIL, "the peer's socket is not in this network namespace");
        goto out;
    }
    if (ans.h.nlmsg_type != SOCK_DIAG_BY_FAMILY ||
        ans.h.nlmsg_len < NLMSG_LENGTH(sizeof(struct inet_diag_msg))) {
        rc = uccl__err(UCCL_ERR_UNAVAIL, "sock_diag: unexpected answer type %u",
                       ans.h.nlmsg_type);
        goto out;
    }
    const struct inet_diag_msg *m = NLMSG_DATA(&ans.h);
    *ino_p = m->idiag_inode;
out:
    close(nl);
    return rc;
}

/* 1 if /proc/<pid>/fd holds socket inode ino. */
static int holds(uint32_t pid, uint32_t ino)
{
    char path[64], want[48], link[64];
    snprintf(path, sizeof(path), "/proc/%u/fd", pid);
    int want_len = snprintf(want, sizeof(want), "socket:[%u]", ino);
    DIR *d = opendir(path);
    if (!d)
        return 0;
    int found = 0;
    for (struct dirent *e; !found && (e = readdir(d));) {
        if (e->d_name[0] == '.')
            continue;
        ssize_t n = readlinkat(dirfd(d), e->d_name, link, sizeof(link));
        found = n == want_len && memcmp(link, want, (size_t)n) == 0;
    }
    closedir(d);
    return found;
}

int uccl__sock_peer_held_by(int fd, uint32_t pid, int *held_p)
{
    struct sockaddr_in me, peer;
    socklen_t ml = sizeof(me), pl = sizeof(peer);
    *held_p = 0;
    if (getsockname(fd, (struct sockaddr *)&me, &ml) < 0 ||
        getpeername(fd, (struct sockaddr *)&peer, &pl) < 0)
        return uccl__err(UCCL_ERR_IO, "socket %d: %s", fd, strerror(errno));
    if (me.sin_family != AF_INET || peer.sin_family != AF_INET || pid == 0) {
        uccl__err(UCCL_ERR_UNAVAIL, "not an IPv4 connection, or no pid");
        return UCCL_OK;
    }
    uint32_t ino = 0;
    if (peer_inode(&peer, &me, &ino) != UCCL_OK || ino == 0)
        return UCCL_OK; /* the reason is recorded */
    *held_p = holds(pid, ino);
    if (!*held_p)
        uccl__err(UCCL_ERR_UNAVAIL, "process %u does not hold the other end of the connection",
                  pid);
    return UCCL_OK;
}
