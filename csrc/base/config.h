/* Every environment variable the project reads, declared once.
 *
 * The table below is the only place a UCCL_* variable is named: the C
 * engine reads it through uccl__cfg_*(), the Python package through the
 * module's config() (which calls the same parser), and docs/environment.md
 * is generated from it (tests/test_config.py checks that they agree and
 * that nothing reads a variable the table does not declare).
 *
 * One syntax per kind, everywhere:
 *   INT     a decimal integer in lo..hi
 *   SIZE    a byte count: digits with an optional K, M or G (powers of
 *           1024; "KiB"/"KB" and so on accepted); plain digits count in
 *           the variable's unit (1 byte, or 1024 for a *_KB variable);
 *           the result, in bytes, in lo..hi bytes
 *   BOOL    0/1, false/true, no/yes, off/on
 *   CHOICE  one of the '|'-separated words, any case
 *   STR     any text
 * Unset or empty means the default.  A value that does not parse is an
 * error naming the variable, the value and what is expected
 * (UCCL_ERR_INVALID; ValueError in Python).
 *
 * X(NAME, KIND, DEFAULT, LO, HI, UNIT, CHOICES, DEFAULT_TEXT, MEANING) declares
 * the variable UCCL_<NAME>, read as UCCL_CFG_<NAME>:
 * DEFAULT is the number an unset INT/SIZE/BOOL gives (SIZE: in bytes;
 * CHOICE: the index of the default word); DEFAULT_TEXT is what the docs
 * show as the default (where the number is a sentinel for "computed"). */
#ifndef UCCL_CONFIG_H
#define UCCL_CONFIG_H

#include <stddef.h>

#define UCCL_KI 1024L
#define UCCL_MI (1024L * 1024L)

