/* The verbs emulator's devices (ibv_emu.c says what the library is): the
 * device list, contexts, and the queries rdma-core's own programs make
 * (ibv_devices, ibv_devinfo): device attributes, ports, GIDs and their
 * types, the node GUID, sysfs files.
 *
 * Each device is a RoCE adapter with one Ethernet port.  Its node GUID is
 * the EUI-64 of a locally administered MAC, 02:00:00:00:00:<n+1> for the
 * n-th device of UCCL_IBV_EMU_DEVICES: 0200:00ff:fe00:0001 for the first.
 * The context is a legacy one (not a struct verbs_context: abi_compat is
 * not rdma-core's "extended" marker), so verbs.h's inline extended verbs
 * (ibv_query_device_ex, ibv_create_cq_ex, ibv_create_qp_ex, ...) take
 * their legacy path or fail with EOPNOTSUPP, as with any provider that
 * lacks them. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ibv_emu.h"

#define MAX_DEVS 8

static struct ibv_device_s devs[MAX_DEVS];

EXPORT struct ibv_device_s **ibv_get_device_list(int *num)
{
    const char *env = getenv("UCCL_IBV_EMU_DEVICES");
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", env ? env : "emu0");
    struct ibv_device_s **list = calloc(MAX_DEVS + 1, sizeof(*list));
    if (!list) {
        errno = ENOMEM;
        return NULL;
    }
    int n = 0;
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t && n < MAX_DEVS; t = strtok_r(NULL, ",", &save)) {
        if (!*t)
            continue;
        memset(&devs[n], 0, sizeof(devs[n]));
        devs[n].node_type = 1;      /* IBV_NODE_CA */
        devs[n].transport_type = 0; /* IBV_TRANSPORT_IB (RoCE reports IB transport) */
        snprintf(devs[n].name, sizeof(devs[n].name), "%s", t);
        snprintf(devs[n].dev_name, sizeof(devs[n].dev_name), "uverbs%d", n);
        /* where a real device's sysfs files are; absent here, so optional
         * files (board_id) read as missing */
        snprintf(devs[n].ibdev_path, sizeof(devs[n].ibdev_path), "/sys/class/infiniband/%.64s", t);
        list[n] = &devs[n];
        n++;
    }
    if (num)
        *num = n;
    return list;
}

EXPORT void ibv_free_device_list(struct ibv_device_s **list) { free(list); }
EXPORT const char *ibv_get_device_name(struct ibv_device_s *d) { return d ? d->name : NULL; }

/* Node GUID in network order (verbs.h: __be64). */
static uint64_t guid_of(const struct ibv_device_s *d)
{
    unsigned char b[8] = {0x02, 0, 0, 0xff, 0xfe, 0, 0, (unsigned char)(d - devs + 1)};
    uint64_t g;
    memcpy(&g, b, sizeof(g));
    return g;
}

EXPORT uint64_t ibv_get_device_guid(struct ibv_device_s *d)
{
    if (!d || d < devs || d >= devs + MAX_DEVS)
        return 0; /* rdma-core: 0 where the GUID cannot be read */
    return guid_of(d);
}

/* rdma-core's helper: <dir>/<file> into buf, the trailing newline dropped;
 * the length read, or -1 (errno from open/read). */
