/* How fast can one process copy another's memory with process_vm_readv
 * (CMA), with 1, 2 and 4 threads?  The ceiling of the same-host transport's
 * single-copy path on this machine.  GB/s = 1e9 bytes/s.
 *
 *   gcc -O2 -pthread benchmarks/cma_ceiling.c -o /tmp/cma_ceiling && /tmp/cma_ceiling [MiB]
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static size_t n_bytes;
static char *src, *dst;
static pid_t child;

struct part { size_t off, len; };

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void *copy_part(void *arg)
{
    struct part *p = arg;
    for (size_t done = 0; done < p->len;) {
        struct iovec l = {dst + p->off + done, p->len - done};
        struct iovec r = {src + p->off + done, p->len - done};
        ssize_t n = process_vm_readv(child, &l, 1, &r, 1, 0);
        if (n <= 0) {
            perror("process_vm_readv");
            exit(1);
        }
        done += (size_t)n;
    }
    return NULL;
}

int main(int argc, char **argv)
{
    n_bytes = (size_t)(argc > 1 ? atol(argv[1]) : 256) << 20;
    /* The child gets the buffer at the same address (fork), touches it, waits. */
    src = mmap(NULL, n_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    int ready[2];
    if (src == MAP_FAILED || pipe(ready) < 0)
        return 1;
    child = fork();
    if (child == 0) {
        memset(src, 9, n_bytes);
        if (write(ready[1], "x", 1) != 1)
            _exit(1);
        pause();
        _exit(0);
    }
    char c;
    if (read(ready[0], &c, 1) != 1)
        return 1;
    dst = malloc(n_bytes);
    memset(dst, 1, n_bytes); /* touched: no first-touch faults in the timing */
    for (int threads = 1; threads <= 4; threads *= 2) {
        double best = 0;
        for (int it = 0; it < 6; it++) {
            pthread_t t[4];
            struct part p[4];
            double t0 = now();
            for (int i = 0; i < threads; i++) {
                p[i] = (struct part){n_bytes / threads * i, n_bytes / threads};
                pthread_create(&t[i], NULL, copy_part, &p[i]);
            }
            for (int i = 0; i < threads; i++)
                pthread_join(t[i], NULL);
            double rate = (double)n_bytes / (now() - t0) / 1e9;
            best = rate > best ? rate : best;
        }
        if (dst[0] != 9 || dst[n_bytes - 1] != 9) {
            fprintf(stderr, "copy check failed\n");
            return 1;
        }
        printf("CMA process_vm_readv %zu MiB, %d thread(s): best %.2f GB/s\n", n_bytes >> 20,
               threads, best);
    }
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    return 0;
}
