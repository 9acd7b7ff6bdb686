from __future__ import annotations

import sys

from workers.main import main

sys.exit(main())
