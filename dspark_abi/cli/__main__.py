"""``python -m dspark_abi.cli``: the ``dspark-abi`` program."""

import sys

import numpy as np

from dspark_abi.cli.main import main

if __name__ == "__main__":
    np.set_printoptions(linewidth=120)
    sys.exit(main())
