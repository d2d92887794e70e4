"""`python -m voicechat ...` is `vc-generate ...` (for environments whose scripts are not on PATH)."""

import sys

from .cli import main

sys.exit(main())
