import sys

from ltm_jax.cli import main

sys.exit(main())
