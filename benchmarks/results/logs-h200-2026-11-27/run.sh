#!/bin/bash
# One lent-GPU session: the latent-vs-plain comparison at equal compute (benchmarks/latent_gpu.py), then the latent
# step's cost against the plain step's (benchmarks/latent_cost.py), each bounded by what is left of TOTAL seconds.
# On the device machine, from the repo root: bash .gpu/run.sh  (carry .whl and .gpu)
set -u
START=$(date +%s); TOTAL=${TOTAL:-570}; PY=${PY:-python3}; OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
L=$OUT/logs; mkdir -p $L
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > $L/pip.log 2>&1 || tail -3 $L/pip.log
mkdir -p /tmp/site; ln -sfn $PWD/pallas /tmp/site/ltm_pallas
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi -L 2>/dev/null; $PY -c "import jax; print('jax', jax.__version__, jax.devices())"
left() { echo $((TOTAL - ($(date +%s) - START))); }
pack() { (cd runs && tar czf $OUT/runs-metrics.tar.gz $(find latent-gpu -name metrics.jsonl -o -name 'bench-*.json' 2>/dev/null)) 2>/dev/null; true; }
D=$(( $(left) - 130 ))
echo "== latent_gpu deadline ${D}s"
timeout -k 10 $((D + 60)) env XLA_FLAGS=--xla_gpu_autotune_level=0 $PY benchmarks/latent_gpu.py --deadline $D --parts code markov --corpus-archive .gpu/corpus-py.tar.xz --out $OUT ${LATENT_GPU_ARGS:-} > $L/latent-gpu.log 2>&1
echo "== latent_gpu rc=$? $(( $(date +%s) - START ))s"; tail -n 40 $L/latent-gpu.log | cut -c1-220; pack
LIM=$(( $(left) - 5 ))
if [ $LIM -gt 40 ]; then
  timeout -k 5 $LIM $PY benchmarks/latent_cost.py --config configs/ltm_code.py --rounds 30 --name latent-cost-code \
    --variant latent.enabled=false --variant '' > $L/latent-cost.log 2>&1
  echo "== latent_cost rc=$? $(( $(date +%s) - START ))s"; tail -n 8 $L/latent-cost.log | cut -c1-220
  cp benchmarks/results/latent-cost-code-*.json $OUT/ 2>/dev/null
fi
echo "== total $(( $(date +%s) - START ))s"
