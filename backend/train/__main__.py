"""``python -m backend.train CONFIG.yaml [dotted.key=value ...]`` (see ``backend.train.cli``)."""

import sys

from backend.train.cli import main

sys.exit(main())
