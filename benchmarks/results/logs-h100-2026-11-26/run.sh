#!/bin/bash
# One lent-GPU session's measurements, most valuable first, each bounded by what is left of DEADLINE seconds.
# On the device machine, from the repo root: bash .gpu/run.sh  (carry .whl and .gpu)
set -u
START=$(date +%s); DEADLINE=${DEADLINE:-540}; PY=${PY:-python3}; OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
L=/tmp/gpulogs; mkdir -p $L $OUT; touch /tmp/gpu-start; sleep 1
if [ -z "${SKIP_PIP:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > $L/pip.log 2>&1 || tail -3 $L/pip.log
fi
mkdir -p /tmp/site; ln -sfn $PWD/pallas /tmp/site/ltm_pallas
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi -L 2>/dev/null; $PY -c "import jax; print('jax', jax.__version__, jax.devices())"
pack() {
  find benchmarks/results -newer /tmp/gpu-start -type f > /tmp/new-files
  tar czf $OUT/gpu-results.tar.gz -T /tmp/new-files -C /tmp gpulogs
}
step() {
  local name=$1 want=$2; shift 2
  local left=$((DEADLINE - ($(date +%s) - START)))
  local lim=$((want < left ? want : left))
  if [ $lim -lt 25 ]; then echo "== $name: not run (deadline)"; return; fi
  local t0=$(date +%s)
  timeout -k 5 $lim "$@" > $L/$name.log 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t0 ))s (limit $lim)"; tail -n ${TAIL:-22} $L/$name.log | cut -c1-190; pack
}
step wkv7seg 150 $PY benchmarks/wkv7.py --shapes gpu --impls pallas_chunked pallas_segmented --no-peers
step latent 160 $PY benchmarks/latent_cost.py --rounds 30 --variant latent.encoder=false,latent.inner_steps=8 \
  --variant latent.encoder=true,latent.inner_steps=2,latent.continuation_fraction=1
step train7 100 $PY benchmarks/train.py --config configs/small_rwkv7.py --name train-small_rwkv7 --variant '' --mfu
env PYTHONPATH=$PWD/.gpu/alt:$PYTHONPATH $PY -c "import ltm_pallas.wkv4 as m; print(m.__file__)"
step wkv4alt 70 env PYTHONPATH=$PWD/.gpu/alt:$PYTHONPATH $PY benchmarks/wkv.py --shape 8,4096,4096 --impls pallas \
  --name wkv4-unrolled
step tests 100 $PY -m pytest -q -n 8 -p no:cacheprovider tests/ops/test_gpu_kernels.py tests/ops/test_backend_choice.py \
  tests/test_latent.py::test_decoder_gradient_equals_gradient_with_z_frozen \
  tests/train/test_cross_entropy.py::test_chunks_bound_the_loss_memory tests/test_info.py
step wkv4main 70 $PY benchmarks/wkv.py --shape 8,4096,4096 --impls pallas --name wkv4-rolled
step wkv7n128 90 $PY benchmarks/wkv7_chunked_backward.py --shape 8,4096,4096,128
echo "== total $(( $(date +%s) - START ))s"
