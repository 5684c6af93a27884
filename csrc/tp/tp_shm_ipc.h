/* tp_shm.c's GPU half (tp_shm_ipc.c): CUDA IPC and the copy engine. */
#ifndef UCCL_TP_SHM_IPC_H
#define UCCL_TP_SHM_IPC_H

#include <stddef.h>
#include <stdint.h>

struct uccl__link;
struct uccl__mr;

int uccl__shm_ipc_mem_key(struct uccl__link *lk, const struct uccl__mr *mr, uintptr_t addr,
                          uint64_t *key_p);
int uccl__shm_ipc_key_on_gpu(uint64_t peer_key);
/* The peer's GPU memory (remote_key != 0) into local memory of any kind. */
int uccl__shm_ipc_pull(struct uccl__link *lk, void *dst, uint64_t local_key, uint64_t remote,
                       uint64_t remote_key, size_t len);
/* Local memory of any kind into the peer's GPU memory. */
int uccl__shm_ipc_push(struct uccl__link *lk, const void *src, uint64_t local_key,
                       uint64_t remote, uint64_t remote_key, size_t len);

#endif
