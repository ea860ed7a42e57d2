"""``python -m mmad.bench ARGS`` is ``mmad bench ARGS`` (for hosts where mmad is not installed)."""

import sys

from mmad.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
