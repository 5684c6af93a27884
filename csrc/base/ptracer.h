/* Who may ptrace this process, and so read and write its memory with
 * process_vm_readv/writev (CMA), where Yama's ptrace_scope is 1.
 *
 * Yama (Documentation/admin-guide/LSM/Yama.rst, PR_SET_PTRACER(2const))
 * keeps one exception per process: prctl(PR_SET_PTRACER, pid) lets that
 * pid and its descendants attach, each call replacing the last; 0 clears
 * it; PR_SET_PTRACER_ANY lets any process of the user attach.  Yama checks
 * on every process_vm_readv/writev, not once, so the exception must stay
 * while a peer copies.  The engine grants a CMA peer only once it proved
 * the job's secret and was found to hold the other end of the connection's
 * socket (tp/handshake.c), and releases it with the connection:
 *   no CMA peer          -> no exception (Yama's default: descendants only)
 *   one peer process     -> PR_SET_PTRACER(that pid)
 *   two or more          -> PR_SET_PTRACER_ANY, because Yama cannot name
 *                           two; back to the one pid when one is left.
 * Where Yama is absent or its scope is not 1, nothing is called (scope 0
 * lets every process of the user attach anyway; 2 and 3 refuse CMA, and
 * the shared-memory ring is used). */
#ifndef UCCL_PTRACER_H
#define UCCL_PTRACER_H

#include <stdint.h>

/* One more connection over which `pid` copies our memory.  Never fails:
 * where prctl refuses, CMA fails at the probe and the ring is used. */
void uccl__ptracer_grant(uint32_t pid);
/* That connection is gone. */
void uccl__ptracer_release(uint32_t pid);

/* For tests: Yama's scope (-1: no Yama), what this process asks of Yama
 * (0: nothing, -1: any, else the pid; asked of the kernel only where the
 * scope is 1), and how many distinct peer processes hold a grant. */
void uccl__ptracer_state(int *scope_p, long *want_p, unsigned *peers_p);

#endif
