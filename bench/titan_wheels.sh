#!/usr/bin/env bash
# torchtitan 0.2.2 for a device machine without network: the Python 3.12 wheels it needs that the
# device's image lacks, added to .whl/ (which the device command carries and .mlm/activate.sh installs).
#   bench/titan_wheels.sh        # from the project root, after the GPU stack's .whl/ is prepared
# The device image already has numpy, pandas, pyarrow, tokenizers, tensorboard, einops, pillow,
# PyYAML, safetensors, grpcio and huggingface_hub 1.x: a huggingface_hub 2.x here would break
# transformers 5.x there, and with it Megatron's imports.
set -eu
top=$(git rev-parse --show-toplevel) && cd "$top"
mkdir -p .whl
P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl --no-deps"
for p in torchtitan==0.2.2 torchdata==0.11.0 "datasets>=4,<6" "tyro>=0.9" docstring_parser typeguard "dill<0.4.2" \
         "multiprocess<0.70.20" xxhash tqdm filelock "fsspec<=2026.9.0" tomli; do
  python3 -m pip download -q $P "$p" 2>/dev/null || { echo "could not download $p" >&2; exit 1; }
done
du -sh .whl
