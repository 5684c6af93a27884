/* The transport registry (transport.h): a const table by wire id, and
 * what goes through it for the memory regions: the hooks that register a
 * region with every transport available here, and the keys of a region
 * for one connection's transport (mem.h asks for them as functions,
 * knowing no transport). */
#include "tp/transport.h"

#include "base/status.h"

const struct uccl__tp_ops *const uccl__tp_registry[UCCL_TP_COUNT] = {
    [UCCL_TP_TCP] = &uccl__tp_tcp,
    [UCCL_TP_SHM] = &uccl__tp_shm,
    [UCCL_TP_RDMA] = &uccl__tp_rdma,
};

const char *const uccl__tp_names[UCCL_TP_COUNT] = {"auto", "tcp", "shm", "ipc", "rdma"};

/* Every transport available in this process, by wire id; the first
 * failure stops (the region is then freed, which undoes the rest). */
static int reg_all(struct uccl__mem *m, struct uccl__mr *mr)
{
    int rc = UCCL_OK;
    for (int i = 0; i < UCCL_TP_COUNT && rc == UCCL_OK; i++) {
        const struct uccl__tp_ops *tp = uccl__tp_registry[i];
        if (tp && tp->mem_reg && tp->available() == UCCL_OK)
            rc = tp->mem_reg(m, mr);
    }
    return rc;
}

static void dereg_all(struct uccl__mem *m, struct uccl__mr *mr)
{
    for (int i = 0; i < UCCL_TP_COUNT; i++) {
        const struct uccl__tp_ops *tp = uccl__tp_registry[i];
        if (tp && tp->mem_dereg && mr->tp_priv[i])
            tp->mem_dereg(m, mr);
    }
}

const struct uccl__mem_hooks uccl__tp_mem_hooks = {.reg = reg_all, .dereg = dereg_all};

static int link_key(void *arg, const struct uccl__mr *mr, uintptr_t addr, uint64_t *key_p)
{
    struct uccl__link *lk = arg;
    return lk->tp->mem_key(lk, mr, addr, key_p);
}

int uccl__tp_mem_keys(struct uccl__mem *m, uint64_t mr_id, uintptr_t ptr, size_t len,
                      struct uccl__link *lk, uint64_t *local_key_p, uint64_t *peer_key_p,
                      uint32_t *mkind_p)
{
    return uccl__mem_keys(m, mr_id, ptr, len, lk->tp->id, lk->tp->mem_key ? link_key : NULL, lk,
                          local_key_p, peer_key_p, mkind_p);
}
