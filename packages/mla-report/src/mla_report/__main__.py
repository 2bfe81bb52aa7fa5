"""``python -m mla_report``: the ``mla-report`` command."""

import sys

from mla_report.report import main

sys.exit(main())
