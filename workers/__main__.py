from __future__ import annotations

import sys

from workers.serving.main import main

sys.exit(main())
