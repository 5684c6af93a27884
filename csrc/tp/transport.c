/* The transport registry: a const table by wire id (DESIGN.md §2.1). */
#include "tp/transport.h"

const struct uccl__tp_ops *const uccl__tp_registry[UCCL_TP_COUNT] = {
    [UCCL_TP_TCP] = &uccl__tp_tcp,
    [UCCL_TP_SHM] = &uccl__tp_shm,
    [UCCL_TP_RDMA] = &uccl__tp_rdma,
};

const char *const uccl__tp_names[UCCL_TP_COUNT] = {"auto", "tcp", "shm", "ipc", "rdma"};
