"""``python -m embstore.training CONFIG.toml [--resume] [--out DIR]``; under ``torchrun --nproc-per-node N`` each
process joins the group (gloo on CPU, nccl on GPU) and trains its shard (see ``distributed.py``)."""

import sys

from embstore.training.trainer import main

if __name__ == "__main__":
    sys.exit(main())
