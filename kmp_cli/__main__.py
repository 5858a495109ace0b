"""`python -m kmp_cli ...` is the `kmp` command, without importing kmp (or
Keras) first: `kmp bench` picks the backend before Keras is imported."""

import sys

from kmp_cli import main

sys.exit(main())
