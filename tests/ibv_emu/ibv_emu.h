/* What the two halves of the verbs emulator share: ibv_emu.c (devices,
 * contexts, protection domains, memory regions, completion queues) and
 * ibv_emu_qp.c (queue pairs: the wire between processes, RC semantics). */
#ifndef IBV_EMU_H
#define IBV_EMU_H

#include <pthread.h>
#include <stddef.h>
#include <sys/socket.h>
#include <stdint.h>

#include "load/ibv_loader.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_SGE 8

/* rdma-core's struct ibv_device layout */
struct ibv_device_s {
    void *ops[2];
    int node_type, transport_type;
    char name[64], dev_name[64], dev_path[256], ibdev_path[256];
};

struct emu_mr { struct ibv_mr_s mr; int access; struct emu_mr *next; };

/* Every MR of the process, by rkey: the responder looks keys up here and
 * holds the lock (read) while bytes land in a region, so dereg waits. */
extern pthread_rwlock_t emu_mr_lock;
/* Under emu_mr_lock: the region key names in pd, if [addr, +len) lies inside
 * it and it grants `need` (IBV_ACCESS_*). */
struct emu_mr *emu_mr_check(struct ibv_pd_s *pd, uint32_t key, uint64_t addr, uint64_t len,
                            int need);
uint32_t emu_random_key(void);
/* Append one completion (the queue grows rather than overrun). */
void emu_cq_push(struct ibv_cq_s *cq, const struct ibv_wc_s *wc);
/* The data path, reached through the context's ops as verbs.h does. */
int emu_post_send(struct ibv_qp_s *qp, struct ibv_send_wr_s *wr, struct ibv_send_wr_s **bad);
int emu_post_recv(struct ibv_qp_s *qp, struct ibv_recv_wr_s *wr, struct ibv_recv_wr_s **bad);

/* ibv_emu_sock.c: 0, or -1 once the peer is gone (or the socket shut down). */
struct sockaddr_un;
int emu_send_full(int fd, struct iovec *iov, int n);
int emu_recv_full(int fd, void *buf, size_t len);
int emu_drain(int fd, size_t len);     /* read and discard len bytes */
void emu_abstract_name(uint32_t qpn, struct sockaddr_un *a, socklen_t *len);

#endif
