import sys

from epmoe.cli import main

sys.exit(main())