/* clang-format off */
#define UCCL_CONFIG_TABLE(X)                                                                      \
  /* ---- the engine, every API ---- */                                                            \
  X(P2P_LOG_LEVEL, CHOICE, 1, 0, 0, 1, "INFO|WARNING|ERROR|FATAL|WARN|DEBUG|TRACE",                \
    "WARNING", "what the engine logs on stderr: INFO, WARNING, ERROR or FATAL (WARN means "        \
    "WARNING; DEBUG and TRACE mean INFO)")                                                         \
  X(P2P_SECRET, STR, 0, 0, 0, 1, "", "unset",                                                      \
    "the job's secret (at most 64 bytes); when set, every peer must present it")                   \
  /* P2P_TRANSPORT's words are UCCL_TP_*'s (net/wire.h), in their order */                         \
  X(P2P_TRANSPORT, CHOICE, 0, 0, 0, 1, "auto|tcp|shm|ipc|rdma", "auto",                            \
    "`auto` (same host: shared memory; other hosts: RDMA when both ends have a usable device, "    \
    "else TCP), `tcp`, `shm`, `ipc` (the same-host transport, GPU memory by CUDA IPC; needs "      \
    "the CUDA driver), `rdma` (also on one host; raises naming what is missing: library, "         \
    "device, active port)")                                                                        \
  X(P2P_SHM_MODE, CHOICE, 0, 0, 0, 1, "auto|cma|ring", "auto",                                     \
    "same-host data path: `cma` (single copy), `ring` (shared-memory ring), `auto` (CMA if the "   \
    "kernel permits)")                                                                             \
  X(SOCKET_IFNAME, STR, 0, 0, 0, 1, "", "the first non-loopback interface that is up",             \
    "interface whose IPv4 address goes into the metadata "                                         \
    "(`lo` for loopback only)")                                                                    \
  X(P2P_TCP_STREAMS, INT, 2, 1, 16, 1, "", "2",                                                    \
    "TCP data streams per connection (1-16); more help on fast NICs with many cores")              \
  X(P2P_TCP_CHUNK_KB, SIZE, 1024 * UCCL_KI, 4 * UCCL_KI, 64 * UCCL_MI, UCCL_KI, "", "1M",          \
    "chunk size striped over the TCP streams (4K-64M; plain digits are KiB)")                      \
  X(P2P_TIMEOUT_S, INT, 300, 1, 86400L * 7, 1, "", "300",                                          \
    "default deadline in seconds of every blocking call and handshake (1-604800)")                 \
  X(P2P_DONE_IDS, INT, 65536, 16, 1L << 30, 1, "", "65536",                                        \
    "finished transfer ids an endpoint keeps individually before compacting the oldest "           \
    "(which then answer \"done\", even after release)")                                            \
  X(P2P_ACCEPT_QUEUE, INT, 1024, 1, 65536, 1, "", "1024",                                          \
    "connections an endpoint keeps that accept() has not returned yet (1-65536); past it a new "   \
    "connection is refused in its handshake, and its connect() raises naming this variable "       \
    "(connections whose peers went away make room)")                                               \
  X(P2P_BASE_PORT, INT, 28500, 1, 65535, 1, "", "28500",                                           \
    "well-known listening port = base + GPU index (CPU: base)")                                    \
  X(P2P_HOST_ID, STR, 0, 0, 0, 1, "", "the kernel's boot id",                                      \
    "host identity for same-host detection; set it to tell apart \"hosts\" that share one "        \
    "kernel (network namespaces)")                                                                 \
  X(P2P_SPIN_US, INT, 200, 0, 1000000, 1, "", "200",                                               \
    "microseconds a blocked caller drives its connection before sleeping; CollectiveContext "      \
    "uses 0 when a node runs more ranks than it has cores, unless this is set")                    \
  X(P2P_CUDA_STREAMS, INT, 2, 1, 8, 1, "", "2",                                                    \
    "copy-engine streams a large GPU copy between device and page-locked or device memory "        \
    "(16 MiB and up, at least 8 MiB per stream) is split "                                         \
    "over, per copying thread (1-8)")                                                              \
  X(CUDA_LIBRARY, STR, 0, 0, 0, 1, "", "libcuda.so.1",                                             \
    "the CUDA driver library loaded at run time (a missing file makes GPU memory unusable, with "  \
    "that reason in the error; CPU work is unaffected)")                                           \
  X(NVRTC_LIB, STR, 0, 0, 0, 1, "", "torch's libnvrtc, else libnvrtc.so.13, .12, .so",             \
    "the run-time compiler for GPU-ring kernels (`gpu_ring.Kernel`) and the stream-ordered "       \
    "reduction and copy "                                                                          \
    "kernels (without it: reductions by torch kernels, copies on the copy engine); an explicit "   \
    "path that fails to load is an error, not a fallback")                                         \
  /* ---- RDMA ---- */                                                                             \
  X(IBVERBS_LIB, STR, 0, 0, 0, 1, "", "libibverbs.so.1",                                           \
    "the verbs library loaded at run time")                                                        \
  X(P2P_RDMA_DEV, STR, 0, 0, 0, 1, "", "every device with an active port (at most 2)",             \
    "RDMA devices to use, comma-separated, each optionally `:port` (`mlx5_0,mlx5_1:1`)")           \
  X(P2P_RDMA_GID_INDEX, INT, -1, -1, 1023, 1, "", "auto: the RoCE v2 GID of an IPv4 address",      \
    "GID table index on RoCE (see `show_gids` or `ibv_devinfo -v`); -1: auto")                     \
  X(P2P_RDMA_SL, INT, 0, 0, 15, 1, "", "0", "service level of the QPs (0-15)")                     \
  X(P2P_RDMA_TC, INT, 0, 0, 255, 1, "", "0",                                                       \
    "traffic class of the QPs (0-255, RoCE DSCP << 2)")                                            \
  X(P2P_RDMA_QPS, INT, 2, 1, 16, 1, "", "2",                                                       \
    "RC queue pairs per connection (1-16); chunks are striped over them, and over the NICs")       \
  X(P2P_RDMA_CHUNK_KB, SIZE, 512 * UCCL_KI, 4 * UCCL_KI, 1024 * UCCL_MI, UCCL_KI, "", "512K",      \
    "bytes per RDMA WRITE/READ work request (4K-1G; plain digits are KiB)")                        \
  X(P2P_RDMA_STAGE_ALL, BOOL, 0, 0, 1, 1, "", "0",                                                 \
    "1: register no memory with the NICs and stage every buffer as GPU memory without "            \
    "GPUDirect is staged (rules GPUDirect out; the tests use it to run the staged paths "          \
    "without a GPU)")                                                                              \
  /* ---- collectives over endpoints (CollectiveContext, the backend's host-driven path) ---- */   \
  X(NODE_ID, STR, 0, 0, 0, 1, "", "boot id + /node<GROUP_RANK> under torchrun",                    \
    "CollectiveContext: which node a rank is on; same-node peers may use shared memory")           \
  X(COLL_PIECE_KB, SIZE, 0, 4 * UCCL_KI, 4L * 1024 * UCCL_MI, UCCL_KI, "",                         \
    "half of each direction's part, 512K-8M",                                                      \
    "ring allgather: bytes forwarded at a time (plain digits are KiB); every rank must use the "   \
    "same value")                                                                                  \
  X(COLL_POLL_US, INT, 200, 0, 1000000, 1, "", "200",                                              \
    "microseconds a waiting collective polls all of its connections (handling arrivals itself) "   \
    "before it sleeps")                                                                            \
  /* ---- the torch.distributed backend ---- */                                                    \
  X(PG_SMALL_KB, SIZE, 64 * UCCL_KI, 0, 1024 * UCCL_MI, UCCL_KI, "", "64K",                        \
    "backend all_reduce of CPU tensors: up to this size one allgather and a local reduction "      \
    "(plain digits are KiB)")                                                                      \
  X(PG_ALGO, CHOICE, 0, 0, 0, 1, "auto|ring|direct|hier", "auto",                                \
    "backend reduce-scatter (and all_reduce's first half): ring, direct, hier (all_reduce of CPU " \
    "tensors by node: within each node, across nodes, within again; where the group spans 2 "     \
    "nodes or more of the same number of ranks, 2 or more), or auto (hier where it applies, "     \
    "else the allgather's choice: direct within a host)")                                          \
  X(PG_PIECE_KB, SIZE, 4096 * UCCL_KI, 0, 1024 * UCCL_MI, UCCL_KI, "", "4M",                       \
    "backend reduce-scatter: largest piece reduced at a time (at least 4 pieces per chunk, but "   \
    "none under 1 MiB or this size if smaller; below 64K counts as 64K; plain digits are KiB)")    \
  X(PG_WINDOW, INT, 4, 0, 1024, 1, "", "4",                                                        \
    "backend reduce-scatter: pieces in flight at once (0 counts as 1)")                            \
  X(PG_REDUCE_THREADS, INT, 0, 0, 256, 1, "", "cores / ranks on the host, at most 8",              \
    "threads one rank splits a large reduction over; 0: the default")                              \
  X(PG_GPU_SMALL_KB, SIZE, 1024 * UCCL_KI, 0, 1024 * UCCL_MI, UCCL_KI, "", "1M",                   \
    "backend all_reduce of CUDA tensors where the engine's kernel does not apply (complex "        \
    "tensors, peers on other hosts): up to this size one allgather and one reduction kernel, "     \
    "above a reduce-scatter and an allgather (the `UCCL_PG_*` piece and window settings are "      \
    "for CPU tensors; plain digits are KiB)")                                                      \
  /* ---- stream-ordered groups (CUDA tensors, every rank on one host) ---- */                     \
  X(STREAM_ORDERED, BOOL, 1, 0, 1, 1, "", "1",                                                     \
    "CUDA tensors, every rank on one host (the backend's collectives, CollectiveContext's "        \
    "allgather): 1 queues each operation on a stream with no host wait for the GPU "               \
    "(Work.wait() as NCCL's); 0 runs it through the engine's host-driven transfers (wait() "       \
    "waits on the host). Every rank must use the same value")                                      \
  X(SG_EAGER_BYTES, SIZE, 256 * UCCL_KI, 0, 64 * UCCL_MI, 1, "", "256K",                           \
    "stream-ordered point-to-point: a send of at most this many bytes that its sender posts "      \
    "before the receiver is copied into a staging slot of the sender's (16 slots per peer, made "  \
    "at the first such send: 4 MiB of GPU memory per peer at the default) and is complete once "   \
    "there, as a buffered send; larger ones complete in the receiver's copy. 0: none staged "      \
    "(at most 64M)")                                                                               \
  X(SG_FUSED_BYTES, SIZE, 1 * UCCL_MI, 0, 64 * UCCL_MI, 1, "", "1M",                               \
    "stream-ordered all_reduce and allgather of at most this many bytes per rank (groups of at "   \
    "most 8 ranks) run as one kernel launch through an arena the peers mapped once (two slots "    \
    "of this size per rank, made with the group): no host wait for the peers; the calls are "      \
    "compared one call late. Must be the same on every rank. The other rounds' handshakes poll "   \
    "the arenas too. 0: never, and no arena (every call a round with its peers on the host, its "  \
    "handshakes stream memory operations on the shared page; at most 64M)")                        \
  X(SG_GRAPH_LL_BYTES, SIZE, 64 * UCCL_KI, 0, 256 * UCCL_KI, 1, "", "64K",                        \
    "an all_reduce or allgather captured in a CUDA graph, one launch at each replay, of at "       \
    "most this many bytes per rank: the data go as NCCL's LL lines (8 bytes and the round's "     \
    "number twice in each 16-byte store: no fence, no ready word, twice the arena); above, the "   \
    "input and then a ready word. Must be the same on every rank (a capture where they differ "    \
    "fails, naming the arena's size). 0: never")                                                   \
  X(SG_GATHER_LAUNCH_BYTES, SIZE, 48 * UCCL_MI, 0, 1L << 40, 1, "", "48M",                         \
    "stream-ordered rounds of one phase with no reduction (allgather), where every peer is a "     \
    "process on this GPU and the handshakes are launches (`UCCL_SG_FUSED_BYTES` not 0, MPS "       \
    "where ranks share a GPU): whose copies move at most this many "                               \
    "bytes in all run as one kernel launch (the handshakes and the copies by the SMs); above, a "  \
    "handshake launch, the copies (`UCCL_SG_KERNEL_COPY_BYTES`) and a handshake launch. 0: "       \
    "never. Ranks may differ")                                                                     \
  X(SG_KERNEL_COPY_BYTES, SIZE, 8 * UCCL_MI, 0, 1L << 40, 1, "", "8M",                             \
    "stream-ordered operations: the copies of one phase that move at most this many bytes in "     \
    "all go in one kernel launch (a cuMemcpyAsync each costs several microseconds of the "         \
    "host's time); above, the copy engine. 0: always the copy engine")                             \
  /* ---- GPU-initiated transfers ---- */                                                          \
  X(RING_SPIN_US, INT, 1000, 0, 10000000, 1, "", "1000",                                           \
    "microseconds a GPU ring's proxy polls after its last command before it sleeps")           \
  X(RING_BATCH_BYTES, SIZE, 1 * UCCL_MI, 0, 1L << 30, 1, "", "1M",                                 \
    "a GPU ring's proxy writes consecutive puts to one remote destination, each range "          \
    "following on from the one before (source and destination), as one write of at most this "  \
    "many bytes, and counts them done together. 0: a write per put")
