import sys

from prism_launch.cli import main

sys.exit(main())
