"""`python converters/mcore_to_hf.py SRC DST [--dtype bf16 ...]`: a Megatron distributed checkpoint to a HF
safetensors folder; the same as `megarl convert --from mcore --to hf SRC DST ...` (the library code is
megarl/conversion/mcore_to_hf.py)."""

import sys

from megarl.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "--from", "mcore", "--to", "hf", *sys.argv[1:]]))