/* clang-format on */

enum uccl_cfg_kind { UCCL_CFG_INT, UCCL_CFG_SIZE, UCCL_CFG_BOOL, UCCL_CFG_CHOICE, UCCL_CFG_STR };

enum uccl_cfg_id {
#define UCCL_X_ID(name, kind, dflt, lo, hi, unit, choices, dtext, doc) UCCL_CFG_##name,
    UCCL_CONFIG_TABLE(UCCL_X_ID)
#undef UCCL_X_ID
    UCCL_CFG_COUNT
};

struct uccl_cfg_entry {
    const char *name;
    int kind;                /* enum uccl_cfg_kind */
    long dflt, lo, hi, unit;
    const char *choices;     /* CHOICE: "a|b|c" */
    const char *dflt_text;   /* the default as the docs show it */
    const char *doc;
};

/* The table (UCCL_CFG_COUNT entries, in declaration order). */
const struct uccl_cfg_entry *uccl__cfg_entry(int id);
/* The entry named `name`, or -1. */
int uccl__cfg_find(const char *name);

/* The value of an INT, SIZE or BOOL variable (SIZE: bytes; BOOL: 0 or 1),
 * its default when unset or empty. */
int uccl__cfg_long(int id, long *v_p);
/* A CHOICE variable: the index of its word in the entry's choices, the
 * default's when unset or empty. */
int uccl__cfg_choice(int id, int *idx_p);
/* A STR variable: its text, or NULL when unset or empty. */
int uccl__cfg_str(int id, const char **v_p);

/* Parse `text` as variable id's kind would (for the Python layer, which
 * reads os.environ, and for the tests): an INT/SIZE/BOOL into *num_p, a
 * CHOICE's index into *num_p, a STR unchanged (*num_p = 0). */
int uccl__cfg_parse(int id, const char *text, long *num_p);

#endif
