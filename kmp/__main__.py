"""`python -m kmp ...` is the `kmp` command."""

import sys

from kmp.cli import main

sys.exit(main())
