/* What the two halves of the emulator's queue pairs share: ibv_emu_wire.c
 * (the wire between two QPs: packets, RC semantics, failures) and
 * ibv_emu_qp.c (the verbs: create, modify, query, destroy, post). */
#ifndef IBV_EMU_QP_H
#define IBV_EMU_QP_H

#include <pthread.h>
#include <stdint.h>

#include "ibv_emu.h"

struct swr {                      /* a send work request, copied at post */
    uint64_t wr_id;
    int opcode, signaled, solicited, local_err;
    uint32_t imm, rkey, len;
    uint64_t raddr;
    int nsge;
    struct ibv_sge_s sge[MAX_SGE];
    struct swr *next;
    char inl[];                   /* IBV_SEND_INLINE: the bytes, copied at post */
};
struct rwr { uint64_t wr_id; int nsge; struct ibv_sge_s sge[MAX_SGE]; struct rwr *next; };
struct rsp { uint32_t type, status, len, fatal; char *data; struct rsp *next; };

struct emu_qp {
    struct ibv_qp_s qp;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int listen_fd, fd;
    uint32_t dest_qpn;
    union ibv_gid_u dgid;         /* the peer's GID (the TCP wire's address) */
    unsigned access;
    int rnr_retry, min_rnr_timer, sq_sig_all, stop, threads, linked;
    struct ibv_qp_attr_s attr;    /* as last modified (ibv_query_qp) */
    struct ibv_qp_cap_s cap;      /* as granted at create */
    int refused;                  /* NAKed a request for access: later ones are dropped */
    int peer_gone;                /* EOF from the peer: requests can no longer be answered */
    int tx_busy;                  /* the sender thread is writing a packet */
    uint64_t req_bytes, reqs;     /* what this QP asked of its peer (UCCL_IBV_EMU_STATS) */
    struct swr *sq, **sq_tail;    /* posted, not yet sent */
    struct swr *out, **out_tail;  /* sent, awaiting the response */
    struct rwr *rq, **rq_tail;    /* posted receives */
    struct rsp *rs, **rs_tail;    /* responses to send */
    pthread_t tx, rx;
};

enum { P_WRITE = 1, P_WRITE_IMM, P_SEND, P_READ, P_ACK, P_NAK, P_READ_RSP };
/* flags of a request: the requester's RNR retry count (it is the
 * requester's attribute; the responder applies it) and the solicited bit */
enum { F_RNR_RETRY = 7, F_SOLICITED = 8 };
struct pkt { uint32_t type, imm; uint64_t raddr; uint32_t rkey, len, status, flags; };

/* ibv_emu_wire.c */
void emu_complete_send(struct emu_qp *e, struct swr *w, int status);
void emu_complete_recv(struct emu_qp *e, struct rwr *r, int status, int opcode, uint32_t len,
                       uint32_t imm, int with_imm, int solicited);
/* Under e->mu: enter ERR; `first` is the status of the oldest outstanding
 * request, everything else is flushed. */
void emu_qp_error_locked(struct emu_qp *e, int first);
/* Under e->mu, at RTR: connect to the peer QP and start the QP's threads. */
int emu_link_up(struct emu_qp *e);

#endif
