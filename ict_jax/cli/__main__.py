"""``python -m ict_jax.cli.main ...`` = ``ict-jax ...``."""

import sys

from ict_jax.cli.main import main

sys.exit(main())
