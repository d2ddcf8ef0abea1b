import sys

from sgl_kvtier.cli import main

sys.exit(main())
