/* A registered region's device memory shared with a same-host peer for
 * stream-ordered exchanges (uccl.h): the owner hands out the key of its
 * export record, the peer maps the range through it.
 *
 * The same checks as a transfer's: the key is that of a live registration
 * of this endpoint and covers the range (uccl__tp_mem_keys); the peer is a
 * connection of this endpoint over shared memory with direct copies (so its
 * process id came through the job's authenticated handshake), and the
 * mapping is of a range inside what the peer's record exports
 * (uccl__gpu_import_get reads it from the peer's memory). */
#define _GNU_SOURCE
#include "ep/engine.h"
#include "gpu/gpu.h"
#include "base/status.h"
#include "tp/transport.h"

/* *c_p: connection conn_id, with a reference, if it reaches a same-host
 * peer's GPU memory by CUDA IPC. */
static int ipc_conn(uccl_ep_t *ep, uint64_t conn_id, const char *what, struct uccl__conn **c_p)
{
    struct uccl__conn *c = uccl__ep_conn_get(ep, conn_id);
    if (!c)
        return uccl__err(UCCL_ERR_NOTFOUND, "%s: no connection %llu", what,
                         (unsigned long long)conn_id);
    if (atomic_load(&c->link.failed)) { /* (it may be released: no transport state) */
        int rc = uccl__err(UCCL_ERR_IO, "%s: %s", what, c->fail_msg);
        uccl__conn_put(c);
        return rc;
    }
    if (c->link.tp->id != UCCL_TP_SHM || !c->link.direct) {
        int rc = uccl__err(UCCL_ERR_INVALID, "%s: connection %llu is %s%s, not shared memory "
                           "with CUDA IPC", what, (unsigned long long)conn_id, c->link.tp->name,
                           c->link.tp->id == UCCL_TP_SHM ? " without direct copies" : "");
        uccl__conn_put(c);
        return rc;
    }
    *c_p = c;
    return UCCL_OK;
}

int uccl_ep_ipc_key(uccl_ep_t *ep, uint64_t conn_id, uint64_t mr_id, uintptr_t ptr, size_t len,
                    uint64_t *key_p)
{
    int rc = uccl__ep_check_open(ep);
    if (rc)
        return rc;
    struct uccl__conn *c;
    if ((rc = ipc_conn(ep, conn_id, "sharing device memory", &c)))
        return rc;
    uint64_t local_key = 0, peer_key = 0;
    uint32_t mkind = 0;
    rc = uccl__tp_mem_keys(&ep->local.mem, mr_id, ptr, len, &c->link, &local_key, &peer_key,
                           &mkind);
    uccl__conn_put(c);
    if (rc)
        return rc;
    if (!UCCL_MK_ON_GPU(mkind) || peer_key == 0)
        return uccl__err(UCCL_ERR_INVALID, "sharing device memory: 0x%zx (%zu bytes, region "
                         "%llu) is not device memory", (size_t)ptr, len,
                         (unsigned long long)mr_id);
    *key_p = peer_key;
    return UCCL_OK;
}

int uccl_ep_ipc_map(uccl_ep_t *ep, uint64_t conn_id, uint64_t key, uint64_t addr, size_t len,
                    int dev, void **ptr_p, void **imp_p)
{
    int rc = uccl__ep_check_open(ep);
    if (rc)
        return rc;
    if (key == 0 || len == 0 || addr + len < addr)
        return uccl__err(UCCL_ERR_INVALID, "mapping a peer's device memory: key 0x%llx, address "
                         "0x%llx, %zu bytes", (unsigned long long)key,
                         (unsigned long long)addr, len);
    struct uccl__conn *c;
    if ((rc = ipc_conn(ep, conn_id, "mapping a peer's device memory", &c)))
        return rc;
    uint32_t pid = c->link.peer_pid;
    uccl__conn_put(c);
    struct uccl__gpu_import *imp = NULL;
    rc = uccl__gpu_import_get(pid, key, addr, len, dev, ptr_p, &imp);
    if (rc == UCCL_OK)
        *imp_p = imp;
    return rc;
}

void uccl_ep_ipc_unmap(void *imp)
{
    if (imp)
        uccl__gpu_import_put(imp);
}
