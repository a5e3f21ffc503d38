"""`python converters/hf_to_mcore.py SRC DST [--tp N ...]`: a HF safetensors folder (or Hub id) to a Megatron
distributed checkpoint; the same as `megarl convert --from hf --to mcore SRC DST ...` (the library code is
megarl/conversion/hf_to_mcore.py)."""

import sys

from megarl.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "--from", "hf", "--to", "mcore", *sys.argv[1:]]))
