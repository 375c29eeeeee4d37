"""``python -m benchmarks`` is ``python -m benchmarks.run``."""
import sys

from .run import _reexec_with_malloc_settings, main

_reexec_with_malloc_settings()
sys.exit(main())
