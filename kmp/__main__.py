"""`python -m kmp ...` is the `kmp` command (`kmp_cli`)."""

import sys

from kmp_cli import main

sys.exit(main())
