import sys

from smcspec.cli import main

sys.exit(main())
