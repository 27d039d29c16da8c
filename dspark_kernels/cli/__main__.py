"""``python -m dspark_kernels.cli``: the ``dspark`` command."""

import sys

from dspark_kernels.cli import main

sys.exit(main())
