#!/bin/bash
# The GPU checks of a session lent a GPU (the `device` tool): device-tier tests on CUDA, then bench_gpu.py.
#
# The GPU image has torch, numba, numpy, pytest and hypothesis but not rocksdict or pyuring; carry them as
# wheels (in the repository root, once per session):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl rocksdict==0.3.29 pyuring==0.3.0
# then run with carry [".whl"]:   TEST_S=240 BENCH_S=270 bash tools/gpu/run.sh all
# The package is not pip-installed there: the mapped folders are copied under embstore/ in the device's
# copy of the tree (which is thrown away), so `import embstore.tiers` works from the repository root.
what=${1:-all}
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/numba_cache
nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
for d in tiers hashing server training; do rm -rf embstore/$d; cp -r $d embstore/$d; done
export PYTHONPATH=/tmp/site:$PWD
python3 - <<'PY'
import torch, numba, numpy, embstore.training, embstore.tiers.rocksdb
print("torch", torch.__version__, "numba", numba.__version__, "numpy", numpy.__version__,
      torch.cuda.get_device_name(), "cpus", __import__("os").cpu_count())
PY
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -o addopts="-m 'not slow'" --timeout 600 \
    -W ignore::DeprecationWarning ${TESTS:-tests/test_device_resident.py tests/test_hierarchy.py tests/test_tier_conformance.py tests/test_mutation_core.py tests/test_store_model.py} 2>&1 | tee $OUT/tests.log | tail -40
  echo "tests rc ${PIPESTATUS[0]}"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout ${BENCH_S:-240} python3 tools/bench/bench_gpu.py ${BENCH_ARGS:-} 2>&1 | grep -v -i "warn\|sparse_coo_tensor" | tee $OUT/bench.log
  echo "bench rc ${PIPESTATUS[0]}"
fi
