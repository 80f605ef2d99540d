import sys

from fsdp_planner.cli import main

sys.exit(main())
