"""``python -m backend.rl CONFIG.yaml [dotted.key=value ...]`` (see ``backend.rl.cli``)."""

import sys

from backend.rl.cli import main

sys.exit(main())
