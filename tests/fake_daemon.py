"""``mmad serve`` with the fake dispatching backend (tests/fake_variants.py) registered: run as
``python tests/fake_daemon.py <mmad serve arguments>`` with ``MMAD_BACKEND=fake``."""

import sys

import fake_variants

from mmad.server.main import main

if __name__ == "__main__":
    fake_variants.register()
    sys.exit(main(sys.argv[1:]))
