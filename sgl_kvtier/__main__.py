"""``python -m sgl_kvtier``: the operator commands of ``sgl_kvtier.cli``."""

import sys

from sgl_kvtier.cli import main

sys.exit(main())
