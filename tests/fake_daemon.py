"""``mmad serve`` with the fake dispatching backend (tests/fake_variants.py) registered: run as
``python tests/fake_daemon.py <mmad serve arguments>`` with ``MMAD_BACKEND=fake``."""

import os
import sys
import time

import fake_variants

from mmad.server.main import main


def watch_after_the_measurements_end() -> None:
    """``FAKE_WATCH_LATE=1``: the registry starts following a model's measurements only once they
    have ended, the order a measurement quicker than the model's start gives."""
    from mmad.backends.dispatch import Background
    from mmad.engine import background_dispatch

    watch = background_dispatch.watch

    def late(registry, entry) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                r.model.dispatch.done() for r in entry.replicas if isinstance(r.model.dispatch, Background)):
            time.sleep(0.01)
        watch(registry, entry)

    background_dispatch.watch = late


if __name__ == "__main__":
    fake_variants.register()
    if os.environ.get("FAKE_WATCH_LATE") == "1":
        watch_after_the_measurements_end()
    sys.exit(main(sys.argv[1:]))
