set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
for m in plain nocache nanpool; do timeout 120 python3 .scratch/dbg.py $m > $OUT/dbg_$m.log 2>&1; done
timeout 200 compute-sanitizer --tool initcheck python3 .scratch/dbg.py plain > $OUT/initcheck.log 2>&1
tail -5 $OUT/*.log
