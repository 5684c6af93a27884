/* Memory regions, the windows advertised over them, and holds.
 *
 * A region is what reg() made: an address range plus what each transport
 * registered for it (an RDMA lkey, a CUDA IPC handle).  A window is a range
 * of a region offered to the peer of one connection (advertise()), named by
 * an id and a random token.  A peer's one-sided access is checked against
 * its window here, and holds the region until the access is over; dereg()
 * removes the region's windows at once (no new access can start) and then
 * waits for the holds to go.
 *
 * One mutex guards the tables.  Nothing here calls into the transports,
 * connections or the endpoint: they call down into this file, and what
 * this file needs of them it is given as functions.  reg() classifies the
 * memory (host, page-locked, device: gpu.h) and exports device memory for
 * CUDA IPC, then registers it through the hooks its owner gave at init
 * (every transport available here: an RDMA device's MRs), which free()
 * undoes; keys() asks, under the lock, a caller's function for what a peer
 * needs to reach the memory (a transport's mem_key); dereg() asks its
 * caller, through a callback, to stop accesses that do not end in time. */
#ifndef UCCL_MEM_H
#define UCCL_MEM_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu/gpu.h"
#include "base/idmap.h"
#include "net/wire.h"

struct uccl__mem;
struct uccl__mr {
    uint64_t id;
    uintptr_t addr;
    size_t len;
    struct uccl__gpu_info gpu;   /* what the memory is (classified at registration) */
    struct uccl__gpu_export *gexp; /* device memory: its export record for peers on the host */
    char gexp_err[200];          /* ... or why it could not be exported */
    /* per transport: what mem_reg made (an lkey); by default the memory kind */
    uint64_t tp_key[UCCL_TP_COUNT];
    void *tp_priv[UCCL_TP_COUNT];
    int inflight;                /* one-sided operations of peers touching it (mem->mu) */
    int dead;                    /* deregistered: freed when inflight drops to 0 ... */
    int waiting;                 /* ... by dereg() itself while it waits, else by the last release */
};

struct uccl__window {
    uint64_t id, token, conn_id, mr_id;
    uintptr_t addr;
    size_t len;
    struct uccl__mr *mr;         /* in a window_check result: the hold to release */
};

/* What registers a region with the means of moving bytes, given by the
 * memory's owner (the endpoint: every transport, tp/transport.c). */
struct uccl__mem_hooks {
    /* A new region, classified: fill mr->tp_key[] and tp_priv[] (an lkey,
     * a record); an error fails the registration, and dereg then undoes
     * what was done. */
    int (*reg)(struct uccl__mem *m, struct uccl__mr *mr);
    /* The region is out of every peer's reach: undo reg. */
    void (*dereg)(struct uccl__mem *m, struct uccl__mr *mr);
};

struct uccl__mem {
    const struct uccl__mem_hooks *hooks;
    pthread_mutex_t mu;          /* everything below, and every region's counters */
    pthread_cond_t cv;           /* a region's last hold went */
    uint64_t next_mr_id, next_window_id;
    struct uccl__idmap mrs, windows;
    struct uccl__idmap window_of;  /* (conn, region, addr, len)'s hash -> its window:
                                      advertising the same range again gives it again */
};

void uccl__mem_init(struct uccl__mem *m, const struct uccl__mem_hooks *hooks);
/* Free every region and window; no access may be under way any more. */
void uccl__mem_fini(struct uccl__mem *m);

/* Register [addr, addr + len) (through the hooks: with every transport
 * available here). */
int uccl__mem_reg(struct uccl__mem *m, uintptr_t addr, size_t len, uint64_t *mr_p);

/* Called by dereg for each connection that was offered a window of the
 * region, when accesses under way did not end within the timeout: stop
 * them (fail the connection). */
typedef void (*uccl__mem_stop_fn)(void *arg, uint64_t conn_id, uint64_t mr_id);

/* Forget region mr_id and its windows; return once no peer touches it (or,
 * after stop() and 5 s more, with UCCL_ERR_TIMEOUT: the last hold frees it). */
int uccl__mem_dereg(struct uccl__mem *m, uint64_t mr_id, uint64_t timeout_ns,
                    uccl__mem_stop_fn stop, void *arg);

/* A capacity recv (upstream's rule) may post more than its region holds past
 * ptr: it takes at most what the region holds (nothing can land beyond it). */
size_t uccl__mem_room(struct uccl__mem *m, uint64_t mr_id, uintptr_t ptr, size_t len);

/* What a peer needs besides the address to reach addr inside region mr
 * (a transport's mem_key: an rkey, an export record's address), asked
 * under the regions' lock; arg is the caller's. */
typedef int (*uccl__mem_key_fn)(void *arg, const struct uccl__mr *mr, uintptr_t addr,
                                uint64_t *key_p);

/* Is [ptr, ptr + len) inside region mr_id, and (device memory) still the
 * allocation that was registered?  If so, the keys transport tp_id needs
 * to move it: local_key (this side's, from its registration: the memory
 * kind unless the transport registers) and peer_key (from peer_key_fn,
 * 0 without one), and the memory's kind (gpu.h). */
int uccl__mem_keys(struct uccl__mem *m, uint64_t mr_id, uintptr_t ptr, size_t len, int tp_id,
                   uccl__mem_key_fn peer_key_fn, void *arg, uint64_t *local_key_p,
                   uint64_t *peer_key_p, uint32_t *mkind_p);

/* Connection conn_id is gone: the windows offered on it go too (no peer
 * can use them any more; a window offered to any connection stays). */
void uccl__mem_drop_conn(struct uccl__mem *m, uint64_t conn_id);
/* Offer [addr, addr + len) of region mr_id to the peer of connection conn_id. */
int uccl__mem_advertise(struct uccl__mem *m, uint64_t conn_id, uint64_t mr_id, uintptr_t addr,
                        size_t len, struct uccl__fifo_item *f_p);

/* A peer's access to [offset, +len) of a window: if allowed, a copy of the
 * window (the caller frees it) whose region is held from dereg() until
 * uccl__mem_release_hold(m, copy->mr); else NULL with *status_p set. */
struct uccl__window *uccl__mem_window_check(struct uccl__mem *m, uint64_t conn_id,
                                            uint64_t window, uint64_t token, uint64_t offset,
                                            uint64_t len, int *status_p);
void uccl__mem_release_hold(struct uccl__mem *m, struct uccl__mr *mr);

#endif