EXPORT int ibv_read_sysfs_file(const char *dir, const char *file, char *buf, size_t size)
{
    char path[512];
    if (snprintf(path, sizeof(path), "%s/%s", dir, file) >= (int)sizeof(path)) {
        errno = ENAMETOOLONG;
        return -1;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t len = read(fd, buf, size);
    close(fd);
    if (len > 0) {
        if (buf[len - 1] == '\n')
            buf[--len] = '\0';
        else if ((size_t)len < size)
            buf[len] = '\0';
        else
            return -1; /* would be truncated: no terminator fits */
    }
    return (int)len;
}

EXPORT struct ibv_context_s *ibv_open_device(struct ibv_device_s *dev)
{
    struct ibv_context_s *c = calloc(1, sizeof(*c));
    if (!c) {
        errno = ENOMEM;
        return NULL;
    }
    c->device = dev;
    c->ops.poll_cq = emu_poll_cq;
    c->ops.req_notify_cq = emu_req_notify_cq;
    c->ops.post_send = emu_post_send;
    c->ops.post_recv = emu_post_recv;
    c->cmd_fd = c->async_fd = -1;
    c->num_comp_vectors = 1;
    pthread_mutex_init(&c->mutex, NULL);
    return c;
}

EXPORT int ibv_close_device(struct ibv_context_s *c)
{
    pthread_mutex_destroy(&c->mutex);
    free(c);
    return 0;
}

EXPORT int ibv_query_device(struct ibv_context_s *c, struct ibv_device_attr_s *a)
{
    memset(a, 0, sizeof(*a));
    snprintf(a->fw_ver, sizeof(a->fw_ver), "1.0 (ibv_emu)");
    a->node_guid = a->sys_image_guid = guid_of(c->device);
    a->max_mr_size = UINT64_MAX;
    a->page_size_cap = ~(uint64_t)4095;
    a->max_qp = 1 << 16;
    a->max_qp_wr = EMU_MAX_QP_WR;
    a->device_cap_flags = 1u << 12; /* IBV_DEVICE_RC_RNR_NAK_GEN: receivers NAK, senders retry */
    a->max_sge = a->max_sge_rd = MAX_SGE;
    a->max_cq = 1 << 16;
    a->max_cqe = EMU_MAX_CQE;
    a->max_mr = 1 << 20;
    a->max_pd = 1 << 16;
    a->max_qp_rd_atom = a->max_res_rd_atom = a->max_qp_init_rd_atom = 16;
    a->atomic_cap = 0; /* IBV_ATOMIC_NONE: no atomics emulated; no SRQ, MW, AH, multicast */
    a->max_pkeys = 1;
    a->local_ca_ack_delay = 15;
    a->phys_port_cnt = 1;
    return 0;
}

static int port_down(const struct ibv_context_s *c)
{
    const char *d = getenv("UCCL_IBV_EMU_PORT_DOWN");
    return d && (strcmp(d, "all") == 0 || strcmp(d, c->device->name) == 0);
}

EXPORT int ibv_query_port(struct ibv_context_s *c, uint8_t port, struct ibv_port_attr_s *a)
{
    if (port != 1)
        return EINVAL;
    /* The compat prefix only (up to link_layer and flags), as the real
     * exported symbol writes; the caller zeroed the rest. */
    memset(a, 0, offsetof(struct ibv_port_attr_s, port_cap_flags2));
    a->state = port_down(c) ? 1 /* IBV_PORT_DOWN */ : IBV_PORT_ACTIVE_;
    a->max_mtu = 5;    /* IBV_MTU_4096 */
    a->active_mtu = 3; /* IBV_MTU_1024 */
    a->gid_tbl_len = 2;
    a->port_cap_flags = 1u << 16 | 1u << 26; /* IBV_PORT_CM_SUP | IBV_PORT_IP_BASED_GIDS */
    a->max_msg_sz = 1u << 31;
    a->pkey_tbl_len = 1;
    a->max_vl_num = 1;
    a->active_width = 2;  /* 4X */
    a->active_speed = 32; /* 25 Gbps a lane */
    a->link_layer = IBV_LINK_LAYER_ETHERNET_;
    a->phys_state = a->state == IBV_PORT_ACTIVE_ ? 5 /* LINK_UP */ : 3 /* DISABLED */;
    return 0;
}

static void gid_of(int index, union ibv_gid_u *g)
{
    memset(g, 0, sizeof(*g));
    if (index == 0) {
        g->raw[0] = 0xfe;
        g->raw[1] = 0x80;
        g->raw[15] = 1;
    } else { /* ::ffff:<the port's IPv4 address>, 127.0.0.1 by default */
        uint32_t ip = emu_ipv4();
        if (!ip)
            ip = htonl(0x7f000001);
        g->raw[10] = g->raw[11] = 0xff;
        memcpy(g->raw + 12, &ip, sizeof(ip));
    }
}

EXPORT int ibv_query_gid(struct ibv_context_s *c, uint8_t port, int index, union ibv_gid_u *g)
{
    (void)c;
    if (port != 1 || index < 0 || index > 1)
        return -1;
    gid_of(index, g);
    return 0;
}

EXPORT int _ibv_query_gid_ex(struct ibv_context_s *c, uint32_t port, uint32_t index,
                             struct ibv_gid_entry_s *e, uint32_t flags, size_t size)
{
    (void)c;
    if (flags || size < sizeof(*e))
        return EINVAL;
    if (port != 1 || index > 1)
        return ENODATA;
    memset(e, 0, sizeof(*e));
    gid_of((int)index, &e->gid);
    e->gid_index = index;
    e->port_num = port;
    e->gid_type = index == 0 ? IBV_GID_TYPE_ROCE_V1_ : IBV_GID_TYPE_ROCE_V2_;
    return 0;
}

/* rdma-core's private helper (IBVERBS_PRIVATE_34) that ibv_devinfo calls:
 * the sysfs GID type, 0 for IB and RoCE v1, 1 for RoCE v2; -1 on error.
 * ENODATA (no such entry) reads as RoCE v1, rdma-core's legacy answer. */
EXPORT int ibv_query_gid_type(struct ibv_context_s *c, uint8_t port, unsigned index, int *type)
{
    struct ibv_gid_entry_s e;
    int rc = _ibv_query_gid_ex(c, port, index, &e, 0, sizeof(e));
    if (rc == ENODATA) {
        *type = 0;
        return 0;
    }
    if (rc) {
        errno = rc;
        return -1;
    }
    *type = e.gid_type == IBV_GID_TYPE_ROCE_V2_ ? 1 : 0;
    return 0;
}
