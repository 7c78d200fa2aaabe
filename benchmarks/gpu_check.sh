#!/usr/bin/env bash
# The GPU checks of a lent machine in one pass: `make test-gpu`'s tests (tests/gpu, NCCL,
# one rank per GPU) and benchmarks/bench_gpu.py, without a venv: the machine's own CUDA
# torch, autoshard from this checkout (passes/ and policies/ linked inside the package
# where an install places them), and wheels from .whl/ if present (e.g. transformers==5.23).
# Logs and JSON go to $OUT (default /tmp/gpu-out).
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
site=""
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && site=/tmp/site
fi
# autoshard.passes / autoshard.policies where an install puts them (the tests put the checkout first on sys.path)
for d in passes policies; do [ -e "autoshard/$d" ] || ln -s "../$d" "autoshard/$d"; done
export PYTHONPATH=$PWD${site:+:$site}
# torch older than the pinned 2.13 (a lent machine's own build): new_group() has no
# sort_ranks; every group of a one-rank-per-GPU run on one node lists its ranks sorted anyway,
# so drop the argument where it would not change the group, and refuse where it would.
mkdir -p /tmp/compat
cat > /tmp/compat/sitecustomize.py <<'PY'
import inspect
import torch.distributed as dist
if "sort_ranks" not in inspect.signature(dist.new_group).parameters:
    _new_group = dist.new_group
    def new_group(ranks=None, *args, sort_ranks=True, **kwargs):
        if not sort_ranks and ranks is not None and list(ranks) != sorted(ranks):
            raise RuntimeError("this torch cannot keep the rank order %s (needs torch 2.13)" % (list(ranks),))
        return _new_group(ranks, *args, **kwargs)
    dist.new_group = new_group
if not hasattr(dist, "all_gather_single"):         # the 2.13 names of the single-tensor collectives
    dist.all_gather_single = dist.all_gather_into_tensor
    dist.reduce_scatter_single = dist.reduce_scatter_tensor
PY
export PYTHONPATH=$PYTHONPATH:/tmp/compat
ngpu=$(nvidia-smi -L | wc -l)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"; } 2>&1 | tee "$OUT/env.txt"
echo "== tests/gpu"
[ -n "${SKIP_TESTS:-}" ] || AUTOSHARD_GPU_TESTS=1 timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/gpu \
    2>&1 | tee "$OUT/test_gpu.log" | tail -40
echo "== bench_gpu"
timeout "${BENCH_TIMEOUT:-200}" python3 -m torch.distributed.run --nproc-per-node "$ngpu" benchmarks/bench_gpu.py \
    --out "$OUT/gpu.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -20
