"""``python -m tessera <command>``: the same command line as the installed ``tessera`` entry point."""

import sys

from tessera.cli import main

sys.exit(main())
