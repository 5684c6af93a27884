#!/usr/bin/env bash
# Open MPI MPI_Allgather baseline for the CPU allgather benchmark, measured on
# *this* machine.  Installs Open MPI (Debian packages) if mpicc is missing,
# builds benchmarks/mpi_allgather.c and runs it over the shared-memory BTL for
# every world size in WORLDS, printing one JSON line per (world, size) on stdout:
#   {"tool":"mpi","op":"allgather","world":N,"bytes_per_rank":S,"time_us":T,
#    "algbw_gbs":...,"busbw_gbs":...}
# algbw = bytes gathered by each rank (world x bytes per rank) / time (nccl-tests), busbw = algbw*(N-1)/N, GB/s = 1e9 bytes/s.
#
# Usage: benchmarks/mpi_baseline.sh [-i ITERS]       (needs root for apt-get)
#        WORLDS="2 4 8" SIZES="1048576 67108864" benchmarks/mpi_baseline.sh -i 10
# Extra arguments go to mpi_allgather before the sizes (only -i is known).
# MPI_SINGLE_COPY=cma|none|emulated overrides the shared-memory BTL's
# single-copy mechanism (default: Open MPI's own choice, cma on Linux).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORLDS="${WORLDS:-2 4}"
SIZES="${SIZES:-1048576 4194304 16777216 67108864}"

# ---------------------------------------------------------------- install ---
if ! command -v mpicc >/dev/null; then
    # Refresh the package lists only when the plain install fails: the update
    # is the slow part and is not needed on a warm machine.
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q openmpi-bin libopenmpi-dev >&2; then
        apt-get update -q >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q openmpi-bin libopenmpi-dev >&2
    fi
fi

# ------------------------------------------------------------------ build ---
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
mpicc -O2 "$HERE/mpi_allgather.c" -o "$TMP/mpi_allgather"

# --------------------------------------------------------------- settings ---
# Running as root in a container, with no ssh needed for a single host.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_plm_rsh_agent=
# The shared-memory BTL is 'vader' in Open MPI 4.x and 'sm' in 5.x.
if ompi_info --parsable 2>/dev/null | grep -q '^mca:btl:vader:'; then
    SMBTL=vader
else
    SMBTL=sm
fi
MCA=(--mca btl "self,$SMBTL"
     # Debian's build also has the UCX PML, which outranks ob1 and would
     # bypass the BTLs altogether; ob1 is the PML that uses them.
     --mca pml ob1)
if [[ -n "${MPI_SINGLE_COPY:-}" ]]; then
    MCA+=(--mca "btl_${SMBTL}_single_copy_mechanism" "$MPI_SINGLE_COPY")
fi
echo "# $(ompi_info --version 2>/dev/null | head -1), btl self,$SMBTL, pml ob1," \
     "single copy: ${MPI_SINGLE_COPY:-$(ompi_info --all 2>/dev/null |
        sed -n "s/.*btl_${SMBTL}_single_copy_mechanism\" (current value: \"\([^\"]*\)\".*/\1/p" |
        head -1)}" >&2

# -------------------------------------------------------------------- run ---
for n in $WORLDS; do
    # shellcheck disable=SC2086  # SIZES is a word list
    mpirun --allow-run-as-root --oversubscribe -np "$n" --bind-to none \
        "${MCA[@]}" "$TMP/mpi_allgather" "$@" $SIZES
done
