#!/bin/bash
# The GPU checks in one command (docs/benchmarks/gpu_h200.md), for a lent
# GPU machine with JAX, run from the repository root with OUT set to an
# output folder: the accelerator check in 4 processes at once, then the
# per-update overhead alone on the GPU.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
python3 -c "import jax, optax, flax, chex; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a $OUT/gpu.txt
S=$(date +%s)
for k in 1 2 3 4; do
  timeout ${ACC_S:-200} python3 -m benchmarks.accelerator_check --steps 4 --part $k/4 > $OUT/acc$k.md 2>$OUT/acc$k.err &
done
wait
echo "accelerator_check: $(( $(date +%s) - S )) s" | tee -a $OUT/gpu.txt
S=$(date +%s)
timeout ${OVH_S:-370} python3 -m benchmarks.bench_overhead --rounds ${ROUNDS:-5} --json $OUT/overhead.json > $OUT/overhead.md 2>$OUT/overhead.err
echo "bench_overhead rc=$? $(( $(date +%s) - S )) s" | tee -a $OUT/gpu.txt
tail -n 3 $OUT/acc*.err $OUT/overhead.err
grep -h "error" $OUT/acc*.md | head -20
tail -n 4 $OUT/acc*.md $OUT/overhead.md
cat $OUT/acc1.md $OUT/acc2.md $OUT/acc3.md $OUT/acc4.md > $OUT/acc.md
for f in $OUT/acc?.err $OUT/overhead.err; do echo "== $f"; grep -v "^W0000\|^I0000" $f | tail -n 30; done > $OUT/errs.txt
rm -f $OUT/acc?.md $OUT/acc?.err $OUT/overhead.err
