/* Open MPI MPI_Allgather baseline for the CPU allgather benchmark.
 *
 * For each size per rank given on the command line: fill the send buffer with
 * rank-dependent pseudo-random bytes, run one MPI_Allgather (MPI_BYTE) into a
 * recv buffer poisoned with 0xA5 and check every chunk against a regeneration
 * of what rank r sent, then time `iters` iterations after 3 warmups.  Rank 0
 * prints one JSON line per size.  GB/s = 1e9 bytes/s; busbw = algbw*(N-1)/N
 * (nccl-tests convention).
 *
 *   mpicc -O2 benchmarks/mpi_allgather.c -o /tmp/mpi_allgather
 *   mpirun -np 4 /tmp/mpi_allgather [-i ITERS] BYTES [BYTES ...]
 *
 * benchmarks/mpi_baseline.sh builds and runs it.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define WARMUP 3

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* Deterministic bytes for (rank, size): any rank can regenerate them. */
static void fill_rank(unsigned char *buf, size_t n, int rank)
{
    uint64_t s = 0x243F6A8885A308D3ULL ^ ((uint64_t)rank << 32) ^ (uint64_t)n;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v = splitmix64(&s);
        memcpy(buf + i, &v, 8);
    }
    if (i < n) {
        uint64_t v = splitmix64(&s);
        memcpy(buf + i, &v, n - i);
    }
}

static void usage(const char *prog)
{
    fprintf(stderr, "usage: %s [-i ITERS] BYTES_PER_RANK [BYTES_PER_RANK ...]\n", prog);
}

int main(int argc, char **argv)
{
    int rank, world, iters = 20, first = 1;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);

    if (first < argc && strcmp(argv[first], "-i") == 0) {
        if (first + 1 >= argc || (iters = atoi(argv[first + 1])) <= 0) {
            if (rank == 0) usage(argv[0]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        first += 2;
    }
    if (first >= argc) {
        if (rank == 0) usage(argv[0]);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }

    for (int a = first; a < argc; a++) {
        char *end;
        unsigned long long s = strtoull(argv[a], &end, 10);
        /* MPI_Allgather counts are int */
        if (*end != '\0' || s == 0 || s > (unsigned long long)2147483647) {
            if (rank == 0) fprintf(stderr, "bad size '%s'\n", argv[a]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        size_t size = (size_t)s;
        int count = (int)size;

        unsigned char *sendbuf = malloc(size);
        unsigned char *recvbuf = malloc(size * (size_t)world);
        unsigned char *expect = malloc(size);
        if (!sendbuf || !recvbuf || !expect) {
            fprintf(stderr, "rank %d: out of memory for %zu bytes per rank\n", rank, size);
            MPI_Abort(MPI_COMM_WORLD, 3);
        }
        fill_rank(sendbuf, size, rank);

        /* Check run: poison, gather, compare each chunk with rank r's bytes. */
        memset(recvbuf, 0xA5, size * (size_t)world);
        MPI_Allgather(sendbuf, count, MPI_BYTE, recvbuf, count, MPI_BYTE, MPI_COMM_WORLD);
        int bad = -1;
        for (int r = 0; r < world && bad < 0; r++) {
            fill_rank(expect, size, r);
            if (memcmp(recvbuf + (size_t)r * size, expect, size) != 0) bad = r;
        }
        int any_bad = 0, local_bad = bad >= 0;
        MPI_Allreduce(&local_bad, &any_bad, 1, MPI_INT, MPI_LOR, MPI_COMM_WORLD);
        if (bad >= 0) {
            const unsigned char *got = recvbuf + (size_t)bad * size;
            size_t off = 0;
            fill_rank(expect, size, bad);
            while (off < size && got[off] == expect[off]) off++;
            fprintf(stderr,
                    "rank %d: DATA MISMATCH in chunk from rank %d, %zu bytes per rank, "
                    "first bad byte at offset %zu (got 0x%02x, want 0x%02x)\n",
                    rank, bad, size, off, got[off], expect[off]);
        }
        if (any_bad) {
            MPI_Finalize();
            return 1;
        }

        for (int i = 0; i < WARMUP; i++)
            MPI_Allgather(sendbuf, count, MPI_BYTE, recvbuf, count, MPI_BYTE, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = 0; i < iters; i++)
            MPI_Allgather(sendbuf, count, MPI_BYTE, recvbuf, count, MPI_BYTE, MPI_COMM_WORLD);
        double local = MPI_Wtime() - t0, elapsed;
        /* the slowest rank defines the collective's time */
        MPI_Reduce(&local, &elapsed, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);

        if (rank == 0) {
            double t = elapsed / iters;                /* seconds per allgather */
            double algbw = (double)size * world / t / 1e9; /* nccl-tests: bytes gathered */
            double busbw = algbw * (world - 1) / world;
            printf("{\"tool\":\"mpi\",\"op\":\"allgather\",\"world\":%d,\"bytes_per_rank\":%zu,"
                   "\"time_us\":%.1f,\"algbw_gbs\":%.3f,\"busbw_gbs\":%.3f}\n",
                   world, size, t * 1e6, algbw, busbw);
            fflush(stdout);
        }
        free(sendbuf);
        free(recvbuf);
        free(expect);
    }
    MPI_Finalize();
    return 0;
}
