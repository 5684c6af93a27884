# Sourced by the device_*.sh scripts: the GPU machine's environment, a
# record of the machine in $out/machine.txt, and the in-place build (there
# is no package registry there).  Sets $out (OUT, else ./bench_out/device).
out=${OUT:-bench_out/device}
mkdir -p "$out"
export PYTHONPATH=$PWD UCCL_P2P_LOG_LEVEL=ERROR
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ nproc; python3 -c "import torch; print(torch.__version__)"; lscpu | grep -E "Model name|^CPU\(s\)"; } > "$out/machine.txt" 2>&1
# UCCL_BUILT=1: a calling script built the tree already (scripts run side by side must not build at once)
[ "${UCCL_BUILT:-0}" = 1 ] ||
  python3 setup.py build_ext --inplace -q > "$out/build.log" 2>&1 || { echo "build failed"; tail -20 "$out/build.log"; exit 1; }
